// The Jinja subset of chat templates (kv/text/chat_template.hpp says what and why). Lexing
// follows jinja2's lexer with transformers' settings, parsing its parser's grammar, and values
// behave as the Python values jinja2 would hold.
#include "kv/text/chat_template.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <ctime>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <unordered_map>
#include <variant>
#include <vector>

#include "utf8.hpp"

namespace kv::text {

ChatTemplateError::ChatTemplateError(const std::string& message, int line, int column)
    : Error(message), line_(line), column_(column) {}

struct ChatTemplateAccess {
    static void mark_raised(ChatTemplateError& error) { error.raised_ = true; }
};

namespace {

// ---------------------------------------------------------------------------------------------
// Positions and errors

struct Pos {
    int line = 1, column = 1;
};

std::string where(Pos pos) {
    return "chat template line " + std::to_string(pos.line) + " column " +
           std::to_string(pos.column) + ": ";
}

[[noreturn]] void syntax_error(Pos pos, const std::string& what) {
    throw FormatError(where(pos) + what);
}
[[noreturn]] void unsupported(Pos pos, const std::string& what) {
    throw UnsupportedError(where(pos) + "unsupported: " + what);
}
[[noreturn]] void render_error(Pos pos, const std::string& what) {
    throw ChatTemplateError(where(pos) + what, pos.line, pos.column);
}

// ---------------------------------------------------------------------------------------------
// UTF-8 and Python's notion of whitespace

std::vector<uint32_t> code_points(std::string_view text) {
    std::vector<uint32_t> out;
    out.reserve(text.size());
    auto* p = reinterpret_cast<const unsigned char*>(text.data());
    auto* end = p + text.size();
    while (p < end) {
        size_t length = utf8::valid_length(p, end);
        if (length == 0) {
            out.push_back(0xFFFD);  // never produced from valid input: JSON strings are UTF-8
            ++p;
            continue;
        }
        out.push_back(utf8::decode(p, length));
        p += length;
    }
    return out;
}

void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

std::string from_code_points(const std::vector<uint32_t>& cps, size_t begin, size_t end) {
    std::string out;
    for (size_t i = begin; i < end; ++i)
        append_utf8(out, cps[i]);
    return out;
}

size_t code_point_count(std::string_view text) {
    size_t n = 0;
    for (char c : text)
        n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
    return n;
}

// str.isspace(): the characters of bidirectional class WS, B or S, or category Zs.
bool is_space(uint32_t cp) {
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x1F)) return true;
    if (cp < 0x80) return false;
    return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
           cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

bool is_ascii(std::string_view text) {
    return std::all_of(text.begin(), text.end(),
                       [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

// Python's str.strip family; chars=nullopt strips whitespace.
std::string strip(std::string_view text, const std::optional<std::string>& chars, bool left,
                  bool right) {
    std::vector<uint32_t> cps = code_points(text);
    std::vector<uint32_t> set;
    if (chars) set = code_points(*chars);
    auto strips = [&](uint32_t cp) {
        return chars ? std::find(set.begin(), set.end(), cp) != set.end() : is_space(cp);
    };
    size_t begin = 0, end = cps.size();
    if (left)
        while (begin < end && strips(cps[begin]))
            ++begin;
    if (right)
        while (end > begin && strips(cps[end - 1]))
            --end;
    return from_code_points(cps, begin, end);
}

// ---------------------------------------------------------------------------------------------
// Values: what jinja2 would hold, with Python's behaviour

struct Value;
struct ListObj;
struct DictObj;
struct Object;
struct Callable;
class Context;

struct Undefined {
    std::string hint;  // Jinja's message when it is used: "'x' is undefined"
};
struct None {};

struct Value {
    std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<ListObj>,
                 std::shared_ptr<DictObj>, std::shared_ptr<Object>, std::shared_ptr<Callable>>
        v;

    Value() : v(Undefined{}) {}
    static Value undefined(std::string hint) {
        Value x;
        x.v = Undefined{std::move(hint)};
        return x;
    }
    static Value none() {
        Value x;
        x.v = None{};
        return x;
    }
    Value(bool b) : v(b) {}
    Value(int64_t i) : v(i) {}
    Value(int i) : v(static_cast<int64_t>(i)) {}
    Value(size_t i) : v(static_cast<int64_t>(i)) {}
    Value(double d) : v(d) {}
    Value(std::string s) : v(std::move(s)) {}
    Value(const char* s) : v(std::string(s)) {}
    Value(std::shared_ptr<ListObj> l) : v(std::move(l)) {}
    Value(std::shared_ptr<DictObj> d) : v(std::move(d)) {}
    Value(std::shared_ptr<Object> o) : v(std::move(o)) {}
    Value(std::shared_ptr<Callable> c) : v(std::move(c)) {}

    bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
    bool is_none() const { return std::holds_alternative<None>(v); }
    bool is_bool() const { return std::holds_alternative<bool>(v); }
    bool is_int() const { return std::holds_alternative<int64_t>(v); }
    bool is_float() const { return std::holds_alternative<double>(v); }
    bool is_string() const { return std::holds_alternative<std::string>(v); }
    bool is_list() const { return std::holds_alternative<std::shared_ptr<ListObj>>(v); }
    bool is_dict() const { return std::holds_alternative<std::shared_ptr<DictObj>>(v); }
    bool is_object() const { return std::holds_alternative<std::shared_ptr<Object>>(v); }
    bool is_callable() const { return std::holds_alternative<std::shared_ptr<Callable>>(v); }
    // bool is an int in Python's arithmetic and comparisons.
    bool is_integral() const { return is_int() || is_bool(); }
    bool is_number() const { return is_integral() || is_float(); }

    const std::string& str() const { return std::get<std::string>(v); }
    const Undefined& undef() const { return std::get<Undefined>(v); }
    const ListObj& list() const { return *std::get<std::shared_ptr<ListObj>>(v); }
    const DictObj& dict() const { return *std::get<std::shared_ptr<DictObj>>(v); }
    const std::shared_ptr<ListObj>& list_ptr() const {
        return std::get<std::shared_ptr<ListObj>>(v);
    }
    const std::shared_ptr<DictObj>& dict_ptr() const {
        return std::get<std::shared_ptr<DictObj>>(v);
    }
    Object& object() const { return *std::get<std::shared_ptr<Object>>(v); }
    const std::shared_ptr<Object>& object_ptr() const {
        return std::get<std::shared_ptr<Object>>(v);
    }
    const Callable& callable() const { return *std::get<std::shared_ptr<Callable>>(v); }
    int64_t integer() const {
        return is_bool() ? int64_t(std::get<bool>(v)) : std::get<int64_t>(v);
    }
    double real() const { return is_float() ? std::get<double>(v) : double(integer()); }
};

struct ListObj {
    std::vector<Value> items;
    bool tuple = false;
    const char* view = nullptr;  // dict_keys, dict_values, dict_items: how repr() names it
};

struct DictObj {
    std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python's dict
    const Value* find(std::string_view key) const {
        for (auto& [k, v] : items)
            if (k == key) return &v;
        return nullptr;
    }
    void set(const std::string& key, Value value) {
        for (auto& [k, v] : items) {
            if (k == key) {
                v = std::move(value);
                return;
            }
        }
        items.emplace_back(key, std::move(value));
    }
};

Value make_list(std::vector<Value> items, bool tuple = false) {
    auto list = std::make_shared<ListObj>();
    list->items = std::move(items);
    list->tuple = tuple;
    return Value(list);
}

struct Args {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keyword;
};

struct Callable {
    std::string name;  // for messages and repr
    std::function<Value(Context&, Args&)> call;
};

// Objects with attributes: namespace(), the loop variable.
struct Object {
    virtual ~Object() = default;
    virtual std::string type_name() const = 0;
    virtual Value attribute(const std::string& name) = 0;
    /// Drops the values it holds (RenderArena: the end of the render).
    virtual void release() {}
};

struct Namespace : Object {
    DictObj attributes;
    std::string type_name() const override { return "Namespace"; }
    void release() override { attributes.items.clear(); }
    Value attribute(const std::string& name) override {
        if (const Value* v = attributes.find(name)) return *v;
        return Value::undefined("'Namespace' object has no attribute '" + name + "'");
    }
};

Value make_callable(std::string name, std::function<Value(Context&, Args&)> call) {
    auto c = std::make_shared<Callable>();
    c->name = std::move(name);
    c->call = std::move(call);
    return Value(c);
}

// Python's type names, for error messages.
std::string type_name(const Value& x) {
    switch (x.v.index()) {
        case 0:
            return "Undefined";
        case 1:
            return "NoneType";
        case 2:
            return "bool";
        case 3:
            return "int";
        case 4:
            return "float";
        case 5:
            return "str";
        case 6:
            return x.list().tuple ? "tuple" : "list";
        case 7:
            return "dict";
        case 8:
            return x.object().type_name();
        default:
            return "function";
    }
}

// repr(float) as Python writes it: the shortest digits that round-trip, fixed notation for
// exponents from -4 to 15, else d.ddde+XX.
std::string float_repr(double d, bool json) {
    if (std::isnan(d)) return json ? "NaN" : "nan";
    if (std::isinf(d)) return d > 0 ? (json ? "Infinity" : "inf") : (json ? "-Infinity" : "-inf");
    char buffer[64];
    auto result = std::to_chars(buffer, buffer + sizeof buffer, d, std::chars_format::scientific);
    std::string sci(buffer, result.ptr);
    bool negative = sci[0] == '-';
    if (negative) sci.erase(0, 1);
    size_t e = sci.find('e');
    std::string mantissa = sci.substr(0, e);
    int exponent = std::stoi(sci.substr(e + 1));
    std::string digits;
    for (char c : mantissa)
        if (c != '.') digits += c;
    std::string out;
    if (exponent >= -4 && exponent < 16) {
        if (exponent >= 0) {
            if (digits.size() <= size_t(exponent) + 1) {
                out = digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
            } else {
                out = digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
            }
        } else {
            out = "0." + std::string(-exponent - 1, '0') + digits;
        }
    } else {
        out = digits.substr(0, 1);
        if (digits.size() > 1) out += "." + digits.substr(1);
        char exp[16];
        std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
        out += exp;
    }
    return (negative ? "-" : "") + out;
}

// Characters repr() writes escaped: control characters, and the non-ASCII ones Python's
// str.isprintable() rejects among those a chat could hold (separators, format characters,
// surrogates, private use, non-characters).
bool repr_escapes(uint32_t cp) {
    if (cp < 0x20 || cp == 0x7F) return true;
    if (cp < 0x80) return false;
    if (cp <= 0xA0 || cp == 0xAD) return true;
    if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200F) || (cp >= 0x2028 && cp <= 0x202F) ||
        (cp >= 0x205F && cp <= 0x206F) || cp == 0x3000 || cp == 0xFEFF)
        return true;
    if (cp == 0x061C || cp == 0x180E || (cp >= 0xFFF9 && cp <= 0xFFFB)) return true;
    if ((cp >= 0xD800 && cp <= 0xF8FF) || cp >= 0xF0000) return true;
    if ((cp & 0xFFFE) == 0xFFFE) return true;
    return false;
}

std::string string_repr(const std::string& s) {
    bool has_single = s.find('\'') != std::string::npos;
    bool has_double = s.find('"') != std::string::npos;
    char quote = has_single && !has_double ? '"' : '\'';
    std::string out(1, quote);
    for (uint32_t cp : code_points(s)) {
        if (cp == static_cast<uint32_t>(quote) || cp == '\\') {
            out += '\\';
            out += static_cast<char>(cp);
        } else if (cp == '\n') {
            out += "\\n";
        } else if (cp == '\r') {
            out += "\\r";
        } else if (cp == '\t') {
            out += "\\t";
        } else if (repr_escapes(cp)) {
            char buffer[16];
            if (cp < 0x100)
                std::snprintf(buffer, sizeof buffer, "\\x%02x", cp);
            else if (cp < 0x10000)
                std::snprintf(buffer, sizeof buffer, "\\u%04x", cp);
            else
                std::snprintf(buffer, sizeof buffer, "\\U%08x", cp);
            out += buffer;
        } else {
            append_utf8(out, cp);
        }
    }
    out += quote;
    return out;
}

std::string repr(const Value& x);

// Values nest as deep as a template builds them (a namespace attribute wrapped in a list at each
// step of a loop). Python's repr, == and json.dumps stop at its recursion limit; these walks stop
// too, instead of overflowing the stack.
constexpr int max_value_depth = 500;
thread_local int value_depth = 0;
struct ValueDepth {
    ValueDepth() {
        if (++value_depth > max_value_depth) {
            value_depth = 0;
            throw ChatTemplateError("chat template: a value nested deeper than " +
                                        std::to_string(max_value_depth) +
                                        " levels (Python's recursion limit)",
                                    0, 0);
        }
    }
    ~ValueDepth() {
        if (value_depth > 0) --value_depth;
    }
    ValueDepth(const ValueDepth&) = delete;
    ValueDepth& operator=(const ValueDepth&) = delete;
};

// str(x) as Python gives it (Jinja's output of {{ x }} and the ~ operator).
std::string to_str(const Value& x) {
    switch (x.v.index()) {
        case 0:
            return "";
        case 1:
            return "None";
        case 2:
            return std::get<bool>(x.v) ? "True" : "False";
        case 3:
            return std::to_string(std::get<int64_t>(x.v));
        case 4:
            return float_repr(std::get<double>(x.v), false);
        case 5:
            return x.str();
        default:
            return repr(x);
    }
}

std::string repr(const Value& x) {
    const ValueDepth depth;
    if (x.is_string()) return string_repr(x.str());
    if (x.is_list()) {
        const ListObj& l = x.list();
        std::string out = l.tuple ? "(" : "[";
        for (size_t i = 0; i < l.items.size(); ++i) {
            if (i) out += ", ";
            out += repr(l.items[i]);
        }
        if (l.tuple && l.items.size() == 1) out += ",";
        out += l.tuple ? ")" : "]";
        if (l.view) return std::string(l.view) + "(" + out + ")";
        return out;
    }
    if (x.is_dict()) {
        std::string out = "{";
        bool first = true;
        for (auto& [k, v] : x.dict().items) {
            if (!first) out += ", ";
            first = false;
            out += string_repr(k) + ": " + repr(v);
        }
        return out + "}";
    }
    if (x.is_object()) {
        if (auto* ns = dynamic_cast<Namespace*>(&x.object())) {
            std::string out = "<Namespace {";
            bool first = true;
            for (auto& [k, v] : ns->attributes.items) {
                if (!first) out += ", ";
                first = false;
                out += string_repr(k) + ": " + repr(v);
            }
            return out + "}>";
        }
        return "<" + x.object().type_name() + " object>";
    }
    if (x.is_callable()) return "<function " + x.callable().name + ">";
    return to_str(x);
}

bool truthy(const Value& x) {
    switch (x.v.index()) {
        case 0:
        case 1:
            return false;
        case 2:
            return std::get<bool>(x.v);
        case 3:
            return std::get<int64_t>(x.v) != 0;
        case 4:
            return std::get<double>(x.v) != 0.0;
        case 5:
            return !x.str().empty();
        case 6:
            return !x.list().items.empty();
        case 7:
            return !x.dict().items.empty();
        default:
            return true;
    }
}

bool equal(const Value& a, const Value& b) {
    const ValueDepth depth;
    if (a.is_number() && b.is_number()) {
        if (a.is_float() || b.is_float()) return a.real() == b.real();
        return a.integer() == b.integer();
    }
    if (a.v.index() != b.v.index()) return false;
    switch (a.v.index()) {
        case 0:
        case 1:
            return true;
        case 5:
            return a.str() == b.str();
        case 6: {
            const ListObj &x = a.list(), &y = b.list();
            if (x.tuple != y.tuple || x.items.size() != y.items.size()) return false;
            for (size_t i = 0; i < x.items.size(); ++i)
                if (!equal(x.items[i], y.items[i])) return false;
            return true;
        }
        case 7: {
            const DictObj &x = a.dict(), &y = b.dict();
            if (x.items.size() != y.items.size()) return false;
            for (auto& [k, v] : x.items) {
                const Value* w = y.find(k);
                if (!w || !equal(v, *w)) return false;
            }
            return true;
        }
        case 8:
            return a.object_ptr() == b.object_ptr();
        case 9:
            return std::get<std::shared_ptr<Callable>>(a.v) ==
                   std::get<std::shared_ptr<Callable>>(b.v);
        default:
            return false;
    }
}

// Python's ordering: numbers with numbers, strings by code point (UTF-8 byte order is the same),
// lists and tuples element by element; anything else is a TypeError. Returns -1, 0 or 1.
int compare(const Value& a, const Value& b, Pos pos, const char* op) {
    const ValueDepth depth;
    if (a.is_number() && b.is_number()) {
        if (a.is_float() || b.is_float()) {
            double x = a.real(), y = b.real();
            return x < y ? -1 : x > y ? 1 : 0;
        }
        int64_t x = a.integer(), y = b.integer();
        return x < y ? -1 : x > y ? 1 : 0;
    }
    if (a.is_string() && b.is_string()) {
        int c = a.str().compare(b.str());
        return c < 0 ? -1 : c > 0 ? 1 : 0;
    }
    if (a.is_list() && b.is_list() && a.list().tuple == b.list().tuple) {
        const auto &x = a.list().items, &y = b.list().items;
        for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
            if (equal(x[i], y[i])) continue;
            return compare(x[i], y[i], pos, op);
        }
        return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
    }
    render_error(pos, std::string("'") + op + "' not supported between instances of '" +
                          type_name(a) + "' and '" + type_name(b) + "'");
}

// Jinja's error for a value that is undefined and used as if it were not.
[[noreturn]] void undefined_error(Pos pos, const Value& x) {
    const std::string& hint = x.undef().hint;
    render_error(pos, hint.empty() ? std::string("undefined value used") : hint);
}

// ---------------------------------------------------------------------------------------------
// json.dumps(x, ensure_ascii=False, indent=..., separators=..., sort_keys=...) as transformers'
// tojson calls it

struct JsonStyle {
    std::optional<std::string> indent;  // None: one line
    std::string item_separator = ", ", key_separator = ": ";
    bool sort_keys = false;
};

void json_string(std::string& out, const std::string& s) {
    out += '"';
    for (unsigned char c : s) {
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            case '\b':
                out += "\\b";
                break;
            case '\f':
                out += "\\f";
                break;
            default:
                if (c < 0x20) {
                    char buffer[8];
                    std::snprintf(buffer, sizeof buffer, "\\u%04x", c);
                    out += buffer;
                } else {
                    out += static_cast<char>(c);
                }
        }
    }
    out += '"';
}

