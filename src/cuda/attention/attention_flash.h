// What the two flash-attention kernels of attention_prefill (step 2) share: the block
// shape, the launch parameters, the causal key range of a block and its split over key
// tiles, and the split partial-result format the merge launch reads (flash_store_row).
//   attention_prefill.cu:       mma.sync m16n8k16 kernel (D = 64, 128, 256) and the merge;
//   attention_flash_wgmma.cu:   Hopper wgmma kernel (D = 256), LILY_PREFILL_ATTN=wgmma.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#ifdef __CUDACC__  // the device part; host code (prefill_step.cpp) reads the limits only
#include "common/async_copy.cuh"
#include "common/device_common.cuh"
#endif

namespace lily::cuda {

constexpr int kFlashRows = 128;  // query rows per block: row r = (token r / G, head r % G)
constexpr int kFlashKeys = 64;   // keys per tile
constexpr float kFlashLog2e = 1.4426950408889634f;

struct FlashParams {
  const uint16_t* q;   // bf16 [T][Hq][D], pre-scaled by 1/sqrt(D)
  const uint16_t* k;   // bf16 [ctx][Hkv][D]
  const uint16_t* v;
  const float* proj;   // for the gate: proj[t * ldp + h * 2D + D + d]
  uint16_t* out;       // bf16 [T][Hq][D]
  float* part_o;       // [splits * blocks][kFlashRows][D] unnormalised O of each split
  float2* part_ml;     // [splits * blocks][kFlashRows] (row max of the scores, row sum of exp)
  int ldp, T, pos0, Hq, Hkv, G;
  int tpt;             // tokens per block: kFlashRows / G
  int blocks;          // query tiles x KV heads
  int splits;          // key splits per block
};

// Keys of query tile `qt` (tokens qt*tpt ..): all positions up to its last token.
__host__ __device__ inline int key_tiles(int qt, int tpt, int T, int pos0) {
  const int last = (qt + 1) * tpt < T ? (qt + 1) * tpt : T;
  return (pos0 + last + kFlashKeys - 1) / kFlashKeys;
}
// Key tiles per split: split s takes tiles [s * chunk, min((s + 1) * chunk, n_tiles)).
__host__ __device__ inline int split_chunk(int n_tiles, int splits) { return (n_tiles + splits - 1) / splits; }

#ifdef __CUDACC__
// What block (blockIdx.x, blockIdx.y) of a flash kernel computes: query tile blk / Hkv
// (tokens q0 .. q0 + tpt - 1) of KV head g, heaviest (latest) tiles first so the causal
// tail is short; key tiles kt0 .. kt1 - 1 of split blockIdx.y (empty: kt0 >= kt1, which
// the merge skips); n_keys: the cache rows its queries may see.
struct FlashBlock {
  int blk, g, q0, kt0, kt1, n_keys;
};
__device__ __forceinline__ FlashBlock flash_block(const FlashParams& p) {
  FlashBlock b;
  b.blk = p.blocks - 1 - blockIdx.x;
  const int qt = b.blk / p.Hkv, n_tiles = key_tiles(qt, p.tpt, p.T, p.pos0), chunk = split_chunk(n_tiles, p.splits);
  b.g = b.blk % p.Hkv;
  b.q0 = qt * p.tpt;
  b.kt0 = blockIdx.y * chunk;
  b.kt1 = min(n_tiles, b.kt0 + chunk);
  b.n_keys = p.pos0 + min(b.q0 + p.tpt, p.T);
  return b;
}

// Element offset in p.q of 16-byte chunk c of Q row r (token q0 + r / G, head g G + r % G);
// ok: the row is one of the block's tokens (the others are loaded as zeros: finite
// scores, never stored).
__device__ __forceinline__ size_t flash_q_src(const FlashParams& p, const FlashBlock& b, int r, int c, int D, bool& ok) {
  const int tok = r / p.G, t = b.q0 + tok;
  ok = tok < p.tpt && t < p.T;
  return (static_cast<size_t>(ok ? t : 0) * p.Hq + b.g * p.G + r % p.G) * D + c * 8;
}

// The end of a flash block for its row r (token q0 + r / G, head g * G + r % G) in this
// thread: columns 8n + 2 quad + {0, 1} (n < D / 8) hold pair(n), the unnormalised O; m, l
// the row's max score and full sum of exp. One split: out = O / l * sigmoid(gate) in bf16;
// several: O and (m, l) as the split's partial result for the merge. Rows past the chunk
// are skipped.
template <int D, typename Pair>
__device__ __forceinline__ void flash_store_row(const FlashParams& p, const FlashBlock& b, int r, int quad, float m,
                                                float l, Pair pair) {
  const int blk = b.blk, tok = r / p.G, t = b.q0 + tok, h = b.g * p.G + r % p.G;
  if (tok >= p.tpt || t >= p.T) return;
  if (p.splits > 1) {
    const size_t prow = (static_cast<size_t>(blockIdx.y) * p.blocks + blk) * kFlashRows + r;
    float* dst = p.part_o + prow * D + 2 * quad;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) *reinterpret_cast<float2*>(dst + 8 * n) = pair(n);
    if (quad == 0) p.part_ml[prow] = make_float2(m, l);
  } else {
    const float inv = 1.0f / l;
    const float* gate = p.proj + static_cast<size_t>(t) * p.ldp + static_cast<size_t>(h) * 2 * D + D + 2 * quad;
    uint16_t* dst = p.out + (static_cast<size_t>(t) * p.Hq + h) * D + 2 * quad;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float2 gv = *reinterpret_cast<const float2*>(gate + 8 * n), o = pair(n);
      *reinterpret_cast<uint32_t*>(dst + 8 * n) = pack_bf16(o.x * inv * sigmoidf_(gv.x), o.y * inv * sigmoidf_(gv.y));
    }
  }
}
#endif

// The wgmma kernel's head dims (it keeps a 64 x D fp32 O per warpgroup in registers).
inline bool flash_wgmma_supports(int D) { return D == 256; }


}  // namespace lily::cuda
