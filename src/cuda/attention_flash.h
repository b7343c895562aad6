// What the two flash-attention kernels of attention_prefill (step 2) share: the block
// shape, the launch parameters, the causal key range of a block and its split over key
// tiles, and the split partial-result format the merge launch reads.
//   attention_prefill.cu:       mma.sync m16n8k16 kernel (D = 64, 128, 256) and the merge;
//   attention_flash_wgmma.cu:   Hopper wgmma kernel (D = 256), LILY_PREFILL_ATTN=wgmma.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

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

// The wgmma kernel's head dims (it keeps a 64 x D fp32 O per warpgroup in registers).
inline bool flash_wgmma_supports(int D) { return D == 256; }

// Flash step on Hopper warpgroup MMA (attention_flash_wgmma.cu): same grid, outputs and
// partial results as the mma.sync kernel; the caller launches the merge when p.splits > 1.
void launch_flash_wgmma(const FlashParams& p, int D, cudaStream_t stream);

}  // namespace lily::cuda
