#include <catch2/catch.hpp>

#include <string>

#include "kv/sha256.hpp"

TEST_CASE("sha256 matches the FIPS 180-4 examples", "[sha256]") {
    CHECK(kv::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(kv::sha256_hex("abc") ==
          "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(kv::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    CHECK(kv::sha256_hex(std::string(1'000'000, 'a')) ==
          "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("sha256 gives the same digest however the input is split", "[sha256]") {
    std::string text;
    for (int i = 0; i < 1000; ++i)
        text += static_cast<char>(i * 7 + 3);
    std::string expected = kv::sha256_hex(text);
    for (size_t step : {1, 3, 55, 56, 63, 64, 65, 127, 999}) {
        kv::Sha256 hash;
        for (size_t at = 0; at < text.size(); at += step) {
            hash.update(std::string_view(text).substr(at, step));
        }
        CHECK(hash.hex() == expected);
    }
    // Messages around the padding boundary (55, 56 and 64 bytes) take one or two final blocks.
    CHECK(kv::sha256_hex(std::string(55, 'x')) != kv::sha256_hex(std::string(56, 'x')));
    kv::Sha256 finished;
    finished.update("abc");
    CHECK(finished.hex() == finished.hex());  // the digest is kept once taken
}
