// What every kv* tool shares: the common options, defined once (spelling, help text and
// environment variable), and the main wrapper that maps errors to exit codes.
//
// Exit codes: 0 success, 1 runtime or data error, 2 usage error. Errors are one line on stderr,
// "kvtool: error: ...". --help and --version print to stdout and exit 0. No tool ends on a
// signal: SIGPIPE is ignored and a failed write to stdout is an ordinary error.
//
// What a tool says on stderr, and what -q and -v change (the Reporter below applies it):
//  - errors: always, one line (run_tool);
//  - warnings, lines saying that data was dropped or skipped (kvbake's skipped documents, the
//    IceCache indexes kvpack and kvinspect compress drop) or that a checked file has a problem
//    (kvinspect check): always; -q does not silence them;
//  - progress: on a terminal one line rewritten in place, unless -q; with -v plain lines (one
//    per step) also when stderr is not a terminal;
//  - the summary line that ends a run: by default for kvbake, kvtrain and kvinspect compress,
//    only with -v for the others (kvindex, kvpack, kvinspect check, export and merge); never
//    with -q, nor when --json prints the report instead;
//  - details: more lines with -v only (kvinspect compress: one per packet).
// -q and -v exclude each other. A --json report is output asked for, not chatter: -q keeps it.
// Commands take only what changes something: kvinspect check, export and merge say nothing but
// errors and warnings unless asked, so they take -v alone (add_verbose_option); show, diff and
// plot print their results on stdout and take neither (diff -q is its own, cmp -s's quiet).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <functional>

#include <string>
#include "kv/api/report.hpp"
#include "kv/compress.hpp"
#include "kv/format/cache_writer.hpp"

namespace kv::json {
class Value;
}

namespace kv::cli {

struct ModelOptions {
    std::string model;
    std::string tokenizer;
};

struct ComputeOptions {
    int threads = 0;
    std::string device = "auto";
    std::string dtype = "auto";
    bool mmap = false;
};

struct Verbosity {
    bool quiet = false;
    bool verbose = false;
};

/// Range checks for numeric options, with messages in plain numbers that name the option:
/// "--batch-size: 0 is out of range: give a whole number from 1 to 65536". `max` of INT64_MAX
/// reads "or more"; `note` is added in parentheses (what 0 means, say).
CLI::Validator whole_number(int64_t min, int64_t max = INT64_MAX, const std::string& note = "");
/// A number, not NaN nor infinite, in [min, max] (`below_max`: [min, max)).
CLI::Validator real_number(double min, double max, bool below_max = false,
                           const std::string& note = "");
/// The most threads -t/--threads and KV_THREADS take: 8 per core of this machine, at least 16.
int thread_limit();

/// -m/--model (required when `required`) and --tokenizer.
void add_model_options(CLI::App& app, ModelOptions& options, bool required = true);
/// -t/--threads alone, for tools that run no model (environment: KV_THREADS, checked as the
/// option is and named in its messages).
void add_threads_option(CLI::App& app, int& threads);
/// -t/--threads, --device, --dtype, --mmap (environment: KV_THREADS, KV_DEVICE, KV_DTYPE).
void add_compute_options(CLI::App& app, ComputeOptions& options);
/// --zstd-level, -f/--force and --json, for tools that write a cache file.
void add_cache_output_options(CLI::App& app, CacheWriteOptions& write, bool& json_report);
/// Prints a --json report: on stdout, or on stderr when stdout carries the cache (`output` "-");
/// `indent` as json::dump's.
void write_report(const json::Value& report, const std::string& output, int indent = 2);
/// How much compression prunes and its rules' parameters (kvinspect compress, kvbake
/// --compress): --ratio, --keep-tokens, --keep-adapters, --seed, --sinks, --window-size,
/// --kernel-size, --future-positions, --sketch-dimension, --local-window. The method option is
/// the tool's own.
void add_compression_options(CLI::App& app, CompressionSettings& settings);
/// -q/--quiet and -v/--verbose (the rule above; the Reporter refuses both together).
void add_verbosity_options(CLI::App& app, Verbosity& options);
/// -v/--verbose alone, for commands that print nothing on stderr but errors and warnings unless
/// asked (so -q would change nothing): kvinspect check, export and merge.
CLI::Option* add_verbose_option(CLI::App& app, Verbosity& options);

/// When a tool's summary line is printed without --json: unless -q, or only with -v.
enum class Summary { by_default, when_verbose };

/// A tool's stderr for one run, by the rule at the top of this file: progress, warnings, the
/// summary line or the --json report, details. Every line starts with the tool's name. A
/// progress line left open on a terminal is ended before anything else is printed and when the
/// reporter goes (an error then starts on a line of its own).
class Reporter {
  public:
    /// UsageError when both -q and -v were given.
    Reporter(std::string tool, const Verbosity& verbosity, Summary summary);
    ~Reporter();
    Reporter(const Reporter&) = delete;
    Reporter& operator=(const Reporter&) = delete;

    /// One progress update (the library's progress_line).
    void progress(const ProgressLine& line);
    /// A line -q does not silence (the rule above).
    void warning(const std::string& text);
    /// A line printed only with -v.
    void detail(const std::string& text);
    /// The run's result: with `json_report` the JSON value (write_report's rule, indented by
    /// `indent`, -1 for one line), otherwise the summary line when the rule says so. `warning`
    /// is what the summary and the JSON carry that -q must not silence: printed on its own when
    /// neither is.
    void finish(const std::string& summary, bool json_report, const json::Value& report,
                const std::string& output, int indent = 2, const std::string& warning = "");
    /// The summary line when the rule says so (for commands without --json).
    void finish(const std::string& summary);

  private:
    void end_progress();
    void line(const std::string& text);
    std::string tool_;
    Verbosity verbosity_;
    Summary summary_;
    bool live_;          ///< progress rewritten in place: stderr is a terminal and not -q
    bool open_ = false;  ///< a live progress line awaits its end
};

/// Creates the app, lets `configure` add options, parses, and runs `body`, mapping CLI11 parse
/// errors and kv::UsageError to 2, every other error to 1. Returns the exit code for main.
int run_tool(const std::string& name, const std::string& description, int argc, char** argv,
             const std::function<void(CLI::App&)>& configure, const std::function<int()>& body);

/// Provenance for an output file: the tool, kvtools' version, the command line as typed (shell
/// quoting where needed) and the time, unless KV_NO_TIMESTAMP is set (byte-identical output).
Provenance provenance(const std::string& tool, int argc, char** argv);

/// Writes to stdout, throwing kv::IoError if the write fails (closed pipe, full disk).
void write_stdout(std::string_view text);

}  // namespace kv::cli
