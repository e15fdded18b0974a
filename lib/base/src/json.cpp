#include "kv/json.hpp"

#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <unordered_map>

#include "kv/error.hpp"
#include "utf8.hpp"

namespace kv::json {

namespace {

bool is_digit(char c) {
    return c >= '0' && c <= '9';
}

// Bytes a string can copy verbatim in the parser's fast loop.
constexpr std::array<bool, 256> plain_string_bytes = [] {
    std::array<bool, 256> table{};
    for (int c = 0x20; c < 0x80; ++c)
        table[c] = c != '"' && c != '\\';
    return table;
}();

std::string describe_byte(unsigned char c) {
    if (c >= 0x21 && c < 0x7F) return "'" + std::string(1, static_cast<char>(c)) + "'";
    static const char* const hex = "0123456789ABCDEF";
    return std::string("byte 0x") + hex[c >> 4] + hex[c & 0xF];
}

std::string format_double(double d) {
    char buffer[32];
    auto result = std::to_chars(buffer, buffer + sizeof buffer, d);
    std::string text(buffer, result.ptr);
    // Keep reals real across a round trip: "2" would read back as an integer.
    if (text.find_first_of(".e") == std::string::npos) text += ".0";
    return text;
}

}  // namespace

std::string_view type_name(Type type) {
    switch (type) {
        case Type::null:
            return "null";
        case Type::boolean:
            return "a boolean";
        case Type::number:
            return "a number";
        case Type::string:
            return "a string";
        case Type::array:
            return "an array";
        case Type::object:
            return "an object";
    }
    return "an unknown type";
}

// ---- Value ----------------------------------------------------------------------------------

Value::Number Value::Number::unsigned_integer(uint64_t n) {
    if (n <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return integer(static_cast<int64_t>(n));
    }
    Number x;
    x.kind = Kind::uint64;
    x.u = n;
    return x;
}

Value::Value(uint64_t n) : data_(Number::unsigned_integer(n)) {}

void Value::throw_type_error(std::string_view expected) const {
    throw FormatError("expected " + std::string(expected) + ", got " +
                      std::string(type_name(type())));
}

bool Value::is_integer() const {
    auto* number = std::get_if<Number>(&data_);
    return number && number->kind == Number::Kind::int64;
}

bool Value::as_bool() const {
    if (!is_bool()) throw_type_error("a boolean");
    return std::get<bool>(data_);
}

double Value::as_double() const {
    if (!is_number()) throw_type_error("a number");
    const Number& number = std::get<Number>(data_);
    switch (number.kind) {
        case Number::Kind::int64:
            return static_cast<double>(number.i);
        case Number::Kind::uint64:
            return static_cast<double>(number.u);
        case Number::Kind::real:
            return number.d;
    }
    return 0;
}

int64_t Value::as_int() const {
    if (!is_number()) throw_type_error("an integer");
    const Number& number = std::get<Number>(data_);
    if (number.kind == Number::Kind::int64) return number.i;
    if (number.kind == Number::Kind::real) {
        // 2^63 is exact as a double; anything below it in magnitude converts without overflow.
        constexpr double limit = 9223372036854775808.0;
        if (std::trunc(number.d) == number.d && number.d >= -limit && number.d < limit) {
            return static_cast<int64_t>(number.d);
        }
        throw FormatError("expected an integer, got " + format_double(number.d));
    }
    throw FormatError("expected a 64-bit signed integer, got " + std::to_string(number.u));
}

const std::string& Value::as_string() const {
    if (!is_string()) throw_type_error("a string");
    return std::get<std::string>(data_);
}

const Value::Array& Value::as_array() const {
    if (!is_array()) throw_type_error("an array");
    return std::get<Array>(data_);
}

const Value::Object& Value::as_object() const {
    if (!is_object()) throw_type_error("an object");
    return std::get<Object>(data_);
}

const Value* Value::find(std::string_view key) const {
    auto* object = std::get_if<Object>(&data_);
    if (!object) return nullptr;
    for (const auto& [name, value] : *object) {
        if (name == key) return &value;
    }
    return nullptr;
}

const Value& Value::at(std::string_view key) const {
    if (!is_object()) throw_type_error("an object");
    const Value* value = find(key);
    if (!value) throw FormatError("missing key " + kv::quoted(std::string(key)));
    return *value;
}

size_t Value::size() const {
    if (auto* array = std::get_if<Array>(&data_)) return array->size();
    if (auto* object = std::get_if<Object>(&data_)) return object->size();
    throw_type_error("an array or an object");
}

const Value& Value::operator[](size_t index) const {
    const Array& array = as_array();
    if (index >= array.size()) {
        throw FormatError("index " + std::to_string(index) + " is out of range for an array of " +
                          std::to_string(array.size()));
    }
    return array[index];
}

Value& Value::push_back(Value value) {
    if (is_null()) data_ = Array{};
    if (!is_array()) throw_type_error("an array");
    return std::get<Array>(data_).emplace_back(std::move(value));
}

Value& Value::set(std::string key, Value value) {
    if (is_null()) data_ = Object{};
    if (!is_object()) throw_type_error("an object");
    auto& object = std::get<Object>(data_);
    for (auto& [name, existing] : object) {
        if (name == key) return existing = std::move(value);
    }
    return object.emplace_back(std::move(key), std::move(value)).second;
}

bool operator==(const Value& a, const Value& b) {
    if (a.type() != b.type()) return false;
    switch (a.type()) {
        case Type::null:
            return true;
        case Type::boolean:
            return a.as_bool() == b.as_bool();
        case Type::number: {
            using Kind = Value::Number::Kind;
            const auto& x = std::get<Value::Number>(a.data_);
            const auto& y = std::get<Value::Number>(b.data_);
            if (x.kind == Kind::int64 && y.kind == Kind::int64) return x.i == y.i;
            if (x.kind == Kind::uint64 && y.kind == Kind::uint64) return x.u == y.u;
            return a.as_double() == b.as_double();
        }
        case Type::string:
            return a.as_string() == b.as_string();
        case Type::array:
            return a.as_array() == b.as_array();
        case Type::object: {
            const auto& x = a.as_object();
            const auto& y = b.as_object();
            if (x.size() != y.size()) return false;
            if (x.size() <= 16) {
                for (const auto& [key, value] : x) {
                    const Value* other = b.find(key);
                    if (!other || !(*other == value)) return false;
                }
                return true;
            }
            std::unordered_map<std::string_view, const Value*> members;
            members.reserve(y.size());
            for (const auto& [key, value] : y)
                members.emplace(key, &value);
            for (const auto& [key, value] : x) {
                auto it = members.find(key);
                if (it == members.end() || !(*it->second == value)) return false;
            }
            return true;
        }
    }
    return false;
}

// ---- parsing --------------------------------------------------------------------------------

class Parser {
  public:
    explicit Parser(std::string_view text)
        : begin_(text.data()), p_(text.data()), end_(text.data() + text.size()) {}

