// Errors and checks shared by every ditscale module.
//
// DS_CHECK(cond, args...) throws ditscale::Error carrying file:line, the failed expression and a
// message formatted from args (streamed with operator<<). Library code never calls exit(): the
// Python layer turns Error into a Python exception.
//
// Expected failures of planners and parsers (a bad manifest row, an infeasible plan) are not
// exceptions: they are returned as Result<T> (see result.h).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace ditscale {

// The single exception type of the library. what() is "file:line: message".
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace internal {
template <typename... Args>
std::string StrCat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void ThrowCheckFailure(const char* file, int line, const char* expr,
                                    const std::string& msg);
}  // namespace internal

}  // namespace ditscale

// Throws ditscale::Error("file:line: check failed: <expr>: <message>") when cond is false.
#define DS_CHECK(cond, ...)                                                                        \
  do {                                                                                             \
    if (!(cond)) [[unlikely]] {                                                                    \
      ::ditscale::internal::ThrowCheckFailure(                                                     \
          __FILE__, __LINE__, #cond, ::ditscale::internal::StrCat("" __VA_OPT__(, ) __VA_ARGS__)); \
    }                                                                                              \
  } while (0)

// Throws ditscale::Error("file:line: message") unconditionally.
#define DS_FAIL(...)                                                   \
  ::ditscale::internal::ThrowCheckFailure(__FILE__, __LINE__, nullptr, \
                                          ::ditscale::internal::StrCat(__VA_ARGS__))
