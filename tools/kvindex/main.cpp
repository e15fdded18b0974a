// kvindex: build IceCache's DCI index and semantic pages for every packet of a cache file.
#include "kv/api/index.hpp"
#include "tool.hpp"

int main(int argc, char** argv) {
    kv::IndexOptions options;
    std::string input, output = "-";
    bool json_report = false;
    kv::cli::Verbosity verbosity;
    CLI::Option* zstd_level = nullptr;

    auto configure = [&](CLI::App& app) {
        app.add_option("input", input, "Cache file to index ('-': standard input)")->required();
        app.add_option("-o,--output", output,
                       "Indexed cache file ('-': standard output, the default; may be the input)");
        app.add_option("--page-size", options.page_size, "Slots per page")
            ->default_val(16)
            ->check(kv::cli::whole_number(2, 4096));
        app.add_option("--promotion-first", options.promotion_first,
                       "p0: share of tokens promoted to level 1")
            ->default_val(0.01)
            ->check(kv::cli::real_number(0, 1));
        app.add_option("--promotion-rest", options.promotion_rest,
                       "p1: share of each higher level promoted further")
            ->default_val(0.2)
            ->check(kv::cli::real_number(0, 1));
        app.add_option("--exact-parent-limit", options.exact_parent_limit,
                       "Search parents exactly while the level above has at most this many points "
                       "(else by a beam descent); the tokens of a packet of more take the anchor "
                       "shortcut")
            ->default_val(3000)
            ->check(kv::cli::whole_number(0, int64_t{1} << 30));
        app.add_option("--anchor-interval", options.anchor_interval,
                       "Every n-th token gets an exact parent in the anchor shortcut")
            ->default_val(120)
            ->check(kv::cli::whole_number(1, int64_t{1} << 30));
        app.add_option("--dense-layers", options.dense_layers,
                       "The first layers get no index: decoding reads them densely "
                       "(kvserve-once --dense-layers)")
            ->default_val(2)
            ->check(kv::cli::whole_number(0, 1 << 24));
        app.add_option("--reuse-layers", options.reuse_layers,
                       "Runs of sparse layers sharing one choice of pages: only the first of each "
                       "gets an index (kvserve-once --reuse-layers)")
            ->default_val(1)
            ->check(kv::cli::whole_number(1, 1 << 24));
        app.add_option("--seed", options.seed, "Seed of the projection direction")
            ->default_val(1)
            ->check(kv::cli::whole_number(0));
        app.add_flag("--keep-existing", options.keep_existing,
                     "Keep the index of packets that already have one");
        kv::cli::add_threads_option(app, options.threads);
        kv::cli::add_cache_output_options(app, options.write, json_report);
        // Unless told, the keys and values stay compressed (or not) as the input's are.
        zstd_level = app.get_option("--zstd-level");
        zstd_level->description("zstd level of the stored tensors (0: none; default: the input's)")
            ->default_str("");
        kv::cli::add_verbosity_options(app, verbosity);
    };

    auto body = [&] {
        options.input = input;
        options.output = output;
        options.zstd_level_of_input = zstd_level->count() == 0;
        options.provenance = kv::cli::provenance("kvindex", argc, argv);
        kv::cli::Reporter reporter("kvindex", verbosity, kv::cli::Summary::when_verbose);
        options.progress = [&](const kv::IndexProgress& progress) {
            reporter.progress(kv::progress_line(progress));
        };
        const kv::IndexReport report = kv::index_cache_file(options);
        reporter.finish(kv::summary(report), json_report, kv::to_json(report), output);
        return 0;
    };

    return kv::cli::run_tool("kvindex",
                             "Build IceCache's multi-level DCI index and semantic pages for every "
                             "packet of a cache file (no model needed)",
                             argc, argv, configure, body);
}
