// The separate dequantisation pass of the prefill GEMM ablation: a tiled 4-bit group-64
// matrix (QMat::tiled, qmatmul_decode_mma.cuh) expanded to a row-major bf16 copy W16 [rows][ldw] for a
// bf16 GEMM. w = bf16(s q + b) by weights_bf16x2 (qmatmul_prefill_core.cuh): the instructions of
// qmatmul_prefill's bf16-weight kernel, so the same weights bit for bit. Memory-bound: per weight
// 0.5 byte of code and 1/16 byte of scale|bias read, 2 bytes written.
//
// One warp per 16 x 64 tile (row block rb, group g), kTilesPerWarp consecutive tiles with
// all their loads issued first. Lane L = 4 gid + t loads its 16 code bytes (the tile is
// one coalesced 512-byte load) and dequantises its 32 weights, rows gid and gid + 8 by
// columns 16 j + 2t + {0, 1, 8, 9}, into a shared [16][64] bf16 tile; then it stores row
// 4 s + L / 8, 16-byte chunk L % 8 for s = 0..3: four whole 128-byte row segments per
// store instruction.
#include <string>

#include "dequant_pass.h"
#include "common/device_common.cuh"
#include "qmatmul/qmatmul_prefill_core.cuh"

namespace lily::bench {
namespace {

using namespace lily::cuda;

constexpr int kWarps = 8, kThreads = 32 * kWarps, kTilesPerWarp = 2;
// Words per shared tile row: 32 for the 64 bf16 + 4 of padding, so a row step moves 4
// banks and both the lanes' word writes (rows gid, words 8j + t) and each 8-lane phase of
// the 16-byte reads (one row, chunks 0..7) fall in 32 different banks.
constexpr int kRowWords = 36;

__global__ void __launch_bounds__(kThreads) dequant_bf16_kernel(QMat W, uint16_t* __restrict__ w16, int ldw) {
  __shared__ __align__(16) uint32_t stage[kWarps][16][kRowWords];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, t = lane & 3;
  const int G = W.cols / 64, n_tiles = (W.rows + 15) / 16 * G;
  const int tile0 = (static_cast<int>(blockIdx.x) * kWarps + warp) * kTilesPerWarp;

  pdl_wait();  // the previous kernel may still read w16
  uint4 codes[kTilesPerWarp];
  uint32_t sb[kTilesPerWarp][2];  // scale|bias of rows gid, gid + 8
#pragma unroll
  for (int i = 0; i < kTilesPerWarp; ++i) {
    if (tile0 + i >= n_tiles) break;
    const size_t tile = static_cast<size_t>(tile0 + i);
    codes[i] = load_stream(W.codes + tile * 32 + lane);
    sb[i][0] = __ldg(W.sb + tile * 16 + gid);
    sb[i][1] = __ldg(W.sb + tile * 16 + gid + 8);
  }
  pdl_trigger();

  uint32_t(*tile_s)[kRowWords] = stage[warp];
#pragma unroll
  for (int i = 0; i < kTilesPerWarp; ++i) {
    const int tile = tile0 + i;
    if (tile >= n_tiles) break;  // warp-uniform
    const int rb = tile / G, g = tile % G;
    uint32_t s2[2], b2[2];  // bf16 scale / bias of rows gid, gid + 8, each doubled into a bf16x2
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      s2[h] = __byte_perm(sb[i][h], 0, 0x1010);
      b2[h] = __byte_perm(sb[i][h], 0, 0x3232);
    }
    // A register r of k-step j: row gid + 8 (r & 1), columns 16 j + 2t + 8 (r >> 1) + {0, 1}.
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = kstep_word(codes[i], j);
#pragma unroll
      for (int r = 0; r < 4; ++r)
        tile_s[gid + 8 * (r & 1)][8 * j + t + 4 * (r >> 1)] = weights_bf16x2(word, r, s2[r & 1], b2[r & 1]);
    }
    __syncwarp();
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int r = 4 * s + (lane >> 3), c = lane & 7, row = 16 * rb + r;
      if (row < W.rows)
        *reinterpret_cast<uint4*>(w16 + static_cast<size_t>(row) * ldw + 64 * g + 8 * c) =
            *reinterpret_cast<const uint4*>(&tile_s[r][4 * c]);
    }
    __syncwarp();  // the next tile overwrites tile_s
  }
}

}  // namespace

void dequant_bf16(const QMat& W, uint16_t* w16, int ldw, cudaStream_t stream) {
  if (!W.tiled || W.bits != 4) fail("dequant_bf16: W must be a tiled 4-bit matrix (QMat::tiled)");
  if (W.rows <= 0 || W.cols <= 0 || W.cols % 64 != 0)
    fail("dequant_bf16: W is ", std::to_string(W.rows), "x", std::to_string(W.cols),
         "; rows must be positive and cols a positive multiple of 64");
  if (ldw < W.cols || ldw % 8 != 0 || reinterpret_cast<uintptr_t>(w16) % 16 != 0)
    fail("dequant_bf16: w16 must be 16-byte aligned with a row stride ldw (", std::to_string(ldw),
         ") >= cols (", std::to_string(W.cols), ") and a multiple of 8");
  constexpr int kTilesPerBlock = kWarps * kTilesPerWarp;
  const long long n_tiles = (W.rows + 15LL) / 16 * (W.cols / 64);
  if (n_tiles + kTilesPerBlock > (1LL << 31) - 1) fail("dequant_bf16: ", std::to_string(n_tiles), " tiles overflow int");
  const auto blocks = static_cast<unsigned>((n_tiles + kTilesPerBlock - 1) / kTilesPerBlock);
  launch("dequant_bf16", dequant_bf16_kernel, dim3(blocks), dim3(kThreads), 0, stream, W, w16, ldw);
}

}  // namespace lily::bench
