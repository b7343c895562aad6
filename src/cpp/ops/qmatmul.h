// Quantized matmul and the embedding gather over MLX affine weights (weights.h: QWeight;
// docs/ops.md says what a contract holds).
#pragma once
#include <cstdint>

#include "weights.h"

namespace lily::ops {

// qmatmul: y[T, N] = x[T, K] W^T, W = scale q + bias dequantized per group from w ([N, K], one
// matrix: w.experts == 1), fp32 accumulation. cuda's decode on tensor-core tiles takes x as
// bf16 hi + lo, its prefill GEMMs x in bf16 (bf16w and wgmma W too); metal sums
// s * dot(x, q) + b * sum(x) per word.
// tolerance qmatmul: cpu 2e-6, cuda:decode 1e-5, cuda:decode_tiles 1e-4, cuda:prefill 1e-2, cuda:prefill_bf16w 1e-2, cuda:prefill_wgmma 1e-2, metal-emulator 1e-5
struct QMatmul {
  const float* x = nullptr;  // [T, K]
  int64_t T = 0;
  QWeight w;
  float* y = nullptr;        // [T, N], not aliasing x
};

// embedding: out[t] = dequant(table[ids[t]]) (cpu: exactly the reference's values).
// tolerance embedding: cpu 0, cuda 1e-6, metal-emulator 1e-6
struct Embedding {
  QWeight table;  // [V, H]
  const int32_t* ids = nullptr;  // [T], in [0, V)
  int64_t T = 0;
  float* out = nullptr;          // [T, H]
};

}  // namespace lily::ops
