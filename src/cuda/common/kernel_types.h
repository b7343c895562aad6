// Plain descriptions of kernel operands, shared by host code and kernels.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "error.h"

namespace lily::cuda {

// Tokens (x rows) one decode step feeds at most: a plain step feeds 1, a speculative verify
// step the pending token and up to 3 drafts. Every row of a T-row step is computed exactly
// as a single-row step would (the 4 column pairs of an mma.m16n8k16 hold 4 rows: qmatmul_decode_mma.cuh).
constexpr int kMaxStepRows = 4;

// f(std::integral_constant<int, T>{}) for rows T in [1, kMaxStepRows]; other counts are
// refused, naming `op`.
template <class F>
void with_step_rows(const char* op, int rows, F f) {
  if (rows < 1 || rows > kMaxStepRows)
    fail(op, ": ", std::to_string(rows), " rows; a step takes 1 to ", std::to_string(kMaxStepRows));
  if (rows == 1) f(std::integral_constant<int, 1>{});
  else if (rows == 2) f(std::integral_constant<int, 2>{});
  else if (rows == 3) f(std::integral_constant<int, 3>{});
  else f(std::integral_constant<int, 4>{});
}

// The most experts, and routed experts per token, any MoE kernel takes (decode and prefill).
constexpr int kMoeMaxExperts = 512, kMoeMaxTopK = 16;

// A quantized matrix as the kernels read it: row-major in MLX code order, or tiled for
// the tensor-core GEMV (then rows are padded to 16 and chunks()/groups() do not apply).
struct QMat {
  const uint4* codes = nullptr;  // [rows][chunks], chunk = 16 bytes = 128/bits columns
  const uint32_t* sb = nullptr;  // [rows][cols/group]: bf16 scale (low half) | bf16 bias (high half)
  int rows = 0, cols = 0, bits = 4;
  int gshift = 1;  // log2(group / columns per chunk)
  bool tiled = false;  // 4-bit, group 64, in the tensor-core tile order (qmatmul_decode_mma.cuh)
  __host__ __device__ int chunks() const { return cols * bits / 128; }
  __host__ __device__ int groups() const { return chunks() >> gshift; }
};

// How a block builds its input vector x [cols] before the dot products.
enum class XMode : int {
  Plain,         // x
  RmsNorm,       // x * rsqrt(mean(x^2) + eps) * w
  EmbedRmsNorm,  // e = embedding row of *token (block 0 stores e to h_out); then RmsNorm of e
};

struct XSpec {
  XMode mode = XMode::Plain;
  const float* x = nullptr;
  const float* w = nullptr;
  float eps = 1e-6f;
  QMat embed;                  // EmbedRmsNorm: the embedding table [vocab, cols]
  const int* token = nullptr;  // EmbedRmsNorm
  float* h_out = nullptr;      // EmbedRmsNorm
};

}  // namespace lily::cuda
