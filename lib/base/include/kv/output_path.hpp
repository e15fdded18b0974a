// Where a tool's output goes, and whether it may go there (docs/reliability.md, "Outputs").
//
// A path is resolved once, before anything is written: "-" is standard output; a symbolic link is
// followed to the file it names, which is then written (the link stays, and now leads to the new
// file); an existing character device or FIFO (/dev/null, a named pipe) is opened and written in
// place, without a rename and without atomicity; an existing regular file is replaced atomically
// (a temporary file beside it, renamed over it) keeping its mode and, where the system allows,
// its owner and group; a missing file is created the same way. Anything else (a directory, a
// socket, a block device) is refused.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace kv {

class OutputPath {
  public:
    /// Resolves `path`; throws IoError for what cannot be written (above) or a symbolic link
    /// that does not resolve (a loop).
    explicit OutputPath(const std::filesystem::path& path);

    bool standard_output() const { return kind_ == Kind::standard_output; }
    /// A character device or FIFO: written in place by open_stream(), never renamed.
    bool stream() const { return kind_ == Kind::stream; }
    /// The path as given, quoted, or "standard output": for messages.
    const std::string& name() const { return name_; }
    /// The file written: symbolic links followed.
    const std::filesystem::path& target() const { return target_; }

    /// Creates an empty temporary file beside the target, with the mode and owner of the file it
    /// will replace (new files: 0644 less the umask), and returns its path. IoError on failure.
    std::filesystem::path create_temporary() const;
    /// Opens the character device or FIFO for writing; IoError on failure.
    int open_stream() const;
    /// Moves a finished (synced) temporary file onto the target and syncs the directory. With
    /// `no_replace` it fails with EEXIST's message when a file appeared under the name meanwhile.
    /// Removes the temporary file when it fails (IoError).
    void commit(const std::filesystem::path& temporary, bool no_replace = false) const;

  private:
    enum class Kind { standard_output, new_file, regular_file, stream };
    Kind kind_ = Kind::new_file;
    std::string name_;
    std::filesystem::path target_;
    mode_t mode_ = 0;
    uid_t owner_ = 0;
    gid_t group_ = 0;
};

/// Whether an input and an output name one existing file (device and inode, symbolic links
/// followed); "-" is standard input as the input and standard output as the output, as their
/// descriptors refer to. False when either does not exist or is not a regular file.
bool same_file(const std::filesystem::path& input, const std::filesystem::path& output);

/// Refuses with UsageError, naming both, an output that is one of the inputs (same_file): writing
/// it would destroy the input. Tools that rewrite a file in place by design (kvindex A -o A,
/// kvinspect compress A -o A, kvbake --append) check the other inputs only and lock the file.
void refuse_output_among_inputs(const std::filesystem::path& output,
                                const std::vector<std::filesystem::path>& inputs);

/// The files of a model argument that an output must not replace: the file itself, or every
/// regular file directly inside the folder.
std::vector<std::filesystem::path> model_input_files(const std::filesystem::path& model);

}  // namespace kv