    Value parse_document() {
        // Editors on some systems save a byte order mark; RFC 8259 lets parsers ignore it.
        if (end_ - p_ >= 3 && std::string_view(p_, 3) == "\xEF\xBB\xBF") p_ += 3;
        skip_whitespace();
        Value value = parse_value(0);
        skip_whitespace();
        if (p_ != end_) fail(p_, "unexpected " + describe_byte(*p_) + " after the value");
        return value;
    }

  private:
    [[noreturn]] void fail(const char* at, const std::string& what) const {
        size_t line = 1;
        size_t column = 1;
        for (const char* c = begin_; c < at; ++c) {
            if (*c == '\n') {
                ++line;
                column = 1;
            } else if ((static_cast<unsigned char>(*c) & 0xC0) != 0x80) {
                ++column;  // columns count characters, not the bytes inside one
            }
        }
        throw FormatError("invalid JSON at line " + std::to_string(line) + " column " +
                          std::to_string(column) + ": " + what);
    }

    [[noreturn]] void fail_unexpected(const char* at) const {
        if (at == end_) fail(at, "unexpected end of input");
        fail(at, "unexpected " + describe_byte(*at));
    }

    void skip_whitespace() {
        while (p_ < end_ && (*p_ == ' ' || *p_ == '\n' || *p_ == '\r' || *p_ == '\t'))
            ++p_;
    }

    void expect(char c, const char* what) {
        if (p_ == end_ || *p_ != c) {
            if (p_ == end_) fail(p_, "unexpected end of input, " + std::string(what));
            fail(p_, "unexpected " + describe_byte(*p_) + ", " + what);
        }
        ++p_;
    }

