// Gated DeltaNet prefill, step 2 of 3, chunked form (the alternative to gated_delta_scan_prefill,
// same inputs, outputs and state semantics). Per value head h (key head h / (Hv/Hk)),
// state S [Dk][Dv] fp32, the recurrence of gated_delta_decode per token t:
//   S = decay_t S;  delta = beta_t (v_t - S^T k_t);  S += k_t delta^T;  o_t = S^T q_t
// computed in chunks of C = 64 tokens. Within a chunk (rows i, j < n), with
// gamma_i = sum_{m<=i} log decay_m, g_i = exp(gamma_i), r_ij = exp(gamma_i - gamma_j) (j <= i):
//   (I + A) [W | U] = [diag(beta g) K | diag(beta) V],  A_ij = beta_i r_ij k_i.k_j (j < i)
//   D = U - W S                 (the deltas, given the state S at the chunk start)
//   O = diag(g) Q S + P D,      P_ij = r_ij q_i.k_j (j <= i)
//   S = g_{n-1} S + K^T diag(g_{n-1} / g) D
// Kernel 1 (all chunks and heads in parallel) builds W, U (forward substitution in fp32),
// P and g into `scratch`; kernel 2 (per head and value-column slice, chunks in order) runs
// the state products on tensor cores in 3xTF32 (hi/lo split: fp32-grade products, so the
// error stays at the scan's level over any number of chunks). The state is read from
// `state` at the start and written back at the end, in place, in gated_delta_decode's layout.
// Limits: T >= 1, Dk and Dv multiples of 16 up to 128, Hv % Hk == 0; q, k, v, state, o,
// scratch 16-byte aligned, scratch_bytes >= gated_delta_chunked_prefill_scratch_bytes(T, Hv, Dk, Dv).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "gated_delta/gated_delta_scan_prefill.h"

namespace lily::cuda {

// The scan's arguments (same inputs, outputs and state semantics) plus the chunk factors' scratch.
struct GdnChunkedPrefillArgs : GdnScanPrefillArgs {
  void* scratch = nullptr;  // per chunk and value head: W, U, P, g (gated_delta_chunked_prefill_scratch_bytes)
  size_t scratch_bytes = 0;
};

size_t gated_delta_chunked_prefill_scratch_bytes(int T, int Hv, int Dk, int Dv);

void gated_delta_chunked_prefill(const GdnChunkedPrefillArgs& a, cudaStream_t stream);

}  // namespace lily::cuda
