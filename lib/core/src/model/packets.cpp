#include "kv/model/packets.hpp"

#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/model/model.hpp"
#include "kv/rope.hpp"

namespace kv {

torch::ScalarType torch_dtype(CacheDtype dtype) {
    switch (dtype) {
        case CacheDtype::f32:
            return torch::kFloat32;
        case CacheDtype::bf16:
            return torch::kBFloat16;
        case CacheDtype::f16:
            return torch::kFloat16;
    }
    return torch::kFloat32;
}

CacheDtype cache_dtype(torch::ScalarType dtype) {
    if (dtype == torch::kBFloat16) return CacheDtype::bf16;
    if (dtype == torch::kFloat16) return CacheDtype::f16;
    if (dtype == torch::kFloat32) return CacheDtype::f32;
    throw UnsupportedError(std::string("no cache dtype for ") + c10::toString(dtype));
}

void copy_cache_to_packet(const KvCache& cache, int64_t begin, int64_t count, CacheDtype dtype,
                          Packet& packet) {
    std::vector<torch::Tensor> keys, values;
    for (int64_t layer = 0; layer < cache.num_layers(); ++layer) {
        keys.push_back(cache.keys(layer).narrow(1, begin, count));
        values.push_back(cache.values(layer).narrow(1, begin, count));
    }
    auto to_bytes = [&](const std::vector<torch::Tensor>& layers, std::vector<std::byte>& out) {
        const torch::Tensor stacked =
            torch::stack(layers).to(torch::kCPU, torch_dtype(dtype)).contiguous();
        const auto* data = static_cast<const std::byte*>(stacked.data_ptr());
        out.assign(data, data + stacked.nbytes());
    };
    to_bytes(keys, packet.keys);
    to_bytes(values, packet.values);
}

torch::Tensor packet_tensor(const Packet& packet, bool keys, int64_t num_layers, int64_t kv_heads,
                            int64_t head_dim, CacheDtype dtype) {
    const std::vector<std::byte>& bytes = keys ? packet.keys : packet.values;
    const int64_t tokens = packet.stored_length();
    const std::size_t expected =
        static_cast<std::size_t>(num_layers * kv_heads * tokens * head_dim) *
        cache_dtype_size(dtype);
    if (bytes.size() != expected)
        throw FormatError("packet " + kv::quoted(packet.id) + ": " + (keys ? "keys" : "values") +
                          " hold " + std::to_string(bytes.size()) + " bytes, the shape needs " +
                          std::to_string(expected));
    return torch::from_blob(const_cast<std::byte*>(bytes.data()),
                            {num_layers, kv_heads, tokens, head_dim},
                            torch::TensorOptions().dtype(torch_dtype(dtype)));
}

namespace {

void check_positions_count(const Packet& packet) {
    if (static_cast<int64_t>(packet.positions.size()) != packet.stored_length())
        throw FormatError("packet " + kv::quoted(packet.id) + " has " +
                          std::to_string(packet.positions.size()) + " positions for " +
                          std::to_string(packet.stored_length()) + " tokens");
}

// Rotates the keys of rows [first_row, first_row + tokens) of every layer by `delta` positions
// where they lie in the cache.
void turn_landed_keys(const Rope& rope, KvCache& cache, int64_t first_row, int64_t tokens,
                      int64_t delta) {
    for (int64_t layer = 0; layer < cache.num_layers(); ++layer) {
        const torch::Tensor landed = cache.keys(layer).narrow(1, first_row, tokens);
        if (!rope.shift_in_place(landed, delta))
            landed.copy_(rope.shift(landed, delta));  // not expected: a layout it can't turn
    }
}

}  // namespace

void append_packet(const Rope& rope, KvCache& cache, const Packet& packet, CacheDtype dtype) {
    const int64_t tokens = packet.stored_length();
    check_positions_count(packet);
    const int64_t delta = cache.next_position();
    const int64_t layers = cache.num_layers(), kv_heads = cache.kv_heads(),
                  head_dim = cache.head_dim();
    const torch::Tensor keys = packet_tensor(packet, true, layers, kv_heads, head_dim, dtype);
    const torch::Tensor values = packet_tensor(packet, false, layers, kv_heads, head_dim, dtype);
    const torch::Tensor positions =
        torch::from_blob(const_cast<int64_t*>(packet.positions.data()), {tokens}, torch::kInt64) +
        delta;

    // A packet that keeps different tokens per head sits in the cache by slot: each slot at the
    // largest position any head stores there (formats/kvcache.md 6.3), which is exact for every
    // later query; padding slots are masked per head.
    std::vector<torch::Tensor> used_per_layer;
    if (packet.ragged() && static_cast<int64_t>(packet.head_lengths.size()) != layers * kv_heads)
        throw FormatError("packet " + kv::quoted(packet.id) + " has " +
                          std::to_string(packet.head_lengths.size()) + " head lengths for " +
                          std::to_string(layers * kv_heads) + " (layer, kv-head) pairs");
    if (packet.padded()) {
        const torch::Tensor lengths =
            torch::from_blob(const_cast<int64_t*>(packet.head_lengths.data()), {layers, kv_heads},
                             torch::kInt64)
                .clone();
        for (int64_t layer = 0; layer < layers; ++layer)
            used_per_layer.push_back(lengths[layer]);
    }
    // A host cache in the stored dtype takes the keys as they are and turns them where they
    // land: a rotated copy of the packet first would cost as much memory again, every page of it
    // faulted in (a 32k-token packet of a 1B model: 512 MiB). Same arithmetic, same bits.
    const bool rotate_in_cache = delta != 0 && keys.scalar_type() == cache.dtype() &&
                                 cache.device().is_cpu() && !cache.offloaded();
    std::vector<torch::Tensor> keys_per_layer, values_per_layer;
    for (int64_t layer = 0; layer < layers; ++layer) {
        // Float32 arithmetic and one rounding into the cache's dtype, as at bake time: rotated in
        // the stored dtype when the cache keeps it, else in float32 before the conversion.
        const torch::ScalarType rotate_in =
            keys.scalar_type() == cache.dtype() ? cache.dtype() : torch::kFloat32;
        keys_per_layer.push_back(delta == 0 || rotate_in_cache
                                     ? keys[layer]
                                     : rope.shift(keys[layer].to(rotate_in), delta));
        values_per_layer.push_back(values[layer]);
    }
    const int64_t first_row = cache.length();
    cache.append(keys_per_layer, values_per_layer, positions, used_per_layer);
    if (rotate_in_cache) turn_landed_keys(rope, cache, first_row, tokens, delta);
    cache.advance_to(delta + packet.logical_length);
}

bool can_read_into_cache(const CacheReader& reader, const std::string& id, const KvCache& cache) {
    return !cache.offloaded() && cache.device().is_cpu() &&
           torch_dtype(reader.model().dtype) == cache.dtype() && !reader.has_head_positions(id);
}

Packet read_packet_into_cache(const Rope& rope, const CacheReader& reader, const std::string& id,
                              KvCache& cache) {
    const KvCache::RowsAfterEnd rows = cache.rows_after_end(reader.packet_info(id).stored_length);
    PlaneTargets keys{rows.keys, rows.head_stride, {}};
    // Turned as each piece lands, on the reading threads, as append_packet turns a host cache's
    // keys of the stored dtype: the same rows through the same rotate_rows, so the same bits,
    // without a pass over all of them afterwards (32k tokens of a 1B model: 512 MiB, 0.09 s).
    const int64_t delta = cache.next_position();
    const CacheDtype dtype = cache_dtype(cache.dtype());
    const std::size_t row_bytes =
        static_cast<std::size_t>(cache.head_dim()) * cache_dtype_size(dtype);
    const RopeSettings settings{rope.layout(), cache.head_dim(), rope.inverse_frequencies()};
    if (delta != 0)
        keys.landed = [&](std::size_t layer, std::size_t head, std::size_t first,
                          std::size_t count) {
            rotate_keys(keys.plane(layer, head) + first * row_bytes, dtype, count, settings, delta);
        };
    return reader.read_into(id, keys, PlaneTargets{rows.values, rows.head_stride, {}},
                            /*with_layouts=*/false);
}

void append_packet_in_place(KvCache& cache, const Packet& packet, int64_t turned_by) {
    const int64_t tokens = packet.stored_length();
    check_positions_count(packet);
    const int64_t delta = cache.next_position();
    if (turned_by != delta)
        throw Error("packet " + kv::quoted(packet.id) + " was read to follow position " +
                    std::to_string(turned_by) + " and appended after " + std::to_string(delta));
    cache.append_written(
        torch::from_blob(const_cast<int64_t*>(packet.positions.data()), {tokens}, torch::kInt64) +
        delta);
    cache.advance_to(delta + packet.logical_length);
}

void append_packet_planes(const Rope& rope, KvCache& cache, const Packet& packet,
                          const CacheReader& reader, CacheDtype dtype) {
    const int64_t tokens = packet.stored_length();
    if (packet.ragged())
        throw UnsupportedError("packet " + kv::quoted(packet.id) +
                               " keeps different tokens per head, which an offloaded cache does "
                               "not hold yet");
    check_positions_count(packet);
    const int64_t delta = cache.next_position();
    const int64_t head_dim = cache.head_dim();
    const torch::Tensor positions =
        torch::from_blob(const_cast<int64_t*>(packet.positions.data()), {tokens}, torch::kInt64) +
        delta;
    const torch::ScalarType stored = torch_dtype(dtype);
    // As append_packet: rotated in the stored dtype when the cache keeps it, else in float32.
    const torch::ScalarType rotate_in = stored == cache.dtype() ? stored : torch::kFloat32;
    cache.begin_append(positions);
    try {
        reader.read_planes(packet.id, [&](int64_t layer, int64_t head, bool keys, int64_t first,
                                          std::span<const std::byte> bytes) {
            const auto row_bytes = static_cast<std::size_t>(head_dim) * cache_dtype_size(dtype);
            const auto rows = static_cast<int64_t>(bytes.size() / row_bytes);
            if (bytes.size() % row_bytes != 0 || first < 0 || first + rows > tokens)
                throw FormatError("packet " + kv::quoted(packet.id) + ": a piece of " +
                                  std::to_string(bytes.size()) + " bytes at token " +
                                  std::to_string(first));
            torch::Tensor piece =
                torch::from_blob(const_cast<std::byte*>(bytes.data()), {1, rows, head_dim},
                                 torch::TensorOptions().dtype(stored));
            // The shift is the same for every token: rotating a piece rotates its rows as the
            // whole plane would.
            if (keys && delta != 0) piece = rope.shift(piece.to(rotate_in), delta);
            cache.write_plane(layer, head, keys, first, piece[0].to(cache.dtype()));
            cache.release_pages(layer);
        });
    } catch (...) {
        cache.rollback();
        throw;
    }
    cache.commit();
    cache.advance_to(delta + packet.logical_length);
}

void BosRows::prefill(const Model& model, int32_t bos, KvCache& cache) {
    if (cache.length() != 0 || cache.next_position() != 0)
        throw Error("BOS goes into an empty cache");
    const bool same = model_ == &model && bos_ == bos && !keys_.empty() &&
                      keys_.front().scalar_type() == cache.dtype() &&
                      keys_.front().device() == cache.device() && !cache.offloaded();
    if (same) {
        cache.append(keys_, values_, torch::zeros({1}, torch::TensorOptions().dtype(torch::kInt64)),
                     {});
        return;
    }
    model.prefill(std::span<const int32_t>(&bos, 1), cache);
    model_ = nullptr;  // until the rows are kept
    keys_.clear();
    values_.clear();
    if (cache.offloaded()) return;
    for (int64_t layer = 0; layer < cache.num_layers(); ++layer) {
        keys_.push_back(cache.keys(layer).narrow(1, 0, 1).clone());
        values_.push_back(cache.values(layer).narrow(1, 0, 1).clone());
    }
    model_ = &model;
    bos_ = bos;
}

}  // namespace kv
