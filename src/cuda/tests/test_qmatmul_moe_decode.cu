// GEMV (every x/y mode, 4 and 8 bits, several group sizes) and the MoE kernels
// (router + top-k, gate/up, down + combine) against fp64 references.
#include <algorithm>
#include <numeric>

#include "qmatmul/qmatmul_decode.h"
#include "moe/moe_experts_decode.h"
#include "moe/moe_router_decode.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

std::vector<double> rmsnorm(const std::vector<float>& x, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (float v : x) ss += double(v) * v;
  const double inv = 1 / std::sqrt(ss / x.size() + eps);
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * inv * w[i];
  return y;
}

std::vector<double> matvec(const HostQ& W, const std::vector<double>& x, int row0 = 0, int rows = -1) {
  if (rows < 0) rows = W.rows;
  std::vector<double> y(rows, 0.0);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < W.cols; ++c) y[r] += W.deq[static_cast<size_t>(row0 + r) * W.cols + c] * x[c];
  return y;
}

void test_qmatmul_decode(int bits, int group, int rows, int cols, XMode mode, YMode ymode, uint64_t seed, bool tiled = false) {
  Rng r(seed);
  HostQ W = make_q(rows, cols, bits, group, r);
  QMat dW = upload_as(W, tiled);
  const std::vector<float> x = randn(cols, r, 2.0);
  std::vector<float> w = randn(cols, r, 0.2);
  for (float& v : w) v += 1.0f;
  XSpec X;
  X.mode = mode;
  X.eps = 1e-6f;
  float* dx = to_dev(x);
  float* dw = to_dev(w);
  X.x = dx;
  X.w = dw;
  std::vector<double> xd(cols);
  HostQ E;
  float* dh = nullptr;
  int* dtok = nullptr;
  if (mode == XMode::Plain) {
    for (int c = 0; c < cols; ++c) xd[c] = x[c];
  } else if (mode == XMode::RmsNorm) {
    xd = rmsnorm(x, w, 1e-6);
  } else {  // EmbedRmsNorm: token 29 of a 37-row table
    E = make_q(37, cols, 4, 64, r);
    X.embed = upload_q(E);
    dtok = to_dev(std::vector<int>{29});
    dh = dev_alloc<float>(cols);
    X.token = dtok;
    X.h_out = dh;
    std::vector<float> e(cols);
    for (int c = 0; c < cols; ++c) e[c] = static_cast<float>(E.deq[29 * static_cast<size_t>(cols) + c]);
    xd = rmsnorm(e, w, 1e-6);
  }
  const std::vector<float> y0 = randn(rows, r);
  float* dy = ymode == YMode::Add ? to_dev(y0) : dev_alloc<float>(rows);
  qmatmul_decode(dW, X, {ymode, dy}, nullptr, 0);
  CK(cudaGetLastError());
  std::vector<double> ref = matvec(W, xd);
  if (ymode == YMode::Add)
    for (int i = 0; i < rows; ++i) ref[i] += y0[i];
  const char* names[] = {"plain", "rmsnorm", "embed+rmsnorm"};
  char name[160];
  std::snprintf(name, sizeof name, "qmatmul_decode %d-bit g%d %dx%d %s %s%s", bits, group, rows, cols, names[int(mode)],
                ymode == YMode::Add ? "add" : "store", tiled ? " (tensor cores)" : "");
  report(name, rel_err(from_dev(dy, rows), ref), tiled ? 2e-4 : 1e-4);
  if (mode == XMode::EmbedRmsNorm) {
    std::vector<double> e(cols);
    for (int c = 0; c < cols; ++c) e[c] = E.deq[29 * static_cast<size_t>(cols) + c];
    report("  embedding row written to h", rel_err(from_dev(dh, cols), e), 1e-6);
    free_q(X.embed);
  }
  free_q(dW);
  cudaFree(dx), cudaFree(dw), cudaFree(dy), cudaFree(dh), cudaFree(dtok);
}

// Halted kernels must leave their outputs alone.
void test_qmatmul_decode_halt() {
  Rng r(5);
  HostQ W = make_q(64, 256, 4, 64, r);
  QMat dW = upload_q(W);
  float* dx = to_dev(randn(256, r));
  float* dy = dev_alloc<float>(64, false);
  int* halt = to_dev(std::vector<int>{1});
  XSpec X;
  X.x = dx;
  qmatmul_decode(dW, X, {YMode::Store, dy}, halt, 0);
  const auto y = from_dev(dy, 64);
  expect("qmatmul_decode with halt set writes nothing", std::all_of(y.begin(), y.end(), [](float v) { return v == 0.0f; }));
  free_q(dW);
  cudaFree(dx), cudaFree(dy), cudaFree(halt);
}