    Value parse_value(int depth) {
        if (p_ == end_) fail(p_, "unexpected end of input, expected a value");
        switch (*p_) {
            case '{':
                return parse_object(depth + 1);
            case '[':
                return parse_array(depth + 1);
            case '"':
                return Value(parse_string());
            case 't':
                return parse_literal("true", Value(true));
            case 'f':
                return parse_literal("false", Value(false));
            case 'n':
                return parse_literal("null", Value());
            default:
                if (*p_ == '-' || is_digit(*p_)) return parse_number();
                fail(p_, "unexpected " + describe_byte(*p_) + ", expected a value");
        }
    }

    Value parse_literal(std::string_view word, Value value) {
        if (static_cast<size_t>(end_ - p_) < word.size() ||
            std::string_view(p_, word.size()) != word) {
            fail(p_, "invalid literal, expected '" + std::string(word) + "'");
        }
        p_ += word.size();
        return value;
    }

    void check_depth(int depth) const {
        if (depth > max_depth) {
            fail(p_, "nesting deeper than " + std::to_string(max_depth) + " levels");
        }
    }

    Value parse_array(int depth) {
        check_depth(depth);
        ++p_;
        Value::Array array;
        skip_whitespace();
        if (p_ < end_ && *p_ == ']') {
            ++p_;
            return Value(std::move(array));
        }
        while (true) {
            skip_whitespace();
            array.push_back(parse_value(depth));
            skip_whitespace();
            if (p_ < end_ && *p_ == ',') {
                ++p_;
                continue;
            }
            expect(']', "expected ',' or ']' in an array");
            return Value(std::move(array));
        }
    }

    Value parse_object(int depth) {
        check_depth(depth);
        ++p_;
        Value::Object object;
        skip_whitespace();
        if (p_ < end_ && *p_ == '}') {
            ++p_;
            return Value(std::move(object));
        }
        while (true) {
            skip_whitespace();
            if (p_ == end_ || *p_ != '"') {
                if (p_ == end_) fail(p_, "unexpected end of input, expected a string key");
                fail(p_, "unexpected " + describe_byte(*p_) + ", expected a string key");
            }
            std::string key = parse_string();
            skip_whitespace();
            expect(':', "expected ':' after an object key");
            skip_whitespace();
            Value value = parse_value(depth);
            object.emplace_back(std::move(key), std::move(value));
            skip_whitespace();
            if (p_ < end_ && *p_ == ',') {
                ++p_;
                continue;
            }
            expect('}', "expected ',' or '}' in an object");
            merge_repeated_keys(object);
            return Value(std::move(object));
        }
    }

    // A repeated key keeps its first position and takes the last value, as set() does (and as
    // Python's json module, which wrote most of the files read here, would see it).
    static void merge_repeated_keys(Value::Object& object) {
        std::vector<bool> dropped;
        auto drop = [&](size_t first, size_t repeat) {
            if (dropped.empty()) dropped.resize(object.size());
            object[first].second = std::move(object[repeat].second);
            dropped[repeat] = true;
        };
        if (object.size() <= 16) {
            for (size_t i = 1; i < object.size(); ++i) {
                for (size_t j = 0; j < i; ++j) {
                    if ((dropped.empty() || !dropped[j]) && object[j].first == object[i].first) {
                        drop(j, i);
                        break;
                    }
                }
            }
        } else {
            std::unordered_map<std::string_view, size_t> first_index;
            first_index.reserve(object.size());
            for (size_t i = 0; i < object.size(); ++i) {
                auto [it, inserted] = first_index.emplace(object[i].first, i);
                if (!inserted) drop(it->second, i);
            }
        }
        if (dropped.empty()) return;
        size_t kept = 0;
        for (size_t i = 0; i < object.size(); ++i) {
            if (!dropped[i]) {
                if (kept != i) object[kept] = std::move(object[i]);
                ++kept;
            }
        }
        object.resize(kept);
    }

    uint32_t parse_hex4() {
        if (end_ - p_ < 4) fail(p_, "unexpected end of input in a \\u escape");
        uint32_t value = 0;
        for (int i = 0; i < 4; ++i) {
            char c = p_[i];
            uint32_t digit;
            if (c >= '0' && c <= '9') {
                digit = c - '0';
            } else if (c >= 'a' && c <= 'f') {
                digit = c - 'a' + 10;
            } else if (c >= 'A' && c <= 'F') {
                digit = c - 'A' + 10;
            } else {
                fail(p_ + i, "invalid hex digit " + describe_byte(c) + " in a \\u escape");
            }
            value = value * 16 + digit;
        }
        p_ += 4;
        return value;
    }

