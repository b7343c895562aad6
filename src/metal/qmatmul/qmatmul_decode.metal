// qmatmul_decode: y[t] = x[t] W^T on MLX affine weights (contract: src/cpp/ops/qmatmul.h),
// W[n, k] = scale[n, g] * q[n, k] + bias[n, g], g = k / group_size; codes uint32 [N, K*BITS/32]
// (value i of a word in bits [BITS*i, BITS*(i+1))), scales/biases bf16 [N, K/group_size].
// A threadgroup is 2 simdgroups of 4 output rows each; grid (ceil(N/8), T). Lane l takes
// words l, l+32, ... of its rows: the 32/BITS values of x under a word are loaded once (as
// float4s, coalesced across the simdgroup) for all 4 rows, and per word
//   sum_i x_i (s q_i + b) = s * sum_i x_i q_i + b * sum_i x_i,
// so dequantisation is fused at one multiply-add per value. fp32 throughout; one simd_sum a row.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint ROWS = 4;        // output rows per simdgroup
constant constexpr uint SIMDGROUPS = 2;  // per threadgroup

template <int BITS>
void qmv(device const float* x, device const uint* codes, device const bfloat* scales,
         device const bfloat* biases, device float* y, uint N, uint K, uint group_size, uint3 tg,
         uint simd_gid, uint simd_lid) {
  constexpr int PACK = 32 / BITS;  // values per word: 8 or 4, one or two float4s of x
  constexpr uint MASK = (1u << BITS) - 1;
  const uint words = K / PACK, groups = K / group_size, words_per_group = group_size / PACK;
  const uint row0 = (tg.x * SIMDGROUPS + simd_gid) * ROWS;
  if (row0 >= N) return;  // the whole simdgroup returns: none of its lanes reaches a simd_sum
  x += size_t(tg.y) * K;
  y += size_t(tg.y) * N;

  float acc[ROWS] = {};
  for (uint wd = simd_lid; wd < words; wd += 32) {
    float xv[PACK];
    float xsum = 0.0f;
    for (int i = 0; i < PACK; i += 4) {
      const float4 v = *reinterpret_cast<device const float4*>(x + wd * PACK + i);
      xv[i] = v.x, xv[i + 1] = v.y, xv[i + 2] = v.z, xv[i + 3] = v.w;
      xsum += (v.x + v.y) + (v.z + v.w);
    }
    const uint g = wd / words_per_group;
    for (uint r = 0; r < ROWS; ++r) {
      const uint row = min(row0 + r, N - 1);  // rows past N recompute row N-1, never stored
      const uint q = codes[size_t(row) * words + wd];
      float dot = 0.0f;
      for (int i = 0; i < PACK; ++i) dot += xv[i] * float((q >> (BITS * i)) & MASK);
      const size_t sb = size_t(row) * groups + g;
      acc[r] += float(scales[sb]) * dot + float(biases[sb]) * xsum;
    }
  }
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
