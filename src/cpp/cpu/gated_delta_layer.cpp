// One Gated DeltaNet mixer over a chunk of T tokens (MODEL.md §4.5):
//   mixed = x in_proj_qkv^T [T, 2*Hk*Dk + Hv*Dv]   z = x in_proj_z^T [T, Hv*Dv]
//   a, b  = x in_proj_a^T, x in_proj_b^T [T, Hv]
//   c = silu(causal_conv(mixed)), split flat into q [T,Hk,Dk] | k [T,Hk,Dk] | v [T,Hv,Dv]
//   q = l2norm(q) * Dk^-0.5, k = l2norm(k); o = gated delta rule(q, k, v, g, beta)
//   out = (rmsnorm(o) * norm * silu(z)) out_proj^T
#include <algorithm>
#include <cmath>

#include "check.h"
#include "layers.h"
#include "ops.h"

namespace lily::cpu {

void GdnState::reset(const ModelConfig& c) {
  conv.assign((c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim(), 0.0f);
  recurrent.assign(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim, 0.0f);
}

void gated_delta_mixer(const GdnWeights& w, const ModelConfig& c, const float* x, int64_t T, GdnState& state,
                       GdnBuffers& buf, float* out, const GdnStateRows* rows) {
  const int64_t H = c.hidden_size, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim, Kc = c.linear_conv_kernel_dim;
  const int64_t key_dim = Hk * Dk, value_dim = Hv * Dv, conv_dim = c.gdn_conv_dim();
  check(w.in_proj_qkv.rows == conv_dim && w.in_proj_z.rows == value_dim && w.in_proj_a.rows == Hv &&
            w.in_proj_b.rows == Hv && w.out_proj.rows == H && w.out_proj.cols == value_dim &&
            w.in_proj_qkv.cols == H,
        "gated_delta_mixer", "projection shapes do not match the config");
  check(w.conv1d.values.size() == static_cast<size_t>(conv_dim * Kc) && w.norm.values.size() == static_cast<size_t>(Dv) &&
            w.A_log.values.size() == static_cast<size_t>(Hv) && w.dt_bias.values.size() == static_cast<size_t>(Hv),
        "gated_delta_mixer", "conv1d, norm, A_log or dt_bias has the wrong size");
  check(state.conv.size() == static_cast<size_t>((Kc - 1) * conv_dim) &&
            state.recurrent.size() == static_cast<size_t>(Hv * Dk * Dv),
        "gated_delta_mixer", "the state is not sized for this layer");
  if (T == 0) return;

  buf.mixed.resize(T * conv_dim);
  buf.conv_out.resize(T * conv_dim);
  buf.z.resize(T * value_dim);
  buf.a.resize(T * Hv);
  buf.b.resize(T * Hv);
  const QMatmul projections[] = {{x, T, w.in_proj_qkv, buf.mixed.data()},
                                 {x, T, w.in_proj_z, buf.z.data()},
                                 {x, T, w.in_proj_a, buf.a.data()},
                                 {x, T, w.in_proj_b, buf.b.data()}};
  qmatmul_batch(projections);

  const int64_t conv_state = (Kc - 1) * conv_dim, recurrent_state = Hv * Dk * Dv;
  const int64_t step = rows ? 1 : T;  // tokens a conv / delta-rule call
  for (int64_t t = 0; t < T; t += step) {
    gated_delta_conv({buf.mixed.data() + t * conv_dim, step, conv_dim, w.conv1d.values.data(), Kc, state.conv.data(),
                      buf.conv_out.data() + t * conv_dim});
    if (rows && t + 1 < T) std::copy_n(state.conv.data(), conv_state, rows->conv + t * conv_state);
  }

  buf.q.resize(T * key_dim);
  buf.k.resize(T * key_dim);
  buf.v.resize(T * value_dim);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = buf.conv_out.data() + t * conv_dim;
    std::copy_n(row, key_dim, buf.q.data() + t * key_dim);
    std::copy_n(row + key_dim, key_dim, buf.k.data() + t * key_dim);
    std::copy_n(row + 2 * key_dim, value_dim, buf.v.data() + t * value_dim);
  }
  l2norm({buf.q.data(), T * Hk, Dk, 1e-6f, 1.0f / std::sqrt(static_cast<float>(Dk))});
  l2norm({buf.k.data(), T * Hk, Dk, 1e-6f, 1.0f});

  buf.g.resize(T * Hv);
  buf.beta.resize(T * Hv);
  gated_delta_gates({buf.a.data(), buf.b.data(), T, Hv, w.A_log.values.data(), w.dt_bias.values.data(),
                     buf.g.data(), buf.beta.data()});

  buf.o.resize(T * value_dim);
  for (int64_t t = 0; t < T; t += step) {
    gated_delta({buf.q.data() + t * key_dim, buf.k.data() + t * key_dim, buf.v.data() + t * value_dim,
                 buf.g.data() + t * Hv, buf.beta.data() + t * Hv, step, Hk, Hv, Dk, Dv, state.recurrent.data(),
                 buf.o.data() + t * value_dim});
    if (rows && t + 1 < T) std::copy_n(state.recurrent.data(), recurrent_state, rows->recurrent + t * recurrent_state);
  }
  gated_rmsnorm({buf.o.data(), buf.z.data(), T * Hv, Dv, w.norm.values.data(), c.rms_norm_eps, buf.o.data()});
  qmatmul({buf.o.data(), T, w.out_proj, out});
}

}  // namespace lily::cpu
