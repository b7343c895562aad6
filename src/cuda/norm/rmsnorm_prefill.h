// RMSNorm of a chunk of rows, written as the bf16 operand of the prefill GEMMs (and,
// when asked, in fp32 for the MoE router, whose top-k choice should not see bf16
// rounding):  x[t] = h[t] * rsqrt(mean(h[t]^2) + eps) * w.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace lily::cuda {

// h: [T][H] fp32, H % 4 == 0; w: [H]; xb: [T][ld] bf16 or nullptr; xf: [T][ld] fp32 or nullptr;
// ld: the outputs' row stride (0: H; the MTP head's input is two norms side by side).
void rmsnorm_prefill(const float* h, const float* w, int T, int H, float eps, uint16_t* xb, float* xf,
                     cudaStream_t stream, int ld = 0);

}  // namespace lily::cuda
