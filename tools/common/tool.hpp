// What every kv* tool shares: the common options, defined once (spelling, help text and
// environment variable), and the main wrapper that maps errors to exit codes.
//
// Exit codes: 0 success, 1 runtime or data error, 2 usage error. Errors are one line on stderr,
// "kvtool: error: ...". --help and --version print to stdout and exit 0. No tool ends on a
// signal: SIGPIPE is ignored and a failed write to stdout is an ordinary error.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

#include <string>
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

/// -m/--model (required when `required`) and --tokenizer.
void add_model_options(CLI::App& app, ModelOptions& options, bool required = true);
/// -t/--threads alone, for tools that run no model (environment: KV_THREADS).
void add_threads_option(CLI::App& app, int& threads);
/// -t/--threads, --device, --dtype, --mmap (environment: KV_THREADS, KV_DEVICE, KV_DTYPE).
void add_compute_options(CLI::App& app, ComputeOptions& options);
/// --zstd-level, -f/--force and --json, for tools that write a cache file.
void add_cache_output_options(CLI::App& app, CacheWriteOptions& write, bool& json_report);
/// Prints a --json report: on stdout, or on stderr when stdout carries the cache (`output` "-").
void write_report(const json::Value& report, const std::string& output);
/// How much compression prunes and its rules' parameters (kvinspect compress, kvbake
/// --compress): --ratio, --keep-tokens, --keep-adapters, --seed, --sinks, --window-size,
/// --kernel-size, --future-positions, --sketch-dimension, --local-window. The method option is
/// the tool's own.
void add_compression_options(CLI::App& app, CompressionSettings& settings);
/// -q/--quiet, -v/--verbose.
void add_verbosity_options(CLI::App& app, Verbosity& options);

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
