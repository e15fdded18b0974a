#include "kv/gguf.hpp"

#include "kv/error.hpp"
#include "kv/float_convert.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numbers>

namespace kv {
namespace {

constexpr char magic[4] = {'G', 'G', 'U', 'F'};
constexpr uint64_t default_alignment = 32;
// ggml's GGML_MAX_DIMS: a tensor info with more dimensions is not one ggml could have written.
constexpr uint32_t max_dims = 4;
// Nesting of arrays of arrays; the specification allows it, no model uses it, and a bound keeps
// a hostile file from recursing the reader off its stack.
constexpr int max_array_depth = 3;

struct TypeTraits {
    const char* name;
    uint32_t block;  // elements per block
    uint32_t bytes;  // bytes per block
};

// ggml's type_traits (ggml.c) for every type a GGUF file can hold today: block sizes and bytes
// per block, so that any tensor's extent can be checked against the file even where kvtools
// cannot use its type. Numbers ggml retired (4, 5, 31-33, 36-38) are unknown.
std::optional<TypeTraits> type_traits(uint32_t type) {
    switch (type) {
        case 0:
            return TypeTraits{"F32", 1, 4};
        case 1:
            return TypeTraits{"F16", 1, 2};
        case 2:
            return TypeTraits{"Q4_0", 32, 18};
        case 3:
            return TypeTraits{"Q4_1", 32, 20};
        case 6:
            return TypeTraits{"Q5_0", 32, 22};
        case 7:
            return TypeTraits{"Q5_1", 32, 24};
        case 8:
            return TypeTraits{"Q8_0", 32, 34};
        case 9:
            return TypeTraits{"Q8_1", 32, 36};
        case 10:
            return TypeTraits{"Q2_K", 256, 84};
        case 11:
            return TypeTraits{"Q3_K", 256, 110};
        case 12:
            return TypeTraits{"Q4_K", 256, 144};
        case 13:
            return TypeTraits{"Q5_K", 256, 176};
        case 14:
            return TypeTraits{"Q6_K", 256, 210};
        case 15:
            return TypeTraits{"Q8_K", 256, 292};
        case 16:
            return TypeTraits{"IQ2_XXS", 256, 66};
        case 17:
            return TypeTraits{"IQ2_XS", 256, 74};
        case 18:
            return TypeTraits{"IQ3_XXS", 256, 98};
        case 19:
            return TypeTraits{"IQ1_S", 256, 50};
        case 20:
            return TypeTraits{"IQ4_NL", 32, 18};
        case 21:
            return TypeTraits{"IQ3_S", 256, 110};
        case 22:
            return TypeTraits{"IQ2_S", 256, 82};
        case 23:
            return TypeTraits{"IQ4_XS", 256, 136};
        case 24:
            return TypeTraits{"I8", 1, 1};
        case 25:
            return TypeTraits{"I16", 1, 2};
        case 26:
            return TypeTraits{"I32", 1, 4};
        case 27:
            return TypeTraits{"I64", 1, 8};
        case 28:
            return TypeTraits{"F64", 1, 8};
        case 29:
            return TypeTraits{"IQ1_M", 256, 56};
        case 30:
            return TypeTraits{"BF16", 1, 2};
        case 34:
            return TypeTraits{"TQ1_0", 256, 54};
        case 35:
            return TypeTraits{"TQ2_0", 256, 66};
        case 39:
            return TypeTraits{"MXFP4", 32, 17};
        default:
            return std::nullopt;
    }
}

std::size_t scalar_size(GgufValueType type) {
    switch (type) {
        case GgufValueType::u8:
        case GgufValueType::i8:
        case GgufValueType::boolean:
            return 1;
        case GgufValueType::u16:
        case GgufValueType::i16:
            return 2;
        case GgufValueType::u32:
        case GgufValueType::i32:
        case GgufValueType::f32:
            return 4;
        case GgufValueType::u64:
        case GgufValueType::i64:
        case GgufValueType::f64:
            return 8;
        case GgufValueType::string:
            return 8;  // the smallest: its length alone
        case GgufValueType::array:
            return 12;  // element type and count
    }
    return 1;
}

bool known_value_type(uint32_t type) {
    return type <= 12;
}

// A float32 as the decimal it was written from: converters store config.json's 1e-05 as the
// nearest float32, which read as a double would be 9.99999974738e-06; its shortest decimal is
// 1e-05 again, so that the same model's config is the same whether read from GGUF or JSON.
double widen(float value) {
    if (!std::isfinite(value)) return value;
    char text[32];
    const auto written = std::to_chars(text, text + sizeof text, value);
    double result = value;
    std::from_chars(text, written.ptr, result);
    return result;
}

// Reads the file front to back; every read is checked against what is left of it.
class Reader {
  public:
    Reader(const std::byte* data, std::size_t size, const std::string& source)
        : data_(data), size_(size), source_(source) {}

