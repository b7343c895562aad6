// The gated delta rule, the recurrence of Gated DeltaNet (MODEL.md §4.5 step 7), one
// token at a time in fp32. Per value head h, with key head hk = h / (Hv/Hk) and state
// S [Dk, Dv]:
//   S     = exp(g_t) * S              decay first
//   kv    = S^T k_t                   [Dv], what S currently recalls for k_t
//   delta = (v_t - kv) * beta_t
//   S     = S + k_t (x) delta         rank-1 write
//   o_t   = S^T q_t                   read after the write
// Two sweeps over S per token (decay + recall, then write + read), each along rows of Dv
// so the inner loops vectorise. Heads are independent: one thread walks a head's tokens.
#include <algorithm>
#include <cmath>
#include <vector>

#include "check.h"
#include "ops.h"
#include "threadpool.h"

namespace lily::cpu {

void gated_delta(const ops::GatedDelta& args) {
  const auto& [q, k, v, g, beta, T, Hk, Hv, Dk, Dv, state, o] = args;
  check(Hk > 0 && Hv > 0 && Hv % Hk == 0, "gated_delta", "value heads ", str(Hv),
        " must be a multiple of key heads ", str(Hk));
  check(Dk > 0 && Dv > 0 && T >= 0, "gated_delta", "bad shape: T ", str(T), ", Dk ", str(Dk), ", Dv ", str(Dv));
  check(state && (T == 0 || (q && k && v && g && beta && o)), "gated_delta", "missing input, state or output");
  const int64_t group = Hv / Hk;
  parallel_for(Hv, 4 * T * Dk * Dv, [&](int64_t h0, int64_t h1) {
    std::vector<float> kv(Dv), delta(Dv);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t hk = h / group;
      float* S = state + h * Dk * Dv;
      for (int64_t t = 0; t < T; ++t) {
        const float* kt = k + (t * Hk + hk) * Dk;
        const float* qt = q + (t * Hk + hk) * Dk;
        const float* vt = v + (t * Hv + h) * Dv;
        float* ot = o + (t * Hv + h) * Dv;
        const float decay = std::exp(g[t * Hv + h]), b = beta[t * Hv + h];

        std::fill(kv.begin(), kv.end(), 0.0f);
        for (int64_t i = 0; i < Dk; ++i) {
          float* Si = S + i * Dv;
          const float ki = kt[i];
          for (int64_t j = 0; j < Dv; ++j) {
            Si[j] *= decay;
            kv[j] += Si[j] * ki;
          }
        }
        for (int64_t j = 0; j < Dv; ++j) delta[j] = (vt[j] - kv[j]) * b;

        std::fill(ot, ot + Dv, 0.0f);
        for (int64_t i = 0; i < Dk; ++i) {
          float* Si = S + i * Dv;
          const float ki = kt[i], qi = qt[i];
          for (int64_t j = 0; j < Dv; ++j) {
            Si[j] += ki * delta[j];
            ot[j] += Si[j] * qi;
          }
        }
      }
    }
  });
}

}  // namespace lily::cpu