void json_dump(std::string& out, const Value& x, const JsonStyle& style, int level, Pos pos) {
    const ValueDepth depth;
    auto newline = [&](int depth) {
        if (!style.indent) return;
        out += '\n';
        for (int i = 0; i < depth; ++i)
            out += *style.indent;
    };
    switch (x.v.index()) {
        case 1:
            out += "null";
            return;
        case 2:
            out += std::get<bool>(x.v) ? "true" : "false";
            return;
        case 3:
            out += std::to_string(std::get<int64_t>(x.v));
            return;
        case 4:
            out += float_repr(std::get<double>(x.v), true);
            return;
        case 5:
            json_string(out, x.str());
            return;
        case 6: {
            const auto& items = x.list().items;
            if (items.empty()) {
                out += "[]";
                return;
            }
            out += '[';
            for (size_t i = 0; i < items.size(); ++i) {
                if (i) out += style.item_separator;
                newline(level + 1);
                json_dump(out, items[i], style, level + 1, pos);
            }
            newline(level);
            out += ']';
            return;
        }
        case 7: {
            std::vector<const std::pair<std::string, Value>*> items;
            for (auto& item : x.dict().items)
                items.push_back(&item);
            if (style.sort_keys)
                std::stable_sort(items.begin(), items.end(),
                                 [](auto* a, auto* b) { return a->first < b->first; });
            if (items.empty()) {
                out += "{}";
                return;
            }
            out += '{';
            for (size_t i = 0; i < items.size(); ++i) {
                if (i) out += style.item_separator;
                newline(level + 1);
                json_string(out, items[i]->first);
                out += style.key_separator;
                json_dump(out, items[i]->second, style, level + 1, pos);
            }
            newline(level);
            out += '}';
            return;
        }
        default:
            render_error(pos, "Object of type " + type_name(x) + " is not JSON serializable");
    }
}

Value from_json(const json::Value& j) {
    switch (j.type()) {
        case json::Type::null:
            return Value::none();
        case json::Type::boolean:
            return Value(j.as_bool());
        case json::Type::number:
            if (j.is_integer()) return Value(j.as_int());
            return Value(j.as_double());
        case json::Type::string:
            return Value(j.as_string());
        case json::Type::array: {
            std::vector<Value> items;
            for (const auto& e : j.as_array())
                items.push_back(from_json(e));
            return make_list(std::move(items));
        }
        case json::Type::object: {
            auto d = std::make_shared<DictObj>();
            for (const auto& [k, v] : j.as_object())
                d->set(k, from_json(v));
            return Value(d);
        }
    }
    return Value::none();
}

// ---------------------------------------------------------------------------------------------
// Lexer: jinja2's, with trim_blocks, lstrip_blocks, "\n" newlines and no trailing newline

enum class Tok {
    data,
    var_begin,
    var_end,
    block_begin,
    block_end,
    name,
    string,
    integer,
    real,
    op,
    eof
};

struct Token {
    Tok type;
    std::string text;  // data, name, operator, the decoded string
    int64_t integer = 0;
    double real = 0;
    Pos pos;
};

class Lexer {
  public:
    explicit Lexer(std::string_view source) {
        // Newlines are normalised to "\n" and one trailing newline dropped
        // (keep_trailing_newline=False), before anything else, string literals included.
        std::string normalized;
        normalized.reserve(source.size());
        for (size_t i = 0; i < source.size(); ++i) {
            if (source[i] == '\r') {
                normalized += '\n';
                if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
            } else {
                normalized += source[i];
            }
        }
        if (!normalized.empty() && normalized.back() == '\n') normalized.pop_back();
        src_ = std::move(normalized);
    }

    std::vector<Token> tokenize() {
        size_t pos = 0;
        bool line_starting = true;
        while (pos < src_.size()) {
            size_t start = find_tag(pos);
            if (start == std::string::npos) {
                emit_data(src_.substr(pos), pos);
                break;
            }
            char kind = src_[start + 1];
            char modifier = start + 2 < src_.size() ? src_[start + 2] : '\0';
            if (modifier != '-' && modifier != '+') modifier = '\0';
            std::string text = src_.substr(pos, start - pos);
            if (modifier == '-') {
                text = strip(text, std::nullopt, false, true);
            } else if (modifier != '+' && kind != '{') {
                // lstrip_blocks: whitespace alone between a line's start and a block or comment
                size_t l_pos = text.rfind('\n');
                l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
                if (l_pos > 0 || line_starting) {
                    std::string_view rest(text.data() + l_pos, text.size() - l_pos);
                    if (!rest.empty()) {
                        auto cps = code_points(rest);
                        if (std::all_of(cps.begin(), cps.end(), is_space)) text.resize(l_pos);
                    }
                }
            }
            emit_data(text, pos);
            size_t after = start + 2 + (modifier ? 1 : 0);
            if (kind == '#') {
                pos = comment(start, after, line_starting);
            } else if (kind == '%' && is_raw(after)) {
                pos = raw(start, after, line_starting);
            } else {
                pos = tag(kind, start, after, line_starting);
            }
        }
        tokens_.push_back(Token{Tok::eof, "", 0, 0, position(src_.size())});
        return std::move(tokens_);
    }

  private:
    std::string src_;
    std::vector<Token> tokens_;
    size_t last_offset_ = 0;
    Pos last_;

    // Line and column (in code points) of a byte offset. Tokens ask in increasing order, so the
    // last answer is carried forward: linear in the template, however long its lines.
    Pos position(size_t offset) {
        if (offset < last_offset_) {
            last_offset_ = 0;
            last_ = Pos{};
        }
        for (size_t i = last_offset_; i < offset && i < src_.size(); ++i) {
            const unsigned char c = static_cast<unsigned char>(src_[i]);
            if (c == '\n') {
                ++last_.line;
                last_.column = 1;
            } else if ((c & 0xC0) != 0x80) {
                ++last_.column;
            }
        }
        last_offset_ = offset;
        return last_;
    }

    size_t find_tag(size_t from) const {
        for (size_t i = src_.find('{', from); i != std::string::npos; i = src_.find('{', i + 1)) {
            if (i + 1 < src_.size() &&
                (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
                return i;
        }
        return std::string::npos;
    }

    void emit_data(const std::string& text, size_t at) {
        if (!text.empty()) tokens_.push_back(Token{Tok::data, text, 0, 0, position(at)});
    }

    size_t skip_space(size_t i) const {
        while (i < src_.size() && std::isspace(static_cast<unsigned char>(src_[i])))
            ++i;
        return i;
    }

    // After a block or comment end: "-%}" strips the whitespace that follows, "+%}" keeps it,
    // and "%}" drops one newline (trim_blocks).
    size_t after_end(size_t end, char modifier, bool& line_starting) {
        size_t i = end;
        if (modifier == '-') {
            // \s* over Unicode whitespace, as Python's re does
            while (i < src_.size()) {
                size_t length = utf8::valid_length(src_, i);
                if (length == 0) break;
                uint32_t cp =
                    utf8::decode(reinterpret_cast<const unsigned char*>(src_.data()) + i, length);
                if (!is_space(cp)) break;
                i += length;
            }
        } else if (modifier != '+' && i < src_.size() && src_[i] == '\n') {
            ++i;
        }
        line_starting = i > 0 && src_[i - 1] == '\n';
        return i;
    }

    size_t comment(size_t start, size_t after, bool& line_starting) {
        size_t end = src_.find("#}", after);
        if (end == std::string::npos) syntax_error(position(start), "missing end of comment tag");
        char modifier =
            end > after && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : '\0';
        return after_end(end + 2, modifier, line_starting);
    }

    bool is_raw(size_t after) const {
        size_t i = skip_space(after);
        if (src_.compare(i, 3, "raw") != 0) return false;
        i = skip_space(i + 3);
        return src_.compare(i, 2, "%}") == 0 || src_.compare(i, 3, "-%}") == 0;
    }

    size_t raw(size_t start, size_t after, bool& line_starting) {
        size_t i = skip_space(skip_space(after) + 3);
        bool strip_after = src_[i] == '-';
        i += strip_after ? 3 : 2;
        if (strip_after) i = after_end(i, '-', line_starting);
        // {% endraw %}, with its own whitespace control
        for (size_t e = src_.find("{%", i); e != std::string::npos; e = src_.find("{%", e + 2)) {
            size_t j = e + 2;
            char modifier = src_[j] == '-' || src_[j] == '+' ? src_[j] : '\0';
            if (modifier) ++j;
            j = skip_space(j);
            if (src_.compare(j, 6, "endraw") != 0) continue;
            j = skip_space(j + 6);
            char end_modifier = src_[j] == '-' || src_[j] == '+' ? src_[j] : '\0';
            if (end_modifier) ++j;
            if (src_.compare(j, 2, "%}") != 0) continue;
            std::string text = src_.substr(i, e - i);
            if (modifier == '-') {
                text = strip(text, std::nullopt, false, true);
            } else if (modifier != '+') {
                size_t l_pos = text.rfind('\n');
                l_pos = l_pos == std::string::npos ? 0 : l_pos + 1;
                std::string_view rest(text.data() + l_pos, text.size() - l_pos);
                auto cps = code_points(rest);
                if (l_pos > 0 && !rest.empty() && std::all_of(cps.begin(), cps.end(), is_space))
                    text.resize(l_pos);
            }
            emit_data(text, i);
            return after_end(j + 2, end_modifier, line_starting);
        }
        syntax_error(position(start), "missing endraw");
    }

    size_t tag(char kind, size_t start, size_t after, bool& line_starting) {
        Pos begin = position(start);
        tokens_.push_back(Token{kind == '{' ? Tok::var_begin : Tok::block_begin, "", 0, 0, begin});
        const char* close = kind == '{' ? "}}" : "%}";
        int depth = 0;  // open brackets: an end marker inside them is not the end (jinja2's rule)
        size_t i = after;
        while (true) {
            i = skip_space(i);
            if (i >= src_.size())
                syntax_error(begin,
                             std::string("unexpected end of template, expected '") + close + "'");
            if (depth == 0) {
                char modifier = src_[i] == '-' || (kind == '%' && src_[i] == '+') ? src_[i] : '\0';
                size_t j = i + (modifier ? 1 : 0);
                if (src_.compare(j, 2, close) == 0) {
                    tokens_.push_back(
                        Token{kind == '{' ? Tok::var_end : Tok::block_end, "", 0, 0, position(i)});
                    if (kind == '{') {
                        // no trim_blocks after variables; "-}}" strips what follows
                        return after_end(j + 2, modifier == '-' ? '-' : '+', line_starting);
                    }
                    return after_end(j + 2, modifier, line_starting);
                }
            }
            i = expression_token(i, depth);
        }
    }

    size_t expression_token(size_t i, int& depth) {
        Pos pos = position(i);
        char c = src_[i];
        if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
            size_t j = i;
            while (j < src_.size() &&
                   (std::isalnum(static_cast<unsigned char>(src_[j])) || src_[j] == '_'))
                ++j;
            tokens_.push_back(Token{Tok::name, src_.substr(i, j - i), 0, 0, pos});
            return j;
        }
        if (std::isdigit(static_cast<unsigned char>(c))) return number(i, pos);
        if (c == '\'' || c == '"') return string_literal(i, pos);
        static const char* const two[] = {"//", "**", "==", "!=", ">=", "<="};
        for (const char* op : two) {
            if (src_.compare(i, 2, op) == 0) {
                tokens_.push_back(Token{Tok::op, op, 0, 0, pos});
                return i + 2;
            }
        }
        if (std::string_view("+-/*%~[](){}><=.:|,;").find(c) != std::string_view::npos) {
            if (c == '(' || c == '[' || c == '{') ++depth;
            if ((c == ')' || c == ']' || c == '}') && depth > 0) --depth;
            tokens_.push_back(Token{Tok::op, std::string(1, c), 0, 0, pos});
            return i + 1;
        }
        syntax_error(pos, "unexpected character " + string_repr(std::string(1, c)));
    }

    size_t number(size_t i, Pos pos) {
        auto digits = [&](size_t j) {
            // (\d+_)*\d+
            size_t k = j;
            while (k < src_.size() &&
                   (std::isdigit(static_cast<unsigned char>(src_[k])) ||
                    (src_[k] == '_' && k + 1 < src_.size() &&
                     std::isdigit(static_cast<unsigned char>(src_[k + 1])) && k > j)))
                ++k;
            return k;
        };
        auto clean = [](std::string s) {
            s.erase(std::remove(s.begin(), s.end(), '_'), s.end());
            return s;
        };
        if (src_[i] == '0' && i + 1 < src_.size() && std::strchr("bBoOxX", src_[i + 1])) {
            int base = std::tolower(src_[i + 1]) == 'b'   ? 2
                       : std::tolower(src_[i + 1]) == 'o' ? 8
                                                          : 16;
            size_t j = i + 2;
            while (j < src_.size() &&
                   (std::isxdigit(static_cast<unsigned char>(src_[j])) || src_[j] == '_'))
                ++j;
            std::string text = clean(src_.substr(i + 2, j - i - 2));
            int64_t value = 0;
            auto r = std::from_chars(text.data(), text.data() + text.size(), value, base);
            if (r.ec != std::errc() || r.ptr != text.data() + text.size())
                unsupported(pos, "integer literal " + src_.substr(i, j - i));
            tokens_.push_back(Token{Tok::integer, src_.substr(i, j - i), value, 0, pos});
            return j;
        }
        size_t j = digits(i);
        bool after_dot = i > 0 && src_[i - 1] == '.';  // "x.0.1" is two attributes
        bool is_real = false;
        size_t k = j;
        if (!after_dot && k + 1 < src_.size() && src_[k] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[k + 1]))) {
            k = digits(k + 1);
            is_real = true;
        }
        if (!after_dot && k < src_.size() && (src_[k] == 'e' || src_[k] == 'E')) {
            size_t m = k + 1;
            if (m < src_.size() && (src_[m] == '+' || src_[m] == '-')) ++m;
            if (m < src_.size() && std::isdigit(static_cast<unsigned char>(src_[m]))) {
                k = digits(m);
                is_real = true;
            }
        }
        if (is_real) {
            std::string text = clean(src_.substr(i, k - i));
            tokens_.push_back(Token{Tok::real, text, 0, std::strtod(text.c_str(), nullptr), pos});
            return k;
        }
        std::string text = clean(src_.substr(i, j - i));
        int64_t value = 0;
        auto r = std::from_chars(text.data(), text.data() + text.size(), value);
        if (r.ec != std::errc()) unsupported(pos, "integer literal " + text + " (beyond 64 bits)");
        tokens_.push_back(Token{Tok::integer, text, value, 0, pos});
        return j;
    }

    // A string literal, decoded as jinja2 does: Python's unicode-escape over the source.
    size_t string_literal(size_t i, Pos pos) {
        char quote = src_[i];
        std::string out;
        size_t j = i + 1;
        while (true) {
            if (j >= src_.size()) syntax_error(pos, "unterminated string");
            char c = src_[j];
            if (c == quote) break;
            if (c != '\\') {
                out += c;
                ++j;
                continue;
            }
            if (j + 1 >= src_.size()) syntax_error(pos, "unterminated string");
            char e = src_[j + 1];
            j += 2;
            auto hex = [&](int n) {
                if (j + n > src_.size()) syntax_error(pos, "truncated \\x, \\u or \\U escape");
                uint32_t cp = 0;
                for (int k = 0; k < n; ++k) {
                    char h = src_[j + k];
                    if (!std::isxdigit(static_cast<unsigned char>(h)))
                        syntax_error(pos, "truncated \\x, \\u or \\U escape");
                    cp = cp * 16 + (std::isdigit(static_cast<unsigned char>(h))
                                        ? h - '0'
                                        : std::tolower(h) - 'a' + 10);
                }
                j += n;
                if (cp > 0x10FFFF) syntax_error(pos, "illegal Unicode character in escape");
                if (cp >= 0xD800 && cp <= 0xDFFF)
                    unsupported(pos, "a surrogate code point in a string escape");
                append_utf8(out, cp);
            };
            switch (e) {
                case '\n':
                    break;
                case '\\':
                    out += '\\';
                    break;
                case '\'':
                    out += '\'';
                    break;
                case '"':
                    out += '"';
                    break;
                case 'a':
                    out += '\a';
                    break;
                case 'b':
                    out += '\b';
                    break;
                case 'f':
                    out += '\f';
                    break;
                case 'n':
                    out += '\n';
                    break;
                case 'r':
                    out += '\r';
                    break;
                case 't':
                    out += '\t';
                    break;
                case 'v':
                    out += '\v';
                    break;
                case 'x':
                    hex(2);
                    break;
                case 'u':
                    hex(4);
                    break;
                case 'U':
                    hex(8);
                    break;
                case 'N':
                    unsupported(pos, "\\N{...} escape in a string");
                default:
                    if (e >= '0' && e <= '7') {
                        uint32_t cp = e - '0';
                        for (int k = 0;
                             k < 2 && j < src_.size() && src_[j] >= '0' && src_[j] <= '7'; ++k)
                            cp = cp * 8 + (src_[j++] - '0');
                        append_utf8(out, cp);
                    } else {
                        // an unknown escape keeps its backslash; the character after it is
                        // copied as it is (it may be the first byte of a UTF-8 sequence)
                        out += '\\';
                        out += e;
                    }
            }
        }
        tokens_.push_back(Token{Tok::string, out, 0, 0, pos});
        return j + 1;
    }
};

// ---------------------------------------------------------------------------------------------
// Syntax tree

