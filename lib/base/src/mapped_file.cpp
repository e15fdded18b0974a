#include "kv/mapped_file.hpp"

#include "kv/error.hpp"
#include "kv/output_path.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

namespace kv {
namespace {

std::string system_reason() {
    return std::strerror(errno);
}

class FileDescriptor {
  public:
    explicit FileDescriptor(int fd) : fd_(fd) {}
    ~FileDescriptor() {
        if (fd_ >= 0) ::close(fd_);
    }
    FileDescriptor(const FileDescriptor&) = delete;
    FileDescriptor& operator=(const FileDescriptor&) = delete;
    int get() const { return fd_; }
    int release() { return std::exchange(fd_, -1); }

  private:
    int fd_;
};

}  // namespace

std::shared_ptr<const MappedFile> MappedFile::open(const std::filesystem::path& path) {
    FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0)
        throw IoError("cannot open " + quoted(path.string()) + ": " + system_reason());
    struct stat info {};
    if (::fstat(fd.get(), &info) != 0)
        throw IoError("cannot stat " + quoted(path.string()) + ": " + system_reason());
    if (!S_ISREG(info.st_mode))
        throw IoError("cannot map " + quoted(path.string()) + ": not a regular file");

    std::shared_ptr<MappedFile> file(new MappedFile());
    file->path_ = path;
    file->size_ = static_cast<std::size_t>(info.st_size);
    if (file->size_ == 0) return file;
    void* address = ::mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (address == MAP_FAILED)
        throw IoError("cannot map " + quoted(path.string()) + ": " + system_reason());
    file->data_ = static_cast<const std::byte*>(address);
    return file;
}

MappedFile::~MappedFile() {
    if (data_) ::munmap(const_cast<std::byte*>(data_), size_);
}

namespace {

// Reads fd to its end; returns false with errno set on a read error.
bool read_to_end(int fd, std::string& out) {
    char buffer[1 << 16];
    for (;;) {
        const ssize_t n = ::read(fd, buffer, sizeof buffer);
        if (n == 0) return true;
        if (n < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        out.append(buffer, static_cast<std::size_t>(n));
    }
}

}  // namespace

std::string read_file_text(const std::filesystem::path& path) {
    FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0)
        throw IoError("cannot open " + quoted(path.string()) + ": " + system_reason());
    std::string text;
    if (!read_to_end(fd.get(), text))
        throw IoError("cannot read " + quoted(path.string()) + ": " + system_reason());
    return text;
}

std::string read_standard_input() {
    std::string text;
    if (!read_to_end(STDIN_FILENO, text))
        throw IoError("cannot read standard input: " + system_reason());
    return text;
}

void write_file_atomic(const std::filesystem::path& path, const void* data, std::size_t size) {
    const OutputPath output(path);
    const auto* bytes = static_cast<const char*>(data);
    auto write_all = [&](int fd) {
        for (std::size_t written = 0; written < size;) {
            const ssize_t n = ::write(fd, bytes + written, size - written);
            if (n < 0) {
                if (errno == EINTR) continue;
                return false;
            }
            written += static_cast<std::size_t>(n);
        }
        return true;
    };
    if (output.standard_output() || output.stream()) {  // written in place
        FileDescriptor fd(output.standard_output() ? ::dup(STDOUT_FILENO) : output.open_stream());
        if (fd.get() < 0 || !write_all(fd.get()) || ::close(fd.release()) != 0)
            throw IoError("cannot write " + output.name() + ": " + system_reason());
        return;
    }
    const std::filesystem::path temporary = output.create_temporary();
    FileDescriptor fd(::open(temporary.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC));
    auto fail = [&](const std::string& what) {
        const std::string reason = system_reason();
        ::unlink(temporary.c_str());
        throw IoError("cannot " + what + " " + output.name() + ": " + reason);
    };
    if (fd.get() < 0) fail("create");
    if (!write_all(fd.get())) fail("write");
    if (::fsync(fd.get()) != 0) fail("sync");
    if (::close(fd.release()) != 0) fail("close");
    output.commit(temporary);
}

}  // namespace kv
