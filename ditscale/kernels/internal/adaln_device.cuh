// Device-side pieces shared by the AdaLN forward and backward kernels: kernel argument structs,
// element conversion, 16-byte vector loads/stores, and the deterministic row reduction.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace ditscale::kernels::internal {

// A [B, N, D] strided view (last dim contiguous) as the kernels see it. `f32`: elements are
// float; otherwise they are the kernel's activation type T.
struct DevView {
  const void* data = nullptr;
  std::int64_t sb = 0;
  std::int64_t sn = 0;
  bool f32 = false;
};

struct FwdArgs {
  std::int64_t rows = 0;   // B * N
  std::int64_t batch = 0;  // B
  std::int64_t n = 0;      // N
  std::int64_t d = 0;      // D
  float inv_d = 0.f;       // 1 / D (fp32, as the kernels would compute it)
  float eps = 0.f;
  bool rms = false;
  bool gated = false;
  DevView x;  // plain: x; gated: residual
  DevView branch, gate, scale, shift;
  const void* weight = nullptr;
  const void* bias = nullptr;
  bool affine_f32 = false;
  void* y = nullptr;
  void* h = nullptr;
  float* mean = nullptr;
  float* rstd = nullptr;
  bool evict_first = false;  // streaming / evict-first hints on x loads and y stores
};

struct BwdArgs {
  std::int64_t n = 0;  // N
  std::int64_t d = 0;  // D
  std::int64_t rows_per_tile = 0;
  std::int64_t num_tiles = 0;
  bool rms = false;
  bool gated = false;
  DevView x;  // plain: x; gated: residual (h = residual + gate * branch is recomputed)
  DevView dy, dh_out, branch, gate, scale, shift;
  const void* weight = nullptr;
  const void* bias = nullptr;
  bool affine_f32 = false;
  const float* mean = nullptr;
  const float* rstd = nullptr;
  void* dx = nullptr;
  void* dbranch = nullptr;
  void* dscale_tok = nullptr;  // per-token dscale output (null when per sample / not wanted)
  void* dshift_tok = nullptr;
  void* dgate_tok = nullptr;
  float* ws_dscale = nullptr;  // [B, tiles, D] partials (null when not reduced)
  float* ws_dshift = nullptr;
  float* ws_dgate = nullptr;
  float* ws_dweight = nullptr;
  float* ws_dbias = nullptr;
};

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v);
template <>
__device__ __forceinline__ float from_f<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_f<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <int V>
__device__ __forceinline__ void fill(float (&v)[V], float value) {
#pragma unroll
  for (int e = 0; e < V; ++e) v[e] = value;
}

// Rounds v to T and back.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_f(from_f<T>(v));
}

// The gated residual h = residual + gate * branch as the forward stores it (one fp32 FMA, rounded
// to T): the backward recomputes it with this same function, so it sees the forward's bits.
template <typename T>
__device__ __forceinline__ float gated_h(float residual, float gate, float branch) {
  return round_to<T>(fmaf(gate, branch, residual));
}

// V elements of E at p (16-byte aligned, V * sizeof(E) a multiple of 16) -> float.
template <int V, typename E>
__device__ __forceinline__ void load_vec(const E* p, float (&out)[V]) {
  constexpr int kChunks = V * static_cast<int>(sizeof(E)) / 16;
  static_assert(kChunks * 16 == V * static_cast<int>(sizeof(E)), "vector must be 16-byte chunks");
  uint4 raw[kChunks];
  const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) raw[i] = src[i];
  const E* e = reinterpret_cast<const E*>(raw);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_f(e[i]);
}

// float[V] -> V elements of E at p (rounded to nearest even), 16-byte stores.
template <int V, typename E>
__device__ __forceinline__ void store_vec(E* p, const float (&in)[V]) {
  constexpr int kChunks = V * static_cast<int>(sizeof(E)) / 16;
  static_assert(kChunks * 16 == V * static_cast<int>(sizeof(E)), "vector must be 16-byte chunks");
  uint4 raw[kChunks];
  E* e = reinterpret_cast<E*>(raw);
#pragma unroll
  for (int i = 0; i < V; ++i) e[i] = from_f<E>(in[i]);
  uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) dst[i] = raw[i];
}

__device__ __forceinline__ std::int64_t view_offset(const DevView& v, std::int64_t b,
                                                    std::int64_t n, std::int64_t d) {
  return b * v.sb + n * v.sn + d;
}

// V elements of a view whose dtype is T or float (runtime flag, uniform across the block).
template <int V, typename T>
__device__ __forceinline__ void load_view_vec(const DevView& v, std::int64_t off, float (&out)[V]) {
  if (v.f32) {
    load_vec<V>(static_cast<const float*>(v.data) + off, out);
  } else {
    load_vec<V>(static_cast<const T*>(v.data) + off, out);
  }
}

