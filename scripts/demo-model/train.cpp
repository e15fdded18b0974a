// Trains kvtools' demo model: a small Llama-architecture decoder learnt on CPU from the task
// generators' text (bench/kvtasks train), with libtorch autograd through kv::Model's own
// forward pass, so the model that is trained is exactly the model the tools run.
//
// Not a user tool: scripts/train-demo-model drives it and documents the recipe. The weights are
// kept in float32 (the optimizer's master copy); each step runs the model in the compute dtype
// (bf16 by default: this CPU's bf16 matrix products are several times faster), with the cast
// inside the autograd graph so that gradients reach the master weights.
#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/model/model.hpp"
#include "kv/safetensors.hpp"
#include "kv/tokenizer.hpp"

#include <ATen/Parallel.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <CLI/CLI.hpp>

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numbers>
#include <random>
#include <sstream>

namespace fs = std::filesystem;

namespace {

struct Options {
    fs::path data, output, tokenizer_dir;
    int64_t hidden = 256, layers = 4, heads = 8, kv_heads = 2, intermediate = 640;
    double rope_theta = 10000.0;
    int64_t max_positions = 32768;
    int64_t batch = 8;
    double lr = 3e-3, min_lr_fraction = 0.1, weight_decay = 0.01, clip = 1.0;
    int64_t warmup = 50;
    double stretch_probability = 0.5, max_stretch = 16.0;
    double stretch_after = 0.3;  // share of the steps trained on true positions first
    std::string compute_dtype = "bf16", save_dtype = "bf16";
    int threads = 2;
    uint64_t seed = 1;
    int64_t checkpoint_every = 200;
    fs::path init;
};

struct Sample {
    std::vector<int32_t> tokens;  // BOS first
    std::vector<float> weights;   // loss weight of predicting tokens[i] (weights[0] unused)
};

std::vector<Sample> read_samples(const fs::path& path, const kv::Tokenizer& tokenizer) {
    std::ifstream in(path);
    if (!in) throw kv::IoError("cannot open " + kv::quoted(path.string()));
    std::vector<Sample> samples;
    std::string line;
    while (std::getline(in, line)) {
        if (line.empty()) continue;
        const kv::json::Value root = kv::json::parse(line);
        Sample sample;
        sample.tokens.push_back(tokenizer.bos_id());
        sample.weights.push_back(0.0f);
        for (const kv::json::Value& segment : root.at("segments").as_array()) {
            const std::vector<int32_t> ids = tokenizer.encode(segment[0].as_string());
            const float weight = static_cast<float>(segment[1].as_double());
            sample.tokens.insert(sample.tokens.end(), ids.begin(), ids.end());
            sample.weights.insert(sample.weights.end(), ids.size(), weight);
        }
        samples.push_back(std::move(sample));
    }
    return samples;
}

kv::ModelConfig make_config(const Options& o, const kv::Tokenizer& tokenizer) {
    kv::ModelConfig c;
    c.architecture = "LlamaForCausalLM";
    c.vocab_size = tokenizer.vocab_size();
    c.hidden_size = o.hidden;
    c.intermediate_size = o.intermediate;
    c.num_layers = o.layers;
    c.num_heads = o.heads;
    c.num_kv_heads = o.kv_heads;
    c.head_dim = o.hidden / o.heads;
    c.max_position_embeddings = o.max_positions;
    c.rms_norm_eps = 1e-5;
    c.rope_theta = o.rope_theta;
    c.tie_word_embeddings = true;
    c.bos_token_id = tokenizer.bos_id();
    c.eos_token_id = tokenizer.eos_id();
    c.weights_dtype = o.save_dtype;
    return c;
}

// GPT-2's initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2 layers).
kv::WeightMap initial_weights(const kv::ModelConfig& c) {
    kv::WeightMap w;
    const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.num_layers));
    auto normal = [](std::vector<int64_t> shape, double std) {
        return (torch::randn(shape) * std).requires_grad_();
    };
    auto ones = [](int64_t n) { return torch::ones({n}).requires_grad_(); };
    const int64_t q_dim = c.num_heads * c.head_dim, kv_dim = c.kv_dim();
    w["model.embed_tokens.weight"] = normal({c.vocab_size, c.hidden_size}, 0.02);
    w["model.norm.weight"] = ones(c.hidden_size);
    for (int64_t i = 0; i < c.num_layers; ++i) {
        const std::string p = "model.layers." + std::to_string(i) + ".";
        w[p + "input_layernorm.weight"] = ones(c.hidden_size);
        w[p + "post_attention_layernorm.weight"] = ones(c.hidden_size);
        w[p + "self_attn.q_proj.weight"] = normal({q_dim, c.hidden_size}, 0.02);
        w[p + "self_attn.k_proj.weight"] = normal({kv_dim, c.hidden_size}, 0.02);
        w[p + "self_attn.v_proj.weight"] = normal({kv_dim, c.hidden_size}, 0.02);
        w[p + "self_attn.o_proj.weight"] = normal({c.hidden_size, q_dim}, residual_std);
        w[p + "mlp.gate_proj.weight"] = normal({c.intermediate_size, c.hidden_size}, 0.02);
        w[p + "mlp.up_proj.weight"] = normal({c.intermediate_size, c.hidden_size}, 0.02);
        w[p + "mlp.down_proj.weight"] = normal({c.hidden_size, c.intermediate_size}, residual_std);
    }
    return w;
}

