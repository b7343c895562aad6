// The MTP head's forward (MODEL.md §7): fc over the normed next-token embedding and the normed
// trunk state, one full-attention decoder layer with its own KV cache, then mtp.norm.
#include <algorithm>

#include "check.h"
#include "layers.h"
#include "ops.h"

namespace lily::cpu {

void mtp_head(const ModelWeights& w, const float* hidden, const int32_t* next, int64_t R, int64_t pos0, KvCache& cache,
              MtpBuffers& buf, float* out) {
  check(w.has_mtp, "mtp_head", "the checkpoint has no MTP head");
  if (R == 0) return;
  const ModelConfig& c = w.config;
  const MtpWeights& m = w.mtp;
  const LayerWeights& L = m.layer;
  const int64_t H = c.hidden_size;
  const float eps = c.rms_norm_eps;
  buf.e.resize(R * H);
  buf.cat.resize(R * 2 * H);
  buf.u.resize(R * H);
  buf.x.resize(R * H);
  buf.mix.resize(R * H);

  // cat = [rmsnorm(embed(next)) | rmsnorm(hidden)] per row: the embedding half first.
  auto to_half = [&](int64_t half) {
    for (int64_t r = 0; r < R; ++r) std::copy_n(buf.x.data() + r * H, H, buf.cat.data() + (2 * r + half) * H);
  };
  embedding({w.embed, next, R, buf.e.data()});
  rmsnorm({buf.e.data(), R, H, m.pre_fc_norm_embedding.values.data(), eps, buf.x.data()});
  to_half(0);
  rmsnorm({hidden, R, H, m.pre_fc_norm_hidden.values.data(), eps, buf.x.data()});
  to_half(1);
  qmatmul({buf.cat.data(), R, m.fc, buf.u.data()});

  float* u = buf.u.data();
  rmsnorm({u, R, H, L.input_norm.values.data(), eps, buf.x.data()});
  attention_mixer(L.attn, c, buf.x.data(), R, pos0, cache, buf.attn, buf.mix.data());
  if (!out) return;  // the cache has the rows' K/V
  for (int64_t i = 0; i < R * H; ++i) u[i] += buf.mix[i];
  rmsnorm({u, R, H, L.post_norm.values.data(), eps, buf.x.data()});
  moe_block(L.moe, c, buf.x.data(), R, buf.moe, buf.mix.data());
  for (int64_t i = 0; i < R * H; ++i) u[i] += buf.mix[i];
  rmsnorm({u, R, H, m.norm.values.data(), eps, out});
}

}  // namespace lily::cpu
