#include "tool.hpp"

#include "kv/format/cache_writer.hpp"
#include "kv/format/quantize.hpp"

#include <memory>

#include "kv/cpu_kernels.hpp"
#include "kv/error.hpp"
#include "kv/json.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <map>
#include <thread>
#include <vector>

#include <unistd.h>

namespace kv::cli {
namespace {

// libtorch's messages carry a backtrace on the following lines; the contract is one line.
std::string first_line(const char* message) {
    std::string text = message ? message : "";
    const std::size_t end = text.find('\n');
    return end == std::string::npos ? text : text.substr(0, end);
}

void report(const std::string& name, const std::string& message) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s: error: %s\n", name.c_str(), message.c_str());
}

// What runs once an app (or subcommand) is parsed: CLI11 keeps one callback per app, and several
// option groups need one (the quantisation options, the environment's defaults).
void after_parse(CLI::App& app, std::function<void()> action) {
    static std::map<CLI::App*, std::vector<std::function<void()>>> actions;
    auto& list = actions[&app];
    list.push_back(std::move(action));
    if (list.size() == 1)
        app.final_callback([&list] {
            for (const auto& run : list)
                run();
        });
}

std::string with_thousands(int64_t value) {
    const std::string digits = std::to_string(value < 0 ? -(value + 1) + uint64_t{1} : value);
    std::string out;
    for (std::size_t i = 0; i < digits.size(); ++i) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return value < 0 ? "-" + out : out;
}

std::string whole_range_text(int64_t min, int64_t max, const std::string& note) {
    const std::string range =
        max == INT64_MAX
            ? "a whole number, " + with_thousands(min) + " or more"
            : "a whole number from " + with_thousands(min) + " to " + with_thousands(max);
    return range + (note.empty() ? "" : " (" + note + ")");
}

// "" or what is wrong with `text` as a whole number in [min, max].
std::string whole_problem(const std::string& text, int64_t min, int64_t max,
                          const std::string& note) {
    int64_t value = 0;
    const char* end = text.data() + text.size();
    const auto [stop, error] = std::from_chars(text.data(), end, value);
    const bool digits_only =
        !text.empty() && stop == end && text.find_first_not_of("-0123456789") == std::string::npos;
    if (!digits_only && error != std::errc::result_out_of_range)
        return kv::quoted(text) + " is not a whole number: give " +
               whole_range_text(min, max, note);
    if (error == std::errc::result_out_of_range || value < min || value > max)
        return (error == std::errc{} ? with_thousands(value) : kv::quoted(text)) +
               " is out of range: give " + whole_range_text(min, max, note);
    return "";
}

std::string real_text(double value) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", value);
    return text;
}

std::string real_problem(const std::string& text, double min, double max, bool below_max,
                         const std::string& note) {
    const std::string range =
        (std::isinf(max) ? "a number, " + real_text(min) + " or more"
                         : "a number from " + real_text(min) +
                               (below_max ? " to just under " : " to ") + real_text(max)) +
        (note.empty() ? "" : " (" + note + ")");
    char* end = nullptr;
    errno = 0;
    const double value = text.empty() ? 0 : std::strtod(text.c_str(), &end);
    if (text.empty() || *end != '\0' || std::isspace(static_cast<unsigned char>(text[0])) ||
        !std::isfinite(value))
        return kv::quoted(text) + " is not a number: give " + range;
    if (value < min || value > max || (below_max && value >= max))
        return text + " is out of range: give " + range;
    return "";
}

}  // namespace

CLI::Validator whole_number(int64_t min, int64_t max, const std::string& note) {
    const std::string description =
        max == INT64_MAX ? (min == 0   ? "NONNEGATIVE"
                            : min == 1 ? "POSITIVE"
                                       : ">= " + std::to_string(min))
                         : "INT in [" + std::to_string(min) + " - " + std::to_string(max) + "]";
    return CLI::Validator(
        [min, max, note](std::string& text) { return whole_problem(text, min, max, note); },
        description);
}

CLI::Validator real_number(double min, double max, bool below_max, const std::string& note) {
    const std::string description =
        "FLOAT in [" + real_text(min) + " - " + real_text(max) + (below_max ? ")" : "]");
    return CLI::Validator(
        [=](std::string& text) { return real_problem(text, min, max, below_max, note); },
        description);
}

int thread_limit() {
    return static_cast<int>(std::max(16u, 8 * std::thread::hardware_concurrency()));
}

