// qmatmul_decode: y[t] = x[t] W^T on MLX affine weights (contract: src/cpp/ops/qmatmul.h),
// the row dots of qmatmul_rows.h. A threadgroup is 2 simdgroups of 4 output rows each; grid
// (ceil(N/8), T); one simd_sum a row.
#include <metal_stdlib>
using namespace metal;
#include "qmatmul/qmatmul_rows.h"

template <int BITS>
void qmv(device const float* x, device const uint* codes, device const bfloat* scales,
         device const bfloat* biases, device float* y, uint N, uint K, uint group_size, uint3 tg,
         uint simd_gid, uint simd_lid) {
  const QRows W = qrows<BITS>(codes, scales, biases, K, group_size);
  const uint row0 = (tg.x * SIMDGROUPS + simd_gid) * ROWS;
  if (row0 >= N) return;  // the whole simdgroup returns: none of its lanes reaches a simd_sum
  x += size_t(tg.y) * K;
  y += size_t(tg.y) * N;

  float acc[ROWS] = {};
  add_rows<BITS>(W, x, N, row0, simd_lid, 1.0f, acc);
  for (uint r = 0; r < ROWS; ++r) {
    const float sum = simd_sum(acc[r]);
    if (simd_lid == 0 && row0 + r < N) y[row0 + r] = sum;
  }
}

kernel void qmatmul_decode_4bit(device const float* x [[buffer(0)]],
                                device const uint* codes [[buffer(1)]],
                                device const bfloat* scales [[buffer(2)]],
                                device const bfloat* biases [[buffer(3)]],
                                device float* y [[buffer(4)]],
                                constant uint& N [[buffer(5)]],
                                constant uint& K [[buffer(6)]],
                                constant uint& group_size [[buffer(7)]],
                                uint3 tg [[threadgroup_position_in_grid]],
                                uint simd_gid [[simdgroup_index_in_threadgroup]],
                                uint simd_lid [[thread_index_in_simdgroup]]) {
  qmv<4>(x, codes, scales, biases, y, N, K, group_size, tg, simd_gid, simd_lid);
}

kernel void qmatmul_decode_8bit(device const float* x [[buffer(0)]],
                                device const uint* codes [[buffer(1)]],
                                device const bfloat* scales [[buffer(2)]],
                                device const bfloat* biases [[buffer(3)]],
                                device float* y [[buffer(4)]],
                                constant uint& N [[buffer(5)]],
                                constant uint& K [[buffer(6)]],
                                constant uint& group_size [[buffer(7)]],
                                uint3 tg [[threadgroup_position_in_grid]],
                                uint simd_gid [[simdgroup_index_in_threadgroup]],
                                uint simd_lid [[thread_index_in_simdgroup]]) {
  qmv<8>(x, codes, scales, biases, y, N, K, group_size, tg, simd_gid, simd_lid);
}
