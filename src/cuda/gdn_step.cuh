// Pieces of one Gated DeltaNet decode step (gdn_decode.cu; the decay also in gdn_conv_prefill.cu).
#pragma once
#include <cooperative_groups.h>

#include "device_common.cuh"
#include "gdn_decode.h"

namespace lily::cuda {

// The ring of pre-conv rows by position mod 4: the rows of positions pos-3, pos-2, pos-1.
// They were written a step ago or earlier, so they are read through L2 and may be read
// before the PDL wait.
struct ConvRing {
  const float* ring;
  int conv_dim, r0, r1, r2;  // rows of pos-3, pos-2, pos-1
  __device__ __forceinline__ ConvRing(const float* ring_, int conv_dim_, int pos)
      : ring(ring_), conv_dim(conv_dim_), r0((pos + 1) & 3), r1((pos + 2) & 3), r2((pos + 3) & 3) {}
  __device__ __forceinline__ float at(int row, int ch) const { return __ldcg(ring + row * conv_dim + ch); }
};

// One causal-conv channel (kernel 4): its weights and its taps of the three previous positions.
struct ConvTap {
  float4 w = {};
  float past = 0.0f;  // w.x ring[pos-3] + w.y ring[pos-2] + w.z ring[pos-1]

  __device__ __forceinline__ static ConvTap load(const float* conv_w, const ConvRing& ring, int ch) {
    ConvTap c;
    c.w = reinterpret_cast<const float4*>(conv_w)[ch];
    c.past = c.w.x * ring.at(ring.r0, ch) + c.w.y * ring.at(ring.r1, ch) + c.w.z * ring.at(ring.r2, ch);
    return c;
  }
  // SiLU of the conv output, x the channel's current pre-conv value.
  __device__ __forceinline__ float apply(float x) const { return siluf_(past + w.w * x); }
};

// decay = exp(-exp(A_log) * softplus(a + dt_bias)), given neg_A = -exp(A_log).
__device__ __forceinline__ float gdn_decay(float a, float dt_bias, float neg_A) {
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

// 1 / RMS of a value head's Dv outputs split over the kGdnSplit blocks of its cluster:
// each block's sum of o^2 (part) goes into every block's head_ss[split] through
// distributed shared memory; after the cluster barrier all add them in split order (the
// same total everywhere). Every block must have started (cluster_wait) before the call.
__device__ __forceinline__ float head_inv_rms(float part, float* head_ss, int split, int Dv, float eps) {
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (threadIdx.x < kGdnSplit) cluster.map_shared_rank(head_ss, static_cast<int>(threadIdx.x))[split] = part;
  cluster.sync();
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < kGdnSplit; ++i) ss += head_ss[i];
  return rsqrtf(ss / Dv + eps);
}

}  // namespace lily::cuda
