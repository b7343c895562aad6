// Gated DeltaNet prefill, step 1 of 3 (then the recurrence: gated_delta_scan_prefill or
// gated_delta_chunked_prefill, then gated_rmsnorm_prefill): for a
// chunk of T tokens at positions pos0 .. pos0+T-1, the per-token maths of gated_delta_decode
// before the recurrence:
//   y[t][c] = silu(sum_{i<4} w[c][i] * pre[t-3+i][c])   (pre = the q|k|v columns of proj;
//             rows before the chunk come from the ring, which holds zeros before position 0)
//   q = l2norm(y_q) / sqrt(Dk), k = l2norm(y_k), v = y_v   (l2norm(x) = x * rsqrt(sum x^2 + 1e-6))
//   beta = sigmoid(b), decay = exp(neg_A * softplus(a + dt_bias))
// and the ring update of T decode steps: ring[(pos0 + t) % kGdnRingRows] = pre row t for
// the last min(T, kGdnRingRows) tokens, other rows untouched. Limits: T >= 1, pos0 >= 0, Dk and Dv multiples
// of 16 up to 128, Hv % Hk == 0, conv kernel 4; proj, conv_w, ring, q, k, v 16-byte
// aligned, ldp % 4 == 0.
#pragma once
#include <cuda_runtime.h>

namespace lily::cuda {

struct GdnConvPrefillArgs {
  const float* proj = nullptr;     // [T][ldp]: q|k|v [conv_dim] | z [Hv*Dv] | b [Hv] | a [Hv] (GdnArgs::proj per row)
  int ldp = 0;                     // row stride of proj in floats
  const float* conv_w = nullptr;   // [conv_dim][4], tap 3 multiplies the current token
  float* ring = nullptr;           // [kGdnRingRows][conv_dim] pre-conv rows by position (gated_delta_decode's ring)
  const float* dt_bias = nullptr;  // [Hv]
  const float* neg_A = nullptr;    // [Hv] = -exp(A_log)
  float* q = nullptr;              // [T][Hk][Dk]
  float* k = nullptr;              // [T][Hk][Dk]
  float* v = nullptr;              // [T][Hv][Dv]
  float* beta = nullptr;           // [T][Hv]
  float* decay = nullptr;          // [T][Hv]
  int T = 0, pos0 = 0;             // tokens in this chunk; position of its first token
  int Hk = 0, Hv = 0, Dk = 0, Dv = 0;
};

void gated_delta_conv_prefill(const GdnConvPrefillArgs& a, cudaStream_t stream);

}  // namespace lily::cuda
