// The decode GEMV (every x/y mode, 4 and 8 bits, several group sizes) against fp64 references;
// the MoE kernels are tested from Python (tests/test_ops.py, test_moe_block_cuda).
#include <algorithm>
#include <numeric>

#include "qmatmul/qmatmul_decode.h"
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

}  // namespace

void run_qmatmul_decode_tests() {
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
}

}  // namespace lily::cuda::test
