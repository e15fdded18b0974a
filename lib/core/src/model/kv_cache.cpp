#include "kv/model/kv_cache.hpp"

#include "kv/error.hpp"
#include "kv/memory.hpp"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace kv {

namespace {

// to.copy_(from) for rows the cache takes on the host, [heads, tokens, dim] of one dtype with
// their dims' elements next to each other: row by row with memcpy. libtorch's copy_ costs a few
// microseconds of dispatch and TensorIterator per call, and a decoding step makes two per layer
// (a twentieth of the demo model's step). False, copying nothing, where copy_ must do it: other
// devices, dtypes or layouts, overlapping memory, or a source autograd records.
bool copy_rows_on_host(const torch::Tensor& to, const torch::Tensor& from) {
    if (!to.device().is_cpu() || !from.device().is_cpu() || to.dim() != 3 || from.dim() != 3 ||
        to.scalar_type() != from.scalar_type() || to.sizes() != from.sizes() || to.stride(2) != 1 ||
        from.stride(2) != 1 || to.is_conj() || from.is_conj() || to.is_neg() || from.is_neg())
        return false;
    if (from.requires_grad() && at::GradMode::is_enabled()) return false;
    const int64_t heads = from.size(0), tokens = from.size(1), dim = from.size(2);
    if (heads == 0 || tokens == 0 || dim == 0) return true;
    const auto element = static_cast<int64_t>(from.element_size());
    auto* target = static_cast<char*>(to.data_ptr());
    const auto* source = static_cast<const char*>(from.data_ptr());
    auto extent = [&](const torch::Tensor& t) {
        return ((heads - 1) * t.stride(0) + (tokens - 1) * t.stride(1) + dim) * element;
    };
    if (target < source + extent(from) && source < target + extent(to)) return false;
    const auto row_bytes = static_cast<std::size_t>(dim * element);
    for (int64_t head = 0; head < heads; ++head) {
        char* to_head = target + head * to.stride(0) * element;
        const char* from_head = source + head * from.stride(0) * element;
        if (to.stride(1) == dim && from.stride(1) == dim) {
            std::memcpy(to_head, from_head, static_cast<std::size_t>(tokens) * row_bytes);
            continue;
        }
        for (int64_t token = 0; token < tokens; ++token)
            std::memcpy(to_head + token * to.stride(1) * element,
                        from_head + token * from.stride(1) * element, row_bytes);
    }
    return true;
}

void write_rows(const torch::Tensor& to, const torch::Tensor& from) {
    if (!copy_rows_on_host(to, from)) to.copy_(from);
}

}  // namespace

KvCache::KvCache(int64_t num_layers, int64_t kv_heads, int64_t head_dim, torch::ScalarType dtype,
                 torch::Device device, int64_t capacity)
    : kv_heads_(kv_heads),
      head_dim_(head_dim),
      dtype_(dtype),
      device_(device),
      keys_(static_cast<std::size_t>(num_layers)),
      values_(static_cast<std::size_t>(num_layers)) {
    reserve(std::max<int64_t>(capacity, 1));
}

