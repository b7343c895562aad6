// Several-token (speculative verify) steps: every decode op launched once for T tokens
// against T one-token launches, bit for bit (outputs, recurrent states, conv ring, KV
// cache), T = 2, 3, 4 on awkward shapes and positions.
#include <algorithm>
#include <cstring>

#include "attention/attention_decode.h"
#include "attention/attention_decode_tc.h"
#include "gated_delta/gated_delta_decode.h"
#include "qmatmul/qmatmul_decode.h"
#include "head/lm_head.h"
#include "moe/moe_experts_decode.h"
#include "moe/moe_router_decode.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

std::vector<float> norm_weight(int n, Rng& r) {
  std::vector<float> w = randn(n, r, 0.2);
  for (float& v : w) v += 1.0f;
  return w;
}

const char* mode_name(XMode m) { return m == XMode::Plain ? "plain" : m == XMode::RmsNorm ? "rmsnorm" : "embed+rmsnorm"; }

void test_qmatmul_decode_rows(int rows, int cols, XMode mode, YMode ymode, int T, uint64_t seed) {
  Rng r(seed);
  HostQ W = make_q(rows, cols, 4, 64, r, false);
  QMat dW = upload_q_tiled(W);
  float* dx = to_dev(randn(static_cast<size_t>(T) * cols, r, 2.0));
  float* dw = to_dev(norm_weight(cols, r));
  HostQ E = make_q(37, cols, 4, 64, r, false);
  XSpec X;
  X.mode = mode;
  X.x = dx;
  X.w = dw;
  X.embed = upload_q(E);
  int* dtok = to_dev(std::vector<int>{29, 3, 29, 11});
  float *dh1 = dev_alloc<float>(T * cols), *dhT = dev_alloc<float>(T * cols);
  X.token = dtok;
  const std::vector<float> y0 = randn(static_cast<size_t>(T) * rows, r);
  float *dy1 = ymode == YMode::Add ? to_dev(y0) : dev_alloc<float>(T * rows);
  float *dyT = ymode == YMode::Add ? to_dev(y0) : dev_alloc<float>(T * rows);
  for (int t = 0; t < T; ++t) {
    XSpec Xt = X;
    Xt.x = dx + t * cols;
    Xt.token = dtok + t;
    Xt.h_out = dh1 + t * cols;
    qmatmul_decode(dW, Xt, {ymode, dy1 + t * rows}, nullptr, 0);
  }
  X.h_out = dhT;
  qmatmul_decode(dW, X, {ymode, dyT}, nullptr, 0, T);
  CK(cudaGetLastError());
  char name[160];
  std::snprintf(name, sizeof name, "qmatmul_decode %dx%d %s %s, %d rows = %d one-row launches", rows, cols, mode_name(mode),
                ymode == YMode::Add ? "add" : "store", T, T);
  const auto y1 = from_dev(dy1, T * rows), yT = from_dev(dyT, T * rows);
  expect(name, same_bits(y1, yT) && std::all_of(yT.begin(), yT.end(), [](float v) { return std::isfinite(v); }));
  if (mode == XMode::EmbedRmsNorm) expect("  embedding rows written to h", same_bits(from_dev(dh1, T * cols), from_dev(dhT, T * cols)));
  free_q(dW), free_q(X.embed);
  cudaFree(dx), cudaFree(dw), cudaFree(dtok), cudaFree(dh1), cudaFree(dhT), cudaFree(dy1), cudaFree(dyT);
}