    std::size_t position() const { return position_; }
    std::size_t remaining() const { return size_ - position_; }

    [[noreturn]] void fail(const std::string& what) const {
        throw FormatError(source_ + ": " + what);
    }

    void need(std::size_t bytes, const std::string& what) const {
        if (bytes > remaining())
            fail("truncated: " + what + " at byte " + std::to_string(position_) + " needs " +
                 std::to_string(bytes) + " bytes, the file has " + std::to_string(remaining()) +
                 " left");
    }

    template <typename T>
    T read(const std::string& what) {
        need(sizeof(T), what);
        T value;
        std::memcpy(&value, data_ + position_, sizeof value);
        position_ += sizeof value;
        return value;
    }

    std::string read_string(const std::string& what) {
        const uint64_t length = read<uint64_t>(what + "'s length");
        if (length > remaining())
            fail(what + " at byte " + std::to_string(position_ - 8) + " claims " +
                 std::to_string(length) + " bytes, more than the " + std::to_string(remaining()) +
                 " left in the file");
        std::string text(reinterpret_cast<const char*>(data_ + position_),
                         static_cast<std::size_t>(length));
        position_ += static_cast<std::size_t>(length);
        return text;
    }

    // A count of items of at least `item_bytes` each that the rest of the file must hold: checked
    // before anything is sized by it.
    uint64_t read_count(const std::string& what, std::size_t item_bytes) {
        const std::size_t at = position_;
        const uint64_t count = read<uint64_t>(what);
        if (item_bytes > 0 && count > remaining() / item_bytes)
            fail(what + " at byte " + std::to_string(at) + " is " + std::to_string(count) +
                 ", more than the " + std::to_string(remaining()) + " bytes left could hold");
        return count;
    }