void test_moe(int H, int E, int k, int I, int Is, uint64_t seed, bool tiled = false) {
  Rng r(seed);
  HostQ router = make_q(E + 1, H, 8, 64, r), gu = make_q(E * 2 * I, H, 4, 64, r), down = make_q(E * H, I, 4, 64, r);
  HostQ sgu = make_q(2 * Is, H, 4, 64, r), sdown = make_q(H, Is, 4, 64, r);
  const std::vector<float> h = randn(H, r, 2.0);
  std::vector<float> w = randn(H, r, 0.2);
  for (float& v : w) v += 1.0f;
  MoeExperts m;
  m.gate_up = upload_as(gu, tiled, I);
  m.down = upload_as(down, tiled);
  m.shared_gate_up = upload_as(sgu, tiled, Is);
  m.shared_down = upload_as(sdown, tiled);
  m.n_experts = E;
  m.inter = I;
  m.shared_inter = Is;
  QMat dR = upload_q(router);
  float* dh = to_dev(h);
  float* dw = to_dev(w);
  RouterOut out{dev_alloc<float>(E + 1), dev_alloc<int>(k), dev_alloc<float>(k), dev_alloc<float>(1)};
  float* act = dev_alloc<float>(k * I + Is);
  XSpec X;
  X.mode = XMode::RmsNorm;
  X.x = dh;
  X.w = dw;
  moe_router_decode(dR, X, E, k, true, out, nullptr, 0);
  // No logits kept (decode), and smaller clusters (a partitioned GPU may place no more):
  // each row is still one warp's dot product, so the routing is the same bit for bit.
  // (Run before moe_down_decode adds to h, which X reads.)
  const int caps[] = {kRouterMaxCluster, 8, 4, 1};
  RouterOut capped[4];
  for (int c = 0; c < 4; ++c) {
    const bool keep = caps[c] != kRouterMaxCluster && caps[c] != 1;
    capped[c] = {keep ? dev_alloc<float>(E + 1) : nullptr, dev_alloc<int>(k), dev_alloc<float>(k), dev_alloc<float>(1)};
    moe_router_decode(dR, X, E, k, true, capped[c], nullptr, 0, caps[c]);
  }
  moe_gate_up_decode(m, X, out.ids, k, act, nullptr, 0);
  moe_down_decode(m, act, out.ids, out.weights, out.shared_gate, k, dh, nullptr, nullptr, 0);
  CK(cudaGetLastError());

  const std::vector<double> x = rmsnorm(h, w, 1e-6);
  const std::vector<double> logits = matvec(router, x);
  char name[160];
  std::snprintf(name, sizeof name, "moe H%d E%d k%d I%d Is%d%s: router logits", H, E, k, I, Is,
                tiled ? " (tensor cores)" : "");
  report(name, rel_err(from_dev(out.logits, E + 1), logits), 1e-4);
  double mx = *std::max_element(logits.begin(), logits.begin() + E), z = 0;
  std::vector<double> p(E);
  for (int e = 0; e < E; ++e) z += p[e] = std::exp(logits[e] - mx);
  for (double& v : p) v /= z;
  std::vector<double> sorted(p);
  std::sort(sorted.rbegin(), sorted.rend());
  const auto ids = from_dev(out.ids, k);
  bool ids_ok = true;
  double psum = 0;
  for (int j = 0; j < k; ++j) {
    ids_ok &= ids[j] >= 0 && ids[j] < E && p[ids[j]] >= sorted[k - 1] * (1 - 1e-5);
    ids_ok &= std::count(ids.begin(), ids.end(), ids[j]) == 1;
    if (ids_ok) psum += p[ids[j]];
  }
  expect("  top-k ids are the k most probable experts", ids_ok);
  for (int c = 0; c < 4; ++c) {
    const RouterOut& o = capped[c];
    std::snprintf(name, sizeof name, "  clusters of at most %d%s: the same routing", caps[c], o.logits ? "" : ", no logits kept");
    expect(name, (!o.logits || from_dev(o.logits, E + 1) == from_dev(out.logits, E + 1)) && from_dev(o.ids, k) == ids &&
                     from_dev(o.weights, k) == from_dev(out.weights, k) &&
                     from_dev(o.shared_gate, 1) == from_dev(out.shared_gate, 1));
    cudaFree(o.logits), cudaFree(o.ids), cudaFree(o.weights), cudaFree(o.shared_gate);
  }
  if (!ids_ok) return;
  std::vector<double> wref(k);
  for (int j = 0; j < k; ++j) wref[j] = p[ids[j]] / psum;
  report("  routing weights (renormalised)", rel_err(from_dev(out.weights, k), wref), 1e-5);
  const double sg = sigmoid(logits[E]);
  report("  shared gate", rel_err(from_dev(out.shared_gate, 1), {sg}), 1e-5);

  std::vector<double> aref(k * I + Is);
  for (int j = 0; j < k; ++j) {
    const auto g = matvec(gu, x, ids[j] * 2 * I, I), u = matvec(gu, x, ids[j] * 2 * I + I, I);
    for (int i = 0; i < I; ++i) aref[j * I + i] = silu(g[i]) * u[i];
  }
  const auto sg_ = matvec(sgu, x, 0, Is), su = matvec(sgu, x, Is, Is);
  for (int i = 0; i < Is; ++i) aref[k * I + i] = silu(sg_[i]) * su[i];
  report("  gate/up activations (SiLU * up)", rel_err(from_dev(act, k * I + Is), aref), tiled ? 2e-4 : 1e-4);

  std::vector<double> href(H);
  for (int j = 0; j < H; ++j) href[j] = h[j];
  for (int e = 0; e < k; ++e) {
    std::vector<double> a(aref.begin() + e * I, aref.begin() + (e + 1) * I);
    const auto y = matvec(down, a, ids[e] * H, H);
    for (int j = 0; j < H; ++j) href[j] += wref[e] * y[j];
  }
  std::vector<double> as(aref.begin() + k * I, aref.end());
  const auto ys = matvec(sdown, as);
  for (int j = 0; j < H; ++j) href[j] += sg * ys[j];
  report("  down + combine + residual", rel_err(from_dev(dh, H), href), tiled ? 2e-4 : 1e-4);

  for (QMat* q : {&m.gate_up, &m.down, &m.shared_gate_up, &m.shared_down, &dR}) free_q(*q);
  cudaFree(dh), cudaFree(dw), cudaFree(act);
  cudaFree(out.logits), cudaFree(out.ids), cudaFree(out.weights), cudaFree(out.shared_gate);
}

}  // namespace