void test_head_rows(int V, int H, int T, uint64_t seed) {
  Rng r(seed);
  HostQ W = make_q(V, H, 4, 64, r, false);
  HeadArgs a;
  a.W = upload_q_tiled(W);
  float* dx = to_dev(randn(static_cast<size_t>(T) * H, r, 2.0));
  a.X.mode = XMode::RmsNorm;
  a.X.x = dx;
  a.X.w = to_dev(norm_weight(H, r));
  a.partial = dev_alloc<float2>(T * kLmHeadMaxBlocks);
  a.counter = dev_alloc<unsigned>(1, false);
  float* l1 = dev_alloc<float>(static_cast<size_t>(T) * V);
  for (int t = 0; t < T; ++t) {
    HeadArgs at = a;
    at.X.x = dx + t * H;
    at.logits = l1 + static_cast<size_t>(t) * V;
    lm_head(at, nullptr, 0);
  }
  a.logits = dev_alloc<float>(static_cast<size_t>(T) * V);
  a.rows = T;
  a.argmax = dev_alloc<int>(T);
  a.argmax_limit = V - 5;  // the last rows may not be chosen
  lm_head(a, nullptr, 0);
  CK(cudaGetLastError());
  const auto want = from_dev(l1, static_cast<size_t>(T) * V), got = from_dev(a.logits, static_cast<size_t>(T) * V);
  const auto am = from_dev(a.argmax, T);
  bool arg_ok = true;
  for (int t = 0; t < T; ++t) {
    const float* row = want.data() + static_cast<size_t>(t) * V;
    arg_ok &= am[t] == static_cast<int>(std::max_element(row, row + V - 5) - row);
  }
  char name[160];
  std::snprintf(name, sizeof name, "lm_head %dx%d, %d rows = %d one-row launches", V, H, T, T);
  expect(name, same_bits(want, got));
  expect("  argmax of each row (below argmax_limit)", arg_ok);
  free_q(a.W);
  cudaFree(dx), cudaFree(const_cast<float*>(a.X.w)), cudaFree(a.partial), cudaFree(a.counter), cudaFree(l1),
      cudaFree(a.logits), cudaFree(a.argmax);
}

void test_router_rows(int H, int E, int k, int T, uint64_t seed) {
  Rng r(seed);
  QMat R = upload_q(make_q(E + 1, H, 8, 64, r, false));
  float* dx = to_dev(randn(static_cast<size_t>(T) * H, r, 2.0));
  XSpec X;
  X.mode = XMode::RmsNorm;
  X.x = dx;
  X.w = to_dev(norm_weight(H, r));
  auto outs = [&] { return RouterOut{dev_alloc<float>(T * (E + 1)), dev_alloc<int>(T * k), dev_alloc<float>(T * k), dev_alloc<float>(T)}; };
  const RouterOut one = outs(), all = outs();
  for (int t = 0; t < T; ++t) {
    XSpec Xt = X;
    Xt.x = dx + t * H;
    moe_router_decode(R, Xt, E, k, true, {one.logits + t * (E + 1), one.ids + t * k, one.weights + t * k, one.shared_gate + t},
               nullptr, 0);
  }
  moe_router_decode(R, X, E, k, true, all, nullptr, 0, kRouterMaxCluster, T);
  CK(cudaGetLastError());
  char name[160];
  std::snprintf(name, sizeof name, "moe_router_decode H%d E%d k%d, %d rows = %d one-row launches", H, E, k, T, T);
  expect(name, same_bits(from_dev(one.logits, T * (E + 1)), from_dev(all.logits, T * (E + 1))) &&
                   same_bits(from_dev(one.ids, T * k), from_dev(all.ids, T * k)) &&
                   same_bits(from_dev(one.weights, T * k), from_dev(all.weights, T * k)) &&
                   same_bits(from_dev(one.shared_gate, T), from_dev(all.shared_gate, T)));
  free_q(R);
  cudaFree(dx), cudaFree(const_cast<float*>(X.w));
  for (const RouterOut& o : {one, all}) cudaFree(o.logits), cudaFree(o.ids), cudaFree(o.weights), cudaFree(o.shared_gate);
}

// Tokens whose experts overlap: token 1 shares half of token 0's, token 2 has token 0's in
// another order, token 3 its own.
std::vector<int> overlapping_ids(int E, int k, int T, Rng& r) {
  std::vector<int> perm(E);
  for (int e = 0; e < E; ++e) perm[e] = e;
  for (int e = E - 1; e > 0; --e) std::swap(perm[e], perm[r.next() % (e + 1)]);
  std::vector<int> ids(T * k);
  for (int j = 0; j < k; ++j) ids[j] = perm[j];
  if (T > 1)
    for (int j = 0; j < k; ++j) ids[k + j] = j < k / 2 ? perm[k - 1 - j] : perm[k + j];
  if (T > 2)
    for (int j = 0; j < k; ++j) ids[2 * k + j] = perm[(j + 3) % k];
  if (T > 3)
    for (int j = 0; j < k; ++j) ids[3 * k + j] = perm[(2 * k + j) % E];
  return ids;
}