KvCache KvCache::on_disk(int64_t num_layers, int64_t kv_heads, int64_t head_dim,
                         torch::ScalarType dtype, int64_t capacity,
                         const std::filesystem::path& folder) {
    capacity = std::max<int64_t>(capacity, 1);
    KvCache cache(num_layers, kv_heads, head_dim, dtype, torch::kCPU, 1);
    auto arena = std::make_shared<FileArena>(folder);
    require_disk_space(2.0 * static_cast<double>(num_layers) * static_cast<double>(kv_heads) *
                           static_cast<double>(capacity) * static_cast<double>(head_dim) *
                           static_cast<double>(c10::elementSize(dtype)),
                       folder, "a KV cache of " + std::to_string(capacity) + " tokens on disk");
    const std::size_t plane_bytes = static_cast<std::size_t>(kv_heads * capacity * head_dim) *
                                    static_cast<std::size_t>(c10::elementSize(dtype));
    const auto options = torch::TensorOptions().dtype(dtype).device(torch::kCPU);
    for (int64_t layer = 0; layer < num_layers; ++layer) {
        // A region per layer, so that releasing one leaves the others alone.
        const auto [region, offset] = arena->allocate(2 * plane_bytes);
        cache.layer_regions_.push_back(region);
        cache.layer_offsets_.push_back(offset);
        auto keep = [arena](void*) {};  // the tensors keep the file mapped
        cache.keys_[static_cast<std::size_t>(layer)] =
            torch::from_blob(region.data(), {kv_heads, capacity, head_dim}, keep, options);
        cache.values_[static_cast<std::size_t>(layer)] = torch::from_blob(
            region.data() + plane_bytes, {kv_heads, capacity, head_dim}, keep, options);
    }
    cache.positions_ = torch::empty({capacity}, torch::kInt64);
    cache.capacity_ = capacity;
    cache.arena_ = std::move(arena);
    cache.folder_ = folder;
    return cache;
}

void KvCache::release_pages(int64_t layer) {
    // On a shared mapping this only unmaps: written data stays in the file.
    if (layer >= 0 && static_cast<std::size_t>(layer) < layer_regions_.size()) {
        const std::span<std::byte> region = layer_regions_[static_cast<std::size_t>(layer)];
        drop_mapped_file_pages(region.data(), region.size());
    } else if (layer < 0) {
        for (const std::span<std::byte>& region : layer_regions_)
            drop_mapped_file_pages(region.data(), region.size());
    }
}

void KvCache::gather(int64_t layer, int64_t head, std::span<const int64_t> rows, void* keys_out,
                     void* values_out) const {
    for (int64_t row : rows)
        if (row < 0 || row >= visible())
            throw Error("kv cache: gather of row " + std::to_string(row) + " of " +
                        std::to_string(visible()));
    const auto row_bytes = static_cast<std::size_t>(head_dim_ * c10::elementSize(dtype_));
    for (std::size_t i = 0; i < rows.size();) {
        std::size_t run = 1;  // consecutive rows are read at once
        while (i + run < rows.size() && rows[i + run] == rows[i] + static_cast<int64_t>(run))
            ++run;
        copy_rows(layer, head, rows[i], static_cast<int64_t>(run),
                  keys_out ? static_cast<std::byte*>(keys_out) + i * row_bytes : nullptr,
                  values_out ? static_cast<std::byte*>(values_out) + i * row_bytes : nullptr);
        i += run;
    }
}

void KvCache::gather_range(int64_t layer, int64_t head, int64_t first, int64_t count,
                           void* keys_out, void* values_out) const {
    if (first < 0 || count < 0 || first + count > visible())
        throw Error("kv cache: gather of rows " + std::to_string(first) + "+" +
                    std::to_string(count) + " of " + std::to_string(visible()));
    copy_rows(layer, head, first, count, keys_out, values_out);
}

void KvCache::copy_rows(int64_t layer, int64_t head, int64_t first, int64_t count, void* keys_out,
                        void* values_out) const {
    const auto row_bytes = static_cast<std::size_t>(head_dim_ * c10::elementSize(dtype_));
    const std::size_t bytes = static_cast<std::size_t>(count) * row_bytes;
    for (const bool keys : {true, false}) {
        void* out = keys ? keys_out : values_out;
        if (!out || count == 0) continue;
        if (!arena_) {
            // A cache on a GPU copies its rows to the host first (a no-op on the CPU).
            const torch::Tensor plane = (keys ? keys_ : values_)
                                            .at(static_cast<std::size_t>(layer))[head]
                                            .narrow(0, first, count)
                                            .to(torch::kCPU)
                                            .contiguous();
            std::memcpy(out, plane.data_ptr(), bytes);
            continue;
        }
        const std::size_t plane_bytes = static_cast<std::size_t>(kv_heads_ * capacity_) * row_bytes;
        const std::size_t base = layer_offsets_.at(static_cast<std::size_t>(layer)) +
                                 (keys ? 0 : plane_bytes) +
                                 static_cast<std::size_t>(head * capacity_) * row_bytes;
        arena_->read(base + static_cast<std::size_t>(first) * row_bytes, bytes, out);
    }
}