struct Expr {
    Pos pos;
    virtual ~Expr() = default;
    virtual Value eval(Context& ctx) const = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt {
    Pos pos;
    virtual ~Stmt() = default;
};
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct CallArgs {
    std::vector<ExprPtr> positional;
    std::vector<std::pair<std::string, ExprPtr>> keyword;
    ExprPtr spread_positional, spread_keyword;  // f(*list, **dict)
};

// Where `set` and `for` store: a name, a namespace attribute, or a tuple of names.
struct Target {
    std::vector<std::string> names;  // more than one: unpacking
    bool tuple = false;
    std::string ns_attribute;  // set ns.attr = ...: names[0] is the namespace
};

struct TextStmt : Stmt {
    std::string text;
};
struct OutputStmt : Stmt {
    ExprPtr expr;
};
struct IfStmt : Stmt {
    std::vector<std::pair<ExprPtr, Body>> branches;
    Body otherwise;
};
struct ForStmt : Stmt {
    Target target;
    ExprPtr iterable;
    ExprPtr condition;
    Body body, otherwise;
};
struct SetStmt : Stmt {
    Target target;
    ExprPtr value;
};
struct SetBlockStmt : Stmt {
    Target target;
    Body body;
    std::vector<std::pair<std::string, CallArgs>> filters;
};
struct MacroStmt : Stmt {
    std::string name;
    std::vector<std::string> params;
    std::vector<ExprPtr> defaults;  // for the last params
    Body body;
    bool uses_caller = false, uses_varargs = false, uses_kwargs = false;
};
struct CallBlockStmt : Stmt {
    ExprPtr call;  // a Call expression
    std::vector<std::string> params;
    std::vector<ExprPtr> defaults;
    Body body;
};
struct FilterBlockStmt : Stmt {
    std::vector<std::pair<std::string, CallArgs>> filters;
    Body body;
};
struct WithStmt : Stmt {
    std::vector<std::pair<std::string, ExprPtr>> assignments;
    Body body;
};
struct BreakStmt : Stmt {};
struct ContinueStmt : Stmt {};

}  // namespace

struct ChatTemplate::Program {
    Body body;
};

namespace {

// ---------------------------------------------------------------------------------------------
// Scopes and the render context

struct Scope {
    std::unordered_map<std::string, Value> vars;
    std::shared_ptr<Scope> parent;
    const Value* find(const std::string& name) const {
        for (const Scope* s = this; s; s = s->parent.get()) {
            auto it = s->vars.find(name);
            if (it != s->vars.end()) return &it->second;
        }
        return nullptr;
    }
};

// What a render creates that can change after it is made: scopes (set), namespaces (set
// ns.x) and loops (loop.changed). Only these close reference cycles, which shared_ptr never
// frees: lists and dicts cannot change once built, and a callable holds what existed when it was
// made. Templates make cycles without trying (a macro is held by the scope it was defined in,
// which its closure holds) and on purpose ({% set ns.x = ns %}), so the render keeps a weak
// reference to each and, when it ends, returned or thrown, empties them all: every cycle is
// broken and everything the render made is freed. Nothing made by a render outlives it (it
// returns a string), and nothing is emptied before, so templates render as before.
// Loop iterations and macro calls one render may take: a real chat template takes one per
// message, tool or content part, while a hostile one nests loops or doubles its recursion
// (jinja2 renders on for as long as it takes: 5.6 s for two loops of 1,050, found by fuzzing;
// three such loops would take hours).
constexpr int64_t max_render_steps = 250000;

class RenderArena {
  public:
    /// Counts one step of the render (a loop iteration, a macro call), failing past the budget.
    void step(const Pos& pos) {
        if (++steps_ > max_render_steps)
            render_error(pos, "the template takes more than " + std::to_string(max_render_steps) +
                                  " loop iterations and macro calls");
    }
    RenderArena() = default;
    RenderArena(const RenderArena&) = delete;
    RenderArena& operator=(const RenderArena&) = delete;
    ~RenderArena() { release(); }

    std::shared_ptr<Scope> scope(std::shared_ptr<Scope> parent) {
        auto s = std::make_shared<Scope>();
        s->parent = std::move(parent);
        track(scopes_, s);
        return s;
    }
    template <typename T>
    std::shared_ptr<T> object() {
        auto o = std::make_shared<T>();
        track(objects_, std::static_pointer_cast<Object>(o));
        return o;
    }

  private:
    // Expired references are dropped whenever the list doubles, so that it stays within twice
    // what is alive (a loop of 100,000 iterations makes as many scopes).
    template <typename T>
    static void track(std::vector<std::weak_ptr<T>>& list, const std::shared_ptr<T>& p) {
        if (list.size() == list.capacity() && list.size() >= 64)
            std::erase_if(list, [](const std::weak_ptr<T>& w) { return w.expired(); });
        list.push_back(p);
    }
    void release() {
        // Emptying one may free others (their references expire); each is locked first.
        for (auto& w : scopes_)
            if (auto s = w.lock()) {
                s->vars.clear();
                s->parent.reset();
            }
        for (auto& w : objects_)
            if (auto o = w.lock()) o->release();
    }
    std::vector<std::weak_ptr<Scope>> scopes_;
    std::vector<std::weak_ptr<Object>> objects_;
    int64_t steps_ = 0;
};

enum class Flow { normal, break_loop, continue_loop };

class Context {
  public:
    std::shared_ptr<Scope> scope;
    RenderArena* arena = nullptr;
    ChatRenderOptions options;
    int call_depth = 0;
    Pos pos;  // of the call being made, for errors raised inside builtins

    [[noreturn]] void fail(const std::string& what) const { render_error(pos, what); }
};

constexpr int max_call_depth = 200;  // jinja2 would hit Python's recursion limit

Flow render_body(const Body& body, Context& ctx, std::string& out);

// Macros: a Callable that renders the body in a scope of its own whose parent is the scope it
// was defined in (a Python closure, as jinja2 compiles it).
Value make_macro(const MacroStmt* macro, const std::vector<std::string>& params,
                 const std::vector<ExprPtr>& defaults, const Body& body,
                 std::shared_ptr<Scope> defined_in, std::optional<Value> caller,
                 const std::string& name) {
    bool uses_varargs = macro ? macro->uses_varargs : false;
    bool uses_kwargs = macro ? macro->uses_kwargs : false;
    return make_callable(
        name,
        [&params, &defaults, &body, defined_in, caller, name, uses_varargs, uses_kwargs](
            Context& ctx, Args& args) -> Value {
            Pos call_pos = ctx.pos;
            ctx.arena->step(call_pos);
            if (++ctx.call_depth > max_call_depth) {
                --ctx.call_depth;
                render_error(call_pos,
                             "macro calls nested deeper than " + std::to_string(max_call_depth));
            }
            auto scope = ctx.arena->scope(defined_in);
            size_t first_default = params.size() - defaults.size();
            std::vector<Value> varargs;
            for (size_t i = 0; i < args.positional.size(); ++i) {
                if (i < params.size()) {
                    scope->vars[params[i]] = args.positional[i];
                } else if (uses_varargs) {
                    varargs.push_back(args.positional[i]);
                } else {
                    render_error(call_pos, "macro '" + name + "' takes not more than " +
                                               std::to_string(params.size()) + " argument(s)");
                }
            }
            auto kwargs = std::make_shared<DictObj>();
            for (auto& [key, value] : args.keyword) {
                auto it = std::find(params.begin(), params.end(), key);
                if (it != params.end()) {
                    if (scope->vars.count(key))
                        render_error(call_pos,
                                     "macro '" + name + "' got multiple values for '" + key + "'");
                    scope->vars[key] = value;
                } else if (key == "caller") {
                    scope->vars["caller"] = value;
                } else if (uses_kwargs) {
                    kwargs->set(key, value);
                } else {
                    render_error(call_pos,
                                 "macro '" + name + "' takes no keyword argument '" + key + "'");
                }
            }
            for (size_t i = 0; i < params.size(); ++i) {
                if (scope->vars.count(params[i])) continue;
                if (i >= first_default) {
                    Context inner = ctx;
                    inner.scope = scope;
                    scope->vars[params[i]] = defaults[i - first_default]->eval(inner);
                } else {
                    scope->vars[params[i]] =
                        Value::undefined("parameter '" + params[i] + "' was not provided");
                }
            }
            if (uses_varargs) scope->vars["varargs"] = make_list(varargs, true);
            if (uses_kwargs) scope->vars["kwargs"] = Value(kwargs);
            if (caller && !scope->vars.count("caller")) scope->vars["caller"] = *caller;
            Context inner;
            inner.scope = scope;
            inner.arena = ctx.arena;
            inner.options = ctx.options;
            inner.call_depth = ctx.call_depth;
            std::string out;
            render_body(body, inner, out);
            --ctx.call_depth;
            return Value(out);
        });
}

// ---------------------------------------------------------------------------------------------
// Attribute and item access, with the sandbox's rules

Value call_value(Context& ctx, const Value& callee, Args& args, Pos pos);
Value string_method(const std::string& s, const std::string& name);
Value dict_method(const std::shared_ptr<DictObj>& d, const std::string& name);
Value list_method(const std::shared_ptr<ListObj>& l, const std::string& name);

// Methods that would change a list or dict: ImmutableSandboxedEnvironment refuses them.
bool mutating_method(const Value& x, const std::string& name) {
    static const char* const list_methods[] = {"append", "clear",  "extend",  "insert",
                                               "pop",    "remove", "reverse", "sort"};
    static const char* const dict_methods[] = {"clear", "pop", "popitem", "setdefault", "update"};
    if (x.is_list() && !x.list().tuple)
        return std::find(std::begin(list_methods), std::end(list_methods), name) !=
               std::end(list_methods);
    if (x.is_dict())
        return std::find(std::begin(dict_methods), std::end(dict_methods), name) !=
               std::end(dict_methods);
    return false;
}

Value no_attribute(const Value& obj, const std::string& name) {
    std::string what = obj.is_none() ? "None" : "'" + type_name(obj) + " object'";
    if (obj.is_dict()) what = "'dict object'";
    if (obj.is_list()) what = "'" + type_name(obj) + " object'";
    return Value::undefined(what + " has no attribute '" + name + "'");
}

// jinja2 returns an undefined that raises SecurityError when used: it prints as nothing, and
// calling it (the only use a template could make of a method) fails.
Value unsafe(const Value& obj, const std::string& name) {
    return Value::undefined("access to attribute '" + name + "' of '" + type_name(obj) +
                            "' object is unsafe (the sandbox forbids changing a value)");
}

// obj.name: Python's getattr first (methods), then obj[name]; else undefined.
Value get_attribute(const Value& obj, const std::string& name, Pos pos) {
    if (obj.is_undefined()) undefined_error(pos, obj);
    if (!name.empty() && name[0] == '_') {
        // the sandbox hides underscored attributes; they would be dunder methods anyway
        return no_attribute(obj, name);
    }
    if (mutating_method(obj, name)) return unsafe(obj, name);
    if (obj.is_string()) {
        Value m = string_method(obj.str(), name);
        if (!m.is_undefined()) return m;
        return no_attribute(obj, name);
    }
    if (obj.is_dict()) {
        Value m = dict_method(obj.dict_ptr(), name);
        if (!m.is_undefined()) return m;
        if (const Value* v = obj.dict().find(name)) return *v;
        return no_attribute(obj, name);
    }
    if (obj.is_list()) {
        Value m = list_method(obj.list_ptr(), name);
        if (!m.is_undefined()) return m;
        return no_attribute(obj, name);
    }
    if (obj.is_object()) return obj.object().attribute(name);
    return no_attribute(obj, name);
}

int64_t normalize_index(int64_t index, size_t size) {
    return index < 0 ? index + static_cast<int64_t>(size) : index;
}

// obj[key]: Python's subscription first, then getattr for a string key; else undefined.
Value get_item(const Value& obj, const Value& key, Pos pos) {
    if (obj.is_undefined()) undefined_error(pos, obj);
    if (obj.is_list() && key.is_integral()) {
        const auto& items = obj.list().items;
        int64_t i = normalize_index(key.integer(), items.size());
        if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[i];
        return Value::undefined("'" + type_name(obj) + " object' has no element " +
                                std::to_string(key.integer()));
    }
    if (obj.is_string() && key.is_integral()) {
        auto cps = code_points(obj.str());
        int64_t i = normalize_index(key.integer(), cps.size());
        if (i >= 0 && i < static_cast<int64_t>(cps.size()))
            return Value(from_code_points(cps, i, i + 1));
        return Value::undefined("'str object' has no element " + std::to_string(key.integer()));
    }
    if (obj.is_dict()) {
        if (key.is_string()) {
            if (const Value* v = obj.dict().find(key.str())) return *v;
        } else if (!key.is_undefined()) {
            // dict keys here are strings (JSON's, or literals); another key is not in it
            return Value::undefined("'dict object' has no element " + repr(key));
        }
    }
    if (key.is_string()) {
        Value attribute = get_attribute(obj, key.str(), pos);
        if (!attribute.is_undefined()) return attribute;
        return Value::undefined("'" +
                                (obj.is_none() ? std::string("None") : type_name(obj) + " object") +
                                "' has no attribute '" + key.str() + "'");
    }
    if (key.is_undefined()) undefined_error(pos, key);
    return Value::undefined("'" + type_name(obj) + " object' has no element " + repr(key));
}

// Python's slice indices for a sequence of n items.
std::vector<size_t> slice_indices(int64_t n, const Value& start, const Value& stop,
                                  const Value& step, Pos pos) {
    auto as_int = [&](const Value& x, const char* what) -> std::optional<int64_t> {
        if (x.is_none() || x.is_undefined()) return std::nullopt;
        if (!x.is_integral())
            render_error(pos, std::string("slice ") + what + " must be an integer or None");
        return x.integer();
    };
    int64_t st = as_int(step, "step").value_or(1);
    if (st == 0) render_error(pos, "slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> v, int64_t def) {
        if (!v) return def;
        int64_t x = *v < 0 ? *v + n : *v;
        if (st > 0) return std::clamp<int64_t>(x, 0, n);
        return std::clamp<int64_t>(x, -1, n - 1);
    };
    int64_t b = clamp(as_int(start, "start"), st > 0 ? 0 : n - 1);
    int64_t e = clamp(as_int(stop, "stop"), st > 0 ? n : -1);
    std::vector<size_t> out;
    if (st > 0)
        for (int64_t i = b; i < e; i += st)
            out.push_back(static_cast<size_t>(i));
    else
        for (int64_t i = b; i > e; i += st)
            out.push_back(static_cast<size_t>(i));
    return out;
}

// Iterating a value as a for loop or a filter would: list items, dict keys, string characters.
std::vector<Value> iterate(const Value& x, Pos pos) {
    if (x.is_undefined()) return {};
    if (x.is_list()) return x.list().items;
    if (x.is_dict()) {
        std::vector<Value> keys;
        for (auto& item : x.dict().items)
            keys.emplace_back(item.first);
        return keys;
    }
    if (x.is_string()) {
        std::vector<Value> chars;
        std::string s;
        for (uint32_t cp : code_points(x.str())) {
            s.clear();
            append_utf8(s, cp);
            chars.emplace_back(s);
        }
        return chars;
    }
    render_error(pos, "'" + type_name(x) + "' object is not iterable");
}

int64_t length(const Value& x, Pos pos) {
    if (x.is_undefined()) return 0;
    if (x.is_string()) return static_cast<int64_t>(code_point_count(x.str()));
    if (x.is_list()) return static_cast<int64_t>(x.list().items.size());
    if (x.is_dict()) return static_cast<int64_t>(x.dict().items.size());
    if (x.is_object()) {
        if (auto* ns = dynamic_cast<Namespace*>(&x.object()))
            return static_cast<int64_t>(ns->attributes.items.size());
    }
    render_error(pos, "object of type '" + type_name(x) + "' has no len()");
}

bool contains(const Value& container, const Value& item, Pos pos) {
    if (container.is_string()) {
        if (!item.is_string())
            render_error(pos,
                         "'in <string>' requires string as left operand, not " + type_name(item));
        return container.str().find(item.str()) != std::string::npos;
    }
    if (container.is_list()) {
        for (auto& x : container.list().items)
            if (equal(x, item)) return true;
        return false;
    }
    if (container.is_dict()) return item.is_string() && container.dict().find(item.str());
    if (container.is_undefined()) return false;
    render_error(pos, "argument of type '" + type_name(container) + "' is not iterable");
}

// ---------------------------------------------------------------------------------------------
// Arithmetic

// Python's integers have no bounds; these have 64 bits and refuse to wrap.
int64_t checked(Pos pos, const char* op, int64_t x, int64_t y) {
    int64_t r = 0;
    bool overflow = op[0] == '+'   ? __builtin_add_overflow(x, y, &r)
                    : op[0] == '-' ? __builtin_sub_overflow(x, y, &r)
                                   : __builtin_mul_overflow(x, y, &r);
    if (overflow) unsupported(pos, "integer arithmetic beyond 64 bits");
    return r;
}

int64_t floor_div(int64_t a, int64_t b) {
    int64_t q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
    return q;
}

[[noreturn]] void operand_error(Pos pos, const std::string& op, const Value& a, const Value& b) {
    if (a.is_undefined()) undefined_error(pos, a);
    if (b.is_undefined()) undefined_error(pos, b);
    render_error(pos, "unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" +
                          type_name(b) + "'");
}

// A string or list repeated into more than this is refused rather than exhausting memory (no
// prompt is that long).
constexpr int64_t max_repeated_bytes = int64_t{1} << 28;

std::string repeat(const std::string& s, int64_t n) {
    if (n > 0 && static_cast<int64_t>(s.size()) > max_repeated_bytes / n)
        throw UnsupportedError("chat template: unsupported: a string repeated into more than " +
                               std::to_string(max_repeated_bytes) + " bytes");
    std::string out;
    for (int64_t i = 0; i < n; ++i)
        out += s;
    return out;
}

// "%s" % x: Python's printf-style formatting for %s, %r, %d, %i and %%, without flags or widths.
std::string printf_format(const std::string& format, const Value& args, Pos pos) {
    std::vector<Value> values;
    if (args.is_list() && args.list().tuple)
        values = args.list().items;
    else
        values.push_back(args);
    std::string out;
    size_t next = 0;
    for (size_t i = 0; i < format.size(); ++i) {
        if (format[i] != '%') {
            out += format[i];
            continue;
        }
        if (i + 1 >= format.size()) render_error(pos, "incomplete format");
        char c = format[++i];
        if (c == '%') {
            out += '%';
            continue;
        }
        if (c != 's' && c != 'r' && c != 'd' && c != 'i')
            unsupported(pos, std::string("printf-style conversion '%") + c + "'");
        if (next >= values.size()) render_error(pos, "not enough arguments for format string");
        const Value& v = values[next++];
        if (c == 's') {
            out += to_str(v);
        } else if (c == 'r') {
            out += repr(v);
        } else if (v.is_integral()) {
            out += std::to_string(v.integer());
        } else if (v.is_float()) {
            out += std::to_string(static_cast<int64_t>(v.real()));
        } else {
            render_error(pos, "%" + std::string(1, c) + " format: a real number is required, not " +
                                  type_name(v));
        }
    }
    if (next < values.size())
        render_error(pos, "not all arguments converted during string formatting");
    return out;
}

Value binary(const std::string& op, const Value& a, const Value& b, Pos pos) {
    if (a.is_number() && b.is_number()) {
        bool real = a.is_float() || b.is_float();
        if (op == "/") {
            if (b.real() == 0) render_error(pos, "division by zero");
            return Value(a.real() / b.real());
        }
        if (real) {
            double x = a.real(), y = b.real();
            if (op == "+") return Value(x + y);
            if (op == "-") return Value(x - y);
            if (op == "*") return Value(x * y);
            if (op == "**") return Value(std::pow(x, y));
            if (y == 0) render_error(pos, "float division by zero");
            if (op == "//") return Value(std::floor(x / y));
            if (op == "%") {
                double m = std::fmod(x, y);
                if (m != 0 && ((m < 0) != (y < 0))) m += y;
                return Value(m);
            }
        } else {
            int64_t x = a.integer(), y = b.integer();
            if (op == "+" || op == "-" || op == "*") return Value(checked(pos, op.c_str(), x, y));
            if (op == "**") {
                if (y < 0) return Value(std::pow(double(x), double(y)));
                int64_t result = 1;
                for (int64_t i = 0; i < y; ++i)
                    result = checked(pos, "*", result, x);
                return Value(result);
            }
            if (y == 0) render_error(pos, "integer division or modulo by zero");
            if (op == "//") return Value(floor_div(x, y));
            if (op == "%") return Value(x - floor_div(x, y) * y);
        }
    }
    if (op == "+") {
        if (a.is_string() && b.is_string()) return Value(a.str() + b.str());
        if (a.is_list() && b.is_list() && a.list().tuple == b.list().tuple) {
            std::vector<Value> items = a.list().items;
            items.insert(items.end(), b.list().items.begin(), b.list().items.end());
            return make_list(std::move(items), a.list().tuple);
        }
    }
    if (op == "*") {
        if (a.is_string() && b.is_integral()) return Value(repeat(a.str(), b.integer()));
        if (b.is_string() && a.is_integral()) return Value(repeat(b.str(), a.integer()));
        if (a.is_list() && b.is_integral()) {
            std::vector<Value> items;
            const int64_t size = static_cast<int64_t>(a.list().items.size());
            if (size > 0 && b.integer() > (max_repeated_bytes / 16) / size)
                unsupported(pos, "a list repeated into more than " +
                                     std::to_string(max_repeated_bytes / 16) + " items");
            for (int64_t i = 0; size > 0 && i < b.integer(); ++i)
                items.insert(items.end(), a.list().items.begin(), a.list().items.end());
            return make_list(std::move(items), a.list().tuple);
        }
    }
    if (op == "%" && a.is_string()) return Value(printf_format(a.str(), b, pos));
    operand_error(pos, op, a, b);
}

// ---------------------------------------------------------------------------------------------
// Expressions

struct Literal : Expr {
    Value value;
    Value eval(Context&) const override { return value; }
};

struct Name : Expr {
    std::string name;
    Value eval(Context& ctx) const override {
        if (const Value* v = ctx.scope->find(name)) return *v;
        return Value::undefined("'" + name + "' is undefined");
    }
};

struct ListExpr : Expr {
    std::vector<ExprPtr> items;
    bool tuple = false;
    Value eval(Context& ctx) const override {
        std::vector<Value> values;
        for (auto& e : items)
            values.push_back(e->eval(ctx));
        return make_list(std::move(values), tuple);
    }
};

struct DictExpr : Expr {
    std::vector<std::pair<ExprPtr, ExprPtr>> items;
    Value eval(Context& ctx) const override {
        auto d = std::make_shared<DictObj>();
        for (auto& [k, v] : items) {
            Value key = k->eval(ctx);
            if (!key.is_string()) unsupported(k->pos, "a dict key that is not a string");
            d->set(key.str(), v->eval(ctx));
        }
        return Value(d);
    }
};

struct GetAttr : Expr {
    ExprPtr obj;
    std::string name;
    Value eval(Context& ctx) const override { return get_attribute(obj->eval(ctx), name, pos); }
};

struct GetItem : Expr {
    ExprPtr obj, key;
    Value eval(Context& ctx) const override {
        Value o = obj->eval(ctx);
        return get_item(o, key->eval(ctx), pos);
    }
};

struct SliceExpr : Expr {
    ExprPtr obj, start, stop, step;
    Value eval(Context& ctx) const override {
        Value o = obj->eval(ctx);
        auto opt = [&](const ExprPtr& e) { return e ? e->eval(ctx) : Value::none(); };
        Value b = opt(start), e = opt(stop), s = opt(step);
        if (o.is_undefined()) undefined_error(pos, o);
        if (o.is_string()) {
            auto cps = code_points(o.str());
            std::string out;
            for (size_t i : slice_indices(cps.size(), b, e, s, pos))
                append_utf8(out, cps[i]);
            return Value(out);
        }
        if (o.is_list()) {
            std::vector<Value> items;
            for (size_t i : slice_indices(o.list().items.size(), b, e, s, pos))
                items.push_back(o.list().items[i]);
            return make_list(std::move(items), o.list().tuple);
        }
        return Value::undefined("'" + type_name(o) + " object' cannot be sliced");
    }
};

Args evaluate_args(const CallArgs& call, Context& ctx) {
    Args args;
    for (auto& e : call.positional)
        args.positional.push_back(e->eval(ctx));
    for (auto& [k, e] : call.keyword)
        args.keyword.emplace_back(k, e->eval(ctx));
    if (call.spread_positional) {
        for (auto& v : iterate(call.spread_positional->eval(ctx), call.spread_positional->pos))
            args.positional.push_back(v);
    }
    if (call.spread_keyword) {
        Value d = call.spread_keyword->eval(ctx);
        if (!d.is_dict())
            render_error(call.spread_keyword->pos,
                         "argument after ** must be a mapping, not " + type_name(d));
        for (auto& [k, v] : d.dict().items)
            args.keyword.emplace_back(k, v);
    }
    return args;
}

struct Call : Expr {
    ExprPtr callee;
    CallArgs args;
    Value eval(Context& ctx) const override {
        Value f = callee->eval(ctx);
        Args a = evaluate_args(args, ctx);
        return call_value(ctx, f, a, pos);
    }
};

Value apply_filter(Context& ctx, const std::string& name, const Value& value, Args& args, Pos pos);
bool apply_test(Context& ctx, const std::string& name, const Value& value, Args& args, Pos pos);
bool known_filter(const std::string& name);
bool known_test(const std::string& name);

struct FilterExpr : Expr {
    ExprPtr base;
    std::string name;
    CallArgs args;
    Value eval(Context& ctx) const override {
        Value v = base->eval(ctx);
        Args a = evaluate_args(args, ctx);
        return apply_filter(ctx, name, v, a, pos);
    }
};

struct TestExpr : Expr {
    ExprPtr base;
    std::string name;
    CallArgs args;
    Value eval(Context& ctx) const override {
        Value v = base->eval(ctx);
        Args a = evaluate_args(args, ctx);
        return Value(apply_test(ctx, name, v, a, pos));
    }
};

struct Unary : Expr {
    std::string op;
    ExprPtr operand;
    Value eval(Context& ctx) const override {
        Value v = operand->eval(ctx);
        if (op == "not") return Value(!truthy(v));
        if (!v.is_number()) {
            if (v.is_undefined()) undefined_error(pos, v);
            render_error(pos, "bad operand type for unary " + op + ": '" + type_name(v) + "'");
        }
        if (op == "-") {
            if (v.is_float()) return Value(-v.real());
            if (v.integer() == std::numeric_limits<int64_t>::min())
                unsupported(pos, "integer arithmetic beyond 64 bits");
            return Value(-v.integer());
        }
        return v.is_float() ? v : Value(v.integer());
    }
};

struct Binary : Expr {
    std::string op;
    ExprPtr left, right;
    Value eval(Context& ctx) const override {
        if (op == "and") {
            Value a = left->eval(ctx);
            return truthy(a) ? right->eval(ctx) : a;
        }
        if (op == "or") {
            Value a = left->eval(ctx);
            return truthy(a) ? a : right->eval(ctx);
        }
        Value a = left->eval(ctx);
        Value b = right->eval(ctx);
        if (op == "~") return Value(to_str(a) + to_str(b));
        return binary(op, a, b, pos);
    }
};

bool compare_op(const std::string& op, const Value& a, const Value& b, Pos pos) {
    if (op == "==") return equal(a, b);
    if (op == "!=") return !equal(a, b);
    if (op == "in") return contains(b, a, pos);
    if (op == "notin") return !contains(b, a, pos);
    if (a.is_undefined()) undefined_error(pos, a);
    if (b.is_undefined()) undefined_error(pos, b);
    int c = compare(a, b, pos, op.c_str());
    if (op == "<") return c < 0;
    if (op == "<=") return c <= 0;
    if (op == ">") return c > 0;
    return c >= 0;
}

struct Compare : Expr {
    ExprPtr first;
    std::vector<std::pair<std::string, ExprPtr>> rest;
    Value eval(Context& ctx) const override {
        // chained as Python chains them: a < b < c is a < b and b < c
        Value a = first->eval(ctx);
        for (auto& [op, e] : rest) {
            Value b = e->eval(ctx);
            if (!compare_op(op, a, b, pos)) return Value(false);
            a = std::move(b);
        }
        return Value(true);
    }
};

struct CondExpr : Expr {
    ExprPtr test, then, otherwise;
    Value eval(Context& ctx) const override {
        if (truthy(test->eval(ctx))) return then->eval(ctx);
        if (otherwise) return otherwise->eval(ctx);
        return Value::undefined("the inline if-expression on line " + std::to_string(pos.line) +
                                " evaluated to false and no else section was defined.");
    }
};

Value call_value(Context& ctx, const Value& callee, Args& args, Pos pos) {
    if (callee.is_callable()) {
        Pos saved = ctx.pos;
        ctx.pos = pos;
        Value result = callee.callable().call(ctx, args);
        ctx.pos = saved;
        return result;
    }
    if (callee.is_undefined()) undefined_error(pos, callee);
    render_error(pos, "'" + type_name(callee) + "' object is not callable");
}

// ---------------------------------------------------------------------------------------------
// Arguments of builtins: Python's binding of positional and keyword arguments to parameters

class Bound {
  public:
    Bound(Context& ctx, const std::string& function, Args& args,
          std::initializer_list<const char*> params)
        : ctx_(ctx), function_(function), params_(params) {
        values_.resize(params_.size());
        if (args.positional.size() > params_.size())
            ctx.fail(function + "() takes at most " + std::to_string(params_.size()) +
                     " argument(s) (" + std::to_string(args.positional.size()) + " given)");
        for (size_t i = 0; i < args.positional.size(); ++i)
            values_[i] = args.positional[i];
        for (auto& keyword : args.keyword) {
            // Not a structured binding: clang 14 (the fuzz build's) cannot capture one.
            const auto& k = keyword.first;
            const auto& v = keyword.second;
            auto it =
                std::find_if(params_.begin(), params_.end(), [&](const char* p) { return k == p; });
            if (it == params_.end())
                ctx.fail(function + "() got an unexpected keyword argument '" + k + "'");
            size_t i = static_cast<size_t>(it - params_.begin());
            if (values_[i]) ctx.fail(function + "() got multiple values for argument '" + k + "'");
            values_[i] = v;
        }
    }
    bool has(size_t i) const { return values_[i].has_value(); }
    const Value& get(size_t i) const {
        if (!values_[i]) ctx_.fail(function_ + "() missing required argument '" + params_[i] + "'");
        return *values_[i];
    }
    Value get(size_t i, Value fallback) const { return values_[i] ? *values_[i] : fallback; }
    std::string string(size_t i) const {
        const Value& v = get(i);
        if (!v.is_string())
            ctx_.fail(function_ + "() argument '" + params_[i] + "' must be str, not " +
                      type_name(v));
        return v.str();
    }
    std::optional<std::string> optional_string(size_t i) const {
        if (!values_[i] || values_[i]->is_none()) return std::nullopt;
        return string(i);
    }
    int64_t integer(size_t i, int64_t fallback) const {
        if (!values_[i]) return fallback;
        if (!values_[i]->is_integral())
            ctx_.fail(function_ + "() argument '" + params_[i] + "' must be an integer, not " +
                      type_name(*values_[i]));
        return values_[i]->integer();
    }
    bool flag(size_t i, bool fallback) const { return values_[i] ? truthy(*values_[i]) : fallback; }

