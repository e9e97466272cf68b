// Tensor checks and allocation of the AdaLN torch ops (see adaln_prepare.h for the contract).
#include "ditscale/torch/adaln_prepare.h"

#include <optional>
#include <string>
#include <utility>

#include "ditscale/core/range.h"

namespace ditscale::torch_ext {
namespace {

using kernels::DType;
using kernels::RowsView;

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kFloat64;
    default:
      TORCH_CHECK(false, "ditscale: unsupported dtype ", t);
  }
}

kernels::NormType to_norm(const char* op, std::string_view norm) {
  if (norm == "layernorm") return kernels::NormType::kLayerNorm;
  if (norm == "rmsnorm") return kernels::NormType::kRMSNorm;
  TORCH_CHECK(false, op, ": norm must be \"layernorm\" or \"rmsnorm\", got \"", std::string(norm),
              "\"");
}

bool last_dim_contiguous(const at::Tensor& t) { return t.size(-1) == 1 || t.stride(-1) == 1; }

// Shape and dtype of one activation tensor [B, N, D] against x; returns it with a
// contiguous last dimension (a copy only when needed).
at::Tensor rows_input(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.dim() == 3 && t.sizes() == x.sizes(), op, ": ", name,
              " must have x's shape [B, N, D] = ", x.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " must have x's dtype ",
              x.scalar_type(), ", got ", t.scalar_type());
  return last_dim_contiguous(t) ? t : t.contiguous();
}

RowsView rows_view(const at::Tensor& t) {
  RowsView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.stride_b = t.stride(0);
  v.stride_n = t.stride(1);
  return v;
}

// A modulation tensor (scale, shift, gate): [B, D] or [B, N, D], x's dtype or fp32. Returns it
// with a contiguous last dimension; `per_token_grad` materialises a [B, N, D] view with stride 0
// along N (its gradient is per token, which the kernels only write for stride_n != 0).
at::Tensor modulation_input(const char* op, const char* name, const at::Tensor& t,
                            const at::Tensor& x, bool per_token_grad) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  const bool per_sample = t.dim() == 2 && t.size(0) == B && t.size(1) == D;
  const bool per_token = t.dim() == 3 && t.size(0) == B && t.size(1) == N && t.size(2) == D;
  TORCH_CHECK(per_sample || per_token, op, ": ", name, " must be per sample [B, D] = [", B, ", ", D,
              "] or per token [B, N, D] = [", B, ", ", N, ", ", D, "], got ", t.sizes(),
              " (a [B, 1, D] tensor: pass t.squeeze(1), as ditscale.ops.adaln does)");
  TORCH_CHECK(t.scalar_type() == x.scalar_type() || t.scalar_type() == at::kFloat, op, ": ", name,
              " must have x's dtype (", x.scalar_type(), ") or float32, got ", t.scalar_type());
  if (!last_dim_contiguous(t)) return t.contiguous();
  if (per_token_grad && per_token && N > 1 && t.stride(1) == 0) return t.contiguous();
  return t;
}

RowsView modulation_view(const at::Tensor& t) {
  RowsView v;
  v.data = t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.stride_b = t.stride(0);
  v.stride_n = t.dim() == 2 ? 0 : t.stride(1);
  return v;
}

// weight / bias: [D], x's dtype or fp32, contiguous (copied otherwise).
OptTensor affine_input(const char* op, const char* name, const OptTensor& t, const at::Tensor& x) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == x.size(2), op, ": ", name, " must be [D] = [",
              x.size(2), "], got ", t->sizes());
  TORCH_CHECK(t->scalar_type() == x.scalar_type() || t->scalar_type() == at::kFloat, op, ": ", name,
              " must have x's dtype (", x.scalar_type(), ") or float32, got ", t->scalar_type());
  return t->contiguous();
}

