// Gated DeltaNet decode step for one token, one launch (grid: 4 splits of the value
// dimension x value heads; the 4 blocks of a head form a cluster). Per value head h (key
// head h / (Hv/Hk)):
//   causal conv (kernel 4) + SiLU over the q, k, v channels, using a ring of the pre-conv
//   rows indexed by position mod kGdnRingRows (the current row is written back);
//   q = l2norm(q) / sqrt(Dk), k = l2norm(k); beta = sigmoid(b); decay = exp(-exp(A_log) softplus(a + dt_bias));
//   S = decay S;  S += k (beta (v - S^T k))^T;  o = S^T q;
//   out = o * rsqrt(mean(o^2) + eps) * norm_w * silu(z)   (gated RMSNorm over the head's Dv).
// The state is read from one buffer and written to another (double buffering), so a
// step that is later discarded leaves the previous state intact. With rows > 1 the tokens
// at pos, pos + 1, ... are stepped in order, each exactly as alone (proj and out rows
// contiguous); the state after token r < rows - 1 goes to state_rows + r * Hv*Dk*Dv, the
// last to state_out, so a speculative step can keep any prefix of its tokens. The ring
// holds 8 rows: a step writes up to kMaxStepRows rows while its tokens read the 3 before
// each, and a discarded row never overwrites one that a later position reads.
// pos, the ring, state_in and the weights are read before the wait on the kernel launched just before
// (PDL), which must therefore write none of them (decode writes proj there); any earlier
// kernel may, as every kernel here lets its dependents start only after its own wait.
#pragma once
#include <cuda_runtime.h>

#include "common/kernel_types.h"

namespace lily::cuda {

constexpr int kGdnSplit = 4;     // blocks per value head
constexpr int kGdnRingRows = 8;  // conv ring rows
static_assert(kGdnRingRows >= 3 + kMaxStepRows && (kGdnRingRows & (kGdnRingRows - 1)) == 0,
              "a power of two: the 3 rows a position reads survive a discarded speculation's writes");

struct GdnArgs {
  const float* proj = nullptr;     // [conv_dim (q|k|v) | Hv*Dv (z) | Hv (b) | Hv (a)]
  const float* norm_w = nullptr;   // [Dv] gated RMSNorm weight
  const float* conv_w = nullptr;   // [conv_dim][4], tap 3 multiplies the current token
  float* ring = nullptr;           // [kGdnRingRows][conv_dim] pre-conv rows by position (zeros at start)
  const float* dt_bias = nullptr;  // [Hv]
  const float* neg_A = nullptr;    // [Hv] = -exp(A_log)
  const float* state_in = nullptr; // [Hv * Dk * Dv] in the kernel's own layout (see gated_delta_state_index)
  float* state_out = nullptr;
  float* state_rows = nullptr;     // several rows: [rows - 1][Hv * Dk * Dv], the state after each but the last
  float* out = nullptr;            // [Hv * Dv] the gated norm of o
  const int* pos = nullptr;        // position of this token
  int Hk = 0, Hv = 0, Dk = 0, Dv = 0;
  float eps = 1e-6f;
};

void gated_delta_decode(const GdnArgs& a, const int* halt, cudaStream_t stream, int rows = 1);

// Where S[k][v] of value head h lives in the state buffer (for tests and snapshots).
size_t gated_delta_state_index(int Hv, int Dk, int Dv, int h, int k, int v);

}  // namespace lily::cuda