torch::Tensor KvCache::read_keys(int64_t layer, int64_t head, int64_t first, int64_t count) const {
    if (!arena_)
        return keys(layer)[head]
            .narrow(0, first, count)
            .to(torch::kCPU, torch::kFloat32)
            .contiguous();
    const torch::Tensor raw = torch::empty({count, head_dim_}, dtype_);
    gather_range(layer, head, first, count, raw.data_ptr(), nullptr);
    return raw.to(torch::kFloat32).contiguous();
}

torch::Tensor KvCache::gather_keys(int64_t layer, int64_t head,
                                   std::span<const int64_t> rows) const {
    const auto count = static_cast<int64_t>(rows.size());
    if (!arena_) {
        const torch::Tensor index =
            torch::from_blob(const_cast<int64_t*>(rows.data()), {count}, torch::kInt64).to(device_);
        return keys(layer)[head]
            .index_select(0, index)
            .to(torch::kCPU, torch::kFloat32)
            .contiguous();
    }
    const torch::Tensor raw = torch::empty({count, head_dim_}, dtype_);
    gather(layer, head, rows, raw.data_ptr(), nullptr);
    return raw.to(torch::kFloat32).contiguous();
}

std::unique_ptr<FileArena> KvCache::new_spill_file() const {
    return arena_ ? std::make_unique<FileArena>(folder_) : nullptr;
}

int64_t KvCache::offloaded_bytes() const {
    return arena_ ? static_cast<int64_t>(arena_->size()) : 0;
}

void KvCache::write_plane(int64_t layer, int64_t head, bool keys, int64_t first,
                          const torch::Tensor& rows) {
    const int64_t count = rows.size(0);
    if (first < 0 || first + count > pending_)
        throw Error("kv cache: write of pending tokens [" + std::to_string(first) + ", " +
                    std::to_string(first + count) + ") of a head, " + std::to_string(pending_) +
                    " pending");
    (keys ? keys_ : values_)
        .at(static_cast<std::size_t>(layer))[head]
        .narrow(0, length_ + first, count)
        .copy_(rows);
    if (!valid_.empty())
        valid_[static_cast<std::size_t>(layer)][head].narrow(0, length_ + first, count).fill_(true);
}

void KvCache::reserve(int64_t capacity) {
    if (capacity <= capacity_) return;
    if (arena_)
        throw UnsupportedError("the cache offloaded to disk was made for " +
                               std::to_string(capacity_) + " tokens; " + std::to_string(capacity) +
                               " do not fit");
    // Fail with the size, not with the allocator's message (a huge -n, say).
    if (device_.is_cpu())
        require_memory(2.0 * static_cast<double>(keys_.size()) * static_cast<double>(kv_heads_) *
                           static_cast<double>(capacity) * static_cast<double>(head_dim_) *
                           static_cast<double>(c10::elementSize(dtype_)),
                       "a KV cache of " + std::to_string(capacity) + " tokens");
    const auto options = torch::TensorOptions().dtype(dtype_).device(device_);
    for (std::size_t layer = 0; layer < keys_.size(); ++layer) {
        torch::Tensor keys = torch::empty({kv_heads_, capacity, head_dim_}, options);
        torch::Tensor values = torch::empty({kv_heads_, capacity, head_dim_}, options);
        if (visible() > 0) {
            keys.narrow(1, 0, visible()).copy_(keys_[layer].narrow(1, 0, visible()));
            values.narrow(1, 0, visible()).copy_(values_[layer].narrow(1, 0, visible()));
        }
        keys_[layer] = keys;
        values_[layer] = values;
        if (!valid_.empty()) {
            torch::Tensor valid = torch::ones(
                {kv_heads_, capacity}, torch::TensorOptions().dtype(torch::kBool).device(device_));
            if (visible() > 0)
                valid.narrow(1, 0, visible()).copy_(valid_[layer].narrow(1, 0, visible()));
            valid_[layer] = valid;
        }
    }
    torch::Tensor positions =
        torch::empty({capacity}, torch::TensorOptions().dtype(torch::kInt64).device(device_));
    if (visible() > 0) positions.narrow(0, 0, visible()).copy_(positions_.narrow(0, 0, visible()));
    positions_ = positions;
    capacity_ = capacity;
}