  private:
    Context& ctx_;
    std::string function_;
    std::vector<const char*> params_;
    std::vector<std::optional<Value>> values_;
};

// ---------------------------------------------------------------------------------------------
// Case changes: ASCII exactly as Python; other letters need Unicode's case tables, which this
// library does not carry, so text with them is refused rather than changed wrongly.

void require_ascii(Context& ctx, const std::string& s, const char* operation) {
    if (!is_ascii(s))
        unsupported(ctx.pos, std::string(operation) +
                                 " of text with non-ASCII characters (it needs Unicode's case "
                                 "tables): " +
                                 string_repr(s.size() > 40 ? s.substr(0, 40) + "..." : s));
}

std::string ascii_lower(std::string s) {
    for (char& c : s)
        c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
}
std::string ascii_upper(std::string s) {
    for (char& c : s)
        c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return s;
}

// str.title(): a letter after a letter is lowered, any other letter raised.
std::string python_title(std::string s) {
    bool previous_cased = false;
    for (char& c : s) {
        unsigned char u = static_cast<unsigned char>(c);
        if (std::isalpha(u)) {
            c = static_cast<char>(previous_cased ? std::tolower(u) : std::toupper(u));
            previous_cased = true;
        } else {
            previous_cased = false;
        }
    }
    return s;
}

std::string python_capitalize(std::string s) {
    s = ascii_lower(std::move(s));
    if (!s.empty()) s[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(s[0])));
    return s;
}

// ---------------------------------------------------------------------------------------------
// String methods

std::vector<std::string> split_whitespace(const std::string& s, int64_t maxsplit) {
    auto cps = code_points(s);
    std::vector<std::string> out;
    size_t i = 0;
    while (i < cps.size()) {
        while (i < cps.size() && is_space(cps[i]))
            ++i;
        if (i >= cps.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
            size_t end = cps.size();
            while (end > i && is_space(cps[end - 1]))
                --end;
            out.push_back(from_code_points(cps, i, end));
            break;
        }
        size_t j = i;
        while (j < cps.size() && !is_space(cps[j]))
            ++j;
        out.push_back(from_code_points(cps, i, j));
        i = j;
    }
    return out;
}

std::vector<std::string> split_on(const std::string& s, const std::string& sep, int64_t maxsplit) {
    std::vector<std::string> out;
    size_t start = 0;
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
        size_t at = s.find(sep, start);
        if (at == std::string::npos) break;
        out.push_back(s.substr(start, at - start));
        start = at + sep.size();
    }
    out.push_back(s.substr(start));
    return out;
}

std::vector<std::string> rsplit_on(const std::string& s, const std::string& sep, int64_t maxsplit) {
    std::vector<std::string> out;
    size_t end = s.size();
    while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
        if (end < sep.size()) break;
        size_t at = s.rfind(sep, end - sep.size());
        if (at == std::string::npos) break;
        out.push_back(s.substr(at + sep.size(), end - at - sep.size()));
        end = at;
    }
    out.push_back(s.substr(0, end));
    std::reverse(out.begin(), out.end());
    return out;
}

Value string_list(const std::vector<std::string>& parts) {
    std::vector<Value> items;
    for (auto& p : parts)
        items.emplace_back(p);
    return make_list(std::move(items));
}

std::string python_replace(const std::string& s, const std::string& old, const std::string& with,
                           int64_t count) {
    std::string out;
    if (old.empty()) {
        // inserted before every character and at the end
        auto cps = code_points(s);
        int64_t done = 0;
        for (size_t i = 0; i <= cps.size(); ++i) {
            if (count < 0 || done < count) {
                out += with;
                ++done;
            }
            if (i < cps.size()) append_utf8(out, cps[i]);
        }
        return out;
    }
    size_t start = 0;
    int64_t done = 0;
    while (count < 0 || done < count) {
        size_t at = s.find(old, start);
        if (at == std::string::npos) break;
        out += s.substr(start, at - start) + with;
        start = at + old.size();
        ++done;
    }
    return out + s.substr(start);
}

// str.startswith / endswith with a string or a tuple of strings
bool affix_match(Context& ctx, const std::string& s, const Value& affix, bool start,
                 const char* name) {
    auto one = [&](const Value& a) {
        if (!a.is_string())
            ctx.fail(std::string(name) + " first arg must be str or a tuple of str, not " +
                     type_name(a));
        const std::string& p = a.str();
        if (p.size() > s.size()) return false;
        return start ? s.compare(0, p.size(), p) == 0
                     : s.compare(s.size() - p.size(), p.size(), p) == 0;
    };
    if (affix.is_list() && affix.list().tuple) {
        for (auto& a : affix.list().items)
            if (one(a)) return true;
        return false;
    }
    return one(affix);
}

// str.format with {}, {0} and {name} fields and no conversions or format specifications.
std::string python_format(Context& ctx, const std::string& s, Args& args) {
    std::string out;
    size_t automatic = 0;
    for (size_t i = 0; i < s.size(); ++i) {
        char c = s[i];
        if (c == '{' && i + 1 < s.size() && s[i + 1] == '{') {
            out += '{';
            ++i;
        } else if (c == '}' && i + 1 < s.size() && s[i + 1] == '}') {
            out += '}';
            ++i;
        } else if (c == '{') {
            size_t end = s.find('}', i);
            if (end == std::string::npos) ctx.fail("Single '{' encountered in format string");
            std::string field = s.substr(i + 1, end - i - 1);
            if (field.find_first_of(":!.[") != std::string::npos)
                unsupported(ctx.pos, "str.format field {" + field + "}");
            const Value* v = nullptr;
            if (field.empty()) {
                if (automatic >= args.positional.size())
                    ctx.fail("Replacement index " + std::to_string(automatic) +
                             " out of range for positional args tuple");
                v = &args.positional[automatic++];
            } else if (std::all_of(field.begin(), field.end(), ::isdigit)) {
                size_t index = std::stoul(field);
                if (index >= args.positional.size())
                    ctx.fail("Replacement index " + field +
                             " out of range for positional args tuple");
                v = &args.positional[index];
            } else {
                for (auto& [k, value] : args.keyword)
                    if (k == field) v = &value;
                if (!v) ctx.fail("KeyError: '" + field + "'");
            }
            out += to_str(*v);
            i = end;
        } else if (c == '}') {
            ctx.fail("Single '}' encountered in format string");
        } else {
            out += c;
        }
    }
    return out;
}

