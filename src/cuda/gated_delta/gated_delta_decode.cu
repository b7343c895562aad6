#include "gated_delta/gated_delta_decode.h"

#include "common/device_common.cuh"
#include "gated_delta/gated_delta_step.cuh"

namespace lily::cuda {
namespace {

constexpr int kMaxDk = 128;

// Thread t of block (split, h) owns value column v = split*C + t/4 and the keys
// k = 4i + t%4 (i < Dk/4): interleaved so the 4 owners of a column read different banks.
// Its Dk/4 state values are float4 slots j at ((h*S + split) * Dk*C/4 + j*4C + t) * 4.
// The S blocks of a head form a cluster: the gated norm's sum of squares over the head's
// Dv outputs is exchanged through distributed shared memory. T tokens: the convs and q/k
// norms of all T first (they do not depend on the state; one block reduction for the 2T
// sums), then the T delta rules back to back with the state in registers, each exactly as
// a one-token launch, the state after each but the last going to state_rows.
template <int T>
__global__ void __launch_bounds__(128) gated_delta_decode_kernel(GdnArgs a, const int* halt) {
  const int split = blockIdx.x, h = blockIdx.y, t = threadIdx.x;
  const int C = a.Dv / kGdnSplit, nk = a.Dk / 4;
  const int kh = h / (a.Hv / a.Hk);
  const int conv_dim = 2 * a.Hk * a.Dk + a.Hv * a.Dv, proj_rows = conv_dim + a.Hv * a.Dv + 2 * a.Hv;
  __shared__ float qs[T][kMaxDk], ks[T][kMaxDk], vs[T][kMaxDk / kGdnSplit * 4], red[32 * 2 * T], head_ss[T][kGdnSplit];

  // Only the input projection (proj) comes from the kernel launched just before this one;
  // pos, the conv ring and the state were last written a step ago (gated_delta_decode.h), so they
  // and the weights are read before the wait, through L2 (an SM's L1 may be stale).
  const int pos = __ldcg(a.pos);

  // Causal conv + SiLU of this thread's q, k and v channels (at most one each: Dk, C <= 128
  // threads). The q/k channels of a key head are shared by Hv/Hk value heads and all
  // splits; one block writes their ring rows (identical values, no race on reads).
  const ConvRing ring(a.ring, conv_dim, pos);
  ConvWindow tq, tk, tv;
  if (t < a.Dk) {
    tq = ConvWindow::load(a.conv_w, ring, kh * a.Dk + t);
    tk = ConvWindow::load(a.conv_w, ring, a.Hk * a.Dk + kh * a.Dk + t);
  }
  if (t < C) tv = ConvWindow::load(a.conv_w, ring, 2 * a.Hk * a.Dk + h * a.Dv + split * C + t);
  const float dt_bias = a.dt_bias[h], neg_A = a.neg_A[h];

  const int col = t >> 2, kq = t & 3;
  const bool active = col < C;
  const int v_idx = h * a.Dv + split * C + (active ? col : 0);  // this thread's output
  const float norm_w = a.norm_w[split * C + (active ? col : 0)];
  const size_t base = (static_cast<size_t>(h) * kGdnSplit + split) * a.Dk * C / 4;
  const size_t state_floats = static_cast<size_t>(a.Hv) * a.Dk * a.Dv;
  const float4* sin4 = reinterpret_cast<const float4*>(a.state_in) + base;
  float s[kMaxDk / 4];
#pragma unroll
  for (int j = 0; j < kMaxDk / 16; ++j) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (active && j < nk / 4) v = __ldcg(sin4 + j * 4 * C + t);
    s[4 * j] = v.x;
    s[4 * j + 1] = v.y;
    s[4 * j + 2] = v.z;
    s[4 * j + 3] = v.w;
  }

