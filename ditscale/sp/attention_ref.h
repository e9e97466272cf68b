// CPU reference of block attention with log-sum-exp, and of the LSE merge used by ring and torus
// attention. Inputs and outputs are float; every reduction is done in double.
//
// Layout: a TensorView is a strided [batch, tokens, heads, width] window onto float memory, the
// innermost `width` elements contiguous. For one batch entry b, query token t and query head h
// (kv head h / group, group = q heads / kv heads):
//   s_j   = scale * sum_w q[b,t,h,w] * k[b,j,h/group,w]            (j over the kv tokens)
//   lse   = log(sum_j exp(s_j))                                   (-inf when there are no kv)
//   out   = sum_j exp(s_j - lse) * v[b,j,h/group,:]               (0 when there are no kv)
// Merging a partial (o_p, l_p) into an accumulator (o_a, l_a):
//   l = log(exp(l_a) + exp(l_p)),  o = o_a * exp(l_a - l) + o_p * exp(l_p - l)
// An accumulator with l_a = -inf (and any o_a) takes the partial as is.
#pragma once

#include <cstdint>
#include <vector>

namespace ditscale::sp {

struct TensorView {
  float* data = nullptr;
  int64_t batch = 0, tokens = 0, heads = 0, width = 0;
  int64_t batch_stride = 0, token_stride = 0, head_stride = 0;  // in elements

  float* at(int64_t b, int64_t t, int64_t h) const {
    return data + b * batch_stride + t * token_stride + h * head_stride;
  }
  // A dense row-major [batch, tokens, heads, width] tensor.
  static TensorView Dense(float* data, int64_t batch, int64_t tokens, int64_t heads, int64_t width);
  // The window [token_begin, +tokens) x [head_begin, +heads) of this view.
  TensorView Sub(int64_t token_begin, int64_t tokens, int64_t head_begin, int64_t heads) const;
};

// q: [B, Tq, Hq, d]; k, v: [B, Tk, Hq / group, d]; out: [B, Tq, Hq, d]; lse: [B, Tq, Hq, 1].
// Hq must be a multiple of k.heads. `out` and `lse` must not alias the inputs.
void AttentionRef(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, const TensorView& lse, double scale);

// Merges (part, part_lse) into (acc, acc_lse) in place; all four shaped alike (lse width 1).
void MergeRef(const TensorView& part, const TensorView& part_lse, const TensorView& acc,
              const TensorView& acc_lse);

}  // namespace ditscale::sp
