// kvpack: concatenate packets into one context cache, keys realigned by rotation. No model.
#include "kv/api/pack.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/json.hpp"
#include "tool.hpp"

#include <cstdio>

int main(int argc, char** argv) {
    kv::PackOptions options;
    std::vector<std::string> inputs;
    std::string output = "-", preamble;
    bool json_report = false;
    kv::cli::Verbosity verbosity;

    auto configure = [&](CLI::App& app) {
        app.add_option("inputs", inputs,
                       "Packets in context order: FILE (all its packets, in file order) or "
                       "FILE:ID ('-': standard input)")
            ->required();
        app.add_option("-o,--output", output,
                       "Output context cache ('-': standard output, the default)");
        app.add_option("--preamble", preamble,
                       "A packet (FILE or FILE:ID) placed before all others, e.g. a baked chat "
                       "template start");
        app.add_option("--id", options.id, "Id of the packed context in the output")
            ->default_val("context");
        kv::cli::add_cache_output_options(app, options.write, json_report);
        kv::cli::add_verbosity_options(app, verbosity);
    };

    auto body = [&] {
        for (const std::string& input : inputs)
            options.inputs.push_back(kv::parse_cache_selection(input));
        if (!preamble.empty()) options.preamble = kv::parse_cache_selection(preamble);
        options.output = output;
        options.provenance = kv::cli::provenance("kvpack", argc, argv);
        const kv::PackReport report = kv::pack_caches(options);
        if (!report.index_dropped.empty() && !verbosity.quiet)
            std::fprintf(stderr, "kvpack: note: %s: the context carries no IceCache index\n",
                         report.index_dropped.c_str());
        if (json_report) {
            kv::json::Value value = kv::json::Value::object();
            kv::json::Value parts = kv::json::Value::array();
            for (const kv::PackPart& part : report.parts) {
                kv::json::Value item = kv::json::Value::object();
                item.set("file", part.file);
                item.set("id", part.id);
                item.set("offset", part.offset);
                item.set("logical_length", part.logical_length);
                item.set("stored_length", part.stored_length);
                parts.push_back(std::move(item));
            }
            value.set("packets", static_cast<int64_t>(report.parts.size()));
            value.set("logical_length", report.logical_length);
            value.set("stored_length", report.stored_length);
            value.set("bytes_read", report.bytes_read);
            value.set("indexed", report.indexed);
            value.set("seconds", report.seconds);
            value.set("parts", std::move(parts));
            kv::cli::write_report(value, output);
        } else if (verbosity.verbose) {
            std::fprintf(stderr, "kvpack: %zu packets, %lld tokens (%lld stored) in %.3f s\n",
                         report.parts.size(), static_cast<long long>(report.logical_length),
                         static_cast<long long>(report.stored_length), report.seconds);
        }
        return 0;
    };

    return kv::cli::run_tool("kvpack",
                             "Concatenate packets into one context cache, keys realigned by "
                             "rotation (no model needed)",
                             argc, argv, configure, body);
}
