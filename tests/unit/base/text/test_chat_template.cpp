// The chat template engine (kv/text/chat_template.hpp). The expected outputs here are
// jinja2's with transformers' settings (python3-jinja2 3.1.2, rendered by
// tests/chat_templates/ref_render.py); tests/chat_templates checks real models' templates.
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/text/chat_template.hpp"

using kv::text::ChatTemplate;
using kv::text::ChatTemplateError;

namespace {

const char* const messages_json =
    R"([{"role": "system", "content": "Be nice"}, {"role": "user", "content": "Hello ü 😀"},
        {"role": "assistant", "content": " Hi "}])";

kv::json::Value variables() {
    kv::json::Value v = kv::json::Value::object();
    v.set("messages", kv::json::parse(messages_json));
    v.set("add_generation_prompt", true);
    v.set("bos_token", "<s>");
    return v;
}

std::string render(const std::string& source) {
    return ChatTemplate(source).render(variables());
}

// The message of the error of type E that parsing or rendering throws ("" when none).
template <typename E>
std::string error_of(const std::string& source) {
    try {
        render(source);
    } catch (const E& e) {
        return e.what();
    }
    return "";
}

struct TempDir {
    std::filesystem::path path;
    TempDir() {
        path = std::filesystem::temp_directory_path() /
               ("kv_chat_template_" + std::to_string(::getpid()));
        std::filesystem::create_directories(path);
    }
    ~TempDir() { std::filesystem::remove_all(path); }
    void write(const std::string& name, const std::string& text) const {
        std::ofstream(path / name, std::ios::binary) << text;
    }
};

}  // namespace

TEST_CASE("chat templates render as jinja2 does with transformers' settings", "[chat_template]") {
    struct Case {
        const char* name;
        const char* source;
        const char* expected;
    };
    const Case cases[] = {
        {"whitespace",
         "{% for m in messages %}\n  {{ m.role }}\n  {%- if loop.last %} last{% endif %}\n{% "
         "endfor %}\n  {# c #}\nend\n",
         "  system  user  assistant lastend"},
        {"plus", "a\n  {%+ if true %}b{% endif +%}\nc", "a\n  b\nc"},
        {"scoping",
         "{% set x = 0 %}{% for i in [1, 2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}{% "
         "if true %}{% set y = 5 %}{% endif %}{{ y }}",
         "010205"},
        {"namespace",
         "{% set ns = namespace(n=0, s='') %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% "
         "set ns.s = ns.s ~ m.role[0] %}{% endfor %}{{ ns.n }}{{ ns.s }}",
         "3sua"},
        {"python-str",
         "{{ [1, 'a', none, true, 1.5, {'k': (1, 'b\\'')}] }} {{ 1 / 2 }} {{ 7 // 2 }} {{ -7 % 3 "
         "}} {{ 2 ** 10 }} {{ 1e20 }} {{ 0.0001 }} {{ 3.0 }} {{ none }}",
         "[1, 'a', None, True, 1.5, {'k': (1, \"b'\")}] 0.5 3 2 1024 1e+20 0.0001 3.0 None"},
        {"tojson",
         "{{ messages[1] | tojson }} {{ {'a': [], 'b': {'c': 1.0}} | tojson(indent=2) }} {{ "
         "'é\\n\\u0001' | tojson }}",
         "{\"role\": \"user\", \"content\": \"Hello ü 😀\"} {\n  \"a\": [],\n  \"b\": {\n    \"c\": "
         "1.0\n  }\n} \"é\\n\\u0001\""},
        {"loop",
         "{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}{{ "
         "loop.first }}{{ loop.last }}{{ loop.revindex0 }} {% else %}none{% endfor %}",
         "1/2TrueFalse1 2/2FalseTrue0 "},
        {"macro",
         "{% macro tag(name, body='x') %}<{{ name }}>{{ body }}{{ caller() if caller is defined "
         "}}</{{ name }}>{% endmacro %}{{ tag('a') }}{{ tag('b', body=2) }}{% call tag('c') "
         "%}inner{% endcall %}",
         "<a>x</a><b>2</b><c>xinner</c>"},
        {"strings",
         "{{ ' x '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'abc'[::-1] "
         "}}|{{ 'héllo'[1:3] }}|{{ 'Hi'.startswith(('x', 'H')) }}|{{ 'hello world' | title }}|{{ "
         "'ab' * 2 }}|{{ '{} {x}'.format(1, x='y') }}|{{ '%s-%d' % ('a', 3) }}",
         "x|['a', 'b', '', 'c']|['a', 'b']|cba|él|True|Hello World|abab|1 y|a-3"},
        {"filters",
         "{{ messages | selectattr('role', 'equalto', 'user') | map(attribute='content') | join(', "
         "') }}|{{ messages | rejectattr('role', 'in', ['user']) | list | length }}|{{ [3, 1, 2] | "
         "sort | first }}|{{ [1, 2] | last }}|{{ undefined_thing | default('d') }}|{{ {'b': 1, "
         "'a': 2} | dictsort }}|{{ {'a': 1} | items | list }}|{{ '42' | int + 1 }}|{{ 'x' | int "
         "}}|{{ [1, 2, 3] | sum }}|{{ 'a\\nb' | indent(2, true) }}",
         "Hello ü 😀|2|1|2|d|[('a', 2), ('b', 1)]|[('a', 1)]|43|0|6|  a\n  b"},
        {"tests",
         "{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ 6 is divisibleby 3 }}{{ "
         "messages[0] is mapping }}{{ messages is iterable }}{{ 3 is odd }}{{ 1 is number }}{{ 'a' "
         "is not none }}",
         "FalseTrueTrueTrueTrueTrueTrueTrueTrue"},
        {"compare",
         "{{ 1 == 1.0 }}{{ true == 1 }}{{ 1 < 2 < 3 }}{{ 'b' > 'a' }}{{ [1, 2] == [1, 2] }}{{ 'ab' "
         "in 'cab' }}{{ 'role' in messages[0] }}{{ 3 not in [1] }}",
         "TrueTrueTrueTrueTrueTrueTrueTrue"},
        {"loopcontrols",
         "{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break "
         "%}{% endif %}{{ i }}{% endfor %}",
         "023"},
        {"setblock",
         "{%- set x -%}\n  hello {{ 1 }}\n{%- endset %}[{{ x }}]{% set y | upper %}b{% endset %}{{ "
         "y }}",
         "[hello 1]B"},
        {"condexpr",
         "[{{ 'x' if false }}][{{ 1 if true else 2 }}]{{ (messages | length) if messages else 0 }}",
         "[][1]3"},
        {"raw", "{% raw %}{{ not rendered }}{% endraw %}", "{{ not rendered }}"},
        {"dict-methods",
         "{{ messages[0].get('role') }}{{ messages[0].get('missing') }}{{ "
         "messages[0].get('missing', 3) }} {{ {'a': 1}.keys() }} {% for k, v in {'x': 1}.items() "
         "%}{{ k }}={{ v }}{% endfor %}",
         "systemNone3 dict_keys(['a']) x=1"},
    };
    for (const Case& c : cases) {
        INFO(c.name);
        CHECK(render(c.source) == c.expected);
    }
}

