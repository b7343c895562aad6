// Prefill MoE routing (router GEMM, top-k, counting sort, tile list) and the combine
// against fp64 / host references.
#include <algorithm>
#include <functional>
#include <numeric>

#include "error.h"
#include "moe/moe_combine_prefill.h"
#include "moe/moe_route_prefill.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

constexpr int kH = 2048;
// fp32 sums of 2048 terms (or 2048/S) against fp64: the worst of 1M outputs reaches ~8e-6 of the RMS.
constexpr double kLogitTol = 3e-5;

std::vector<float> rand_sym(size_t n, Rng& r, double scale = 1.0) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.sym() * scale);
  return v;
}

// Row dst of W becomes a copy of row src (codes, scales, biases).
void copy_row(HostQ& W, int dst, int src) {
  const size_t words = W.cols * W.bits / 32, groups = W.cols / W.group;
  std::copy_n(W.codes.begin() + src * words, words, W.codes.begin() + dst * words);
  std::copy_n(W.sb.begin() + src * groups, groups, W.sb.begin() + dst * groups);
  const size_t cols = W.cols;
  std::copy_n(W.deq.begin() + src * cols, cols, W.deq.begin() + dst * cols);
}

// Adds ~delta to every bias of row `row` (rounded to bf16), keeping deq exact.
void shift_bias(HostQ& W, int row, double delta) {
  const int groups = W.cols / W.group;
  for (int g = 0; g < groups; ++g) {
    uint32_t& w = W.sb[static_cast<size_t>(row) * groups + g];
    const float b = bf16_to_float(static_cast<uint16_t>(w >> 16));
    const float nb = round_bf16(static_cast<float>(b + delta));
    w = (w & 0xffffu) | (uint32_t(float_to_bf16(nb)) << 16);
    for (int c = g * W.group; c < (g + 1) * W.group; ++c)
      W.deq[static_cast<size_t>(row) * W.cols + c] += double(nb) - double(b);
  }
}

// fp64 W[n] . x[t] for rows n0 <= n < n1: [T][n1 - n0].
std::vector<double> ref_rows(const HostQ& W, const std::vector<float>& x, int T, int n0, int n1) {
  std::vector<double> y(static_cast<size_t>(T) * (n1 - n0));
  for (int t = 0; t < T; ++t)
    for (int n = n0; n < n1; ++n) {
      const double* w = W.deq.data() + static_cast<size_t>(n) * W.cols;
      const float* xt = x.data() + static_cast<size_t>(t) * W.cols;
      double s = 0;
      for (int c = 0; c < W.cols; ++c) s += w[c] * xt[c];
      y[static_cast<size_t>(t) * (n1 - n0) + n - n0] = s;
    }
  return y;
}

// Top-k of one token's logits: descending, equal values by ascending id.
std::vector<int> topk_ids(const float* l, int E, int k) {
  std::vector<int> order(E);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  order.resize(k);
  return order;
}

// Device buffers of one routing call, outputs poisoned (NaN / -1).
struct Route {
  MoeRouteArgs a;
  Route(const QMat& router, const float* dx, int T, int E, int k, bool norm, int tile_m) {
    a.router = router;
    a.x = dx;
    a.T = T, a.E = E, a.k = k, a.norm_topk = norm, a.tile_m = tile_m;
    a.logits = dev_alloc<float>(static_cast<size_t>(T) * E);
    a.route_w = dev_alloc<float>(static_cast<size_t>(T) * k);
    a.expert_ids = dev_alloc<int>(static_cast<size_t>(T) * k);
    a.shared_logit = dev_alloc<float>(T);
    a.counts = dev_alloc<int>(E);
    a.offsets = dev_alloc<int>(E + 1);
    a.x_rows = dev_alloc<int>(static_cast<size_t>(T) * k);
    a.y_rows = dev_alloc<int>(static_cast<size_t>(T) * k);
    a.max_tiles = moe_max_tiles(T * k, tile_m, E);
    a.tiles = dev_alloc<int4>(a.max_tiles);
    a.n_tiles = dev_alloc<int>(1);
    a.partials = dev_alloc<float>(moe_router_partial_floats(T, E));
    a.cursor = dev_alloc<int>(E);
    a.counter = dev_alloc<unsigned>(1);
  }
  ~Route() {
    cudaFree(a.logits), cudaFree(a.route_w), cudaFree(a.expert_ids), cudaFree(a.shared_logit), cudaFree(a.counts);
    cudaFree(a.offsets), cudaFree(a.x_rows), cudaFree(a.y_rows), cudaFree(a.tiles), cudaFree(a.n_tiles);
    cudaFree(a.partials), cudaFree(a.cursor), cudaFree(a.counter);
  }
};

