// kvtrain: learn KV Packet's header/trailer adapters for a model by self-distillation.
#include "kv/api/train.hpp"
#include "kv/error.hpp"
#include "tool.hpp"

int main(int argc, char** argv) {
    kv::cli::ModelOptions model;
    kv::cli::ComputeOptions compute;
    kv::cli::Verbosity verbosity;
    kv::TrainOptions options;
    std::string data, output, teacher_file, answer_stop = "eos";
    bool json_report = false;

    auto configure = [&](CLI::App& app) {
        kv::cli::add_model_options(app, model);
        app.add_option("--data", data,
                       "Training samples, JSONL: {\"documents\": [\"...\", ...], \"question\": "
                       "\"...\"} per line")
            ->required();
        app.add_option("-o,--output", output,
                       "Adapter file to write (a cache file; also the checkpoint --resume reads)")
            ->required();
        app.add_option("--header", options.header_tokens, "Soft tokens before each document")
            ->default_val(8)
            ->check(kv::cli::whole_number(0, 4096));
        app.add_option("--trailer", options.trailer_tokens, "Soft tokens after each document")
            ->default_val(8)
            ->check(kv::cli::whole_number(0, 4096));
        app.add_option("--epochs", options.epochs, "Passes over the samples")
            ->default_val(30)
            ->check(kv::cli::whole_number(1, 1000000));
        app.add_option("--lr", options.learning_rate,
                       "Peak learning rate of AdamW, decayed linearly to 0")
            ->default_val(5e-4)
            ->check(kv::cli::real_number(1e-12, 10));
        app.add_option("--batch", options.batch,
                       "Samples per optimizer step (gradients summed over them)")
            ->default_val(64)
            ->check(kv::cli::whole_number(1, 1 << 20));
        app.add_option("--answer-tokens", options.answer_tokens,
                       "Most tokens of the teacher's answer")
            ->default_val(32)
            ->check(kv::cli::whole_number(1, 4096));
        app.add_option("--answer-stop", answer_stop,
                       "Where the teacher's answer ends (the stop token included): at the end of "
                       "generation (eos) or at the first token with a newline (newline)")
            ->default_val("eos")
            ->check(CLI::IsMember({"eos", "newline"}));
        app.add_option("--teacher-top-k", options.teacher_top_k,
                       "Teacher log-probabilities kept per answer token, the rest pooled in one "
                       "bucket (0: the whole vocabulary)")
            ->default_val(64)
            ->check(kv::cli::whole_number(0, 1 << 24));
        app.add_option("--teacher-file", teacher_file,
                       "Where the teacher's answers are kept and reused (default: OUTPUT.teacher)");
        app.add_option("--seed", options.seed, "Seed of the initialisation and the sample order")
            ->default_val(42)
            ->check(kv::cli::whole_number(0));
        app.add_option("--checkpoint-every", options.checkpoint_every,
                       "Optimizer steps between checkpoints written to OUTPUT (0: only at the end)")
            ->default_val(10)
            ->check(kv::cli::whole_number(0));
        app.add_flag("--resume", options.resume,
                     "Continue from the checkpoint at OUTPUT (same data and settings)");
        app.add_option("--max-steps", options.max_steps,
                       "Stop after this many optimizer steps of this run (0: to the end); "
                       "--resume continues")
            ->default_val(0)
            ->check(kv::cli::whole_number(0));
        app.add_flag("--chat-preamble", options.chat_preamble,
                     "KV Packet's preamble from the model's chat template: its start before the "
                     "documents instead of BOS, the end of the user's turn and the generation "
                     "prompt after the question");
        app.add_option("--system", options.system,
                       "With --chat-preamble: a system message at the start of the conversation");
        app.add_flag("--json", json_report, "Print a JSON report on stdout");
        kv::cli::add_compute_options(app, compute);
        kv::cli::add_verbosity_options(app, verbosity);
    };

    auto body = [&] {
        if (!options.system.empty() && !options.chat_preamble)
            throw kv::UsageError(
                "--system is a message of the chat template: give --chat-preamble");
        options.model = model.model;
        if (!model.tokenizer.empty()) options.tokenizer = model.tokenizer;
        options.data = data;
        options.output = output;
        if (!teacher_file.empty()) options.teacher_file = teacher_file;
        options.answer_stop =
            answer_stop == "newline" ? kv::AnswerStop::newline : kv::AnswerStop::eos;
        options.threads = compute.threads;
        options.device = compute.device;
        options.dtype = compute.dtype;
        options.use_mmap = compute.mmap;
        options.provenance = kv::cli::provenance("kvtrain", argc, argv);
        kv::cli::Reporter reporter("kvtrain", verbosity, kv::cli::Summary::by_default);
        options.progress = [&](const kv::TrainProgress& progress) {
            reporter.progress(kv::progress_line(progress));
        };
        const kv::TrainReport report = kv::train_adapter(options);
        // The adapter file is never standard output: the JSON report goes there, on one line.
        reporter.finish(kv::summary(report), json_report, kv::to_json(report), "", -1);
        return 0;
    };

    return kv::cli::run_tool("kvtrain",
                             "Train KV Packet header/trailer adapters by self-distillation (the "
                             "model stays frozen; only the adapters learn)",
                             argc, argv, configure, body);
}
