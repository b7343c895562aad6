// Device code shared by the attention kernels (decode SIMT, decode tensor-core, prefill
// prep): the q/k RMSNorm + partial RoPE every one of them applies bit for bit the same
// way (so cache rows match whichever path wrote them), packed bf16 stores, and the
// log-sum-exp merge of the decode splits.
#pragma once
#include <cfloat>
#include <cstdint>

#include "attention/attention_decode.h"
#include "common/device_common.cuh"

namespace lily::cuda {

constexpr int kAttnMergeWarps = 8;
constexpr int kAttnMaxSplits = 256;  // decode blocks per KV head at most (the merge's shared weights)

// RMSNorm over the warp's D values (DPL per lane), then partial rotate-half RoPE on the
// first rot dims: dim d pairs with d +- rot/2, which lives `rot/2/DPL` lanes away. The
// angle is fp32 pos * inv_freq (as the references compute it); it is reduced to
// [-pi, pi] in fp64 (one FMA) so the fast sine and cosine stay accurate at any position.
template <int DPL>
__device__ void norm_rope(float (&x)[DPL], const float* w, int pos, int rot, const float* inv_freq, float eps,
                          int lane) {
  constexpr int D = DPL * 32;
  float ss = 0.0f;
#pragma unroll
  for (int i = 0; i < DPL; ++i) ss += x[i] * x[i];
  const float inv = rsqrtf(warp_sum(ss) / D + eps);
#pragma unroll
  for (int i = 0; i < DPL; ++i) x[i] *= inv * w[lane * DPL + i];
  const int half = rot / 2, off = half / DPL;
#pragma unroll
  for (int i = 0; i < DPL; ++i) {
    const float other = __shfl_xor_sync(0xffffffffu, x[i], off);
    const int d = lane * DPL + i;
    if (d < rot) {
      const double ang = __fmul_rn(static_cast<float>(pos), inv_freq[d % half]);
      const double turns = rint(ang * 0.15915494309189535);
      float s, c;
      __sincosf(static_cast<float>(fma(-turns, 6.283185307179586, ang)), &s, &c);
      x[i] = d < half ? x[i] * c - other * s : x[i] * c + other * s;
    }
  }
}

// DPL bf16 values (4, 8 or 16 bytes) in one store.
template <int DPL>
__device__ __forceinline__ void store_bf16(uint16_t* p, const float (&x)[DPL]) {
  uint32_t w[DPL / 2];
#pragma unroll
  for (int i = 0; i < DPL / 2; ++i) w[i] = pack_bf16(x[2 * i], x[2 * i + 1]);
  if constexpr (DPL == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (DPL == 4) {
    *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(p) = w[0];
  }
}

// Split-K routing of one decode step over a context of L keys: splits of `chunk` keys
// (at least min_chunk, at most max_splits splits); split s covers [start, end).
struct SplitRange {
  int chunk, n_splits, start, end;
};
__device__ __forceinline__ SplitRange split_range(const AttnArgs& a, int L, int split) {
  const int chunk = max(a.min_chunk, (L + a.max_splits - 1) / a.max_splits);
  const int start = split * chunk;
  return {chunk, (L + chunk - 1) / chunk, start, min(L, start + chunk)};
}

// Merge of the decode splits (partial layout of AttnArgs), one block of kAttnMergeWarps
// warps per query head and token (blockIdx.y: the token at pos + y of a several-row step):
// weight of split s is exp(M_s - M), the output sum_s w_s acc_s / sum_s w_s l_s, times the
// gate. Reads only the live splits of this position; warps take every 8th split. pos
// (last written by the previous step) and the gate (by the QKV projection, two launches
// back) are read before the wait, through L2; after it every warp loads its first kPre
// splits' partials while warp 0 loads the splits' maxima and sums in one pass, so the
// weights cost one round trip, not three.
template <int D>
__global__ void __launch_bounds__(kAttnMergeWarps * 32) attention_merge_kernel(AttnArgs a, const int* halt) {
  constexpr int DPL = D / 32, kPre = 4, kStatsPerLane = kAttnMaxSplits / 32;
  static_assert(D <= kAttnMergeWarps * 32, "a thread per output value");
  const int hq = blockIdx.x, row = blockIdx.y, G = a.Hq / a.Hkv, g = hq / G, h = hq % G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float w_s[kAttnMaxSplits], red[kAttnMergeWarps][D], total[1];
  const int L = __ldcg(a.pos) + a.pos_offset + row + 1;
  const float* qkv = a.qkv + static_cast<size_t>(row) * attention_qkv_floats(a);
  const float gate = threadIdx.x < D ? __ldcg(qkv + static_cast<size_t>(hq) * 2 * D + D + threadIdx.x) : 0.0f;
  if (wait_halted(halt)) return;
  const int n_splits = split_range(a, L, 0).n_splits;
  if (n_splits == 1) return;  // the attention kernel wrote the output
  const size_t stride = static_cast<size_t>(G) * (D + 2);
  const float* parts = a.partial + (static_cast<size_t>(row) * a.Hkv + g) * a.max_splits * stride + h * (D + 2);
  float pre[kPre][DPL];
#pragma unroll
  for (int j = 0; j < kPre; ++j) {
    const int s = warp + kAttnMergeWarps * j;
#pragma unroll
    for (int i = 0; i < DPL; ++i) pre[j][i] = s < n_splits ? parts[s * stride + lane * DPL + i] : 0.0f;
  }
  if (warp == 0) {
    float m[kStatsPerLane], l[kStatsPerLane], M = -FLT_MAX;
#pragma unroll
    for (int i = 0; i < kStatsPerLane; ++i) {
      const int s = lane + 32 * i;
      m[i] = s < n_splits ? parts[s * stride + D] : -FLT_MAX;
      l[i] = s < n_splits ? parts[s * stride + D + 1] : 0.0f;
      M = fmaxf(M, m[i]);
    }
    M = warp_max(M);
    float S = 0.0f;
#pragma unroll
    for (int i = 0; i < kStatsPerLane; ++i) {
      const int s = lane + 32 * i;
      if (s < n_splits) {
        const float w = __expf(m[i] - M);
        w_s[s] = w;
        S += w * l[i];
      }
    }
    S = warp_sum(S);
    if (lane == 0) total[0] = S;
  }
  __syncthreads();
  timeline_mark(0);  // the splits' weights known
  float acc[DPL] = {};
#pragma unroll
  for (int j = 0; j < kPre; ++j) {
    const int s = warp + kAttnMergeWarps * j;
    if (s < n_splits) {
      const float w = w_s[s];
#pragma unroll
      for (int i = 0; i < DPL; ++i) acc[i] = fmaf(w, pre[j][i], acc[i]);
    }
  }
#pragma unroll 4
  for (int s = warp + kAttnMergeWarps * kPre; s < n_splits; s += kAttnMergeWarps) {
    const float w = w_s[s];
#pragma unroll
    for (int i = 0; i < DPL; ++i) acc[i] = fmaf(w, parts[s * stride + lane * DPL + i], acc[i]);
  }
#pragma unroll
  for (int i = 0; i < DPL; ++i) red[warp][lane * DPL + i] = acc[i];
  __syncthreads();
  timeline_mark(1);  // every warp's weighted sum in
  timeline_done();
  if (threadIdx.x < D) {
    float y = 0.0f;
    for (int w = 0; w < kAttnMergeWarps; ++w) y += red[w][threadIdx.x];
    a.out[(static_cast<size_t>(row) * a.Hq + hq) * D + threadIdx.x] = y / total[0] * sigmoidf_(gate);
  }
}

}  // namespace lily::cuda