// Positions 0, 1, 2, ... or, for a share of the sequences, BOS at 0 and the rest spread out by
// gaps at a few random places (about one per 64 tokens) that stretch the sequence by a random
// factor. The model then sees relative distances up to max_positions while training on short
// sequences, which is what lets it retrieve beyond its training length, while almost every
// neighbouring pair stays one position apart, which is what local heads (the previous-token half
// of an induction circuit) need. A uniform stretch of every distance would deny them that.
torch::Tensor sample_positions(int64_t count, bool stretch_allowed, const Options& o,
                               std::mt19937_64& rng) {
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    torch::Tensor positions = torch::arange(count, torch::kInt64);
    if (!stretch_allowed || count < 3 || unit(rng) >= o.stretch_probability) return positions;
    const double limit = std::min(
        o.max_stretch, static_cast<double>(o.max_positions - 1) / static_cast<double>(count));
    const double stretch = 1.0 + unit(rng) * std::max(0.0, limit - 1.0);
    const auto extra = static_cast<int64_t>(static_cast<double>(count) * (stretch - 1.0));
    const int64_t gaps = std::max<int64_t>(1, count / 64);
    std::uniform_int_distribution<int64_t> where(2, count - 1);
    std::vector<int64_t> cuts(static_cast<std::size_t>(gaps)), shares(cuts.size() + 1);
    for (auto& cut : cuts)
        cut = where(rng);
    std::sort(cuts.begin(), cuts.end());
    // Split `extra` into `gaps` random shares: sorted uniform points, differences.
    std::vector<double> points(cuts.size());
    for (auto& point : points)
        point = unit(rng);
    std::sort(points.begin(), points.end());
    auto* p = positions.data_ptr<int64_t>();
    int64_t added = 0;
    std::size_t next = 0;
    for (int64_t i = 1; i < count; ++i) {
        while (next < cuts.size() && cuts[next] == i) {
            added = static_cast<int64_t>(points[next] * static_cast<double>(extra));
            ++next;
        }
        p[i] = i + added;
    }
    return positions;
}

void save_model(const fs::path& dir, const kv::ModelConfig& config, const kv::WeightMap& weights,
                const Options& o, const std::map<std::string, std::string>& metadata) {
    fs::create_directories(dir);
    const torch::ScalarType dtype = o.save_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    std::vector<torch::Tensor> keep;
    std::vector<kv::SafetensorsTensorView> views;
    for (const auto& [name, tensor] : weights) {
        keep.push_back(tensor.detach().to(dtype).contiguous());
        const torch::Tensor& t = keep.back();
        views.push_back({name, o.save_dtype == "bf16" ? "BF16" : "F32",
                         std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), t.data_ptr(),
                         t.nbytes()});
    }
    kv::write_safetensors(dir / "model.safetensors", views, metadata);
    const std::string config_text = kv::json::dump(kv::config_to_hf_json(config), 2) + "\n";
    const fs::path temporary = dir / "config.json.tmp";
    std::ofstream(temporary) << config_text;
    fs::rename(temporary, dir / "config.json");
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
        fs::copy_file(o.tokenizer_dir / name, dir / name, fs::copy_options::overwrite_existing);
}