// Router logits and the shared-expert gate logit vs fp64; the top-k sets vs the fp64
// top-k wherever the fp64 logits are not within 1e-4 of a tie at the k-th place.
void test_logits(int bits, int T, int E, int k, uint64_t seed) {
  Rng r(seed);
  HostQ W = make_q(E + 1, kH, bits, 64, r);
  QMat dW = upload_q(W);
  const std::vector<float> x = randn(static_cast<size_t>(T) * kH, r);
  float* dx = to_dev(x);
  Route rt(dW, dx, T, E, k, true, 32);
  moe_route_prefill(rt.a, 0);
  CK(cudaGetLastError());
  const std::vector<double> ref = ref_rows(W, x, T, 0, E + 1);
  std::vector<double> want(static_cast<size_t>(T) * E), want_g(T);
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) want[static_cast<size_t>(t) * E + e] = ref[static_cast<size_t>(t) * (E + 1) + e];
    want_g[t] = ref[static_cast<size_t>(t) * (E + 1) + E];
  }
  char name[160];
  std::snprintf(name, sizeof name, "router logits %d-bit T=%d E=%d (%d H slices)", bits, T, E,
                moe_route_detail::router_splits(T, kH));
  report(name, rel_err(from_dev(rt.a.logits, want.size()), want), kLogitTol);
  std::snprintf(name, sizeof name, "  shared-expert gate logit T=%d", T);
  report(name, rel_err(from_dev(rt.a.shared_logit, T), want_g), kLogitTol);

  const std::vector<int> ids = from_dev(rt.a.expert_ids, static_cast<size_t>(T) * k);
  int wrong = 0, ambiguous = 0;
  std::vector<int> order(E);
  for (int t = 0; t < T; ++t) {
    const double* l = want.data() + static_cast<size_t>(t) * E;
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
    if (k < E && l[order[k - 1]] - l[order[k]] < 1e-4) {
      ++ambiguous;
      continue;
    }
    std::vector<int> got(ids.begin() + static_cast<size_t>(t) * k, ids.begin() + static_cast<size_t>(t + 1) * k);
    std::sort(got.begin(), got.end());
    std::vector<int> exp(order.begin(), order.begin() + k);
    std::sort(exp.begin(), exp.end());
    wrong += got != exp;
  }
  std::snprintf(name, sizeof name, "  top-%d sets match fp64 (%d of %d tokens within 1e-4 of a tie skipped)", k,
                ambiguous, T);
  expect(name, wrong == 0);
  free_q(dW);
  cudaFree(dx);
}

