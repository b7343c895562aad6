// The experts' SwiGLU MLPs of a token (contract: src/cpp/ops/moe.h), as the decode step runs
// them: slot s = t*S + j is token t's j-th expert ids[s] (S slots a token), with matrices
// stacked by expert; the row dots are qmatmul_rows.h's. A threadgroup is 2 simdgroups of 4
// output rows each.
//   moe_gate_up: act[s][i] = silu(gate_e[i] . x_t) * (up_e[i] . x_t), grid (ceil(I/8), T*S):
//                one pass over x for both matrices.
//   moe_down:    y[t] = (residual ? r[t] : 0) + sum_j w[t*S + j] down_{ids[t*S+j]} act[t*S + j]
//                (+ sigmoid(shared_logit[t]) shared_down act_shared[t] when shared),
//                grid (ceil(H/8), T): the routing weights, the gated shared expert and the
//                residual in the same pass.
#include <metal_stdlib>
using namespace metal;
#include "qmatmul/qmatmul_rows.h"

template <int BITS>
void gate_up(device const float* x, device const int* ids, QRows gate, QRows up, device float* act, uint I, uint H,
             uint S, uint3 tg, uint simd_gid, uint simd_lid) {
  const uint slot = tg.y, row0 = (tg.x * SIMDGROUPS + simd_gid) * ROWS;
  if (row0 >= I) return;  // the whole simdgroup returns: none of its lanes reaches a simd_sum
  const uint e = uint(ids[slot]);
  gate = qrows_of<BITS>(gate, e, I);
  up = qrows_of<BITS>(up, e, I);
  x += size_t(slot / S) * H;
  float g[ROWS] = {}, u[ROWS] = {};
  for (uint wd = simd_lid; wd < gate.words; wd += 32) {
    const XWord<BITS> xw = x_word<BITS>(x, wd);
    for (uint r = 0; r < ROWS; ++r) {
      const uint row = min(row0 + r, I - 1);
      g[r] += word_term<BITS>(gate, row, wd, xw);
      u[r] += word_term<BITS>(up, row, wd, xw);
    }
  }
  for (uint r = 0; r < ROWS; ++r) {
    const float gs = simd_sum(g[r]), us = simd_sum(u[r]);
    if (simd_lid == 0 && row0 + r < I) act[size_t(slot) * I + row0 + r] = gs / (1.0f + exp(-gs)) * us;
  }
}

template <int BITS>
void down(device const float* act, device const int* ids, device const float* w, QRows W, device const float* act_shared,
          QRows Ws, device const float* shared_logit, device const float* residual, device float* y, uint H, uint I,
          uint Is, uint S, uint flags, uint3 tg, uint simd_gid, uint simd_lid) {
  const uint t = tg.y, row0 = (tg.x * SIMDGROUPS + simd_gid) * ROWS;
  if (row0 >= H) return;
  float acc[ROWS] = {};
  for (uint j = 0; j < S; ++j) {
    const uint s = t * S + j;
    add_rows<BITS>(qrows_of<BITS>(W, uint(ids[s]), H), act + size_t(s) * I, H, row0, simd_lid, w[s], acc);
  }
  if (flags & 1u) add_rows<BITS>(Ws, act_shared + size_t(t) * Is, H, row0, simd_lid, 1.0f / (1.0f + exp(-shared_logit[t])), acc);
  for (uint r = 0; r < ROWS; ++r) {
    const float sum = simd_sum(acc[r]);
    const uint row = row0 + r;
    if (simd_lid == 0 && row < H) y[size_t(t) * H + row] = ((flags & 2u) ? residual[size_t(t) * H + row] : 0.0f) + sum;
  }
}

// bits (4 or 8) is uniform: one kernel an op for both widths. dims: I, H, group_size, S.
kernel void moe_gate_up(device const float* x [[buffer(0)]],
                        device const int* ids [[buffer(1)]],
                        device const uint* g_codes [[buffer(2)]],
                        device const bfloat* g_scales [[buffer(3)]],
                        device const bfloat* g_biases [[buffer(4)]],
                        device const uint* u_codes [[buffer(5)]],
                        device const bfloat* u_scales [[buffer(6)]],
                        device const bfloat* u_biases [[buffer(7)]],
                        device float* act [[buffer(8)]],
                        constant uint4& dims [[buffer(9)]],
                        constant uint& bits [[buffer(10)]],
                        uint3 tg [[threadgroup_position_in_grid]],
                        uint simd_gid [[simdgroup_index_in_threadgroup]],
                        uint simd_lid [[thread_index_in_simdgroup]]) {
  const uint I = dims.x, H = dims.y, gs = dims.z, S = dims.w;
  if (bits == 4)
    gate_up<4>(x, ids, qrows<4>(g_codes, g_scales, g_biases, H, gs), qrows<4>(u_codes, u_scales, u_biases, H, gs), act, I, H,
               S, tg, simd_gid, simd_lid);
  else
    gate_up<8>(x, ids, qrows<8>(g_codes, g_scales, g_biases, H, gs), qrows<8>(u_codes, u_scales, u_biases, H, gs), act, I, H,
               S, tg, simd_gid, simd_lid);
}

// dims: H, I, Is, S; params: group_size, the shared down's group_size, bits, flags (1: the
// shared expert, 2: the residual).
kernel void moe_down(device const float* act [[buffer(0)]],
                     device const int* ids [[buffer(1)]],
                     device const float* w [[buffer(2)]],
                     device const uint* codes [[buffer(3)]],
                     device const bfloat* scales [[buffer(4)]],
                     device const bfloat* biases [[buffer(5)]],
                     device const float* act_shared [[buffer(6)]],
                     device const uint* s_codes [[buffer(7)]],
                     device const bfloat* s_scales [[buffer(8)]],
                     device const bfloat* s_biases [[buffer(9)]],
                     device const float* shared_logit [[buffer(10)]],
                     device const float* residual [[buffer(11)]],
                     device float* y [[buffer(12)]],
                     constant uint4& dims [[buffer(13)]],
                     constant uint4& params [[buffer(14)]],
                     uint3 tg [[threadgroup_position_in_grid]],
                     uint simd_gid [[simdgroup_index_in_threadgroup]],
                     uint simd_lid [[thread_index_in_simdgroup]]) {
  const uint H = dims.x, I = dims.y, Is = dims.z, S = dims.w, gs = params.x, sgs = params.y, flags = params.w;
  if (params.z == 4)
    down<4>(act, ids, w, qrows<4>(codes, scales, biases, I, gs), act_shared, qrows<4>(s_codes, s_scales, s_biases, Is, sgs),
            shared_logit, residual, y, H, I, Is, S, flags, tg, simd_gid, simd_lid);
  else
    down<8>(act, ids, w, qrows<8>(codes, scales, biases, I, gs), act_shared, qrows<8>(s_codes, s_scales, s_biases, Is, sgs),
            shared_logit, residual, y, H, I, Is, S, flags, tg, simd_gid, simd_lid);
}
