// Reading the documents kvbake bakes: plain text files (one document each), "-" (standard input,
// one document), and JSONL files (one {"id": ..., "text": ...} object per line).
#pragma once

#include <string>
#include <vector>

namespace kv {

struct Document {
    std::string
        id;  ///< JSONL "id" (a string or an integer), else the file name as given; "-" for stdin
    std::string text;
    std::string origin;  ///< where it came from, for messages: "'docs.jsonl' line 3"
};

/// Reads every input in order. A path ending in ".jsonl" is JSON Lines (blank lines skipped;
/// "id" optional: it defaults to "<file>:<line>"); anything else is one document. Throws
/// IoError for unreadable files and FormatError for a malformed line, text that is not UTF-8, an
/// id that is empty, holds a line break or is not UTF-8 (ids are printed one a line and named as
/// FILE:ID), or a duplicate id, naming the file and line. With `problems`, those are not thrown: each is
/// recorded there as a one-line message and the culprit skipped (a later duplicate, not the
/// first), so that one bad document does not cost a batch (kvbake --keep-going).
std::vector<Document> read_documents(const std::vector<std::string>& inputs,
                                     std::vector<std::string>* problems = nullptr);

/// "document 'ID'", followed by where it came from when the id alone does not say it.
std::string describe(const Document& document);

/// What --keep-going forgives, decided in one place: without a sink a problem is thrown, with
/// one it is recorded as its one-line message (the caller then skips the culprit).
struct DocumentProblems {
    std::vector<std::string>* sink = nullptr;
    template <typename Problem>
    void report(const Problem& problem) const {
        if (!sink) throw problem;
        sink->push_back(problem.what());
    }
};

}  // namespace kv
