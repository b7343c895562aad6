// The attention mixer between its projections (MODEL.md §4.4 steps 3-6): per-head q/k norms,
// partial RoPE, the new keys and values appended to the cache, causal GQA, the sigmoid gate.
#include <algorithm>
#include <cmath>
#include <vector>

#include "check.h"
#include "ops.h"
#include "vec.h"

namespace lily::cpu {

void gated_attention(const ops::GatedAttention& a) {
  const int64_t T = a.T, Hq = a.Hq, Hkv = a.Hkv, D = a.D;
  check(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "gated_attention", "query heads ", str(Hq),
        " must be a multiple of KV heads ", str(Hkv));
  check(D > 0 && T >= 0 && a.pos0 >= 0 && a.rotary_dim >= 0 && a.rotary_dim <= D && a.rotary_dim % 2 == 0,
        "gated_attention", "bad shape: T ", str(T), ", pos0 ", str(a.pos0), ", D ", str(D), ", rotary_dim ",
        str(a.rotary_dim));
  if (T == 0) return;
  std::vector<float> q(T * Hq * D);
  for (int64_t i = 0; i < T * Hq; ++i) std::copy_n(a.qg + i * 2 * D, D, q.data() + i * D);
  // k and v may already sit in the cache rows (the CPU mixer projects straight into them).
  float* k_new = a.k_cache + a.pos0 * Hkv * D;
  float* v_new = a.v_cache + a.pos0 * Hkv * D;
  if (a.k != k_new) std::copy_n(a.k, T * Hkv * D, k_new);
  if (a.v != v_new) std::copy_n(a.v, T * Hkv * D, v_new);
  rmsnorm({q.data(), T * Hq, D, a.q_norm, a.eps, q.data()});
  rmsnorm({k_new, T * Hkv, D, a.k_norm, a.eps, k_new});
  rope({q.data(), T, Hq, D, a.rotary_dim, a.pos0, a.theta});
  rope({k_new, T, Hkv, D, a.rotary_dim, a.pos0, a.theta});
  attention({q.data(), a.k_cache, a.v_cache, T, a.pos0, Hq, Hkv, D, 1.0f / std::sqrt(static_cast<float>(D)), a.out});
  for (int64_t i = 0; i < T * Hq; ++i) {
    const float* gate = a.qg + i * 2 * D + D;
    float* o = a.out + i * D;
    for (int64_t d = 0; d < D; ++d) o[d] *= sigmoid(gate[d]);
  }
}

}  // namespace lily::cpu
