// Gated DeltaNet: the causal conv, the gates and the recurrence (docs/ops.md says what
// a contract holds; docs/MODEL.md §4.5 the layer they make).
#pragma once
#include <cstdint>

namespace lily::ops {

// gated_delta_conv: causal depthwise conv over time, then SiLU: y[t, c] = silu(sum_j w[c, j] x[t-Kc+1+j, c]),
// tap Kc-1 on the current token; rows before x come from state, which is updated to the
// last Kc-1 rows of state ++ x (zeros at the sequence start).
// tolerance gated_delta_conv: cpu 1e-6, metal-emulator 1e-6
struct GatedDeltaConv {
  const float* x = nullptr;  // [T, C]
  int64_t T = 0, C = 0;
  const float* w = nullptr;  // [C, Kc]
  int64_t Kc = 0;
  float* state = nullptr;    // [Kc-1, C], carried in and out
  float* y = nullptr;        // [T, C], not aliasing x
};

// gated_delta_gates: g = -exp(A_log) softplus(a + dt_bias) (log-decay, <= 0), beta = sigmoid(b).
// tolerance gated_delta_gates: cpu 1e-6, metal-emulator 1e-6
struct GatedDeltaGates {
  const float* a = nullptr;  // [T, Hv]
  const float* b = nullptr;  // [T, Hv]
  int64_t T = 0, Hv = 0;
  const float* A_log = nullptr;    // [Hv]
  const float* dt_bias = nullptr;  // [Hv]
  float* g = nullptr;              // [T, Hv]
  float* beta = nullptr;           // [T, Hv]
};

// gated_delta, per value head h (key head h / (Hv/Hk)), state S [Dk, Dv] fp32:
//   S = exp(g_t) S;  delta = (v_t - S^T k_t) beta_t;  S += k_t (x) delta;  o_t = S^T q_t
// Tolerances hold for o and S, over 512+ tokens too; cuda's chunked form uses 3xTF32 products.
// tolerance gated_delta: cpu 1e-5, cuda:scan 1e-5, cuda:chunked 1e-4, metal-emulator 1e-6
struct GatedDelta {
  const float* q = nullptr;     // [T, Hk, Dk], l2-normalised and scaled by Dk^-1/2
  const float* k = nullptr;     // [T, Hk, Dk], l2-normalised
  const float* v = nullptr;     // [T, Hv, Dv]
  const float* g = nullptr;     // [T, Hv] log-decay
  const float* beta = nullptr;  // [T, Hv]
  int64_t T = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  float* state = nullptr;       // [Hv, Dk, Dv], carried in and out
  float* o = nullptr;           // [T, Hv, Dv]
};

// gated_delta_step, the Gated DeltaNet mixer between its projections (MODEL.md §4.5):
// c = gated_delta_conv(mixed), split flat into q [Hk, Dk] | k [Hk, Dk] | v [Hv, Dv] a token;
// q = l2norm(q) Dk^-1/2, k = l2norm(k); (g, beta) = gated_delta_gates(a, b); o = gated_delta(q, k,
// v, g, beta); out = gated_rmsnorm(o, z, norm). With conv_rows and state_rows the states after
// each token but the last are kept too, as a verify step keeps them. (CUDA's prefill routes
// give out in bf16, the out-projection's input; their state holds gated_delta's bound.)
// tolerance gated_delta_step: cpu 2e-6, metal-emulator 1e-5, cuda 2e-6, cuda:prefill_scan 4e-3, cuda:prefill_chunked 4e-3
struct GatedDeltaStep {
  const float* mixed = nullptr;    // [T, 2 Hk Dk + Hv Dv]: the in-projection's q | k | v rows, before the conv
  const float* z = nullptr;        // [T, Hv, Dv]
  const float* b = nullptr;        // [T, Hv]
  const float* a = nullptr;        // [T, Hv]
  const float* conv_w = nullptr;   // [2 Hk Dk + Hv Dv, Kc]
  const float* A_log = nullptr;    // [Hv]
  const float* dt_bias = nullptr;  // [Hv]
  const float* norm = nullptr;     // [Dv] the gated RMSNorm weight
  int64_t T = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0, Kc = 0;
  float eps = 1e-6f;
  float* conv_state = nullptr;     // [Kc - 1, 2 Hk Dk + Hv Dv], carried in and out
  float* state = nullptr;          // [Hv, Dk, Dv], carried in and out
  float* out = nullptr;            // [T, Hv, Dv]
  float* conv_rows = nullptr;      // optional [T - 1][Kc - 1, 2 Hk Dk + Hv Dv]: conv_state after each token
  float* state_rows = nullptr;     // optional [T - 1][Hv, Dk, Dv]: state after each token
};

}  // namespace lily::ops