std::vector<std::string> python_splitlines(const std::string& s, bool keepends) {
    auto cps = code_points(s);
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t i = 0; i < cps.size(); ++i) {
        uint32_t c = cps[i];
        bool is_break = c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C ||
                        c == 0x1D || c == 0x1E || c == 0x85 || c == 0x2028 || c == 0x2029;
        if (!is_break) continue;
        size_t end = i;
        if (c == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
        out.push_back(from_code_points(cps, start, keepends ? i + 1 : end));
        start = i + 1;
    }
    if (start < cps.size()) out.push_back(from_code_points(cps, start, cps.size()));
    return out;
}

Value string_method(const std::string& s, const std::string& name) {
    using F = std::function<Value(Context&, Args&)>;
    F f;
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
        bool left = name != "rstrip", right = name != "lstrip";
        f = [s, name, left, right](Context& ctx, Args& args) {
            Bound b(ctx, "str." + name, args, {"chars"});
            return Value(strip(s, b.optional_string(0), left, right));
        };
    } else if (name == "split" || name == "rsplit") {
        f = [s, name](Context& ctx, Args& args) {
            Bound b(ctx, "str." + name, args, {"sep", "maxsplit"});
            int64_t maxsplit = b.integer(1, -1);
            auto sep = b.optional_string(0);
            if (!sep) {
                if (name == "rsplit" && maxsplit >= 0)
                    unsupported(ctx.pos, "str.rsplit() on whitespace with maxsplit");
                return string_list(split_whitespace(s, maxsplit));
            }
            if (sep->empty()) ctx.fail("empty separator");
            return string_list(name == "split" ? split_on(s, *sep, maxsplit)
                                               : rsplit_on(s, *sep, maxsplit));
        };
    } else if (name == "startswith" || name == "endswith") {
        bool start = name == "startswith";
        f = [s, name, start](Context& ctx, Args& args) {
            Bound b(ctx, "str." + name, args, {"prefix", "start", "end"});
            if (b.has(1) || b.has(2)) unsupported(ctx.pos, "str." + name + " with start or end");
            return Value(affix_match(ctx, s, b.get(0), start, name.c_str()));
        };
    } else if (name == "upper" || name == "lower" || name == "title" || name == "capitalize" ||
               name == "swapcase") {
        f = [s, name](Context& ctx, Args& args) {
            Bound b(ctx, "str." + name, args, {});
            require_ascii(ctx, s, ("str." + name + "()").c_str());
            if (name == "upper") return Value(ascii_upper(s));
            if (name == "lower") return Value(ascii_lower(s));
            if (name == "title") return Value(python_title(s));
            if (name == "capitalize") return Value(python_capitalize(s));
            std::string out = s;
            for (char& c : out) {
                unsigned char u = static_cast<unsigned char>(c);
                c = static_cast<char>(std::isupper(u) ? std::tolower(u) : std::toupper(u));
            }
            return Value(out);
        };
    } else if (name == "replace") {
        f = [s](Context& ctx, Args& args) {
            Bound b(ctx, "str.replace", args, {"old", "new", "count"});
            return Value(python_replace(s, b.string(0), b.string(1), b.integer(2, -1)));
        };
    } else if (name == "find" || name == "rfind" || name == "index" || name == "rindex" ||
               name == "count") {
        f = [s, name](Context& ctx, Args& args) {
            Bound b(ctx, "str." + name, args, {"sub", "start", "end"});
            if (b.has(1) || b.has(2)) unsupported(ctx.pos, "str." + name + " with start or end");
            std::string sub = b.string(0);
            if (name == "count") {
                if (sub.empty()) return Value(static_cast<int64_t>(code_point_count(s) + 1));
                int64_t n = 0;
                for (size_t at = s.find(sub); at != std::string::npos;
                     at = s.find(sub, at + sub.size()))
                    ++n;
                return Value(n);
            }
            size_t at = name[0] == 'r' ? s.rfind(sub) : s.find(sub);
            if (at == std::string::npos) {
                if (name == "index" || name == "rindex") ctx.fail("substring not found");
                return Value(int64_t{-1});
            }
            return Value(static_cast<int64_t>(code_point_count(std::string_view(s).substr(0, at))));
        };
    } else if (name == "join") {
        f = [s](Context& ctx, Args& args) {
            Bound b(ctx, "str.join", args, {"iterable"});
            std::string out;
            bool first = true;
            for (auto& item : iterate(b.get(0), ctx.pos)) {
                if (!item.is_string())
                    ctx.fail("sequence item: expected str instance, " + type_name(item) + " found");
                if (!first) out += s;
                first = false;
                out += item.str();
            }
            return Value(out);
        };
    } else if (name == "format") {
        f = [s](Context& ctx, Args& args) { return Value(python_format(ctx, s, args)); };
    } else if (name == "splitlines") {
        f = [s](Context& ctx, Args& args) {
            Bound b(ctx, "str.splitlines", args, {"keepends"});
            return string_list(python_splitlines(s, b.flag(0, false)));
        };
    } else if (name == "isdigit" || name == "isalpha" || name == "isalnum" || name == "isspace" ||
               name == "isupper" || name == "islower" || name == "isnumeric" ||
               name == "isdecimal") {
        f = [s, name](Context& ctx, Args& args) {
            Bound b(ctx, "str." + name, args, {});
            if (name == "isspace") {
                auto cps = code_points(s);
                return Value(!cps.empty() && std::all_of(cps.begin(), cps.end(), is_space));
            }
            require_ascii(ctx, s, ("str." + name + "()").c_str());
            auto all = [&](int (*pred)(int)) {
                return !s.empty() && std::all_of(s.begin(), s.end(), [&](char c) {
                    return pred(static_cast<unsigned char>(c)) != 0;
                });
            };
            if (name == "isalpha") return Value(all(::isalpha));
            if (name == "isalnum") return Value(all(::isalnum));
            if (name == "isupper" || name == "islower") {
                bool cased = false, ok = true;
                for (char c : s) {
                    unsigned char u = static_cast<unsigned char>(c);
                    if (std::isalpha(u)) {
                        cased = true;
                        if (name == "isupper" ? std::islower(u) : std::isupper(u)) ok = false;
                    }
                }
                return Value(cased && ok);
            }
            return Value(all(::isdigit));
        };
    } else {
        return Value::undefined("");
    }
    return make_callable("str." + name, std::move(f));
}

Value dict_method(const std::shared_ptr<DictObj>& d, const std::string& name) {
    if (name == "items" || name == "keys" || name == "values") {
        return make_callable("dict." + name, [d, name](Context& ctx, Args& args) {
            Bound b(ctx, "dict." + name, args, {});
            std::vector<Value> out;
            for (auto& [k, v] : d->items) {
                if (name == "items")
                    out.push_back(make_list({Value(k), v}, true));
                else if (name == "keys")
                    out.emplace_back(k);
                else
                    out.push_back(v);
            }
            Value list = make_list(std::move(out));
            list.list_ptr()->view = name == "items"  ? "dict_items"
                                    : name == "keys" ? "dict_keys"
                                                     : "dict_values";
            return list;
        });
    }
    if (name == "get") {
        return make_callable("dict.get", [d](Context& ctx, Args& args) {
            Bound b(ctx, "dict.get", args, {"key", "default"});
            const Value& key = b.get(0);
            if (key.is_string())
                if (const Value* v = d->find(key.str())) return *v;
            return b.get(1, Value::none());
        });
    }
    if (name == "copy") {
        return make_callable("dict.copy", [d](Context& ctx, Args& args) {
            Bound b(ctx, "dict.copy", args, {});
            return Value(std::make_shared<DictObj>(*d));
        });
    }
    return Value::undefined("");
}

Value list_method(const std::shared_ptr<ListObj>& l, const std::string& name) {
    if (name == "index" || name == "count") {
        return make_callable("list." + name, [l, name](Context& ctx, Args& args) {
            Bound b(ctx, "list." + name, args, {"value"});
            int64_t n = 0;
            for (size_t i = 0; i < l->items.size(); ++i) {
                if (!equal(l->items[i], b.get(0))) continue;
                if (name == "index") return Value(static_cast<int64_t>(i));
                ++n;
            }
            if (name == "index") ctx.fail(repr(b.get(0)) + " is not in list");
            return Value(n);
        });
    }
    return Value::undefined("");
}

// ---------------------------------------------------------------------------------------------
// Filters (jinja2's builtins, transformers' tojson)

// jinja2's make_attrgetter: "a.b" walks attributes, digits are indices.
Value attribute_path(Context& ctx, const Value& item, const Value& attribute) {
    if (attribute.is_integral()) return get_item(item, attribute, ctx.pos);
    if (!attribute.is_string()) ctx.fail("attribute must be a string or an integer");
    Value x = item;
    std::string path = attribute.str();
    size_t start = 0;
    while (true) {
        size_t dot = path.find('.', start);
        std::string part =
            path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
        if (!part.empty() && std::all_of(part.begin(), part.end(), ::isdigit))
            x = get_item(x, Value(static_cast<int64_t>(std::stoll(part))), ctx.pos);
        else
            x = get_item(x, Value(part), ctx.pos);
        if (dot == std::string::npos) break;
        start = dot + 1;
    }
    return x;
}

// The key Jinja's sort, dictsort, unique, min and max compare by: strings lowered unless
// case_sensitive.
Value sort_key(Context& ctx, const Value& x, bool case_sensitive) {
    if (!case_sensitive && x.is_string()) {
        require_ascii(ctx, x.str(), "case-insensitive comparison");
        return Value(ascii_lower(x.str()));
    }
    return x;
}

std::vector<Value> sorted(Context& ctx, std::vector<Value> items, bool reverse, bool case_sensitive,
                          const Value& attribute) {
    std::vector<std::pair<Value, Value>> keyed;
    for (auto& item : items) {
        Value key = attribute.is_none() ? item : attribute_path(ctx, item, attribute);
        keyed.emplace_back(sort_key(ctx, key, case_sensitive), item);
    }
    Pos pos = ctx.pos;
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& a, const auto& b) {
        return reverse ? compare(b.first, a.first, pos, "<") < 0
                       : compare(a.first, b.first, pos, "<") < 0;
    });
    std::vector<Value> out;
    for (auto& [k, v] : keyed)
        out.push_back(v);
    return out;
}

std::string html_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
        switch (c) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&#34;";
                break;
            case '\'':
                out += "&#39;";
                break;
            default:
                out += c;
        }
    }
    return out;
}

// Python's int(str, base) on what the int filter is given, then int(float(str)).
std::optional<int64_t> parse_int(std::string text, int base) {
    text = strip(text, std::nullopt, true, true);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    if (text.empty()) return std::nullopt;
    bool negative = text[0] == '-';
    if (text[0] == '+' || text[0] == '-') text.erase(0, 1);
    if (base == 16 && text.size() > 2 && text[0] == '0' && std::tolower(text[1]) == 'x')
        text.erase(0, 2);
    int64_t value = 0;
    auto r = std::from_chars(text.data(), text.data() + text.size(), value, base);
    if (r.ec != std::errc() || r.ptr != text.data() + text.size() || text.empty())
        return std::nullopt;
    return negative ? -value : value;
}

const std::vector<std::string>& filter_names() {
    static const std::vector<std::string> names = {
        "abs",      "attr",   "batch",  "capitalize", "count",      "d",           "default",
        "dictsort", "e",      "escape", "first",      "float",      "forceescape", "indent",
        "int",      "items",  "join",   "last",       "length",     "list",        "lower",
        "map",      "max",    "min",    "reject",     "rejectattr", "replace",     "reverse",
        "round",    "safe",   "select", "selectattr", "sort",       "string",      "sum",
        "title",    "tojson", "trim",   "unique",     "upper",      "wordcount"};
    return names;
}
bool known_filter(const std::string& name) {
    const auto& names = filter_names();
    return std::find(names.begin(), names.end(), name) != names.end();
}

const std::vector<std::string>& test_names() {
    static const std::vector<std::string> names = {
        "boolean",  "callable", "defined",  "divisibleby", "eq",    "equalto", "==",  "escaped",
        "even",     "false",    "float",    "ge",          ">=",    "gt",      ">",   "greaterthan",
        "in",       "integer",  "iterable", "le",          "<=",    "lower",   "lt",  "<",
        "lessthan", "mapping",  "ne",       "!=",          "none",  "number",  "odd", "sameas",
        "sequence", "string",   "true",     "undefined",   "upper", "filter",  "test"};
    return names;
}
bool known_test(const std::string& name) {
    const auto& names = test_names();
    return std::find(names.begin(), names.end(), name) != names.end();
}

// select/reject/selectattr/rejectattr: items for which the test (or truthiness) holds.
std::vector<Value> select_items(Context& ctx, const Value& seq, Args& args, bool by_attribute,
                                bool keep, const std::string& filter) {
    size_t next = 0;
    Value attribute;
    if (by_attribute) {
        if (args.positional.empty()) ctx.fail(filter + "() missing the attribute");
        attribute = args.positional[next++];
    }
    std::optional<std::string> test;
    if (next < args.positional.size()) {
        if (!args.positional[next].is_string()) ctx.fail(filter + "(): the test must be a name");
        test = args.positional[next++].str();
        if (!known_test(*test)) unsupported(ctx.pos, "test '" + *test + "' (in " + filter + ")");
    }
    Args test_args;
    test_args.positional.assign(args.positional.begin() + next, args.positional.end());
    test_args.keyword = args.keyword;
    std::vector<Value> out;
    for (auto& item : iterate(seq, ctx.pos)) {
        Value x = by_attribute ? attribute_path(ctx, item, attribute) : item;
        bool ok = test ? apply_test(ctx, *test, x, test_args, ctx.pos) : truthy(x);
        if (ok == keep) out.push_back(item);
    }
    return out;
}

Value tojson(Context& ctx, const Value& value, Args& args) {
    Bound b(ctx, "tojson", args, {"ensure_ascii", "indent", "separators", "sort_keys"});
    if (b.flag(0, false)) unsupported(ctx.pos, "tojson(ensure_ascii=True)");
    JsonStyle style;
    Value indent = b.get(1, Value::none());
    if (indent.is_integral()) {
        style.indent = std::string(std::max<int64_t>(indent.integer(), 0), ' ');
    } else if (indent.is_string()) {
        style.indent = indent.str();
    } else if (!indent.is_none()) {
        ctx.fail("tojson indent must be an integer or a string");
    }
    if (style.indent) style.item_separator = ",";
    Value separators = b.get(2, Value::none());
    if (!separators.is_none()) {
        if (!separators.is_list() || separators.list().items.size() != 2 ||
            !separators.list().items[0].is_string() || !separators.list().items[1].is_string())
            ctx.fail("tojson separators must be a pair of strings");
        style.item_separator = separators.list().items[0].str();
        style.key_separator = separators.list().items[1].str();
    }
    style.sort_keys = b.flag(3, false);
    std::string out;
    json_dump(out, value, style, 0, ctx.pos);
    return Value(out);
}