template <int V, typename T>
__device__ __forceinline__ void store_any_vec(void* base, bool f32, std::int64_t off,
                                              const float (&in)[V]) {
  if (f32) {
    store_vec<V>(static_cast<float*>(base) + off, in);
  } else {
    store_vec<V>(static_cast<T*>(base) + off, in);
  }
}

template <typename T>
__device__ __forceinline__ float load_any(const void* base, bool f32, std::int64_t off) {
  return f32 ? static_cast<const float*>(base)[off] : to_f(static_cast<const T*>(base)[off]);
}

template <typename T>
__device__ __forceinline__ void store_any(void* base, bool f32, std::int64_t off, float v) {
  if (f32) {
    static_cast<float*>(base)[off] = v;
  } else {
    static_cast<T*>(base)[off] = from_f<T>(v);
  }
}

// ---- Programmatic dependent launch (sm_90+; no-ops on older GPUs and without the attribute) ----
// Every AdaLN kernel starts with this, before its first global memory access. Launched with
// cudaLaunchAttributeProgrammaticStreamSerialization (adaln_launch.h: launch_kernel), a kernel may
// begin while the kernel before it in the stream is still finishing: `griddepcontrol.wait`
// blocks until that grid has completed and its writes are visible, so no input is read early.
// `griddepcontrol.launch_dependents` then lets the next PDL-launched kernel be scheduled as this
// one's blocks retire (the next kernel waits the same way, for this one's completion): launch
// latency and block ramp-up overlap the previous kernel's tail. Deadlock-free: the next grid
// starts only once every block of this one has executed the trigger, i.e. is resident.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- Per-thread asynchronous copy ring (cp.async, sm_80+) ----
// The pipelined kernels stream their row inputs into shared memory with 16-byte cp.async copies
// issued a few rows ahead. Every thread copies exactly the 16-byte chunks it later reads itself,
// so a thread only waits for its own copy groups (cp.async.wait_group); no barrier is needed for
// the ring. A thread issues the copies of a ring slot only after it has read that slot's previous
// contents (program order), so there is no write-after-read race either.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` of this thread's most recent copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 16 bytes of T -> V floats.
template <int V, typename T>
__device__ __forceinline__ void unpack_vec(const uint4& raw, float (&out)[V]) {
  static_assert(V * sizeof(T) == 16, "one 16-byte chunk per vector");
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = to_f(e[i]);
}

// 16 bytes of a 16-bit type -> 8 floats (exact). bf16 by bit operations (one per element: the
// low half shifted up, the high half masked), fp16 by conversion.
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float (&out)[8]) {
  static_assert(sizeof(T) == 2, "16-bit element types only");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
    unpack_vec<8, T>(raw, out);
  }
}

// V elements of E from shared memory (16-byte aligned) -> float.
template <int V, typename E>
__device__ __forceinline__ void load_smem_vec(const uint4* p, float (&out)[V]) {
  const uint4 raw = *p;  // one 16-byte load, then registers
  unpack_vec<V, E>(raw, out);
}

// A and C of feature vector starting at d (sample b, token n): A = w (1 + scale),
// C = b (1 + scale) + shift.
template <int V, typename T>
__device__ __forceinline__ void fwd_coefs(const FwdArgs& a, std::int64_t b, std::int64_t n,
                                          std::int64_t d, float (&ca)[V], float (&cc)[V]) {
  load_view_vec<V, T>(a.scale, view_offset(a.scale, b, n, d), ca);
  load_view_vec<V, T>(a.shift, view_offset(a.shift, b, n, d), cc);
#pragma unroll
  for (int e = 0; e < V; ++e) ca[e] += 1.f;
  if (a.weight == nullptr && a.bias == nullptr) return;
  float w[V], bi[V];
  fill(w, 1.f);
  fill(bi, 0.f);
  if (a.weight != nullptr) load_view_vec<V, T>(DevView{a.weight, 0, 0, a.affine_f32}, d, w);
  if (a.bias != nullptr) load_view_vec<V, T>(DevView{a.bias, 0, 0, a.affine_f32}, d, bi);
#pragma unroll
  for (int e = 0; e < V; ++e) {
    cc[e] = fmaf(bi[e], ca[e], cc[e]);
    ca[e] *= w[e];
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sums K values over the blockDim.x threads of one row (threadIdx.y selects the row): warp
// shuffle, then the row's warps through `smem` (>= blockDim.y * blockDim.x / 32 * K floats),
// added in warp order so every thread gets the same, reproducible result. Must be called by all
// threads of the block; two calls on the same `smem` need a __syncthreads() between them (use
// two buffers alternately).
template <int K>
__device__ __forceinline__ void row_sum(float (&v)[K], float* smem) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if (blockDim.x == 32) return;  // uniform: one warp per row
  const int warps = blockDim.x / 32;
  const int warp = threadIdx.x / 32;
  float* s = smem + threadIdx.y * warps * K;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) s[warp * K + k] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) {
    float t = 0.f;
    for (int w = 0; w < warps; ++w) t += s[w * K + k];
    v[k] = t;
  }
}

}  // namespace ditscale::kernels::internal
