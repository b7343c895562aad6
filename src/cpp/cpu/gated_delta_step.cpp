// The Gated DeltaNet mixer between its projections (MODEL.md §4.5 steps 2-6): the causal conv
// + SiLU, l2-normalised q/k, the gates, the delta rule and the gated RMSNorm.
#include <algorithm>
#include <cmath>
#include <vector>

#include "check.h"
#include "ops.h"

namespace lily::cpu {

void gated_delta_step(const ops::GatedDeltaStep& s) {
  const int64_t T = s.T, Hk = s.Hk, Hv = s.Hv, Dk = s.Dk, Dv = s.Dv, Kc = s.Kc;
  check(Hk > 0 && Hv % Hk == 0 && Dk > 0 && Dv > 0 && Kc > 0 && T >= 0, "gated_delta_step", "bad shape: T ", str(T),
        ", Hk ", str(Hk), ", Hv ", str(Hv), ", Dk ", str(Dk), ", Dv ", str(Dv), ", Kc ", str(Kc));
  check(!s.conv_rows == !s.state_rows, "gated_delta_step", "conv_rows and state_rows are kept together");
  if (T == 0) return;
  const int64_t key_dim = Hk * Dk, value_dim = Hv * Dv, conv_dim = 2 * key_dim + value_dim;
  const int64_t conv_state = (Kc - 1) * conv_dim, recurrent_state = Hv * Dk * Dv;
  const bool rows = s.state_rows;
  const int64_t step = rows ? 1 : T;  // tokens a conv / delta-rule call: both walk the tokens in order

  std::vector<float> c(T * conv_dim);
  for (int64_t t = 0; t < T; t += step) {
    gated_delta_conv({s.mixed + t * conv_dim, step, conv_dim, s.conv_w, Kc, s.conv_state, c.data() + t * conv_dim});
    if (rows && t + 1 < T) std::copy_n(s.conv_state, conv_state, s.conv_rows + t * conv_state);
  }
  std::vector<float> q(T * key_dim), k(T * key_dim), v(T * value_dim);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = c.data() + t * conv_dim;
    std::copy_n(row, key_dim, q.data() + t * key_dim);
    std::copy_n(row + key_dim, key_dim, k.data() + t * key_dim);
    std::copy_n(row + 2 * key_dim, value_dim, v.data() + t * value_dim);
  }
  l2norm({q.data(), T * Hk, Dk, 1e-6f, 1.0f / std::sqrt(static_cast<float>(Dk))});
  l2norm({k.data(), T * Hk, Dk, 1e-6f, 1.0f});

  std::vector<float> g(T * Hv), beta(T * Hv);
  gated_delta_gates({s.a, s.b, T, Hv, s.A_log, s.dt_bias, g.data(), beta.data()});
  for (int64_t t = 0; t < T; t += step) {
    gated_delta({q.data() + t * key_dim, k.data() + t * key_dim, v.data() + t * value_dim, g.data() + t * Hv,
                 beta.data() + t * Hv, step, Hk, Hv, Dk, Dv, s.state, s.out + t * value_dim});
    if (rows && t + 1 < T) std::copy_n(s.state, recurrent_state, s.state_rows + t * recurrent_state);
  }
  gated_rmsnorm({s.out, s.z, T * Hv, Dv, s.norm, s.eps, s.out});
}

}  // namespace lily::cpu
