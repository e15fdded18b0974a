#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>

#include "kv/error.hpp"
#include "kv/json.hpp"

using kv::json::dump;
using kv::json::parse;
using kv::json::Type;
using kv::json::Value;

namespace {

// The message of the FormatError that parsing text throws ("" if it parses).
std::string parse_error(std::string_view text) {
    try {
        parse(text);
    } catch (const kv::FormatError& error) {
        return error.what();
    }
    return "";
}

}  // namespace

TEST_CASE("json parses scalars", "[json]") {
    CHECK(parse("null").is_null());
    CHECK(parse(" true ").as_bool());
    CHECK_FALSE(parse("false").as_bool());
    CHECK(parse("42").as_int() == 42);
    CHECK(parse("42").is_integer());
    CHECK(parse("-0").is_integer());
    CHECK(parse("-17").as_int() == -17);
    CHECK(parse("1.5").as_double() == 1.5);
    CHECK_FALSE(parse("1.5").is_integer());
    CHECK_FALSE(parse("1e2").is_integer());
    CHECK(parse("1e2").as_int() == 100);
    CHECK(parse("-2.5E-3").as_double() == -0.0025);
    CHECK(parse("\"hi\"").as_string() == "hi");
    CHECK(parse("1e-400").as_double() == 0.0);
}

TEST_CASE("json keeps object order and replaces repeated keys", "[json]") {
    Value object = parse(R"({"b": 1, "a": [true, null], "c": {"d": "e"}, "b": 2})");
    REQUIRE(object.is_object());
    REQUIRE(object.size() == 3);
    CHECK(object.as_object()[0].first == "b");
    CHECK(object.as_object()[1].first == "a");
    CHECK(object.at("b").as_int() == 2);
    CHECK(object.at("a")[0].as_bool());
    CHECK(object.at("a")[1].is_null());
    CHECK(object.at("c").at("d").as_string() == "e");
    CHECK(object.find("missing") == nullptr);
    CHECK(Value(3).find("a") == nullptr);

    std::string many = "{";
    for (int i = 0; i < 40; ++i)
        many += "\"k" + std::to_string(i % 20) + "\":" + std::to_string(i) + ",";
    many.back() = '}';
    Value large = parse(many);
    REQUIRE(large.size() == 20);
    CHECK(large.as_object()[5].first == "k5");
    CHECK(large.at("k5").as_int() == 25);
}

TEST_CASE("json accessors name the types on a mismatch", "[json]") {
    Value value = parse(R"({"n": "text", "x": 2.5})");
    CHECK_THROWS_WITH(value.at("n").as_int(), "expected an integer, got a string");
    CHECK_THROWS_WITH(value.at("n").as_double(), "expected a number, got a string");
    CHECK_THROWS_WITH(value.at("x").as_int(), "expected an integer, got 2.5");
    CHECK_THROWS_WITH(value.at("x").as_string(), "expected a string, got a number");
    CHECK_THROWS_WITH(value.at("k"), "missing key 'k'");
    CHECK_THROWS_AS(value.at("n").as_array(), kv::FormatError);
    CHECK_THROWS_AS(value.at("n").size(), kv::FormatError);
    CHECK_THROWS_AS(parse("[1]")[1], kv::FormatError);
}

TEST_CASE("json builds values and dumps them", "[json]") {
    Value root = Value::object();
    root.set("name", "kv");
    root.set("count", 3);
    root.set("ratio", 0.25);
    root.set("flag", false);
    root.set("none", nullptr);
    Value& list = root.set("list", Value::array());
    list.push_back(1);
    list.push_back("two");
    list.push_back(Value::object());
    root.set("count", 4);  // replaces in place
    CHECK(dump(root) ==
          R"({"name":"kv","count":4,"ratio":0.25,"flag":false,"none":null,"list":[1,"two",{}]})");
    CHECK(dump(parse(R"({"a":[1,{"b":[]}]})"), 2) ==
          "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ]\n}");
    CHECK(Value(5u).as_int() == 5);
    CHECK(Value(int64_t{-5}).as_int() == -5);
    CHECK(Value(std::string_view("sv")).as_string() == "sv");
    CHECK(Value(std::string("s")).type() == Type::string);
}

