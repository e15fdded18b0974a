// Typed errors of the kvtools library.
//
// The library never prints and never exits: it throws one of these with a complete, one-line
// message (lowercase, no full stop, the subject quoted), and the tool's main maps the type to an
// exit code: UsageError -> 2, every other kv::Error -> 1.
#pragma once

#include <stdexcept>
#include <string>

namespace kv {

/// Base of all errors the library throws on purpose (runtime or data error: exit code 1).
class Error : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

/// The user asked for something that cannot be done as asked (exit code 2).
class UsageError : public Error {
  public:
    using Error::Error;
};

/// A file could not be opened, read or written.
class IoError : public Error {
  public:
    using Error::Error;
};

/// A file or text is malformed: bad header, truncated, wrong shape, invalid JSON.
class FormatError : public Error {
  public:
    using Error::Error;
};

/// Two things that must agree do not: model vs cache fingerprint, prompt vs context length.
class MismatchError : public Error {
  public:
    using Error::Error;
};

/// The input asks for a feature this build does not support (architecture, dtype, device).
class UnsupportedError : public Error {
  public:
    using Error::Error;
};

/// Quote a user-supplied subject the way every message does: 'name'.
inline std::string quoted(const std::string& subject) {
    return "'" + subject + "'";
}

}  // namespace kv