void KvCache::fault_in() {
    if (arena_ || !device_.is_cpu() || visible() > 0) return;
    // Pieces of 2 MiB (a huge page where the memory is advised for them), taken by the threads
    // in turn.
    constexpr std::size_t piece = std::size_t{2} << 20;
    std::vector<std::span<std::byte>> pieces;
    for (const auto* tensors : {&keys_, &values_})
        for (const torch::Tensor& tensor : *tensors) {
            auto* data = static_cast<std::byte*>(tensor.data_ptr());
            const auto bytes = static_cast<std::size_t>(tensor.nbytes());
            for (std::size_t at = 0; at < bytes; at += piece)
                pieces.emplace_back(data + at, std::min(piece, bytes - at));
        }
    at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i)
            populate_for_writing(pieces[static_cast<std::size_t>(i)].data(),
                                 pieces[static_cast<std::size_t>(i)].size());
    });
}

void KvCache::clear() {
    length_ = 0;
    pending_ = 0;
    next_position_ = 0;
    valid_.clear();  // no padding until a padded packet brings some again
}

KvCache::RowsAfterEnd KvCache::rows_after_end(int64_t count) {
    if (arena_ || !device_.is_cpu())
        throw UnsupportedError("kv cache: rows are written in place only in host memory");
    if (pending_ != 0) throw Error("kv cache: rows_after_end while tokens are pending");
    reserve(length_ + count);
    RowsAfterEnd rows;
    const auto row_bytes = static_cast<std::size_t>(head_dim_) * c10::elementSize(dtype_);
    rows.head_stride = static_cast<std::size_t>(capacity_) * row_bytes;
    for (std::size_t layer = 0; layer < keys_.size(); ++layer) {
        const std::size_t end = static_cast<std::size_t>(length_) * row_bytes;
        rows.keys.push_back(static_cast<std::byte*>(keys_[layer].data_ptr()) + end);
        rows.values.push_back(static_cast<std::byte*>(values_[layer].data_ptr()) + end);
    }
    return rows;
}

void KvCache::append_written(const torch::Tensor& positions) {
    if (length_ + positions.numel() > capacity_)
        throw Error("kv cache: " + std::to_string(positions.numel()) +
                    " tokens written after the end, room for " +
                    std::to_string(capacity_ - length_));
    begin_append(positions);
    if (!valid_.empty())
        for (torch::Tensor& valid : valid_)
            valid.narrow(1, length_, pending_).fill_(true);
    commit();
}

void KvCache::begin_append(const torch::Tensor& positions) {
    if (pending_ != 0) throw Error("kv cache: begin_append while tokens are pending");
    const int64_t count = positions.numel();
    if (length_ + count > capacity_) reserve(std::max(length_ + count, capacity_ * 2));
    positions_.narrow(0, length_, count).copy_(positions.reshape({count}));
    pending_ = count;
}

