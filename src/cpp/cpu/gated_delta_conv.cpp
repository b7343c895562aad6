// Causal depthwise conv over time + SiLU, the short conv of Gated DeltaNet (MODEL.md §4.5
// step 2). With the input extended by the state, u = state ++ x ([Kc-1+T, C]):
//   y[t, c] = silu(sum_{j<Kc} w[c, j] * u[t + j, c])
// so tap Kc-1 multiplies the current token x[t]. The new state is the last Kc-1 rows of u.
#include <algorithm>
#include <vector>

#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {

void gated_delta_conv(const ops::GatedDeltaConv& args) {
  const auto& [x, T, C, w, Kc, state, y] = args;
  check(Kc >= 1 && C > 0 && T >= 0, "gated_delta_conv", "bad shape: T ", str(T), ", channels ", str(C),
        ", kernel ", str(Kc));
  check(w && (Kc == 1 || state) && (T == 0 || (x && y)), "gated_delta_conv", "missing input, weight, state or output");
  check(T == 0 || x != y, "gated_delta_conv", "the output must not alias the input");
  const int64_t S = Kc - 1;  // rows of state
  // Row i of u (i < S + T), a pointer into the state or into x.
  auto u_row = [&](int64_t i) { return i < S ? state + i * C : x + (i - S) * C; };

  // Channels in blocks of 256; each block walks all tokens, so loads run along c.
  constexpr int64_t kBlock = 256;
  parallel_for((C + kBlock - 1) / kBlock, T * kBlock * (Kc + kExpWork), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
      for (int64_t t = 0; t < T; ++t) {
        float* yt = y + t * C;
        for (int64_t c = c0; c < c1; ++c) yt[c] = 0.0f;
        for (int64_t j = 0; j < Kc; ++j) {
          const float* ut = u_row(t + j);
          for (int64_t c = c0; c < c1; ++c) yt[c] += w[c * Kc + j] * ut[c];
        }
        for (int64_t c = c0; c < c1; ++c) yt[c] = silu(yt[c]);
      }
    }
  });

  // New state: rows T .. T+S-1 of u. Copy in increasing order: a row moving within the
  // state only ever moves to a lower index, so it is read before being overwritten.
  for (int64_t i = 0; i < S; ++i) {
    const float* src = u_row(T + i);
    if (src != state + i * C) std::copy(src, src + C, state + i * C);
  }
}

}  // namespace lily::cpu
