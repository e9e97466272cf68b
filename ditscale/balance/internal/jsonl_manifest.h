// The JSONL manifest reader (see manifest.h for the format, the field rules and the limits).
//
// Each non-blank line (at most kMaxLineBytes) is parsed by ParseJson (ditscale/core/json_text.h)
// with its line number, so syntax errors, repeated keys and numbers beyond a double are bad rows
// naming file:line; the line must hold one JSON object. The required keys' values become
// FieldRefs typed by their JSON kind and go through the same ValidateRow as CSV fields.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "ditscale/balance/manifest.h"
#include "ditscale/core/result.h"

namespace ditscale::balance::internal {

// Parses JSONL manifest text; `name` is used in error messages. Texts of at least
// `min_parallel_bytes` are parsed by two threads (lines are independent: the second starts after
// the first line end past the middle; results, lines and errors are those of one pass).
Result<Manifest> ParseJsonlManifest(std::string_view text, const std::string& name,
                                    const ManifestOptions& options,
                                    size_t min_parallel_bytes = size_t{1} << 20);

}  // namespace ditscale::balance::internal
