// Result<T>: a value or an expected failure (bad user input, infeasible plan).
//
// A failure carries a message and, for input files, the location: file, 1-based line and the
// column (field name). ToString() gives "file:line: column 'fps': message", the form every
// user-facing error of ditscale takes.
#pragma once

#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <variant>

#include "ditscale/core/error.h"

namespace ditscale {

// Build failures through the named factories below (one per kind of failure, as leveldb's
// Status::InvalidArgument); they only fill the fields, so ToString() is the same either way.
struct Failure {
  std::string message;
  std::string file;    // empty when not about a file
  long long line = 0;  // 1-based; 0 when unknown
  std::string column;  // field name; empty when unknown

  // A bad argument or option of an API call; `field` names it ("rank", "comm_sms"), if any.
  static Failure InvalidArgument(std::string message, std::string field = {}) {
    return Failure{std::move(message), {}, 0, std::move(field)};
  }
  // Bad content of an input file: `file`, 1-based `line` (0 = the whole file, e.g. it cannot be
  // opened) and `column` (the field; empty when not about one field).
  static Failure InFile(std::string file, long long line, std::string column, std::string message) {
    return Failure{std::move(message), std::move(file), line, std::move(column)};
  }
  // Valid input for which no result exists (no plan fits, no feasible configuration); `field`
  // names the constraint that cannot be met, if any.
  static Failure Infeasible(std::string message, std::string field = {}) {
    return Failure{std::move(message), {}, 0, std::move(field)};
  }
  // Something the call needs is missing: a library ditscale was built without, a device, a
  // driver feature, device memory.
  static Failure Unavailable(std::string message, std::string field = {}) {
    return Failure{std::move(message), {}, 0, std::move(field)};
  }
  // A CUDA, NCCL or NVSHMEM operation failed or timed out at run time (the message names the
  // call, the rank and the library's error text).
  static Failure BackendError(std::string message) {
    return Failure{std::move(message), {}, 0, {}};
  }
  // The operating system refused an I/O operation on an output (cannot create, write, flush or
  // close it); the message carries strerror's text, `file` names the file where it is not in the
  // message already.
  static Failure IoError(std::string message, std::string file = {}) {
    return Failure{std::move(message), std::move(file), 0, {}};
  }

  std::string ToString() const {
    std::ostringstream os;
    if (!file.empty()) {
      os << file;
      if (line > 0) os << ':' << line;
      os << ": ";
    }
    if (!column.empty()) os << "column '" << column << "': ";
    os << message;
    return os.str();
  }
};

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit on purpose
  Result(Failure f) : v_(std::move(f)) {}    // NOLINT

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }

  const T& value() const& {
    DS_CHECK(ok(), failure().ToString());
    return std::get<0>(v_);
  }
  T& value() & {
    DS_CHECK(ok(), failure().ToString());
    return std::get<0>(v_);
  }
  T&& value() && {
    DS_CHECK(ok(), failure().ToString());
    return std::get<0>(std::move(v_));
  }
  const T& operator*() const& { return value(); }
  T& operator*() & { return value(); }
  const T* operator->() const { return &value(); }
  T* operator->() { return &value(); }

  const Failure& failure() const {
    DS_CHECK(!ok(), "Result holds a value, not a failure");
    return std::get<1>(v_);
  }
  // Throws ditscale::Error with the failure's message if this is a failure.
  T ValueOrThrow() && {
    if (!ok()) throw Error(failure().ToString());
    return std::get<0>(std::move(v_));
  }

 private:
  std::variant<T, Failure> v_;
};

}  // namespace ditscale
