// Sequence parallelism in the balanced planner: a micro-batch may be trained by a group of d
// ranks together (Ulysses inside one machine), d in the planner's degree list.
//
// Per-rank cost of a micro-batch of B samples of S tokens on d ranks (seconds):
//   Work_d(B, S) = a_mb + B * Work(S) / (d * eff(d)) + B * comm(d, S)
//     Work(S):    the cost model's per-sample work (cost_model.h), s
//     eff(d):     CostModel::sp_efficiency (1 unless given in the cost JSON), eff(1) = 1
//     comm(d, S): communication per sample not hidden behind compute, s (0 at d = 1):
//                 comm(d, S) = 3 * L * exposed(d, S)
//                   exposed(d, S): the sp simulator's (ditscale/sp/simulator.h) mean exposed
//                     communication per rank of ONE attention layer, plain Ulysses (U = d,
//                     NCCL two-sided) on one machine of d GPUs of the node topology, batch 1,
//                     S tokens, the model's heads and head dim (hidden / heads); joint text
//                     tokens are counted in S;
//                   L: attention layers; 3: forward + backward (two all-to-all passes).
//                 A micro-batch of B samples is charged B * comm(d, S): linear in the bytes
//                 (the fixed sync and latency of one larger all-to-all are charged B times:
//                 conservative for B > 1).
// Memory per rank: m0 + m1 * B * S / d, so B * S <= d * M_mem; a sample fits at degree d when
// S <= d * M_mem.
// Docs: docs/balance.md, "Sequence parallelism per micro-batch".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ditscale/balance/shapes.h"
#include "ditscale/core/result.h"
#include "ditscale/sp/topology.h"

namespace ditscale::balance {

// Degrees 1, 2, 4, 8: one machine's NVLink domain (the comm model is intra-machine).
inline constexpr int kMaxSpDegree = 8;
inline constexpr int kSpDegreeSlots = 4;  // log2(kMaxSpDegree) + 1
// The node topology of comm(d, S) unless told otherwise: the sp preset of an 8-GPU NVLink4 /
// NVSwitch gen-3 node (H100 and H200 HGX share that fabric).
inline constexpr const char* kDefaultSpTopology = "h100-8x";

// log2(d) for d in {1, 2, 4, 8}.
int SpSlot(int degree);

// Parses "1,2,4,8": each entry a power of two in [1, kMaxSpDegree], at most world_size and
// dividing it, no duplicates; returned sorted ascending. Failures name the option, the value and
// the range ("--sp-degrees: 3 is not a power of two in [1, 8]").
Result<std::vector<int>> ParseSpDegrees(const std::string& text, int world_size);

// The first broken rule of ParseSpDegrees in a list of degrees (any order), worded with `name`
// ("sp_degrees: 3 is not a power of two in [1, 8]"); an empty list is refused too. nullopt: valid.
std::optional<std::string> SpDegreesError(const std::vector<int>& degrees, int world_size,
                                          const std::string& name);

// The smallest degree of `degrees` (sorted) at which one sample of S tokens fits the memory
// budget (S <= d * m_mem_tokens); 0 when none does.
int MinSpDegree(int64_t seq_len, int64_t m_mem_tokens, const std::vector<int>& degrees);

// comm(d, S) per sample (above) for every shape and degree: [shape * kSpDegreeSlots + SpSlot(d)],
// 0 for d = 1 and for degrees not in `degrees`. `topology_name`: an sp preset or a JSON file
// (sp::LoadTopology), instantiated as one machine of d GPUs. Simulated once per distinct S and d.
// Failures: the topology, or a degree the sp builders refuse for the model (named).
Result<std::vector<double>> UlyssesCommPerSample(const ModelPreset& model,
                                                 const std::vector<TrainShape>& shapes,
                                                 const std::vector<int>& degrees,
                                                 const std::string& topology_name);

}  // namespace ditscale::balance
