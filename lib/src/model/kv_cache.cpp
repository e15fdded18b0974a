#include "kv/model/kv_cache.hpp"

#include "kv/error.hpp"

#include <algorithm>

namespace kv {

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

void KvCache::reserve(int64_t capacity) {
    if (capacity <= capacity_) return;
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
    keys_.at(static_cast<std::size_t>(layer)).narrow(1, length_, pending_).copy_(keys);
    values_.at(static_cast<std::size_t>(layer)).narrow(1, length_, pending_).copy_(values);
    if (!valid_.empty())
        valid_[static_cast<std::size_t>(layer)].narrow(1, length_, pending_).fill_(true);
}

void KvCache::write_part(int64_t layer, int64_t first, const torch::Tensor& keys,
                         const torch::Tensor& values) {
    const int64_t count = keys.size(1);
    if (first < 0 || count != values.size(1) || first + count > pending_)
        throw Error("kv cache: write of pending tokens [" + std::to_string(first) + ", " +
                    std::to_string(first + count) + "), " + std::to_string(pending_) + " pending");
    keys_.at(static_cast<std::size_t>(layer)).narrow(1, length_ + first, count).copy_(keys);
    values_.at(static_cast<std::size_t>(layer)).narrow(1, length_ + first, count).copy_(values);
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