// Fills the fields shared by forward and backward; returns the affine tensors (kept alive by
// the caller).
void fill_config(const char* op, kernels::AdaLNConfig& p, const at::Tensor& x,
                 const OptTensor& weight, const OptTensor& bias, std::string_view norm,
                 double eps) {
  const std::optional<std::string> eps_error = RangeError("eps", eps, kMinEps, kMaxEps);
  TORCH_CHECK(!eps_error, op, ": ", *eps_error, " (eps must be finite and > 0)");
  p.batch = x.size(0);
  p.seq_len = x.size(1);
  p.dim = x.size(2);
  p.norm = to_norm(op, norm);
  p.eps = static_cast<float>(eps);
  p.dtype = to_dtype(x.scalar_type());
  if (weight && bias) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(), op,
                ": weight and bias must have the same dtype, got ", weight->scalar_type(), " and ",
                bias->scalar_type());
  }
  p.weight = weight ? weight->data_ptr() : nullptr;
  p.bias = bias ? bias->data_ptr() : nullptr;
  if (weight)
    p.affine_dtype = to_dtype(weight->scalar_type());
  else if (bias)
    p.affine_dtype = to_dtype(bias->scalar_type());
}

void check_x(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(x.dim() == 3, op, ": ", name, " must be [B, N, D], got shape ", x.sizes());
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kDouble, op, ": ",
              name, " must be bfloat16, float16, float32 or float64, got ", t);
  TORCH_CHECK(t != at::kDouble || x.device().is_cpu(), op, ": ", name,
              " is float64, which only the CPU implementation supports");
  TORCH_CHECK(x.size(2) >= 1, op, ": ", name, " must have D >= 1 features, got ", x.sizes());
}

at::Tensor affine_grad(const OptTensor& t, const at::Tensor& x) {
  if (!t) return at::empty({0}, x.options().dtype(at::kFloat));
  return at::empty({x.size(2)}, t->options());
}

}  // namespace

void check_same_device(const char* op, std::initializer_list<NamedTensor> tensors) {
  const NamedTensor* first = nullptr;
  for (const NamedTensor& t : tensors) {
    if (t.tensor == nullptr || !t.tensor->defined()) continue;
    if (first == nullptr) {
      first = &t;
      continue;
    }
    TORCH_CHECK(t.tensor->device() == first->tensor->device(), op,
                ": expected all tensors to be on the same device, but got ", t.name, " on ",
                t.tensor->device(), ", different from ", first->name, " on ",
                first->tensor->device());
  }
}

AdaLNForwardCall prepare_adaln_forward(const char* op, bool gated, const at::Tensor& x_in,
                                       const OptTensor& gate_in, const OptTensor& branch_in,
                                       const at::Tensor& scale_in, const at::Tensor& shift_in,
                                       const OptTensor& weight_in, const OptTensor& bias_in,
                                       std::string_view norm, double eps) {
  const char* xname = gated ? "residual" : "x";
  check_x(op, xname, x_in);
  AdaLNForwardCall c;
  at::Tensor x = last_dim_contiguous(x_in) ? x_in : x_in.contiguous();
  at::Tensor scale = modulation_input(op, "scale", scale_in, x, false);
  at::Tensor shift = modulation_input(op, "shift", shift_in, x, false);
  OptTensor weight = affine_input(op, "weight", weight_in, x);
  OptTensor bias = affine_input(op, "bias", bias_in, x);
  auto& p = c.params;
  fill_config(op, p, x, weight, bias, norm, eps);
  p.scale = modulation_view(scale);
  p.shift = modulation_view(shift);
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  c.y = at::empty({B, N, D}, x.options());
  c.mean = at::empty({B, N}, x.options().dtype(at::kFloat));
  c.rstd = at::empty({B, N}, x.options().dtype(at::kFloat));
  p.y = c.y.data_ptr();
  p.mean = c.mean.data_ptr<float>();
  p.rstd = c.rstd.data_ptr<float>();
  if (gated) {
    TORCH_CHECK(gate_in && branch_in, op, ": the gated variant needs gate and branch");
    at::Tensor gate = modulation_input(op, "gate", *gate_in, x, false);
    at::Tensor branch = rows_input(op, "branch", *branch_in, x);
    c.h = at::empty({B, N, D}, x.options());
    p.residual = rows_view(x);
    p.branch = rows_view(branch);
    p.gate = modulation_view(gate);
    p.h = c.h.data_ptr();
    c.keep = {gate, branch};
  } else {
    p.x = rows_view(x);
  }
  c.keep.insert(c.keep.end(), {x, scale, shift});
  if (weight) c.keep.push_back(*weight);
  if (bias) c.keep.push_back(*bias);
  c.empty = B * N == 0;
  return c;
}