  private:
    const std::byte* data_;
    std::size_t size_;
    const std::string& source_;
    std::size_t position_ = 0;
};

int64_t read_integer(Reader& reader, GgufValueType type, const std::string& what) {
    switch (type) {
        case GgufValueType::u8:
            return reader.read<uint8_t>(what);
        case GgufValueType::i8:
            return reader.read<int8_t>(what);
        case GgufValueType::u16:
            return reader.read<uint16_t>(what);
        case GgufValueType::i16:
            return reader.read<int16_t>(what);
        case GgufValueType::u32:
            return reader.read<uint32_t>(what);
        case GgufValueType::i32:
            return reader.read<int32_t>(what);
        case GgufValueType::i64:
            return reader.read<int64_t>(what);
        case GgufValueType::boolean:
            return reader.read<uint8_t>(what) != 0;
        case GgufValueType::u64: {
            const uint64_t value = reader.read<uint64_t>(what);
            if (value > static_cast<uint64_t>(INT64_MAX))
                reader.fail(what + " is " + std::to_string(value) +
                            ", beyond the largest value kvtools reads (2^63 - 1)");
            return static_cast<int64_t>(value);
        }
        default:
            return 0;
    }
}

bool is_integer_type(GgufValueType type) {
    return type != GgufValueType::f32 && type != GgufValueType::f64 &&
           type != GgufValueType::string && type != GgufValueType::array;
}

GgufValueType read_type(Reader& reader, const std::string& what) {
    const uint32_t type = reader.read<uint32_t>(what + "'s type");
    if (!known_value_type(type))
        reader.fail(what + " has unknown value type " + std::to_string(type) +
                    " (GGUF defines 0 to 12)");
    return static_cast<GgufValueType>(type);
}

GgufValue read_value(Reader& reader, GgufValueType type, const std::string& what, int depth) {
    GgufValue value;
    value.type = type;
    if (type == GgufValueType::string) {
        value.text = reader.read_string(what);
    } else if (type == GgufValueType::f32) {
        value.number = widen(reader.read<float>(what));
    } else if (type == GgufValueType::f64) {
        value.number = reader.read<double>(what);
    } else if (type == GgufValueType::array) {
        if (depth >= max_array_depth)
            reader.fail(what + " nests arrays more than " + std::to_string(max_array_depth) +
                        " deep");
        value.element_type = read_type(reader, what + "'s elements");
        value.count = reader.read_count(what + "'s element count", scalar_size(value.element_type));
        const std::size_t count = static_cast<std::size_t>(value.count);
        const GgufValueType element = value.element_type;
        if (element == GgufValueType::string) {
            value.strings.reserve(count);
            for (std::size_t i = 0; i < count; ++i)
                value.strings.push_back(reader.read_string(what));
        } else if (element == GgufValueType::f32 || element == GgufValueType::f64) {
            value.numbers.reserve(count);
            for (std::size_t i = 0; i < count; ++i)
                value.numbers.push_back(element == GgufValueType::f32
                                            ? widen(reader.read<float>(what))
                                            : reader.read<double>(what));
        } else if (element == GgufValueType::array) {
            for (std::size_t i = 0; i < count; ++i) {
                const GgufValueType inner = read_type(reader, what + "[" + std::to_string(i) + "]");
                (void)read_value(reader, inner, what + "[" + std::to_string(i) + "]", depth + 1);
            }
        } else {
            value.integers.reserve(count);
            for (std::size_t i = 0; i < count; ++i)
                value.integers.push_back(read_integer(reader, element, what));
        }
    } else {
        value.integer = read_integer(reader, type, what);
    }
    return value;
}

// a * b, or nullopt where it would not fit in int64.
std::optional<int64_t> checked_multiply(int64_t a, int64_t b) {
    int64_t product;
    if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
    return product;
}

std::string dims_text(const std::vector<int64_t>& dims) {
    std::string text = "[";
    for (std::size_t i = 0; i < dims.size(); ++i)
        text += (i ? ", " : "") + std::to_string(dims[i]);
    return text + "]";
}

}  // namespace

std::string gguf_value_type_name(GgufValueType type) {
    static constexpr const char* names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                            "bool", "string", "array", "u64", "i64", "f64"};
    const auto index = static_cast<uint32_t>(type);
    return index < std::size(names) ? names[index] : "type " + std::to_string(index);
}

std::string ggml_type_name(uint32_t type) {
    const auto traits = type_traits(type);
    return traits ? traits->name : "type " + std::to_string(type);
}

bool GgufValue::is_integer() const {
    return type != GgufValueType::boolean && is_integer_type(type);
}

bool GgufValue::is_number() const {
    return is_integer() || type == GgufValueType::f32 || type == GgufValueType::f64;
}

int64_t GgufTensorInfo::elements() const {
    int64_t count = 1;
    for (int64_t extent : dims)
        count *= extent;  // checked against overflow at parse time
    return count;
}

GgufFile GgufFile::open(const std::filesystem::path& path) {
    auto file = MappedFile::open(path);
    GgufFile result = parse(file->data(), file->size(), path.string());
    result.file_ = std::move(file);
    return result;
}

