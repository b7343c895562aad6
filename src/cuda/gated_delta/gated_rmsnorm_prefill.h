// Gated DeltaNet prefill, step 3 of 3: the gated RMSNorm of the recurrence output, per
// token t and value head h (the maths of gated_delta_decode's last step), written as the bf16 input
// of the out-projection GEMM:
//   out[t][h*Dv + d] = bf16(o[t][h][d] * rsqrt(mean_d(o[t][h]^2) + eps) * w[d] * silu(z[t][h*Dv + d]))
// Limits: T >= 1, Dv a multiple of 16 up to 128; o, z, w 16-byte aligned, ldz % 4 == 0,
// out 8-byte aligned.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace lily::cuda {

struct GdnGatedNormArgs {
  const float* o = nullptr;  // [T][Hv][Dv] (the recurrence: gated_delta_scan_prefill or gated_delta_chunked_prefill)
  const float* z = nullptr;  // z of token t at z + t*ldz: [Hv*Dv] (proj + conv_dim, ldz = the proj row stride)
  int ldz = 0;
  const float* w = nullptr;  // [Dv] plain weight (not +1-shifted), shared by all heads
  float eps = 1e-6f;
  uint16_t* out = nullptr;   // bf16 [T][Hv*Dv]
  int T = 0, Hv = 0, Dv = 0;
};

void gated_rmsnorm_prefill(const GdnGatedNormArgs& a, cudaStream_t stream);

}  // namespace lily::cuda
