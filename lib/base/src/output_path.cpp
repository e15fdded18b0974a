#include "kv/output_path.hpp"

#include "kv/error.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

namespace kv {
namespace {

std::string system_reason() {
    return std::strerror(errno);
}

std::filesystem::path directory_of(const std::filesystem::path& path) {
    return path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
}

// Device and inode of a regular file, by path ("-": the descriptor `fd`).
bool regular_file_identity(const std::filesystem::path& path, int fd, struct stat& info) {
    const int status = path == "-" ? ::fstat(fd, &info) : ::stat(path.c_str(), &info);
    return status == 0 && S_ISREG(info.st_mode);
}

}  // namespace

OutputPath::OutputPath(const std::filesystem::path& path) {
    if (path == "-") {
        kind_ = Kind::standard_output;
        name_ = "standard output";
        return;
    }
    name_ = kv::quoted(path.string());
    if (path.empty()) throw UsageError("an output file name must not be empty");
    struct stat info {};
    target_ = path;
    if (::lstat(path.c_str(), &info) != 0) {
        if (errno != ENOENT) throw IoError("cannot write " + name_ + ": " + system_reason());
        kind_ = Kind::new_file;
        return;
    }
    if (S_ISLNK(info.st_mode)) {
        if (::stat(path.c_str(), &info) == 0) {
            // The file the links lead to is written (the rename must replace it, not the link);
            // canonical() also resolves /dev/stdout's kind of link to a file.
            if (S_ISREG(info.st_mode)) {
                std::error_code error;
                target_ = std::filesystem::canonical(path, error);
                if (error) throw IoError("cannot write " + name_ + ": " + error.message());
            }
        } else if (errno == ENOENT) {
            // A dangling link: the file it names is created (what open() would do).
            std::filesystem::path at = path;
            for (int links = 0; ::lstat(at.c_str(), &info) == 0 && S_ISLNK(info.st_mode); ++links) {
                std::error_code error;
                const std::filesystem::path link = std::filesystem::read_symlink(at, error);
                if (error || links >= 40)
                    throw IoError("cannot write " + name_ + ": " +
                                  (error ? error.message() : "too many levels of symbolic links"));
                at = link.is_absolute() ? link : directory_of(at) / link;
            }
            target_ = at;
            kind_ = Kind::new_file;
            return;
        } else {
            throw IoError("cannot write " + name_ + ": " + system_reason());
        }
    }
    if (S_ISREG(info.st_mode)) {
        kind_ = Kind::regular_file;
        mode_ = info.st_mode & 07777;
        owner_ = info.st_uid;
        group_ = info.st_gid;
    } else if (S_ISCHR(info.st_mode) || S_ISFIFO(info.st_mode)) {
        kind_ = Kind::stream;  // opened through the links as given
    } else if (S_ISDIR(info.st_mode)) {
        throw IoError("cannot write " + name_ + ": Is a directory");
    } else {
        throw IoError("cannot write " + name_ + ": not a regular file, character device or FIFO");
    }
}

std::filesystem::path OutputPath::create_temporary() const {
    std::random_device entropy;
    const std::filesystem::path temporary =
        directory_of(target_) / ("." + target_.filename().string() + ".tmp-" +
                                 std::to_string(::getpid()) + "-" + std::to_string(entropy()));
    const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) throw IoError("cannot create " + name_ + ": " + system_reason());
    if (kind_ == Kind::regular_file) {
        // The file it replaces keeps its owner where the system lets us (root, or a group we
        // are in), and its mode (after chown, which may clear set-id bits).
        if ((owner_ != ::geteuid() || group_ != ::getegid()) &&
            ::fchown(fd, owner_, group_) != 0 && group_ != ::getegid())
            (void)::fchown(fd, static_cast<uid_t>(-1), group_);
        if (::fchmod(fd, mode_) != 0) {
            const std::string reason = system_reason();
            ::close(fd);
            ::unlink(temporary.c_str());
            throw IoError("cannot create " + name_ + ": " + reason);
        }
    }
    ::close(fd);
    return temporary;
}

int OutputPath::open_stream() const {
    const int fd = ::open(target_.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) throw IoError("cannot open " + name_ + ": " + system_reason());
    return fd;
}

void OutputPath::commit(const std::filesystem::path& temporary, bool no_replace) const {
    if (no_replace) {
        // link() fails with EEXIST where rename() would replace: the first writer wins.
        if (::link(temporary.c_str(), target_.c_str()) != 0) {
            const std::string reason =
                errno == EEXIST ? "another process created it meanwhile; run again to append to it"
                                : system_reason();
            ::unlink(temporary.c_str());
            throw IoError("cannot create " + name_ + ": " + reason);
        }
        ::unlink(temporary.c_str());
    } else if (::rename(temporary.c_str(), target_.c_str()) != 0) {
        const std::string reason = system_reason();
        ::unlink(temporary.c_str());
        throw IoError("cannot rename onto " + name_ + ": " + reason);
    }
    // Make the rename itself durable.
    const int directory = ::open(directory_of(target_).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (directory >= 0) {
        ::fsync(directory);
        ::close(directory);
    }
}

bool same_file(const std::filesystem::path& input, const std::filesystem::path& output) {
    struct stat a {}, b{};
    return regular_file_identity(input, STDIN_FILENO, a) &&
           regular_file_identity(output, STDOUT_FILENO, b) && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}

void refuse_output_among_inputs(const std::filesystem::path& output,
                                const std::vector<std::filesystem::path>& inputs) {
    for (const std::filesystem::path& input : inputs) {
        if (!same_file(input, output)) continue;
        const std::string out = output == "-" ? "standard output" : kv::quoted(output.string());
        const std::string in = input == "-" ? "standard input" : kv::quoted(input.string());
        throw UsageError("the output " + out + " is the input " + in +
                         ": writing it would destroy the input (write to another file)");
    }
}

std::vector<std::filesystem::path> model_input_files(const std::filesystem::path& model) {
    std::error_code error;
    if (!std::filesystem::is_directory(model, error)) return {model};
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(model, error))
        if (entry.is_regular_file(error)) files.push_back(entry.path());
    return files;
}

}  // namespace kv
