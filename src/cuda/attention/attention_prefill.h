// Gated GQA full attention over a chunk of T prompt tokens (prefill), on tensor cores.
// Token t sits at position pos0 + t and attends to keys 0 .. pos0 + t of the cache.
//   1. prep (one warp per token and head, the maths of attention_decode's norm_rope):
//      q = RoPE(RMSNorm(q) * q_norm) / sqrt(D) -> bf16 scratch [T][Hq][D];
//      k = RoPE(RMSNorm(k) * k_norm) -> k_cache[pos0 + t], v -> v_cache[pos0 + t] (bf16),
//      bit for bit what T decode steps write, so decode continues after prefill.
//   2. flash attention (mma.sync bf16, fp32 online softmax): a block takes 128 query rows
//      = (token, head) pairs of one KV head (128/G tokens x its G heads), so every K/V tile
//      in shared memory serves all G heads; out = softmax(q K^T) V * sigmoid(gate).
//   3. when the blocks are fewer than the SMs (few tokens, long cache), each block's key
//      tiles are split over several blocks and a merge launch combines them by log-sum-exp.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "options.h"

namespace lily::cuda {

struct AttnPrefillArgs {
  const float* proj = nullptr;      // [T][ldp]: per token [Hq * 2D (per head: D query, D gate) | Hkv*D k | Hkv*D v]
  int ldp = 0;                      // row stride of proj in floats (a multiple of 4)
  const float* q_norm = nullptr;    // [D] RMSNorm weights (+1 already applied)
  const float* k_norm = nullptr;    // [D]
  const float* inv_freq = nullptr;  // [rot_dim / 2] RoPE inverse frequencies (rope_inv_freq)
  uint16_t* k_cache = nullptr;      // bf16 [ctx][Hkv][D]; rows pos0 .. pos0+T-1 are written
  uint16_t* v_cache = nullptr;      // bf16 [ctx][Hkv][D]
  uint16_t* out = nullptr;          // bf16 [T][Hq * D]: the input rows of o_proj
  void* scratch = nullptr;          // attention_prefill_scratch_bytes(T, Hq, D) bytes, 256-byte aligned
  size_t scratch_bytes = 0;
  int T = 0, pos0 = 0, ctx = 0;
  int Hq = 0, Hkv = 0, D = 0, rot_dim = 0;
  float eps = 1e-6f;
  // The flash kernel: by head dim (wgmma where it has one, D = 256), or mma.sync (every head
  // dim), or wgmma (another head dim is refused, not run on mma.sync).
  AttnRoute route = AttnRoute::ByHeadDim;
};

// All launches of one layer's prefill attention (prep, flash attention, merge if split).
// Needs D in {64, 128, 256}, G = Hq/Hkv <= 16, pos0 + T <= ctx.
void attention_prefill(const AttnPrefillArgs& a, cudaStream_t stream);

// Scratch for a chunk of T tokens on the current device: the bf16 queries [T][Hq][D]
// (at the start), then room for the split partial results. Grows with T only.
size_t attention_prefill_scratch_bytes(int T, int Hq, int D);


}  // namespace lily::cuda
