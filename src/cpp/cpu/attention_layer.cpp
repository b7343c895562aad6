// One gated full-attention mixer over a chunk of T tokens at positions pos0.. (MODEL.md §4.4):
//   qg = x q_proj^T [T, Hq, 2D]: per head D query values, then D gate values
//   k, v = x k_proj^T, x v_proj^T [T, Hkv, D], appended to the cache
//   q, k: per-head RMSNorm (q_norm, k_norm), then partial RoPE
//   o = causal GQA(q, cache) * sigmoid(gate);  out = o o_proj^T
#include <algorithm>
#include <cmath>

#include "check.h"
#include "layers.h"
#include "ops.h"
#include "vec.h"

namespace lily::cpu {

void attention_mixer(const AttnWeights& w, const ModelConfig& c, const float* x, int64_t T, int64_t pos0,
                     KvCache& cache, AttnBuffers& buf, float* out, const ops::HostOps& kernels) {
  const int64_t H = c.hidden_size, Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  check(w.q_proj.rows == 2 * Hq * D && w.k_proj.rows == Hkv * D && w.v_proj.rows == Hkv * D &&
            w.o_proj.rows == H && w.o_proj.cols == Hq * D && w.q_proj.cols == H,
        "attention_mixer", "projection shapes do not match the config");
  check(w.q_norm.values.size() == static_cast<size_t>(D) && w.k_norm.values.size() == static_cast<size_t>(D),
        "attention_mixer", "q_norm or k_norm has the wrong size");
  const size_t cached = static_cast<size_t>(pos0 * Hkv * D);
  check(cache.k.size() == cached && cache.v.size() == cached, "attention_mixer", "the KV cache holds ",
        str(static_cast<int64_t>(cache.k.size() / (Hkv * D))), " positions, expected ", str(pos0));
  if (T == 0) return;

  // New keys and values go straight into the cache rows pos0 .. pos0+T-1, and are normed
  // and roped there by gated_attention.
  buf.qg.resize(T * 2 * Hq * D);
  cache.k.resize(cached + T * Hkv * D);
  cache.v.resize(cached + T * Hkv * D);
  float* k_new = cache.k.data() + cached;
  float* v_new = cache.v.data() + cached;
  const QMatmul projections[] = {{x, T, w.q_proj, buf.qg.data()}, {x, T, w.k_proj, k_new}, {x, T, w.v_proj, v_new}};
  kernels.qmatmul_batch(std::span<const QMatmul>(projections));
  buf.o.resize(T * Hq * D);
  kernels.gated_attention({buf.qg.data(), k_new, v_new, w.q_norm.values.data(), w.k_norm.values.data(),
                           cache.k.data(), cache.v.data(), T, pos0, Hq, Hkv, D, c.rotary_dim(), c.rope_theta,
                           c.rms_norm_eps, buf.o.data()});
  kernels.qmatmul({buf.o.data(), T, w.o_proj, out});
}

}  // namespace lily::cpu
