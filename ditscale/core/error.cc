#include "ditscale/core/error.h"

namespace ditscale::internal {

void ThrowCheckFailure(const char* file, int line, const char* expr, const std::string& msg) {
  std::ostringstream os;
  os << file << ":" << line << ": ";
  if (expr != nullptr) {
    os << "check failed: " << expr;
    if (!msg.empty()) os << ": ";
  }
  os << msg;
  throw Error(os.str());
}

}  // namespace ditscale::internal