void run_qmatmul_moe_decode_tests() {
  test_qmatmul_decode(4, 64, 1, 128, XMode::Plain, YMode::Store, 1);
  test_qmatmul_decode(4, 64, 7, 384, XMode::RmsNorm, YMode::Add, 2);
  test_qmatmul_decode(4, 32, 1000, 2048, XMode::RmsNorm, YMode::Store, 3);
  test_qmatmul_decode(4, 128, 12352, 2048, XMode::Plain, YMode::Store, 4);
  test_qmatmul_decode(4, 64, 2048, 4096, XMode::Plain, YMode::Add, 5);  // the GDN output projection
  test_qmatmul_decode(4, 64, 300, 128, XMode::Plain, YMode::Store, 6);
  test_qmatmul_decode(4, 64, 300, 256, XMode::EmbedRmsNorm, YMode::Store, 7);
  test_qmatmul_decode(8, 64, 257, 2048, XMode::RmsNorm, YMode::Store, 8);
  test_qmatmul_decode(8, 32, 33, 512, XMode::Plain, YMode::Add, 9);
  test_qmatmul_decode(8, 128, 4500, 1024, XMode::Plain, YMode::Store, 10);
  test_qmatmul_decode_halt();
  test_moe(256, 16, 4, 64, 128, 11);   // lily-tiny shape
  test_moe(128, 8, 2, 64, 64, 12);     // the synthetic tiny shape
  test_moe(2048, 64, 8, 512, 512, 13);   // Qwen3.6-35B-A3B widths (64 of its 256 experts)
  test_moe(2048, 256, 8, 512, 512, 14);  // all 256: one router row per warp of the cluster
  test_moe(256, 512, 10, 64, 64, 15);    // 513 router rows: several per warp
  test_moe(256, 300, 8, 64, 64, 16);     // E past 256 and not a multiple of 32 (16 per lane, some lanes short)
  // Tensor-core path (tiled weights), the same shapes.
  test_qmatmul_decode(4, 64, 1, 128, XMode::Plain, YMode::Store, 101, true);
  test_qmatmul_decode(4, 64, 7, 384, XMode::RmsNorm, YMode::Add, 102, true);
  test_qmatmul_decode(4, 64, 1000, 2048, XMode::RmsNorm, YMode::Store, 103, true);
  test_qmatmul_decode(4, 64, 12352, 2048, XMode::Plain, YMode::Store, 104, true);
  test_qmatmul_decode(4, 64, 2048, 4096, XMode::Plain, YMode::Add, 105, true);
  test_qmatmul_decode(4, 64, 300, 128, XMode::Plain, YMode::Store, 106, true);
  test_qmatmul_decode(4, 64, 300, 256, XMode::EmbedRmsNorm, YMode::Store, 107, true);
  test_qmatmul_decode(4, 64, 33, 1088, XMode::RmsNorm, YMode::Store, 108, true);
  // Several row blocks per block in turn, odd counts and a partial last one.
  test_qmatmul_decode(4, 64, 21127, 128, XMode::RmsNorm, YMode::Add, 109, true);
  test_qmatmul_decode(4, 64, 9000, 4096, XMode::Plain, YMode::Store, 110, true);
  test_moe(256, 16, 4, 64, 128, 111, true);
  test_moe(128, 8, 2, 64, 64, 112, true);
  test_moe(2048, 64, 8, 512, 512, 113, true);
  test_moe(4096, 64, 8, 512, 512, 114, true);  // 256 row blocks of h: moe_down_decode in blocks of 8 warps
  test_moe(256, 16, 4, 192, 64, 115, true);     // 3 groups, 24 row blocks an expert: not powers of two
}

}  // namespace lily::cuda::test
