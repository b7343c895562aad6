// Helpers of the standalone kernel tests: random data, MLX affine matrices with their
// dequantised fp64 copy, device upload/download, NaN poisoning and error reports.
#pragma once
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "bf16.h"
#include "common/kernel_types.h"
#include "qmatmul/qmatmul_tiles.h"

namespace lily::cuda::test {

#define CK(x)                                                                                 \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(2);                                                                           \
    }                                                                                         \
  } while (0)

inline int g_failures = 0;

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  double uniform() { return (next() >> 11) * 0x1p-53; }              // [0, 1)
  double sym() { return 2.0 * uniform() - 1.0; }                      // [-1, 1)
  double normal() { return std::sqrt(-2.0 * std::log(uniform() + 1e-300)) * std::cos(6.283185307179586 * uniform()); }
};

inline std::vector<float> randn(size_t n, Rng& r, double scale = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.normal() * scale);
  return v;
}

// An MLX affine matrix [rows, cols] with random codes, signed bf16 scales and biases
// chosen so rows . x stays O(1) for x of RMS 1; `deq` is the exact dequantised matrix.
struct HostQ {
  int rows, cols, bits, group;
  std::vector<uint32_t> codes;
  std::vector<uint32_t> sb;  // interleaved like the device
  std::vector<double> deq;
};

inline HostQ make_q(int rows, int cols, int bits, int group, Rng& r, bool want_deq = true) {
  HostQ q{rows, cols, bits, group, {}, {}, {}};
  const int words = cols * bits / 32, groups = cols / group, levels = (1 << bits) - 1;
  q.codes.resize(static_cast<size_t>(rows) * words);
  for (auto& w : q.codes) w = static_cast<uint32_t>(r.next());
  q.sb.resize(static_cast<size_t>(rows) * groups);
  if (want_deq) q.deq.resize(static_cast<size_t>(rows) * cols);
  const double spread = 1.0 / std::sqrt(static_cast<double>(cols)) / std::sqrt((std::pow(4.0, bits) - 1) / 12.0);
  for (int i = 0; i < rows; ++i)
    for (int g = 0; g < groups; ++g) {
      const float s = round_bf16(static_cast<float>(spread * (0.8 + 0.4 * r.uniform()) * (r.next() & 1 ? -1 : 1)));
      const float b = round_bf16(static_cast<float>(-s * levels / 2.0 + 0.1 * spread * r.sym()));
      q.sb[static_cast<size_t>(i) * groups + g] = uint32_t(float_to_bf16(s)) | (uint32_t(float_to_bf16(b)) << 16);
      if (!want_deq) continue;
      for (int c = g * group; c < (g + 1) * group; ++c) {
        const uint32_t w = q.codes[static_cast<size_t>(i) * words + c * bits / 32];
        const uint32_t code = (w >> (bits * (c % (32 / bits)))) & levels;
        q.deq[static_cast<size_t>(i) * cols + c] = static_cast<double>(s) * code + static_cast<double>(b);
      }
    }
  return q;
}

template <typename T>
T* to_dev(const std::vector<T>& v) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(v.size(), 1) * sizeof(T)));
  CK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <typename T>
std::vector<T> from_dev(const T* p, size_t n) {
  std::vector<T> v(n);
  CK(cudaDeviceSynchronize());
  CK(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

template <typename T>
T* dev_alloc(size_t n, bool nan_poison = true) {
  T* p = nullptr;
  CK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  CK(cudaMemset(p, nan_poison ? 0xFF : 0, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

inline QMat upload_q(const HostQ& q) {
  QMat m;
  m.codes = reinterpret_cast<const uint4*>(to_dev(q.codes));
  m.sb = to_dev(q.sb);
  m.rows = q.rows;
  m.cols = q.cols;
  m.bits = q.bits;
  int s = 0;
  while ((128 / q.bits) << s < q.group) ++s;
  m.gshift = s;
  return m;
}

// The same matrix in the tensor-core tile order (4-bit, group 64); interleave I > 0 for
// expert gate/up stacks.
inline QMat upload_q_tiled(const HostQ& q, int interleave = 0) {
  QMat raw = upload_q(q);
  QMat m = raw;
  uint4* codes = nullptr;
  uint32_t* sb = nullptr;
  CK(cudaMalloc(&codes, tiled_code_bytes(q.rows, q.cols)));
  CK(cudaMalloc(&sb, tiled_sb_bytes(q.rows, q.cols)));
  pack_tiles(reinterpret_cast<const uint32_t*>(raw.codes), raw.sb, q.rows, q.cols, interleave, codes, sb, 0);
  CK(cudaDeviceSynchronize());
  cudaFree(const_cast<uint4*>(raw.codes));
  cudaFree(const_cast<uint32_t*>(raw.sb));
  m.codes = codes;
  m.sb = sb;
  m.tiled = true;
  return m;
}

inline QMat upload_as(const HostQ& q, bool tiled, int interleave = 0) {
  return tiled ? upload_q_tiled(q, interleave) : upload_q(q);
}

inline void free_q(QMat& m) {
  cudaFree(const_cast<uint4*>(m.codes));
  cudaFree(const_cast<uint32_t*>(m.sb));
}

// max |got - want| / rms(want); NaN (unwritten output) fails.
inline double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double ss = 0, worst = 0;
  for (double w : want) ss += w * w;
  const double rms = std::sqrt(ss / std::max<size_t>(want.size(), 1)) + 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    worst = std::max(worst, std::fabs(got[i] - want[i]) / rms);
  }
  return worst;
}

inline void report(const std::string& name, double err, double tol) {
  const bool ok = err <= tol;
  if (!ok) ++g_failures;
  std::printf("%-4s %-60s err %.3g (tol %.1g)\n", ok ? "ok" : "FAIL", name.c_str(), err, tol);
}

inline void expect(const std::string& name, bool ok) {
  if (!ok) ++g_failures;
  std::printf("%-4s %s\n", ok ? "ok" : "FAIL", name.c_str());
}

inline double bf16r(double v) { return round_bf16(static_cast<float>(v)); }

inline double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }
inline double silu(double v) { return v * sigmoid(v); }

// The gated RMSNorm of one token's o [Hv][Dv] (fp64): o * rsqrt(mean(o^2) + eps) * w * silu(z) per head.
template <typename T>
std::vector<double> gated_norm(const T* o, const float* z, int Hv, int Dv, const std::vector<float>& w) {
  std::vector<double> x(static_cast<size_t>(Hv) * Dv);
  for (int h = 0; h < Hv; ++h) {
    double ss = 0;
    for (int d = 0; d < Dv; ++d) ss += double(o[h * Dv + d]) * o[h * Dv + d];
    const double inv = 1 / std::sqrt(ss / Dv + 1e-6);
    for (int d = 0; d < Dv; ++d) x[h * Dv + d] = o[h * Dv + d] * inv * w[d] * silu(z[h * Dv + d]);
  }
  return x;
}

}  // namespace lily::cuda::test
