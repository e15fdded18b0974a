#include "adapter_codec.hpp"

#include <cmath>
#include <tuple>

namespace kv::format {

std::string adapter_problem(const Adapter& adapter) {
    if (adapter.hidden_size <= 0) return "hidden size " + std::to_string(adapter.hidden_size);
    const std::size_t width = static_cast<std::size_t>(adapter.hidden_size);
    for (const auto* vectors : {&adapter.header, &adapter.trailer})
        if (vectors->size() % width != 0)
            return std::to_string(vectors->size()) + " values are not rows of " +
                   std::to_string(width);
    if (adapter.header.empty() && adapter.trailer.empty()) return "no soft tokens";
    for (const auto* vectors : {&adapter.header, &adapter.trailer})
        for (float value : *vectors)
            if (!std::isfinite(value)) return "a soft token holds a value that is not finite";
    if (adapter.has_optimizer_state() &&
        (adapter.header_moment.size() != adapter.header.size() ||
         adapter.header_second_moment.size() != adapter.header.size() ||
         adapter.trailer_moment.size() != adapter.trailer.size() ||
         adapter.trailer_second_moment.size() != adapter.trailer.size() ||
         adapter.optimizer_step < 0))
        return "optimizer state does not match the soft tokens";
    return "";
}

void write_adapter(const FileWriter& out, hid_t root, const Adapter& adapter,
                   const CacheWriteOptions& options) {
    Handle group = out.create_group(root, "adapter");
    const hid_t g = group.get();
    out.write_string(g, "fingerprint", adapter.fingerprint());
    out.write_integer(g, "header_tokens", adapter.header_tokens());
    out.write_integer(g, "trailer_tokens", adapter.trailer_tokens());
    out.write_integer(g, "hidden_size", adapter.hidden_size);
    out.write_double(g, "init_mean", adapter.init_mean);
    out.write_double(g, "init_std", adapter.init_std);
    out.write_string(g, "training", adapter.training);
    const hsize_t width = static_cast<hsize_t>(adapter.hidden_size);
    auto write_rows = [&](hid_t parent, const char* name, const std::vector<float>& values) {
        const hsize_t rows = values.size() / width;
        out.write_dataset(parent, name, H5T_IEEE_F32LE, H5T_NATIVE_FLOAT, {rows, width},
                          {std::max<hsize_t>(rows, 1), width}, options, true, values.data());
    };
    write_rows(g, "header", adapter.header);
    write_rows(g, "trailer", adapter.trailer);
    if (adapter.has_optimizer_state()) {
        Handle optimizer = out.create_group(g, "optimizer");
        out.write_integer(optimizer.get(), "step", adapter.optimizer_step);
        write_rows(optimizer.get(), "header_moment", adapter.header_moment);
        write_rows(optimizer.get(), "header_second_moment", adapter.header_second_moment);
        write_rows(optimizer.get(), "trailer_moment", adapter.trailer_moment);
        write_rows(optimizer.get(), "trailer_second_moment", adapter.trailer_second_moment);
    }
}

Adapter read_adapter(const FileReader& in, hid_t root) {
    Handle group = in.open_group(root, "adapter", "/adapter");
    const hid_t g = group.get();
    Adapter adapter;
    const std::string fingerprint = in.string_attribute(g, "fingerprint", "/adapter");
    const int64_t header_tokens = in.integer_attribute(g, "header_tokens", "/adapter");
    const int64_t trailer_tokens = in.integer_attribute(g, "trailer_tokens", "/adapter");
    adapter.hidden_size = in.integer_attribute(g, "hidden_size", "/adapter");
    adapter.init_mean = FileReader::has_attribute(g, "init_mean")
                            ? in.float_attribute(g, "init_mean", "/adapter")
                            : 0.0;
    adapter.init_std = FileReader::has_attribute(g, "init_std")
                           ? in.float_attribute(g, "init_std", "/adapter")
                           : 0.0;
    adapter.training = in.string_attribute_or(g, "training", "/adapter", "");
    constexpr int64_t most_tokens = 1 << 16, widest = 1 << 20;
    for (const auto& [name, value, most] :
         {std::tuple<const char*, int64_t, int64_t>{"header_tokens", header_tokens, most_tokens},
          {"trailer_tokens", trailer_tokens, most_tokens},
          {"hidden_size", adapter.hidden_size, widest}})
        if (value < 0 || value > most || (value == 0 && std::string(name) == "hidden_size"))
            in.fail("/adapter: invalid " + std::string(name) + " " + std::to_string(value));
    const hsize_t width = static_cast<hsize_t>(adapter.hidden_size);
    auto rows = [&](hid_t parent, const char* name, const std::string& where, int64_t count) {
        return in.numeric_dataset<float>(parent, name, where + "/" + name,
                                         {static_cast<hsize_t>(count), width}, H5T_NATIVE_FLOAT);
    };
    adapter.header = rows(g, "header", "/adapter", header_tokens);
    adapter.trailer = rows(g, "trailer", "/adapter", trailer_tokens);
    if (H5Lexists(g, "optimizer", H5P_DEFAULT) > 0) {
        Handle optimizer = in.open_group(g, "optimizer", "/adapter/optimizer");
        const hid_t o = optimizer.get();
        const std::string where = "/adapter/optimizer";
        adapter.optimizer_step = in.integer_attribute(o, "step", where);
        adapter.header_moment = rows(o, "header_moment", where, header_tokens);
        adapter.header_second_moment = rows(o, "header_second_moment", where, header_tokens);
        adapter.trailer_moment = rows(o, "trailer_moment", where, trailer_tokens);
        adapter.trailer_second_moment = rows(o, "trailer_second_moment", where, trailer_tokens);
    }
    H5Eclear2(H5E_DEFAULT);
    const std::string problem = adapter_problem(adapter);
    if (!problem.empty()) in.fail("/adapter: " + problem);
    if (adapter.fingerprint() != fingerprint)
        in.fail(
            "/adapter: the soft tokens do not match the adapter's fingerprint (the file is "
            "damaged)");
    return adapter;
}

}  // namespace kv::format