namespace {

// prepare_adaln_backward; modulation_grads = false leaves dscale / dshift / dgate unallocated (the
// packed ops point them into the modulation's gradient).
AdaLNBackwardCall prepare_backward(const char* op, bool gated, const OptTensor& dh_in,
                                   const at::Tensor& dy_in, const at::Tensor& x_in,
                                   const OptTensor& gate_in, const OptTensor& branch_in,
                                   const at::Tensor& scale_in, const at::Tensor& shift_in,
                                   const OptTensor& weight_in, const OptTensor& bias_in,
                                   const at::Tensor& mean_in, const at::Tensor& rstd_in,
                                   std::string_view norm, double eps, bool modulation_grads) {
  const char* xname = gated ? "residual" : "x";
  check_x(op, xname, x_in);
  AdaLNBackwardCall c;
  at::Tensor x = last_dim_contiguous(x_in) ? x_in : x_in.contiguous();
  at::Tensor dy = rows_input(op, "dy", dy_in, x);
  at::Tensor scale = modulation_input(op, "scale", scale_in, x, true);
  at::Tensor shift = modulation_input(op, "shift", shift_in, x, true);
  OptTensor weight = affine_input(op, "weight", weight_in, x);
  OptTensor bias = affine_input(op, "bias", bias_in, x);
  const int64_t B = x.size(0), N = x.size(1), D = x.size(2);
  for (const auto* s : {&mean_in, &rstd_in}) {
    const char* name = s == &mean_in ? "mean" : "rstd";
    TORCH_CHECK(s->defined() && s->dim() == 2 && s->size(0) == B && s->size(1) == N, op, ": ", name,
                " must be [B, N] = [", B, ", ", N, "] (from the forward), got ",
                s->defined() ? s->sizes() : at::IntArrayRef{});
    TORCH_CHECK(s->scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ",
                s->scalar_type());
  }
  at::Tensor mean = mean_in.contiguous();
  at::Tensor rstd = rstd_in.contiguous();

  auto& p = c.params;
  fill_config(op, p, x, weight, bias, norm, eps);
  p.scale = modulation_view(scale);
  p.shift = modulation_view(shift);
  (gated ? p.residual : p.x) = rows_view(x);
  p.dy = rows_view(dy);
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  c.dx = at::empty({B, N, D}, x.options());
  if (modulation_grads) {
    c.dscale = at::empty(scale.sizes(), scale.options());
    c.dshift = at::empty(shift.sizes(), shift.options());
    p.dscale = c.dscale.data_ptr();
    p.dshift = c.dshift.data_ptr();
  }
  c.dweight = affine_grad(weight, x);
  c.dbias = affine_grad(bias, x);
  p.dx = c.dx.data_ptr();
  p.dweight = weight ? c.dweight.data_ptr() : nullptr;
  p.dbias = bias ? c.dbias.data_ptr() : nullptr;
  c.keep = {x, dy, scale, shift, mean, rstd};
  if (weight) c.keep.push_back(*weight);
  if (bias) c.keep.push_back(*bias);
  if (gated) {
    TORCH_CHECK(gate_in && branch_in, op, ": the gated variant needs gate and branch");
    at::Tensor gate = modulation_input(op, "gate", *gate_in, x, true);
    at::Tensor branch = rows_input(op, "branch", *branch_in, x);
    p.gate = modulation_view(gate);
    p.branch = rows_view(branch);
    if (dh_in && dh_in->defined()) {
      at::Tensor dh = rows_input(op, "dh", *dh_in, x);
      p.dh_out = rows_view(dh);
      c.keep.push_back(dh);
    }
    c.dbranch = at::empty({B, N, D}, x.options());
    p.dbranch = c.dbranch.data_ptr();
    if (modulation_grads) {
      c.dgate = at::empty(gate.sizes(), gate.options());
      p.dgate = c.dgate.data_ptr();
    }
    c.keep.insert(c.keep.end(), {gate, branch});
  }
  c.empty = B * N == 0;
  if (c.empty) {  // nothing to launch: reduced gradients are sums over no rows
    for (at::Tensor* g : {&c.dscale, &c.dshift, &c.dweight, &c.dbias, &c.dgate}) {
      if (g->defined()) g->zero_();
    }
  }
  return c;
}

}  // namespace