TEST_CASE("chat templates: one trailing newline of the source is dropped, CRLF becomes LF",
          "[chat_template]") {
    CHECK(render("a\r\nb\n") == "a\nb");
    CHECK(render("a\n\n") == "a\n");
    CHECK(render("{{ 'x\r\ny' }}") == "x\ny");
}

TEST_CASE("chat templates: strftime_now formats the moment given", "[chat_template]") {
    kv::text::ChatRenderOptions options;
    options.now = 1700000000;  // 2023-11-14 22:13 UTC: 2023 in every time zone
    CHECK(ChatTemplate("{{ strftime_now('%Y') }}").render(variables(), options) == "2023");
}

TEST_CASE("chat templates: what is not supported is refused with its name and position",
          "[chat_template]") {
    CHECK(error_of<kv::UnsupportedError>("ab\n  {{ x | wordwrap }}") ==
          "chat template line 2 column 10: unsupported: filter 'wordwrap'");
    CHECK(error_of<kv::UnsupportedError>("{% include 'x' %}") ==
          "chat template line 1 column 4: unsupported: tag 'include'");
    CHECK(error_of<kv::UnsupportedError>("{% for x in y recursive %}{% endfor %}") ==
          "chat template line 1 column 15: unsupported: recursive for loops");
    CHECK(error_of<kv::UnsupportedError>("{{ 1 is sameas 1 }}") ==
          "chat template line 1 column 6: unsupported: test 'sameas' on a int (Python's "
          "identity of numbers and strings)");
    // a case change of non-ASCII text would need Unicode's tables: refused, not guessed
    CHECK(
        error_of<kv::UnsupportedError>("{{ 'straße'.upper() }}")
            .find("line 1 column 12: unsupported: str.upper() of text with non-ASCII characters") !=
        std::string::npos);
    CHECK(error_of<kv::UnsupportedError>("{{ '%5s' % 'a' }}").find("printf-style conversion") !=
          std::string::npos);
}

