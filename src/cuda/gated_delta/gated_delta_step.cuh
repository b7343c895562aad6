// Pieces of one Gated DeltaNet decode step (gated_delta_decode.cu; the decay also in gated_delta_conv_prefill.cu).
#pragma once
#include <cooperative_groups.h>

#include "common/device_common.cuh"
#include "gated_delta/gated_delta_decode.h"

namespace lily::cuda {

// The ring of pre-conv rows by position mod kGdnRingRows: the rows of positions pos-3,
// pos-2, pos-1. They were written a step ago or earlier, so they are read through L2 and
// may be read before the PDL wait.
struct ConvRing {
  const float* ring;
  int conv_dim, r0, r1, r2;  // rows of pos-3, pos-2, pos-1
  __device__ __forceinline__ ConvRing(const float* ring_, int conv_dim_, int pos)
      : ring(ring_), conv_dim(conv_dim_), r0((pos - 3) & (kGdnRingRows - 1)), r1((pos - 2) & (kGdnRingRows - 1)),
        r2((pos - 1) & (kGdnRingRows - 1)) {}
  __device__ __forceinline__ float at(int row, int ch) const { return __ldcg(ring + row * conv_dim + ch); }
};

// SiLU of one channel's causal conv (kernel 4): taps w (x: t-3, y: t-2, z: t-1, w: t) over
// the pre-conv values a, b, c (t-3 .. t-1) and x (t); decode and prefill alike.
__device__ __forceinline__ float conv4_silu(float4 w, float a, float b, float c, float x) {
  return siluf_(fmaf(w.w, x, fmaf(w.z, c, fmaf(w.y, b, w.x * a))));
}

// One causal-conv channel (kernel 4): its weights and the pre-conv values of the three
// previous positions; step(x) gives the SiLU of the conv output at x's position and
// shifts x in, so consecutive tokens of one step see what single steps would.
struct ConvWindow {
  float4 w = {};
  float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f;  // positions -3, -2, -1

  __device__ __forceinline__ static ConvWindow load(const float* conv_w, const ConvRing& ring, int ch) {
    ConvWindow c;
    c.w = reinterpret_cast<const float4*>(conv_w)[ch];
    c.p0 = ring.at(ring.r0, ch);
    c.p1 = ring.at(ring.r1, ch);
    c.p2 = ring.at(ring.r2, ch);
    return c;
  }
  __device__ __forceinline__ float step(float x) {
    const float y = conv4_silu(w, p0, p1, p2, x);
    p0 = p1;
    p1 = p2;
    p2 = x;
    return y;
  }
};

// decay = exp(-exp(A_log) * softplus(a + dt_bias)), given neg_A = -exp(A_log).
__device__ __forceinline__ float gated_delta_decay(float a, float dt_bias, float neg_A) {
  const float x = a + dt_bias;
  const float softplus = x > 20.0f ? x : log1pf(__expf(x));
  return __expf(neg_A * softplus);
}

// The delta rule on one value column v held by 4 adjacent threads (a quad), this one
// with the keys k = 4i + lane_k (i < nk) of the column's state s (registers):
//   q' = q / (|q| sqrt(Dk)), k' = k / |k|   (sq, sk: the block sums of q^2, k^2)
//   S = decay S;  S += k' (beta (v - S^T k'))^T;  returns o = S^T q' (on all 4 threads).
// qs, ks: q and k in shared memory; v is ignored where !active.
template <int N>
__device__ __forceinline__ float delta_rule(float (&s)[N], int nk, int lane_k, const float* qs, const float* ks, float sq,
                                            float sk, int Dk, float decay, float beta, float v, bool active) {
  const float qscale = rsqrtf(sq + 1e-6f) * rsqrtf(static_cast<float>(Dk));
  const float kscale = rsqrtf(sk + 1e-6f);
  float kv = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < nk) {
      s[i] *= decay;
      kv = fmaf(s[i], ks[4 * i + lane_k] * kscale, kv);
    }
  kv = quad_sum(kv);
  const float delta = active ? (v - kv) * beta : 0.0f;
  float o = 0.0f;
#pragma unroll
  for (int i = 0; i < N; ++i)
    if (i < nk) {
      s[i] = fmaf(ks[4 * i + lane_k] * kscale, delta, s[i]);
      o = fmaf(s[i], qs[4 * i + lane_k] * qscale, o);
    }
  return quad_sum(o);
}

// 1 / RMS of a value head's Dv outputs split over the kGdnSplit blocks of its cluster, for
// T tokens: each block's sums of o^2 (part) go into every block's head_ss[t][split]
// through distributed shared memory; after the cluster barrier all add them in split order
// (the same total everywhere). Every block must have started (cluster_wait) before the call.
template <int T>
__device__ __forceinline__ void head_inv_rms(const float (&part)[T], float (*head_ss)[kGdnSplit], int split, int Dv,
                                             float eps, float (&inv)[T]) {
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (threadIdx.x < kGdnSplit) {
    float (*dst)[kGdnSplit] = cluster.map_shared_rank(head_ss, static_cast<int>(threadIdx.x));
#pragma unroll
    for (int t = 0; t < T; ++t) dst[t][split] = part[t];
  }
  cluster.sync();
#pragma unroll
  for (int t = 0; t < T; ++t) {
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < kGdnSplit; ++i) ss += head_ss[t][i];
    inv[t] = rsqrtf(ss / Dv + eps);
  }
}

}  // namespace lily::cuda