void test_moe_rows(int H, int E, int k, int I, int Is, int T, uint64_t seed) {
  Rng r(seed);
  MoeExperts m;
  m.gate_up = upload_q_tiled(make_q(E * 2 * I, H, 4, 64, r, false), I);
  m.down = upload_q_tiled(make_q(E * H, I, 4, 64, r, false));
  m.shared_gate_up = upload_q_tiled(make_q(2 * Is, H, 4, 64, r, false), Is);
  m.shared_down = upload_q_tiled(make_q(H, Is, 4, 64, r, false));
  m.n_experts = E, m.inter = I, m.shared_inter = Is;
  const int A = k * I + Is;
  float* dx = to_dev(randn(static_cast<size_t>(T) * H, r, 2.0));
  XSpec X;
  X.mode = XMode::RmsNorm;
  X.x = dx;
  X.w = to_dev(norm_weight(H, r));
  int* ids = to_dev(overlapping_ids(E, k, T, r));
  std::vector<float> w(T * k);
  for (float& v : w) v = static_cast<float>(0.05 + r.uniform());
  float* dwts = to_dev(w);
  float* sg = to_dev(randn(T, r, 0.5));
  const std::vector<float> h0 = randn(static_cast<size_t>(T) * H, r);
  float *act1 = dev_alloc<float>(T * A), *actT = dev_alloc<float>(T * A), *h1 = to_dev(h0), *hT = to_dev(h0);
  int *pos1 = dev_alloc<int>(1, false), *posT = dev_alloc<int>(1, false);
  for (int t = 0; t < T; ++t) {
    XSpec Xt = X;
    Xt.x = dx + t * H;
    moe_gate_up_decode(m, Xt, ids + t * k, k, act1 + t * A, nullptr, 0);
    moe_down_decode(m, act1 + t * A, ids + t * k, dwts + t * k, sg + t, k, h1 + t * H, pos1, nullptr, 0);
  }
  moe_gate_up_decode(m, X, ids, k, actT, nullptr, 0, T);
  moe_down_decode(m, actT, ids, dwts, sg, k, hT, posT, nullptr, 0, T);
  CK(cudaGetLastError());
  char name[160];
  std::snprintf(name, sizeof name, "moe H%d E%d k%d I%d Is%d, %d rows = %d one-row launches: activations", H, E, k, I, Is, T, T);
  const auto a1 = from_dev(act1, T * A);
  expect(name, same_bits(a1, from_dev(actT, T * A)) && std::all_of(a1.begin(), a1.end(), [](float v) { return std::isfinite(v); }));
  expect("  down + combine + residual", same_bits(from_dev(h1, T * H), from_dev(hT, T * H)));
  expect("  position advanced by the rows", from_dev(pos1, 1) == std::vector<int>{T} && from_dev(posT, 1) == std::vector<int>{T});
  for (QMat* q : {&m.gate_up, &m.down, &m.shared_gate_up, &m.shared_down}) free_q(*q);
  cudaFree(dx), cudaFree(const_cast<float*>(X.w)), cudaFree(ids), cudaFree(dwts), cudaFree(sg);
  cudaFree(act1), cudaFree(actT), cudaFree(h1), cudaFree(hT), cudaFree(pos1), cudaFree(posT);
}

