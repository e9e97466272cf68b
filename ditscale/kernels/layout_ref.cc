// Params builders, validation and the CPU reference of the layout copies (layout.h).
#include <cstring>
#include <string>
#include <vector>

#include "ditscale/core/error.h"
#include "ditscale/kernels/layout.h"

namespace ditscale::kernels {
namespace {

void check_buffer(const DenseBuffer& buf, const char* name) {
  DS_CHECK(dtype_size(buf.dtype) != 0, name, ".dtype: invalid value ", static_cast<int>(buf.dtype));
  DS_CHECK(buf.batch >= 1 && buf.tokens >= 0 && buf.heads >= 0 && buf.head_dim >= 1, name,
           ": invalid shape [", buf.batch, ", ", buf.tokens, ", ", buf.heads, ", ", buf.head_dim,
           "] (need batch, head_dim >= 1, tokens, heads >= 0)");
  DS_CHECK(buf.data != nullptr || buf.tokens * buf.heads == 0, name, ".data: null");
}

void check_region(const DenseBuffer& buf, const BufferRegion& r) {
  DS_CHECK(r.token_begin >= 0 && r.tokens >= 0 && r.token_begin + r.tokens <= buf.tokens,
           "region tokens [", r.token_begin, ", +", r.tokens, ") outside the buffer's ", buf.tokens,
           " tokens");
  DS_CHECK(r.head_begin >= 0 && r.heads >= 0 && r.head_begin + r.heads <= buf.heads,
           "region heads [", r.head_begin, ", +", r.heads, ") outside the buffer's ", buf.heads,
           " heads");
}

LayoutCopyParams base_params(const DenseBuffer& buf) {
  LayoutCopyParams p;
  p.dtype = buf.dtype;
  p.batch = buf.batch;
  p.head_dim = buf.head_dim;
  return p;
}

// The dense buffer's strides, with `data` moved to the region's first element.
void set_strided(const DenseBuffer& buf, const BufferRegion& r, const void** data, std::int64_t* sb,
                 std::int64_t* st, std::int64_t* sh) {
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(buf.dtype));
  *sh = buf.head_dim;
  *st = buf.heads * buf.head_dim;
  *sb = buf.tokens * *st;
  *data = static_cast<const char*>(buf.data) + (r.token_begin * *st + r.head_begin * *sh) * elem;
}

// One copy between region `r` of `buf` and a dense [B, r.tokens, r.heads, D] tensor at `dense`.
LayoutCopy region_copy(const DenseBuffer& buf, const BufferRegion& r, const void* dense,
                       bool to_dense) {
  const void* strided = nullptr;
  std::int64_t sb = 0, st = 0, sh = 0;
  set_strided(buf, r, &strided, &sb, &st, &sh);
  const std::int64_t dh = buf.head_dim, dt = r.heads * dh, db = r.tokens * dt;
  LayoutCopy c;
  c.tokens = r.tokens;
  c.heads = r.heads;
  if (to_dense) {
    c.src = strided;
    c.src_stride_b = sb, c.src_stride_t = st, c.src_stride_h = sh;
    c.dst = const_cast<void*>(dense);
    c.dst_stride_b = db, c.dst_stride_t = dt, c.dst_stride_h = dh;
  } else {
    c.src = dense;
    c.src_stride_b = db, c.src_stride_t = dt, c.src_stride_h = dh;
    c.dst = const_cast<void*>(strided);
    c.dst_stride_b = sb, c.dst_stride_t = st, c.dst_stride_h = sh;
  }
  return c;
}

void check_offsets(const DenseBuffer& buf, SplitAxis axis,
                   const std::vector<std::int64_t>& offsets) {
  const std::int64_t size = axis == SplitAxis::kTokens ? buf.tokens : buf.heads;
  const char* name = axis == SplitAxis::kTokens ? "tokens" : "heads";
  DS_CHECK(offsets.size() >= 2 && offsets.size() <= kMaxLayoutCopies + 1, "offsets: need 2 to ",
           kMaxLayoutCopies + 1, " values (n + 1 for n chunks), got ", offsets.size());
  DS_CHECK(offsets.front() == 0 && offsets.back() == size, "offsets must run from 0 to the ", name,
           " of the buffer (", size, "), got ", offsets.front(), " .. ", offsets.back());
  for (std::size_t i = 1; i < offsets.size(); ++i) {
    DS_CHECK(offsets[i] >= offsets[i - 1], "offsets[", i, "] = ", offsets[i],
             " is smaller than offsets[", i - 1, "] = ", offsets[i - 1]);
  }
}

BufferRegion chunk_region(const DenseBuffer& buf, SplitAxis axis,
                          const std::vector<std::int64_t>& offsets, int i) {
  const std::int64_t n = offsets[i + 1] - offsets[i];
  if (axis == SplitAxis::kTokens) return {offsets[i], n, 0, buf.heads};
  return {0, buf.tokens, offsets[i], n};
}

LayoutCopyParams split_or_join(const DenseBuffer& buf, SplitAxis axis,
                               const std::vector<std::int64_t>& offsets, const void* staging,
                               bool split) {
  check_buffer(buf, split ? "src" : "dst");
  check_offsets(buf, axis, offsets);
  DS_CHECK(staging != nullptr || buf.tokens * buf.heads == 0, "staging: null");
  LayoutCopyParams p = base_params(buf);
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(buf.dtype));
  p.num_copies = static_cast<int>(offsets.size()) - 1;
  for (int i = 0; i < p.num_copies; ++i) {
    const void* chunk =
        static_cast<const char*>(staging) + chunk_offset(buf, axis, offsets, i) * elem;
    p.copies[i] = region_copy(buf, chunk_region(buf, axis, offsets, i), chunk, split);
  }
  return p;
}

}  // namespace

