// kvserve-once: one-shot decoding of a prompt.
#include "kv/api/chat.hpp"
#include "kv/api/serve.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/json.hpp"
#include "kv/mapped_file.hpp"
#include "kv/output_path.hpp"
#include "kv/sparse/options.hpp"
#include "kv/text/chat_template.hpp"
#include "tool.hpp"

#include <unistd.h>
#include <ext/stdio_filebuf.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <limits>
#include <optional>

int main(int argc, char** argv) {
    kv::cli::ModelOptions model;
    kv::cli::ComputeOptions compute;
    kv::cli::Verbosity verbosity;
    kv::ServeOptions options;
    std::string prompt_file, document_file, stats_path, requests_path;
    std::vector<std::string> cache_paths;
    uint64_t seed = 0;
    uint64_t cache_memory = 0;
    int read_ahead = 2;
    bool no_bos = false;
    bool chat = false;
    std::string system;

    auto configure = [&](CLI::App& app) {
        kv::cli::add_model_options(app, model);
        app.add_option("--cache", cache_paths,
                       "Baked cache FILE or one packet FILE:ID ('-': stdin); several are packed in "
                       "order, keys realigned")
            ->take_all();
        auto* prompt = app.add_option("-p,--prompt", options.prompt, "Prompt text");
        app.add_option("-f,--prompt-file", prompt_file,
                       "Read the prompt from a file ('-' for stdin)")
            ->excludes(prompt);
        app.add_option("--document", document_file,
                       "A long document to read before the prompt ('-': stdin), instead of "
                       "--cache: prefilled layer by layer, IceCache indexing each layer as it "
                       "is done; the prompt may then be empty")
            ->excludes("--cache");
        app.add_option("--requests", requests_path,
                       "Many questions in one process: a JSONL FILE ('-': stdin), one request "
                       "{\"id\", \"prompt\", \"cache\": [\"FILE:ID\", ...], ...} a line, one "
                       "JSON answer a line on stdout; the other options are every request's "
                       "defaults");
        app.add_option("--cache-memory", cache_memory,
                       "--requests: memory for the packets kept loaded for later requests, the "
                       "least recently used dropped first (default 1G; 0: none)")
            ->transform(CLI::AsSizeValue(false));
        app.add_option("--read-ahead", read_ahead,
                       "--requests: read the packets of up to N requests already waiting in the "
                       "input on a second thread while the one before them is served (default "
                       "2; 0: each request's when it is served)")
            ->check(kv::cli::whole_number(0, 64, "more would hold packets to no purpose"));
        app.add_option("-n,--n-predict", options.max_new_tokens, "Tokens to generate at most")
            ->default_val(256)
            ->check(kv::cli::whole_number(0, 1 << 30, "generation stops at the model's context"));
        app.add_option("--temp", options.sampling.temperature,
                       "Sampling temperature; 0 is greedy and deterministic")
            ->default_val(0.8)
            ->check(kv::cli::real_number(0, 1000));
        app.add_option("--top-p", options.sampling.top_p,
                       "Nucleus sampling: keep the most likely tokens up to this mass")
            ->default_val(0.95)
            ->check(kv::cli::real_number(0, 1));
        app.add_option("--seed", seed,
                       "Random seed for sampling (default: drawn, reported by --stats)")
            ->check(kv::cli::whole_number(0));
        app.add_flag("--echo", options.echo, "Print the prompt before the continuation");
        app.add_flag("--ignore-eos", options.ignore_eos, "Do not stop at end-of-generation tokens");
        app.add_flag("--no-bos", no_bos, "Do not start the prompt with the BOS token");
        app.add_flag("--chat", chat,
                     "Wrap the prompt in the model's own chat template (tokenizer_config.json's "
                     "chat_template, or a GGUF file's) as the user's message, with the "
                     "generation prompt; with --cache or --document the template's start goes "
                     "before the context (KV Packet's preamble) and the prompt ends the user's "
                     "turn");
        app.add_option("--system", system, "With --chat: a system message first");
        app.add_option("--batch-size", options.prefill_chunk, "Prompt tokens per prefill step")
            ->default_val(512)
            ->check(kv::cli::whole_number(1, 16384));
        std::string methods_help = "Decoding attention:";
        std::vector<std::string> method_names;
        for (const kv::SparseMethodInfo& method : kv::sparse_methods()) {
            methods_help += "\n  " + method.name + ": " + method.help;
            method_names.push_back(method.name);
        }
        app.add_option("--attention", options.attention.method, methods_help)
            ->default_val("full")
            ->check(CLI::IsMember(method_names));
        app.add_option("--budget", options.attention.budget,
                       "Rows each kv head attends to in sparse layers, its query heads together: "
                       "sink, window and retrieved pages (64: 16 + 16 + 2 pages of 16; 256: 32 + "
                       "32 + 12 pages)")
            ->default_val(256)
            ->check(kv::cli::whole_number(64, 1 << 30));
        app.add_option("--dense-layers", options.attention.dense_layers,
                       "The first layers attend to every token")
            ->default_val(2)
            ->check(kv::cli::whole_number(0, 1 << 24));
        app.add_option("--reuse-layers", options.attention.reuse_layers,
                       "Consecutive sparse layers sharing one choice of pages (IceCache(r): 3)")
            ->default_val(1)
            ->check(kv::cli::whole_number(1, 1 << 24));
        app.add_option("--field-of-view", options.attention.field_of_view,
                       "IceCache: index points kept per level (0: max(tokens / 1000, 30))")
            ->default_val(0)
            ->check(kv::cli::whole_number(0, 1 << 30));
        app.add_flag("--sparse-prompt", options.sparse_prompt,
                     "Feed the prompt one token at a time through the sparse attention too, so "
                     "that no step reads the cached context densely");
        app.add_option("--offload", options.offload,
                       "Where the --cache keys and values stay while decoding: host (memory) or "
                       "disk (a temporary file, pages read as a step needs them; the prompt "
                       "then goes through the sparse attention too)")
            ->default_val("host")
            ->check(CLI::IsMember({"host", "disk"}));
        app.add_option("--offload-dir", options.offload_dir,
                       "Folder for --offload disk's temporary file (default: $TMPDIR or /tmp)")
            ->check(CLI::ExistingDirectory);
        app.add_flag("--measure-recall", options.attention.measure_recall,
                     "Also compute full attention at each step and report, per layer, the share "
                     "of its mass on the tokens attended to (in --stats)");
        app.add_option("--recompute", options.recompute.method,
                       "Recompute part of the packed --cache context before the prompt: none, "
                       "epic (each packet's first --recompute-tokens), cacheblend (the "
                       "--recompute-ratio of tokens whose keys and values deviate most at layer "
                       "1) or all (full recompute)")
            ->default_val("none")
            ->check(CLI::IsMember({"none", "epic", "cacheblend", "all"}));
        app.add_option("--recompute-ratio", options.recompute.ratio,
                       "cacheblend: the share of packet tokens recomputed after layer 1")
            ->default_val(0.3)
            ->check(kv::cli::real_number(0, 1));
        app.add_option("--recompute-tokens", options.recompute.tokens,
                       "epic: tokens recomputed at the start of each packet")
            ->default_val(32)
            ->check(kv::cli::whole_number(0, 1 << 30));
        app.add_option("--stats", stats_path,
                       "Write timings as JSON to FILE ('-': standard error, since standard output "
                       "carries the text)");
        kv::cli::add_compute_options(app, compute);
        kv::cli::add_verbosity_options(app, verbosity);
    };

    auto read_text = [](const std::string& path) {
        return path == "-" ? std::string(std::istreambuf_iterator<char>(std::cin), {})
                           : kv::read_file_text(path);
    };
    auto write_stats = [&](const kv::json::Value& value) {
        const std::string report = kv::json::dump(value, 2) + "\n";
        if (stats_path == "-")
            std::fputs(report.c_str(), stderr);
        else
            kv::write_file_atomic(stats_path, report.data(), report.size());
    };

    // --requests: the options are every request's defaults; exit 1 when a request failed.
    auto serve_requests = [&](CLI::App& app) {
        if (!document_file.empty())
            throw kv::UsageError(
                "--document is one long context for one question; --requests serves questions "
                "over --cache packets");
        if (app.count("--cache-memory") && options.offload == "disk")
            throw kv::UsageError(
                "--cache-memory keeps loaded packets in memory and --offload disk keeps them on "
                "disk: give one");
        options.caches = cache_paths;
        const auto stdin_users = std::count(cache_paths.begin(), cache_paths.end(), "-") +
                                 (prompt_file == "-") + (requests_path == "-");
        if (stdin_users > 1) throw kv::UsageError("standard input ('-') can be read only once");
        if (!prompt_file.empty()) options.prompt = read_text(prompt_file);
        kv::RequestsOptions requests;
        if (app.count("--cache-memory"))
            requests.cache_memory = static_cast<int64_t>(
                std::min<uint64_t>(cache_memory, std::numeric_limits<int64_t>::max()));
        requests.read_ahead = read_ahead;
        kv::cli::Reporter reporter("kvserve-once", verbosity, kv::cli::Summary::when_verbose);
        requests.answer = [](const kv::RequestResult& result) {
            kv::cli::write_stdout(kv::json::dump(kv::to_json(result)) + "\n");
        };
        requests.progress = [&](const kv::RequestsReport& report) {
            reporter.progress(kv::progress_line(report));
        };
        std::ifstream file;
        // Standard input through a buffer of its own (std::cin's shares stdio's and cannot tell
        // whether a line is waiting): --read-ahead reads ahead only lines already written.
        // (A duplicate descriptor: the buffer closes the one it has.)
        std::optional<__gnu_cxx::stdio_filebuf<char>> stdin_buffer;
        if (requests_path == "-") {
            const int descriptor = ::dup(STDIN_FILENO);
            if (descriptor < 0)
                throw kv::IoError(std::string("cannot read standard input: ") +
                                  std::strerror(errno));
            stdin_buffer.emplace(descriptor, std::ios::in);
        }
        std::istream standard_input(stdin_buffer ? &*stdin_buffer : std::cin.rdbuf());
        if (requests_path != "-") {
            file.open(requests_path);
            if (!file)
                throw kv::IoError("cannot open " + kv::quoted(requests_path) + ": " +
                                  std::strerror(errno));
        }
        const kv::RequestsReport report =
            kv::serve_requests(options, requests_path == "-" ? standard_input : file, requests);
        reporter.finish(kv::summary(report));
        if (!stats_path.empty()) write_stats(kv::to_json(report));
        return report.failed > 0 ? 1 : 0;
    };

    auto body = [&](CLI::App& app) {
        options.runtime = {model.model,    std::nullopt, compute.dtype,
                           compute.device, compute.mmap, compute.threads};
        if (!model.tokenizer.empty()) options.runtime.tokenizer = model.tokenizer;
        // --stats naming an input would replace it with the timings: refused before any work.
        if (!stats_path.empty() && stats_path != "-") {
            std::vector<std::filesystem::path> inputs = kv::model_input_files(model.model);
            for (const std::string& path :
                 {prompt_file, document_file, requests_path, model.tokenizer})
                if (!path.empty()) inputs.push_back(path);
            for (const std::string& spec : cache_paths)
                inputs.push_back(kv::parse_cache_selection(spec).file);
            kv::refuse_output_among_inputs(stats_path, inputs);
        }
        options.add_bos = !no_bos;
        if (app.count("--seed")) options.sampling.seed = seed;
        if (app.count("--read-ahead") && requests_path.empty())
            throw kv::UsageError(
                "--read-ahead reads the packets of later requests: it goes with "
                "--requests");
        if (app.count("--cache-memory") && requests_path.empty())
            throw kv::UsageError(
                "--cache-memory bounds the packets kept between requests: it goes with "
                "--requests");
        if (!system.empty() && !chat)
            throw kv::UsageError("--system is a message of the chat template: give --chat");
        if (chat && !requests_path.empty())
            throw kv::UsageError(
                "--chat wraps one prompt; --requests takes its prompts as they are");
        if (!requests_path.empty()) return serve_requests(app);
        if (!app.count("--prompt") && prompt_file.empty() && document_file.empty())
            throw kv::UsageError("give the prompt with --prompt TEXT or --prompt-file FILE");
        options.caches = cache_paths;
        const auto stdin_users = std::count(cache_paths.begin(), cache_paths.end(), "-") +
                                 (prompt_file == "-") + (document_file == "-");
        if (stdin_users > 1) throw kv::UsageError("standard input ('-') can be read only once");
        if (!prompt_file.empty()) options.prompt = read_text(prompt_file);
        if (!document_file.empty()) {
            options.document = read_text(document_file);
            if (options.document.empty())
                throw kv::FormatError("the document " + kv::quoted(document_file) + " is empty");
        }
        if (chat) {
            // The template writes BOS where the model wants one, as transformers'
            // apply_chat_template renders and tokenizes the conversation.
            const kv::text::ModelChatTemplate tmpl = kv::model_chat_template(
                model.model, options.runtime.tokenizer, std::nullopt, "--chat");
            if (!options.caches.empty() || !options.document.empty()) {
                // KV Packet's layout: the template's start before the context (the packets, or
                // the document), the end of the user's turn after the prompt.
                const kv::text::ChatPreamble preamble = kv::text::chat_preamble(tmpl, system);
                if (options.caches.empty())
                    options.document = preamble.before + options.document;
                else if (!kv::context_starts_with_chat_preamble(options.caches, preamble.before))
                    options.preamble = preamble.before;  // else baked: kvbake --chat-preamble
                options.prompt += preamble.after;
            } else {
                options.prompt =
                    kv::text::ChatTemplate(tmpl.source)
                        .render(kv::text::chat_variables(
                            tmpl, kv::text::chat_messages(system, options.prompt), true));
            }
            options.add_bos = false;
        }
        kv::cli::Reporter reporter("kvserve-once", verbosity, kv::cli::Summary::when_verbose);
        options.progress = [&](const kv::ServeProgress& progress) {
            reporter.progress(kv::progress_line(progress));
        };
        const kv::ServeStats stats =
            kv::serve_once(options, [](std::string_view text) { kv::cli::write_stdout(text); });
        kv::cli::write_stdout("\n");
        reporter.finish(kv::summary(stats));
        if (!stats_path.empty()) write_stats(kv::stats_to_json(stats));
        return 0;
    };

    CLI::App* app_ref = nullptr;
    return kv::cli::run_tool(
        "kvserve-once", "Decode a continuation of a prompt in one shot", argc, argv,
        [&](CLI::App& app) {
            app_ref = &app;
            configure(app);
        },
        [&] { return body(*app_ref); });
}
