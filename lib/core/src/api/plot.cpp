#include "kv/api/plot.hpp"

#include "context.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "kv/json.hpp"
#include "kv/memory.hpp"
#include "kv/model/attention_recorder.hpp"
#include "kv/runtime.hpp"
#include "runtime.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace kv {
namespace {

double sum_range(const std::vector<double>& values, int64_t begin, int64_t count) {
    double total = 0;
    for (int64_t i = std::max<int64_t>(begin, 0);
         i < begin + count && i < static_cast<int64_t>(values.size()); ++i)
        total += values[static_cast<std::size_t>(i)];
    return total;
}

std::string escape_xml(const std::string& text) {
    std::string out;
    for (char c : text) {
        switch (c) {
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '&':
                out += "&amp;";
                break;
            case '"':
                out += "&quot;";
                break;
            default:
                out += c;
        }
    }
    return out;
}

// Every call formats a short element; long text is appended, not formatted.
std::string format(const char* pattern, auto... args) {
    char buffer[1024];
    std::snprintf(buffer, sizeof buffer, pattern, args...);
    return buffer;
}

}  // namespace

AttentionProfile attention_profile(const AttentionPlotOptions& options) {
    if (options.caches.empty()) throw UsageError("give the context as --cache FILE[:ID]...");
    if (options.prompt.empty()) throw UsageError("the prompt (the question) must not be empty");
    set_compute_threads(options.threads);
    const Runtime runtime =
        load_runtime({options.model, options.tokenizer, options.dtype, options.device, false});
    const Model& model = *runtime.model;
    const Tokenizer& tokenizer = *runtime.tokenizer;
    const bool has_bos = tokenizer.add_bos() && tokenizer.bos_id() >= 0;
    torch::NoGradGuard no_grad;
    KvCache cache = model.new_cache(256);
    const std::vector<int32_t> prompt = tokenizer.encode(options.prompt);
    if (prompt.empty()) throw UsageError("the prompt has no tokens");
    const AssembledContext assembled =
        assemble_packets(model, tokenizer, runtime.cache_info, options.caches, has_bos,
                         static_cast<int64_t>(prompt.size()) + 1, cache);
    if (cache.has_padding())
        throw UnsupportedError(
            "the context keeps different numbers of tokens per head; plot "
            "attention reads contexts without padding");

    // The recorder computes one layer's attention in float32 as [query heads, prompt, keys] three
    // times over (the scores, masked, their softmax): a long prompt fails here, saying how much it
    // would need, not in the allocator.
    const double prompt_tokens = static_cast<double>(prompt.size());
    const double keys_seen = static_cast<double>(cache.length()) + prompt_tokens;
    require_memory(3.0 * static_cast<double>(model.config().num_heads) * prompt_tokens * keys_seen *
                       sizeof(float),
                   "plotting the attention of a prompt of " + std::to_string(prompt.size()) +
                       " tokens over " + std::to_string(cache.length()) + " context tokens");

    AttentionProfile profile;
    profile.layers = model.config().num_layers;
    profile.context_slots = cache.length();
    profile.prompt_tokens = static_cast<int64_t>(prompt.size());
    AttentionRecorder recorder(profile.layers);
    const int64_t start = cache.next_position();
    model.forward(model.embed(prompt),
                  torch::arange(start, start + profile.prompt_tokens, torch::kInt64), cache, {},
                  nullptr, &recorder);
    profile.weights = recorder.weights();
    for (const std::vector<double>& layer : profile.weights) {
        profile.preamble.push_back(assembled.bos_added ? sum_range(layer, 0, 1) : 0.0);
        profile.prompt.push_back(sum_range(layer, profile.context_slots, profile.prompt_tokens));
    }
    for (const PlacedPacket& placed : assembled.packets) {
        PacketAttention packet;
        packet.id = placed.id;
        packet.first_slot = placed.first_slot;
        packet.stored = placed.stored;
        packet.header_tokens = placed.header_tokens;
        packet.trailer_tokens = placed.trailer_tokens;
        const int64_t document = placed.stored - placed.header_tokens - placed.trailer_tokens;
        for (const std::vector<double>& layer : profile.weights) {
            packet.first_token.push_back(sum_range(layer, placed.first_slot, 1));
            packet.header.push_back(sum_range(layer, placed.first_slot, placed.header_tokens));
            packet.document.push_back(
                sum_range(layer, placed.first_slot + placed.header_tokens, document));
            packet.trailer.push_back(sum_range(
                layer, placed.first_slot + placed.header_tokens + document, placed.trailer_tokens));
        }
        profile.packets.push_back(std::move(packet));
    }
    profile.title = options.title;
    if (profile.title.empty()) {
        // "8 packets of docs.kvc": the files, not every FILE:ID argument.
        std::vector<std::string> files;
        for (const std::string& cache_argument : options.caches) {
            const std::string file = parse_cache_selection(cache_argument).file.string();
            if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
        }
        profile.title = std::to_string(profile.packets.size()) +
                        (profile.packets.size() == 1 ? " packet of " : " packets of ");
        for (std::size_t i = 0; i < files.size(); ++i)
            profile.title += (i ? ", " : "") + files[i];
    }
    return profile;
}