void test_gated_delta_decode_rows(int Hk, int Hv, int Dk, int Dv, int pos0, int T, uint64_t seed) {
  Rng r(seed);
  const int conv_dim = 2 * Hk * Dk + Hv * Dv, n_proj = conv_dim + Hv * Dv + 2 * Hv;
  const size_t S = static_cast<size_t>(Hv) * Dk * Dv;
  GdnArgs a;
  a.conv_w = to_dev(randn(conv_dim * 4, r, 0.5));
  a.norm_w = to_dev(norm_weight(Dv, r));
  a.dt_bias = to_dev(randn(Hv, r, 0.5));
  std::vector<float> neg_a(Hv);
  for (float& v : neg_a) v = static_cast<float>(-(1 + 15 * r.uniform()));
  a.neg_A = to_dev(neg_a);
  a.Hk = Hk, a.Hv = Hv, a.Dk = Dk, a.Dv = Dv;
  const auto ring0 = randn(kGdnRingRows * conv_dim, r), state0 = randn(S, r, 0.5);
  const auto proj = randn(static_cast<size_t>(T) * n_proj, r);
  float* dproj = to_dev(proj);
  int* dpos = to_dev(std::vector<int>{pos0});
  a.pos = dpos;

  // T one-token launches: states ping-pong, each step's state kept.
  GdnArgs one = a;
  one.ring = to_dev(ring0);
  std::vector<float*> states{to_dev(state0)};
  float* out1 = dev_alloc<float>(T * Hv * Dv);
  std::vector<int*> poss;
  for (int t = 0; t < T; ++t) {
    states.push_back(dev_alloc<float>(S));
    poss.push_back(to_dev(std::vector<int>{pos0 + t}));
    one.proj = dproj + t * n_proj;
    one.pos = poss.back();
    one.state_in = states[t];
    one.state_out = states[t + 1];
    one.out = out1 + t * Hv * Dv;
    gated_delta_decode(one, nullptr, 0);
  }
  // One launch of T rows.
  a.ring = to_dev(ring0);
  a.proj = dproj;
  a.state_in = to_dev(state0);
  a.state_rows = dev_alloc<float>((T - 1) * S);
  a.state_out = dev_alloc<float>(S);
  a.out = dev_alloc<float>(T * Hv * Dv);
  gated_delta_decode(a, nullptr, 0, T);
  CK(cudaGetLastError());
  bool states_ok = true;
  for (int t = 0; t < T; ++t) {
    const auto want = from_dev(states[t + 1], S);
    states_ok &= same_bits(want, t + 1 < T ? from_dev(a.state_rows + t * S, S) : from_dev(a.state_out, S));
  }
  char name[160];
  std::snprintf(name, sizeof name, "gdn Hk%d Hv%d Dk%d Dv%d from pos %d, %d rows = %d one-row launches: outputs", Hk, Hv, Dk, Dv,
                pos0, T, T);
  const auto o1 = from_dev(out1, T * Hv * Dv);
  expect(name, same_bits(o1, from_dev(a.out, T * Hv * Dv)) && std::all_of(o1.begin(), o1.end(), [](float v) { return std::isfinite(v); }));
  expect("  the state after every row", states_ok);
  expect("  conv ring", same_bits(from_dev(one.ring, kGdnRingRows * conv_dim), from_dev(a.ring, kGdnRingRows * conv_dim)));
  for (const float* p : {a.conv_w, a.norm_w, a.dt_bias, a.neg_A, a.state_in}) cudaFree(const_cast<float*>(p));
  for (float* p : states) cudaFree(p);
  for (int* p : poss) cudaFree(p);
  cudaFree(one.ring), cudaFree(a.ring), cudaFree(a.state_rows), cudaFree(a.state_out), cudaFree(a.out), cudaFree(out1);
  cudaFree(dproj), cudaFree(dpos);
}

