// kvinspect compress and kvinspect plot: the subcommands of kvinspect that need libtorch, as
// their own program so that kvinspect's other subcommands start without loading it. kvinspect
// runs it with its own command line (argv[1] is "compress" or "plot"), so usage and messages
// read as kvinspect's.
#include "kv/api/plot.hpp"
#include "kv/compress.hpp"
#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/mapped_file.hpp"
#include "tool.hpp"

#include <string>
#include <vector>

int main(int argc, char** argv) {
    kv::CompressOptions compression;
    std::string compress_method, compress_input, output;
    kv::cli::ModelOptions compress_model;
    bool compress_json = false;
    kv::cli::Verbosity compress_verbosity;
    CLI::App* compress = nullptr;
    CLI::App* plot_attention = nullptr;
    kv::AttentionPlotOptions plot;
    kv::cli::ModelOptions plot_model;
    std::string plot_svg;
    bool plot_json = false;

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
        kv::cli::add_verbosity_options(*compress, compress_verbosity);

        CLI::App* plot_command = app.add_subcommand("plot", "Draw what a model does with a cache");
        plot_command->require_subcommand(1);
        plot_attention = plot_command->add_subcommand(
            "attention",
            "Where a question's attention goes over a context packed from packets, per layer "
            "and per packet (header, document, trailer), as SVG");
        kv::cli::add_model_options(*plot_attention, plot_model);
        plot_attention
            ->add_option("--cache", plot.caches,
                         "Packets to pack in order, FILE or FILE:ID (repeatable), as "
                         "kvserve-once --cache")
            ->required()
            ->allow_extra_args(false);
        plot_attention->add_option("--prompt", plot.prompt, "The question")->required();
        plot_attention
            ->add_option("--svg", plot_svg, "Write the figure here ('-': standard output)")
            ->required();
        plot_attention->add_option(
            "--title", plot.title,
            "Title of the figure (default: how many packets, of which files)");
        plot_attention->add_flag("--json", plot_json,
                                 "Also print the attention per packet and layer as JSON "
                                 "(on standard output, or standard error with --svg -)");
        kv::cli::add_threads_option(*plot_attention, plot.threads);
        plot_attention->add_option("--device", plot.device, "auto, cpu, cuda or cuda:N")
            ->envname("KV_DEVICE")
            ->default_val("auto");
        plot_attention->add_option("--dtype", plot.dtype, "auto, f32, bf16 or f16")
            ->envname("KV_DTYPE")
            ->default_val("auto");
    };

    auto body = [&]() -> int {
        if (plot_attention->parsed()) {
            plot.model = plot_model.model;
            if (!plot_model.tokenizer.empty()) plot.tokenizer = plot_model.tokenizer;
            const kv::AttentionProfile profile = kv::attention_profile(plot);
            const std::string svg = kv::attention_svg(profile);
            if (plot_svg == "-") {
                kv::cli::write_stdout(svg);
            } else {
                kv::write_file_atomic(plot_svg, svg.data(), svg.size());
            }
            if (plot_json) kv::cli::write_report(kv::attention_json(profile), plot_svg);
            return 0;
        }
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
        kv::cli::Reporter reporter("kvinspect", compress_verbosity, kv::cli::Summary::by_default);
        const kv::CompressReport report = kv::compress_cache_file(compression);
        reporter.finish(kv::summary(report), compress_json, kv::to_json(report), output, 2,
                        kv::warning(report));
        for (const std::string& line : kv::details(report))
            reporter.detail(line);
        return 0;
    };

    return kv::cli::run_tool(
        "kvinspect", "Show, check, compare, export, merge, compress and plot kvtools cache files",
        argc, argv, configure, body);
}