TEST_CASE("chat templates: syntax errors are format errors with their position",
          "[chat_template]") {
    CHECK(error_of<kv::FormatError>("{% if x %}") ==
          "chat template line 1 column 11: unexpected end of template, expected 'elif' or "
          "'else' or 'endif'");
    CHECK(error_of<kv::FormatError>("x\n{{ 1 + }}") ==
          "chat template line 2 column 8: unexpected end of print statement");
    CHECK(error_of<kv::FormatError>("{% frobnicate %}") ==
          "chat template line 1 column 4: encountered unknown tag 'frobnicate'");
    CHECK(error_of<kv::FormatError>("{{ 'open }}").find("unterminated string") !=
          std::string::npos);
    CHECK(error_of<kv::FormatError>("{% break %}") ==
          "chat template line 1 column 4: 'break' outside of a loop");
}

TEST_CASE("chat templates: render errors name the template position", "[chat_template]") {
    try {
        render(
            "{% if messages[0].role != 'user' %}\n  {{ raise_exception('roles must alternate') }}"
            "{% endif %}");
        FAIL("no exception");
    } catch (const ChatTemplateError& e) {
        CHECK(e.raised_by_template());
        CHECK(e.line() == 2);
        CHECK(std::string(e.what()) ==
              "chat template line 2 column 6: the template raised an exception: roles must "
              "alternate");
    }
    CHECK(error_of<ChatTemplateError>("{{ missing.attribute }}") ==
          "chat template line 1 column 11: 'missing' is undefined");
    CHECK(error_of<ChatTemplateError>("{{ messages[0].content + 1 }}") ==
          "chat template line 1 column 4: unsupported operand type(s) for +: 'str' and 'int'");
    CHECK(error_of<ChatTemplateError>("{{ messages.append(1) }}")
              .find("access to attribute 'append' of 'list' object is unsafe") !=
          std::string::npos);
    CHECK(error_of<ChatTemplateError>("{{ messages[0] | tojson }}{{ x | tojson }}")
              .find("Object of type Undefined is not JSON serializable") != std::string::npos);
    // printing an undefined value is allowed and prints nothing, as in jinja2
    CHECK(render("[{{ nothing }}][{{ messages[0].nothing }}]") == "[][]");
}

TEST_CASE("chat templates of a model folder: tokenizer_config.json's template and tokens",
          "[chat_template]") {
    TempDir dir;
    CHECK_FALSE(kv::text::read_chat_template(dir.path));
    dir.write("tokenizer_config.json", R"({"bos_token": "<s>"})");
    CHECK_FALSE(kv::text::read_chat_template(dir.path));

    dir.write("tokenizer_config.json", R"({
        "bos_token": {"__type": "AddedToken", "content": "<|begin|>"},
        "eos_token": "<|end|>", "pad_token": null,
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{{ tools is none }}"}
        ]})");
    auto model = kv::text::read_chat_template(dir.path / "tokenizer.json");
    REQUIRE(model);
    CHECK(model->special_tokens.at("bos_token").as_string() == "<|begin|>");
    CHECK(model->special_tokens.at("eos_token").as_string() == "<|end|>");
    CHECK_FALSE(model->special_tokens.find("pad_token"));
    ChatTemplate tmpl(model->source);
    auto vars = kv::text::chat_variables(*model, kv::text::chat_messages("Sys", "Q?"), true);
    CHECK(tmpl.render(vars) == "<|begin|><system>Sys<|end|><user>Q?<|end|><assistant>True");
    vars = kv::text::chat_variables(*model, kv::text::chat_messages("", "Q?"), false);
    CHECK(tmpl.render(vars) == "<|begin|><user>Q?<|end|>True");

    auto preamble = kv::text::chat_preamble(*model, "Sys");
    CHECK(preamble.before == "<|begin|><system>Sys<|end|><user>");
    CHECK(preamble.after == "<|end|><assistant>True");

    dir.write("tokenizer_config.json",
              R"({"chat_template": "{% for m in messages %}{{ m.content | upper }}{% endfor %}"})");
    model = kv::text::read_chat_template(dir.path);
    REQUIRE(model);
    CHECK_THROWS_AS(kv::text::chat_preamble(*model, ""), kv::UnsupportedError);

    dir.write("tokenizer_config.json", R"({"chat_template": 3})");
    CHECK_THROWS_AS(kv::text::read_chat_template(dir.path), kv::FormatError);
}

