// kvbake: bake documents into a cache file of packets.
#include "kv/api/bake.hpp"
#include "kv/error.hpp"
#include "tool.hpp"

int main(int argc, char** argv) {
    kv::cli::ModelOptions model;
    kv::cli::ComputeOptions compute;
    kv::cli::Verbosity verbosity;
    kv::BakeOptions options;
    std::string output = "-", shard, compress_method, adapter;
    bool no_bos = false, json_report = false;
    kv::CompressionSettings compression;
    CLI::App* command = nullptr;

    auto configure = [&](CLI::App& app) {
        kv::cli::add_model_options(app, model);
        app.add_option("inputs", options.inputs,
                       "Documents: text files (one document each), '-' (stdin), or .jsonl files "
                       "with one {\"id\": ..., \"text\": ...} per line")
            ->required();
        app.add_option("-o,--output", output,
                       "Output cache file ('-': standard output, the default)");
        app.add_option("--shard", shard,
                       "Bake only documents whose ordinal modulo N is I (0 <= I < N)")
            ->check([](const std::string& text) {
                std::size_t slash = text.find('/');
                return slash == std::string::npos ? std::string("expected I/N, e.g. 0/4")
                                                  : std::string();
            });
        app.add_flag("--no-bos", no_bos, "Do not start packets with the BOS token");
        app.add_option("--adapter", adapter,
                       "Wrap every document as a KV Packet [header][document][trailer] with this "
                       "adapter file (kvtrain); packets then start with the header, not BOS");
        app.add_flag("--chat-preamble", options.chat_preamble,
                     "Also bake KV Packet's preamble, the model's chat template's start, as a "
                     "first packet 'chat-preamble' (as it is: no BOS added, no adapter), for "
                     "kvpack --preamble and kvserve-once --chat");
        app.add_option("--system", options.system,
                       "With --chat-preamble: a system message at the start of the conversation");
        app.add_option("--batch-tokens", options.batch_tokens,
                       "Most tokens per forward pass; shorter documents are packed together")
            ->default_val(512)
            ->check(kv::cli::whole_number(1, 16384));
        app.add_flag("--keep-going", options.keep_going,
                     "Skip bad documents (unreadable, malformed, not UTF-8, empty, duplicate, too "
                     "long), list them on stderr, and bake the rest");
        app.add_flag("--truncate", options.truncate,
                     "Cut documents longer than the model's context instead of refusing them");
        app.add_flag("--append", options.append,
                     "Add the packets to the store given by -o (created when absent), locking it");
        app.add_option("--compress", compress_method,
                       "Compress each packet as it is baked with this scoring rule (" +
                           kv::compression_method_names() + "), as kvinspect compress does")
            ->group("Compression");
        kv::cli::add_compression_options(app, compression);
        kv::cli::add_cache_output_options(app, options.write, json_report);
        kv::cli::add_compute_options(app, compute);
        kv::cli::add_verbosity_options(app, verbosity);
        command = &app;
    };

    auto body = [&] {
        if (!options.system.empty() && !options.chat_preamble)
            throw kv::UsageError(
                "--system is a message of the chat template: give --chat-preamble");
        options.model = model.model;
        if (!model.tokenizer.empty()) options.tokenizer = model.tokenizer;
        options.output = output;
        options.add_bos = !no_bos;
        if (!adapter.empty()) options.adapter = adapter;
        options.threads = compute.threads;
        options.device = compute.device;
        options.dtype = compute.dtype;
        options.use_mmap = compute.mmap;
        if (!shard.empty()) {
            try {
                const std::size_t slash = shard.find('/');
                std::size_t used_index = 0, used_count = 0;
                options.shard_index = std::stoll(shard.substr(0, slash), &used_index);
                options.shard_count = std::stoll(shard.substr(slash + 1), &used_count);
                if (used_index != slash || used_count != shard.size() - slash - 1)
                    throw std::invalid_argument(shard);
            } catch (const std::logic_error&) {
                throw kv::UsageError("invalid --shard '" + shard + "' (expected I/N, e.g. 0/4)");
            }
        }
        if (!compress_method.empty()) {
            compression.method = kv::parse_compression_method(compress_method);
            options.compress = compression;
        } else {
            for (const char* name : {"--ratio", "--keep-tokens", "--keep-adapters"})
                if (command->count(name))
                    throw kv::UsageError(std::string(name) + " needs --compress METHOD");
        }
        options.provenance = kv::cli::provenance("kvbake", argc, argv);
        kv::cli::Reporter reporter("kvbake", verbosity, kv::cli::Summary::by_default);
        options.progress = [&](const kv::BakeProgress& progress) {
            reporter.progress(kv::progress_line(progress));
        };
        const kv::BakeReport report = kv::bake(options);
        for (const std::string& problem : report.skipped)
            reporter.warning("skipped: " + problem);
        reporter.finish(kv::summary(report, options), json_report, kv::to_json(report, options),
                        output);
        return 0;
    };

    return kv::cli::run_tool("kvbake",
                             "Bake documents into a KV cache file, one packet per document", argc,
                             argv, configure, body);
}