std::string attention_svg(const AttentionProfile& profile) {
    const int64_t slots = profile.context_slots + profile.prompt_tokens;
    const double left = 90, right = 20, top = 46, panel = 96, gap = 14, width = 980;
    const double plot_width = width - left - right;
    // Panels: every layer, then their mean.
    std::vector<std::vector<double>> panels = profile.weights;
    std::vector<std::string> names;
    for (int64_t layer = 0; layer < profile.layers; ++layer)
        names.push_back("layer " + std::to_string(layer));
    std::vector<double> mean(static_cast<std::size_t>(slots), 0.0);
    for (const std::vector<double>& layer : profile.weights)
        for (std::size_t i = 0; i < mean.size() && i < layer.size(); ++i)
            mean[i] += layer[i] / static_cast<double>(profile.weights.size());
    panels.push_back(mean);
    names.push_back("mean");
    const double height = top + static_cast<double>(panels.size()) * (panel + gap) + 40;
    auto x_of = [&](double slot) {
        return left + plot_width * slot / static_cast<double>(std::max<int64_t>(slots, 1));
    };
    const double slot_width = plot_width / static_cast<double>(std::max<int64_t>(slots, 1));

    std::string svg = format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
        "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\" font-size=\"11\">\n",
        width, height, width, height);
    svg += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
    svg += format(
               "<text x=\"%.0f\" y=\"18\" font-size=\"14\">Attention of the question (%lld "
               "tokens) over the context: ",
               left, static_cast<long long>(profile.prompt_tokens)) +
           escape_xml(profile.title.substr(0, 160)) + "</text>\n";
    svg += format(
        "<text x=\"%.0f\" y=\"34\" fill=\"#555\">mass per slot, mean over query heads and "
        "question tokens. Grey/white: packets; orange: headers; blue: trailers; red ticks: "
        "packet starts; green: the question</text>\n",
        left);
    for (std::size_t p = 0; p < panels.size(); ++p) {
        const double y0 = top + static_cast<double>(p) * (panel + gap);
        const double base = y0 + panel;
        // Backgrounds: packets alternate, adapter tokens coloured, the question green.
        for (std::size_t i = 0; i < profile.packets.size(); ++i) {
            const PacketAttention& packet = profile.packets[i];
            const double x = x_of(static_cast<double>(packet.first_slot));
            svg += format(
                "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" "
                "fill=\"%s\"/>\n",
                x, y0, slot_width * static_cast<double>(packet.stored), panel,
                i % 2 ? "#ffffff" : "#eeeeee");
            if (packet.header_tokens > 0)
                svg += format(
                    "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" "
                    "fill=\"#fdd9b5\"/>\n",
                    x, y0, slot_width * static_cast<double>(packet.header_tokens), panel);
            if (packet.trailer_tokens > 0)
                svg += format(
                    "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" "
                    "fill=\"#c6dbef\"/>\n",
                    x_of(static_cast<double>(packet.first_slot + packet.stored -
                                             packet.trailer_tokens)),
                    y0, slot_width * static_cast<double>(packet.trailer_tokens), panel);
            svg += format(
                "<line x1=\"%.2f\" y1=\"%.1f\" x2=\"%.2f\" y2=\"%.1f\" "
                "stroke=\"#d62728\" stroke-width=\"1.5\"/>\n",
                x, base, x, base + 5);
        }
        svg += format(
            "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.0f\" "
            "fill=\"#d9f0d3\"/>\n",
            x_of(static_cast<double>(profile.context_slots)), y0,
            slot_width * static_cast<double>(profile.prompt_tokens), panel);
        const std::vector<double>& values = panels[p];
        const double peak = std::max(1e-12, *std::max_element(values.begin(), values.end()));
        std::string path;
        for (std::size_t i = 0; i < values.size(); ++i) {
            if (values[i] <= 0) continue;
            const double x = x_of(static_cast<double>(i) + 0.5);
            path += format("M%.2f %.1fV%.1f", x, base, base - panel * values[i] / peak);
        }
        svg += "<path d=\"" + path + "\"" +
               format(" stroke=\"#1f3b73\" stroke-width=\"%.2f\"/>\n",
                      std::max(0.6, std::min(3.0, slot_width * 0.8)));
        svg += format("<line x1=\"%.0f\" y1=\"%.1f\" x2=\"%.0f\" y2=\"%.1f\" stroke=\"#333\"/>\n",
                      left, base, width - right, base);
        svg += format("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", left - 8,
                      y0 + panel / 2, names[p].c_str());
        svg += format(
            "<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\" fill=\"#555\">max "
            "%.3f</text>\n",
            left - 8, y0 + panel / 2 + 14, peak);
    }
    const double axis = top + static_cast<double>(panels.size()) * (panel + gap) + 6;
    for (int tick = 0; tick <= 4; ++tick) {
        const double slot = static_cast<double>(slots) * tick / 4.0;
        svg += format("<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%.0f</text>\n",
                      x_of(slot), axis + 10, slot);
    }
    svg += format(
        "<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">slot (BOS, then the "
        "packets in order, then the question)</text>\n",
        left + plot_width / 2, axis + 26);
    svg += "</svg>\n";
    return svg;
}

json::Value attention_json(const AttentionProfile& profile) {
    auto list = [](const std::vector<double>& values) {
        json::Value array = json::Value::array();
        for (double value : values)
            array.push_back(value);
        return array;
    };
    json::Value report = json::Value::object();
    report.set("layers", profile.layers);
    report.set("context_slots", profile.context_slots);
    report.set("prompt_tokens", profile.prompt_tokens);
    report.set("preamble", list(profile.preamble));
    report.set("prompt", list(profile.prompt));
    json::Value packets = json::Value::array();
    for (const PacketAttention& packet : profile.packets) {
        json::Value item = json::Value::object();
        item.set("id", packet.id);
        item.set("first_slot", packet.first_slot);
        item.set("stored", packet.stored);
        item.set("header_tokens", packet.header_tokens);
        item.set("trailer_tokens", packet.trailer_tokens);
        item.set("first_token", list(packet.first_token));
        item.set("header", list(packet.header));
        item.set("document", list(packet.document));
        item.set("trailer", list(packet.trailer));
        packets.push_back(std::move(item));
    }
    report.set("packets", std::move(packets));
    return report;
}

}  // namespace kv