void add_model_options(CLI::App& app, ModelOptions& options, bool required) {
    auto* model =
        app.add_option("-m,--model", options.model,
                       "Hugging Face model folder, GGUF file or llama2.c checkpoint file");
    if (required) model->required();
    app.add_option("--tokenizer", options.tokenizer,
                   "Tokenizer override: tokenizer.json, tokenizer.model, a GGUF file or a "
                   "llama2.c tok*.bin");
}

void add_cache_output_options(CLI::App& app, CacheWriteOptions& write, bool& json_report) {
    app.add_option("--zstd-level", write.zstd_level, "zstd level of the stored tensors (0: none)")
        ->default_val(3)
        ->check(whole_number(0, 19));
    app.add_flag("-f,--force", write.force, "Write binary cache data even to a terminal");
    app.add_flag("--json", json_report,
                 "Print the report as JSON: on stdout, or on stderr when stdout carries the cache");

    // Quantised storage: the three options combine once parsing is done.
    struct Raw {
        std::string name;
        int64_t group = 32;
        int64_t residual = -1;
    };
    auto raw = std::make_shared<Raw>();
    const std::string group = "Quantised storage";
    app.add_option("--quantize", raw->name,
                   "Store keys and values as int8 or int4 codes (per-group scale and offset), or "
                   "none; default: as each input packet is stored")
        ->check(CLI::IsMember({"int8", "int4", "none"}))
        ->group(group);
    app.add_option("--quant-group", raw->group,
                   "head_dim values sharing one scale and offset (divides head_dim)")
        ->default_val(32)
        ->check(whole_number(1, 65536))
        ->group(group);
    app.add_option("--residual-tokens", raw->residual,
                   "Last tokens of each head kept unquantised (default: 0 for int8, 128 for int4)")
        ->check(whole_number(0))
        ->group(group);
    CLI::App* command = &app;
    after_parse(app, [raw, &write, command] {
        if (raw->name.empty()) {
            if (command->count("--quant-group") || command->count("--residual-tokens"))
                throw CLI::ValidationError("--quant-group and --residual-tokens need --quantize");
            return;
        }
        Quantization quantization = parse_quantization(raw->name);
        if (quantization.enabled()) {
            quantization.group_size = raw->group;
            if (raw->residual >= 0) quantization.residual_tokens = raw->residual;
        }
        write.quantization = quantization;
    });
}

void write_report(const json::Value& report, const std::string& output, int indent) {
    const std::string text = json::dump(report, indent) + "\n";
    if (output == "-")
        std::fputs(text.c_str(), stderr);
    else
        write_stdout(text);
}

// The environment gives an option its value when the command line does not (CLI11's envname
// would blame the option for the variable's bad value): checked by `problem` ("" or why not),
// named in the message.
void environment_default(CLI::App& app, CLI::Option* option, const char* variable,
                         std::function<std::string(const std::string&)> problem,
                         std::function<void(const std::string&)> assign) {
    after_parse(app, [option, variable, problem, assign] {
        const char* value = std::getenv(variable);
        if (option->count() > 0 || value == nullptr || *value == '\0') return;
        const std::string why = problem(value);
        if (!why.empty())
            throw CLI::ValidationError(
                std::string(variable) + " (the default of " + option->get_name() + ")", why);
        assign(value);
    });
}

void add_threads_option(CLI::App& app, int& threads) {
    const int limit = thread_limit();
    const std::string note = "0: one per core; at most 8 per core of this machine's " +
                             std::to_string(std::thread::hardware_concurrency());
    auto* option = app.add_option("-t,--threads", threads,
                                  "CPU threads (0: one per core; environment: KV_THREADS)")
                       ->check(whole_number(0, limit, note))
                       ->default_val(0);
    environment_default(
        app, option, "KV_THREADS",
        [limit, note](const std::string& text) { return whole_problem(text, 0, limit, note); },
        [&threads](const std::string& text) { threads = std::stoi(text); });
}

void add_compute_options(CLI::App& app, ComputeOptions& options) {
    add_threads_option(app, options.threads);
    auto* device = app.add_option("--device", options.device,
                                  "auto, cpu, cuda or cuda:N (auto: cuda when available; "
                                  "environment: KV_DEVICE)")
                       ->default_val("auto");
    environment_default(
        app, device, "KV_DEVICE", [](const std::string&) { return std::string(); },
        [&options](const std::string& text) { options.device = text; });
    auto* dtype = app.add_option("--dtype", options.dtype,
                                 "auto, f32, bf16 or f16 (auto: the model's own; f32 for "
                                 "llama2.c; environment: KV_DTYPE)")
                      ->check(CLI::IsMember({"auto", "f32", "bf16", "f16"}))
                      ->default_val("auto");
    environment_default(
        app, dtype, "KV_DTYPE",
        [](const std::string& text) {
            return text == "auto" || text == "f32" || text == "bf16" || text == "f16"
                       ? std::string()
                       : kv::quoted(text) + " is not one of auto, f32, bf16, f16";
        },
        [&options](const std::string& text) { options.dtype = text; });
    app.add_flag(
        "--mmap", options.mmap,
        "Read weights in place from the mapped file instead of copying them (instant load, "
        "slower decode)");
}