// The whole routing on a router with a hot expert pair of identical rows (3 and E-56,
// equal logits: ties) and a third hot expert, x with a positive mean so every token
// prefers them: ids / weights vs the host top-k of the kernel's own logits, counts,
// offsets, the sorted rows (a permutation grouped by expert) and the tile list.
void test_routing(int T, int E, int k, bool norm, int tile_m, bool skew, uint64_t seed) {
  Rng r(seed);
  HostQ W = make_q(E + 1, kH, 8, 64, r);
  const int hot_a = std::min(3, E - 1), hot_b = std::max(E - 56, 0), hot_c = E / 3;
  if (hot_b != hot_a) copy_row(W, hot_a, hot_b);
  std::vector<float> x = randn(static_cast<size_t>(T) * kH, r);
  if (skew) {
    for (float& v : x) v += 0.3f;
    for (int e : {hot_a, hot_b, hot_c}) shift_bias(W, e, 3.0 / (0.3 * kH));  // hot_a, hot_b stay equal
  }
  QMat dW = upload_q(W);
  float* dx = to_dev(x);
  Route rt(dW, dx, T, E, k, norm, tile_m);
  moe_route_prefill(rt.a, 0);
  CK(cudaGetLastError());
  const size_t S = static_cast<size_t>(T) * k;
  const std::vector<float> logits = from_dev(rt.a.logits, static_cast<size_t>(T) * E);
  const std::vector<float> w = from_dev(rt.a.route_w, S), shared = from_dev(rt.a.shared_logit, T);
  const std::vector<int> ids = from_dev(rt.a.expert_ids, S), counts = from_dev(rt.a.counts, E);
  const std::vector<int> offsets = from_dev(rt.a.offsets, E + 1), x_rows = from_dev(rt.a.x_rows, S);
  const std::vector<int> y_rows = from_dev(rt.a.y_rows, S), n_tiles_v = from_dev(rt.a.n_tiles, 1);
  const std::vector<int4> tiles = from_dev(rt.a.tiles, rt.a.max_tiles);
  char tag[96];
  std::snprintf(tag, sizeof tag, "T=%d E=%d k=%d tile_m=%d%s%s", T, E, k, tile_m, norm ? "" : " unnormalised",
                skew ? " skewed" : "");

  // Host top-k of the kernel's logits.
  bool ids_ok = true, ties_seen = false;
  std::vector<double> want_w(S);
  for (int t = 0; t < T; ++t) {
    const float* l = logits.data() + static_cast<size_t>(t) * E;
    const std::vector<int> top = topk_ids(l, E, k);
    const double m = *std::max_element(l, l + E);
    double z = 0, zk = 0;
    for (int e = 0; e < E; ++e) z += std::exp(double(l[e]) - m);
    for (int e : top) zk += std::exp(double(l[e]) - m);
    for (int j = 0; j < k; ++j) {
      ids_ok &= ids[static_cast<size_t>(t) * k + j] == top[j];
      want_w[static_cast<size_t>(t) * k + j] = std::exp(double(l[top[j]]) - m) / (norm ? zk : z);
      if (j > 0 && l[top[j]] == l[top[j - 1]]) ties_seen = true;
    }
  }
  expect(std::string("routing ") + tag + ": expert ids (equal logits: lower id first" +
             (ties_seen ? ", ties seen)" : ")"),
         ids_ok);
  report("  routing weights", rel_err(w, want_w), 2e-5);
  report("  shared-expert gate logit", rel_err(shared, ref_rows(W, x, T, E, E + 1)), kLogitTol);

  // Counts, offsets, sorted rows.
  std::vector<int> want_counts(E, 0);
  for (size_t s = 0; s < S; ++s)
    if (ids[s] >= 0 && ids[s] < E) ++want_counts[ids[s]];
  expect("  counts", counts == want_counts);
  bool off_ok = offsets[0] == 0 && offsets[E] == static_cast<int>(S);
  for (int e = 0; e < E && off_ok; ++e) off_ok = offsets[e + 1] == offsets[e] + want_counts[e];
  expect("  offsets (exclusive scan of the counts)", off_ok);
  bool rows_ok = off_ok;
  std::vector<char> seen(S, 0);
  for (int e = 0; rows_ok && e < E; ++e)
    for (int row = offsets[e]; rows_ok && row < offsets[e + 1]; ++row) {
      const int s = y_rows[row];
      rows_ok = s >= 0 && s < static_cast<int>(S) && !seen[s] && ids[s] == e && x_rows[row] == s / k;
      if (rows_ok) seen[s] = 1;
    }
  expect("  x_rows / y_rows: a permutation of the slots grouped by expert", rows_ok);

  // Tiles: experts ascending, each expert's rows in consecutive pieces of <= tile_m.
  int want_tiles = 0;
  for (int c : want_counts) want_tiles += (c + tile_m - 1) / tile_m;
  const int n_tiles = n_tiles_v[0];
  bool tiles_ok = n_tiles == want_tiles && n_tiles <= rt.a.max_tiles;
  for (int i = 0, end = 0, prev_e = -1; tiles_ok && i < n_tiles; ++i) {
    const int4 tl = tiles[i];
    tiles_ok = tl.x >= std::max(prev_e, 0) && tl.x < E && tl.y == end && tl.z >= 1 && tl.z <= tile_m && tl.w == 0 &&
               tl.y >= offsets[tl.x] && tl.y + tl.z <= offsets[tl.x + 1];
    end = tl.y + tl.z;
    prev_e = tl.x;
    if (i == n_tiles - 1) tiles_ok &= end == static_cast<int>(S);
  }
  char name[160];
  std::snprintf(name, sizeof name, "  tiles cover every row once (%d tiles, bound %d)", n_tiles, rt.a.max_tiles);
  expect(name, tiles_ok);

  // A second call on the same buffers (scratch not zero now; no logits) gives the same routing.
  float* const logits_buf = rt.a.logits;
  rt.a.logits = nullptr;
  moe_route_prefill(rt.a, 0);
  CK(cudaGetLastError());
  expect("  second call: same ids, weights, counts, offsets and tiles",
         from_dev(rt.a.expert_ids, S) == ids && from_dev(rt.a.route_w, S) == w && from_dev(rt.a.counts, E) == counts &&
             from_dev(rt.a.offsets, E + 1) == offsets && from_dev(rt.a.n_tiles, 1) == n_tiles_v);
  rt.a.logits = logits_buf;
  free_q(dW);
  cudaFree(dx);
}

