// The three blocks of a decoder layer, composed from the ops in ops.h (MODEL.md §4.4-4.6).
// Each reads x [T, H] (already normed) and writes out [T, H]; the residual adds are the
// caller's. Temporaries live in *Buffers structs that grow on demand and are reused.
#pragma once
#include <cstdint>
#include <vector>

#include "config.h"
#include "ops.h"
#include "weights.h"

namespace lily::cpu {

// One Gated DeltaNet layer's sequence state.
struct GdnState {
  std::vector<float> conv;       // [Kc-1, conv_dim]: the last pre-conv rows of in_proj_qkv
  std::vector<float> recurrent;  // [Hv, Dk, Dv]
  void reset(const ModelConfig& c);  // zeros, sized for c
};

// One attention layer's KV cache: [positions, Hkv, D] each, grown as tokens arrive.
struct KvCache {
  std::vector<float> k, v;
};

struct GdnBuffers {
  std::vector<float> mixed, conv_out, q, k, v, z, a, b, g, beta, o;
};

struct AttnBuffers {
  std::vector<float> qg, q, o;
};

struct MoeBuffers {
  std::vector<float> logits, weights, x_sorted, y_sorted, mlp_scratch, shared, shared_gate;
  std::vector<int32_t> experts, slots_by_expert;
  std::vector<int64_t> expert_begin;
  std::vector<MoeExpert> mlps;
};

// Gated DeltaNet (§4.5): projections, causal conv + SiLU, l2-normalised q/k, the delta
// rule over the chunk, gated RMSNorm, out_proj. state carries across chunks.
void gated_delta_mixer(const GdnWeights& w, const ModelConfig& c, const float* x, int64_t T, GdnState& state,
                       GdnBuffers& buf, float* out);

// Gated full attention (§4.4) for tokens at positions pos0 .. pos0+T-1; the cache must
// hold exactly pos0 positions and gains T.
void attention_mixer(const AttnWeights& w, const ModelConfig& c, const float* x, int64_t T, int64_t pos0,
                     KvCache& cache, AttnBuffers& buf, float* out);

// Sparse MoE with the sigmoid-gated shared expert (§4.6). Tokens are grouped by expert
// so each routed expert's weights are read once per call.
// expert_load (optional, [E]) accumulates the tokens routed to each expert.
void moe_block(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, MoeBuffers& buf, float* out,
               int64_t* expert_load = nullptr);

}  // namespace lily::cpu
