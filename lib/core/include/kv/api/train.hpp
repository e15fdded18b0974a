// kvtrain: KV Packet's header/trailer adapters learnt by self-distillation.
//
// The frozen model first answers every training sample greedily from the whole context (the
// teacher: its answer and, per answer token, its most likely next tokens' log-probabilities,
// computed once and kept in a resumable teacher file). The student sees the same documents as
// separately computed packets [header][document][trailer], each from position 0 with its keys
// realigned, exactly as kvbake and kvpack build them, then the question and the teacher's
// answer; the loss is the forward KL(teacher || student) over the answer tokens, summed. Only
// the adapter learns (AdamW, linear decay to 0, gradients summed over `batch` samples).
// Torch-free header: the tool includes only this.
#pragma once

#include "kv/api/report.hpp"
#include "kv/json.hpp"
#include "kv/packet.hpp"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace kv {

/// One training sample: {"documents": ["...", ...], "question": "..."} per JSONL line (other
/// members, such as "answer", are ignored: the teacher's own answer is the target).
struct TrainSample {
    std::vector<std::string> documents;
    std::string question;
    std::string origin;  ///< "'data.jsonl' line 3", for messages
};

/// Reads samples; FormatError naming the file and line for a malformed one. `sha256`, when
/// given, receives the file's SHA-256 from the same read (what a checkpoint records).
std::vector<TrainSample> read_train_samples(const std::filesystem::path& path,
                                            std::string* sha256 = nullptr);

/// When the teacher's answer ends.
enum class AnswerStop { eos, newline };

struct TrainProgress {
    std::string phase;  ///< "teacher" (answering the samples) or "train"
    int64_t done = 0;   ///< samples answered, or optimizer steps taken
    int64_t total = 0;
    int64_t epoch = 0;  ///< training: the current epoch (from 1)
    double loss = 0;    ///< training: KL per answer token over the last step
    double seconds = 0;
};

struct TrainOptions {
    std::filesystem::path model;
    std::optional<std::filesystem::path> tokenizer;
    std::filesystem::path data;    ///< JSONL samples
    std::filesystem::path output;  ///< the adapter file (also the checkpoint)
    /// Where the teacher's answers are kept (default: OUTPUT.teacher).
    std::optional<std::filesystem::path> teacher_file;
    int64_t header_tokens = 8;
    int64_t trailer_tokens = 8;
    int64_t epochs = 30;
    double learning_rate = 5e-4;
    int64_t batch = 64;          ///< samples per optimizer step (gradient accumulation)
    int64_t answer_tokens = 32;  ///< most tokens the teacher answers with
    AnswerStop answer_stop = AnswerStop::eos;
    int64_t teacher_top_k = 64;     ///< log-probabilities kept per answer token; 0: all
    uint64_t seed = 42;             ///< initialisation and sample order
    int64_t checkpoint_every = 10;  ///< optimizer steps between checkpoints (0: only at the end)
    bool resume = false;            ///< continue from the checkpoint at `output`
    /// Stop after this many optimizer steps of this run (0: run to the end); a later --resume
    /// continues. Lets a long training run in pieces.
    int64_t max_steps = 0;
    int threads = 0;
    std::string device = "auto";
    std::string dtype = "auto";
    bool use_mmap = false;
    /// KV Packet's preamble from the model's chat template (kvtrain --chat-preamble): the
    /// template's start (BOS where it writes one, the system turn with `system`, the opening of
    /// the user's turn) before the packets instead of BOS alone, and the end of the user's turn
    /// with the generation prompt after the question, as the paper trains. Recorded in the
    /// adapter's training settings, so that --resume keeps it.
    bool chat_preamble = false;
    std::string system;  ///< with chat_preamble: a system message ("" for none)
    Provenance provenance;
    std::function<void(const TrainProgress&)> progress;
};

struct TrainReport {
    int64_t samples = 0;
    int64_t teacher_answered = 0;  ///< by this run
    int64_t teacher_reused = 0;    ///< read back from the teacher file
    int64_t answer_tokens = 0;     ///< over all samples
    int64_t steps = 0;             ///< optimizer steps done in all (with earlier runs)
    int64_t total_steps = 0;
    double first_loss = 0;  ///< KL per answer token of the first step of this run
    double last_loss = 0;   ///< and of the last
    double teacher_seconds = 0;
    double train_seconds = 0;
    std::string fingerprint;  ///< of the adapter written
};

TrainReport train_adapter(const TrainOptions& options);

/// kvtrain's progress: "teacher 12/64 samples, 30 s" (only the last of these is a plain line),
/// then "[######                  ] step 3/12 epoch 1 loss 0.5321, 45 s".
ProgressLine progress_line(const TrainProgress& progress);
/// kvtrain --json: samples, teacher_answered, teacher_reused, answer_tokens, steps, total_steps,
/// first_loss, last_loss, teacher_seconds, train_seconds, adapter_fingerprint.
json::Value to_json(const TrainReport& report);
/// kvtrain's summary line: "64 samples (64 answered, 0 reused), step 12/12, loss 0.9000 ->
/// 0.4000 per answer token, 80.0 s; adapter 0123456789ab".
std::string summary(const TrainReport& report);

}  // namespace kv