void test_combine(int T, int H, int k, uint64_t seed) {
  Rng r(seed);
  const size_t n = static_cast<size_t>(T) * H;
  const std::vector<float> h = rand_sym(n, r), ys = rand_sym(n * k, r);
  const std::vector<float> ysh = rand_sym(static_cast<size_t>(T) * H, r), gl = rand_sym(T, r, 4.0);
  float* dh = to_dev(h);
  float* dys = to_dev(ys);
  float* dysh = to_dev(ysh);
  float* dgl = to_dev(gl);
  moe_combine_prefill(dh, dys, dysh, dgl, T, H, k, 0);
  CK(cudaGetLastError());
  std::vector<double> want(h.size());
  for (int t = 0; t < T; ++t) {
    const double g = sigmoid(gl[t]);
    for (int n = 0; n < H; ++n) {
      const size_t i = static_cast<size_t>(t) * H + n;
      double v = double(h[i]) + g * ysh[i];
      for (int j = 0; j < k; ++j) v += ys[(static_cast<size_t>(t) * k + j) * H + n];
      want[i] = v;
    }
  }
  char name[96];
  std::snprintf(name, sizeof name, "moe_combine_prefill T=%d H=%d k=%d", T, H, k);
  report(name, rel_err(from_dev(dh, h.size()), want), 1e-5);
  cudaFree(dh), cudaFree(dys), cudaFree(dysh), cudaFree(dgl);
}

