// kvinspect compress: the subcommand of kvinspect that needs libtorch, as its own program so
// that kvinspect's other subcommands start without loading it. kvinspect runs it with its own
// command line (argv[1] is "compress"), so usage and messages read as kvinspect's.
#include "kv/compress.hpp"
#include "kv/error.hpp"
#include "kv/json.hpp"
#include "tool.hpp"

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
    kv::CompressOptions compression;
    std::string compress_method, compress_input, output;
    kv::cli::ModelOptions compress_model;
    bool compress_json = false;
    CLI::App* compress = nullptr;

    auto configure = [&](CLI::App& app) {
        app.require_subcommand(1);
        compress = app.add_subcommand(
            "compress",
            "Prune tokens per (layer, kv-head) by a kvpress scoring rule; positions are kept, so "
            "packets still pack and decode at their logical length");
        compress->add_option("--method", compress_method,
                             "Scoring rule: " + kv::compression_method_names() +
                                 " (snapkv, tova, observed and expected need -m); may be left out "
                                 "with --quantize");
        kv::cli::add_compression_options(*compress, compression.settings);
        compress
            ->add_option("--packet", compression.ids,
                         "Compress only this packet (repeatable); the others are copied")
            ->allow_extra_args(false);
        compress->add_option("input", compress_input, "Cache file ('-': standard input)")
            ->required();
        compress->add_option("-o,--output", output, "Output file ('-': standard output)")
            ->required();
        kv::cli::add_model_options(*compress, compress_model, false);
        kv::cli::add_threads_option(*compress, compression.threads);
        compress
            ->add_option("--device", compression.device,
                         "auto, cpu, cuda or cuda:N, for rules that run the model")
            ->envname("KV_DEVICE")
            ->default_val("auto");
        kv::cli::add_cache_output_options(*compress, compression.write, compress_json);
    };

    auto body = [&]() -> int {
        if (compress_method.empty()) {
            if (!compression.write.quantization)
                throw kv::UsageError("give --method (pruning), --quantize, or both");
            for (const char* name : {"--ratio", "--keep-tokens", "--keep-adapters"})
                if (compress->count(name))
                    throw kv::UsageError(std::string(name) + " needs --method");
            compression.prune = false;
        } else {
            compression.settings.method = kv::parse_compression_method(compress_method);
        }
        compression.input = compress_input;
        compression.output = output;
        if (!compress_model.model.empty()) compression.model = compress_model.model;
        if (!compress_model.tokenizer.empty()) compression.tokenizer = compress_model.tokenizer;
        compression.provenance = kv::cli::provenance("kvinspect", argc, argv);
        const kv::CompressReport report = kv::compress_cache_file(compression);
        int64_t before = 0, after = 0, per_head = 0, dropped = 0;
        kv::json::Value packets = kv::json::Value::array();
        for (const kv::CompressedPacket& line : report.packets) {
            before += line.stored_before;
            after += line.stored_after;
            per_head += line.per_head;
            dropped += line.index_dropped;
            kv::json::Value item = kv::json::Value::object();
            item.set("id", line.id);
            item.set("logical_length", line.logical_length);
            item.set("stored_before", line.stored_before);
            item.set("stored_after", line.stored_after);
            item.set("per_head", line.per_head);
            item.set("index_dropped", line.index_dropped);
            packets.push_back(item);
        }
        if (compress_json) {
            kv::json::Value value = kv::json::Value::object();
            value.set("method", report.method);
            value.set("quantization", report.quantization);
            value.set("compressed", static_cast<int64_t>(report.packets.size()));
            value.set("copied", report.copied);
            value.set("tokens_before", before);
            value.set("tokens_after", after);
            value.set("bytes_before", report.bytes_before);
            value.set("bytes_after", report.bytes_after);
            value.set("seconds", report.seconds);
            value.set("packets", packets);
            kv::cli::write_report(value, output);
        } else {
            const std::string how =
                report.method.empty() ? "stored as " + report.quantization
                : report.quantization == "none"
                    ? "with " + report.method
                    : "with " + report.method + ", stored as " + report.quantization;
            std::fprintf(stderr,
                         "kvinspect: compressed %zu packet%s %s: %lld -> %lld tokens per "
                         "head, %lld -> %lld bytes of keys and values%s%s\n",
                         report.packets.size(), report.packets.size() == 1 ? "" : "s", how.c_str(),
                         static_cast<long long>(before), static_cast<long long>(after),
                         static_cast<long long>(report.bytes_before),
                         static_cast<long long>(report.bytes_after),
                         per_head ? ", tokens chosen per head" : "",
                         dropped ? " (IceCache indexes dropped: run kvindex again)" : "");
        }
        return 0;
    };

    return kv::cli::run_tool("kvinspect",
                             "Show, check, compare, export, merge and compress kvtools cache files",
                             argc, argv, configure, body);
}