  if (wait_halted(halt)) return;  // uniform: no block is left waiting at a barrier
  cluster_arrive();
  const bool owner = split == 0 && h % (a.Hv / a.Hk) == 0;
  float z[T], beta_in[T], decay_in[T], qk_ss[2 * T];  // qk_ss: token r's sums of q^2, k^2 at 2r, 2r + 1
#pragma unroll
  for (int r = 0; r < T; ++r) {
    const float* proj = a.proj + static_cast<size_t>(r) * proj_rows;
    const int rc = (pos + r) & (kGdnRingRows - 1);  // the ring row of this token's position
    z[r] = proj[conv_dim + v_idx];
    beta_in[r] = proj[conv_dim + a.Hv * a.Dv + h];
    decay_in[r] = proj[conv_dim + a.Hv * a.Dv + a.Hv + h];
    auto conv = [&](ConvWindow& c, int ch, bool write) {
      const float x = proj[ch];
      if (write) a.ring[rc * conv_dim + ch] = x;
      return c.step(x);
    };
    qk_ss[2 * r] = qk_ss[2 * r + 1] = 0.0f;
    if (t < a.Dk) {
      const float q = conv(tq, kh * a.Dk + t, owner), k = conv(tk, a.Hk * a.Dk + kh * a.Dk + t, owner);
      qs[r][t] = q;
      ks[r][t] = k;
      qk_ss[2 * r] = q * q;
      qk_ss[2 * r + 1] = k * k;
    }
    if (t < C) vs[r][t] = conv(tv, 2 * a.Hk * a.Dk + h * a.Dv + split * C + t, true);
  }
  block_sums(qk_ss, red);  // its barriers also publish qs, ks and vs
  timeline_mark(0);  // convs and the q/k sums of squares done

  float o[T], part[T];
#pragma unroll
  for (int r = 0; r < T; ++r) {
    const float beta = sigmoidf_(beta_in[r]), decay = gated_delta_decay(decay_in[r], dt_bias, neg_A);
    o[r] = delta_rule(s, nk, kq, qs[r], ks[r], qk_ss[2 * r], qk_ss[2 * r + 1], a.Dk, decay, beta,
                      active ? vs[r][col] : 0.0f, active);
    float* sout = r == T - 1 ? a.state_out : a.state_rows + r * state_floats;
    float4* sout4 = reinterpret_cast<float4*>(sout) + base;
#pragma unroll
    for (int j = 0; j < kMaxDk / 16; ++j)
      if (active && j < nk / 4) sout4[j * 4 * C + t] = make_float4(s[4 * j], s[4 * j + 1], s[4 * j + 2], s[4 * j + 3]);
    part[r] = active && kq == 0 ? o[r] * o[r] : 0.0f;
  }
  timeline_mark(1);  // the recurrence done

  // Gated RMSNorm over the head (its kGdnSplit blocks form the cluster).
  if constexpr (T == 1) part[0] = block_sum(part[0], red);
  else block_sums(part, red);
  cluster_wait();  // every block of the head has started
  float hinv[T];
  head_inv_rms<T>(part, head_ss, split, a.Dv, a.eps, hinv);
  if (active && kq == 0)
#pragma unroll
    for (int r = 0; r < T; ++r) a.out[static_cast<size_t>(r) * a.Hv * a.Dv + v_idx] = o[r] * hinv[r] * norm_w * siluf_(z[r]);
  timeline_done();
}

}  // namespace

void gated_delta_decode(const GdnArgs& a, const int* halt, cudaStream_t stream, int rows) {
  if (a.Dk > kMaxDk || a.Dk % 16 != 0) fail("gated_delta_decode: key head dim must be a multiple of 16, <= 128");
  if (a.Dv % kGdnSplit != 0 || a.Dv / kGdnSplit * 4 > 128) fail("gated_delta_decode: value head dim must be a multiple of 4, <= 128");
  if (a.Hk <= 0 || a.Hv % a.Hk != 0) fail("gated_delta_decode: value heads must be a multiple of key heads");
  if (!a.norm_w) fail("gated_delta_decode: the gated norm weight (norm_w) is missing");
  if (rows > 1 && !a.state_rows) fail("gated_delta_decode: ", std::to_string(rows), " rows need state_rows");
  with_step_rows("gated_delta_decode", rows, [&](auto t) {
    launch_clustered("gated_delta_decode", kGdnSplit, gated_delta_decode_kernel<t>, dim3(kGdnSplit, a.Hv), dim3(128), 0, stream, a, halt);
  });
}

size_t gated_delta_state_index(int Hv, int Dk, int Dv, int h, int k, int v) {
  const int C = Dv / kGdnSplit, split = v / C, col = v % C, kq = k % 4, i = k / 4;
  const int t = col * 4 + kq, j = i / 4;
  const size_t base = (static_cast<size_t>(h) * kGdnSplit + split) * Dk * C / 4;
  return (base + static_cast<size_t>(j) * 4 * C + t) * 4 + i % 4;
}

}  // namespace lily::cuda
