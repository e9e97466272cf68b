// CPU reference executor of sp schedules: the tests' ground truth for every strategy.
//
// Runs a Schedule with one thread per rank. Each rank owns its buffers (float, whatever the
// schedule's dtype); data moves between ranks ONLY through the schedule's communication ops:
// Send/Recv through mailboxes keyed by (sender, receiver, tag); Put writes into the peer's
// buffer and then (put-with-signal, Signal) increments the peer's counter; Wait blocks until the
// rank's counter reaches its value. Attention and Merge run attention_ref.h on local buffers.
// Buffers that the schedule leaves undefined start as NaN, so reading data that never arrived
// poisons the output instead of passing by luck.
//
// Within a rank the executor honours the schedule's execution model (in-order streams, groups,
// deps) and, with `shuffle`, picks at random among the ops that may run, so a missing
// cross-stream dependency changes the result. A schedule that cannot finish is reported as a
// failure listing every rank's blocked ops (all live threads blocked = deadlock; `timeout_s` is a
// safety net) instead of hanging.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ditscale/core/result.h"
#include "ditscale/sp/schedule.h"

namespace ditscale::sp {

// Global inputs, joint text tokens first: q is [batch, T + S, heads, head_dim], k and v are
// [batch, T + S, kv_heads, head_dim], row-major float.
struct DenseInputs {
  AttentionShape shape;
  std::vector<float> q, k, v;
};

// Standard-normal inputs from `seed` (std::mt19937_64).
DenseInputs RandomInputs(const AttentionShape& shape, uint64_t seed);

// Dense non-causal attention over all T + S tokens, scale 1/sqrt(head_dim):
// [batch, T + S, heads, head_dim].
std::vector<float> DenseAttention(const DenseInputs& inputs);

struct ExecutorOptions {
  bool validate = true;   // run ValidateSchedule first and fail with its report
  bool shuffle = true;    // random choice among runnable ops of a rank
  uint64_t seed = 1;      // for shuffle
  double timeout_s = 60;  // no progress on any rank for this long = failure
};

// Each rank's result: out [batch, image_token_count, heads, head_dim] for its shard, text_out
// [batch, T, heads, head_dim] (empty when T == 0).
struct RankOutput {
  std::vector<float> out;
  std::vector<float> text_out;
};

Result<std::vector<RankOutput>> ExecuteSchedule(const Schedule& schedule, const DenseInputs& inputs,
                                                const ExecutorOptions& options = {});

struct Comparison {
  double max_abs_error = 0;      // over every rank's out and text_out vs dense (NaN -> +inf)
  double max_abs_ref = 0;        // max |dense|
  double max_rel_error = 0;      // max_abs_error / max_abs_ref
  double text_replica_diff = 0;  // max difference between ranks' text_out copies
  std::string ToString() const;
};

// Compares the ranks' outputs (gathered by image_token_begin/count) with `dense`
// (DenseAttention(inputs)).
Comparison CompareWithDense(const Schedule& schedule, const std::vector<float>& dense,
                            const std::vector<RankOutput>& outputs);

}  // namespace ditscale::sp
