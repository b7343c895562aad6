// Causal grouped-query attention over the KV cache (MODEL.md §4.4 step 5), fp32.
// Query t of the chunk sits at position p = pos0 + t and sees keys 0..p:
//   s_j = scale * q . k_j,   out = sum_j softmax(s)_j v_j
// Query head h reads KV head h / (Hq/Hkv). Work items are (head, token) pairs in
// head-major order, so each thread's share of causal work is about even.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {

void attention(const ops::Attention& args) {
  const auto& [q, k, v, T, pos0, Hq, Hkv, D, scale, out] = args;
  check(Hq > 0 && Hkv > 0 && Hq % Hkv == 0, "attention", "query heads ", str(Hq), " must be a multiple of KV heads ",
        str(Hkv));
  check(D > 0 && T >= 0 && pos0 >= 0, "attention", "bad shape: T ", str(T), ", pos0 ", str(pos0), ", D ", str(D));
  check(T == 0 || (q && k && v && out), "attention", "missing input or output");
  const int64_t group = Hq / Hkv;
  // A query sees pos0 + t + 1 keys: on average pos0 + (T + 1) / 2, each a dot, an exp and an axpy.
  const int64_t item_work = (pos0 + (T + 1) / 2) * (2 * D + kExpWork);
  parallel_for(Hq * T, item_work, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(pos0 + T);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / T, t = i % T, kvh = h / group, keys = pos0 + t + 1;
      const float* qh = q + (t * Hq + h) * D;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < keys; ++j) {
        p[j] = scale * dot(qh, k + (j * Hkv + kvh) * D, D);
        m = std::max(m, p[j]);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < keys; ++j) {
        p[j] = std::exp(p[j] - m);
        sum += p[j];
      }
      float* oh = out + (t * Hq + h) * D;
      std::fill(oh, oh + D, 0.0f);
      for (int64_t j = 0; j < keys; ++j) axpy(p[j], v + (j * Hkv + kvh) * D, oh, D);
      const float inv_sum = 1.0f / sum;
      for (int64_t d = 0; d < D; ++d) oh[d] *= inv_sum;
    }
  });
}

}  // namespace lily::cpu
