// MoE router (MODEL.md §4.6 steps 1-2): p = softmax(logits) over all E experts in fp32,
// the K most probable experts (equal p: the lower expert index first), and their
// probabilities, divided by their sum when renormalize (norm_topk_prob).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {

void moe_router(const ops::MoeRouter& args) {
  const auto& [logits, T, E, K, renormalize, experts, weights] = args;
  check(E > 0 && K > 0 && K <= E && T >= 0, "moe_router", "need 0 < K <= E, got K ", str(K), ", E ", str(E));
  check(T == 0 || (logits && experts && weights), "moe_router", "missing input or output");
  // Per token: E exps, then a partial sort of E candidates.
  parallel_for(T, E * (kExpWork + 8), [&](int64_t t0, int64_t t1) {
    std::vector<float> p(E);
    std::vector<int32_t> order(E);
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = logits + t * E;
      const float m = *std::max_element(l, l + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(l[e] - m);
      for (int64_t e = 0; e < E; ++e) p[e] /= sum;

      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(),
                        [&](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      float top_sum = 0.0f;
      for (int64_t i = 0; i < K; ++i) top_sum += p[order[i]];
      for (int64_t i = 0; i < K; ++i) {
        experts[t * K + i] = order[i];
        weights[t * K + i] = renormalize ? p[order[i]] / top_sum : p[order[i]];
      }
    }
  });
}

}  // namespace lily::cpu
