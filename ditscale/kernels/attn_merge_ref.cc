// Validation, params helpers and the fp64 CPU reference of the log-sum-exp merge (attn_merge.h).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/attn_merge.h"

namespace ditscale::kernels {
namespace {

std::string field(const char* name, int index, const char* member) {
  return internal::StrCat("AttnMergeParams.", name, "[", index, "].", member);
}

void check_strides(const std::string& name, std::int64_t sb, std::int64_t st, std::int64_t sh) {
  DS_CHECK(sb >= 0 && st >= 0 && sh >= 0, name, " strides must be >= 0, got stride_b=", sb,
           " stride_t=", st, " stride_h=", sh);
}

}  // namespace

AttnMergeParams attn_merge_pair_params(std::int64_t batch, std::int64_t tokens, std::int64_t heads,
                                       std::int64_t head_dim, DType dtype, AttnOutDst acc,
                                       LseDst acc_lse, AttnOutView part, LseView part_lse) {
  AttnMergeParams p;
  p.batch = batch;
  p.tokens = tokens;
  p.heads = heads;
  p.head_dim = head_dim;
  p.dtype = dtype;
  p.num_inputs = 2;
  p.in[0] = {acc.data, acc.stride_b, acc.stride_t, acc.stride_h};
  p.in_lse[0] = {acc_lse.data, acc_lse.stride_b, acc_lse.stride_t, acc_lse.stride_h};
  p.in[1] = part;
  p.in_lse[1] = part_lse;
  p.out = acc;
  p.out_lse = acc_lse;
  return p;
}

void attn_merge_check(const AttnMergeParams& p, bool for_gpu) {
  DS_CHECK(p.batch >= 1, "AttnMergeParams.batch must be >= 1, got ", p.batch);
  DS_CHECK(p.tokens >= 0, "AttnMergeParams.tokens must be >= 0, got ", p.tokens);
  DS_CHECK(p.heads >= 1, "AttnMergeParams.heads must be >= 1, got ", p.heads);
  DS_CHECK(p.head_dim >= 1, "AttnMergeParams.head_dim must be >= 1, got ", p.head_dim);
  DS_CHECK(dtype_size(p.dtype) != 0, "AttnMergeParams.dtype: invalid value ",
           static_cast<int>(p.dtype));
  DS_CHECK(!(for_gpu && p.dtype == DType::kFloat64),
           "AttnMergeParams.dtype: float64 is supported by the CPU reference only");
  DS_CHECK(p.num_inputs >= 1 && p.num_inputs <= kMaxMergeInputs,
           "AttnMergeParams.num_inputs must be in [1, ", kMaxMergeInputs, "], got ", p.num_inputs);
  for (int i = 0; i < p.num_inputs; ++i) {
    DS_CHECK(p.in[i].data != nullptr, field("in", i, "data"), ": null");
    DS_CHECK(p.in_lse[i].data != nullptr, field("in_lse", i, "data"), ": null");
    check_strides(field("in", i, ""), p.in[i].stride_b, p.in[i].stride_t, p.in[i].stride_h);
    check_strides(field("in_lse", i, ""), p.in_lse[i].stride_b, p.in_lse[i].stride_t,
                  p.in_lse[i].stride_h);
  }
  DS_CHECK(p.out.data != nullptr, "AttnMergeParams.out.data: null");
  check_strides("AttnMergeParams.out", p.out.stride_b, p.out.stride_t, p.out.stride_h);
  DS_CHECK((p.batch == 1 || p.out.stride_b > 0) && (p.tokens <= 1 || p.out.stride_t > 0) &&
               (p.heads == 1 || p.out.stride_h > 0),
           "AttnMergeParams.out: a zero stride over a dimension of size > 1 would write one "
           "element several times");
  if (p.out_lse.data != nullptr) {
    check_strides("AttnMergeParams.out_lse", p.out_lse.stride_b, p.out_lse.stride_t,
                  p.out_lse.stride_h);
    DS_CHECK((p.batch == 1 || p.out_lse.stride_b > 0) &&
                 (p.tokens <= 1 || p.out_lse.stride_t > 0) &&
                 (p.heads == 1 || p.out_lse.stride_h > 0),
             "AttnMergeParams.out_lse: a zero stride over a dimension of size > 1 would write "
             "one element several times");
  }
  for (int i = 0; i < p.num_inputs; ++i) {
    if (p.in[i].data == p.out.data) {
      DS_CHECK(p.in[i].stride_b == p.out.stride_b && p.in[i].stride_t == p.out.stride_t &&
                   p.in[i].stride_h == p.out.stride_h,
               field("in", i, "data"),
               " aliases out.data with different strides (only exact aliasing is allowed)");
    }
    if (p.out_lse.data != nullptr && p.in_lse[i].data == p.out_lse.data) {
      DS_CHECK(p.in_lse[i].stride_b == p.out_lse.stride_b &&
                   p.in_lse[i].stride_t == p.out_lse.stride_t &&
                   p.in_lse[i].stride_h == p.out_lse.stride_h,
               field("in_lse", i, "data"),
               " aliases out_lse.data with different strides (only exact aliasing is allowed)");
    }
  }
}

void attn_merge_ref(const AttnMergeParams& p) {
  attn_merge_check(p, /*for_gpu=*/false);
  const int k = p.num_inputs;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> row(static_cast<std::size_t>(p.head_dim));
  double w[kMaxMergeInputs];
  for (std::int64_t b = 0; b < p.batch; ++b) {
    for (std::int64_t t = 0; t < p.tokens; ++t) {
      for (std::int64_t h = 0; h < p.heads; ++h) {
        double l[kMaxMergeInputs];
        double m = neg_inf;
        bool any_nan = false;
        for (int i = 0; i < k; ++i) {
          const LseView& v = p.in_lse[i];
          l[i] = v.data[b * v.stride_b + t * v.stride_t + h * v.stride_h];
          any_nan = any_nan || std::isnan(l[i]);
          m = std::max(m, l[i]);
        }
        if (any_nan) m = std::numeric_limits<double>::quiet_NaN();  // NaN propagates
        double sum = 0;
        for (int i = 0; i < k; ++i) {
          w[i] = (l[i] == neg_inf) ? 0.0 : std::exp(l[i] - m);
          sum += w[i];
        }
        std::fill(row.begin(), row.end(), 0.0);
        if (m != neg_inf) {
          for (int i = 0; i < k; ++i) {
            if (l[i] == neg_inf) continue;  // empty block: its output is never read
            const AttnOutView& v = p.in[i];
            const std::int64_t base = b * v.stride_b + t * v.stride_t + h * v.stride_h;
            const double c = w[i] / sum;
            for (std::int64_t d = 0; d < p.head_dim; ++d) {
              row[d] += c * load_as_double(v.data, p.dtype, base + d);
            }
          }
        }
        const std::int64_t obase = b * p.out.stride_b + t * p.out.stride_t + h * p.out.stride_h;
        for (std::int64_t d = 0; d < p.head_dim; ++d) {
          store_from_double(p.out.data, p.dtype, obase + d, row[d]);
        }
        if (p.out_lse.data != nullptr) {
          const double lse = (m == neg_inf) ? neg_inf : m + std::log(sum);
          p.out_lse.data[b * p.out_lse.stride_b + t * p.out_lse.stride_t + h * p.out_lse.stride_h] =
              static_cast<float>(lse);
        }
      }
    }
  }
}

}  // namespace ditscale::kernels
