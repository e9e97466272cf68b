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

struct Failure {
  std::string message;
  std::string file;    // empty when not about a file
  long long line = 0;  // 1-based; 0 when unknown
  std::string column;  // field name; empty when unknown

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