GgufFile GgufFile::parse(const std::byte* data, std::size_t size, const std::string& name) {
    GgufFile result;
    result.data_ = data;
    result.size_ = size;
    result.source_ = quoted(name);
    const std::string& source = result.source_;
    Reader reader(data, size, source);

    if (size < 4 || std::memcmp(data, magic, 4) != 0)
        throw FormatError(source + " is not a GGUF file: it does not start with 'GGUF'");
    reader.read<uint32_t>("magic");
    const uint32_t version = reader.read<uint32_t>("version");
    if (version == 1)
        throw UnsupportedError(source + ": GGUF version 1 is not supported (supported: 2 and 3)");
    if (version != 2 && version != 3) {
        // A big-endian file's version reads as 0x02000000 or 0x03000000 here.
        if ((version & 0xFFFF) == 0 && version != 0)
            throw UnsupportedError(
                source + ": big-endian GGUF files are not supported (little-endian only)");
        throw UnsupportedError(source + ": GGUF version " + std::to_string(version) +
                               " is not supported (supported: 2 and 3)");
    }
    result.version_ = version;

    // The smallest tensor info: an empty name, no dimensions, a type and an offset; the smallest
    // key/value: an empty key, a type and a one-byte value.
    const uint64_t tensor_count = reader.read_count("tensor count", 8 + 4 + 4 + 8);
    const uint64_t metadata_count = reader.read_count("metadata count", 8 + 4 + 1);

    for (uint64_t i = 0; i < metadata_count; ++i) {
        const std::string key = reader.read_string("metadata key " + std::to_string(i));
        const std::string what = "metadata '" + key + "'";
        const GgufValueType type = read_type(reader, what);
        GgufValue value = read_value(reader, type, what, 0);
        if (!result.metadata_.emplace(key, std::move(value)).second)
            reader.fail("metadata key '" + key + "' appears twice");
    }

    if (const GgufValue* alignment = result.find("general.alignment")) {
        if (!alignment->is_integer())
            reader.fail("'general.alignment' is a " + gguf_value_type_name(alignment->type) +
                        ", not an integer");
        const int64_t value = alignment->integer;
        if (value <= 0 || value > (int64_t{1} << 30) || (value & (value - 1)) != 0)
            reader.fail("'general.alignment' is " + std::to_string(value) +
                        ", not a power of two up to 2^30");
        result.alignment_ = static_cast<uint64_t>(value);
    }

    result.tensors_.reserve(static_cast<std::size_t>(tensor_count));
    for (uint64_t i = 0; i < tensor_count; ++i) {
        GgufTensorInfo tensor;
        tensor.name = reader.read_string("tensor " + std::to_string(i) + "'s name");
        const std::string what = "tensor '" + tensor.name + "'";
        const uint32_t dim_count = reader.read<uint32_t>(what + "'s dimension count");
        if (dim_count > max_dims)
            reader.fail(what + " has " + std::to_string(dim_count) +
                        " dimensions (ggml allows at most " + std::to_string(max_dims) + ")");
        int64_t elements = 1;
        for (uint32_t d = 0; d < dim_count; ++d) {
            const uint64_t extent = reader.read<uint64_t>(what + "'s dimension");
            const auto product = extent > static_cast<uint64_t>(INT64_MAX)
                                     ? std::nullopt
                                     : checked_multiply(elements, static_cast<int64_t>(extent));
            if (!product)
                reader.fail(what + " has dimension " + std::to_string(extent) +
                            ": more elements than kvtools can count");
            elements = *product;
            tensor.dims.push_back(static_cast<int64_t>(extent));
        }
        tensor.type = reader.read<uint32_t>(what + "'s type");
        const auto traits = type_traits(tensor.type);
        if (!traits)
            throw UnsupportedError(source + ": " + what + " has unknown ggml type " +
                                   std::to_string(tensor.type));
        tensor.offset = reader.read<uint64_t>(what + "'s offset");
        const int64_t first = tensor.dims.empty() ? 1 : tensor.dims[0];
        if (first % traits->block != 0)
            reader.fail(what + " of type " + traits->name + " has " + std::to_string(first) +
                        " elements per row, not a multiple of its block of " +
                        std::to_string(traits->block));
        const auto bytes = checked_multiply(elements / traits->block, traits->bytes);
        if (!bytes) reader.fail(what + " " + dims_text(tensor.dims) + " is too large");
        tensor.size = static_cast<uint64_t>(*bytes);
        if (tensor.offset % result.alignment_ != 0)
            reader.fail(what + " starts at offset " + std::to_string(tensor.offset) +
                        ", not a multiple of the alignment " + std::to_string(result.alignment_));
        if (!result.tensor_index_.emplace(tensor.name, result.tensors_.size()).second)
            reader.fail("tensor '" + tensor.name + "' appears twice");
        result.tensors_.push_back(std::move(tensor));
    }

    const uint64_t end_of_infos = reader.position();
    result.data_offset_ =
        (end_of_infos + result.alignment_ - 1) / result.alignment_ * result.alignment_;
    if (!result.tensors_.empty() && result.data_offset_ > size)
        reader.fail("truncated: the tensor data would start at byte " +
                    std::to_string(result.data_offset_) + ", past the end of the file (" +
                    std::to_string(size) + " bytes)");
    const uint64_t data_bytes = size - std::min<uint64_t>(size, result.data_offset_);

    // Every tensor inside the data, and no two sharing a byte.
    std::vector<const GgufTensorInfo*> by_offset;
    for (const GgufTensorInfo& tensor : result.tensors_) {
        if (tensor.offset > data_bytes || tensor.size > data_bytes - tensor.offset)
            reader.fail("tensor '" + tensor.name + "' (" + ggml_type_name(tensor.type) + " " +
                        dims_text(tensor.dims) + ", " + std::to_string(tensor.size) +
                        " bytes at data offset " + std::to_string(tensor.offset) +
                        ") extends past the end of the file: truncated or corrupt");
        by_offset.push_back(&tensor);
    }
    std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
        return a->offset < b->offset || (a->offset == b->offset && a->size < b->size);
    });
    for (std::size_t i = 1; i < by_offset.size(); ++i) {
        const GgufTensorInfo& before = *by_offset[i - 1];
        const GgufTensorInfo& after = *by_offset[i];
        if (before.size > 0 && after.size > 0 && before.offset + before.size > after.offset)
            reader.fail("tensors '" + before.name + "' and '" + after.name + "' overlap");
    }
    return result;
}

