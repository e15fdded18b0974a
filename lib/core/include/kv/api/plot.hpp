// kvinspect plot attention: where a question's attention goes over a context assembled from
// packets, per layer, drawn as SVG. KV Packet's argument in one picture: without adapters each
// packet's first token draws attention as a second sink; with them the header absorbs it.
// Torch-free header: the tool includes only this.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kv::json {
class Value;
}

namespace kv {

struct AttentionPlotOptions {
    std::filesystem::path model;
    std::optional<std::filesystem::path> tokenizer;
    std::vector<std::string> caches;  ///< FILE or FILE:ID, packed in order as kvserve-once does
    std::string prompt;               ///< the question
    std::string title;                ///< of the figure ("" : the cache arguments)
    int threads = 0;
    std::string device = "auto";
    std::string dtype = "auto";
};

/// One packet's place in the context, and the attention it receives.
struct PacketAttention {
    std::string id;
    int64_t first_slot = 0;  ///< in the context's slots (the preamble's BOS is slot 0)
    int64_t stored = 0;
    int64_t header_tokens = 0;
    int64_t trailer_tokens = 0;
    /// Per layer, the question's attention on the packet's first token (the sink spike when it
    /// has no header), on its header, its document tokens and its trailer.
    std::vector<double> first_token, header, document, trailer;
};

struct AttentionProfile {
    int64_t layers = 0;
    int64_t context_slots = 0;  ///< cached slots, preamble included
    int64_t prompt_tokens = 0;
    /// [layers][context_slots + prompt_tokens]: the attention of the prompt's tokens (averaged
    /// over them and over every query head) on each slot; each row sums to 1.
    std::vector<std::vector<double>> weights;
    std::vector<double> preamble;  ///< per layer, on the BOS put in front (0 when none)
    std::vector<double> prompt;    ///< per layer, on the prompt's own tokens
    std::vector<PacketAttention> packets;
    std::string title;
};

AttentionProfile attention_profile(const AttentionPlotOptions& options);

/// The figure: one panel per layer plus their mean, the attention per slot with packets,
/// headers and trailers shaded and each packet's first slot marked.
std::string attention_svg(const AttentionProfile& profile);

/// Per packet and layer, what attention_profile measured.
json::Value attention_json(const AttentionProfile& profile);

}  // namespace kv