Value apply_filter(Context& ctx, const std::string& name, const Value& value, Args& args, Pos pos) {
    Pos saved = ctx.pos;
    ctx.pos = pos;
    struct Restore {
        Context& ctx;
        Pos pos;
        ~Restore() { ctx.pos = pos; }
    } restore{ctx, saved};
    auto string_value = [&]() {
        // filters that take text convert with str() (jinja2's soft_str)
        return to_str(value);
    };
    if (name == "tojson") return tojson(ctx, value, args);
    if (name == "trim") {
        Bound b(ctx, "trim", args, {"chars"});
        return Value(strip(string_value(), b.optional_string(0), true, true));
    }
    if (name == "length" || name == "count") {
        Bound b(ctx, name, args, {});
        return Value(length(value, pos));
    }
    if (name == "string") {
        Bound b(ctx, name, args, {});
        return Value(string_value());
    }
    if (name == "safe") {
        Bound b(ctx, name, args, {});
        return value;
    }
    if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
        Bound b(ctx, name, args, {});
        std::string s = string_value();
        require_ascii(ctx, s, ("the " + name + " filter").c_str());
        if (name == "upper") return Value(ascii_upper(s));
        if (name == "lower") return Value(ascii_lower(s));
        if (name == "capitalize") return Value(python_capitalize(s));
        // jinja2's title: words start after spaces, dashes and opening brackets
        std::string out;
        bool start = true;
        for (char c : s) {
            unsigned char u = static_cast<unsigned char>(c);
            bool separator =
                std::isspace(u) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
            if (separator) {
                out += c;
                start = true;
            } else {
                out += static_cast<char>(start ? std::toupper(u) : std::tolower(u));
                start = false;
            }
        }
        return Value(out);
    }
    if (name == "replace") {
        Bound b(ctx, name, args, {"old", "new", "count"});
        Value count = b.get(2, Value::none());
        return Value(python_replace(string_value(), b.string(0), b.string(1),
                                    count.is_none() ? -1 : b.integer(2, -1)));
    }
    if (name == "default" || name == "d") {
        Bound b(ctx, name, args, {"default_value", "boolean"});
        bool boolean = b.flag(1, false);
        if (value.is_undefined() || (boolean && !truthy(value))) return b.get(0, Value(""));
        return value;
    }
    if (name == "join") {
        Bound b(ctx, name, args, {"d", "attribute"});
        std::string separator = b.has(0) ? to_str(b.get(0)) : "";
        Value attribute = b.get(1, Value::none());
        std::string out;
        bool first = true;
        for (auto& item : iterate(value, pos)) {
            if (!first) out += separator;
            first = false;
            out += to_str(attribute.is_none() ? item : attribute_path(ctx, item, attribute));
        }
        return Value(out);
    }
    if (name == "list") {
        Bound b(ctx, name, args, {});
        return make_list(iterate(value, pos));
    }
    if (name == "first") {
        Bound b(ctx, name, args, {});
        auto items = iterate(value, pos);
        if (items.empty()) return Value::undefined("No first item, sequence was empty.");
        return items.front();
    }
    if (name == "last") {
        Bound b(ctx, name, args, {});
        if (value.is_dict()) ctx.fail("'dict' object is not reversible");
        auto items = iterate(value, pos);
        if (items.empty()) return Value::undefined("No last item, sequence was empty.");
        return items.back();
    }
    if (name == "reverse") {
        Bound b(ctx, name, args, {});
        if (value.is_string()) {
            auto cps = code_points(value.str());
            std::reverse(cps.begin(), cps.end());
            return Value(from_code_points(cps, 0, cps.size()));
        }
        auto items = iterate(value, pos);
        std::reverse(items.begin(), items.end());
        return make_list(std::move(items));
    }
    if (name == "items") {
        Bound b(ctx, name, args, {});
        if (value.is_undefined()) return make_list({});
        if (!value.is_dict()) ctx.fail("Can only get item pairs from a mapping.");
        std::vector<Value> out;
        for (auto& [k, v] : value.dict().items)
            out.push_back(make_list({Value(k), v}, true));
        return make_list(std::move(out));
    }
    if (name == "dictsort") {
        Bound b(ctx, name, args, {"case_sensitive", "by", "reverse"});
        if (!value.is_dict()) ctx.fail("dictsort needs a mapping");
        std::string by = b.has(1) ? b.string(1) : "key";
        if (by != "key" && by != "value")
            ctx.fail("You can only sort by either \"key\" or \"value\"");
        std::vector<Value> pairs;
        for (auto& [k, v] : value.dict().items)
            pairs.push_back(make_list({Value(k), v}, true));
        return make_list(sorted(ctx, pairs, b.flag(2, false), b.flag(0, false),
                                Value(int64_t{by == "key" ? 0 : 1})));
    }
    if (name == "sort") {
        Bound b(ctx, name, args, {"reverse", "case_sensitive", "attribute"});
        return make_list(sorted(ctx, iterate(value, pos), b.flag(0, false), b.flag(1, false),
                                b.get(2, Value::none())));
    }
    if (name == "unique") {
        Bound b(ctx, name, args, {"case_sensitive", "attribute"});
        Value attribute = b.get(1, Value::none());
        std::vector<Value> seen, out;
        for (auto& item : iterate(value, pos)) {
            Value key =
                sort_key(ctx, attribute.is_none() ? item : attribute_path(ctx, item, attribute),
                         b.flag(0, false));
            if (std::any_of(seen.begin(), seen.end(),
                            [&](const Value& s) { return equal(s, key); }))
                continue;
            seen.push_back(key);
            out.push_back(item);
        }
        return make_list(std::move(out));
    }
    if (name == "min" || name == "max") {
        Bound b(ctx, name, args, {"case_sensitive", "attribute"});
        auto items =
            sorted(ctx, iterate(value, pos), false, b.flag(0, false), b.get(1, Value::none()));
        if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
        if (name == "min") return items.front();
        // max keeps the first of equal maxima, as Python's max does
        Value best = items.back();
        Value best_key = sort_key(ctx,
                                  b.get(1, Value::none()).is_none()
                                      ? best
                                      : attribute_path(ctx, best, b.get(1, Value::none())),
                                  b.flag(0, false));
        for (auto& item : items) {
            Value key = sort_key(ctx,
                                 b.get(1, Value::none()).is_none()
                                     ? item
                                     : attribute_path(ctx, item, b.get(1, Value::none())),
                                 b.flag(0, false));
            if (equal(key, best_key)) return item;
        }
        return best;
    }
    if (name == "sum") {
        Bound b(ctx, name, args, {"attribute", "start"});
        Value total = b.get(1, Value(int64_t{0}));
        Value attribute = b.get(0, Value::none());
        for (auto& item : iterate(value, pos))
            total = binary("+", total,
                           attribute.is_none() ? item : attribute_path(ctx, item, attribute), pos);
        return total;
    }
    if (name == "map") {
        std::vector<Value> out;
        bool by_attribute = false;
        Value attribute, fallback;
        bool has_default = false;
        for (auto& [k, v] : args.keyword) {
            if (k == "attribute") {
                by_attribute = true;
                attribute = v;
            } else if (k == "default") {
                has_default = true;
                fallback = v;
            }
        }
        if (by_attribute) {
            if (!args.positional.empty())
                ctx.fail("map() with attribute takes no positional arguments");
            for (auto& item : iterate(value, pos)) {
                Value x = attribute_path(ctx, item, attribute);
                if (x.is_undefined() && has_default) x = fallback;
                out.push_back(x);
            }
            return make_list(std::move(out));
        }
        if (args.positional.empty() || !args.positional[0].is_string())
            ctx.fail("map requires a filter argument");
        std::string filter = args.positional[0].str();
        if (!known_filter(filter)) unsupported(pos, "filter '" + filter + "' (in map)");
        Args rest;
        rest.positional.assign(args.positional.begin() + 1, args.positional.end());
        rest.keyword = args.keyword;
        for (auto& item : iterate(value, pos)) {
            Args copy = rest;
            out.push_back(apply_filter(ctx, filter, item, copy, pos));
        }
        return make_list(std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
        bool by_attribute = name.size() > 6 && name.substr(name.size() - 4) == "attr";
        bool keep = name[0] == 's';
        return make_list(select_items(ctx, value, args, by_attribute, keep, name));
    }
    if (name == "attr") {
        Bound b(ctx, name, args, {"name"});
        return get_attribute(value, b.string(0), pos);
    }
    if (name == "int") {
        Bound b(ctx, name, args, {"default", "base"});
        Value fallback = b.get(0, Value(int64_t{0}));
        int64_t base = b.integer(1, 10);
        if (value.is_integral()) return Value(value.integer());
        if (value.is_float()) {
            double d = value.real();
            if (!std::isfinite(d)) return fallback;
            return Value(static_cast<int64_t>(d));
        }
        if (value.is_string()) {
            if (auto i = parse_int(value.str(), static_cast<int>(base))) return Value(*i);
            char* end = nullptr;
            std::string s = strip(value.str(), std::nullopt, true, true);
            double d = std::strtod(s.c_str(), &end);
            if (!s.empty() && end == s.c_str() + s.size() && std::isfinite(d))
                return Value(static_cast<int64_t>(d));
        }
        return fallback;
    }
    if (name == "float") {
        Bound b(ctx, name, args, {"default"});
        if (value.is_number()) return Value(value.real());
        if (value.is_string()) {
            std::string s = strip(value.str(), std::nullopt, true, true);
            char* end = nullptr;
            double d = std::strtod(s.c_str(), &end);
            if (!s.empty() && end == s.c_str() + s.size()) return Value(d);
        }
        return b.get(0, Value(0.0));
    }
    if (name == "abs") {
        Bound b(ctx, name, args, {});
        if (value.is_float()) return Value(std::fabs(value.real()));
        if (value.is_integral()) return Value(static_cast<int64_t>(std::llabs(value.integer())));
        ctx.fail("bad operand type for abs(): '" + type_name(value) + "'");
    }
    if (name == "round") {
        Bound b(ctx, name, args, {"precision", "method"});
        int64_t precision = b.integer(0, 0);
        std::string method = b.has(1) ? b.string(1) : "common";
        if (!value.is_number()) ctx.fail("round needs a number");
        double scale = std::pow(10.0, static_cast<double>(precision));
        double x = value.real() * scale;
        double r = method == "floor"  ? std::floor(x)
                   : method == "ceil" ? std::ceil(x)
                                      : std::nearbyint(x);
        if (method == "common" && std::fabs(x - std::trunc(x)) != 0.5) r = std::round(x);
        return Value(r / scale);
    }
    if (name == "indent") {
        Bound b(ctx, name, args, {"width", "first", "blank"});
        Value width = b.get(0, Value(int64_t{4}));
        std::string prefix = width.is_string()
                                 ? width.str()
                                 : std::string(std::max<int64_t>(b.integer(0, 4), 0), ' ');
        bool first = b.flag(1, false), blank = b.flag(2, false);
        std::string s = string_value();
        // jinja2: lines split with splitlines(), joined with "\n" plus the prefix
        std::string newline = "\n";
        if (s.empty()) return Value(s);
        auto lines = python_splitlines(s + newline, false);
        std::string out;
        std::string rest_joined;
        if (blank) {
            for (size_t i = 1; i < lines.size(); ++i)
                rest_joined += newline + prefix + lines[i];
        } else {
            for (size_t i = 1; i < lines.size(); ++i)
                rest_joined += newline + (lines[i].empty() ? "" : prefix) + lines[i];
        }
        out = lines.empty() ? "" : lines[0];
        out += rest_joined;
        if (first) out = prefix + out;
        // the newline added before splitting does not come back, as in jinja2
        return Value(out);
    }
    if (name == "escape" || name == "e" || name == "forceescape") {
        Bound b(ctx, name, args, {});
        if (value.is_undefined()) return Value("");
        return Value(html_escape(string_value()));
    }
    if (name == "wordcount") {
        Bound b(ctx, name, args, {});
        // jinja2: len(re.findall(r"\w+", s)) over ASCII word characters here
        std::string s = string_value();
        require_ascii(ctx, s, "wordcount");
        int64_t n = 0;
        bool in_word = false;
        for (char c : s) {
            bool w = std::isalnum(static_cast<unsigned char>(c)) || c == '_';
            if (w && !in_word) ++n;
            in_word = w;
        }
        return Value(n);
    }
    if (name == "batch") {
        Bound b(ctx, name, args, {"linecount", "fill_with"});
        int64_t n = b.integer(0, 1);
        if (n <= 0) ctx.fail("batch size must be positive");
        std::vector<Value> out, current;
        for (auto& item : iterate(value, pos)) {
            current.push_back(item);
            if (static_cast<int64_t>(current.size()) == n) {
                out.push_back(make_list(current));
                current.clear();
            }
        }
        if (!current.empty()) {
            if (b.has(1) && !b.get(1).is_none())
                while (static_cast<int64_t>(current.size()) < n)
                    current.push_back(b.get(1));
            out.push_back(make_list(current));
        }
        return make_list(std::move(out));
    }
    unsupported(pos, "filter '" + name + "'");
}

bool apply_test(Context& ctx, const std::string& name, const Value& value, Args& args, Pos pos) {
    Pos saved = ctx.pos;
    ctx.pos = pos;
    struct Restore {
        Context& ctx;
        Pos pos;
        ~Restore() { ctx.pos = pos; }
    } restore{ctx, saved};
    auto one = [&]() -> const Value& {
        if (args.positional.size() != 1 || !args.keyword.empty())
            ctx.fail("test '" + name + "' takes one argument");
        return args.positional[0];
    };
    auto none = [&]() {
        if (!args.positional.empty() || !args.keyword.empty())
            ctx.fail("test '" + name + "' takes no argument");
    };
    if (name == "defined") return none(), !value.is_undefined();
    if (name == "undefined") return none(), value.is_undefined();
    if (name == "none") return none(), value.is_none();
    if (name == "string") return none(), value.is_string();
    if (name == "boolean") return none(), value.is_bool();
    if (name == "true") return none(), value.is_bool() && std::get<bool>(value.v);
    if (name == "false") return none(), value.is_bool() && !std::get<bool>(value.v);
    if (name == "integer") return none(), value.is_int();
    if (name == "float") return none(), value.is_float();
    if (name == "number") return none(), value.is_number();
    if (name == "mapping") return none(), value.is_dict();
    if (name == "iterable")
        return none(),
               value.is_string() || value.is_list() || value.is_dict() || value.is_undefined();
    if (name == "sequence") return none(), value.is_string() || value.is_list() || value.is_dict();
    if (name == "callable") return none(), value.is_callable();
    if (name == "escaped") return none(), false;
    if (name == "lower" || name == "upper") {
        none();
        std::string s = to_str(value);
        require_ascii(ctx, s, ("the " + name + " test").c_str());
        return name == "lower" ? s == ascii_lower(s) : s == ascii_upper(s);
    }
    if (name == "odd" || name == "even") {
        none();
        if (!value.is_integral()) ctx.fail("test '" + name + "' needs an integer");
        int64_t r = value.integer() % 2;
        return name == "odd" ? r != 0 : r == 0;
    }
    if (name == "divisibleby") {
        const Value& n = one();
        if (!value.is_integral() || !n.is_integral() || n.integer() == 0)
            ctx.fail("test 'divisibleby' needs integers");
        return value.integer() % n.integer() == 0;
    }
    if (name == "eq" || name == "equalto" || name == "==") return equal(value, one());
    if (name == "ne" || name == "!=") return !equal(value, one());
    if (name == "in") return contains(one(), value, pos);
    if (name == "sameas") {
        const Value& other = one();
        if (value.v.index() != other.v.index()) return false;
        if (value.is_none() || value.is_undefined()) return true;
        if (value.is_bool()) return std::get<bool>(value.v) == std::get<bool>(other.v);
        if (value.is_list()) return value.list_ptr() == other.list_ptr();
        if (value.is_dict()) return value.dict_ptr() == other.dict_ptr();
        if (value.is_object() || value.is_callable()) return equal(value, other);
        unsupported(pos, "test 'sameas' on a " + type_name(value) +
                             " (Python's identity of numbers and strings)");
    }
    if (name == "filter" || name == "test") {
        if (!value.is_string()) return false;
        return name == "filter" ? known_filter(value.str()) : known_test(value.str());
    }
    static const std::map<std::string, std::string> comparisons = {
        {"ge", ">="}, {">=", ">="}, {"gt", ">"}, {">", ">"}, {"greaterthan", ">"},
        {"le", "<="}, {"<=", "<="}, {"lt", "<"}, {"<", "<"}, {"lessthan", "<"}};
    auto it = comparisons.find(name);
    if (it != comparisons.end()) return compare_op(it->second, value, one(), pos);
    unsupported(pos, "test '" + name + "'");
}

// ---------------------------------------------------------------------------------------------
// The loop variable

struct Loop : Object, std::enable_shared_from_this<Loop> {
    std::vector<Value> items;
    size_t index = 0;
    std::optional<Value> last_changed;
    std::string type_name() const override { return "LoopContext"; }
    void release() override {
        items.clear();
        last_changed.reset();
    }
    Value attribute(const std::string& name) override {
        int64_t n = static_cast<int64_t>(items.size()), i = static_cast<int64_t>(index);
        if (name == "index") return Value(i + 1);
        if (name == "index0") return Value(i);
        if (name == "revindex") return Value(n - i);
        if (name == "revindex0") return Value(n - i - 1);
        if (name == "first") return Value(i == 0);
        if (name == "last") return Value(i == n - 1);
        if (name == "length") return Value(n);
        if (name == "depth") return Value(int64_t{1});
        if (name == "depth0") return Value(int64_t{0});
        if (name == "previtem")
            return i > 0 ? items[index - 1] : Value::undefined("there is no previous item");
        if (name == "nextitem")
            return i + 1 < n ? items[index + 1] : Value::undefined("there is no next item");
        if (name == "cycle") {
            size_t at = index;
            return make_callable("loop.cycle", [at](Context& ctx, Args& args) -> Value {
                if (args.positional.empty()) ctx.fail("no items for cycling given");
                return args.positional[at % args.positional.size()];
            });
        }
        if (name == "changed") {
            // holds the loop: a template may keep it ({% set ns.f = loop.changed %}) and call it
            // after the loop has ended, as jinja2's bound method allows
            std::shared_ptr<Loop> self = shared_from_this();
            return make_callable("loop.changed", [self](Context&, Args& args) -> Value {
                Value current = make_list(args.positional);
                if (self->last_changed && equal(*self->last_changed, current)) return Value(false);
                self->last_changed = current;
                return Value(true);
            });
        }
        return Value::undefined("'LoopContext' object has no attribute '" + name + "'");
    }
};

// ---------------------------------------------------------------------------------------------
// Statements

void assign(Context& ctx, const Target& target, const Value& value, Pos pos) {
    if (!target.ns_attribute.empty()) {
        const Value* ns = ctx.scope->find(target.names[0]);
        Namespace* n = ns && ns->is_object() ? dynamic_cast<Namespace*>(&ns->object()) : nullptr;
        if (!n) render_error(pos, "cannot assign attribute on non-namespace object");
        n->attributes.set(target.ns_attribute, value);
        return;
    }
    if (!target.tuple) {
        ctx.scope->vars[target.names[0]] = value;
        return;
    }
    std::vector<Value> items = iterate(value, pos);
    if (items.size() != target.names.size())
        render_error(pos, items.size() < target.names.size()
                              ? "not enough values to unpack (expected " +
                                    std::to_string(target.names.size()) + ", got " +
                                    std::to_string(items.size()) + ")"
                              : "too many values to unpack (expected " +
                                    std::to_string(target.names.size()) + ")");
    for (size_t i = 0; i < items.size(); ++i)
        ctx.scope->vars[target.names[i]] = items[i];
}

Value filter_chain(Context& ctx, Value value,
                   const std::vector<std::pair<std::string, CallArgs>>& filters, Pos pos) {
    for (auto& [name, call] : filters) {
        Args a = evaluate_args(call, ctx);
        value = apply_filter(ctx, name, value, a, pos);
    }
    return value;
}

Flow render_stmt(const Stmt& stmt, Context& ctx, std::string& out);

Flow render_body(const Body& body, Context& ctx, std::string& out) {
    for (auto& s : body) {
        Flow f = render_stmt(*s, ctx, out);
        if (f != Flow::normal) return f;
    }
    return Flow::normal;
}

Flow render_for(const ForStmt& s, Context& ctx, std::string& out) {
    Value iterable = s.iterable->eval(ctx);
    std::vector<Value> all = iterate(iterable, s.iterable->pos);
    std::vector<Value> items;
    if (s.condition) {
        // the filter sees each item in a scope of its own, before the loop variable exists
        for (auto& item : all) {
            ctx.arena->step(s.pos);
            Context inner = ctx;
            inner.scope = ctx.arena->scope(ctx.scope);
            assign(inner, s.target, item, s.pos);
            if (truthy(s.condition->eval(inner))) items.push_back(item);
        }
    } else {
        items = std::move(all);
    }
    if (items.empty()) {
        if (!s.otherwise.empty()) return render_body(s.otherwise, ctx, out);
        return Flow::normal;
    }
    auto loop = ctx.arena->object<Loop>();
    loop->items = items;
    Value loop_value(std::static_pointer_cast<Object>(loop));
    for (size_t i = 0; i < items.size(); ++i) {
        ctx.arena->step(s.pos);
        loop->index = i;
        // each iteration starts from the enclosing scope: what the body sets does not survive it
        Context inner = ctx;
        inner.scope = ctx.arena->scope(ctx.scope);
        inner.scope->vars["loop"] = loop_value;
        assign(inner, s.target, items[i], s.pos);
        Flow f = render_body(s.body, inner, out);
        if (f == Flow::break_loop) break;
    }
    return Flow::normal;
}