int train(const Options& o) {
    at::set_num_threads(o.threads);
    torch::manual_seed(o.seed);
    std::mt19937_64 rng(o.seed);

    const auto tokenizer = kv::load_tokenizer(o.tokenizer_dir / "tokenizer.json");
    const std::vector<Sample> samples = read_samples(o.data, *tokenizer);
    const kv::ModelConfig config = make_config(o, *tokenizer);
    kv::validate_config(config, "demo model");
    kv::WeightMap weights = initial_weights(config);
    if (!o.init.empty()) {
        // Continue from an earlier phase: same shapes required, master weights in float32.
        kv::LoadedWeights earlier = kv::load_hf_folder(o.init);
        for (auto& [name, tensor] : weights) {
            const auto found = earlier.weights.find(name);
            if (found == earlier.weights.end() || found->second.sizes() != tensor.sizes())
                throw kv::Error("--init " + o.init.string() + ": tensor " + name +
                                " is missing or of another shape");
            tensor = found->second.to(torch::kFloat32).clone().requires_grad_();
        }
    }
    std::vector<torch::Tensor> parameters;
    int64_t parameter_count = 0;
    for (auto& [name, tensor] : weights) {
        parameters.push_back(tensor);
        parameter_count += tensor.numel();
    }
    const int64_t steps = static_cast<int64_t>(samples.size()) / o.batch;
    std::fprintf(stderr, "train: %zu samples, %lld steps of %lld, %lld parameters\n",
                 samples.size(), static_cast<long long>(steps), static_cast<long long>(o.batch),
                 static_cast<long long>(parameter_count));

    torch::optim::AdamW optimizer(
        parameters,
        torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(o.weight_decay));
    const torch::ScalarType compute =
        o.compute_dtype == "bf16" ? torch::kBFloat16 : torch::kFloat32;
    const auto started = std::chrono::steady_clock::now();
    std::ofstream log(o.output.string() + ".log.jsonl");
    int64_t tokens_seen = 0;

    for (int64_t step = 0; step < steps; ++step) {
        const double progress = static_cast<double>(step) / static_cast<double>(steps);
        double lr = o.lr * (o.min_lr_fraction + (1 - o.min_lr_fraction) * 0.5 *
                                                    (1 + std::cos(std::numbers::pi * progress)));
        if (step < o.warmup) lr = o.lr * static_cast<double>(step + 1) / o.warmup;
        for (auto& group : optimizer.param_groups())
            static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);

        optimizer.zero_grad();
        // The model is rebuilt from the master weights each step: the dtype cast is part of the
        // graph, so backward reaches the float32 tensors the optimizer owns.
        kv::LoadedWeights loaded{config, weights, "demo model", {}};
        const auto model = kv::Model::from_weights(std::move(loaded), compute, torch::kCPU, false);
        double answer_loss_sum = 0, answer_weight = 0, batch_loss = 0;
        for (int64_t b = 0; b < o.batch; ++b) {
            const Sample& sample = samples[static_cast<std::size_t>(step * o.batch + b)];
            const int64_t count = static_cast<int64_t>(sample.tokens.size()) - 1;
            const std::span<const int32_t> inputs(sample.tokens.data(),
                                                  static_cast<std::size_t>(count));
            const torch::Tensor targets =
                torch::from_blob(const_cast<int32_t*>(sample.tokens.data() + 1), {count},
                                 torch::kInt32)
                    .to(torch::kInt64);
            const torch::Tensor token_weights =
                torch::from_blob(const_cast<float*>(sample.weights.data() + 1), {count},
                                 torch::kFloat32)
                    .clone();
            const torch::Tensor positions =
                sample_positions(count, progress >= o.stretch_after, o, rng);
            const torch::Tensor hidden = model->forward_sequence(model->embed(inputs), positions);
            const torch::Tensor losses = torch::nn::functional::cross_entropy(
                model->logits(hidden), targets,
                torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));
            const torch::Tensor weighted = (losses * token_weights).sum() / token_weights.sum();
            (weighted / static_cast<double>(o.batch)).backward();
            batch_loss += weighted.item<double>() / static_cast<double>(o.batch);
            const torch::Tensor is_answer = token_weights >= 0.5;
            answer_loss_sum += losses.masked_select(is_answer).sum().item<double>();
            answer_weight += is_answer.sum().item<double>();
            tokens_seen += count;
        }
        const double norm = torch::nn::utils::clip_grad_norm_(parameters, o.clip);
        optimizer.step();

        const double seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        const double answer_loss = answer_weight > 0 ? answer_loss_sum / answer_weight : 0;
        if (step % 10 == 0 || step + 1 == steps)
            std::fprintf(stderr,
                         "step %5lld/%lld  loss %.4f  answer loss %.4f  grad %.3f  lr %.2e  "
                         "%.0f tok/s  %.0f s\n",
                         static_cast<long long>(step + 1), static_cast<long long>(steps),
                         batch_loss, answer_loss, norm, lr,
                         static_cast<double>(tokens_seen) / seconds, seconds);
        log << "{\"step\":" << step + 1 << ",\"loss\":" << batch_loss
            << ",\"answer_loss\":" << answer_loss << ",\"lr\":" << lr << ",\"seconds\":" << seconds
            << "}\n"
            << std::flush;
        if ((step + 1) % o.checkpoint_every == 0 && step + 1 < steps)
            save_model(o.output.string() + ".checkpoint", config, weights, o,
                       {{"step", std::to_string(step + 1)}});
    }
    save_model(o.output, config, weights, o,
               {{"trained_steps", std::to_string(steps)},
                {"trained_tokens", std::to_string(tokens_seen)},
                {"seed", std::to_string(o.seed)}});
    std::fprintf(stderr, "train: wrote %s\n", o.output.c_str());
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    // Keep freed activations in the heap for the next step instead of unmapping them (pages of
    // fresh mappings fault on first touch, several times a second at these sizes).
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    Options o;
    CLI::App app{"Trains kvtools' demo model (see scripts/train-demo-model)."};
    app.add_option("--data", o.data, "training JSONL from bench/kvtasks train")->required();
    app.add_option("-o,--output", o.output, "output model folder")->required();
    app.add_option("--tokenizer-dir", o.tokenizer_dir, "folder with tokenizer.json")->required();
    app.add_option("--hidden", o.hidden);
    app.add_option("--layers", o.layers);
    app.add_option("--heads", o.heads);
    app.add_option("--kv-heads", o.kv_heads);
    app.add_option("--intermediate", o.intermediate);
    app.add_option("--rope-theta", o.rope_theta);
    app.add_option("--max-positions", o.max_positions);
    app.add_option("--batch", o.batch);
    app.add_option("--lr", o.lr);
    app.add_option("--warmup", o.warmup);
    app.add_option("--weight-decay", o.weight_decay);
    app.add_option("--stretch-probability", o.stretch_probability);
    app.add_option("--max-stretch", o.max_stretch);
    app.add_option("--stretch-after", o.stretch_after,
                   "share of the steps trained before positions are stretched");
    app.add_option("--compute-dtype", o.compute_dtype)->check(CLI::IsMember({"f32", "bf16"}));
    app.add_option("--save-dtype", o.save_dtype)->check(CLI::IsMember({"f32", "bf16"}));
    app.add_option("-t,--threads", o.threads);
    app.add_option("--seed", o.seed);
    app.add_option("--checkpoint-every", o.checkpoint_every);
    app.add_option("--init", o.init,
                   "start from this model folder (an earlier phase) instead of random weights");
    CLI11_PARSE(app, argc, argv);
    try {
        return train(o);
    } catch (const std::exception& error) {
        std::fprintf(stderr, "train: error: %s\n", error.what());
        return 1;
    }
}
