// The row dot products of the MLX affine GEMVs (qmatmul_decode.metal, moe/moe_experts.metal).
// W [N, K]: codes uint32 [N, K*BITS/32] (value i of a word in bits [BITS*i, BITS*(i+1))),
// bf16 scales/biases [N, K/group_size]. Lane l of a simdgroup takes words l, l+32, ... of
// its rows; the 32/BITS values of x under a word are loaded once (float4s, coalesced across
// the simdgroup) for all the rows, and per word
//   sum_i x_i (s q_i + b) = s * sum_i x_i q_i + b * sum_i x_i,
// so dequantisation is fused at one multiply-add per value; fp32 throughout. Their kernels
// give a threadgroup SIMDGROUPS simdgroups of ROWS output rows each.
#pragma once

constant constexpr uint ROWS = 4;        // output rows per simdgroup
constant constexpr uint SIMDGROUPS = 2;  // per threadgroup

struct QRows {
  device const uint* codes;
  device const bfloat* scales;
  device const bfloat* biases;
  uint words, groups, words_per_group;  // per row
};

template <int BITS>
QRows qrows(device const uint* codes, device const bfloat* scales, device const bfloat* biases, uint K, uint group_size) {
  return {codes, scales, biases, K * BITS / 32, K / group_size, group_size * BITS / 32};
}

// Matrix e of a stack of them, each [N, K].
template <int BITS>
QRows qrows_of(QRows W, uint e, uint N) {
  W.codes += size_t(e) * N * W.words;
  W.scales += size_t(e) * N * W.groups;
  W.biases += size_t(e) * N * W.groups;
  return W;
}

// The values of x under word wd, and their sum.
template <int BITS>
struct XWord {
  float v[32 / BITS];
  float sum;
};

template <int BITS>
XWord<BITS> x_word(device const float* x, uint wd) {
  XWord<BITS> w;
  w.sum = 0.0f;
  for (int i = 0; i < 32 / BITS; i += 4) {
    const float4 v = *reinterpret_cast<device const float4*>(x + wd * (32 / BITS) + i);
    w.v[i] = v.x, w.v[i + 1] = v.y, w.v[i + 2] = v.z, w.v[i + 3] = v.w;
    w.sum += (v.x + v.y) + (v.z + v.w);
  }
  return w;
}

// Word wd of row `row`: s * sum_i x_i q_i + b * sum_i x_i.
template <int BITS>
float word_term(QRows W, uint row, uint wd, thread const XWord<BITS>& xw) {
  constexpr uint MASK = (1u << BITS) - 1;
  const uint q = W.codes[size_t(row) * W.words + wd];
  float dot = 0.0f;
  for (int i = 0; i < 32 / BITS; ++i) dot += xw.v[i] * float((q >> (BITS * i)) & MASK);
  const size_t sb = size_t(row) * W.groups + wd / W.words_per_group;
  return float(W.scales[sb]) * dot + float(W.biases[sb]) * xw.sum;
}

// acc[r] += w * (row row0 + r of W [N, K]) . x, lane partial sums (the caller simd_sums them);
// rows past N recompute row N - 1, which the caller does not store.
template <int BITS>
void add_rows(QRows W, device const float* x, uint N, uint row0, uint lane, float w, thread float* acc) {
  for (uint wd = lane; wd < W.words; wd += 32) {
    const XWord<BITS> xw = x_word<BITS>(x, wd);
    for (uint r = 0; r < ROWS; ++r) acc[r] += w * word_term<BITS>(W, min(row0 + r, N - 1), wd, xw);
  }
}
