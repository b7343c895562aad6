// Quantized matmul and the embedding gather over MLX affine weights (weights.h: QWeight;
// docs/ops.md says what a contract holds).
#pragma once
#include <cstdint>

#include "weights.h"

namespace lily::ops {

// qmatmul: y[T, N] = x[T, K] W^T, W = scale q + bias dequantized per group from w ([N, K], one
// matrix: w.experts == 1), fp32 accumulation. Tolerance: cpu 2e-6; cuda 1e-5 (decode, MLX
// order), 1e-4 (decode on tensor-core tiles: x as bf16 hi + lo), 1e-2 (prefill: x in bf16);
// metal-emulator 1e-5 (decode, 4 and 8 bits: per word s * dot(x, q) + b * sum(x)).
struct QMatmul {
  const float* x = nullptr;  // [T, K]
  int64_t T = 0;
  QWeight w;
  float* y = nullptr;        // [T, N], not aliasing x
};

// embedding: out[t] = dequant(table[ids[t]]). Tolerance: cpu exact; cuda 1e-6.
struct Embedding {
  QWeight table;  // [V, H]
  const int32_t* ids = nullptr;  // [T], in [0, V)
  int64_t T = 0;
  float* out = nullptr;          // [T, H]
};

}  // namespace lily::ops
