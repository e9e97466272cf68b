// The AdaLN launchers' process-wide knobs and their DITSCALE_ADALN_TUNING override (see
// internal/adaln_tuning.h). Plain C++: built with or without CUDA.
#include "ditscale/kernels/internal/adaln_tuning.h"

#include <charconv>
#include <cstdlib>
#include <string_view>
#include <system_error>

#include "ditscale/core/error.h"

namespace ditscale::kernels::internal {
namespace {

// name -> the int field it sets (`pipelined`, a bool, is handled by the caller).
int* tuning_field(AdaLNTuning& t, std::string_view name) {
  struct Entry {
    std::string_view name;
    int AdaLNTuning::*field;
  };
  static constexpr Entry kFields[] = {
      {"fwd_stages", &AdaLNTuning::fwd_stages},
      {"bwd_stages", &AdaLNTuning::bwd_stages},
      {"fwd_rows", &AdaLNTuning::fwd_rows},
      {"fwd_target_tpr", &AdaLNTuning::fwd_target_tpr},
      {"fwd_kernel", &AdaLNTuning::fwd_kernel},
      {"fwd_warp_rows", &AdaLNTuning::fwd_warp_rows},
      {"fwd_warp_prefetch", &AdaLNTuning::fwd_warp_prefetch},
      {"fwd_coef_ahead", &AdaLNTuning::fwd_coef_ahead},
      {"fwd_evict_first", &AdaLNTuning::fwd_evict_first},
      {"fwd_tma_stages", &AdaLNTuning::fwd_tma_stages},
      {"fwd_bulk_store", &AdaLNTuning::fwd_bulk_store},
      {"fwd_coef_reload", &AdaLNTuning::fwd_coef_reload},
      {"fwd_tma_rows", &AdaLNTuning::fwd_tma_rows},
      {"fwd_tma_prefer", &AdaLNTuning::fwd_tma_prefer},
      {"fwd_tma_vecs", &AdaLNTuning::fwd_tma_vecs},
      {"bwd_target_tpr", &AdaLNTuning::bwd_target_tpr},
      {"bwd_reg_cap", &AdaLNTuning::bwd_reg_cap},
      {"pdl", &AdaLNTuning::pdl},
      {"max_blocks_per_sm", &AdaLNTuning::max_blocks_per_sm},
      {"max_resident_blocks", &AdaLNTuning::max_resident_blocks},
  };
  for (const Entry& e : kFields) {
    if (e.name == name) return &(t.*e.field);
  }
  return nullptr;
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
    int* field = tuning_field(t, name);
    DS_CHECK(field != nullptr, source, ": entry '", entry, "': no AdaLN tuning knob named '", name,
             "' (see ditscale/kernels/internal/adaln_tuning.h)");
    *field = v;
  }
}

AdaLNTuning& adaln_tuning() {
  static AdaLNTuning tuning = [] {
    AdaLNTuning t;
    apply_adaln_tuning(t, std::getenv("DITSCALE_ADALN_TUNING"), "DITSCALE_ADALN_TUNING");
    return t;
  }();
  return tuning;
}

}  // namespace ditscale::kernels::internal
