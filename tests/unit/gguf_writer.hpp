// GGUF files written by the tests themselves (the format is simple, and no GGUF writer is
// packaged here): metadata of every value type, tensors of any ggml type given as bytes, the
// version and alignment chosen, and the low-level pieces for hand-made broken files.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace kv::test {

/// Little-endian pieces of a GGUF file.
struct GgufBytes {
    std::string bytes;

    template <typename T>
    GgufBytes& put(T value) {
        char raw[sizeof(T)];
        std::memcpy(raw, &value, sizeof(T));
        bytes.append(raw, sizeof(T));
        return *this;
    }
    GgufBytes& u32(uint32_t value) { return put(value); }
    GgufBytes& u64(uint64_t value) { return put(value); }
    GgufBytes& string(std::string_view text) {
        u64(text.size());
        bytes.append(text);
        return *this;
    }
};

class GgufWriter {
  public:
    explicit GgufWriter(uint32_t version = 3) : version_(version) {}

    GgufWriter& u32(const std::string& key, uint32_t value) {
        return scalar(key, 4, [&](GgufBytes& out) { out.u32(value); });
    }
    GgufWriter& i32(const std::string& key, int32_t value) {
        return scalar(key, 5, [&](GgufBytes& out) { out.put(value); });
    }
    GgufWriter& u64(const std::string& key, uint64_t value) {
        return scalar(key, 10, [&](GgufBytes& out) { out.u64(value); });
    }
    GgufWriter& f32(const std::string& key, float value) {
        return scalar(key, 6, [&](GgufBytes& out) { out.put(value); });
    }
    GgufWriter& f64(const std::string& key, double value) {
        return scalar(key, 12, [&](GgufBytes& out) { out.put(value); });
    }
    GgufWriter& boolean(const std::string& key, bool value) {
        return scalar(key, 7, [&](GgufBytes& out) { out.put<uint8_t>(value ? 1 : 0); });
    }
    GgufWriter& string(const std::string& key, std::string_view value) {
        return scalar(key, 8, [&](GgufBytes& out) { out.string(value); });
    }
    GgufWriter& strings(const std::string& key, const std::vector<std::string>& values) {
        return scalar(key, 9, [&](GgufBytes& out) {
            out.u32(8).u64(values.size());
            for (const std::string& value : values)
                out.string(value);
        });
    }
    GgufWriter& f32s(const std::string& key, const std::vector<float>& values) {
        return scalar(key, 9, [&](GgufBytes& out) {
            out.u32(6).u64(values.size());
            for (float value : values)
                out.put(value);
        });
    }
    GgufWriter& i32s(const std::string& key, const std::vector<int32_t>& values) {
        return scalar(key, 9, [&](GgufBytes& out) {
            out.u32(5).u64(values.size());
            for (int32_t value : values)
                out.put(value);
        });
    }
    /// `shape` as torch writes it (the file holds it reversed); `data` the tensor's bytes.
    GgufWriter& tensor(const std::string& name, std::vector<int64_t> shape, uint32_t type,
                       std::string data) {
        tensors_.push_back({name, std::move(shape), type, std::move(data)});
        return *this;
    }
    /// general.alignment is written as a u32 when it is not GGUF's default of 32.
    GgufWriter& alignment(uint32_t value) {
        alignment_ = value;
        return u32("general.alignment", value);
    }

    std::string bytes() const {
        GgufBytes out;
        out.bytes = "GGUF";
        out.u32(version_).u64(tensors_.size()).u64(metadata_count_);
        out.bytes += metadata_.bytes;
        uint64_t offset = 0;
        std::vector<uint64_t> offsets;
        for (const Tensor& tensor : tensors_) {
            out.string(tensor.name).u32(static_cast<uint32_t>(tensor.shape.size()));
            for (auto extent = tensor.shape.rbegin(); extent != tensor.shape.rend(); ++extent)
                out.u64(static_cast<uint64_t>(*extent));
            out.u32(tensor.type).u64(offset);
            offsets.push_back(offset);
            offset = padded(offset + tensor.data.size());
        }
        out.bytes.resize(padded(out.bytes.size()), '\0');
        const std::size_t data_start = out.bytes.size();
        for (std::size_t i = 0; i < tensors_.size(); ++i) {
            out.bytes.resize(data_start + offsets[i], '\0');
            out.bytes += tensors_[i].data;
        }
        return out.bytes;
    }

  private:
    struct Tensor {
        std::string name;
        std::vector<int64_t> shape;
        uint32_t type;
        std::string data;
    };

    template <typename Write>
    GgufWriter& scalar(const std::string& key, uint32_t type, Write&& write) {
        metadata_.string(key).u32(type);
        write(metadata_);
        ++metadata_count_;
        return *this;
    }

    uint64_t padded(uint64_t offset) const {
        return (offset + alignment_ - 1) / alignment_ * alignment_;
    }

    uint32_t version_;
    uint64_t alignment_ = 32;
    GgufBytes metadata_;
    uint64_t metadata_count_ = 0;
    std::vector<Tensor> tensors_;
};

/// Float32 values as the bytes of a tensor.
inline std::string float_bytes(const std::vector<float>& values) {
    return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

}  // namespace kv::test
