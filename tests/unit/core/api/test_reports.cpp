// The tools print what these functions build: --json reports, summary lines and progress lines,
// in fixed formats (the CLI tests compare them byte for byte).
#include "kv/api/bake.hpp"
#include "kv/api/index.hpp"
#include "kv/api/pack.hpp"
#include "kv/api/train.hpp"
#include "kv/compress.hpp"
#include "kv/json.hpp"

#include <catch2/catch.hpp>

TEST_CASE("kvbake's report: JSON keys by the options, summary and progress", "[reports]") {
    kv::BakeReport report;
    report.documents = 3;
    report.tokens = 1200;
    report.seconds = 1.5;
    report.tokens_per_second = 800;
    kv::BakeOptions options;
    CHECK(kv::summary(report, options) == "3 documents, 1200 tokens in 1.50 s (800 tokens/s)");
    CHECK(kv::json::dump(kv::to_json(report, options)) ==
          R"({"documents":3,"tokens":1200,"seconds":1.5,"tokens_per_second":800.0,)"
          R"("truncated":0,"skipped":[]})");

    options.append = true;
    options.compress = kv::CompressionSettings{};
    report.kept_documents = 2;
    report.truncated = 1;
    report.stored_tokens = 40;
    report.skipped = {"'x.txt' is empty"};
    CHECK(kv::summary(report, options) ==
          "3 documents, 1200 tokens in 1.50 s (800 tokens/s), appended to 2 kept, 1 truncated, "
          "compressed by knorm to 40 tokens per head, 1 skipped");
    const kv::json::Value value = kv::to_json(report, options);
    CHECK(value.at("compress").as_string() == "knorm");
    CHECK(value.at("stored_tokens").as_int() == 40);
    CHECK(value.at("skipped")[0].as_string() == "'x.txt' is empty");
    CHECK(value.at("kept_documents").as_int() == 2);

    const kv::ProgressLine line = kv::progress_line(kv::BakeProgress{1, 3, 400, 0.5});
    CHECK(line.text == "1/3 documents, 400 tokens, 800 tokens/s");
    CHECK_FALSE(line.last);
    CHECK(line.plain);
}

TEST_CASE("kvindex's and kvpack's reports", "[reports]") {
    kv::IndexReport index;
    index.packets = 2;
    index.tokens = 18;
    index.indexes = 16;
    index.pages = 20;
    index.max_levels = 3;
    index.build_seconds = 0.0125;
    index.seconds = 0.5;
    CHECK(kv::summary(index) ==
          "2 packets, 18 tokens, 16 indexes, 20 pages, up to 3 levels; built in 0.013 s (0.500 s "
          "in all)");
    CHECK(kv::to_json(index).at("max_levels").as_int() == 3);
    CHECK(kv::progress_line(kv::IndexProgress{1, 2}).text == "1/2 packets");
    CHECK_FALSE(kv::progress_line(kv::IndexProgress{1, 2}).last);
    CHECK(kv::progress_line(kv::IndexProgress{2, 2}).last);

    kv::PackReport pack;
    pack.parts = {{"a.kvc", "a", 0, 8, 8}, {"b.kvc", "b", 8, 7, 5}};
    pack.logical_length = 15;
    pack.stored_length = 13;
    pack.seconds = 0.0123;
    CHECK(kv::summary(pack) == "2 packets, 15 tokens (13 stored) in 0.012 s");
    CHECK(kv::warning(pack).empty());
    pack.index_dropped = "packet 'b' has no index";
    CHECK(kv::warning(pack) ==
          "note: packet 'b' has no index: the context carries no IceCache index");
    const kv::json::Value value = kv::to_json(pack);
    CHECK(value.at("packets").as_int() == 2);
    CHECK(value.at("parts")[1].at("offset").as_int() == 8);
    CHECK(value.at("parts")[1].at("stored_length").as_int() == 5);
}

TEST_CASE("kvtrain's report and progress", "[reports]") {
    kv::TrainReport report;
    report.samples = 4;
    report.teacher_answered = 1;
    report.teacher_reused = 3;
    report.steps = 4;
    report.total_steps = 4;
    report.first_loss = 0.9;
    report.last_loss = 0.25;
    report.teacher_seconds = 1.25;
    report.train_seconds = 2;
    report.fingerprint = "0123456789abcdef";
    CHECK(kv::summary(report) ==
          "4 samples (1 answered, 3 reused), step 4/4, loss 0.9000 -> 0.2500 per answer token, "
          "3.2 s; adapter 0123456789ab");
    CHECK(kv::to_json(report).at("adapter_fingerprint").as_string() == "0123456789abcdef");

    const kv::ProgressLine teacher = kv::progress_line(kv::TrainProgress{"teacher", 1, 4, 0, 0, 2});
    CHECK(teacher.text == "teacher 1/4 samples, 2 s");
    CHECK_FALSE(teacher.plain);  // with -v only the last teacher line
    CHECK(kv::progress_line(kv::TrainProgress{"teacher", 4, 4, 0, 0, 2}).plain);
    const kv::ProgressLine step = kv::progress_line(kv::TrainProgress{"train", 1, 4, 1, 0.5, 3});
    CHECK(step.text == "[######                  ] step 1/4 epoch 1 loss 0.5000, 3 s");
    CHECK_FALSE(step.last);
}

TEST_CASE("kvinspect compress's report, warning and details", "[reports]") {
    kv::CompressReport report;
    report.method = "knorm";
    report.quantization = "none";
    report.packets = {{"a", 8, 8, 4, true, true}, {"b", 10, 10, 5, true, false}};
    report.bytes_before = 18432;
    report.bytes_after = 9216;
    CHECK(kv::summary(report) ==
          "compressed 2 packets with knorm: 18 -> 9 tokens per head, 18432 -> 9216 bytes of keys "
          "and values, tokens chosen per head (IceCache indexes dropped: run kvindex again)");
    CHECK(kv::warning(report) == "note: IceCache indexes dropped from 1 packet: run kvindex again");
    CHECK(kv::details(report) ==
          std::vector<std::string>{
              "packet 'a': 8 -> 4 tokens per head, of 8 positions, chosen per head, IceCache "
              "index dropped",
              "packet 'b': 10 -> 5 tokens per head, of 10 positions, chosen per head"});
    const kv::json::Value value = kv::to_json(report);
    CHECK(value.at("tokens_before").as_int() == 18);
    CHECK(value.at("tokens_after").as_int() == 9);
    CHECK(value.at("packets")[0].at("index_dropped").as_bool());

    report.packets.pop_back();
    report.packets[0].index_dropped = false;
    report.method = "";
    report.quantization = "int8";
    CHECK(kv::summary(report).starts_with("compressed 1 packet stored as int8: 8 -> 4 tokens"));
    CHECK(kv::warning(report).empty());
}
