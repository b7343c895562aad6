// Pieces of one Gated DeltaNet decode step shared by gdn_decode and gdn_fused.
#pragma once
#include "device_common.cuh"

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

}  // namespace lily::cuda
