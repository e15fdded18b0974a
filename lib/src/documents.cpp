#include "kv/documents.hpp"

#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/mapped_file.hpp"

#include <iostream>
#include <iterator>
#include <map>

namespace kv {
namespace {

bool is_jsonl(const std::string& path) {
    return path.size() > 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
}

void read_jsonl(const std::string& path, std::vector<Document>& documents) {
    const std::string content = read_file_text(path);
    std::size_t line_start = 0;
    int64_t line_number = 0;
    while (line_start < content.size()) {
        std::size_t line_end = content.find('\n', line_start);
        if (line_end == std::string::npos) line_end = content.size();
        ++line_number;
        std::string_view line(content.data() + line_start, line_end - line_start);
        line_start = line_end + 1;
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (line.find_first_not_of(" \t") == std::string_view::npos) continue;
        const std::string origin = kv::quoted(path) + " line " + std::to_string(line_number);
        json::Value value;
        try {
            value = json::parse(line);
        } catch (const FormatError& error) {
            throw FormatError(origin + ": " + error.what());
        }
        if (!value.is_object())
            throw FormatError(origin + ": expected a JSON object with \"text\"");
        const json::Value* text = value.find("text");
        if (!text || !text->is_string())
            throw FormatError(origin + ": missing string field \"text\"");
        Document document;
        const json::Value* id = value.find("id");
        if (!id || id->is_null())
            document.id = path + ":" + std::to_string(line_number);
        else if (id->is_string())
            document.id = id->as_string();
        else if (id->is_integer())
            document.id = std::to_string(id->as_int());
        else
            throw FormatError(origin + ": \"id\" must be a string or an integer");
        document.text = text->as_string();
        document.origin = origin;
        documents.push_back(std::move(document));
    }
}

}  // namespace

std::vector<Document> read_documents(const std::vector<std::string>& inputs) {
    std::vector<Document> documents;
    for (const std::string& input : inputs) {
        if (input == "-") {
            std::string text((std::istreambuf_iterator<char>(std::cin)),
                             std::istreambuf_iterator<char>());
            if (std::cin.bad()) throw IoError("cannot read standard input");
            documents.push_back({"-", std::move(text), "standard input"});
        } else if (is_jsonl(input)) {
            read_jsonl(input, documents);
        } else {
            documents.push_back({input, read_file_text(input), kv::quoted(input)});
        }
    }
    std::map<std::string, const Document*> seen;
    for (const Document& document : documents) {
        auto [found, inserted] = seen.emplace(document.id, &document);
        if (!inserted)
            throw FormatError("duplicate document id " + kv::quoted(document.id) + " (" +
                              found->second->origin + " and " + document.origin + ")");
    }
    return documents;
}

}  // namespace kv