const GgufValue* GgufFile::find(std::string_view key) const {
    const auto found = metadata_.find(key);
    return found == metadata_.end() ? nullptr : &found->second;
}

namespace {

[[noreturn]] void wrong_type(const std::string& source, std::string_view key,
                             const GgufValue& value, const char* wanted) {
    std::string actual = gguf_value_type_name(value.type);
    if (value.type == GgufValueType::array)
        actual = "array of " + gguf_value_type_name(value.element_type);
    throw FormatError(source + ": metadata '" + std::string(key) + "' is " + actual + ", not " +
                      wanted);
}

}  // namespace

std::optional<int64_t> GgufFile::integer(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return std::nullopt;
    if (!value->is_integer()) wrong_type(source_, key, *value, "an integer");
    return value->integer;
}

std::optional<double> GgufFile::number(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return std::nullopt;
    if (!value->is_number()) wrong_type(source_, key, *value, "a number");
    return value->is_integer() ? static_cast<double>(value->integer) : value->number;
}

std::optional<bool> GgufFile::boolean(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return std::nullopt;
    if (value->type != GgufValueType::boolean) wrong_type(source_, key, *value, "a bool");
    return value->integer != 0;
}

std::optional<std::string> GgufFile::string(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return std::nullopt;
    if (value->type != GgufValueType::string) wrong_type(source_, key, *value, "a string");
    return value->text;
}

const std::vector<std::string>* GgufFile::strings(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return nullptr;
    if (!value->is_array_of(GgufValueType::string))
        wrong_type(source_, key, *value, "an array of strings");
    return &value->strings;
}

const std::vector<double>* GgufFile::numbers(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return nullptr;
    if (!value->is_array_of(GgufValueType::f32) && !value->is_array_of(GgufValueType::f64))
        wrong_type(source_, key, *value, "an array of floats");
    return &value->numbers;
}

const std::vector<int64_t>* GgufFile::integers(std::string_view key) const {
    const GgufValue* value = find(key);
    if (!value) return nullptr;
    if (value->type != GgufValueType::array || !is_integer_type(value->element_type))
        wrong_type(source_, key, *value, "an array of integers");
    return &value->integers;
}

const GgufTensorInfo* GgufFile::find_tensor(std::string_view name) const {
    const auto found = tensor_index_.find(name);
    return found == tensor_index_.end() ? nullptr : &tensors_[found->second];
}

bool is_gguf_file(const std::filesystem::path& path) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(path, error)) return false;
    std::ifstream in(path, std::ios::binary);
    char start[4] = {};
    return in.read(start, 4) && std::memcmp(start, magic, 4) == 0;
}

void dequantize_q8_0(const std::byte* blocks, std::size_t count, float* out) {
    constexpr std::size_t block = 32, block_bytes = 34;
    for (std::size_t b = 0; b < count / block; ++b) {
        const std::byte* at = blocks + b * block_bytes;
        uint16_t scale_bits;
        std::memcpy(&scale_bits, at, 2);
        const float scale = f16_to_float(scale_bits);
        const auto* quants = reinterpret_cast<const int8_t*>(at + 2);
        for (std::size_t j = 0; j < block; ++j)
            out[b * block + j] = static_cast<float>(quants[j]) * scale;
    }
}