TEST_CASE("json round trips values through dump and parse", "[json]") {
    const char* documents[] = {
        R"({"vocab":{"a":0,"b":1},"merges":["a b",["c","d"]],"x":-1.25e-7,"y":[[],{}]})",
        R"(["\"\\\/\b\f\n\r\t\u0001\u001f", "é✓😀", "\u0000"])",
        R"([0.1, 1e300, -0.0, 3.0, 123456789.125, 5e-324])",
        R"([9223372036854775807, -9223372036854775808, 18446744073709551615])",
    };
    for (const char* text : documents) {
        Value value = parse(text);
        CHECK(parse(dump(value)) == value);
        CHECK(parse(dump(value, 4)) == value);
        CHECK(dump(parse(dump(value))) == dump(value));
    }
    CHECK(dump(parse("[0.1, 3.0, 1e300]")) == "[0.1,3.0,1e+300]");
    CHECK(dump(Value(std::numeric_limits<double>::quiet_NaN())) == "null");
    CHECK(dump(Value(-std::numeric_limits<double>::infinity())) == "null");
}

TEST_CASE("json handles integers beyond 64 bits", "[json]") {
    Value max = parse("9223372036854775807");
    CHECK(max.is_integer());
    CHECK(max.as_int() == std::numeric_limits<int64_t>::max());
    CHECK(parse("-9223372036854775808").as_int() == std::numeric_limits<int64_t>::min());

    Value beyond = parse("9223372036854775808");
    CHECK(beyond.is_number());
    CHECK_FALSE(beyond.is_integer());
    CHECK(dump(beyond) == "9223372036854775808");
    CHECK_THROWS_AS(beyond.as_int(), kv::FormatError);
    CHECK(beyond.as_double() == 9223372036854775808.0);

    Value huge = parse("123456789012345678901234567890");
    CHECK_FALSE(huge.is_integer());
    CHECK(huge.as_double() == Approx(1.2345678901234568e29));
    CHECK(parse("-9223372036854775809").as_double() == -9223372036854775808.0);
    CHECK(Value(uint64_t{18446744073709551615u}).as_double() == 18446744073709551615.0);
}

TEST_CASE("json decodes escapes and surrogate pairs", "[json]") {
    CHECK(parse(R"("\u00e9")").as_string() == "\xC3\xA9");
    CHECK(parse(R"("\u20AC")").as_string() == "\xE2\x82\xAC");
    CHECK(parse(R"("\ud83d\ude00")").as_string() == "\xF0\x9F\x98\x80");
    CHECK(parse(R"("\uD834\uDD1E")").as_string() == "\xF0\x9D\x84\x9E");
    CHECK(parse(R"("a\u0000b")").as_string() == std::string("a\0b", 3));
    CHECK(parse("\"raw \xE6\x97\xA5\xE6\x9C\xAC\"").as_string() == "raw \xE6\x97\xA5\xE6\x9C\xAC");

    CHECK(parse_error(R"("\ud83d")") ==
          "invalid JSON at line 1 column 2: high surrogate not followed by a low surrogate");
    CHECK(parse_error(R"("\ud83dx")").find("high surrogate") != std::string::npos);
    CHECK(parse_error(R"("\ud83d\u0041")").find("high surrogate") != std::string::npos);
    CHECK(parse_error(R"("\ude00")") ==
          "invalid JSON at line 1 column 2: lone low surrogate in a \\u escape");
    CHECK(parse_error(R"("\x")") == "invalid JSON at line 1 column 2: invalid escape \\x");
    CHECK(parse_error(R"("\u12G4")").find("invalid hex digit 'G'") != std::string::npos);
}

TEST_CASE("json refuses invalid UTF-8 and writes valid UTF-8", "[json]") {
    CHECK(parse_error("\"\xFF\"") == "invalid JSON at line 1 column 2: invalid UTF-8 in a string");
    CHECK(!parse_error("\"\xC0\xAF\"").empty());          // overlong
    CHECK(!parse_error("\"\xED\xA0\x80\"").empty());      // encoded surrogate
    CHECK(!parse_error("\"\xF4\x90\x80\x80\"").empty());  // beyond U+10FFFF
    CHECK(!parse_error("\"\xE2\x82\"").empty());          // truncated
    CHECK(dump(Value("a\xFF"
                     "b")) ==
          "\"a\xEF\xBF\xBD"
          "b\"");
    CHECK(dump(Value("\x01\x7F")) == "\"\\u0001\x7F\"");
}