    void parse_escape(std::string& out) {
        const char* escape = p_;
        ++p_;  // the backslash
        if (p_ == end_) fail(p_, "unexpected end of input in an escape");
        char c = *p_++;
        switch (c) {
            case '"':
                out += '"';
                return;
            case '\\':
                out += '\\';
                return;
            case '/':
                out += '/';
                return;
            case 'b':
                out += '\b';
                return;
            case 'f':
                out += '\f';
                return;
            case 'n':
                out += '\n';
                return;
            case 'r':
                out += '\r';
                return;
            case 't':
                out += '\t';
                return;
            case 'u':
                break;
            default:
                fail(escape, "invalid escape \\" + std::string(1, c));
        }
        uint32_t code_point = parse_hex4();
        if (code_point >= 0xDC00 && code_point <= 0xDFFF) {
            fail(escape, "lone low surrogate in a \\u escape");
        }
        if (code_point >= 0xD800 && code_point <= 0xDBFF) {
            if (end_ - p_ < 2 || p_[0] != '\\' || p_[1] != 'u') {
                fail(escape, "high surrogate not followed by a low surrogate");
            }
            p_ += 2;
            uint32_t low = parse_hex4();
            if (low < 0xDC00 || low > 0xDFFF) {
                fail(escape, "high surrogate not followed by a low surrogate");
            }
            code_point = 0x10000 + ((code_point - 0xD800) << 10) + (low - 0xDC00);
        }
        utf8::append(out, code_point);
    }

    std::string parse_string() {
        const char* opening = p_;
        ++p_;
        std::string out;
        while (true) {
            const char* run = p_;
            while (p_ < end_ && plain_string_bytes[static_cast<unsigned char>(*p_)])
                ++p_;
            out.append(run, p_);
            if (p_ == end_) fail(opening, "unterminated string");
            auto c = static_cast<unsigned char>(*p_);
            if (c == '"') {
                ++p_;
                return out;
            }
            if (c == '\\') {
                parse_escape(out);
            } else if (c < 0x20) {
                fail(p_, "unescaped control character in a string");
            } else {
                auto* bytes = reinterpret_cast<const unsigned char*>(p_);
                size_t length =
                    utf8::valid_length(bytes, reinterpret_cast<const unsigned char*>(end_));
                if (length == 0) fail(p_, "invalid UTF-8 in a string");
                out.append(p_, length);
                p_ += length;
            }
        }
    }

    Value parse_number() {
        const char* start = p_;
        bool negative = *p_ == '-';
        if (negative) ++p_;
        if (p_ == end_ || !is_digit(*p_)) fail(p_, "invalid number, expected a digit");
        const char* integer_digits = p_;
        if (*p_ == '0') {
            ++p_;
            if (p_ < end_ && is_digit(*p_)) fail(start, "invalid number, leading zero");
        } else {
            while (p_ < end_ && is_digit(*p_))
                ++p_;
        }
        const char* integer_end = p_;
        const char* fraction = nullptr;
        bool integral = true;
        if (p_ < end_ && *p_ == '.') {
            ++p_;
            fraction = p_;
            if (p_ == end_ || !is_digit(*p_)) fail(p_, "invalid number, expected a digit");
            while (p_ < end_ && is_digit(*p_))
                ++p_;
            integral = false;
        }
        const char* fraction_end = p_;
        int64_t exponent = 0;
        if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
            ++p_;
            bool negative_exponent = false;
            if (p_ < end_ && (*p_ == '+' || *p_ == '-')) negative_exponent = *p_++ == '-';
            if (p_ == end_ || !is_digit(*p_)) fail(p_, "invalid number, expected a digit");
            for (; p_ < end_ && is_digit(*p_); ++p_) {
                if (exponent < 100'000'000) exponent = exponent * 10 + (*p_ - '0');
            }
            if (negative_exponent) exponent = -exponent;
            integral = false;
        }
        if (integral) {
            int64_t i;
            auto result = std::from_chars(start, p_, i);
            if (result.ec == std::errc() && result.ptr == p_) return Value(i);
            uint64_t u;
            result = std::from_chars(start, p_, u);
            if (!negative && result.ec == std::errc() && result.ptr == p_) return Value(u);
        }
        double d;
        auto result = std::from_chars(start, p_, d);
        if (result.ec == std::errc::result_out_of_range) {
            // Too small to represent is zero; too large is refused (RFC 8259 section 9 allows
            // a range limit) rather than turned into an infinity JSON cannot write back.
            int64_t magnitude = exponent;
            if (integer_end - integer_digits > 1 || *integer_digits != '0') {
                magnitude += integer_end - integer_digits;
            } else if (fraction) {
                const char* first_significant = fraction;
                while (first_significant < fraction_end && *first_significant == '0') {
                    ++first_significant;
                }
                magnitude -= first_significant - fraction;
            }
            if (magnitude <= 0) return Value(negative ? -0.0 : 0.0);
            fail(start, "number out of range");
        }
        if (result.ec != std::errc() || result.ptr != p_) fail(start, "invalid number");
        return Value(d);
    }

