// The separate-dequantisation path of the prefill GEMM ablation (prefill_gemm_ops.cu): a
// pass that expands the tiled 4-bit weights to a bf16 copy (dequant_pass.cu), then a plain
// bf16 GEMM on that copy, the mma.sync probe of the matmul ceiling (matmul_probe.cu).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common/kernel_types.h"

namespace lily::bench {

// w16 [W.rows][ldw] bf16, row-major: w16[n][k] = bf16(s q + b) for k < W.cols, rounded as
// qmatmul_prefill's bf16-weight kernel rounds (GemmArgs::weights_bf16); columns >= W.cols untouched.
// W: tiled 4-bit group 64; ldw % 8 == 0, ldw >= W.cols, w16 16-byte aligned.
void dequant_bf16(const cuda::QMat& W, uint16_t* w16, int ldw, cudaStream_t stream);

// The probe's block tile: its GEMM needs M, N, K multiples of these (callers pad).
constexpr int kProbeTileM = 128, kProbeTileN = 256, kProbeTileK = 64;

// Y [M][N] fp32 = X [M][K] · W16 [N][K]ᵀ, bf16 operands, fp32 accumulation, on the probe
// kernel of the matmul ceiling; M % 128 == 0, N % 256 == 0, K % 64 == 0 (checked).
void probe_gemm(const uint16_t* X, const uint16_t* W16, float* Y, int M, int N, int K, cudaStream_t stream);

}  // namespace lily::bench
