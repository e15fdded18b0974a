#include "kv/documents.hpp"
#include "kv/error.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

namespace {

std::vector<std::string> ids(const std::vector<kv::Document>& documents) {
    std::vector<std::string> result;
    for (const kv::Document& document : documents)
        result.push_back(document.id);
    return result;
}

}  // namespace

TEST_CASE("documents are read from JSONL and text files in order", "[documents]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "a.jsonl",
                         "{\"id\": \"x\", \"text\": \"one\"}\n\n{\"id\": 7, \"text\": \"two\"}\r\n"
                         "{\"text\": \"three\"}\n");
    kv::test::write_file(dir / "b.txt", "four");
    const std::string jsonl = (dir / "a.jsonl").string(), text = (dir / "b.txt").string();
    const auto documents = kv::read_documents({jsonl, text});
    CHECK(ids(documents) == std::vector<std::string>{"x", "7", jsonl + ":4", text});
    CHECK(documents[1].origin == "'" + jsonl + "' line 3");
}

TEST_CASE("bad documents throw, or are recorded and skipped when asked", "[documents]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "a.jsonl",
                         "{\"id\": \"x\", \"text\": \"one\"}\n{\"id\": \"y\", \"text\": \n"
                         "{\"id\": [1], \"text\": \"two\"}\n{\"id\": \"x\", \"text\": \"again\"}\n"
                         "{\"id\": \"z\", \"text\": \"ok\"}\n");
    kv::test::write_file(dir / "latin1.txt", "caf\xe9");
    const std::string jsonl = (dir / "a.jsonl").string(), latin1 = (dir / "latin1.txt").string(),
                      missing = (dir / "missing.txt").string();

    REQUIRE_THROWS_AS(kv::read_documents({jsonl}), kv::FormatError);
    REQUIRE_THROWS_WITH(kv::read_documents({latin1}),
                        Catch::Contains("is not valid UTF-8 (byte 3)"));
    REQUIRE_THROWS_AS(kv::read_documents({missing}), kv::IoError);

    std::vector<std::string> problems;
    const auto documents = kv::read_documents({jsonl, latin1, missing}, &problems);
    CHECK(ids(documents) == std::vector<std::string>{"x", "z"});  // the first "x" is kept
    REQUIRE(problems.size() == 5);
    CHECK_THAT(problems[0], Catch::Contains("line 2: invalid JSON"));
    CHECK_THAT(problems[1], Catch::Contains("line 3: \"id\" must be a string or an integer"));
    CHECK_THAT(problems[2], Catch::Contains("cannot open") && Catch::Contains("missing.txt"));
    // Checked document by document, in input order.
    CHECK_THAT(problems[3], Catch::Contains("duplicate document id 'x'") &&
                                Catch::Contains("line 1") && Catch::Contains("line 4"));
    CHECK_THAT(problems[4], Catch::Contains("not valid UTF-8"));
}
