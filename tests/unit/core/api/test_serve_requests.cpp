// kvserve-once --requests: the fields of a request line over the command line's defaults, and
// the lines written back (the CLI case tests/cli/kvserve-once/requests.sh serves a whole file).
#include "kv/api/serve.hpp"
#include "kv/error.hpp"
#include "kv/json.hpp"

#include <catch2/catch.hpp>

#include <sstream>

namespace {

kv::ServeOptions request(const std::string& line, const kv::ServeOptions& defaults = {}) {
    return kv::request_options(kv::json::parse(line), defaults);
}

std::string error_of(const std::string& line) {
    try {
        request(line);
    } catch (const kv::UsageError& error) {
        return error.what();
    }
    return "";
}

}  // namespace

TEST_CASE("a request's fields override the command line's options", "[requests]") {
    kv::ServeOptions defaults;
    defaults.prompt = "default prompt";
    defaults.caches = {"store.kvc:a"};
    defaults.max_new_tokens = 32;
    defaults.sampling.temperature = 0;
    defaults.sampling.seed = 9;
    defaults.attention.method = "icecache";
    defaults.attention.budget = 128;
    defaults.offload = "disk";
    defaults.progress = [](const kv::ServeProgress&) {};

    const kv::ServeOptions plain = request(R"({"id": "q1"})", defaults);
    CHECK(plain.prompt == "default prompt");
    CHECK(plain.caches == std::vector<std::string>{"store.kvc:a"});
    CHECK(plain.max_new_tokens == 32);
    CHECK(*plain.sampling.seed == 9);
    CHECK(plain.attention.budget == 128);
    CHECK(plain.offload == "disk");
    CHECK_FALSE(plain.progress);  // a request's stages are not reported one by one

    const kv::ServeOptions full = request(
        R"({"id": 17, "prompt": "Q?", "cache": ["s.kvc:doc12", "s.kvc:doc907"], "n_predict": 4,)"
        R"( "temp": 0.5, "top_p": 0.9, "seed": 3, "echo": true, "ignore_eos": true,)"
        R"( "attention": "quest", "budget": 64, "dense_layers": 1, "reuse_layers": 3,)"
        R"( "field_of_view": 40, "sparse_prompt": true, "measure_recall": true,)"
        R"( "recompute": "none", "recompute_ratio": 0.25, "recompute_tokens": 8})",
        defaults);
    CHECK(full.prompt == "Q?");
    CHECK(full.caches == std::vector<std::string>{"s.kvc:doc12", "s.kvc:doc907"});
    CHECK(full.max_new_tokens == 4);
    CHECK(full.sampling.temperature == 0.5);
    CHECK(full.sampling.top_p == 0.9);
    CHECK(*full.sampling.seed == 3);
    CHECK(full.echo);
    CHECK(full.ignore_eos);
    CHECK(full.attention.method == "quest");
    CHECK(full.attention.budget == 64);
    CHECK(full.attention.dense_layers == 1);
    CHECK(full.attention.reuse_layers == 3);
    CHECK(full.attention.field_of_view == 40);
    CHECK(full.sparse_prompt);
    CHECK(full.attention.measure_recall);
    CHECK(full.recompute.ratio == 0.25);
    CHECK(full.recompute.tokens == 8);
    CHECK(request(R"({"id": "x", "cache": "one.kvc:p"})").caches ==
          std::vector<std::string>{"one.kvc:p"});
    CHECK(request(R"({"id": "x", "cache": []})", defaults).caches.empty());
}

TEST_CASE("a bad request is refused naming its field", "[requests]") {
    CHECK(error_of(R"([1, 2])") == "a request is a JSON object, not an array");
    CHECK(error_of(R"({"prompt": "x"})") == "the request has no \"id\"");
    CHECK(error_of(R"({"id": 1.5})") == "field 'id' must be a string or an integer, not 1.5");
    CHECK(error_of(R"({"id": "a", "n_predict": -1})") ==
          "field 'n_predict' must be an integer >= 0, not -1");
    CHECK(error_of(R"({"id": "a", "n_predict": "8"})") ==
          "field 'n_predict' must be an integer >= 0, not '8'");
    CHECK(error_of(R"({"id": "a", "budget": 10})") ==
          "field 'budget' must be an integer in [64, 1073741824], not 10");
    CHECK(error_of(R"({"id": "a", "top_p": 2})") == "field 'top_p' must be a number in [0.0, 1.0], not 2");
    CHECK(error_of(R"({"id": "a", "echo": 1})") == "field 'echo' must be true or false, not 1");
    CHECK(error_of(R"({"id": "a", "cache": [1]})") ==
          "field 'cache' must be a string, not null");
    CHECK(error_of(R"({"id": "a", "recompute": "some"})") ==
          "field 'recompute' must be none, epic, cacheblend or all, not 'some'");
    CHECK(error_of(R"({"id": "a", "attention": "sparse"})").find("sparse") != std::string::npos);
    CHECK(error_of(R"({"id": "a", "tmep": 0})").rfind("unknown field 'tmep' (a request has id, "
                                                       "prompt, cache, n_predict, temp,",
                                                       0) == 0);
}

TEST_CASE("a request's output line: the answer with its stats, or the error", "[requests]") {
    kv::RequestResult answered;
    answered.line = 3;
    answered.id = "q3";
    answered.ok = true;
    answered.text = " 4666466.";
    answered.stats.prompt_tokens = 22;
    answered.stats.generated_tokens = 4;
    answered.stats.load_seconds = 1.0;
    answered.stats.packets_read = 6;
    answered.stats.packets_from_memory = 2;
    answered.seconds = 0.25;
    const kv::json::Value line = kv::to_json(answered);
    CHECK(line.at("id").as_string() == "q3");
    CHECK(line.at("text").as_string() == " 4666466.");
    CHECK(line.find("line") == nullptr);
    const kv::json::Value& stats = line.at("stats");
    CHECK(stats.at("prompt_tokens").as_int() == 22);
    CHECK(stats.at("packets_read").as_int() == 6);
    CHECK(stats.at("packets_from_memory").as_int() == 2);
    CHECK(stats.at("seconds").as_double() == 0.25);
    CHECK(stats.find("load_seconds") == nullptr);  // the model loads once, not per request

    kv::RequestResult failed;
    failed.line = 5;
    failed.id = int64_t{7};
    failed.error = "no packet 'nope' in 's.kvc'";
    CHECK(kv::json::dump(kv::to_json(failed)) ==
          R"({"id":7,"line":5,"error":"no packet 'nope' in 's.kvc'"})");

    kv::RequestsReport report;
    report.requests = 12;
    report.answered = 11;
    report.failed = 1;
    report.seconds = 4;
    report.load_seconds = 0.5;
    report.packets_read = 80;
    report.packets_from_memory = 16;
    report.kept_bytes = 3 << 20;
    CHECK(kv::progress_line(report).text ==
          "12 requests: 11 answered, 1 failed, 3.0/s; packets 80 read, 16 from memory (3.0 MiB "
          "kept)");
    CHECK_FALSE(kv::progress_line(report).plain);
    CHECK(kv::summary(report) == kv::progress_line(report).text +
                                     " in 4.00 s after loading the model in 0.50 s");
    CHECK(kv::to_json(report).at("requests_per_second").as_double() == 3.0);
}

TEST_CASE("serve_requests refuses a document before loading anything", "[requests]") {
    kv::ServeOptions defaults;
    defaults.document = "a long text";
    std::istringstream input("{\"id\": 1}\n");
    CHECK_THROWS_AS(kv::serve_requests(defaults, input, {}), kv::UsageError);
}
