// Small inline vector helpers for the CPU ops, on GCC/Clang vector types one register
// wide (16 floats with AVX-512, 8 with AVX, 4 with SSE/NEON), accumulators kept in
// registers. Plain loops would not vectorise a float sum without -ffast-math, because
// that reorders the additions; here the order is explicit (kLanes partial sums, then
// their total), so results are reproducible on one machine.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace lily::cpu {

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#elif defined(__AVX__)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 4;
#endif
using floatv = float __attribute__((vector_size(kLanes * sizeof(float))));

inline floatv loadv(const float* p) {
  floatv v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline float sum_lanes(floatv v) {
  float s = 0;
  for (int j = 0; j < kLanes; ++j) s += v[j];
  return s;
}

// sum_k a[k] * b[k], any n.
inline float dot(const float* a, const float* b, int64_t n) {
  floatv acc = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) acc += loadv(a + k) * loadv(b + k);
  float s = sum_lanes(acc);
  for (; k < n; ++k) s += a[k] * b[k];
  return s;
}

// out[r] = sum_k x[k] * w[r*n + k] for r < 4: four rows share each load of x.
// n is a multiple of kLanes (at most 16; group sizes are 32+).
inline void dot4(const float* x, const float* w, int64_t n, float* out) {
  floatv a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t k = 0; k < n; k += kLanes) {
    const floatv xv = loadv(x + k);
    a0 += xv * loadv(w + k);
    a1 += xv * loadv(w + n + k);
    a2 += xv * loadv(w + 2 * n + k);
    a3 += xv * loadv(w + 3 * n + k);
  }
  out[0] = sum_lanes(a0);
  out[1] = sum_lanes(a1);
  out[2] = sum_lanes(a2);
  out[3] = sum_lanes(a3);
}

// y += a * x
inline void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// What one std::exp costs next to a multiply-add, for the work estimates given to parallel_for.
constexpr int64_t kExpWork = 16;

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// log(1 + e^x) without overflow for large x.
inline float softplus(float x) { return x > 0 ? x + std::log1p(std::exp(-x)) : std::log1p(std::exp(x)); }

}  // namespace lily::cpu