AdaLNBackwardCall prepare_adaln_backward(const char* op, bool gated, const OptTensor& dh,
                                         const at::Tensor& dy, const at::Tensor& x,
                                         const OptTensor& gate, const OptTensor& branch,
                                         const at::Tensor& scale, const at::Tensor& shift,
                                         const OptTensor& weight, const OptTensor& bias,
                                         const at::Tensor& mean, const at::Tensor& rstd,
                                         std::string_view norm, double eps) {
  return prepare_backward(op, gated, dh, dy, x, gate, branch, scale, shift, weight, bias, mean,
                          rstd, norm, eps, /*modulation_grads=*/true);
}

ModRows packed_modulation(const char* op, const at::Tensor& mod, int64_t scale_index,
                          int64_t shift_index, const at::Tensor& x,
                          std::optional<int64_t> gate_index) {
  // x (plain) / residual (gated): fully checked by prepare_adaln_*; here only its sizes.
  TORCH_CHECK(x.defined() && x.dim() == 3, op, ": the activations must be [B, N, D], got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  TORCH_CHECK(
      mod.defined() && mod.dim() == 3 && mod.size(0) == x.size(0) && mod.size(2) == x.size(2), op,
      ": mod must be [B, K, D] with B = ", x.size(0), " and D = ", x.size(2), ", got ",
      mod.defined() ? mod.sizes() : at::IntArrayRef{});
  const int64_t K = mod.size(1);
  const bool gated = gate_index.has_value();
  const std::pair<const char*, int64_t> rows[3] = {{"scale_index", scale_index},
                                                   {"shift_index", shift_index},
                                                   {"gate_index", gate_index.value_or(-1)}};
  for (int k = 0; k < (gated ? 3 : 2); ++k) {
    TORCH_CHECK(rows[k].second >= 0 && rows[k].second < K, op, ": ", rows[k].first, " = ",
                rows[k].second, " is outside mod's K = ", K, " rows");
    for (int q = 0; q < k; ++q) {
      TORCH_CHECK(rows[q].second != rows[k].second, op, ": ", rows[q].first, " and ", rows[k].first,
                  " are both ", rows[k].second,
                  " (each modulation must be a different row of mod)");
    }
  }
  ModRows m{mod.select(1, scale_index), mod.select(1, shift_index), at::Tensor()};
  if (gated) m.gate = mod.select(1, *gate_index);
  return m;
}

AdaLNBackwardCall prepare_packed_adaln_backward(
    const char* op, const OptTensor& dh, const at::Tensor& dy, const at::Tensor& x,
    const OptTensor& branch, const at::Tensor& mod, std::optional<int64_t> gate_index,
    int64_t scale_index, int64_t shift_index, const OptTensor& weight, const OptTensor& bias,
    const at::Tensor& mean, const at::Tensor& rstd, std::string_view norm, double eps) {
  const ModRows m = packed_modulation(op, mod, scale_index, shift_index, x, gate_index);
  const bool gated = gate_index.has_value();
  AdaLNBackwardCall c = prepare_backward(
      op, gated, dh, dy, x, gated ? OptTensor(m.gate) : OptTensor(), branch, m.scale, m.shift,
      weight, bias, mean, rstd, norm, eps, /*modulation_grads=*/false);
  const int64_t B = mod.size(0), K = mod.size(1), D = mod.size(2);
  c.dmod = at::empty({B, K, D}, mod.options().memory_format(at::MemoryFormat::Contiguous));
  auto& p = c.params;
  c.dscale = c.dmod.select(1, scale_index);
  c.dshift = c.dmod.select(1, shift_index);
  p.dscale = c.dscale.data_ptr();
  p.dshift = c.dshift.data_ptr();
  p.dscale_stride_b = K * D;
  p.dshift_stride_b = K * D;
  if (gated) {
    c.dgate = c.dmod.select(1, *gate_index);
    p.dgate = c.dgate.data_ptr();
    p.dgate_stride_b = K * D;
  }
  if (c.empty) {  // nothing launches: sums over no rows
    c.dmod.zero_();
  } else {  // the backward zeroes the rows it does not fill
    p.dmod = c.dmod.data_ptr();
    p.dmod_rows = K;
    p.dmod_dtype = p.scale.dtype;
  }
  return c;
}

}  // namespace ditscale::torch_ext
