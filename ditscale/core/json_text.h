// Parsing JSON text from user files: one reader for every JSON input of ditscale (model files,
// cost models, topologies, JSONL manifest rows).
//
// ParseJson(text, file, line) returns the document or a Failure that names the file and the
// line, never a raw nlohmann exception:
//   - syntax errors: "model.json:3: JSON syntax error at byte 41: ..." (line counted in text,
//     plus `first_line - 1` for a JSONL row);
//   - numbers outside double ("1e400") and integers outside int64/uint64: refused;
//   - a key repeated within one object: refused ("duplicate key 'fps'"): nlohmann keeps the last
//     silently, CSV refuses a repeated column, and so does every ditscale reader.
// Input larger than kMaxJsonBytes is refused before parsing.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "ditscale/core/result.h"

namespace ditscale {

inline constexpr std::size_t kMaxJsonBytes = std::size_t{64} << 20;  // 64 MiB

Result<nlohmann::json> ParseJson(std::string_view text, const std::string& file,
                                 long long first_line = 1);

// Reads the whole file (regular files only, at most kMaxJsonBytes) and parses it.
Result<nlohmann::json> ReadJsonFile(const std::string& path);

}  // namespace ditscale
