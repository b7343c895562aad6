// rope and the attention gate, the attention mixer's elementwise kernels (contracts:
// src/cpp/ops/attention.h); a thread an element pair or an element, fp32.
//   rope: in place on x [T, heads, head_dim], token t at position pos0 + t: for j < R/2 (R the
//         rotary dims) the NeoX pair (j, j + R/2) rotates by the angle (pos0 + t) * inv_freq[j],
//         inv_freq[j] = theta^(-2j/R) given by the host (fp32 of the fp64 power, as the CPU's),
//         the angle an fp32 product and precise:: cos and sin of it (angles reach 10^5 rad).
//         Grid: T * heads * R/2 threads.
//   attention_gate: out[t][h D + d] *= sigmoid(qg[t][h][D + d]), the gate half of the query
//         projection; grid: T * Hq * D threads.
#include <metal_stdlib>
using namespace metal;

kernel void rope(device float* x [[buffer(0)]],
                 device const float* inv_freq [[buffer(1)]],
                 constant uint4& dims [[buffer(2)]],
                 constant uint& pos0 [[buffer(3)]],
                 uint i [[thread_position_in_grid]]) {
  const uint T = dims.x, heads = dims.y, head_dim = dims.z, half_r = dims.w / 2;
  if (i >= T * heads * half_r) return;
  const uint j = i % half_r, row = i / half_r, t = row / heads;
  const float angle = float(pos0 + t) * inv_freq[j];
  const float c = precise::cos(angle), s = precise::sin(angle);
  device float* lo = x + size_t(row) * head_dim;
  const float a = lo[j], b = lo[j + half_r];
  lo[j] = a * c - b * s;
  lo[j + half_r] = b * c + a * s;
}

kernel void attention_gate(device float* out [[buffer(0)]],
                           device const float* qg [[buffer(1)]],
                           constant uint3& dims [[buffer(2)]],
                           uint i [[thread_position_in_grid]]) {
  const uint T = dims.x, Hq = dims.y, D = dims.z;
  if (i >= T * Hq * D) return;
  const uint d = i % D, th = i / D;  // th = t Hq + h
  const float g = qg[size_t(th) * 2 * D + D + d];
  out[i] *= 1.0f / (1.0f + exp(-g));
}
