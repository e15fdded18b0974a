// Where an output goes (kv/output_path.hpp): through symbolic links to their file, in place on a
// FIFO or character device, atomically onto a regular file keeping its mode, and never onto one
// of the inputs.
#include "../test_support.hpp"
#include "kv/error.hpp"
#include "kv/output_path.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

namespace {

// Writes `text` to `output` as a writer does: in place for a stream, else a temporary file
// committed over the target.
void write_through(const kv::OutputPath& output, const std::string& text) {
    if (output.stream()) {
        const int fd = output.open_stream();
        REQUIRE(fd >= 0);
        REQUIRE(::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()));
        ::close(fd);
        return;
    }
    const std::filesystem::path temporary = output.create_temporary();
    kv::test::write_file(temporary, text);
    output.commit(temporary);
}

mode_t mode_of(const std::filesystem::path& path) {
    struct stat info {};
    REQUIRE(::stat(path.c_str(), &info) == 0);
    return info.st_mode & 07777;
}

}  // namespace

TEST_CASE("an output through a symbolic link replaces the link's file and keeps the link",
          "[output_path]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "store.kvc", "old");
    std::filesystem::create_symlink("store.kvc", dir / "link.kvc");
    const kv::OutputPath output(dir / "link.kvc");
    CHECK_FALSE(output.stream());
    CHECK(output.target() == std::filesystem::canonical(dir / "store.kvc"));
    write_through(output, "new");
    CHECK(std::filesystem::is_symlink(dir / "link.kvc"));
    CHECK(kv::test::read_text(dir / "store.kvc") == "new");

    // A dangling link: the file it names is created, the link kept.
    std::filesystem::create_symlink("later.kvc", dir / "dangling.kvc");
    write_through(kv::OutputPath(dir / "dangling.kvc"), "made");
    CHECK(std::filesystem::is_symlink(dir / "dangling.kvc"));
    CHECK(kv::test::read_text(dir / "later.kvc") == "made");
}

TEST_CASE("an output onto a regular file keeps its mode, and a FIFO is written in place",
          "[output_path]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "a.kvc", "old");
    REQUIRE(::chmod((dir / "a.kvc").c_str(), 0600) == 0);
    write_through(kv::OutputPath(dir / "a.kvc"), "new");
    CHECK(mode_of(dir / "a.kvc") == 0600);
    CHECK(kv::test::read_text(dir / "a.kvc") == "new");
    // Nothing left beside it.
    int files = 0;
    for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path()))
        ++files;
    CHECK(files == 1);

    const std::filesystem::path fifo = dir / "pipe";
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
    const kv::OutputPath output(fifo);
    CHECK(output.stream());
    // The reader end first, non-blocking, so that the writer's open does not wait.
    const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
    REQUIRE(reader >= 0);
    write_through(output, "bytes");
    char buffer[16] = {};
    CHECK(::read(reader, buffer, sizeof buffer) == 5);
    ::close(reader);
    CHECK(std::string(buffer) == "bytes");
    CHECK(std::filesystem::is_fifo(fifo));  // never renamed over

    CHECK(kv::OutputPath("/dev/null").stream());
    CHECK_THROWS_AS(kv::OutputPath(dir.path()), kv::IoError);
    CHECK_THROWS_AS(kv::OutputPath(""), kv::UsageError);
}

TEST_CASE("an output that is one of the inputs is refused, through links too", "[output_path]") {
    kv::test::TempDir dir;
    kv::test::write_file(dir / "in.jsonl", "{}\n");
    std::filesystem::create_symlink("in.jsonl", dir / "alias.jsonl");
    CHECK(kv::same_file(dir / "in.jsonl", dir / "alias.jsonl"));
    CHECK_FALSE(kv::same_file(dir / "in.jsonl", dir / "missing.kvc"));
    CHECK_THROWS_WITH(kv::refuse_output_among_inputs(dir / "alias.jsonl",
                                                     {dir / "other", dir / "in.jsonl"}),
                      Catch::Contains("is the input") && Catch::Contains("in.jsonl"));
    CHECK_NOTHROW(kv::refuse_output_among_inputs(dir / "out.kvc", {dir / "in.jsonl"}));

    // A model folder's files are inputs; a checkpoint file is one.
    std::filesystem::create_directory(dir / "model");
    kv::test::write_file(dir / "model" / "config.json", "{}");
    CHECK(kv::model_input_files(dir / "model") ==
          std::vector<std::filesystem::path>{dir / "model" / "config.json"});
    CHECK(kv::model_input_files(dir / "ckpt.bin") ==
          std::vector<std::filesystem::path>{dir / "ckpt.bin"});
}