Flow render_stmt(const Stmt& stmt, Context& ctx, std::string& out) {
    if (auto* s = dynamic_cast<const TextStmt*>(&stmt)) {
        out += s->text;
        return Flow::normal;
    }
    if (auto* s = dynamic_cast<const OutputStmt*>(&stmt)) {
        out += to_str(s->expr->eval(ctx));
        return Flow::normal;
    }
    if (auto* s = dynamic_cast<const IfStmt*>(&stmt)) {
        for (auto& [cond, body] : s->branches)
            if (truthy(cond->eval(ctx))) return render_body(body, ctx, out);
        return render_body(s->otherwise, ctx, out);
    }
    if (auto* s = dynamic_cast<const ForStmt*>(&stmt)) return render_for(*s, ctx, out);
    if (auto* s = dynamic_cast<const SetStmt*>(&stmt)) {
        assign(ctx, s->target, s->value->eval(ctx), s->pos);
        return Flow::normal;
    }
    if (auto* s = dynamic_cast<const SetBlockStmt*>(&stmt)) {
        std::string captured;
        Context inner = ctx;
        render_body(s->body, inner, captured);
        assign(ctx, s->target, filter_chain(ctx, Value(captured), s->filters, s->pos), s->pos);
        return Flow::normal;
    }
    if (auto* s = dynamic_cast<const MacroStmt*>(&stmt)) {
        ctx.scope->vars[s->name] =
            make_macro(s, s->params, s->defaults, s->body, ctx.scope, std::nullopt, s->name);
        return Flow::normal;
    }
    if (auto* s = dynamic_cast<const CallBlockStmt*>(&stmt)) {
        auto* call = static_cast<const Call*>(s->call.get());
        Value caller =
            make_macro(nullptr, s->params, s->defaults, s->body, ctx.scope, std::nullopt, "caller");
        Value f = call->callee->eval(ctx);
        Args a = evaluate_args(call->args, ctx);
        a.keyword.emplace_back("caller", caller);
        out += to_str(call_value(ctx, f, a, s->pos));
        return Flow::normal;
    }
    if (auto* s = dynamic_cast<const FilterBlockStmt*>(&stmt)) {
        std::string captured;
        Flow f = render_body(s->body, ctx, captured);
        out += to_str(filter_chain(ctx, Value(captured), s->filters, s->pos));
        return f;
    }
    if (auto* s = dynamic_cast<const WithStmt*>(&stmt)) {
        Context inner = ctx;
        inner.scope = ctx.arena->scope(ctx.scope);
        for (auto& [name, e] : s->assignments)
            inner.scope->vars[name] = e->eval(ctx);
        return render_body(s->body, inner, out);
    }
    if (dynamic_cast<const BreakStmt*>(&stmt)) return Flow::break_loop;
    if (dynamic_cast<const ContinueStmt*>(&stmt)) return Flow::continue_loop;
    return Flow::normal;
}

// ---------------------------------------------------------------------------------------------
// Parser: jinja2's grammar

class Parser {
  public:
    explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

    Body parse_template() {
        Body body = parse_body({});
        if (cur().type != Tok::eof) syntax_error(cur().pos, "unexpected tag");
        return body;
    }

  private:
    std::vector<Token> tokens_;
    size_t at_ = 0;
    std::vector<MacroStmt*> macros_;  // being parsed: caller/varargs/kwargs are noted on them

    // Hostile templates (a GGUF file's, say) must not overflow the stack: nesting (brackets,
    // unary operators, blocks) and chains (a + b + ..., a.b.c..., x|f|g...), which the renderer
    // walks recursively, are bounded far above what any real template needs.
    static constexpr int max_nesting = 300;
    static constexpr int max_chain = 1000;
    int depth_ = 0;
    struct Nesting {
        Parser& parser;
        explicit Nesting(Parser& p) : parser(p) {
            if (++parser.depth_ > max_nesting)
                unsupported(parser.cur().pos,
                            "nesting deeper than " + std::to_string(max_nesting) + " levels");
        }
        ~Nesting() { --parser.depth_; }
        Nesting(const Nesting&) = delete;
        Nesting& operator=(const Nesting&) = delete;
    };
    void chain(int& length) {
        if (++length > max_chain)
            unsupported(cur().pos, "an expression chaining more than " + std::to_string(max_chain) +
                                       " operations");
    }

    const Token& cur() const { return tokens_[at_]; }
    const Token& peek(size_t n = 1) const { return tokens_[std::min(at_ + n, tokens_.size() - 1)]; }
    Token next() { return tokens_[at_ < tokens_.size() - 1 ? at_++ : at_]; }
    bool is_op(const char* op) const { return cur().type == Tok::op && cur().text == op; }
    bool is_name(const char* name) const { return cur().type == Tok::name && cur().text == name; }
    bool skip_op(const char* op) {
        if (!is_op(op)) return false;
        next();
        return true;
    }
    bool skip_name(const char* name) {
        if (!is_name(name)) return false;
        next();
        return true;
    }
    std::string describe(const Token& t) const {
        switch (t.type) {
            case Tok::eof:
                return "end of template";
            case Tok::block_end:
                return "end of statement block";
            case Tok::var_end:
                return "end of print statement";
            case Tok::data:
                return "template data";
            case Tok::string:
                return "string";
            default:
                return "'" + t.text + "'";
        }
    }
    void expect_op(const char* op) {
        if (!skip_op(op))
            syntax_error(cur().pos, std::string("expected '") + op + "', got " + describe(cur()));
    }
    std::string expect_name() {
        if (cur().type != Tok::name)
            syntax_error(cur().pos, "expected a name, got " + describe(cur()));
        return next().text;
    }
    void expect_block_end() {
        if (cur().type != Tok::block_end)
            syntax_error(cur().pos,
                         "expected the end of the statement block, got " + describe(cur()));
        next();
    }

    // Statements until one of the end tags (the tag's name is left current, after "{%").
    Body parse_body(std::initializer_list<const char*> ends) {
        Body body;
        while (true) {
            const Token& t = cur();
            if (t.type == Tok::eof) {
                if (ends.size() != 0) {
                    std::string names;
                    for (const char* e : ends)
                        names += (names.empty() ? "'" : " or '") + std::string(e) + "'";
                    syntax_error(t.pos, "unexpected end of template, expected " + names);
                }
                return body;
            }
            if (t.type == Tok::data) {
                auto s = std::make_unique<TextStmt>();
                s->pos = t.pos;
                s->text = t.text;
                body.push_back(std::move(s));
                next();
            } else if (t.type == Tok::var_begin) {
                auto s = std::make_unique<OutputStmt>();
                s->pos = t.pos;
                next();
                s->expr = parse_tuple(true, {});
                if (cur().type != Tok::var_end)
                    syntax_error(cur().pos,
                                 "expected the end of the print statement, got " + describe(cur()));
                next();
                body.push_back(std::move(s));
            } else if (t.type == Tok::block_begin) {
                const Token& tag = peek();
                if (tag.type == Tok::name) {
                    for (const char* e : ends) {
                        if (tag.text == e) {
                            next();  // the name is current
                            return body;
                        }
                    }
                }
                next();
                body.push_back(parse_statement());
            } else {
                syntax_error(t.pos, "unexpected " + describe(t));
            }
        }
    }

    StmtPtr parse_statement() {
        const Nesting nesting(*this);
        const Token& t = cur();
        if (t.type != Tok::name) syntax_error(t.pos, "tag name expected");
        std::string tag = t.text;
        Pos pos = t.pos;
        next();
        StmtPtr s;
        if (tag == "if") {
            s = parse_if(pos);
        } else if (tag == "for") {
            s = parse_for(pos);
        } else if (tag == "set") {
            s = parse_set(pos);
        } else if (tag == "macro") {
            s = parse_macro(pos);
        } else if (tag == "call") {
            s = parse_call_block(pos);
        } else if (tag == "filter") {
            s = parse_filter_block(pos);
        } else if (tag == "with") {
            s = parse_with(pos);
        } else if (tag == "break" || tag == "continue") {
            if (loops_ == 0) syntax_error(pos, "'" + tag + "' outside of a loop");
            expect_block_end();
            if (tag == "break")
                s = std::make_unique<BreakStmt>();
            else
                s = std::make_unique<ContinueStmt>();
        } else if (tag == "generation") {
            // transformers' AssistantTracker: marks the assistant's tokens; renders its body
            expect_block_end();
            auto w = std::make_unique<WithStmt>();
            w->body = parse_body({"endgeneration"});
            next();
            expect_block_end();
            s = std::move(w);
        } else if (tag == "include" || tag == "import" || tag == "from" || tag == "extends" ||
                   tag == "block" || tag == "do" || tag == "autoescape" || tag == "trans" ||
                   tag == "pluralize") {
            unsupported(pos, "tag '" + tag + "'");
        } else {
            syntax_error(pos, "encountered unknown tag '" + tag + "'");
        }
        s->pos = pos;
        return s;
    }

    int loops_ = 0;

    StmtPtr parse_if(Pos) {
        auto s = std::make_unique<IfStmt>();
        ExprPtr cond = parse_tuple(false, {});
        expect_block_end();
        while (true) {
            Body body = parse_body({"elif", "else", "endif"});
            s->branches.emplace_back(std::move(cond), std::move(body));
            std::string tag = next().text;
            if (tag == "elif") {
                cond = parse_tuple(false, {});
                expect_block_end();
                continue;
            }
            if (tag == "else") {
                expect_block_end();
                s->otherwise = parse_body({"endif"});
                next();
            }
            expect_block_end();
            return s;
        }
    }

    Target parse_assign_target(bool allow_ns) {
        Target target;
        Pos pos = cur().pos;
        if (allow_ns && cur().type == Tok::name && peek().type == Tok::op && peek().text == "." &&
            peek(2).type == Tok::name) {
            target.names.push_back(next().text);
            next();
            target.ns_attribute = next().text;
            return target;
        }
        bool parenthesized = skip_op("(");
        target.names.push_back(expect_name());
        while (skip_op(",")) {
            target.tuple = true;
            if (cur().type != Tok::name) break;
            target.names.push_back(expect_name());
        }
        if (parenthesized) {
            expect_op(")");
            target.tuple = true;
        }
        for (auto& n : target.names) {
            if (n == "true" || n == "false" || n == "none" || n == "True" || n == "False" ||
                n == "None")
                syntax_error(pos, "can't assign to '" + n + "'");
        }
        return target;
    }

    StmtPtr parse_for(Pos pos) {
        auto s = std::make_unique<ForStmt>();
        s->target = parse_assign_target(false);
        if (!skip_name("in")) syntax_error(cur().pos, "expected 'in', got " + describe(cur()));
        s->iterable = parse_tuple(false, {"recursive"}, false);
        if (skip_name("if")) s->condition = parse_expression(true);
        if (is_name("recursive")) unsupported(cur().pos, "recursive for loops");
        expect_block_end();
        ++loops_;
        s->body = parse_body({"endfor", "else"});
        --loops_;
        if (next().text == "else") {
            expect_block_end();
            s->otherwise = parse_body({"endfor"});
            next();
        }
        expect_block_end();
        (void)pos;
        return s;
    }

    std::vector<std::pair<std::string, CallArgs>> parse_filter_list() {
        std::vector<std::pair<std::string, CallArgs>> filters;
        do {
            std::string name = expect_name();
            while (is_op(".")) {
                next();
                name += "." + expect_name();
            }
            CallArgs args;
            if (is_op("(")) args = parse_call_args();
            filters.emplace_back(name, std::move(args));
        } while (skip_op("|"));
        return filters;
    }

    void check_filter(const std::string& name, Pos pos) {
        if (!known_filter(name)) unsupported(pos, "filter '" + name + "'");
    }

    StmtPtr parse_set(Pos pos) {
        Target target = parse_assign_target(true);
        if (skip_op("=")) {
            auto s = std::make_unique<SetStmt>();
            s->target = std::move(target);
            s->value = parse_tuple(true, {});
            expect_block_end();
            return s;
        }
        auto s = std::make_unique<SetBlockStmt>();
        s->target = std::move(target);
        if (skip_op("|")) {
            Pos fpos = cur().pos;
            s->filters = parse_filter_list();
            for (auto& f : s->filters)
                check_filter(f.first, fpos);
        }
        expect_block_end();
        s->body = parse_body({"endset"});
        next();
        expect_block_end();
        (void)pos;
        return s;
    }

    void parse_signature(std::vector<std::string>& params, std::vector<ExprPtr>& defaults) {
        expect_op("(");
        while (!is_op(")")) {
            if (!params.empty()) expect_op(",");
            if (is_op(")")) break;
            Pos pos = cur().pos;
            std::string name = expect_name();
            params.push_back(name);
            if (skip_op("=")) {
                defaults.push_back(parse_expression(true));
            } else if (!defaults.empty()) {
                syntax_error(pos, "non-default argument follows default argument");
            }
        }
        expect_op(")");
    }

    StmtPtr parse_macro(Pos) {
        auto s = std::make_unique<MacroStmt>();
        s->name = expect_name();
        parse_signature(s->params, s->defaults);
        expect_block_end();
        macros_.push_back(s.get());
        int saved_loops = loops_;
        loops_ = 0;
        s->body = parse_body({"endmacro"});
        loops_ = saved_loops;
        macros_.pop_back();
        next();
        if (cur().type == Tok::name && cur().text == s->name) next();
        expect_block_end();
        return s;
    }

    StmtPtr parse_call_block(Pos pos) {
        auto s = std::make_unique<CallBlockStmt>();
        if (is_op("(")) parse_signature(s->params, s->defaults);
        ExprPtr e = parse_expression(true);
        if (!dynamic_cast<Call*>(e.get())) syntax_error(pos, "expected a call");
        s->call = std::move(e);
        expect_block_end();
        s->body = parse_body({"endcall"});
        next();
        expect_block_end();
        return s;
    }

    StmtPtr parse_filter_block(Pos pos) {
        auto s = std::make_unique<FilterBlockStmt>();
        Pos fpos = cur().pos;
        s->filters = parse_filter_list();
        for (auto& f : s->filters)
            check_filter(f.first, fpos);
        expect_block_end();
        s->body = parse_body({"endfilter"});
        next();
        expect_block_end();
        (void)pos;
        return s;
    }

    StmtPtr parse_with(Pos) {
        auto s = std::make_unique<WithStmt>();
        while (cur().type != Tok::block_end) {
            if (!s->assignments.empty()) expect_op(",");
            std::string name = expect_name();
            expect_op("=");
            s->assignments.emplace_back(name, parse_expression(true));
        }
        expect_block_end();
        s->body = parse_body({"endwith"});
        next();
        expect_block_end();
        return s;
    }

    // ---- expressions

    template <typename T>
    std::unique_ptr<T> node(Pos pos) {
        auto n = std::make_unique<T>();
        n->pos = pos;
        return n;
    }

    ExprPtr parse_tuple(bool with_condexpr, std::initializer_list<const char*> extra_ends,
                        bool explicit_parentheses = false) {
        Pos pos = cur().pos;
        std::vector<ExprPtr> items;
        bool is_tuple = false;
        auto at_end = [&]() {
            if (cur().type == Tok::var_end || cur().type == Tok::block_end) return true;
            if (is_op(")") && explicit_parentheses) return true;
            for (const char* e : extra_ends)
                if (is_name(e)) return true;
            return false;
        };
        while (true) {
            if (!items.empty()) {
                if (!skip_op(",")) break;
                is_tuple = true;
            }
            if (at_end()) break;
            items.push_back(with_condexpr ? parse_expression(true) : parse_expression(false));
            if (!is_op(",")) break;
        }
        if (!is_tuple) {
            if (items.empty()) {
                if (!explicit_parentheses)
                    syntax_error(cur().pos, "expected an expression, got " + describe(cur()));
                auto t = node<ListExpr>(pos);
                t->tuple = true;
                return t;
            }
            return std::move(items[0]);
        }
        auto t = node<ListExpr>(pos);
        t->tuple = true;
        t->items = std::move(items);
        return t;
    }

    ExprPtr parse_expression(bool with_condexpr) {
        if (with_condexpr) return parse_condexpr();
        return parse_or();
    }

    ExprPtr parse_condexpr() {
        const Nesting nesting(*this);
        Pos pos = cur().pos;
        ExprPtr expr1 = parse_or();
        int length = 0;
        while (skip_name("if")) {
            chain(length);
            auto c = node<CondExpr>(pos);
            c->test = parse_or();
            if (skip_name("else")) c->otherwise = parse_condexpr();
            c->then = std::move(expr1);
            expr1 = std::move(c);
        }
        return expr1;
    }

    ExprPtr parse_or() {
        Pos pos = cur().pos;
        ExprPtr left = parse_and();
        int length = 0;
        while (skip_name("or")) {
            chain(length);
            auto b = node<Binary>(pos);
            b->op = "or";
            b->left = std::move(left);
            b->right = parse_and();
            left = std::move(b);
        }
        return left;
    }

    ExprPtr parse_and() {
        Pos pos = cur().pos;
        ExprPtr left = parse_not();
        int length = 0;
        while (skip_name("and")) {
            chain(length);
            auto b = node<Binary>(pos);
            b->op = "and";
            b->left = std::move(left);
            b->right = parse_not();
            left = std::move(b);
        }
        return left;
    }

    ExprPtr parse_not() {
        const Nesting nesting(*this);
        if (is_name("not")) {
            Pos pos = next().pos;
            auto u = node<Unary>(pos);
            u->op = "not";
            u->operand = parse_not();
            return u;
        }
        return parse_compare();
    }

    ExprPtr parse_compare() {
        Pos pos = cur().pos;
        ExprPtr expr = parse_math1();
        std::vector<std::pair<std::string, ExprPtr>> ops;
        int length = 0;
        while (true) {
            chain(length);
            static const char* const compare_ops[] = {"==", "!=", "<", "<=", ">", ">="};
            bool found = false;
            for (const char* op : compare_ops) {
                if (is_op(op)) {
                    next();
                    ops.emplace_back(op, parse_math1());
                    found = true;
                    break;
                }
            }
            if (found) continue;
            if (skip_name("in")) {
                ops.emplace_back("in", parse_math1());
            } else if (is_name("not") && peek().type == Tok::name && peek().text == "in") {
                next();
                next();
                ops.emplace_back("notin", parse_math1());
            } else {
                break;
            }
        }
        if (ops.empty()) return expr;
        auto c = node<Compare>(pos);
        c->first = std::move(expr);
        c->rest = std::move(ops);
        return c;
    }

