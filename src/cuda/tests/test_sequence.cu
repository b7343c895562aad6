// Kernels with state over positions: Gated DeltaNet decode (hundreds of steps, conv ring
// and double-buffered recurrent state) and attention decode, SIMT and tensor-core (every
// split route, GQA group sizes, head dims, and one step at position 262,143).
#include <algorithm>

#include "attention/attention_decode.h"
#include "attention/attention_decode_tc.h"
#include "gated_delta/gated_delta_decode.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

void test_gdn(int Hk, int Hv, int Dk, int Dv, int steps, uint64_t seed) {
  Rng r(seed);
  const int conv_dim = 2 * Hk * Dk + Hv * Dv, n_proj = conv_dim + Hv * Dv + 2 * Hv;
  const auto conv_w = randn(conv_dim * 4, r, 0.5), dt_bias = randn(Hv, r, 0.5);
  std::vector<float> norm_w = randn(Dv, r, 0.2);
  for (float& v : norm_w) v += 1.0f;
  std::vector<float> neg_a(Hv);
  for (float& v : neg_a) v = static_cast<float>(-std::exp(std::log(1 + 15 * r.uniform())));
  GdnArgs a;
  a.conv_w = to_dev(conv_w);
  a.norm_w = to_dev(norm_w);
  a.dt_bias = to_dev(dt_bias);
  a.neg_A = to_dev(neg_a);
  a.ring = dev_alloc<float>(kGdnRingRows * conv_dim, false);
  const size_t S = static_cast<size_t>(Hv) * Dk * Dv;
  float* state[2] = {dev_alloc<float>(S, false), dev_alloc<float>(S)};
  float* proj = dev_alloc<float>(n_proj);
  a.proj = proj;
  a.out = dev_alloc<float>(Hv * Dv);
  int* pos = dev_alloc<int>(1);
  a.pos = pos;
  a.Hk = Hk, a.Hv = Hv, a.Dk = Dk, a.Dv = Dv;

  std::vector<double> Sref(S, 0.0);  // [h][k][v]
  std::vector<std::vector<float>> rows;  // pre-conv inputs by position
  double worst = 0;
  for (int t = 0; t < steps; ++t) {
    const auto p = randn(n_proj, r);
    rows.push_back(std::vector<float>(p.begin(), p.begin() + conv_dim));
    CK(cudaMemcpy(proj, p.data(), n_proj * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pos, &t, 4, cudaMemcpyHostToDevice));
    a.state_in = state[t & 1];
    a.state_out = state[(t + 1) & 1];
    gated_delta_decode(a, nullptr, 0);
    const auto out = from_dev(a.out, Hv * Dv);

    std::vector<double> c(conv_dim);
    for (int ch = 0; ch < conv_dim; ++ch) {
      double y = 0;
      for (int j = 0; j < 4; ++j) {
        const int tt = t - 3 + j;
        if (tt >= 0) y += conv_w[ch * 4 + j] * double(rows[tt][ch]);
      }
      c[ch] = silu(y);
    }
    std::vector<double> o(Hv * Dv);
    for (int h = 0; h < Hv; ++h) {
      const int kh = h / (Hv / Hk);
      const double* q = &c[kh * Dk];
      const double* k = &c[Hk * Dk + kh * Dk];
      const double* v = &c[2 * Hk * Dk + h * Dv];
      double sq = 0, sk = 0;
      for (int i = 0; i < Dk; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
      const double qs = 1 / std::sqrt(sq + 1e-6) / std::sqrt(double(Dk)), ks = 1 / std::sqrt(sk + 1e-6);
      const double beta = sigmoid(p[conv_dim + Hv * Dv + h]);
      const double ar = double(p[conv_dim + Hv * Dv + Hv + h]) + dt_bias[h];
      const double decay = std::exp(neg_a[h] * std::log1p(std::exp(ar)));
      double* Sh = &Sref[static_cast<size_t>(h) * Dk * Dv];
      for (int vv = 0; vv < Dv; ++vv) {
        double kv = 0;
        for (int i = 0; i < Dk; ++i) kv += (Sh[i * Dv + vv] *= decay) * k[i] * ks;
        const double delta = (v[vv] - kv) * beta;
        double acc = 0;
        for (int i = 0; i < Dk; ++i) acc += (Sh[i * Dv + vv] += k[i] * ks * delta) * q[i] * qs;
        o[h * Dv + vv] = acc;
      }
    }
    worst = std::max(worst, rel_err(out, gated_norm(o.data(), &p[conv_dim], Hv, Dv, norm_w)));
  }
  char name[160];
  std::snprintf(name, sizeof name, "gdn Hk%d Hv%d Dk%d Dv%d, %d steps: gated-norm output", Hk, Hv, Dk, Dv, steps);
  report(name, worst, 1e-4);
  const auto st = from_dev(state[steps & 1], S);
  std::vector<float> got(S);
  for (int h = 0; h < Hv; ++h)
    for (int k = 0; k < Dk; ++k)
      for (int v = 0; v < Dv; ++v)
        got[(static_cast<size_t>(h) * Dk + k) * Dv + v] = st[gated_delta_state_index(Hv, Dk, Dv, h, k, v)];
  report("  final recurrent state", rel_err(got, Sref), 1e-4);
  cudaFree(const_cast<float*>(a.conv_w)), cudaFree(const_cast<float*>(a.norm_w)), cudaFree(const_cast<float*>(a.dt_bias)), cudaFree(const_cast<float*>(a.neg_A));
  cudaFree(a.ring), cudaFree(state[0]), cudaFree(state[1]), cudaFree(proj), cudaFree(a.out), cudaFree(pos);
}

// q/k reference: RMSNorm * w, then rotate-half RoPE on the first rot dims (fp32 angle).
std::vector<double> norm_rope(const float* x, const std::vector<float>& w, int D, int rot, int pos) {
  double ss = 0;
  for (int d = 0; d < D; ++d) ss += double(x[d]) * x[d];
  const double inv = 1 / std::sqrt(ss / D + 1e-6);
  std::vector<double> y(D);
  for (int d = 0; d < D; ++d) y[d] = x[d] * inv * w[d];
  const int half = rot / 2;
  std::vector<double> out(y);
  for (int j = 0; j < half; ++j) {
    const float inv_freq = static_cast<float>(std::pow(1e7, -2.0 * j / rot));
    const float ang = static_cast<float>(pos) * inv_freq;
    const double c = std::cos(double(ang)), s = std::sin(double(ang));
    out[j] = y[j] * c - y[j + half] * s;
    out[j + half] = y[j + half] * c + y[j] * s;
  }
  return out;
}

struct AttnCase {
  int Hq, Hkv, D, max_splits, min_chunk;
};

// Steps 0..steps-1 with fresh random q/k/v each step (or one step at `at` over a
// pre-filled random cache when at > 0); compares every output. With `tensor_cores` the
// op is attention_decode_tc (bf16 q and P: bf16 tolerance), and attention_decode runs
// alongside on a copy of the cache (when G <= 8, its limit), whose rows must come out
// bit-identical.
void test_attention(const AttnCase& tc, int steps, int at, uint64_t seed, bool tensor_cores = false) {
  Rng r(seed);
  const int Hq = tc.Hq, Hkv = tc.Hkv, D = tc.D, G = Hq / Hkv, rot = D / 4;
  const int ctx = at > 0 ? at + 1 : steps;
  const int n_qkv = Hq * 2 * D + 2 * Hkv * D;
  std::vector<float> qn = randn(D, r, 0.1), kn = randn(D, r, 0.1);
  for (float& v : qn) v += 1;
  for (float& v : kn) v += 1;
  AttnArgs a;
  a.q_norm = to_dev(qn);
  a.k_norm = to_dev(kn);
  const size_t cache_n = static_cast<size_t>(ctx) * Hkv * D;
  std::vector<uint16_t> kh(cache_n, 0xFFFF), vh(cache_n, 0xFFFF);  // NaN rows: never read before written
  std::vector<double> K(cache_n), V(cache_n);
  if (at > 0)
    for (size_t i = 0; i < static_cast<size_t>(at) * Hkv * D; ++i) {
      kh[i] = float_to_bf16(static_cast<float>(2 * r.sym()));
      vh[i] = float_to_bf16(static_cast<float>(2 * r.sym()));
      K[i] = bf16_to_float(kh[i]);
      V[i] = bf16_to_float(vh[i]);
    }
  a.k_cache = to_dev(kh);
  a.v_cache = to_dev(vh);
  a.partial = dev_alloc<float>(attention_partial_floats(Hq, Hkv, D, tc.max_splits));
  a.out = dev_alloc<float>(Hq * D);
  float* qkv = dev_alloc<float>(n_qkv);
  a.qkv = qkv;
  int* pos = dev_alloc<int>(1);
  a.pos = pos;
  a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.rot_dim = rot, a.eps = 1e-6f;
  float* inv_freq = to_dev(rope_inv_freq(1e7, rot));
  a.inv_freq = inv_freq;
  a.max_splits = tc.max_splits;
  a.min_chunk = tc.min_chunk;
  AttnArgs simt = a;  // the SIMT op on its own cache copy, partials and outputs
  const bool with_simt = tensor_cores && G <= 8;
  if (with_simt) {
    simt.k_cache = to_dev(kh);
    simt.v_cache = to_dev(vh);
    simt.partial = dev_alloc<float>(attention_partial_floats(Hq, Hkv, D, tc.max_splits));
    simt.out = dev_alloc<float>(Hq * D);
  }

  double worst = 0;
  for (int t = at > 0 ? at : 0; t < ctx; ++t) {
    const auto x = randn(n_qkv, r);
    CK(cudaMemcpy(qkv, x.data(), n_qkv * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(pos, &t, 4, cudaMemcpyHostToDevice));
    if (tensor_cores) {
      attention_decode_tc(a, nullptr, 0);
      if (with_simt) attention_decode(simt, nullptr, 0);
    } else {
      attention_decode(a, nullptr, 0);
    }
    const auto out = from_dev(a.out, Hq * D);
    for (int g = 0; g < Hkv; ++g) {
      const auto k = norm_rope(&x[Hq * 2 * D + g * D], kn, D, rot, t);
      for (int d = 0; d < D; ++d) {
        K[(static_cast<size_t>(t) * Hkv + g) * D + d] = bf16r(k[d]);
        V[(static_cast<size_t>(t) * Hkv + g) * D + d] = bf16r(x[Hq * 2 * D + Hkv * D + g * D + d]);
      }
    }
    std::vector<double> ref(Hq * D);
    std::vector<double> s(t + 1);
    for (int h = 0; h < Hq; ++h) {
      const int g = h / G;
      const auto q = norm_rope(&x[h * 2 * D], qn, D, rot, t);
      double m = -1e300, z = 0;
      for (int j = 0; j <= t; ++j) {
        double d = 0;
        for (int i = 0; i < D; ++i) d += q[i] * K[(static_cast<size_t>(j) * Hkv + g) * D + i];
        s[j] = d / std::sqrt(double(D));
        m = std::max(m, s[j]);
      }
      for (int j = 0; j <= t; ++j) z += s[j] = std::exp(s[j] - m);
      for (int i = 0; i < D; ++i) {
        double acc = 0;
        for (int j = 0; j <= t; ++j) acc += s[j] * V[(static_cast<size_t>(j) * Hkv + g) * D + i];
        ref[h * D + i] = acc / z * sigmoid(x[h * 2 * D + D + i]);
      }
    }
    worst = std::max(worst, rel_err(out, ref));
  }
  char name[160];
  std::snprintf(name, sizeof name, "%s Hq%d Hkv%d D%d splits<=%d chunk>=%d, %s",
                tensor_cores ? "attention_tc" : "attention", Hq, Hkv, D, tc.max_splits,
                tc.min_chunk, at > 0 ? ("position " + std::to_string(at)).c_str() : ("steps 0.." + std::to_string(steps - 1)).c_str());
  report(name, worst, tensor_cores ? 3e-2 : 2e-3);  // bf16 q and P: max |err| / RMS up to ~2e-2
  if (with_simt) {
    const bool same = from_dev(a.k_cache, cache_n) == from_dev(simt.k_cache, cache_n) &&
                      from_dev(a.v_cache, cache_n) == from_dev(simt.v_cache, cache_n);
    expect("  K/V cache rows bit-identical to attention_decode's", same);
    cudaFree(simt.k_cache), cudaFree(simt.v_cache), cudaFree(simt.partial), cudaFree(simt.out);
  }
  cudaFree(const_cast<float*>(a.q_norm)), cudaFree(const_cast<float*>(a.k_norm)), cudaFree(a.k_cache), cudaFree(a.v_cache);
  cudaFree(a.partial), cudaFree(a.out), cudaFree(qkv), cudaFree(pos), cudaFree(inv_freq);
}

}  // namespace

void run_sequence_tests(bool long_context) {
  test_gdn(2, 4, 32, 32, 600, 21);     // synthetic tiny
  test_gdn(2, 4, 64, 64, 300, 22);     // lily-tiny
  test_gdn(16, 32, 128, 128, 520, 23);  // Qwen3.6-35B-A3B
  test_attention({4, 2, 64, 8, 4}, 200, 0, 31);     // split from 5 keys on, G = 2
  test_attention({16, 2, 256, 8, 16}, 300, 0, 32);  // 35B heads, splits from 17 keys
  test_attention({16, 2, 256, 64, 64}, 300, 0, 33);  // 35B routing: one block up to 64 keys
  test_attention({8, 8, 128, 4, 8}, 100, 0, 34);    // G = 1
  test_attention({8, 1, 128, 3, 7}, 90, 0, 35);     // G = 8, odd split count
  test_attention({16, 2, 256, 256, 2}, 0, 3000, 37);  // 256 splits, merge over all of them
  if (long_context) test_attention({16, 2, 256, 256, 64}, 0, 262143, 36);
  // The tensor-core op on the same inputs (same seeds).
  test_attention({4, 2, 64, 8, 4}, 200, 0, 31, true);
  test_attention({16, 2, 256, 8, 16}, 300, 0, 32, true);
  test_attention({16, 2, 256, 64, 64}, 300, 0, 33, true);
  test_attention({8, 8, 128, 4, 8}, 100, 0, 34, true);
  test_attention({8, 1, 128, 3, 7}, 90, 0, 35, true);
  test_attention({32, 2, 128, 3, 150}, 300, 0, 38, true);  // G = 16 (a full mma tile), splits of 1-3 tiles
  test_attention({16, 2, 256, 256, 2}, 0, 3000, 37, true);
  test_attention({16, 2, 256, 64, 64}, 0, 131071, 39, true);  // 35B routing at 128K: 32 tiles per split
  if (long_context) test_attention({16, 2, 256, 256, 64}, 0, 262143, 36, true);
}

}  // namespace lily::cuda::test
