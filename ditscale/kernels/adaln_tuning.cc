// The AdaLN launchers' plan override: the tuning of the launch in progress on this thread and the
// parser of the benchmark's variants (see internal/adaln_tuning.h). Plain C++: built with or
// without CUDA.
#include "ditscale/kernels/internal/adaln_tuning.h"

#include <charconv>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "ditscale/core/error.h"
#include "ditscale/core/range.h"

namespace ditscale::kernels::internal {
namespace {

// name -> the int field it sets and its range (`pipelined`, a bool, is handled by the caller).
struct Knob {
  int* field;
  int lo, hi;
};

std::optional<Knob> tuning_field(AdaLNTuning& t, std::string_view name) {
  if (name == "fwd_kernel") return Knob{&t.fwd_kernel, 0, 3};
  if (name == "pdl") return Knob{&t.pdl, 0, 1};
  if (name == "max_resident_blocks") return Knob{&t.max_resident_blocks, 0, 1 << 30};
  return std::nullopt;
}

}  // namespace

void apply_adaln_tuning(AdaLNTuning& t, const char* text, const char* source) {
  std::string_view rest = text != nullptr ? text : "";
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view entry = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
    if (entry.empty()) continue;
    const std::size_t eq = entry.find('=');
    DS_CHECK(eq != std::string_view::npos, source, ": entry '", entry, "' is not name=value");
    const std::string_view name = entry.substr(0, eq);
    const std::string_view value = entry.substr(eq + 1);
    int v = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    DS_CHECK(ec == std::errc{} && end == value.data() + value.size() && !value.empty(), source,
             ": entry '", entry, "': '", value, "' is not an integer");
    if (name == "pipelined") {
      DS_CHECK(v == 0 || v == 1, source, ": entry '", entry, "': pipelined takes 0 or 1");
      t.pipelined = v != 0;
      continue;
    }
    const std::optional<Knob> knob = tuning_field(t, name);
    DS_CHECK(knob.has_value(), source, ": entry '", entry, "': no AdaLN tuning knob named '", name,
             "' (pipelined, fwd_kernel, pdl, max_resident_blocks; see "
             "ditscale/kernels/internal/adaln_tuning.h)");
    const std::optional<std::string> range =
        RangeError(name, static_cast<long long>(v), knob->lo, knob->hi);
    DS_CHECK(!range, source, ": entry '", entry, "': ", *range);
    *knob->field = v;
  }
}

namespace {
thread_local const AdaLNTuning* current_tuning = nullptr;
}  // namespace

const AdaLNTuning& adaln_tuning() {
  static const AdaLNTuning defaults{};
  return current_tuning != nullptr ? *current_tuning : defaults;
}

ScopedAdaLNTuning::ScopedAdaLNTuning(const AdaLNTuning& tuning) : previous_(current_tuning) {
  current_tuning = &tuning;
}

ScopedAdaLNTuning::~ScopedAdaLNTuning() { current_tuning = previous_; }

}  // namespace ditscale::kernels::internal
