// kvbake's JSONL input reader on arbitrary bytes (ids, duplicates, escapes, invalid UTF-8).
#include "fuzz_input.hpp"
#include "kv/documents.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
    const auto path = kv::fuzz::scratch_file("documents.jsonl", data, size);
    kv::fuzz::expect_clean_outcome([&] { kv::read_documents({path.string()}); });
    // --keep-going's mode never throws for bad lines: it records them.
    std::vector<std::string> problems;
    kv::fuzz::expect_clean_outcome([&] { kv::read_documents({path.string()}, &problems); });
    return 0;
}
