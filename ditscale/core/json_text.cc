#include "ditscale/core/json_text.h"

#include <sys/stat.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_set>
#include <vector>

namespace ditscale {
namespace {

long long LineOfByte(std::string_view text, std::size_t byte) {
  long long line = 1;
  for (std::size_t i = 0; i < byte && i < text.size(); ++i) line += text[i] == '\n';
  return line;
}

Failure At(const std::string& file, long long line, std::string message) {
  return Failure::InFile(file, line, {}, std::move(message));
}

// The 1-based line (within text) of the first repeated key or number beyond a double, found by a
// light scan of text that nlohmann has already parsed up to the problem; 1 if none is found.
// nlohmann's parser callback gives no position, so its findings are located here.
long long LineOfValueProblem(std::string_view text) {
  struct Frame {
    bool object;
    std::unordered_set<std::string> keys;
  };
  std::vector<Frame> stack;
  bool expect_key = false;
  long long line = 1;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
    } else if (c == '{' || c == '[') {
      stack.push_back({c == '{', {}});
      expect_key = c == '{';
    } else if (c == '}' || c == ']') {
      if (!stack.empty()) stack.pop_back();
      expect_key = false;
    } else if (c == ',') {
      expect_key = !stack.empty() && stack.back().object;
    } else if (c == '"') {
      std::size_t j = i + 1;
      while (j < text.size() && text[j] != '"') j += text[j] == '\\' ? 2 : 1;
      const std::string raw(text.substr(i + 1, j - i - 1));
      if (expect_key && !stack.empty() && !stack.back().keys.insert(raw).second) return line;
      expect_key = false;
      i = j;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      char* end = nullptr;
      const std::string num(text.substr(i, 64));
      const double v = std::strtod(num.c_str(), &end);
      if (!std::isfinite(v)) return line;
      i += static_cast<std::size_t>(end - num.c_str()) - 1;
    }
  }
  return 1;
}

// Rejects duplicate keys and non-finite numbers while nlohmann parses.
struct StrictCallback {
  std::vector<std::unordered_set<std::string>>* keys;
  std::string* error;
  bool operator()(int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) const {
    using E = nlohmann::json::parse_event_t;
    if (!error->empty()) return false;
    switch (event) {
      case E::object_start:
        keys->emplace_back();
        break;
      case E::object_end:
        if (!keys->empty()) keys->pop_back();
        break;
      case E::key: {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!keys->empty() && !keys->back().insert(k).second) *error = "duplicate key '" + k + "'";
        break;
      }
      case E::value:
        if (parsed.is_number_float() && !std::isfinite(parsed.get<double>())) {
          *error = "number out of the range of a double";
        }
        break;
      default:
        break;
    }
    return error->empty() || event == E::object_end;
  }
};

}  // namespace

Result<nlohmann::json> ParseJson(std::string_view text, const std::string& file,
                                 long long first_line) {
  if (text.size() > kMaxJsonBytes) {
    return At(file, 0,
              "JSON text of " + std::to_string(text.size()) + " bytes exceeds the " +
                  std::to_string(kMaxJsonBytes) + "-byte limit");
  }
  std::vector<std::unordered_set<std::string>> keys;
  std::string error;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.begin(), text.end(), StrictCallback{&keys, &error});
  } catch (const nlohmann::json::parse_error& e) {
    const long long line = first_line - 1 + LineOfByte(text, e.byte > 0 ? e.byte - 1 : 0);
    // nlohmann's what() is "[json.exception.parse_error.101] parse error at line 1, column 5:
    // syntax error while parsing value - ..."; keep the part after the location.
    std::string what = e.what();
    const auto colon = what.find(": ");
    if (colon != std::string::npos) what = what.substr(colon + 2);
    return At(file, line, "JSON syntax error: " + what);
  } catch (const nlohmann::json::exception& e) {
    // out_of_range.406 (1e400) and friends: no file name in nlohmann's text.
    std::string what = e.what();
    const auto close = what.find("] ");
    if (close != std::string::npos) what = what.substr(close + 2);
    return At(file, first_line - 1 + LineOfValueProblem(text), "JSON value error: " + what);
  }
  if (!error.empty()) return At(file, first_line - 1 + LineOfValueProblem(text), error);
  return j;
}

Result<nlohmann::json> ReadJsonFile(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return At(path, 0, "cannot open the file");
  if (!S_ISREG(st.st_mode)) return At(path, 0, "not a regular file");
  if (static_cast<unsigned long long>(st.st_size) > kMaxJsonBytes) {
    return At(path, 0,
              "file of " + std::to_string(st.st_size) + " bytes exceeds the " +
                  std::to_string(kMaxJsonBytes) + "-byte limit of a JSON file");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return At(path, 0, "cannot open the file");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return At(path, 0, "read error");
  return ParseJson(ss.str(), path);
}

}  // namespace ditscale