// Arguments the host wrappers must refuse.
void test_refusals() {
  Rng r(9);
  HostQ W = make_q(9, 256, 8, 64, r);
  QMat dW = upload_q(W);
  float* dx = to_dev(randn(256, r));
  auto refused = [](auto&& f) {
    try {
      f();
    } catch (const Error&) {
      return true;
    }
    return false;
  };
  {
    Route rt(dW, dx, 1, 8, 2, true, 32);
    rt.a.tile_m = 48;
    expect("moe_route_prefill refuses tile_m 48", refused([&] { moe_route_prefill(rt.a, 0); }));
    rt.a.tile_m = 32;
    rt.a.max_tiles = 1;
    expect("moe_route_prefill refuses max_tiles below the bound", refused([&] { moe_route_prefill(rt.a, 0); }));
    rt.a.max_tiles = moe_max_tiles(2, 32, 8);
    rt.a.E = 7;
    expect("moe_route_prefill refuses a router of E + 2 rows", refused([&] { moe_route_prefill(rt.a, 0); }));
  }
  expect("moe_combine_prefill refuses H % 4 != 0", refused([&] { moe_combine_prefill(dx, dx, dx, dx, 1, 6, 1, 0); }));
  free_q(dW);
  cudaFree(dx);
}

float time_ms(const std::function<void()>& f, int reps) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  f();
  CK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) f();
  CK(cudaEventRecord(b));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms / reps;
}

// Timings at the 35B-A3B shape (information only).
void time_prefill_moe() {
  const int T = 4096, E = 256, k = 8;
  Rng r(11);
  HostQ W = make_q(E + 1, kH, 8, 64, r, false);
  QMat dW = upload_q(W);
  float* dx = to_dev(rand_sym(static_cast<size_t>(T) * kH, r));
  Route rt(dW, dx, T, E, k, true, 32);
  MoeRouteArgs a = rt.a;
  a.logits = nullptr;
  const float route_ms = time_ms([&] { moe_route_prefill(a, 0); }, 20);
  float* dh = dev_alloc<float>(static_cast<size_t>(T) * kH, false);
  float* dys = dev_alloc<float>(static_cast<size_t>(T) * k * kH, false);
  float* dysh = dev_alloc<float>(static_cast<size_t>(T) * kH, false);
  float* dgl = dev_alloc<float>(T, false);
  const float combine_ms = time_ms([&] { moe_combine_prefill(dh, dys, dysh, dgl, T, kH, k, 0); }, 20);
  CK(cudaGetLastError());
  std::printf("info moe_route_prefill T=%d E=%d k=%d: %.1f us; moe_combine_prefill T=%d H=%d k=%d: %.1f us (%.0f GB/s)\n", T,
              E, k, route_ms * 1e3, T, kH, k, combine_ms * 1e3,
              (static_cast<double>(T) * kH * 4 * (k + 3)) / (combine_ms * 1e-3) / 1e9);
  free_q(dW);
  cudaFree(dx), cudaFree(dh), cudaFree(dys), cudaFree(dysh), cudaFree(dgl);
}

}  // namespace

void run_moe_prefill_tests() {
  std::printf("\n== MoE prefill: router GEMM, top-k, counting sort, tiles, combine ==\n");
  for (int bits : {8, 4}) {
    for (int T : {1, 7, 100, 257, 4096}) test_logits(bits, T, 256, 8, 100 + T + bits);
    for (int T : {1, 7, 100, 257}) test_logits(bits, T, 8, 2, 200 + T + bits);
  }
  for (int tile_m : {16, 32, 64, 128}) {
    for (int T : {1, 3, 100, 4096}) test_routing(T, 256, 8, true, tile_m, T >= 100, 300 + T + tile_m);
    test_routing(100, 8, 2, true, tile_m, false, 400 + tile_m);
  }
  test_routing(257, 256, 8, false, 32, false, 501);
  test_routing(33, 8, 2, false, 16, true, 502);
  for (int T : {1, 7, 100, 257, 4096}) test_combine(T, kH, 8, 600 + T);
  test_combine(7, 64, 2, 607);
  test_refusals();
  time_prefill_moe();
}

}  // namespace lily::cuda::test