namespace {

// Llama 3's RoPE scaling, which llama.cpp's converter stores as one divisor per rotated pair
// (rope_freqs.weight) rather than as metadata: the parameters are recovered by checking the
// divisors against Hugging Face's rule with the converter's and Meta's constants (low 1, high 4,
// 8192 original positions) and the largest divisor as the factor.
RopeScaling llama3_scaling_from_factors(const GgufFile& file, const GgufTensorInfo& tensor,
                                        const ModelConfig& config) {
    const std::string& source = file.source();
    const int64_t pairs = config.head_dim / 2;
    if (tensor.type != ggml_type::f32 || tensor.dims.size() != 1 || tensor.dims[0] != pairs)
        throw FormatError(source + ": tensor 'rope_freqs.weight' is " +
                          ggml_type_name(tensor.type) + " " + dims_text(tensor.dims) +
                          ", expected F32 [" + std::to_string(pairs) + "]");
    std::vector<float> factors(static_cast<std::size_t>(pairs));
    std::memcpy(factors.data(), file.tensor_data(tensor), factors.size() * sizeof(float));
    RopeScaling scaling;
    scaling.type = RopeScalingType::llama3;
    scaling.factor = *std::max_element(factors.begin(), factors.end());
    scaling.low_freq_factor = 1.0;
    scaling.high_freq_factor = 4.0;
    scaling.original_max_position_embeddings = 8192;
    const double low_wavelength = 8192.0 / scaling.low_freq_factor;
    const double high_wavelength = 8192.0 / scaling.high_freq_factor;
    bool matches = scaling.factor >= 1.0;
    for (int64_t i = 0; i < pairs && matches; ++i) {
        const double frequency =
            1.0 / std::pow(config.rope_theta,
                           static_cast<double>(2 * i) / static_cast<double>(config.head_dim));
        const double wavelength = 2 * std::numbers::pi / frequency;
        double expected;
        if (wavelength < high_wavelength) {
            expected = 1.0;
        } else if (wavelength > low_wavelength) {
            expected = scaling.factor;
        } else {
            const double smooth = (8192.0 / wavelength - scaling.low_freq_factor) /
                                  (scaling.high_freq_factor - scaling.low_freq_factor);
            expected = 1.0 / ((1 - smooth) / scaling.factor + smooth);
        }
        matches = std::abs(factors[static_cast<std::size_t>(i)] - expected) <= 1e-4 * expected;
    }
    if (!matches)
        throw UnsupportedError(source +
                               ": tensor 'rope_freqs.weight' holds RoPE frequency factors that "
                               "are not Llama 3's scaling (low_freq_factor 1, high_freq_factor "
                               "4, 8192 original positions); other factors are not supported");
    return scaling;
}

}  // namespace

