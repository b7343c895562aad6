// The Gated DeltaNet mixer's prologue (contracts: src/cpp/ops/gated_delta.h), fp32:
//   gated_delta_conv:  y[t][c] = silu(sum_j w[c][j] u[t + j][c]), u = [state (Kc-1 rows); x],
//                      and the new state, u's last Kc-1 rows; a thread a channel walks the
//                      tokens (a simdgroup reads 32 consecutive channels a row), the window
//                      of Kc-1 rows in registers; grid (ceil(C/256)), Kc <= 8.
//   gated_delta_gates: g = -exp(A_log[h]) softplus(a + dt_bias[h]), beta = sigmoid(b), a
//                      thread a (token, head); grid (ceil(T Hv / 256)).
#include <metal_stdlib>
using namespace metal;

constant constexpr uint MAX_TAPS = 8;

kernel void gated_delta_conv(device const float* x [[buffer(0)]],
                             device const float* w [[buffer(1)]],
                             device const float* state_in [[buffer(2)]],
                             device float* y [[buffer(3)]],
                             device float* state_out [[buffer(4)]],
                             constant uint3& dims [[buffer(5)]],
                             uint c [[thread_position_in_grid]]) {
  const uint T = dims.x, C = dims.y, Kc = dims.z, S = Kc - 1;  // S rows of state
  if (c >= C) return;
  float win[MAX_TAPS];  // u rows t .. t + S - 1 of this channel
  for (uint j = 0; j < S; ++j) win[j] = state_in[size_t(j) * C + c];
  for (uint t = 0; t < T; ++t) {
    const float xt = x[size_t(t) * C + c];
    float acc = 0.0f;
    for (uint j = 0; j < S; ++j) acc += w[size_t(c) * Kc + j] * win[j];
    acc += w[size_t(c) * Kc + S] * xt;
    y[size_t(t) * C + c] = acc / (1.0f + exp(-acc));
    for (uint j = 0; j + 1 < S; ++j) win[j] = win[j + 1];
    if (S > 0) win[S - 1] = xt;
  }
  for (uint j = 0; j < S; ++j) state_out[size_t(j) * C + c] = win[j];
}

kernel void gated_delta_gates(device const float* a [[buffer(0)]],
                              device const float* b [[buffer(1)]],
                              device const float* A_log [[buffer(2)]],
                              device const float* dt_bias [[buffer(3)]],
                              device float* g [[buffer(4)]],
                              device float* beta [[buffer(5)]],
                              constant uint2& dims [[buffer(6)]],
                              uint i [[thread_position_in_grid]]) {
  const uint n = dims.x, Hv = dims.y;  // n = T Hv
  if (i >= n) return;
  const uint h = i % Hv;
  const float x = a[i] + dt_bias[h];
  const float softplus = x > 20.0f ? x : log(1.0f + exp(x));
  g[i] = -exp(A_log[h]) * softplus;
  beta[i] = 1.0f / (1.0f + exp(-b[i]));
}
