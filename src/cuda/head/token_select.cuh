// Device helpers of the token-choosing kernels: penalties, random numbers, the
// (key, index) argmax order, and what happens once a token is chosen.
#pragma once
#include <cfloat>

#include "common/decode_ctl.h"
#include "common/device_common.cuh"

namespace lily::cuda {

// Repetition (HF: divide positive, multiply negative logits of seen tokens), then
// presence/frequency (OpenAI: subtract per generated occurrence).
__device__ __forceinline__ float penalized(float l, int i, const DecodeCtl& c, const int* counts,
                                           const unsigned char* seen) {
  if (!c.penalties) return l;
  if (c.repetition != 1.0f && seen[i]) l = l > 0.0f ? l / c.repetition : l * c.repetition;
  const int n = counts[i];
  if (n > 0) l -= c.presence + c.frequency * static_cast<float>(n);
  return l;
}

__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1) from (seed, step, index).
__device__ __forceinline__ float uniform01(unsigned long long seed, int step, int index) {
  const unsigned long long h =
      mix64(mix64(seed + 0x9e3779b97f4a7c15ull * (static_cast<unsigned long long>(step) + 1)) ^ static_cast<unsigned>(index));
  return (static_cast<float>(h >> 40) + 0.5f) * 0x1p-24f;
}

__device__ __forceinline__ bool better(float v, int i, float ov, int oi) { return v > ov || (v == ov && i < oi); }

__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (better(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

// Best (key, index) over the block; red_v/red_i hold 32 entries. All threads get it.
__device__ __forceinline__ void block_best(float& v, int& i, float* red_v, int* red_i) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  warp_best(v, i);
  __syncthreads();
  if (lane == 0) { red_v[warp] = v; red_i[warp] = i; }
  __syncthreads();
  v = lane < nw ? red_v[lane] : -FLT_MAX;
  i = lane < nw ? red_i[lane] : 0x7fffffff;
  warp_best(v, i);
}

// Records a chosen token (one thread): the next step's input slot, the host's pinned
// copy, penalty counts, and the stop rules (stop id, max_tokens, context limit).
__device__ inline void emit_token(int tok, const TokenSink& s) {
  DecodeCtl& c = *s.ctl;
  *s.slot = tok;
  *s.host = tok;
  const int n = ++c.n_generated;
  if (c.penalties) {
    s.counts[tok] += 1;
    s.seen[tok] = 1;
  }
  bool stop = n >= c.max_tokens || *s.pos + 1 >= c.max_context;
  for (int j = 0; j < c.n_stop; ++j) stop |= c.stop_ids[j] == tok;
  if (stop) c.halt = 1;
  __threadfence_system();
}

}  // namespace lily::cuda