void test_attention_rows(int Hq, int Hkv, int D, int rot, int pos0, int T, uint64_t seed) {
  Rng r(seed);
  AttnArgs a;
  a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.rot_dim = rot;
  const int ctx = pos0 + T, qkv = attention_qkv_floats(a);
  a.q_norm = to_dev(norm_weight(D, r));
  a.k_norm = to_dev(norm_weight(D, r));
  a.inv_freq = to_dev(rope_inv_freq(1e7, rot));
  std::vector<uint16_t> cache(static_cast<size_t>(ctx) * Hkv * D * 2);
  for (auto& c : cache) c = float_to_bf16(static_cast<float>(r.normal()));
  const size_t half = cache.size() / 2;
  const auto x = randn(static_cast<size_t>(T) * qkv, r);
  float* dqkv = to_dev(x);
  const size_t parts = attention_partial_floats(Hq, Hkv, D, a.max_splits);

  AttnArgs one = a;
  uint16_t* cache1 = to_dev(cache);
  one.k_cache = cache1, one.v_cache = cache1 + half;
  one.partial = dev_alloc<float>(parts);
  float* out1 = dev_alloc<float>(T * Hq * D);
  std::vector<int*> poss;
  for (int t = 0; t < T; ++t) {
    poss.push_back(to_dev(std::vector<int>{pos0 + t}));
    one.pos = poss.back();
    one.qkv = dqkv + t * qkv;
    one.out = out1 + t * Hq * D;
    attention_decode_tc(one, nullptr, 0);
  }
  uint16_t* cacheT = to_dev(cache);
  a.k_cache = cacheT, a.v_cache = cacheT + half;
  a.partial = dev_alloc<float>(T * parts);
  a.out = dev_alloc<float>(T * Hq * D);
  a.qkv = dqkv;
  int* dpos = to_dev(std::vector<int>{pos0});
  a.pos = dpos;
  attention_decode_tc(a, nullptr, 0, T);
  CK(cudaGetLastError());
  char name[160];
  std::snprintf(name, sizeof name, "attention (tensor cores) Hq%d Hkv%d D%d at pos %d, %d rows = %d one-row launches", Hq, Hkv, D,
                pos0, T, T);
  const auto o1 = from_dev(out1, T * Hq * D);
  expect(name, same_bits(o1, from_dev(a.out, T * Hq * D)) && std::all_of(o1.begin(), o1.end(), [](float v) { return std::isfinite(v); }));
  expect("  KV cache with the rows appended", same_bits(from_dev(cache1, cache.size()), from_dev(cacheT, cache.size())));
  for (const float* p : {a.q_norm, a.k_norm, a.inv_freq}) cudaFree(const_cast<float*>(p));
  for (int* p : poss) cudaFree(p);
  cudaFree(cache1), cudaFree(cacheT), cudaFree(one.partial), cudaFree(a.partial), cudaFree(out1), cudaFree(a.out);
  cudaFree(dqkv), cudaFree(dpos);
}

}  // namespace

void run_rows_tests() {
  test_head_rows(4096, 256, 1, 59);  // one row: the verify head's argmax without a token choice
  for (int T = 2; T <= kMaxStepRows; ++T) {
    test_qmatmul_decode_rows(12352, 2048, XMode::RmsNorm, YMode::Store, T, 10 + T);  // GDN in-projection
    test_qmatmul_decode_rows(9216, 2048, XMode::EmbedRmsNorm, YMode::Store, T, 20 + T);
    test_qmatmul_decode_rows(2048, 4096, XMode::Plain, YMode::Add, T, 30 + T);  // out-projection (16-warp blocks)
    test_qmatmul_decode_rows(300, 256, XMode::RmsNorm, YMode::Add, T, 40 + T);
    test_qmatmul_decode_rows(33, 1088, XMode::EmbedRmsNorm, YMode::Store, T, 50 + T);
    test_head_rows(4096, 256, T, 60 + T);
    test_head_rows(50000, 2048, T, 70 + T);
    test_router_rows(2048, 256, 8, T, 80 + T);
    test_router_rows(256, 16, 4, T, 90 + T);
    test_moe_rows(2048, 64, 8, 512, 512, T, 100 + T);  // Qwen3.6-35B-A3B widths: 16-warp down
    test_moe_rows(4096, 64, 8, 512, 512, T, 110 + T);  // 8-warp down, several row blocks a block
    test_moe_rows(256, 16, 4, 64, 128, T, 120 + T);    // lily-tiny
    test_moe_rows(256, 16, 4, 192, 64, T, 130 + T);    // 3 groups, 24 row blocks an expert: not powers of two
    test_gated_delta_decode_rows(16, 32, 128, 128, 4095, T, 130 + T);  // Qwen3.6-35B-A3B
    test_gated_delta_decode_rows(2, 4, 64, 64, 1, T, 140 + T);         // lily-tiny, the ring partly before position 0
    for (int pos : {0, 126, 200, 8190, 20000}) test_attention_rows(16, 2, 256, 64, pos, T, 150 + T + pos);
    test_attention_rows(4, 2, 64, 32, 60, T, 160 + T);
  }
}

}  // namespace lily::cuda::test
