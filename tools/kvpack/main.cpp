// kvpack: concatenate packets into one context cache, keys realigned by rotation. No model.
#include "kv/api/pack.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "tool.hpp"

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
        kv::cli::Reporter reporter("kvpack", verbosity, kv::cli::Summary::when_verbose);
        const kv::PackReport report = kv::pack_caches(options);
        reporter.warning(kv::warning(report));
        reporter.finish(kv::summary(report), json_report, kv::to_json(report), output);
        return 0;
    };

    return kv::cli::run_tool("kvpack",
                             "Concatenate packets into one context cache, keys realigned by "
                             "rotation (no model needed)",
                             argc, argv, configure, body);
}