void KvCache::write(int64_t layer, const torch::Tensor& keys, const torch::Tensor& values) {
    if (keys.size(1) != pending_ || values.size(1) != pending_)
        throw Error("kv cache: write of " + std::to_string(keys.size(1)) + " tokens, " +
                    std::to_string(pending_) + " pending");
    write_rows(keys_.at(static_cast<std::size_t>(layer)).narrow(1, length_, pending_), keys);
    write_rows(values_.at(static_cast<std::size_t>(layer)).narrow(1, length_, pending_), values);
    if (!valid_.empty())
        valid_[static_cast<std::size_t>(layer)].narrow(1, length_, pending_).fill_(true);
}

void KvCache::write_part(int64_t layer, int64_t first, const torch::Tensor& keys,
                         const torch::Tensor& values) {
    const int64_t count = keys.size(1);
    if (first < 0 || count != values.size(1) || first + count > pending_)
        throw Error("kv cache: write of pending tokens [" + std::to_string(first) + ", " +
                    std::to_string(first + count) + "), " + std::to_string(pending_) + " pending");
    write_rows(keys_.at(static_cast<std::size_t>(layer)).narrow(1, length_ + first, count), keys);
    write_rows(values_.at(static_cast<std::size_t>(layer)).narrow(1, length_ + first, count),
               values);
    if (!valid_.empty())
        valid_[static_cast<std::size_t>(layer)].narrow(1, length_ + first, count).fill_(true);
}

torch::Tensor KvCache::key_valid(int64_t layer) const {
    if (valid_.empty()) return {};
    return valid_.at(static_cast<std::size_t>(layer)).narrow(1, 0, visible());
}

void KvCache::commit() {
    if (pending_ > 0) {
        const int64_t last = positions_.narrow(0, length_, pending_).max().item<int64_t>();
        next_position_ = std::max(next_position_, last + 1);
    }
    length_ += pending_;
    pending_ = 0;
}

void KvCache::rollback() {
    pending_ = 0;
}

void KvCache::advance_to(int64_t next_position) {
    next_position_ = std::max(next_position_, next_position);
}

torch::Tensor KvCache::keys(int64_t layer) const {
    return keys_.at(static_cast<std::size_t>(layer)).narrow(1, 0, visible());
}

torch::Tensor KvCache::values(int64_t layer) const {
    return values_.at(static_cast<std::size_t>(layer)).narrow(1, 0, visible());
}

torch::Tensor KvCache::positions() const {
    return positions_.narrow(0, 0, visible());
}

void KvCache::append(const std::vector<torch::Tensor>& keys_per_layer,
                     const std::vector<torch::Tensor>& values_per_layer,
                     const torch::Tensor& positions,
                     const std::vector<torch::Tensor>& used_per_layer) {
    if (keys_per_layer.size() != keys_.size() || values_per_layer.size() != keys_.size())
        throw MismatchError("kv cache: appended tokens cover " +
                            std::to_string(keys_per_layer.size()) + " layers, the cache has " +
                            std::to_string(keys_.size()));
    begin_append(positions);
    try {
        for (std::size_t layer = 0; layer < keys_.size(); ++layer)
            write(static_cast<int64_t>(layer), keys_per_layer[layer].to(device_, dtype_),
                  values_per_layer[layer].to(device_, dtype_));
        if (!used_per_layer.empty()) {
            const int64_t count = positions.numel();
            if (valid_.empty()) {
                // From now on every layer tracks its padding slots; those stored so far are real.
                for (std::size_t layer = 0; layer < keys_.size(); ++layer)
                    valid_.push_back(
                        torch::ones({kv_heads_, capacity_},
                                    torch::TensorOptions().dtype(torch::kBool).device(device_)));
            }
            const torch::Tensor slots = torch::arange(count, torch::kInt64).view({1, count});
            for (std::size_t layer = 0; layer < keys_.size(); ++layer) {
                const torch::Tensor used =
                    used_per_layer.at(layer).to(torch::kCPU, torch::kInt64).view({kv_heads_, 1});
                valid_[layer].narrow(1, length_, count).copy_(slots < used);
            }
        }
    } catch (...) {
        rollback();
        throw;
    }
    commit();
}

}  // namespace kv
