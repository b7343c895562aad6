// rmsnorm, gated_rmsnorm and l2norm (contracts: src/cpp/ops/norm.h), one threadgroup per row of dim
// values, fp32 throughout. Threads stride over the row (a simdgroup reads 32 consecutive
// floats a step), sum x^2, and reduce with simd_sum then across simdgroups through
// threadgroup memory: partial[s] holds simdgroup s's sum, and every simdgroup folds the
// partials itself, so one barrier suffices and no thread waits for a broadcast.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint SIMD = 32;  // lanes of a simdgroup; 1024 threads make 32 simdgroups

// rsqrt(sum(x^2) / divisor + eps) of the row (divisor dim: 1 / RMS; 1: 1 / L2 norm), the same
// on every thread of the group.
inline float inv_norm(device const float* x, uint dim, float divisor, float eps, threadgroup float* partial, uint tid,
                      uint tpg, uint simd_gid, uint simd_lid) {
  float ss = 0.0f;
  for (uint i = tid; i < dim; i += tpg) {
    const float v = x[i];
    ss += v * v;
  }
  ss = simd_sum(ss);
  if (simd_lid == 0) partial[simd_gid] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint n_simd = (tpg + SIMD - 1) / SIMD;
  const float total = simd_sum(simd_lid < n_simd ? partial[simd_lid] : 0.0f);
  return rsqrt(total / divisor + eps);
}

// y[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w; grid: rows threadgroups.
kernel void rmsnorm(device const float* x [[buffer(0)]],
                    device const float* w [[buffer(1)]],
                    device float* y [[buffer(2)]],
                    constant uint& dim [[buffer(3)]],
                    constant float& eps [[buffer(4)]],
                    uint row [[threadgroup_position_in_grid]],
                    uint tid [[thread_position_in_threadgroup]],
                    uint tpg [[threads_per_threadgroup]],
                    uint simd_gid [[simdgroup_index_in_threadgroup]],
                    uint simd_lid [[thread_index_in_simdgroup]]) {
  threadgroup float partial[SIMD];
  x += size_t(row) * dim;
  y += size_t(row) * dim;
  const float r = inv_norm(x, dim, float(dim), eps, partial, tid, tpg, simd_gid, simd_lid);
  for (uint i = tid; i < dim; i += tpg) y[i] = x[i] * r * w[i];
}

// y[row] = rmsnorm(x[row]) * w * silu(z[row]), silu(z) = z / (1 + exp(-z)): the Gated
// DeltaNet output norm, a row being one value head's Dv.
kernel void gated_rmsnorm(device const float* x [[buffer(0)]],
                          device const float* z [[buffer(1)]],
                          device const float* w [[buffer(2)]],
                          device float* y [[buffer(3)]],
                          constant uint& dim [[buffer(4)]],
                          constant float& eps [[buffer(5)]],
                          uint row [[threadgroup_position_in_grid]],
                          uint tid [[thread_position_in_threadgroup]],
                          uint tpg [[threads_per_threadgroup]],
                          uint simd_gid [[simdgroup_index_in_threadgroup]],
                          uint simd_lid [[thread_index_in_simdgroup]]) {
  threadgroup float partial[SIMD];
  x += size_t(row) * dim;
  z += size_t(row) * dim;
  y += size_t(row) * dim;
  const float r = inv_norm(x, dim, float(dim), eps, partial, tid, tpg, simd_gid, simd_lid);
  for (uint i = tid; i < dim; i += tpg) {
    const float g = z[i];
    y[i] = x[i] * r * w[i] * (g / (1.0f + exp(-g)));
  }
}

// y[row] = x[row] * rsqrt(sum(x[row]^2) + eps) * scale (the Gated DeltaNet's q and k, a row a
// head); y may be x: every read of the row is done before the barrier's last use.
kernel void l2norm(device const float* x [[buffer(0)]],
                   device float* y [[buffer(1)]],
                   constant uint& dim [[buffer(2)]],
                   constant float2& eps_scale [[buffer(3)]],
                   uint row [[threadgroup_position_in_grid]],
                   uint tid [[thread_position_in_threadgroup]],
                   uint tpg [[threads_per_threadgroup]],
                   uint simd_gid [[simdgroup_index_in_threadgroup]],
                   uint simd_lid [[thread_index_in_simdgroup]]) {
  threadgroup float partial[SIMD];
  x += size_t(row) * dim;
  y += size_t(row) * dim;
  const float r = inv_norm(x, dim, 1.0f, eps_scale.x, partial, tid, tpg, simd_gid, simd_lid) * eps_scale.y;
  for (uint i = tid; i < dim; i += tpg) y[i] = x[i] * r;
}
