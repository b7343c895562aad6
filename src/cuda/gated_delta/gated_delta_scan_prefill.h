// Gated DeltaNet prefill, step 2 of 3: the recurrence over a chunk of T tokens, token by
// token in order, per value head h (key head h / (Hv/Hk)), state S [Dk][Dv] fp32:
//   S = decay S;  kv = S^T k;  delta = beta (v - kv);  S += k delta^T;  o = S^T q
// (the maths of gated_delta_decode). The state is read from `state` at the start and written back
// at the end, in place, in gated_delta_decode's layout (gated_delta_state_index), so decode continues
// where the chunk stopped. The state stays in registers for the whole chunk: one block
// per (head, 32 or 16 value columns), inputs staged through shared memory.
// Limits: T >= 1, Dk and Dv multiples of 16 up to 128, Hv % Hk == 0; q, k, v, state
// 16-byte aligned.
#pragma once
#include <cuda_runtime.h>

namespace lily::cuda {

struct GdnScanPrefillArgs {
  const float* q = nullptr;      // [T][Hk][Dk], l2-normalised and scaled by Dk^-1/2 (gated_delta_conv_prefill)
  const float* k = nullptr;      // [T][Hk][Dk], l2-normalised
  const float* v = nullptr;      // [T][Hv][Dv]
  const float* beta = nullptr;   // [T][Hv]
  const float* decay = nullptr;  // [T][Hv], in [0, 1]
  float* state = nullptr;        // [Hv * Dk * Dv] recurrent state (gated_delta_decode layout), updated in place
  float* o = nullptr;            // [T][Hv][Dv]
  int T = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0;
};

void gated_delta_scan_prefill(const GdnScanPrefillArgs& a, cudaStream_t stream);

}  // namespace lily::cuda
