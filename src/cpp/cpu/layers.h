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
  std::vector<float> mixed, z, a, b, o;
};

struct AttnBuffers {
  std::vector<float> qg, o;
};

struct MoeBuffers {
  std::vector<float> logits, weights, x_sorted, y_sorted, mlp_scratch, shared, shared_gate;
  std::vector<int32_t> experts, slots_by_expert;
  std::vector<int64_t> expert_begin;
  std::vector<MoeExpert> mlps;
};

// Gated DeltaNet (§4.5): projections, causal conv + SiLU, l2-normalised q/k, the delta
// rule over the chunk, gated RMSNorm, out_proj. state carries across chunks.
// With rows (a verify's slots), the state after each token but the last is copied out, conv
// [T-1, (Kc-1) conv_dim] and recurrent [T-1, Hv Dk Dv]; the conv and the delta rule then run a
// token at a time, the same bits (both walk the tokens in order however they are chunked).
struct GdnStateRows {
  float* conv = nullptr;
  float* recurrent = nullptr;
};
void gated_delta_mixer(const GdnWeights& w, const ModelConfig& c, const float* x, int64_t T, GdnState& state,
                       GdnBuffers& buf, float* out, const GdnStateRows* rows = nullptr, const ops::HostOps& kernels = host_ops());

// Gated full attention (§4.4) for tokens at positions pos0 .. pos0+T-1; the cache must
// hold exactly pos0 positions and gains T.
void attention_mixer(const AttnWeights& w, const ModelConfig& c, const float* x, int64_t T, int64_t pos0,
                     KvCache& cache, AttnBuffers& buf, float* out, const ops::HostOps& kernels = host_ops());

// Sparse MoE with the sigmoid-gated shared expert (§4.6). Tokens are grouped by expert
// so each routed expert's weights are read once per call.
// expert_load (optional, [E]) accumulates the tokens routed to each expert.
void moe_block(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t T, MoeBuffers& buf, float* out,
               int64_t* expert_load = nullptr);

struct MtpBuffers {
  std::vector<float> e, cat, u, x, mix;
  AttnBuffers attn;
  MoeBuffers moe;
};

// The MTP head (MODEL.md §7) over R rows at positions pos0..pos0+R-1: row r takes the trunk's
// hidden state after its final norm at pos0 + r and the token at pos0 + r + 1,
//   u = fc([rmsnorm(embed(next), pre_fc_norm_embedding), rmsnorm(hidden, pre_fc_norm_hidden)])
// then one full-attention decoder layer on u. The rows' K/V join the head's cache, which
// must hold exactly pos0 positions. With out non-null, the layer is finished (the MoE
// block) and out [R, H] = rmsnorm(u, mtp.norm), which lm_head turns into logits for the
// token after next; without, only the cache is filled (a prompt's rows).
void mtp_head(const ModelWeights& w, const float* hidden, const int32_t* next, int64_t R, int64_t pos0, KvCache& cache,
              MtpBuffers& buf, float* out);

}  // namespace lily::cpu
