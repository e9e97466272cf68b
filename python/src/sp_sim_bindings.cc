// Bindings of the sequence-parallel simulator's attention model (ditscale/sp/topology.h), so that
// bench/sp/calibrate.py fits its constants with the simulator's own formula instead of a copy:
//
//   sp_wave_factor(q_tokens, batch_heads, slots, tile=128) -> float
//       ceil(W) / W for W = batch_heads * ceil(q_tokens / tile) / slots (Topology::WaveFactor):
//       a partial last wave of CTAs costs a full one; 1 when slots, batch_heads or q_tokens is 0.
//   sp_attention_seconds(flops, q_tokens, kv_tokens, attention_flops, half_tokens, launch_s,
//                        batch_heads=0, slots=0, tile=128) -> float
//       launch_s + flops * WaveFactor / (attention_flops * Eff(q) * Eff(kv)),
//       Eff(t) = t / (t + half_tokens) (Topology::AttentionSeconds); launch_s when flops is 0.
//
// Ranges (checked here; ditscale._core.Error "<name>: <v> is out of range [lo, hi]" otherwise):
//   q_tokens, kv_tokens [0, 1e12]; batch_heads [0, 1e9]; slots [0, 1048576]; tile [1, 1048576];
//   flops [0, 1e30]; attention_flops [1, 1e18] FLOP/s; half_tokens [0, 1e12]; launch_s [0, 1].
//   With flops > 0, q_tokens and kv_tokens must be > 0.
#include <pybind11/pybind11.h>

#include "ditscale/core/range.h"
#include "ditscale/sp/topology.h"
#include "python/src/bindings.h"

namespace py = pybind11;

namespace ditscale::python {
namespace {

constexpr double kMaxTokens = 1e12;
constexpr long long kMaxSlots = 1 << 20;

// A topology that holds only the attention model's constants.
sp::Topology AttentionModel(long long slots, long long tile) {
  CheckRange("slots", slots, 0, kMaxSlots);
  CheckRange("tile", tile, 1, kMaxSlots);
  sp::Topology t;
  t.attention_slots = static_cast<int>(slots);
  t.attention_tile_tokens = static_cast<int>(tile);
  return t;
}

double WaveFactor(double q_tokens, double batch_heads, long long slots, long long tile) {
  CheckRange("q_tokens", q_tokens, 0, kMaxTokens);
  CheckRange("batch_heads", batch_heads, 0, 1e9);
  return AttentionModel(slots, tile).WaveFactor(q_tokens, batch_heads);
}

double AttentionSeconds(double flops, double q_tokens, double kv_tokens, double attention_flops,
                        double half_tokens, double launch_s, double batch_heads, long long slots,
                        long long tile) {
  CheckRange("flops", flops, 0, 1e30);
  CheckRange("q_tokens", q_tokens, 0, kMaxTokens);
  CheckRange("kv_tokens", kv_tokens, 0, kMaxTokens);
  CheckRange("attention_flops", attention_flops, 1, 1e18);
  CheckRange("half_tokens", half_tokens, 0, kMaxTokens);
  CheckRange("launch_s", launch_s, 0, 1);
  CheckRange("batch_heads", batch_heads, 0, 1e9);
  if (flops > 0 && (q_tokens <= 0 || kv_tokens <= 0)) {
    DS_FAIL("attention block with no tokens: q_tokens=", FormatNumber(q_tokens),
            " kv_tokens=", FormatNumber(kv_tokens), " for flops=", FormatNumber(flops));
  }
  sp::Topology t = AttentionModel(slots, tile);
  t.attention_flops = attention_flops;
  t.attention_half_tokens = half_tokens;
  t.launch_overhead_s = launch_s;
  return t.AttentionSeconds(flops, q_tokens, kv_tokens, batch_heads);
}

}  // namespace

void BindSpSimulator(py::module_& m) {
  m.def("sp_wave_factor", &WaveFactor, py::arg("q_tokens"), py::arg("batch_heads"),
        py::arg("slots"), py::arg("tile") = 128,
        "ceil(W) / W, W = batch_heads * ceil(q_tokens / tile) / slots (Topology::WaveFactor).");
  m.def("sp_attention_seconds", &AttentionSeconds, py::arg("flops"), py::arg("q_tokens"),
        py::arg("kv_tokens"), py::arg("attention_flops"), py::arg("half_tokens"),
        py::arg("launch_s"), py::arg("batch_heads") = 0.0, py::arg("slots") = 0,
        py::arg("tile") = 128,
        "The simulator's attention time in seconds (Topology::AttentionSeconds).");
}

}  // namespace ditscale::python
