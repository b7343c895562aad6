// 4-bit prefill GEMM on tensor cores: Y = X · Wᵀ for many rows at once.
//
// X: bf16 [M, K] (prompt tokens, or MoE rows gathered from the tokens); W: a tiled 4-bit
// group-64 matrix (QMat::tiled, see qmatmul_decode_mma.cuh) of N = W.rows output features, K = W.cols.
// W is dequantised tile by tile in registers (bf16 128 + q, exact) and never written out;
// per group g of 64 columns, with C_g = (128 + q) · X_gᵀ and xsum_g = Σ X_g (fp32):
//   y[r][t] += s[r][g] * C_g[r][t] + (b[r][g] - 128 s[r][g]) * xsum_g[t]
//
// With weights_bf16 the kernel of qmatmul_prefill_bf16w.cu instead dequantises each weight to bf16
// the way MLX's GPU kernels do, w = bf16(s q + b) (one rounding per weight), and
// accumulates X · wᵀ over all of K in fp32: no per-group fold or row sums and larger warp
// tiles (fewer instructions per mma); its results differ from the exact route's by that
// rounding (max ~1e-2 of the output RMS), its accumulation error is the same (~1e-5).
// With wgmma as well (sm_90a; needs weights_bf16) the kernel of qmatmul_prefill_wgmma.cu computes
// the same weights_bf16 maths on Hopper warpgroup MMA (wgmma.mma_async): blocks of 128
// rows x 256 features (tile_m 128) or 64 x 128 (tile_m 16, 32, 64; smaller grouped tiles
// run as m64 with their rows clipped).
//
// Dense mode (tiles == nullptr): GEMM rows 0 .. M-1, features 0 .. W.rows-1.
// Grouped mode (MoE): W stacks experts of expert_rows rows each; block y of the launch
// computes tiles[y] = {expert, row0, rows, 0}: GEMM rows row0 .. row0+rows-1 (rows <= the
// tile size) against expert `expert`'s expert_rows features. Blocks with y >= *n_tiles
// do nothing, so the tile list can be built on the device for a host bound max_tiles.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/kernel_types.h"

namespace lily::cuda {

enum class GemmEpilogue : int {
  Store,   // y[out][f] = acc (* y_scale[out])                                   fp32
  Add,     // y[out][f] += acc  (each element by one thread: deterministic)      fp32
  SwiGlu,  // act[out][i] = bf16(silu(gate_i) * up_i), W packed with gate/up interleave I
};

// GEMM row r reads x row x_rows ? x_rows[r] : r and writes output row
// out = y_rows ? y_rows[r] : r. Features f (Store/Add) run over W.rows (dense) or
// expert_rows (grouped); SwiGlu outputs i over swiglu_inter, where W.rows (dense) or
// expert_rows (grouped) must be 2 * swiglu_inter and W was packed with interleave
// swiglu_inter (pack_tiles), so row block b yields outputs 8b .. 8b+7.
struct GemmArgs {
  QMat W;                         // tiled 4-bit group-64
  const uint16_t* x = nullptr;    // bf16 activations, row stride ldx elements (16-byte aligned, ldx % 8 == 0)
  int ldx = 0;
  int M = 0;                      // GEMM rows (dense: tokens; grouped: total routed rows, bounds every tile)
  const int* x_rows = nullptr;    // optional gather of input rows [M]
  GemmEpilogue epi = GemmEpilogue::Store;
  float* y = nullptr;             // Store / Add
  uint16_t* act = nullptr;        // SwiGlu (bf16)
  int ldy = 0;                    // row stride of y or act, elements
  const int* y_rows = nullptr;    // optional scatter of output rows [M]
  const float* y_scale = nullptr; // optional, Store only: y *= y_scale[out_row] (MoE routing weight)
  int swiglu_inter = 0;           // SwiGlu: I (outputs per expert)
  const int4* tiles = nullptr;    // grouped mode: [max_tiles] {expert, row0, rows, 0}
  const int* n_tiles = nullptr;   // grouped mode: number of valid tiles (device)
  int max_tiles = 0;              // grouped mode: grid bound (blocks per feature block)
  int expert_rows = 0;            // grouped mode: rows per expert in W (multiple of 16)
  bool weights_bf16 = false;      // bf16-rounded weights, one fp32 sum over K (see above)
  bool wgmma = false;             // weights_bf16 on warpgroup MMA (sm_90a, see above)
};

// One launch; grid = (ceil(features / 128) (weights_bf16: / 256), dense ? ceil(M / tile_m) : max_tiles);
// wgmma: (ceil(features / 256), ceil(M / 128)) for tile_m 128, else (ceil(features / 128), ceil(M / 64)),
// grouped max_tiles.
// tile_m (rows per block) in {16, 32, 64, 128}; grouped mode: the tile size the list was
// built for (a tile's rows are clipped to tile_m and to M - row0, never past them).
// Limits (checked, fail("qmatmul_prefill: ...")): K % 64 == 0; x 16-byte aligned, ldx % 8 == 0;
// ceil(M / tile_m) resp. max_tiles <= 65535; ceil(W.rows / 16) * K / 64 * 32 < 2^31.
// M == 0 or max_tiles == 0 launches nothing.
void qmatmul_prefill(const GemmArgs& a, int tile_m, cudaStream_t stream);

}  // namespace lily::cuda
