// moe_router: softmax over the E logits of a token, then the K largest probabilities (ties:
// the lower expert first), divided by their sum when renormalize (contract: src/cpp/ops/moe.h).
// One simdgroup a token, grid (T): lane l holds experts l, l + 32, ... (E <= 32 PER_LANE).
// Each of the K rounds is an argmax across the lanes: simd_max of the lanes' best
// probability, then simd_min of the expert among the lanes holding it; its lane marks it taken.
#include <metal_stdlib>
using namespace metal;

constant constexpr uint PER_LANE = 16;  // E <= 512

kernel void moe_router_topk(device const float* logits [[buffer(0)]],
                            device int* experts [[buffer(1)]],
                            device float* weights [[buffer(2)]],
                            constant uint& E [[buffer(3)]],
                            constant uint& K [[buffer(4)]],
                            constant uint& renormalize [[buffer(5)]],
                            uint t [[threadgroup_position_in_grid]],
                            uint lane [[thread_index_in_simdgroup]]) {
  device const float* l = logits + size_t(t) * E;
  float p[PER_LANE];
  bool taken[PER_LANE];  // also every slot past E
  float m = -INFINITY;
  for (uint i = 0; i < PER_LANE; ++i) {
    const uint e = lane + 32 * i;
    taken[i] = e >= E;
    p[i] = taken[i] ? 0.0f : l[e];
    if (!taken[i]) m = max(m, p[i]);
  }
  m = simd_max(m);
  float sum = 0.0f;
  for (uint i = 0; i < PER_LANE; ++i)
    if (!taken[i]) sum += p[i] = exp(p[i] - m);
  sum = simd_sum(sum);
  for (uint i = 0; i < PER_LANE; ++i) p[i] /= sum;

  float chosen_sum = 0.0f;
  for (uint r = 0; r < K; ++r) {
    float best = -1.0f;
    uint best_e = 0xffffffffu;
    for (uint i = 0; i < PER_LANE; ++i)
      if (!taken[i] && p[i] > best) best = p[i], best_e = lane + 32 * i;  // i ascending: the lower expert on ties
    const float top = simd_max(best);
    const uint winner = simd_min(best == top ? best_e : 0xffffffffu);
    if (winner % 32 == lane) taken[winner / 32] = true;
    chosen_sum += top;
    if (lane == 0) {
      experts[size_t(t) * K + r] = int(winner);
      weights[size_t(t) * K + r] = top;
    }
  }
  if (lane == 0 && renormalize != 0)
    for (uint r = 0; r < K; ++r) weights[size_t(t) * K + r] /= chosen_sum;
}
