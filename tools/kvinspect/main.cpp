// kvinspect: show, check, compare, export, merge, compress and plot cache files.
#include "kv/api/inspect.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/format/cache_writer.hpp"
#include "kv/json.hpp"
#include "tool.hpp"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace {

const char* const subcommands[] = {"show", "check", "diff", "export", "merge", "compress", "plot"};

// The command as typed, for provenance: arguments joined by spaces, single-quoted where the
// shell would need it.
std::string command_line(int argc, char** argv) {
    std::string line;
    for (int i = 0; i < argc; ++i) {
        const std::string arg = argv[i];
        const bool plain =
            !arg.empty() && arg.find_first_not_of(
                                "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                "0123456789-_./=:,+@%") == std::string::npos;
        std::string quoted_arg = "'";
        for (char c : arg)
            quoted_arg += c == '\'' ? std::string("'\\''") : std::string(1, c);
        line += (i ? " " : "") + (plain ? arg : quoted_arg + "'");
    }
    return line;
}

// Replaces this process by the helper that runs the subcommands needing libtorch (compress,
// plot), which sits at KV_MODEL_HELPER_FROM_BIN relative to this program (build tree and
// installation alike), with the same arguments.
int run_model_helper(int argc, char** argv) {
    std::error_code error;
    const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", error);
    const std::filesystem::path helper =
        (error ? std::filesystem::path(argv[0]).parent_path() : self.parent_path()) /
        KV_MODEL_HELPER_FROM_BIN;
    std::vector<char*> args(argv, argv + argc);
    args.push_back(nullptr);
    ::execv(helper.c_str(), args.data());
    std::fprintf(stderr, "kvinspect: error: cannot run %s: %s\n", helper.c_str(),
                 std::strerror(errno));
    return 1;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc > 1 && (std::strcmp(argv[1], "compress") == 0 || std::strcmp(argv[1], "plot") == 0))
        return run_model_helper(argc, argv);
    // "kvinspect FILE" is "kvinspect show FILE".
    std::vector<char*> args(argv, argv + argc);
    static char show_name[] = "show";
    if (argc > 1) {
        const std::string first = argv[1];
        bool known = first == "-h" || first == "--help" || first == "--version";
        for (const char* name : subcommands)
            known = known || first == name;
        if (!known) args.insert(args.begin() + 1, show_name);
    }

    std::string show_file, diff_a, diff_b, export_input, export_to, output, packet;
    std::vector<std::string> check_files, merge_inputs;
    bool json = false, force = false, quiet = false;
    kv::cli::Verbosity verbosity;
    double tolerance = 0;
    int zstd_level = 3;
    CLI::App* show = nullptr;
    CLI::App* check = nullptr;
    CLI::App* diff = nullptr;
    CLI::App* exporter = nullptr;
    CLI::App* merge = nullptr;

    auto configure = [&](CLI::App& app) {
        app.require_subcommand(1);
        app.footer(
            "'kvinspect FILE' is 'kvinspect show FILE'. Every FILE may be '-' (standard "
            "input). See kvinspect(1) and kvcache(5).");

        show =
            app.add_subcommand("show", "Summarize a cache file: model, dtype, provenance, packets");
        show->add_option("file", show_file, "Cache file ('-': standard input)")->required();
        show->add_flag("--json", json, "Write the summary as JSON");

        check = app.add_subcommand(
            "check",
            "Verify cache files: structure, checksums of every chunk, shapes, finite values");
        check->add_option("files", check_files, "Cache files ('-': standard input)")->required();
        kv::cli::add_verbose_option(*check, verbosity);

        diff = app.add_subcommand(
            "diff",
            "Compare the packets of two cache files layer by layer (exit 0 same, 1 "
            "different, 2 error)");
        diff->add_option("a", diff_a, "First cache file")->required();
        diff->add_option("b", diff_b, "Second cache file")->required();
        diff->add_option("--tol", tolerance,
                         "Largest absolute difference still counted as equal (0: exact)")
            ->default_val(0)
            ->check(kv::cli::real_number(0, HUGE_VAL));
        diff->add_option("--packet", packet, "Compare only the packet with this id");
        diff->add_flag("-q,--quiet", quiet, "Print nothing; only the exit code tells");

        exporter = app.add_subcommand("export", "Convert a cache file to another format");
        exporter->add_option("--to", export_to, "Output format: safetensors")
            ->required()
            ->check(CLI::IsMember({"safetensors"}));
        exporter->add_option("input", export_input, "Cache file ('-': standard input)")->required();
        exporter->add_option("-o,--output", output, "Output file ('-': standard output)")
            ->required();
        exporter->add_flag("--force", force, "Write binary data even to a terminal");
        kv::cli::add_verbose_option(*exporter, verbosity);

        merge =
            app.add_subcommand("merge", "Merge cache files (shards) into one, keeping their order");
        merge->add_option("inputs", merge_inputs, "Cache files ('-': standard input, once)")
            ->required();
        merge->add_option("-o,--output", output, "Output file ('-': standard output)")->required();
        merge->add_option("--zstd-level", zstd_level, "zstd level of the output, 0 for none")
            ->default_val(3)
            ->check(kv::cli::whole_number(0, 22));
        merge->add_flag("--force", force, "Write binary data even to a terminal");
        kv::cli::add_verbose_option(*merge, verbosity);

        // Compression needs libtorch, which takes half a second to load: it lives in a helper
        // program (main() hands it the command line), so that the other subcommands start fast.
        app.add_subcommand("compress",
                           "Prune tokens per (layer, kv-head) by a kvpress scoring rule, or "
                           "quantise; see 'kvinspect compress --help'")
            ->allow_extras()
            ->prefix_command();
        app.add_subcommand("plot",
                           "Draw where a question's attention goes over a packed context (SVG); "
                           "see 'kvinspect plot attention --help'")
            ->allow_extras()
            ->prefix_command();
    };

    auto body = [&]() -> int {
        kv::cli::Reporter reporter("kvinspect", verbosity, kv::cli::Summary::when_verbose);
        if (show->parsed()) {
            const kv::CacheReader reader(show_file);
            kv::cli::write_stdout(json ? kv::json::dump(kv::describe_cache_json(reader), 2) + "\n"
                                       : kv::describe_cache_text(reader));
            return 0;
        }
        if (check->parsed()) {
            int stdin_count = 0;
            for (const std::string& file : check_files)
                stdin_count += file == "-";
            if (stdin_count > 1) throw kv::UsageError("standard input ('-') can be read only once");
            bool sound = true;
            for (const std::string& file : check_files) {
                const kv::CheckReport report = kv::check_cache(file);
                for (const std::string& problem : report.problems)
                    reporter.warning(problem);
                reporter.detail(kv::summary(report));
                sound = sound && report.problems.empty();
            }
            return sound ? 0 : 1;
        }
        if (diff->parsed()) {
            // Like cmp and h5diff: 0 same, 1 different, 2 trouble.
            try {
                kv::DiffOptions options;
                options.tolerance = tolerance;
                if (diff->count("--packet")) options.packet = packet;
                const kv::DiffReport report = kv::diff_cache_files(diff_a, diff_b, options);
                if (!quiet) kv::cli::write_stdout(kv::format_diff_report(report, tolerance));
                return report.same ? 0 : 1;
            } catch (const std::exception& error) {
                std::string message = error.what();
                message = message.substr(0, message.find('\n'));
                std::fflush(stdout);
                std::fprintf(stderr, "kvinspect: error: %s\n", message.c_str());
                return 2;
            }
        }
        if (exporter->parsed()) {
            reporter.finish(kv::summary(kv::export_safetensors(export_input, output, force)));
            return 0;
        }
        kv::CacheWriteOptions options;
        options.zstd_level = zstd_level;
        options.force = force;
        const std::vector<std::filesystem::path> inputs(merge_inputs.begin(), merge_inputs.end());
        const kv::MergeReport report = kv::merge_cache_files(
            inputs, output, {"kvinspect", KV_VERSION, command_line(argc, argv), ""}, options);
        reporter.finish(kv::summary(report, output));
        return 0;
    };

    return kv::cli::run_tool(
        "kvinspect", "Show, check, compare, export, merge, compress and plot kvtools cache files",
        static_cast<int>(args.size()), args.data(), configure, body);
}
