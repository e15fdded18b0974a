// Cache files as stores of packets: naming one packet on the command line (FILE:ID), merging
// stores baked apart, and the lock that in-place rewrites take.
#pragma once

#include "kv/format/cache_writer.hpp"

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace kv {

/// An exclusive advisory lock (flock) on an existing cache file for as long as it lives, taken
/// without waiting: a second process gets IoError naming the file. Writers replace files by
/// rename, so the lock is taken on the file the name refers to after locking (retrying when it
/// was replaced meanwhile). Nothing is locked when the file does not exist.
class CacheFileLock {
  public:
    explicit CacheFileLock(const std::filesystem::path& path);
    ~CacheFileLock();
    CacheFileLock(const CacheFileLock&) = delete;
    CacheFileLock& operator=(const CacheFileLock&) = delete;
    bool locked() const { return fd_ >= 0; }  ///< false: the file did not exist

  private:
    int fd_ = -1;
};

/// A cache argument as users write it: FILE (every packet, in file order) or FILE:ID (one packet),
/// "-" for standard input. The whole argument is FILE when it names an existing file (not a
/// directory); otherwise it splits at the last ':' whose left part is an existing file, so ids
/// holding ':' can be named. Throws UsageError for "FILE:" (no id) and for an empty argument, and
/// IoError naming the file(s) meant when the argument holds ':' but no reading names a file. An
/// argument without ':' that names nothing is returned as FILE: its reader reports it.
struct CacheSelection {
    std::filesystem::path file;
    std::string id;  ///< empty: every packet
};
CacheSelection parse_cache_selection(const std::string& spec);

/// What merge_cache_files wrote.
struct MergeReport {
    int64_t files = 0;
    int64_t packets = 0;
    int64_t tokens = 0;         ///< logical lengths, summed
    int64_t stored_tokens = 0;  ///< stored lengths, summed
    int64_t bytes = 0;          ///< keys and values, as read (dequantised)
};

/// Merges stores baked separately (shards of one kvbake run, say) into `output`: the packets of
/// every input, inputs in the order given and packets in file order, tensors copied exactly.
/// Throws MismatchError naming both files when two inputs differ in model information
/// (check_compatible) or share a packet id; nothing is written then. At most one input may be
/// "-"; `output` may be one of the inputs (it is replaced atomically at the end). Returns what was
/// written.
MergeReport merge_cache_files(const std::vector<std::filesystem::path>& inputs,
                              const std::filesystem::path& output, const Provenance& provenance,
                              const CacheWriteOptions& options = {});

}  // namespace kv
