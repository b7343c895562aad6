// The sparse MoE block with its shared expert (MODEL.md §4.6):
//   out[t] = sum_{e in topK(t)} w_te * expert_e(x[t]) + sigmoid(x[t] . g_s) * shared(x[t])
// Routed work is grouped by expert: every (token, slot) pair routed to e is gathered
// into one [n_e, H] block, so each expert's weights are dequantized once per call; all
// experts' MLPs run as one batch (moe_experts), and results are added back per token in
// ascending expert order (the order depends neither on the chunking of the prompt nor
// on the threads).
#include <algorithm>
#include <vector>

#include "check.h"
#include "layers.h"
#include "ops.h"
#include "vec.h"

namespace lily::cpu {
namespace {

void check_matrix(const QWeight& w, int64_t experts, int64_t rows, int64_t cols, const char* name) {
  check_qweight(w, "moe_block", name);
  check(w.experts == experts && w.rows == rows && w.cols == cols, "moe_block", name, " is [", str(w.experts), ", ",
        str(w.rows), ", ", str(w.cols), "], expected [", str(experts), ", ", str(rows), ", ", str(cols), "]");
}

}  // namespace

void check_moe_weights(const MoeWeights& w, const ModelConfig& c) {
  const int64_t H = c.hidden_size, E = c.num_experts;
  const int64_t I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  check(c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= E, "moe_block", "top_k ", str(c.num_experts_per_tok),
        " must be in [1, ", str(E), "]");
  check_matrix(w.router, 1, E, H, "router");
  check_matrix(w.gate_proj, E, I, H, "gate_proj");
  check_matrix(w.up_proj, E, I, H, "up_proj");
  check_matrix(w.down_proj, E, H, I, "down_proj");
  check_matrix(w.shared_gate_proj, 1, Is, H, "shared_expert.gate_proj");
  check_matrix(w.shared_up_proj, 1, Is, H, "shared_expert.up_proj");
  check_matrix(w.shared_down_proj, 1, H, Is, "shared_expert.down_proj");
  check_matrix(w.shared_expert_gate, 1, 1, H, "shared_expert_gate");
}

void moe_block(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, MoeBuffers& buf, float* out,
               int64_t* expert_load) {
  const int64_t H = c.hidden_size, E = c.num_experts, K = c.num_experts_per_tok;
  const int64_t I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  check_moe_weights(w, c);
  if (T == 0) return;

  // Route: experts/weights [T, K].
  buf.logits.resize(T * E);
  buf.experts.resize(T * K);
  buf.weights.resize(T * K);
  qmatmul({x, T, w.router, buf.logits.data()});
  moe_router({buf.logits.data(), T, E, K, c.norm_topk_prob, buf.experts.data(), buf.weights.data()});

  // Counting sort of the T*K slots by expert: slots of expert e are
  // slots_by_expert[expert_begin[e] .. expert_begin[e+1]), each slot index = t*K + k.
  buf.expert_begin.assign(E + 1, 0);
  for (int64_t s = 0; s < T * K; ++s) ++buf.expert_begin[buf.experts[s] + 1];
  if (expert_load)
    for (int64_t e = 0; e < E; ++e) expert_load[e] += buf.expert_begin[e + 1];
  for (int64_t e = 0; e < E; ++e) buf.expert_begin[e + 1] += buf.expert_begin[e];
  buf.slots_by_expert.resize(T * K);
  {
    std::vector<int64_t> next(buf.expert_begin.begin(), buf.expert_begin.end() - 1);
    for (int64_t s = 0; s < T * K; ++s) buf.slots_by_expert[next[buf.experts[s]]++] = static_cast<int32_t>(s);
  }

  // The slots gathered in that order: expert e's tokens are rows expert_begin[e].. of x_sorted.
  const int64_t slots = T * K;
  buf.x_sorted.resize(slots * H);
  buf.y_sorted.resize(slots * H);
  for (int64_t i = 0; i < slots; ++i)
    std::copy_n(x + (buf.slots_by_expert[i] / K) * H, H, buf.x_sorted.data() + i * H);

  // Every routed expert with tokens, and the shared expert, in one batch.
  buf.shared.resize(T * H);
  buf.mlps.clear();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = buf.expert_begin[e], n = buf.expert_begin[e + 1] - begin;
    if (n > 0)
      buf.mlps.push_back({buf.x_sorted.data() + begin * H, n, w.gate_proj.expert(e), w.up_proj.expert(e),
                           w.down_proj.expert(e), buf.y_sorted.data() + begin * H});
  }
  buf.mlps.push_back({x, T, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj, buf.shared.data()});
  moe_experts(buf.mlps, buf.mlp_scratch);

  // out[t]: its routed slots weighted, in ascending expert order, then the shared expert
  // gated per token by sigmoid(x[t] . shared_expert_gate).
  std::fill(out, out + T * H, 0.0f);
  for (int64_t i = 0; i < slots; ++i) {
    const int32_t s = buf.slots_by_expert[i];
    axpy(buf.weights[s], buf.y_sorted.data() + i * H, out + (s / K) * H, H);
  }
  buf.shared_gate.resize(T);
  qmatmul({x, T, w.shared_expert_gate, buf.shared_gate.data()});
  for (int64_t t = 0; t < T; ++t) axpy(sigmoid(buf.shared_gate[t]), buf.shared.data() + t * H, out + t * H, H);
}

}  // namespace lily::cpu
