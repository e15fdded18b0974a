#include "kv/format/cache_store.hpp"

#include "hdf5_file.hpp"
#include "kv/error.hpp"
#include "kv/format/cache_reader.hpp"
#include "kv/output_path.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <optional>
#include <system_error>
#include <unordered_map>

namespace kv {

using format::system_reason;

MergeReport merge_cache_files(const std::vector<std::filesystem::path>& inputs,
                              const std::filesystem::path& output, const Provenance& provenance,
                              const CacheWriteOptions& options) {
    if (inputs.empty()) throw UsageError("nothing to merge: no input files");
    if (std::count(inputs.begin(), inputs.end(), std::filesystem::path("-")) > 1)
        throw UsageError("standard input ('-') can be read only once");
    // The output may be one of the inputs (adding a shard to a store): a rewrite in place, under
    // the lock kvbake --append takes, held until the new file is in place.
    std::optional<CacheFileLock> lock;
    for (const std::filesystem::path& input : inputs)
        if (!lock && same_file(input, output)) {
            if (input == "-" || output == "-")
                throw UsageError("standard input and standard output are the same file: write "
                                 "the merged store to another file");
            lock.emplace(input);
        }
    std::vector<std::unique_ptr<CacheReader>> readers;
    for (const std::filesystem::path& input : inputs)
        readers.push_back(std::make_unique<CacheReader>(input));
    // A file holds at most one adapter: the inputs' adapters are kept when they are one.
    const CacheReader* with_adapter = nullptr;
    std::optional<Adapter> adapter;
    for (const auto& reader : readers) {
        if (!reader->has_adapter()) continue;
        Adapter found = reader->read_adapter();
        if (adapter && found.fingerprint() != adapter->fingerprint())
            throw MismatchError("cannot merge: " + with_adapter->source() + " and " +
                                reader->source() +
                                " hold different adapters, and a file holds at most one");
        if (!adapter) {
            adapter = std::move(found);
            with_adapter = reader.get();
        }
    }

    const CacheReader& first = *readers.front();
    std::unordered_map<std::string, const CacheReader*> owner;
    for (const auto& reader : readers) {
        if (reader.get() != &first) {
            try {
                check_compatible(first.model(), reader->model(), reader->source());
            } catch (const MismatchError& error) {
                throw MismatchError("cannot merge " + reader->source() + " with " + first.source() +
                                    ": " + error.what());
            }
        }
        for (const PacketInfo& info : reader->packets()) {
            const auto [at, inserted] = owner.emplace(info.id, reader.get());
            if (!inserted)
                throw MismatchError("cannot merge: packet id " + kv::quoted(info.id) +
                                    " is in both " + at->second->source() + " and " +
                                    reader->source());
        }
    }

    CacheWriter writer(output, first.model(), provenance, options);
    if (adapter) writer.set_adapter(*adapter);
    MergeReport report;
    report.files = static_cast<int64_t>(readers.size());
    for (const auto& reader : readers)
        for (const PacketInfo& info : reader->packets()) {
            const Packet packet = reader->read(info.id);
            ++report.packets;
            report.tokens += packet.logical_length;
            report.stored_tokens += packet.stored_length();
            report.bytes += static_cast<int64_t>(packet.keys.size() + packet.values.size());
            writer.add(packet);
        }
    writer.finish();
    return report;
}

CacheFileLock::CacheFileLock(const std::filesystem::path& path) {
    const std::string source = kv::quoted(path.string());
    for (int attempt = 0; attempt < 100; ++attempt) {
        const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT) return;
            throw IoError("cannot open " + source + ": " + system_reason());
        }
        if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
            const bool busy = errno == EWOULDBLOCK;
            const std::string reason = system_reason();
            ::close(fd);
            throw IoError(busy ? source +
                                     " is locked: another process is writing it (try again "
                                     "when it has finished)"
                               : "cannot lock " + source + ": " + reason);
        }
        // The holder before us may have replaced the file: then our lock is on the old one.
        struct stat locked {
        }, named{};
        if (::fstat(fd, &locked) == 0 && ::stat(path.c_str(), &named) == 0 &&
            locked.st_dev == named.st_dev && locked.st_ino == named.st_ino) {
            fd_ = fd;
            return;
        }
        ::close(fd);
    }
    throw IoError("cannot lock " + source + ": it keeps being replaced");
}

CacheFileLock::~CacheFileLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
}

namespace {

// A FILE candidate of a FILE:ID argument: anything the reader could open, not a directory (a
// directory named like the start of an argument must not turn its id into a path).
bool names_file(const std::string& path) {
    std::error_code error;
    const auto status = std::filesystem::status(path, error);
    return !error && std::filesystem::exists(status) && !std::filesystem::is_directory(status);
}

}  // namespace

CacheSelection parse_cache_selection(const std::string& spec) {
    if (spec.empty()) throw UsageError("an empty cache argument names no file");
    // "-" is standard input and nothing else: a FILE:ID split of it would read a file named "-".
    if (spec == "-" || names_file(spec)) return {spec, ""};
    // Ids may hold ':' (kvbake's default ids are PATH:LINE) and so may file names: the split is at
    // the last ':' whose left part is an existing file, so that every id of an existing file can
    // be named; when both readings exist, the longer file name wins (kvpack(1)).
    std::vector<std::string> candidates;
    for (std::size_t colon = spec.rfind(':'); colon != std::string::npos && colon > 0;
         colon = spec.rfind(':', colon - 1)) {
        std::string file = spec.substr(0, colon);
        if (names_file(file)) {
            if (colon + 1 == spec.size())
                throw UsageError(kv::quoted(spec) + " names no packet: give " + kv::quoted(file) +
                                 " for every packet or " + kv::quoted(file + ":ID") + " for one");
            return {std::move(file), spec.substr(colon + 1)};
        }
        candidates.push_back(std::move(file));
    }
    if (candidates.empty()) return {spec, ""};  // no ':': the reader names the file it cannot open
    // Nothing exists: name the file the user most likely meant, and the other readings.
    if (candidates.size() == 1)
        throw IoError("cannot open " + kv::quoted(candidates.front()) + " (the FILE of " +
                      kv::quoted(spec) + "): no such file");
    std::string readings;
    for (const std::string& file : candidates)
        readings += (readings.empty() ? "" : ", ") + kv::quoted(file);
    throw IoError("cannot open " + kv::quoted(spec) + ": neither it nor the FILE of FILE:ID (" +
                  readings + ") is a file");
}

}  // namespace kv