    ExprPtr binary_node(Pos pos, std::string op, ExprPtr left, ExprPtr right) {
        auto b = node<Binary>(pos);
        b->op = std::move(op);
        b->left = std::move(left);
        b->right = std::move(right);
        return b;
    }

    ExprPtr parse_math1() {
        Pos pos = cur().pos;
        ExprPtr left = parse_concat();
        int length = 0;
        while (is_op("+") || is_op("-")) {
            chain(length);
            std::string op = next().text;
            left = binary_node(pos, op, std::move(left), parse_concat());
        }
        return left;
    }

    ExprPtr parse_concat() {
        Pos pos = cur().pos;
        ExprPtr left = parse_math2();
        int length = 0;
        while (is_op("~")) {
            chain(length);
            next();
            left = binary_node(pos, "~", std::move(left), parse_math2());
        }
        return left;
    }

    ExprPtr parse_math2() {
        Pos pos = cur().pos;
        ExprPtr left = parse_pow();
        int length = 0;
        while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
            chain(length);
            std::string op = next().text;
            left = binary_node(pos, op, std::move(left), parse_pow());
        }
        return left;
    }

    ExprPtr parse_pow() {
        Pos pos = cur().pos;
        ExprPtr left = parse_unary(true);
        int length = 0;
        while (is_op("**")) {
            chain(length);
            next();
            left = binary_node(pos, "**", std::move(left), parse_unary(true));
        }
        return left;
    }

    ExprPtr parse_unary(bool with_filter) {
        const Nesting nesting(*this);
        Pos pos = cur().pos;
        ExprPtr n;
        if (is_op("-") || is_op("+")) {
            std::string op = next().text;
            auto u = node<Unary>(pos);
            u->op = op;
            u->operand = parse_unary(false);
            n = std::move(u);
        } else {
            n = parse_primary();
        }
        n = parse_postfix(std::move(n));
        if (with_filter) n = parse_filter_expr(std::move(n));
        return n;
    }

    ExprPtr parse_primary() {
        const Token& t = cur();
        Pos pos = t.pos;
        if (t.type == Tok::name) {
            std::string name = next().text;
            auto lit = node<Literal>(pos);
            if (name == "true" || name == "True") {
                lit->value = Value(true);
            } else if (name == "false" || name == "False") {
                lit->value = Value(false);
            } else if (name == "none" || name == "None") {
                lit->value = Value::none();
            } else {
                if (!macros_.empty()) {
                    // a macro that names them takes extra arguments (jinja2's rule)
                    if (name == "varargs") macros_.back()->uses_varargs = true;
                    if (name == "kwargs") macros_.back()->uses_kwargs = true;
                    if (name == "caller") macros_.back()->uses_caller = true;
                }
                auto n = node<Name>(pos);
                n->name = name;
                return n;
            }
            return lit;
        }
        if (t.type == Tok::string) {
            std::string s;
            while (cur().type == Tok::string)
                s += next().text;  // adjacent literals join
            auto lit = node<Literal>(pos);
            lit->value = Value(s);
            return lit;
        }
        if (t.type == Tok::integer || t.type == Tok::real) {
            auto lit = node<Literal>(pos);
            lit->value = t.type == Tok::integer ? Value(t.integer) : Value(t.real);
            next();
            return lit;
        }
        if (is_op("(")) {
            next();
            ExprPtr e = parse_tuple(true, {}, true);
            expect_op(")");
            return e;
        }
        if (is_op("[")) {
            next();
            auto l = node<ListExpr>(pos);
            while (!is_op("]")) {
                if (!l->items.empty()) expect_op(",");
                if (is_op("]")) break;
                l->items.push_back(parse_expression(true));
            }
            expect_op("]");
            return l;
        }
        if (is_op("{")) {
            next();
            auto d = node<DictExpr>(pos);
            while (!is_op("}")) {
                if (!d->items.empty()) expect_op(",");
                if (is_op("}")) break;
                ExprPtr key = parse_expression(true);
                expect_op(":");
                d->items.emplace_back(std::move(key), parse_expression(true));
            }
            expect_op("}");
            return d;
        }
        syntax_error(pos, "unexpected " + describe(t));
    }

    ExprPtr parse_postfix(ExprPtr n) {
        int length = 0;
        while (true) {
            chain(length);
            if (is_op(".") || is_op("[")) {
                n = parse_subscript(std::move(n));
            } else if (is_op("(")) {
                n = parse_call(std::move(n));
            } else {
                return n;
            }
        }
    }

    ExprPtr parse_filter_expr(ExprPtr n) {
        int length = 0;
        while (true) {
            chain(length);
            if (is_op("|")) {
                n = parse_filter(std::move(n));
            } else if (is_name("is")) {
                n = parse_test(std::move(n));
            } else if (is_op("(")) {
                n = parse_call(std::move(n));
            } else {
                return n;
            }
        }
    }

    ExprPtr parse_subscript(ExprPtr obj) {
        Token t = next();
        Pos pos = t.pos;
        if (t.text == ".") {
            const Token& attr = cur();
            if (attr.type == Tok::name) {
                auto g = node<GetAttr>(pos);
                g->obj = std::move(obj);
                g->name = next().text;
                return g;
            }
            if (attr.type == Tok::integer) {
                auto g = node<GetItem>(pos);
                g->obj = std::move(obj);
                auto lit = node<Literal>(attr.pos);
                lit->value = Value(attr.integer);
                g->key = std::move(lit);
                next();
                return g;
            }
            syntax_error(attr.pos, "expected name or number");
        }
        // [ ... ]: an index, a slice, or a tuple of them (jinja2 allows the last; Python's
        // values here would refuse it)
        std::vector<ExprPtr> parts;
        bool slice = false;
        ExprPtr start, stop, step;
        if (!is_op(":")) start = parse_expression(true);
        if (is_op(":")) {
            slice = true;
            next();
            if (!is_op("]") && !is_op(":") && !is_op(",")) stop = parse_expression(true);
            if (skip_op(":")) {
                if (!is_op("]") && !is_op(",")) step = parse_expression(true);
            }
        }
        if (is_op(",")) unsupported(cur().pos, "a tuple of subscripts");
        expect_op("]");
        if (slice) {
            auto s = node<SliceExpr>(pos);
            s->obj = std::move(obj);
            s->start = std::move(start);
            s->stop = std::move(stop);
            s->step = std::move(step);
            return s;
        }
        auto g = node<GetItem>(pos);
        g->obj = std::move(obj);
        g->key = std::move(start);
        return g;
    }

    CallArgs parse_call_args() {
        expect_op("(");
        CallArgs args;
        bool first = true;
        while (!is_op(")")) {
            if (!first) {
                expect_op(",");
                if (is_op(")")) break;
            }
            first = false;
            // jinja2's order: positional, keyword, *args, **kwargs
            if (is_op("*")) {
                next();
                if (args.spread_positional || args.spread_keyword)
                    syntax_error(cur().pos, "invalid syntax for function call expression");
                args.spread_positional = parse_expression(true);
                continue;
            }
            if (is_op("**")) {
                next();
                if (args.spread_keyword)
                    syntax_error(cur().pos, "invalid syntax for function call expression");
                args.spread_keyword = parse_expression(true);
                continue;
            }
            if (cur().type == Tok::name && peek().type == Tok::op && peek().text == "=") {
                std::string key = next().text;
                next();
                args.keyword.emplace_back(key, parse_expression(true));
            } else {
                if (!args.keyword.empty())
                    syntax_error(cur().pos, "invalid syntax for function call expression");
                args.positional.push_back(parse_expression(true));
            }
        }
        expect_op(")");
        return args;
    }

    ExprPtr parse_call(ExprPtr callee) {
        Pos pos = callee->pos;  // errors point at what is called
        auto c = node<Call>(pos);
        // caller(), varargs and kwargs inside a macro are its business
        if (auto* name = dynamic_cast<Name*>(callee.get())) {
            if (name->name == "caller" && !macros_.empty()) macros_.back()->uses_caller = true;
        }
        c->callee = std::move(callee);
        c->args = parse_call_args();
        return c;
    }

    ExprPtr parse_filter(ExprPtr base) {
        expect_op("|");
        Pos pos = cur().pos;
        std::string name = expect_name();
        while (is_op(".")) {
            next();
            name += "." + expect_name();
        }
        check_filter(name, pos);
        auto f = node<FilterExpr>(pos);
        f->base = std::move(base);
        f->name = name;
        if (is_op("(")) f->args = parse_call_args();
        return f;
    }

    ExprPtr parse_test(ExprPtr base) {
        Pos pos = next().pos;  // "is"
        bool negated = skip_name("not");
        Pos name_pos = cur().pos;
        std::string name = expect_name();
        while (is_op(".")) {
            next();
            name += "." + expect_name();
        }
        if (!known_test(name)) unsupported(name_pos, "test '" + name + "'");
        auto t = node<TestExpr>(pos);
        t->base = std::move(base);
        t->name = name;
        const Token& c = cur();
        if (is_op("(")) {
            t->args = parse_call_args();
        } else if ((c.type == Tok::name || c.type == Tok::string || c.type == Tok::integer ||
                    c.type == Tok::real || is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
            if (is_name("is")) syntax_error(c.pos, "You cannot chain multiple tests with is");
            ExprPtr arg = parse_primary();
            arg = parse_postfix(std::move(arg));
            t->args.positional.push_back(std::move(arg));
        }
        if (!negated) return t;
        auto u = node<Unary>(pos);
        u->op = "not";
        u->operand = std::move(t);
        return u;
    }
};

// Names a template may call that are neither variables nor supported: refused by name.
const char* const unsupported_globals[] = {"lipsum", "cycler", "joiner"};

std::shared_ptr<Scope> globals(const ChatRenderOptions& options) {
    auto scope = std::make_shared<Scope>();
    scope->vars["raise_exception"] =
        make_callable("raise_exception", [](Context& ctx, Args& args) -> Value {
            std::string message = args.positional.empty() ? "" : to_str(args.positional[0]);
            ChatTemplateError error(where(ctx.pos) + "the template raised an exception: " + message,
                                    ctx.pos.line, ctx.pos.column);
            ChatTemplateAccess::mark_raised(error);
            throw error;
        });
    scope->vars["strftime_now"] =
        make_callable("strftime_now", [options](Context& ctx, Args& args) -> Value {
            Bound b(ctx, "strftime_now", args, {"format"});
            std::string format = b.string(0);
            std::time_t now =
                options.now ? static_cast<std::time_t>(*options.now) : std::time(nullptr);
            std::tm local{};
            localtime_r(&now, &local);
            if (format.empty()) return Value("");
            std::vector<char> buffer(256 + format.size() * 8);
            size_t n = std::strftime(buffer.data(), buffer.size(), format.c_str(), &local);
            if (n == 0) unsupported(ctx.pos, "strftime format " + string_repr(format));
            return Value(std::string(buffer.data(), n));
        });
    scope->vars["range"] = make_callable("range", [](Context& ctx, Args& args) -> Value {
        if (!args.keyword.empty() || args.positional.empty() || args.positional.size() > 3)
            ctx.fail("range expected 1 to 3 arguments");
        for (auto& a : args.positional)
            if (!a.is_integral())
                ctx.fail("'" + type_name(a) + "' object cannot be interpreted as an integer");
        int64_t start = 0, stop, step = 1;
        if (args.positional.size() == 1) {
            stop = args.positional[0].integer();
        } else {
            start = args.positional[0].integer();
            stop = args.positional[1].integer();
            if (args.positional.size() == 3) step = args.positional[2].integer();
        }
        if (step == 0) ctx.fail("range() arg 3 must not be zero");
        std::vector<Value> items;
        // jinja2's sandbox caps ranges at MAX_RANGE = 100000 items
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            if (items.size() >= 100000)
                ctx.fail(
                    "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
            items.emplace_back(i);
        }
        return make_list(std::move(items));
    });
    scope->vars["namespace"] = make_callable("namespace", [](Context& ctx, Args& args) -> Value {
        auto ns = ctx.arena->object<Namespace>();
        for (auto& a : args.positional) {
            if (!a.is_dict()) ctx.fail("namespace() takes a mapping as positional argument");
            for (auto& [k, v] : a.dict().items)
                ns->attributes.set(k, v);
        }
        for (auto& [k, v] : args.keyword)
            ns->attributes.set(k, v);
        return Value(std::static_pointer_cast<Object>(ns));
    });
    scope->vars["dict"] = make_callable("dict", [](Context& ctx, Args& args) -> Value {
        auto d = std::make_shared<DictObj>();
        for (auto& a : args.positional) {
            if (!a.is_dict()) unsupported(ctx.pos, "dict() of anything but a mapping");
            for (auto& [k, v] : a.dict().items)
                d->set(k, v);
        }
        for (auto& [k, v] : args.keyword)
            d->set(k, v);
        return Value(d);
    });
    for (const char* name : unsupported_globals) {
        std::string n = name;
        scope->vars[n] = make_callable(n, [n](Context& ctx, Args&) -> Value {
            unsupported(ctx.pos, "global function '" + n + "'");
        });
    }
    return scope;
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source) {
    Lexer lexer(source);
    Parser parser(lexer.tokenize());
    auto program = std::make_shared<Program>();
    program->body = parser.parse_template();
    program_ = std::move(program);
}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const json::Value& variables,
                                 const ChatRenderOptions& options) const {
    if (!variables.is_object())
        throw UsageError("chat template variables must be a JSON object, got " +
                         std::string(json::type_name(variables.type())));
    RenderArena arena;  // declared first: emptied last, when every other reference has gone
    Context ctx;
    ctx.arena = &arena;
    ctx.options = options;
    // the template's globals (raise_exception, range, ...) under the variables passed in, as
    // jinja2's context resolves them
    auto root = arena.scope(globals(options));
    for (const auto& [k, v] : variables.as_object())
        root->vars[k] = from_json(v);
    ctx.scope = root;
    std::string out;
    render_body(program_->body, ctx, out);
    return out;
}

// ---------------------------------------------------------------------------------------------
// Models' templates

namespace {

std::string special_token_text(const json::Value& entry) {
    if (entry.is_string()) return entry.as_string();
    if (entry.is_object()) {
        if (const json::Value* content = entry.find("content"); content && content->is_string())
            return content->as_string();
    }
    return "";
}

}  // namespace

std::optional<ModelChatTemplate> read_chat_template(const std::filesystem::path& model) {
    namespace fs = std::filesystem;
    std::error_code error;
    fs::path directory = fs::is_directory(model, error) ? model : model.parent_path();
    fs::path file = directory / "tokenizer_config.json";
    if (!fs::is_regular_file(file, error)) return std::nullopt;
    std::ifstream in(file, std::ios::binary);
    if (!in) throw IoError("cannot open " + quoted(file.string()));
    std::stringstream buffer;
    buffer << in.rdbuf();
    json::Value config;
    try {
        config = json::parse(buffer.str());
    } catch (const FormatError& e) {
        throw FormatError(quoted(file.string()) + ": " + e.what());
    }
    if (!config.is_object())
        throw FormatError(quoted(file.string()) + ": expected an object, got " +
                          std::string(json::type_name(config.type())));
    const json::Value* chat = config.find("chat_template");
    if (!chat || chat->is_null()) return std::nullopt;
    ModelChatTemplate result;
    result.file = file;
    if (chat->is_string()) {
        result.source = chat->as_string();
    } else if (chat->is_array()) {
        // a list of named templates: transformers uses the one named "default"
        bool found = false;
        for (const auto& entry : chat->as_array()) {
            const json::Value* name = entry.find("name");
            const json::Value* tmpl = entry.find("template");
            if (name && name->is_string() && name->as_string() == "default" && tmpl &&
                tmpl->is_string()) {
                result.source = tmpl->as_string();
                found = true;
            }
        }
        if (!found) return std::nullopt;
    } else {
        throw FormatError(quoted(file.string()) +
                          ": chat_template must be a string or a list of named templates");
    }
    // transformers' special_tokens_map: the set attributes among these, as strings
    for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                            "cls_token", "mask_token"}) {
        const json::Value* entry = config.find(key);
        if (!entry || entry->is_null()) continue;
        // special_tokens_map keeps the tokens whose value is truthy: an empty one is left out
        std::string text = special_token_text(*entry);
        if (!text.empty()) result.special_tokens.set(key, text);
    }
    if (const json::Value* extra = config.find("additional_special_tokens");
        extra && extra->is_array() && extra->size() > 0) {
        json::Value list = json::Value::array();
        for (const auto& e : extra->as_array())
            list.push_back(special_token_text(e));
        result.special_tokens.set("additional_special_tokens", std::move(list));
    }
    return result;
}

json::Value chat_variables(const ModelChatTemplate& model, json::Value messages,
                           bool add_generation_prompt) {
    json::Value variables = json::Value::object();
    for (const auto& [k, v] : model.special_tokens.as_object())
        variables.set(k, v);
    variables.set("messages", std::move(messages));
    variables.set("tools", nullptr);
    variables.set("documents", nullptr);
    variables.set("add_generation_prompt", add_generation_prompt);
    return variables;
}

json::Value chat_messages(std::string_view system, std::string_view user) {
    json::Value messages = json::Value::array();
    if (!system.empty()) {
        json::Value m = json::Value::object();
        m.set("role", "system");
        m.set("content", std::string(system));
        messages.push_back(std::move(m));
    }
    json::Value m = json::Value::object();
    m.set("role", "user");
    m.set("content", std::string(user));
    messages.push_back(std::move(m));
    return messages;
}

ChatPreamble chat_preamble(const ModelChatTemplate& model, std::string_view system) {
    // A marker no template would write or change: letters and digits only, so that trim,
    // capitalisation checks and the like leave it alone; templates that change it are refused.
    const std::string marker = "KvPacketDocumentsMarker7Q2X";
    ChatTemplate tmpl(model.source);
    std::string text = tmpl.render(chat_variables(model, chat_messages(system, marker), true));
    size_t at = text.find(marker);
    if (at == std::string::npos)
        throw UnsupportedError(quoted(model.file.string()) +
                               ": the chat template does not write the user's message as it is, "
                               "so no preamble can be cut from it");
    if (text.find(marker, at + marker.size()) != std::string::npos)
        throw UnsupportedError(quoted(model.file.string()) +
                               ": the chat template writes the user's message twice, so no "
                               "preamble can be cut from it");
    return ChatPreamble{text.substr(0, at), text.substr(at + marker.size())};
}

}  // namespace kv::text
