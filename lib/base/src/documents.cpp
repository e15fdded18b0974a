#include "kv/documents.hpp"

#include "kv/error.hpp"
#include "kv/json.hpp"
#include "kv/mapped_file.hpp"
#include "utf8.hpp"

#include <map>

namespace kv {
namespace {

bool is_jsonl(const std::string& path) {
    return path.size() > 6 && path.compare(path.size() - 6, 6, ".jsonl") == 0;
}

// Byte offset of the first byte that does not start a valid UTF-8 sequence, or npos.
std::size_t invalid_utf8_offset(std::string_view text) {
    for (std::size_t at = 0; at < text.size();) {
        const std::size_t length = utf8::valid_length(text, at);
        if (length == 0) return at;
        at += length;
    }
    return std::string_view::npos;
}

void read_jsonl(const std::string& path, std::vector<Document>& documents,
                const DocumentProblems& problems) {
    std::string content;
    try {
        content = read_file_text(path);
    } catch (const IoError& error) {
        problems.report(error);
        return;
    }
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
        try {
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
        } catch (const FormatError& error) {
            problems.report(error);
        }
    }
}

}  // namespace

std::string describe(const Document& document) {
    const std::string name = "document " + kv::quoted(document.id);
    return document.origin == kv::quoted(document.id) ? name : name + " (" + document.origin + ")";
}

std::vector<Document> read_documents(const std::vector<std::string>& inputs,
                                     std::vector<std::string>* problem_sink) {
    const DocumentProblems problems{problem_sink};
    std::vector<Document> read;
    for (const std::string& input : inputs) {
        if (input == "-") {
            try {
                read.push_back({"-", read_standard_input(), "standard input"});
            } catch (const IoError& error) {
                problems.report(error);
            }
        } else if (is_jsonl(input)) {
            read_jsonl(input, read, problems);
        } else {
            try {
                read.push_back({input, read_file_text(input), kv::quoted(input)});
            } catch (const IoError& error) {
                problems.report(error);
            }
        }
    }
    std::vector<Document> documents;
    std::map<std::string, std::string> seen;  // id -> origin
    for (Document& document : read) {
        if (const std::size_t at = invalid_utf8_offset(document.text); at != std::string::npos) {
            problems.report(FormatError(describe(document) + " is not valid UTF-8 (byte " +
                                        std::to_string(at) + ")"));
            continue;
        }
        // A packet id is printed one a line (kvinspect show, kvbake --keep-going) and named on the
        // command line as FILE:ID: an empty id cannot be named, and a line break would split it.
        if (document.id.empty()) {
            problems.report(FormatError(document.origin + ": the document id is empty"));
            continue;
        }
        if (document.id.find_first_of("\n\r") != std::string::npos) {
            std::string shown;  // the id with its line breaks escaped, to keep the message one line
            for (const char c : document.id)
                shown += c == '\n'   ? std::string("\\n")
                         : c == '\r' ? std::string("\\r")
                                     : std::string(1, c);
            problems.report(FormatError(document.origin + ": document id " + kv::quoted(shown) +
                                        " holds a line break (an id is one line)"));
            continue;
        }
        if (const std::size_t at = invalid_utf8_offset(document.id); at != std::string::npos) {
            problems.report(FormatError(document.origin +
                                        ": document id is not valid UTF-8 (byte " +
                                        std::to_string(at) + ")"));
            continue;
        }
        auto [found, inserted] = seen.emplace(document.id, document.origin);
        if (!inserted) {
            problems.report(FormatError("duplicate document id " + kv::quoted(document.id) + " (" +
                                        found->second + " and " + document.origin + ")"));
            continue;
        }
        documents.push_back(std::move(document));
    }
    return documents;
}

}  // namespace kv
