// What the api functions give the tools to print besides their report structs: progress lines
// and the printf-style formatting of summaries. The tools add their name and decide where and
// whether a line goes (tools/common/tool.hpp: -q and -v). Torch-free.
#pragma once

#include <string>

namespace kv {

/// One update of a long run's progress, for people.
struct ProgressLine {
    std::string
        text;  ///< without the tool's name, e.g. "3/10 documents, 1200 tokens, 800 tokens/s"
    bool last = false;  ///< the last of its phase: on a terminal it stays, on its own line
    bool plain = true;  ///< also printed as a plain line with -v (false: only live on a terminal)
};

/// printf into a std::string (summaries and progress lines, whose number formats are fixed).
std::string format_text(const char* pattern, ...) __attribute__((format(printf, 1, 2)));

}  // namespace kv
