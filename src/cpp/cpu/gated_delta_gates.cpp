// Gated DeltaNet gates per token and value head (MODEL.md §4.5 step 5):
//   g    = -exp(A_log) * softplus(a + dt_bias)   (log-decay <= 0; the decay is exp(g))
//   beta = sigmoid(b)
#include <cmath>

#include "check.h"
#include "ops.h"
#include "vec.h"

namespace lily::cpu {

void gated_delta_gates(const ops::GatedDeltaGates& args) {
  const auto& [a, b, T, Hv, A_log, dt_bias, g, beta] = args;
  check(T >= 0 && Hv > 0, "gated_delta_gates", "bad shape [", str(T), ", ", str(Hv), "]");
  check(A_log && dt_bias && (T == 0 || (a && b && g && beta)), "gated_delta_gates", "missing input or output");
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < Hv; ++h) {
      const int64_t i = t * Hv + h;
      g[i] = -std::exp(A_log[h]) * softplus(a[i] + dt_bias[h]);
      beta[i] = sigmoid(b[i]);
    }
}

}  // namespace lily::cpu