TEST_CASE("chat templates: hostile templates are refused, never overflow the stack or memory",
          "[chat_template]") {
    // A model file's template is input like any other (a GGUF file's, say).
    const std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
    CHECK(error_of<kv::UnsupportedError>(deep).find("unsupported: nesting deeper than") !=
          std::string::npos);
    std::string blocks;
    for (int i = 0; i < 2000; ++i)
        blocks += "{% if true %}";
    CHECK(error_of<kv::UnsupportedError>(blocks).find("nesting deeper than") != std::string::npos);
    std::string sum = "{{ 1";
    for (int i = 0; i < 100000; ++i)
        sum += " + 1";
    CHECK(error_of<kv::UnsupportedError>(sum + " }}")
              .find("an expression chaining more than 1000 operations") != std::string::npos);
    std::string nots = "{{ ";
    for (int i = 0; i < 100000; ++i)
        nots += "not ";
    CHECK_FALSE(error_of<kv::UnsupportedError>(nots + "x }}").empty());
    // A value nested 600 deep (Python's repr would hit its recursion limit too).
    CHECK(error_of<ChatTemplateError>("{% set ns = namespace(x=1) %}{% for i in range(600) %}"
                                      "{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x }}")
              .find("a value nested deeper than 500 levels") != std::string::npos);
    CHECK(error_of<kv::UnsupportedError>("{{ 'x' * 1000000000000 }}")
              .find("a string repeated into more than") != std::string::npos);
    CHECK(error_of<kv::UnsupportedError>("{{ ([1] * 1000000000000) | length }}")
              .find("a list repeated into more than") != std::string::npos);
    CHECK(render("{{ ([] * 1000000000000000) | length }}") == "0");
    // Nested loops and doubling recursion stop at the render's budget of loop iterations and
    // macro calls (fuzzing: two loops of 1,050 outlived the fuzzer's patience under ASan); a
    // loop just within it renders.
    const std::string loops =
        "{% set ns = namespace(x=0) %}{% for i in range(1050) %}"
        "{% for j in range(1050) %}{% set ns.x = ns.x + 1 %}{% endfor %}"
        "{% endfor %}{{ ns.x }}";
    CHECK(error_of<ChatTemplateError>(loops).find(
              "the template takes more than 250000 loop iterations and macro calls") !=
          std::string::npos);
    CHECK(error_of<ChatTemplateError>("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}"
                                      "{% endif %}{% endmacro %}{{ f(40) }}")
              .find("loop iterations and macro calls") != std::string::npos);
    CHECK(render("{% set ns = namespace(x=0) %}{% for i in range(500) %}{% for j in range(499) %}"
                 "{% set ns.x = ns.x + 1 %}{% endfor %}{% endfor %}{{ ns.x }}") == "249500");
}

TEST_CASE("chat templates: values that hold themselves render as jinja2's and are freed",
          "[chat_template]") {
    // Reference cycles: a namespace holding itself, a list in it holding it, a recursive macro
    // held by the scope it closes over (every template that defines a macro), a loop keeping
    // itself through loop.changed, a macro's own namespace holding itself, and loop.changed
    // called after its loop has ended. The render frees them all, returned or thrown
    // (LeakSanitizer checks it in scripts/test-sanitizers; tests/fuzz/regressions/chat_template
    // keeps the same template).
    const std::string cycles =
        "{%- set ns = namespace(x=none, items=[]) %}"
        "{%- set ns.x = ns %}"
        "{%- set ns.items = [ns, ns.items] %}"
        "{%- macro m(n) %}{% if n > 0 %}{{ m(n - 1) }}{% endif %}{{ n }}{% endmacro %}"
        "{%- set ns.m = m %}"
        "{%- for x in [ns] %}{{ loop.changed(loop) }}{% set ns.loop = loop %}"
        "{% set ns.c = loop.changed %}{% endfor %}"
        "{{- ns.c(1) }}|{{ m(3) }}|{{ ns.x.x.x.m(2) }}|{{ ns.items[0].items[0].x.items|length }}"
        "{%- macro outer() %}{% set own = namespace(self=none) %}{% set own.self = own %}"
        "[{{ caller() }}]{% endmacro %}"
        "{%- call outer() %}{{ ns.loop.length }}{% endcall %}"
        "{%- for message in messages %}{% set ns.last = message %}{% endfor %}"
        "{{- ns.last.role }}";
    // jinja2 3.1 with transformers' settings (tests/chat_templates/ref_render.py)
    CHECK(render(cycles) == "TrueTrue|0123|012|2[1]assistant");
    CHECK(error_of<ChatTemplateError>(cycles + "{{ raise_exception('stop') }}")
              .find("the template raised an exception: stop") != std::string::npos);
}
