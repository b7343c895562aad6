// Qwen3.6-35B-A3B dimensions (docs/MODEL.md) and the prefill chunk the entries use.
#pragma once
#include <string>
#include <vector>

#include "bench.h"

namespace lily::bench {

constexpr int kH = 2048, kV = 248320;  // hidden size, vocabulary
constexpr float kEps = 1e-6f;          // RMSNorm epsilon
// Gated DeltaNet: in_proj rows = q | k | v (conv_dim) | z [Hv*Dv] | b [Hv] | a [Hv].
constexpr int kHk = 16, kHv = 32, kDh = 128, kConv = 2 * kHk * kDh + kHv * kDh, kGdnRows = kConv + kHv * kDh + 2 * kHv;
// Gated attention: qkv rows = per query head D query + D gate | k | v.
constexpr int kHq = 16, kHkv = 2, kD = 256, kRot = 64, kAttnRows = 2 * kHq * kD + 2 * kHkv * kD;
constexpr double kRopeTheta = 1e7;
// MoE: experts, top-k, expert and shared-expert widths.
constexpr int kE = 256, kTopK = 8, kI = 512, kIs = 512;
// Prefill: prompt tokens of one chunk.
constexpr int kT = 4096;

// -exp(A_log) of the Gated DeltaNet heads: a spread of decay rates.
inline std::vector<float> gdn_neg_A() {
  std::vector<float> v(kHv);
  for (int h = 0; h < kHv; ++h) v[h] = -(0.5f + 0.05f * h);
  return v;
}

inline std::string dims(long a, long b) { return std::to_string(a) + "x" + std::to_string(b); }

// x [kH] staged as a decode kernel's prologue does: RMSNorm with random weights near 1.
inline cuda::XSpec rmsnorm_of(Arena& A, const float* x) {
  cuda::XSpec X;
  X.mode = cuda::XMode::RmsNorm;
  X.x = x;
  X.w = A.near_one(kH);
  X.eps = kEps;
  return X;
}

}  // namespace lily::bench
