// The CUDA backend's ops on host arrays in the reference layout (src/cpp/ops/*.h), for the
// per-backend op tests (tests/test_ops.py through lily._lily.ops): each call uploads its
// inputs, converts them to the kernels' own layouts, runs the kernel chain of the
// executor, and brings the outputs back. Outputs start as NaN on the device, so a kernel
// that skips an element fails the test.
#pragma once
#include "ops/gated_delta.h"
#include "ops/norm.h"
#include "ops/qmatmul.h"

namespace lily::cuda_ops {

// The decode and prefill kernels of a quantized matmul: Decode, qmatmul_decode one row at a
// time on MLX-order weights (fp32 dot); DecodeTiles, on tensor-core tiles, up to 4 rows a
// launch; Prefill, the exact tensor-core GEMM of qmatmul_prefill (bf16 x).
enum class QMatmulRoute { Decode, DecodeTiles, Prefill };
void qmatmul(const ops::QMatmul& a, QMatmulRoute route);
void embedding(const ops::Embedding& a);  // embedding_prefill

void rmsnorm(const ops::RmsNorm& a);              // rmsnorm_prefill, its fp32 output
void gated_rmsnorm(const ops::GatedRmsNorm& a);   // gated_rmsnorm_prefill (bf16 output)

// The prefill recurrence: gated_delta_scan_prefill, or with chunked
// gated_delta_chunked_prefill (chunks of 64 tokens on tensor cores).
void gated_delta(const ops::GatedDelta& a, bool chunked);

}  // namespace lily::cuda_ops