ModelConfig gguf_model_config(const GgufFile& file) {
    const std::string& source = file.source();
    const std::optional<std::string> architecture = file.string("general.architecture");
    if (!architecture) throw FormatError(source + ": missing metadata 'general.architecture'");
    ModelConfig config;
    if (*architecture == "llama")
        config.architecture = "LlamaForCausalLM";
    else if (*architecture == "qwen2")
        config.architecture = "Qwen2ForCausalLM";
    else if (*architecture == "qwen3")
        config.architecture = "Qwen3ForCausalLM";
    else
        throw UnsupportedError(source + ": GGUF architecture '" + *architecture +
                               "' is not supported (supported: llama, which includes Mistral, "
                               "qwen2, qwen3)");
    const std::string prefix = *architecture + ".";
    auto required = [&](const std::string& key) {
        const std::optional<int64_t> value = file.integer(prefix + key);
        if (!value) throw FormatError(source + ": missing metadata '" + prefix + key + "'");
        return *value;
    };
    if (const auto experts = file.integer(prefix + "expert_count"); experts && *experts > 0)
        throw UnsupportedError(source + ": mixtures of experts ('" + prefix + "expert_count' " +
                               std::to_string(*experts) + ") are not supported");

    config.hidden_size = required("embedding_length");
    config.num_layers = required("block_count");
    config.intermediate_size = required("feed_forward_length");
    config.num_heads = required("attention.head_count");
    config.num_kv_heads =
        file.integer(prefix + "attention.head_count_kv").value_or(config.num_heads);
    config.max_position_embeddings = file.integer(prefix + "context_length").value_or(2048);
    const std::optional<double> epsilon = file.number(prefix + "attention.layer_norm_rms_epsilon");
    if (!epsilon)
        throw FormatError(source + ": missing metadata '" + prefix +
                          "attention.layer_norm_rms_epsilon'");
    config.rms_norm_eps = *epsilon;
    config.rope_theta = file.number(prefix + "rope.freq_base").value_or(10000.0);
    if (config.num_heads <= 0)
        throw FormatError(source + ": '" + prefix + "attention.head_count' must be positive");
    config.head_dim = file.integer(prefix + "attention.key_length")
                          .value_or(config.hidden_size / config.num_heads);
    if (const auto value_length = file.integer(prefix + "attention.value_length");
        value_length && *value_length != config.head_dim)
        throw UnsupportedError(source + ": value heads of " + std::to_string(*value_length) +
                               " dimensions and key heads of " + std::to_string(config.head_dim) +
                               " are not supported (they must be equal)");
    if (const auto rotated = file.integer(prefix + "rope.dimension_count");
        rotated && *rotated != config.head_dim)
        throw UnsupportedError(source + ": partial RoPE ('" + prefix + "rope.dimension_count' " +
                               std::to_string(*rotated) + " of " + std::to_string(config.head_dim) +
                               " dimensions per head) is not supported");

    // Llama-arch files hold q and k permuted for llama.cpp's interleaved RoPE; the loader undoes
    // that, so every architecture computes as Hugging Face's does.
    config.rope_layout = RopeLayout::half_split;
    const std::string scaling_type = file.string(prefix + "rope.scaling.type").value_or("none");
    if (scaling_type == "linear") {
        config.rope_scaling.type = RopeScalingType::linear;
        config.rope_scaling.factor = file.number(prefix + "rope.scaling.factor").value_or(1.0);
    } else if (scaling_type != "none") {
        throw UnsupportedError(source + ": rope scaling '" + scaling_type +
                               "' is not supported (supported: linear, and Llama 3's "
                               "rope_freqs.weight)");
    } else if (const auto scale = file.number(prefix + "rope.scale_linear");
               scale && *scale != 1.0) {
        config.rope_scaling.type = RopeScalingType::linear;
        config.rope_scaling.factor = *scale;
    }
    if (config.rope_scaling.type == RopeScalingType::linear && !(config.rope_scaling.factor > 0))
        throw FormatError(source + ": the linear rope scaling factor must be positive");

    const GgufTensorInfo* embedding = file.find_tensor("token_embd.weight");
    if (!embedding) throw FormatError(source + ": missing tensor 'token_embd.weight'");
    if (embedding->dims.size() != 2)
        throw FormatError(source + ": tensor 'token_embd.weight' has " +
                          std::to_string(embedding->dims.size()) + " dimensions, expected 2");
    config.vocab_size = embedding->dims[1];
    config.tie_word_embeddings = file.find_tensor("output.weight") == nullptr;
    config.attention_bias = *architecture == "qwen2" || file.find_tensor("blk.0.attn_q.bias");
    config.qk_norm = *architecture == "qwen3";
    config.bos_token_id = file.integer("tokenizer.ggml.bos_token_id").value_or(-1);
    config.eos_token_id = file.integer("tokenizer.ggml.eos_token_id").value_or(-1);
    // What the embedding is stored as: Q8_0 is dequantised to float32 at load.
    config.weights_dtype = embedding->type == ggml_type::f16    ? "f16"
                           : embedding->type == ggml_type::bf16 ? "bf16"
                                                                : "f32";
    validate_config(config, source);
    if (const GgufTensorInfo* factors = file.find_tensor("rope_freqs.weight")) {
        if (config.rope_scaling.type != RopeScalingType::none)
            throw UnsupportedError(source + ": both rope scaling '" + scaling_type +
                                   "' and 'rope_freqs.weight'");
        config.rope_scaling = llama3_scaling_from_factors(file, *factors, config);
    }
    return config;
}

}  // namespace kv
