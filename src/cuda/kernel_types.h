// Plain descriptions of kernel operands, shared by host code and kernels.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "error.h"

namespace lily::cuda {

// A quantized matrix as the kernels read it: row-major in MLX code order, or tiled for
// the tensor-core GEMV (then rows are padded to 16 and chunks()/groups() do not apply).
struct QMat {
  const uint4* codes = nullptr;  // [rows][chunks], chunk = 16 bytes = 128/bits columns
  const uint32_t* sb = nullptr;  // [rows][cols/group]: bf16 scale (low half) | bf16 bias (high half)
  int rows = 0, cols = 0, bits = 4;
  int gshift = 1;  // log2(group / columns per chunk)
  bool tiled = false;  // 4-bit, group 64, in the tensor-core tile order (qmma.cuh)
  __host__ __device__ int chunks() const { return cols * bits / 128; }
  __host__ __device__ int groups() const { return chunks() >> gshift; }
  // Bytes of the codes and of the scale|bias words (rows unpadded).
  __host__ __device__ size_t code_bytes() const { return static_cast<size_t>(rows) * cols * bits / 8; }
  __host__ __device__ size_t sb_bytes() const { return static_cast<size_t>(rows) * groups() * 4; }
};

// Weights that a later kernel of the decode step reads, pulled into L2 by an earlier
// kernel before its PDL wait (l2_ahead in device_common.cuh) so that the later one reads
// L2 instead of HBM. Decode is latency-bound at ~20 % of the bandwidth, so these reads
// overlap phases that wait on latency. Ranges are 16-byte aligned.
struct L2Ahead {
  static constexpr int kMax = 10;
  const void* p[kMax] = {};
  size_t bytes[kMax] = {};
  int n = 0;
  void add(const void* ptr, size_t b) {
    if (n == kMax) fail("L2Ahead: more than ", std::to_string(kMax), " ranges");
    p[n] = ptr;
    bytes[n++] = b;
  }
  void add(const QMat& W) {
    add(W.codes, W.code_bytes());
    add(W.sb, W.sb_bytes());
  }
};

// The chosen experts' slices of stacked expert matrices (expert e = the e-th of E equal
// row ranges), which moe_router pulls into L2 once it has chosen them.
struct ExpertsAhead {
  QMat m[2];
  int n = 0, E = 0;
};

// How a block builds its input vector x [cols] before the dot products.
enum class XMode : int {
  Plain,         // x
  RmsNorm,       // x * rsqrt(mean(x^2) + eps) * w
  EmbedRmsNorm,  // e = embedding row of *token (block 0 stores e to h_out); then RmsNorm of e
  HeadNormGate,  // per head of head_dim: x * rsqrt(mean(x^2) + eps) * w[d] * silu(z)  (Gated DeltaNet output)
};

struct XSpec {
  XMode mode = XMode::Plain;
  const float* x = nullptr;
  const float* w = nullptr;
  const float* z = nullptr;
  int head_dim = 0;
  float eps = 1e-6f;
  QMat embed;                  // EmbedRmsNorm: the embedding table [vocab, cols]
  const int* token = nullptr;  // EmbedRmsNorm
  float* h_out = nullptr;      // EmbedRmsNorm
};

}  // namespace lily::cuda