LayoutCopyParams pack_region_params(const DenseBuffer& src, const BufferRegion& region,
                                    void* staging) {
  check_buffer(src, "src");
  check_region(src, region);
  DS_CHECK(staging != nullptr || region.tokens * region.heads == 0, "staging: null");
  LayoutCopyParams p = base_params(src);
  p.num_copies = 1;
  p.copies[0] = region_copy(src, region, staging, /*to_dense=*/true);
  return p;
}

LayoutCopyParams unpack_region_params(const void* staging, const DenseBuffer& dst,
                                      const BufferRegion& region) {
  check_buffer(dst, "dst");
  check_region(dst, region);
  DS_CHECK(staging != nullptr || region.tokens * region.heads == 0, "staging: null");
  LayoutCopyParams p = base_params(dst);
  p.num_copies = 1;
  p.copies[0] = region_copy(dst, region, staging, /*to_dense=*/false);
  return p;
}

std::int64_t chunk_offset(const DenseBuffer& shape, SplitAxis axis,
                          const std::vector<std::int64_t>& offsets, int i) {
  DS_CHECK(i >= 0 && static_cast<std::size_t>(i) < offsets.size(), "chunk index ", i,
           " out of range for ", offsets.size(), " offsets");
  const std::int64_t other = axis == SplitAxis::kTokens ? shape.heads : shape.tokens;
  return shape.batch * other * shape.head_dim * offsets[i];
}

LayoutCopyParams split_params(const DenseBuffer& src, SplitAxis axis,
                              const std::vector<std::int64_t>& offsets, void* staging) {
  return split_or_join(src, axis, offsets, staging, /*split=*/true);
}

LayoutCopyParams join_params(const void* staging, SplitAxis axis,
                             const std::vector<std::int64_t>& offsets, const DenseBuffer& dst) {
  return split_or_join(dst, axis, offsets, staging, /*split=*/false);
}

void layout_copy_check(const LayoutCopyParams& p) {
  DS_CHECK(dtype_size(p.dtype) != 0, "LayoutCopyParams.dtype: invalid value ",
           static_cast<int>(p.dtype));
  DS_CHECK(p.batch >= 1, "LayoutCopyParams.batch must be >= 1, got ", p.batch);
  DS_CHECK(p.head_dim >= 1, "LayoutCopyParams.head_dim must be >= 1, got ", p.head_dim);
  DS_CHECK(p.num_copies >= 0 && p.num_copies <= kMaxLayoutCopies,
           "LayoutCopyParams.num_copies must be in [0, ", kMaxLayoutCopies, "], got ",
           p.num_copies);
  for (int i = 0; i < p.num_copies; ++i) {
    const LayoutCopy& c = p.copies[i];
    const std::string f = internal::StrCat("LayoutCopyParams.copies[", i, "]");
    DS_CHECK(c.tokens >= 0 && c.heads >= 0, f, ": tokens and heads must be >= 0, got ", c.tokens,
             " and ", c.heads);
    if (c.tokens == 0 || c.heads == 0) continue;
    DS_CHECK(c.src != nullptr, f, ".src: null");
    DS_CHECK(c.dst != nullptr, f, ".dst: null");
    DS_CHECK(c.src_stride_b >= 0 && c.src_stride_t >= 0 && c.src_stride_h >= 0, f,
             ".src strides must be >= 0");
    DS_CHECK(c.dst_stride_b >= 0 && c.dst_stride_t >= 0 && c.dst_stride_h >= 0, f,
             ".dst strides must be >= 0");
  }
}

std::int64_t layout_copy_bytes(const LayoutCopyParams& p) {
  std::int64_t elements = 0;
  for (int i = 0; i < p.num_copies; ++i) {
    elements += p.batch * p.copies[i].tokens * p.copies[i].heads * p.head_dim;
  }
  return elements * static_cast<std::int64_t>(dtype_size(p.dtype));
}

void layout_copy_ref(const LayoutCopyParams& p) {
  layout_copy_check(p);
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(p.dtype));
  const std::size_t row_bytes = static_cast<std::size_t>(p.head_dim * elem);
  for (int i = 0; i < p.num_copies; ++i) {
    const LayoutCopy& c = p.copies[i];
    for (std::int64_t b = 0; b < p.batch; ++b) {
      for (std::int64_t t = 0; t < c.tokens; ++t) {
        for (std::int64_t h = 0; h < c.heads; ++h) {
          const char* s = static_cast<const char*>(c.src) +
                          (b * c.src_stride_b + t * c.src_stride_t + h * c.src_stride_h) * elem;
          char* d = static_cast<char*>(c.dst) +
                    (b * c.dst_stride_b + t * c.dst_stride_t + h * c.dst_stride_h) * elem;
          std::memcpy(d, s, row_bytes);
        }
      }
    }
  }
}

}  // namespace ditscale::kernels
