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

TEST_CASE("ids that FILE:ID cannot name are refused, one document at a time", "[documents]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "a.jsonl",
                         "{\"id\": \"\", \"text\": \"empty id\"}\n"
                         "{\"id\": \"two\\nlines\", \"text\": \"line feed\"}\n"
                         "{\"id\": \"cr\\r\", \"text\": \"carriage return\"}\n"
                         "{\"id\": \"a:b\", \"text\": \"a colon is fine\"}\n");
    kv::test::write_file(dir / "caf\xe9.txt", "a file name that is not UTF-8");
    const std::string jsonl = (dir / "a.jsonl").string(), latin1 = (dir / "caf\xe9.txt").string();

    REQUIRE_THROWS_WITH(kv::read_documents({jsonl}),
                        "'" + jsonl + "' line 1: the document id is empty");
    std::vector<std::string> problems;
    const auto documents = kv::read_documents({jsonl, latin1}, &problems);
    CHECK(ids(documents) == std::vector<std::string>{"a:b"});
    REQUIRE(problems.size() == 4);
    CHECK(problems[0] == "'" + jsonl + "' line 1: the document id is empty");
    CHECK(problems[1] == "'" + jsonl +
                             "' line 2: document id 'two\\nlines' holds a line break (an id is "
                             "one line)");
    CHECK_THAT(problems[2], Catch::Contains("line 3: document id 'cr\\r' holds a line break"));
    CHECK_THAT(problems[3], Catch::Contains("document id is not valid UTF-8 (byte " +
                                            std::to_string(latin1.size() - 5) + ")"));
    for (const std::string& problem : problems)
        CHECK(problem.find('\n') == std::string::npos);
}
