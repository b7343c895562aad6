// The norms (docs/ops.md says what a contract holds and where each backend's kernels are).
#pragma once
#include <cstdint>

namespace lily::ops {

// rmsnorm: y[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w over rows of dim values.
// tolerance rmsnorm: cpu 1e-6, cuda 1e-6, metal-emulator 1e-6
struct RmsNorm {
  const float* x = nullptr;  // [rows, dim]
  int64_t rows = 0, dim = 0;
  const float* w = nullptr;  // [dim]
  float eps = 1e-6f;
  float* y = nullptr;        // [rows, dim]
};

// gated_rmsnorm, the Gated DeltaNet output norm: y = rmsnorm(x) * w * silu(z) per row of dim
// (one value head's Dv); cuda writes bf16, the out-projection's operand.
// tolerance gated_rmsnorm: cpu 1e-6, cuda 4e-3, metal-emulator 1e-6
struct GatedRmsNorm {
  const float* x = nullptr;  // [rows, dim]
  const float* z = nullptr;  // [rows, dim]
  int64_t rows = 0, dim = 0;
  const float* w = nullptr;  // [dim]
  float eps = 1e-6f;
  float* y = nullptr;        // [rows, dim]
};

// l2norm: x[r] = x[r] * rsqrt(sum(x[r]^2) + eps) * scale, in place.
// tolerance l2norm: cpu 1e-6, metal-emulator 1e-6
struct L2Norm {
  float* x = nullptr;  // [rows, dim]
  int64_t rows = 0, dim = 0;
  float eps = 1e-6f, scale = 1.0f;
};

}  // namespace lily::ops
