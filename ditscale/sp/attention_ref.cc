#include "ditscale/sp/attention_ref.h"

#include <cmath>
#include <limits>

#include "ditscale/core/error.h"

namespace ditscale::sp {

TensorView TensorView::Dense(float* data, int64_t batch, int64_t tokens, int64_t heads,
                             int64_t width) {
  return TensorView{data,          batch, tokens, heads, width, tokens * heads * width,
                    heads * width, width};
}

TensorView TensorView::Sub(int64_t token_begin, int64_t n_tokens, int64_t head_begin,
                           int64_t n_heads) const {
  DS_CHECK(token_begin >= 0 && token_begin + n_tokens <= tokens && head_begin >= 0 &&
               head_begin + n_heads <= heads,
           "sub-view out of range");
  TensorView s = *this;
  s.data = data + token_begin * token_stride + head_begin * head_stride;
  s.tokens = n_tokens;
  s.heads = n_heads;
  return s;
}

void AttentionRef(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& out, const TensorView& lse, double scale) {
  DS_CHECK(k.heads > 0 && q.heads % k.heads == 0, "query heads ", q.heads, " vs kv heads ",
           k.heads);
  DS_CHECK(k.tokens == v.tokens && k.heads == v.heads && q.width == k.width &&
               v.width == out.width && out.tokens == q.tokens && out.heads == q.heads &&
               lse.tokens == q.tokens && lse.heads == q.heads && lse.width == 1,
           "attention shapes disagree");
  const int64_t group = q.heads / k.heads;
  const int64_t d = q.width, dv = v.width;
  std::vector<double> s(k.tokens), acc(dv);
  for (int64_t b = 0; b < q.batch; ++b) {
    for (int64_t t = 0; t < q.tokens; ++t) {
      for (int64_t h = 0; h < q.heads; ++h) {
        const float* qr = q.at(b, t, h);
        const int64_t kh = h / group;
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < k.tokens; ++j) {
          const float* kr = k.at(b, j, kh);
          double dot = 0;
          for (int64_t w = 0; w < d; ++w) dot += static_cast<double>(qr[w]) * kr[w];
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        float* o = out.at(b, t, h);
        if (k.tokens == 0) {
          for (int64_t w = 0; w < dv; ++w) o[w] = 0.f;
          *lse.at(b, t, h) = -std::numeric_limits<float>::infinity();
          continue;
        }
        double sum = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < k.tokens; ++j) {
          const double p = std::exp(s[j] - m);
          sum += p;
          const float* vr = v.at(b, j, kh);
          for (int64_t w = 0; w < dv; ++w) acc[w] += p * vr[w];
        }
        for (int64_t w = 0; w < dv; ++w) o[w] = static_cast<float>(acc[w] / sum);
        *lse.at(b, t, h) = static_cast<float>(m + std::log(sum));
      }
    }
  }
}

void MergeRef(const TensorView& part, const TensorView& part_lse, const TensorView& acc,
              const TensorView& acc_lse) {
  DS_CHECK(part.batch == acc.batch && part.tokens == acc.tokens && part.heads == acc.heads &&
               part.width == acc.width && part_lse.tokens == part.tokens &&
               part_lse.heads == part.heads && acc_lse.tokens == acc.tokens &&
               acc_lse.heads == acc.heads,
           "merge shapes disagree");
  for (int64_t b = 0; b < acc.batch; ++b) {
    for (int64_t t = 0; t < acc.tokens; ++t) {
      for (int64_t h = 0; h < acc.heads; ++h) {
        const double lp = *part_lse.at(b, t, h);
        float* la = acc_lse.at(b, t, h);
        const double l0 = *la;
        if (std::isinf(lp) && lp < 0) continue;  // empty partial
        const float* po = part.at(b, t, h);
        float* ao = acc.at(b, t, h);
        if (std::isinf(l0) && l0 < 0) {
          for (int64_t w = 0; w < acc.width; ++w) ao[w] = po[w];
          *la = static_cast<float>(lp);
          continue;
        }
        const double m = std::max(l0, lp);
        const double wa = std::exp(l0 - m), wp = std::exp(lp - m);
        const double l = m + std::log(wa + wp);
        const double ca = std::exp(l0 - l), cp = std::exp(lp - l);
        for (int64_t w = 0; w < acc.width; ++w) {
          ao[w] =
              static_cast<float>(ca * static_cast<double>(ao[w]) + cp * static_cast<double>(po[w]));
        }
        *la = static_cast<float>(l);
      }
    }
  }
}

}  // namespace ditscale::sp
