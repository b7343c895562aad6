#include "qmatmul/qmatmul_tiles.h"

#include "common/device_common.cuh"

namespace lily::cuda {
namespace {

// Source row of tiled row r (-1: padding).
__device__ __forceinline__ int source_row(int r, int rows, int I) {
  if (r >= rows) return -1;
  if (I == 0) return r;
  const int e = r / (2 * I), w = r % (2 * I), b = w / 16, within = w % 16;
  return e * 2 * I + (within < 8 ? 8 * b + within : I + 8 * b + within - 8);
}

__device__ __forceinline__ uint32_t nibble(const uint32_t* codes, int row, int words, int c) {
  return row < 0 ? 0u : (codes[static_cast<size_t>(row) * words + c / 8] >> (4 * (c % 8))) & 0xFu;
}

// One thread per (row block, group, lane) output vector.
__global__ void pack_kernel(const uint32_t* codes, const uint32_t* sb, int rows, int cols, int I, uint4* out_codes,
                            uint32_t* out_sb) {
  const int G = cols / 64, n_rb = (rows + 15) / 16, words = cols / 8;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<size_t>(n_rb) * G * 32) return;
  const int lane = i % 32, g = (i / 32) % G, rb = static_cast<int>(i / 32 / G);
  const int gid = lane / 4, t = lane % 4;
  const int r0 = source_row(16 * rb + gid, rows, I), r1 = source_row(16 * rb + gid + 8, rows, I);
  uint32_t w[4];
  for (int j = 0; j < 4; ++j) {
    const int k = 64 * g + 16 * j + 2 * t;
    const uint32_t n[8] = {nibble(codes, r0, words, k),     nibble(codes, r1, words, k),
                           nibble(codes, r0, words, k + 8), nibble(codes, r1, words, k + 8),
                           nibble(codes, r0, words, k + 1), nibble(codes, r1, words, k + 1),
                           nibble(codes, r0, words, k + 9), nibble(codes, r1, words, k + 9)};
    w[j] = 0;
    for (int m = 0; m < 8; ++m) w[j] |= n[m] << (4 * m);
  }
  out_codes[i] = make_uint4(w[0], w[1], w[2], w[3]);
  if (lane < 16) {
    const int r = source_row(16 * rb + lane, rows, I);
    out_sb[(static_cast<size_t>(rb) * G + g) * 16 + lane] = r < 0 ? 0u : sb[static_cast<size_t>(r) * G + g];
  }
}

}  // namespace

void pack_tiles(const uint32_t* codes, const uint32_t* sb, int rows, int cols, int interleave, uint4* out_codes,
                uint32_t* out_sb, cudaStream_t stream) {
  if (cols % 64 != 0) fail("pack_tiles: cols ", std::to_string(cols), " is not a multiple of 64");
  if (interleave && (interleave % 8 != 0 || rows % (2 * interleave) != 0))
    fail("pack_tiles: gate/up interleave needs I % 8 == 0 and rows a multiple of 2I");
  const size_t n = static_cast<size_t>((rows + 15) / 16) * (cols / 64) * 32;
  pack_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, stream>>>(codes, sb, rows, cols, interleave, out_codes,
                                                                          out_sb);
  check_launch("pack_tiles");
}

}  // namespace lily::cuda
