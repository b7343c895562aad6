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
                     KvCache& cache, AttnBuffers& buf, float* out) {
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

  // New keys and values go straight into the cache rows pos0 .. pos0+T-1.
  buf.qg.resize(T * 2 * Hq * D);
  cache.k.resize(cached + T * Hkv * D);
  cache.v.resize(cached + T * Hkv * D);
  float* k_new = cache.k.data() + cached;
  const QMatmul projections[] = {{x, T, w.q_proj, buf.qg.data()},
                                 {x, T, w.k_proj, k_new},
                                 {x, T, w.v_proj, cache.v.data() + cached}};
  qmatmul_batch(projections);
  buf.q.resize(T * Hq * D);
  for (int64_t i = 0; i < T * Hq; ++i) std::copy_n(buf.qg.data() + i * 2 * D, D, buf.q.data() + i * D);

  rmsnorm({buf.q.data(), T * Hq, D, w.q_norm.values.data(), c.rms_norm_eps, buf.q.data()});
  rmsnorm({k_new, T * Hkv, D, w.k_norm.values.data(), c.rms_norm_eps, k_new});
  rope({buf.q.data(), T, Hq, D, c.rotary_dim(), pos0, c.rope_theta});
  rope({k_new, T, Hkv, D, c.rotary_dim(), pos0, c.rope_theta});

  buf.o.resize(T * Hq * D);
  attention({buf.q.data(), cache.k.data(), cache.v.data(), T, pos0, Hq, Hkv, D, 1.0f / std::sqrt(static_cast<float>(D)),
             buf.o.data()});
  for (int64_t i = 0; i < T * Hq; ++i) {
    const float* gate = buf.qg.data() + i * 2 * D + D;
    float* o = buf.o.data() + i * D;
    for (int64_t d = 0; d < D; ++d) o[d] *= sigmoid(gate[d]);
  }
  qmatmul({buf.o.data(), T, w.o_proj, out});
}

}  // namespace lily::cpu
