// GGUF, llama.cpp's model file: a header, typed metadata (key -> value), tensor infos, then the
// tensor data at the next multiple of general.alignment, each tensor at an aligned offset in it.
//
// Versions 2 and 3 (little-endian) are read; every count, length, shape and offset is checked
// against the file before it is used, so that a hostile or truncated file gives a FormatError
// naming the file and what is wrong, never a read outside it or an absurd allocation. The file is
// memory-mapped and tensors are viewed in place. What a model loader makes of the metadata
// (the decoder's shape, the tokenizer) is gguf_model_config() here and load_tokenizer(); the
// weights are read by kvcore's load_gguf_model().
#pragma once

#include "kv/mapped_file.hpp"
#include "kv/model/config.hpp"

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kv {

/// The metadata value types of the GGUF specification, by their numbers in the file.
enum class GgufValueType : uint32_t {
    u8 = 0,
    i8 = 1,
    u16 = 2,
    i16 = 3,
    u32 = 4,
    i32 = 5,
    f32 = 6,
    boolean = 7,
    string = 8,
    array = 9,
    u64 = 10,
    i64 = 11,
    f64 = 12,
};

/// "u32", "string", "array"...
std::string gguf_value_type_name(GgufValueType type);

/// One metadata value. Integers of every width (and booleans) are held as int64, floats as
/// double; arrays keep their elements in the member of their kind. Arrays of arrays are checked
/// and counted but their elements are not kept (no model metadata uses them).
struct GgufValue {
    GgufValueType type = GgufValueType::u8;
    GgufValueType element_type = GgufValueType::u8;  ///< arrays only
    int64_t integer = 0;                             ///< integer and boolean scalars
    double number = 0;                               ///< f32 and f64 scalars
    std::string text;                                ///< string scalars
    uint64_t count = 0;                              ///< arrays: number of elements
    std::vector<int64_t> integers;                   ///< arrays of integers or booleans
    std::vector<double> numbers;                     ///< arrays of f32 or f64
    std::vector<std::string> strings;                ///< arrays of strings

    bool is_integer() const;  ///< any integer type (not boolean)
    bool is_number() const;   ///< integer or float
    bool is_array_of(GgufValueType element) const {
        return type == GgufValueType::array && element_type == element;
    }
};

/// The tensor types of ggml (the numbers in the file). Only those kvtools reads are named
/// constants; the others are known by name and size only, so that a file holding them is
/// still read and refused by name where a tensor of that type would be used.
namespace ggml_type {
constexpr uint32_t f32 = 0;
constexpr uint32_t f16 = 1;
constexpr uint32_t q8_0 = 8;
constexpr uint32_t bf16 = 30;
}  // namespace ggml_type

/// "F32", "Q4_K"...; "type N" for a number ggml does not define.
std::string ggml_type_name(uint32_t type);

struct GgufTensorInfo {
    std::string name;
    std::vector<int64_t> dims;  ///< ggml's order: dims[0] is the contiguous one
    uint32_t type = 0;
    uint64_t offset = 0;  ///< from the start of the tensor data
    uint64_t size = 0;    ///< bytes

    /// The shape as torch and safetensors write it: dims reversed.
    std::vector<int64_t> shape() const { return {dims.rbegin(), dims.rend()}; }
    int64_t elements() const;
};

class GgufFile {
  public:
    /// Maps and parses the file. Throws IoError (cannot open), FormatError (not GGUF, truncated,
    /// inconsistent) or UnsupportedError (version 1, big-endian, an unknown tensor type), each
    /// naming the file.
    static GgufFile open(const std::filesystem::path& path);
    /// Parses bytes in memory, which must outlive the result; `name` is what messages call them.
    static GgufFile parse(const std::byte* data, std::size_t size, const std::string& name);

    uint32_t version() const { return version_; }
    uint64_t alignment() const { return alignment_; }
    /// Where the tensor data starts, from the start of the file.
    uint64_t data_offset() const { return data_offset_; }
    /// The file's name, quoted, for messages.
    const std::string& source() const { return source_; }

    const std::map<std::string, GgufValue, std::less<>>& metadata() const { return metadata_; }
    const GgufValue* find(std::string_view key) const;
    /// Typed look-ups: nullopt where the key is absent, FormatError naming the key where its
    /// value has another type.
    std::optional<int64_t> integer(std::string_view key) const;
    std::optional<double> number(std::string_view key) const;  ///< integers too
    std::optional<bool> boolean(std::string_view key) const;
    std::optional<std::string> string(std::string_view key) const;
    /// Arrays: nullptr where absent, FormatError where not an array of that kind.
    const std::vector<std::string>* strings(std::string_view key) const;
    const std::vector<double>* numbers(std::string_view key) const;
    const std::vector<int64_t>* integers(std::string_view key) const;

    /// In file order.
    const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
    const GgufTensorInfo* find_tensor(std::string_view name) const;
    /// The tensor's bytes (checked at parse time to lie inside the file).
    const std::byte* tensor_data(const GgufTensorInfo& tensor) const {
        return data_ + data_offset_ + tensor.offset;
    }
    /// The mapping the tensors view; null for parse() from memory.
    const std::shared_ptr<const MappedFile>& mapping() const { return file_; }

  private:
    std::shared_ptr<const MappedFile> file_;
    const std::byte* data_ = nullptr;
    std::size_t size_ = 0;
    std::string source_;
    uint32_t version_ = 0;
    uint64_t alignment_ = 32;
    uint64_t data_offset_ = 0;
    std::map<std::string, GgufValue, std::less<>> metadata_;
    std::vector<GgufTensorInfo> tensors_;
    std::map<std::string, std::size_t, std::less<>> tensor_index_;
};

/// Whether the file starts with GGUF's magic (false for folders and unreadable files).
bool is_gguf_file(const std::filesystem::path& path);

/// The decoder's shape from the metadata of architectures llama (Llama, Mistral and others
/// converted as llama), qwen2 and qwen3, and the tensors that tell what the metadata does not
/// (output.weight absent: tied embeddings; the q/k biases and norms). The architecture is named
/// as Hugging Face names it (LlamaForCausalLM...), so that the same weights loaded from a folder
/// or from GGUF are the same model. Throws UnsupportedError for another architecture, partial
/// RoPE or a RoPE scaling kvtools does not implement; FormatError for missing or inconsistent
/// fields.
ModelConfig gguf_model_config(const GgufFile& file);

/// Q8_0 blocks (an f16 scale, then 32 int8) to float32, as ggml's dequantize_row_q8_0:
/// `count` values (a multiple of 32) from count / 32 blocks.
void dequantize_q8_0(const std::byte* blocks, std::size_t count, float* out);

}  // namespace kv