void add_compression_options(CLI::App& app, CompressionSettings& settings) {
    const std::string group = "Compression";
    app.add_option("--ratio", settings.ratio,
                   "Fraction of each head's tokens pruned, in [0, 1) (kvpress's compression_ratio)")
        ->check(real_number(0, 1, true))
        ->group(group);
    app.add_option("--keep-tokens", settings.keep_tokens,
                   "Tokens each head keeps, instead of --ratio")
        ->check(whole_number(1))
        ->group(group);
    app.add_flag("--keep-adapters", settings.keep_adapters,
                 "Never prune a packet's header and trailer adapter tokens")
        ->group(group);
    app.add_option("--seed", settings.seed, "Seed of random's scores and leverage's sketch")
        ->default_val(0)
        ->check(whole_number(0))
        ->group(group);
    // The rules' parameters, each with kvpress's default; what they allocate grows with them
    // (the rules check that it fits memory).
    const struct {
        const char* name;
        int64_t CompressionSettings::*field;
        int64_t default_value;
        int64_t min, max;
        const char* help;
    } parameters[] = {
        {"--sinks", &CompressionSettings::sinks, 4, 0, int64_t{1} << 30,
         "streaming, expected, cur: first tokens always kept"},
        {"--window-size", &CompressionSettings::window_size, 64, 1, 65536,
         "snapkv: last queries whose attention scores the others"},
        {"--kernel-size", &CompressionSettings::kernel_size, 5, 1, 1001,
         "snapkv: width of the average pooling of its scores (odd)"},
        {"--future-positions", &CompressionSettings::future_positions, 512, 1, 1 << 20,
         "expected: positions its query statistics are rotated over"},
        {"--sketch-dimension", &CompressionSettings::sketch_dimension, 48, 1, 65536,
         "leverage: width of the Gaussian sketch of the keys"},
        {"--local-window", &CompressionSettings::local_window, 16, 1, int64_t{1} << 30,
         "cur: norms are normalised inside windows of this many tokens"},
    };
    for (const auto& parameter : parameters)
        app.add_option(parameter.name, settings.*parameter.field, parameter.help)
            ->default_val(parameter.default_value)
            ->check(whole_number(parameter.min, parameter.max))
            ->group(group);
}

void add_verbosity_options(CLI::App& app, Verbosity& options) {
    app.add_flag("-q,--quiet", options.quiet, "No progress or chatter on stderr");
    add_verbose_option(app, options);
}

CLI::Option* add_verbose_option(CLI::App& app, Verbosity& options) {
    return app.add_flag("-v,--verbose", options.verbose, "More chatter on stderr");
}

Reporter::Reporter(std::string tool, const Verbosity& verbosity, Summary summary)
    : tool_(std::move(tool)),
      verbosity_(verbosity),
      summary_(summary),
      live_(!verbosity.quiet && ::isatty(STDERR_FILENO)) {
    // Checked here rather than by the parser (CLI11's excludes), which would also change every
    // tool's --help, kvserve-once's included.
    if (verbosity.quiet && verbosity.verbose)
        throw UsageError("--quiet and --verbose exclude each other");
}

Reporter::~Reporter() {
    end_progress();
}

void Reporter::end_progress() {
    if (!open_) return;
    std::fputc('\n', stderr);
    open_ = false;
}

void Reporter::line(const std::string& text) {
    end_progress();
    std::fprintf(stderr, "%s: %s\n", tool_.c_str(), text.c_str());
}

void Reporter::progress(const ProgressLine& update) {
    if (live_) {
        std::fprintf(stderr, "\r%s: %s%s", tool_.c_str(), update.text.c_str(),
                     update.last ? "\n" : "");
        open_ = !update.last;
    } else if (verbosity_.verbose && update.plain) {
        std::fprintf(stderr, "%s: %s\n", tool_.c_str(), update.text.c_str());
    }
}

void Reporter::warning(const std::string& text) {
    if (!text.empty()) line(text);
}

