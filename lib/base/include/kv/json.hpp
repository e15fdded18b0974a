// JSON values, a strict parser and a serializer.
//
// Reads the Hugging Face files (config.json, tokenizer.json, safetensors headers) and writes the
// tools' --json reports. Parsing follows RFC 8259 exactly (no comments, no trailing commas, UTF-8
// only) and throws kv::FormatError with the line and column of the first problem; it never
// recurses deeper than max_depth, so hostile input cannot overflow the stack. Objects keep their
// keys in insertion order; a repeated key keeps its first position and its last value.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace kv::json {

enum class Type { null, boolean, number, string, array, object };

/// Lowercase name of a type for messages: "null", "a boolean", "a number", ...
std::string_view type_name(Type type);

class Value {
  public:
    using Array = std::vector<Value>;
    using Object = std::vector<std::pair<std::string, Value>>;

    Value() = default;
    Value(std::nullptr_t) {}
    Value(bool b) : data_(b) {}
    Value(int n) : data_(Number::integer(n)) {}
    Value(int64_t n) : data_(Number::integer(n)) {}
    Value(uint64_t n);
    Value(double d) : data_(Number::real(d)) {}
    Value(std::string s) : data_(std::move(s)) {}
    Value(const char* s) : data_(std::string(s)) {}
    Value(std::string_view s) : data_(std::string(s)) {}
    /// Every other integer type (unsigned, long long, short), so that no call is ambiguous.
    template <std::integral T>
    requires(!std::same_as<T, bool> && !std::same_as<T, char>) Value(T n) : Value(widen(n)) {}

    static Value array() { return Value(Array{}); }
    static Value object() { return Value(Object{}); }

    Type type() const { return static_cast<Type>(data_.index()); }
    bool is_null() const { return type() == Type::null; }
    bool is_bool() const { return type() == Type::boolean; }
    bool is_number() const { return type() == Type::number; }
    /// A number written without fraction or exponent whose value fits int64.
    bool is_integer() const;
    bool is_string() const { return type() == Type::string; }
    bool is_array() const { return type() == Type::array; }
    bool is_object() const { return type() == Type::object; }

    // The accessors throw kv::FormatError ("expected a number, got a string") on the wrong type.
    bool as_bool() const;
    double as_double() const;
    /// Integers, and numbers like 3.0 or 1e3 that hold an exact int64 value.
    int64_t as_int() const;
    const std::string& as_string() const;
    const Array& as_array() const;
    const Object& as_object() const;

    /// The member named key, or nullptr when absent or when this is not an object. Linear in the
    /// number of keys: iterate as_object() to visit every member of a large object.
    const Value* find(std::string_view key) const;
    /// The member named key; throws kv::FormatError "missing key 'key'".
    const Value& at(std::string_view key) const;
    /// Element or member count of an array or object.
    size_t size() const;
    /// Array element; throws kv::FormatError when out of range.
    const Value& operator[](size_t index) const;

    /// Appends to an array (a null value becomes an empty array first). The reference returned
    /// here and by set() lasts until the same container grows again.
    Value& push_back(Value value);
    /// Adds or replaces a member of an object (a null value becomes an empty object first).
    Value& set(std::string key, Value value);

    /// Structural equality; object members compare regardless of order, numbers by value.
    friend bool operator==(const Value& a, const Value& b);

  private:
    // Integers that do not fit int64 but fit uint64 keep their exact digits; larger ones are real.
    struct Number {
        enum class Kind : uint8_t { int64, uint64, real } kind = Kind::int64;
        union {
            int64_t i = 0;
            uint64_t u;
            double d;
        };
        static Number integer(int64_t n) {
            Number x;
            x.kind = Kind::int64;
            x.i = n;
            return x;
        }
        static Number unsigned_integer(uint64_t n);
        static Number real(double d) {
            Number x;
            x.kind = Kind::real;
            x.d = d;
            return x;
        }
    };
    template <std::integral T>
    static Value widen(T n) {
        if constexpr (std::is_signed_v<T>) {
            return Value(static_cast<int64_t>(n));
        } else {
            return Value(static_cast<uint64_t>(n));
        }
    }
    explicit Value(Number n) : data_(n) {}
    explicit Value(Array a) : data_(std::move(a)) {}
    explicit Value(Object o) : data_(std::move(o)) {}
    [[noreturn]] void throw_type_error(std::string_view expected) const;

    // Order matches enum Type so that index() is the type.
    std::variant<std::monostate, bool, Number, std::string, Array, Object> data_;

    friend class Parser;
    friend class Writer;
};

/// Deepest nesting of arrays and objects parse() accepts.
inline constexpr int max_depth = 512;

/// Parses one JSON text; throws kv::FormatError "invalid JSON at line L column C: <what>".
Value parse(std::string_view text);

/// Serializes compactly when indent < 0, else one member per line indented by indent spaces.
/// Integers print exactly, reals with the shortest round-trip digits, NaN and infinities as null.
/// Bytes of strings that are not valid UTF-8 are written as U+FFFD so that the output always is.
std::string dump(const Value& value, int indent = -1);

}  // namespace kv::json
