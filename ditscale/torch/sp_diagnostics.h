// The GPU executor's one-GPU diagnostics, no process group (torch.ops.ditscale.*, driven by
// python/ditscale/_experimental/sp_local.py). `config`: the ops' configuration text
// (sp_config_text.h); machines, gpus_per_machine: [1, 65536].
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "ditscale/torch/sp_config_text.h"

namespace ditscale::torch_ext {

// One rank's compute of a strategy's schedule, replayed alone on the current GPU with every
// transfer skipped (runtime::Transports::compute_only): its attention calls, merges and copies as
// the executor issues them, as if communication were free. Random bf16 inputs; the output is
// meaningless. Returns (ms of each of `iters` [1, 10000] timed layers after `warmup`
// [0, 10000], the traced per-unit timeline of one more layer). Measures, on one GPU, what a
// schedule's cuts cost in compute.
std::tuple<at::Tensor, std::string> sp_replay_compute(SpConfigText config, int64_t machines,
                                                      int64_t gpus_per_machine, int64_t rank,
                                                      int64_t batch, int64_t seq, int64_t text,
                                                      int64_t heads, int64_t kv_heads,
                                                      int64_t head_dim, int64_t iters,
                                                      int64_t warmup);

// Every rank of a one-sided schedule (the config's transport is taken as one-sided on every
// link) in this process on the current GPU: the real executors (one per rank, each on its own
// stream), their puts, signals and waits through the copy-engine engine over
// runtime::LocalPeers. q, k, v: the FULL [B, S, H, D] inputs (text_*: [B, T, H, D]), split into
// the ranks' shards as the schedule says. Runs `layers` [1, 1000] layers (the signal words grow
// across them) and returns (out of the first layer, out of the last, each rank's text out of the
// last stacked [ranks, B, T, H, D] (empty without text), a description: engine, arena bytes).
// Fails after timeout_s when the ranks do not finish (a Wait whose signal never came; the
// streams stay blocked: exit the process). Checks the executor and the strategies on one GPU.
std::tuple<at::Tensor, at::Tensor, at::Tensor, std::string> sp_run_local(
    SpConfigText config, int64_t machines, int64_t gpus_per_machine, at::Tensor q, at::Tensor k,
    at::Tensor v, std::optional<at::Tensor> tq, std::optional<at::Tensor> tk,
    std::optional<at::Tensor> tv, int64_t layers, double timeout_s);

}  // namespace ditscale::torch_ext
