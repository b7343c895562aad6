// One Gated DeltaNet mixer over a chunk of T tokens (MODEL.md §4.5):
//   mixed = x in_proj_qkv^T [T, 2*Hk*Dk + Hv*Dv]   z = x in_proj_z^T [T, Hv*Dv]
//   a, b  = x in_proj_a^T, x in_proj_b^T [T, Hv]
//   c = silu(causal_conv(mixed)), split flat into q [T,Hk,Dk] | k [T,Hk,Dk] | v [T,Hv,Dv]
//   q = l2norm(q) * Dk^-0.5, k = l2norm(k); o = gated delta rule(q, k, v, g, beta)
//   out = (rmsnorm(o) * norm * silu(z)) out_proj^T
#include <algorithm>

#include "check.h"
#include "layers.h"
#include "ops.h"

namespace lily::cpu {

void GdnState::reset(const ModelConfig& c) {
  conv.assign((c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim(), 0.0f);
  recurrent.assign(c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim, 0.0f);
}

void gated_delta_mixer(const GdnWeights& w, const ModelConfig& c, const float* x, int64_t T, GdnState& state,
                       GdnBuffers& buf, float* out, const GdnStateRows* rows, const ops::HostOps& kernels) {
  const int64_t H = c.hidden_size, Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int64_t Dk = c.linear_key_head_dim, Dv = c.linear_value_head_dim, Kc = c.linear_conv_kernel_dim;
  const int64_t value_dim = Hv * Dv, conv_dim = c.gdn_conv_dim();
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
  buf.z.resize(T * value_dim);
  buf.a.resize(T * Hv);
  buf.b.resize(T * Hv);
  const QMatmul projections[] = {{x, T, w.in_proj_qkv, buf.mixed.data()},
                                 {x, T, w.in_proj_z, buf.z.data()},
                                 {x, T, w.in_proj_a, buf.a.data()},
                                 {x, T, w.in_proj_b, buf.b.data()}};
  kernels.qmatmul_batch(std::span<const QMatmul>(projections));

  buf.o.resize(T * value_dim);
  kernels.gated_delta_step({buf.mixed.data(), buf.z.data(), buf.b.data(), buf.a.data(), w.conv1d.values.data(),
                            w.A_log.values.data(), w.dt_bias.values.data(), w.norm.values.data(), T, Hk, Hv, Dk,
                            Dv, Kc, c.rms_norm_eps, state.conv.data(), state.recurrent.data(), buf.o.data(),
                            rows ? rows->conv : nullptr, rows ? rows->recurrent : nullptr});
  kernels.qmatmul({buf.o.data(), T, w.out_proj, out});
}

}  // namespace lily::cpu
