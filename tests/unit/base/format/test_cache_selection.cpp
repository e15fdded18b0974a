// FILE:ID as every tool reads it (parse_cache_selection): which ':' splits, and the errors.
#include "kv/error.hpp"
#include "kv/format/cache_store.hpp"
#include "test_support.hpp"

#include <catch2/catch.hpp>

#include <filesystem>

namespace {

std::pair<std::string, std::string> parsed(const std::string& spec) {
    const kv::CacheSelection selection = kv::parse_cache_selection(spec);
    return {selection.file.string(), selection.id};
}

}  // namespace

TEST_CASE("FILE:ID splits at the last ':' whose left part is an existing file",
          "[cache_selection]") {
    kv::test::TempDir dir;
    const std::string store = (dir / "s.kvc").string();
    kv::test::write_file(store, "");
    std::filesystem::create_directory(dir / "d");

    CHECK(parsed(store) == std::pair<std::string, std::string>{store, ""});
    CHECK(parsed("-") == std::pair<std::string, std::string>{"-", ""});
    CHECK(parsed(store + ":doc") == std::pair<std::string, std::string>{store, "doc"});
    // kvbake's default ids are PATH:LINE, and ids may hold any number of ':'.
    CHECK(parsed(store + ":docs.jsonl:3") ==
          std::pair<std::string, std::string>{store, "docs.jsonl:3"});
    CHECK(parsed(store + "::") == std::pair<std::string, std::string>{store, ":"});
    CHECK(parsed(store + ":a:") == std::pair<std::string, std::string>{store, "a:"});

    // A file whose name holds ':' is read whole, and its packets are named after it.
    const std::string colon_store = (dir / "s.kvc:docs.jsonl").string();
    kv::test::write_file(colon_store, "");
    CHECK(parsed(colon_store) == std::pair<std::string, std::string>{colon_store, ""});
    // Both readings exist: the longer file name wins.
    CHECK(parsed(colon_store + ":3") == std::pair<std::string, std::string>{colon_store, "3"});
    CHECK(parsed(store + ":other:3") == std::pair<std::string, std::string>{store, "other:3"});

    // A directory is never the FILE of FILE:ID.
    const std::string in_directory = (dir / "d").string() + ":x";
    REQUIRE_THROWS_AS(kv::parse_cache_selection(in_directory), kv::IoError);
    // Without ':' the argument is FILE, whatever it names: its reader reports it.
    CHECK(parsed((dir / "none.kvc").string()).first == (dir / "none.kvc").string());
}

TEST_CASE("FILE: and a missing FILE of FILE:ID are errors naming the file", "[cache_selection]") {
    kv::test::TempDir dir;
    const std::string store = (dir / "s.kvc").string(), missing = (dir / "nowhere.kvc").string();
    kv::test::write_file(store, "");

    REQUIRE_THROWS_AS(kv::parse_cache_selection(store + ":"), kv::UsageError);
    REQUIRE_THROWS_WITH(kv::parse_cache_selection(store + ":"),
                        "'" + store + ":' names no packet: give '" + store +
                            "' for every packet or '" + store + ":ID' for one");
    REQUIRE_THROWS_AS(kv::parse_cache_selection(""), kv::UsageError);

    REQUIRE_THROWS_AS(kv::parse_cache_selection(missing + ":doc"), kv::IoError);
    REQUIRE_THROWS_WITH(
        kv::parse_cache_selection(missing + ":doc"),
        "cannot open '" + missing + "' (the FILE of '" + missing + ":doc'): no such file");
    REQUIRE_THROWS_WITH(kv::parse_cache_selection(missing + ":a.jsonl:3"),
                        "cannot open '" + missing +
                            ":a.jsonl:3': neither it nor the FILE of "
                            "FILE:ID ('" +
                            missing + ":a.jsonl', '" + missing + "') is a file");
}