void Reporter::detail(const std::string& text) {
    if (verbosity_.verbose) line(text);
}

void Reporter::finish(const std::string& summary) {
    end_progress();
    if (verbosity_.quiet) return;
    if (summary_ == Summary::by_default || verbosity_.verbose) line(summary);
}

void Reporter::finish(const std::string& summary, bool json_report, const json::Value& report,
                      const std::string& output, int indent, const std::string& warning) {
    end_progress();
    if (json_report) {
        write_report(report, output, indent);
    } else if (!verbosity_.quiet && (summary_ == Summary::by_default || verbosity_.verbose)) {
        line(summary);
    } else {
        this->warning(warning);
    }
}

Provenance provenance(const std::string& tool, int argc, char** argv) {
    Provenance result;
    result.tool = tool;
    result.version = KV_VERSION;
    for (int i = 0; i < argc; ++i) {
        std::string argument = argv[i];
        const bool plain =
            !argument.empty() && argument.find_first_not_of(
                                     "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                     "0123456789-_./:=,+@%") == std::string::npos;
        if (!plain) {
            std::string escaped = "'";
            for (char c : argument)
                escaped += c == '\'' ? std::string("'\\''") : std::string(1, c);
            argument = escaped + "'";
        }
        result.command_line += (i ? " " : "") + argument;
    }
    // SOURCE_DATE_EPOCH (reproducible-builds.org) pins the time; KV_NO_TIMESTAMP omits it.
    // The format's time is ISO 8601 with a four-digit year: up to 9999-12-31T23:59:59Z.
    const char* epoch = std::getenv("SOURCE_DATE_EPOCH");
    if (!std::getenv("KV_NO_TIMESTAMP")) {
        constexpr long long latest = 253402300799;
        long long pinned = -1;
        if (epoch && *epoch) {
            const std::string text = epoch;
            const bool digits =
                text.size() <= 12 && text.find_first_not_of("0123456789") == std::string::npos;
            if (digits) pinned = std::stoll(text);
            if (!digits || pinned > latest)
                throw UsageError("SOURCE_DATE_EPOCH must be a whole number of seconds from 0 to " +
                                 std::to_string(latest) + " (9999-12-31T23:59:59Z), not " +
                                 kv::quoted(text));
        }
        const std::time_t now = pinned >= 0 ? static_cast<std::time_t>(pinned) : std::time(nullptr);
        std::tm parts{};
        char text[32];
        if (!::gmtime_r(&now, &parts) ||
            std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &parts) == 0)
            throw IoError("cannot write the time " + std::to_string(static_cast<long long>(now)) +
                          " as a date (the clock is out of range)");
        result.created = text;
    }
    return result;
}

void write_stdout(std::string_view text) {
    if (text.empty()) return;
    if (std::fwrite(text.data(), 1, text.size(), stdout) != text.size() || std::fflush(stdout) != 0)
        throw IoError(std::string("cannot write to standard output: ") + std::strerror(errno));
}

int run_tool(const std::string& name, const std::string& description, int argc, char** argv,
             const std::function<void(CLI::App&)>& configure, const std::function<int()>& body) {
    std::signal(SIGPIPE, SIG_IGN);
    // Over a file size limit (ulimit -f) a write fails with EFBIG and the tool reports it and
    // removes its temporary file, instead of dying with nothing said.
    std::signal(SIGXFSZ, SIG_IGN);
    CLI::App app(description, name);
    // The kernels' instruction set: the same build computes differently on another CPU (and the
    // CLI tests choose their per-CPU expectations by it).
    app.set_version_flag("--version",
                         name + " (kvtools) " KV_VERSION "\nkernels: " + isa_name(detect_isa()));
    app.get_formatter()->column_width(34);
    try {
        configure(app);
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& help) {
        return app.exit(help);
    } catch (const CLI::CallForAllHelp& help) {
        return app.exit(help);
    } catch (const CLI::CallForVersion& version) {
        return app.exit(version);
    } catch (const CLI::ParseError& error) {
        report(name, first_line(error.what()));
        std::fprintf(stderr, "Try '%s --help' for more information.\n", name.c_str());
        return 2;
    }

    int code = 1;
    try {
        code = body();
    } catch (const UsageError& error) {
        report(name, first_line(error.what()));
        return 2;
    } catch (const std::exception& error) {
        report(name, first_line(error.what()));
        return 1;
    }
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
        report(name, std::string("cannot write to standard output: ") + std::strerror(errno));
        return 1;
    }
    return code;
}

}  // namespace kv::cli
