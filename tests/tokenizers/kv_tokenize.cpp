// kvtools' side of the tokenizer conformance suite (tests/tokenizers/README.md): loads a
// tokenizer with kv::load_tokenizer and, for each line {"text": ...} of a JSONL corpus, writes
// one line with the ids without and with the special tokens the model adds around a text, the
// text each decodes to, and the decoding of the text's ids with specials followed by the next
// line's (the last line's next is the first).
//
// Usage: kv_tokenize TOKENIZER CORPUS.jsonl > OUT.jsonl

#include <cstdio>
#include <exception>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "kv/json.hpp"
#include "kv/tokenizer.hpp"

namespace {

kv::json::Value ids_value(const std::vector<int32_t>& ids) {
    kv::json::Value array = kv::json::Value::array();
    for (int32_t id : ids)
        array.push_back(id);
    return array;
}

int run(const char* tokenizer_path, const char* corpus_path) {
    std::unique_ptr<kv::Tokenizer> tokenizer = kv::load_tokenizer(tokenizer_path);
    std::ifstream corpus(corpus_path);
    if (!corpus) {
        std::cerr << "kv_tokenize: cannot read " << corpus_path << "\n";
        return 2;
    }
    std::vector<std::vector<int32_t>> plain, special;
    std::string line;
    while (std::getline(corpus, line)) {
        if (line.empty()) continue;
        const std::string text = kv::json::parse(line).at("text").as_string();
        plain.push_back(tokenizer->encode(text));
        special.push_back(tokenizer->encode_with_special_tokens(text));
    }
    std::string out;
    for (size_t i = 0; i < plain.size(); ++i) {
        // Two texts one after the other, each with its special tokens, as packed documents are.
        std::vector<int32_t> joined = special[i];
        const std::vector<int32_t>& next = special[(i + 1) % special.size()];
        joined.insert(joined.end(), next.begin(), next.end());
        kv::json::Value result = kv::json::Value::object();
        result.set("ids", ids_value(plain[i]));
        result.set("ids_special", ids_value(special[i]));
        result.set("decoded", tokenizer->decode(plain[i]));
        result.set("decoded_special", tokenizer->decode(special[i]));
        result.set("decoded_joined", tokenizer->decode(joined));
        out += kv::json::dump(result);
        out += '\n';
    }
    std::fwrite(out.data(), 1, out.size(), stdout);
    return std::fflush(stdout) == 0 ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::cerr << "usage: kv_tokenize TOKENIZER CORPUS.jsonl > OUT.jsonl\n";
        return 2;
    }
    try {
        return run(argv[1], argv[2]);
    } catch (const std::exception& error) {
        std::cerr << "kv_tokenize: " << error.what() << "\n";
        return 2;
    }
}