TEST_CASE("json reports errors with line and column", "[json]") {
    CHECK(parse_error("") ==
          "invalid JSON at line 1 column 1: unexpected end of input, expected a value");
    CHECK(parse_error("{\n  \"a\": 1,\n  \"b\" 2\n}") ==
          "invalid JSON at line 3 column 7: unexpected '2', expected ':' after an object key");
    CHECK(parse_error("[1, 2,]") ==
          "invalid JSON at line 1 column 7: unexpected ']', expected a value");
    CHECK(parse_error("[1 2]") ==
          "invalid JSON at line 1 column 4: unexpected '2', expected ',' or ']' in an array");
    CHECK(parse_error("{\"é\": x}") ==
          "invalid JSON at line 1 column 7: unexpected 'x', expected a value");
    CHECK(parse_error("{} x") == "invalid JSON at line 1 column 4: unexpected 'x' after the value");
    CHECK(parse_error("[1] 2") ==
          "invalid JSON at line 1 column 5: unexpected '2' after the value");
    CHECK(parse_error("\"abc") == "invalid JSON at line 1 column 1: unterminated string");
    CHECK(parse_error("\"a\tb\"") ==
          "invalid JSON at line 1 column 3: unescaped control character in a string");
    CHECK(parse_error("01") == "invalid JSON at line 1 column 1: invalid number, leading zero");
    CHECK(parse_error("1.") == "invalid JSON at line 1 column 3: invalid number, expected a digit");
    CHECK(parse_error("-") == "invalid JSON at line 1 column 2: invalid number, expected a digit");
    CHECK(parse_error("1e+") ==
          "invalid JSON at line 1 column 4: invalid number, expected a digit");
    CHECK(parse_error("1e400") == "invalid JSON at line 1 column 1: number out of range");
    CHECK(parse_error("tru") ==
          "invalid JSON at line 1 column 1: invalid literal, expected 'true'");
    CHECK(parse_error("NaN") ==
          "invalid JSON at line 1 column 1: unexpected 'N', expected a value");
    CHECK(parse_error("{'a': 1}").find("expected a string key") != std::string::npos);
    CHECK(parse_error("[1] // comment").find("after the value") != std::string::npos);
    CHECK(parse_error("\x01") ==
          "invalid JSON at line 1 column 1: unexpected byte 0x01, expected a value");
    CHECK(parse_error("{\"a\":1") ==
          "invalid JSON at line 1 column 7: unexpected end of input, expected ',' or '}' in an "
          "object");
    CHECK(parse("\xEF\xBB\xBF[1]").size() == 1);  // a byte order mark is skipped
}

TEST_CASE("json refuses nesting beyond the depth limit", "[json]") {
    auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
    CHECK_NOTHROW(parse(nested(kv::json::max_depth)));
    CHECK(parse_error(nested(kv::json::max_depth + 1)) ==
          "invalid JSON at line 1 column 513: nesting deeper than 512 levels");
    // Far deeper input still fails cleanly instead of exhausting the stack.
    CHECK_THROWS_AS(parse(std::string(1'000'000, '[')), kv::FormatError);
    CHECK_THROWS_AS(parse(std::string(100'000, '{')), kv::FormatError);
}

TEST_CASE("json parses a large tokenizer-like document quickly", "[json]") {
    std::string text = R"({"model":{"type":"BPE","vocab":{)";
    for (int i = 0; i < 150'000; ++i) {
        if (i) text += ',';
        text += "\"\\u0120tok" + std::to_string(i) + "\xC3\xA9\":" + std::to_string(i);
    }
    text += R"(},"merges":[)";
    for (int i = 0; i < 250'000; ++i) {
        if (i) text += ',';
        text += "\"\\u0120to k" + std::to_string(i) + "\"";
    }
    text += "]}}";
    Value value = parse(text);
    const Value& model = value.at("model");
    CHECK(model.at("vocab").size() == 150'000);
    CHECK(model.at("merges").size() == 250'000);
    CHECK(model.at("vocab").as_object()[7].first == "\xC4\xA0tok7\xC3\xA9");
    CHECK(parse(dump(value)) == value);
}
