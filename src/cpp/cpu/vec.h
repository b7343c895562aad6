// Small inline vector helpers for the CPU ops. The sums keep 16 independent partial
// accumulators so the compiler vectorises them without -ffast-math (a single running sum
// would be a serial dependency it may not reorder). Lengths are multiples of 16 where
// noted; the others have a scalar tail.
#pragma once
#include <cmath>
#include <cstdint>

namespace lily::cpu {

constexpr int64_t kLanes = 16;

inline float sum_lanes(const float* acc) {
  float s = 0;
  for (int64_t j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

// sum_k a[k] * b[k], any n.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[k + j] * b[k + j];
  float s = sum_lanes(acc);
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// out[r] = sum_k x[k] * w[r*n + k] for r < 4: four rows share each load of x.
// n is a multiple of kLanes.
inline void dot4(const float* x, const float* w, int64_t n, float* out) {
  float acc[4][kLanes] = {};
  for (int64_t k = 0; k < n; k += kLanes)
    for (int r = 0; r < 4; ++r)
      for (int64_t j = 0; j < kLanes; ++j) acc[r][j] += x[k + j] * w[r * n + k + j];
  for (int r = 0; r < 4; ++r) out[r] = sum_lanes(acc[r]);
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// log(1 + e^x) without overflow for large x.
inline float softplus(float x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

}  // namespace lily::cpu