    const char* begin_;
    const char* p_;
    const char* end_;
};

Value parse(std::string_view text) {
    return Parser(text).parse_document();
}

// ---- writing --------------------------------------------------------------------------------

class Writer {
  public:
    explicit Writer(int indent) : indent_(indent) {}

    std::string take() { return std::move(out_); }

    void write(const Value& value, int level) {
        switch (value.type()) {
            case Type::null:
                out_ += "null";
                return;
            case Type::boolean:
                out_ += value.as_bool() ? "true" : "false";
                return;
            case Type::number:
                write_number(std::get<Value::Number>(value.data_));
                return;
            case Type::string:
                write_string(value.as_string());
                return;
            case Type::array: {
                const auto& array = value.as_array();
                if (array.empty()) {
                    out_ += "[]";
                    return;
                }
                out_ += '[';
                for (size_t i = 0; i < array.size(); ++i) {
                    if (i > 0) out_ += ',';
                    newline(level + 1);
                    write(array[i], level + 1);
                }
                newline(level);
                out_ += ']';
                return;
            }
            case Type::object: {
                const auto& object = value.as_object();
                if (object.empty()) {
                    out_ += "{}";
                    return;
                }
                out_ += '{';
                for (size_t i = 0; i < object.size(); ++i) {
                    if (i > 0) out_ += ',';
                    newline(level + 1);
                    write_string(object[i].first);
                    out_ += indent_ < 0 ? ":" : ": ";
                    write(object[i].second, level + 1);
                }
                newline(level);
                out_ += '}';
                return;
            }
        }
    }

  private:
    void newline(int level) {
        if (indent_ < 0) return;
        out_ += '\n';
        out_.append(static_cast<size_t>(level) * static_cast<size_t>(indent_), ' ');
    }

    void write_number(const Value::Number& number) {
        using Kind = Value::Number::Kind;
        switch (number.kind) {
            case Kind::int64:
                out_ += std::to_string(number.i);
                return;
            case Kind::uint64:
                out_ += std::to_string(number.u);
                return;
            case Kind::real:
                if (!std::isfinite(number.d)) {
                    out_ += "null";
                } else {
                    out_ += format_double(number.d);
                }
                return;
        }
    }

    void write_string(std::string_view text) {
        static const char* const hex = "0123456789abcdef";
        out_ += '"';
        auto* bytes = reinterpret_cast<const unsigned char*>(text.data());
        auto* end = bytes + text.size();
        while (bytes < end) {
            const unsigned char* run = bytes;
            while (bytes < end && plain_string_bytes[*bytes])
                ++bytes;
            out_.append(reinterpret_cast<const char*>(run), bytes - run);
            if (bytes == end) break;
            unsigned char c = *bytes;
            if (c >= 0x80) {
                size_t length = utf8::valid_length(bytes, end);
                if (length == 0) {
                    out_ += utf8::replacement_character;  // the output must stay valid UTF-8
                    ++bytes;
                } else {
                    out_.append(reinterpret_cast<const char*>(bytes), length);
                    bytes += length;
                }
                continue;
            }
            ++bytes;
            switch (c) {
                case '"':
                    out_ += "\\\"";
                    break;
                case '\\':
                    out_ += "\\\\";
                    break;
                case '\b':
                    out_ += "\\b";
                    break;
                case '\f':
                    out_ += "\\f";
                    break;
                case '\n':
                    out_ += "\\n";
                    break;
                case '\r':
                    out_ += "\\r";
                    break;
                case '\t':
                    out_ += "\\t";
                    break;
                default:
                    out_ += "\\u00";
                    out_ += hex[c >> 4];
                    out_ += hex[c & 0xF];
            }
        }
        out_ += '"';
    }

    int indent_;
    std::string out_;
};

std::string dump(const Value& value, int indent) {
    Writer writer(indent);
    writer.write(value, 0);
    return writer.take();
}

}  // namespace kv::json
