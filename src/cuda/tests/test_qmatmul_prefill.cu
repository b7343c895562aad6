// The 4-bit prefill GEMM (qmatmul_prefill) against fp64 references: dense Store/Add on awkward
// and real shapes for every tile size, SwiGLU on gate/up-interleaved weights, and the
// grouped (MoE) mode with a tile list, row gather, scatter, routing weights and tiles
// past *n_tiles. Outputs start as NaN where the kernel must write and as a sentinel
// (or the Add input) everywhere else, which must survive. Every case runs all three
// kernels: the exact one against the exact weights, the weights_bf16 and wgmma ones
// against the weights rounded to bf16 as the device rounds them (isolating accumulation
// error) and, with a bf16-sized tolerance, against the exact weights. Single wgmma
// instructions (shared-memory A and B, K-major, 128B swizzle) are first checked alone
// against a CPU matmul, so a descriptor or layout bug shows up in isolation.
#include <algorithm>
#include <atomic>
#include <limits>
#include <numeric>
#include <thread>

#include "error.h"
#include "qmatmul/qmatmul_prefill.h"
#include "qmatmul/qmatmul_prefill_core.cuh"
#include "test_util.h"

namespace lily::cuda {
namespace {

// One warpgroup computes D (64 x N fp32) = A (64 x 16 ksteps) · B (N x 16 ksteps)ᵀ with
// ksteps chained wgmma.mma_async m64nNk16 from shared memory: a, b bf16 [rows][64]
// (ksteps <= 4) are written into K-major 128-byte rows with the 128B swizzle as the PTX
// ISA states it (16-byte chunk c of row r at chunk c ^ (r % 8) of a 1024-byte aligned
// atom), d [64][N] from the D fragment: d[4i + 2h + e] = D[16 w + gid + 8h][8i + 2t + e].
template <int N, int ksteps>
__global__ void __launch_bounds__(128) wgmma_probe_kernel(const uint16_t* a, const uint16_t* b, float* d) {
  extern __shared__ __align__(16) unsigned char smem[];
  const uint32_t raw0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t sa = (raw0 + 1023) & ~1023u, sb = sa + 64 * 128;
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, gid = lane >> 2, t = lane & 3;
  pdl_wait();
  for (int i = tid; i < (64 + N) * 32; i += 128) {  // 4-byte words: row i / 32, k = 2 (i % 32)
    const int row = i >> 5, k = 2 * (i & 31), r = row < 64 ? row : row - 64;
    const uint16_t* src = (row < 64 ? a : b) + r * 64 + k;
    const uint32_t tile = row < 64 ? sa : sb;
    st_shared_u32(tile + r * 128 + (((k >> 3) ^ (r & 7)) << 4) + 2 * (k & 7),
                  src[0] | static_cast<uint32_t>(src[1]) << 16);
  }
  fence_proxy_async_smem();
  __syncthreads();
  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.0f;
  wgmma_hold(acc);
  wgmma_fence();
#pragma unroll
  for (int j = 0; j < ksteps; ++j)
    wgmma_ss<N>(acc, wgmma_desc_kmajor_sw128(sa + 32 * j), wgmma_desc_kmajor_sw128(sb + 32 * j), 1);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(acc);
#pragma unroll
  for (int i = 0; i < N / 2; ++i)
    d[(16 * w + gid + 8 * ((i >> 1) & 1)) * N + 8 * (i >> 2) + 2 * t + (i & 1)] = acc[i];
}

}  // namespace
}  // namespace lily::cuda

namespace lily::cuda::test {
namespace {

constexpr int kTiles[] = {16, 32, 64, 128};
constexpr float kSentinel = 1234.5f;
constexpr uint16_t kSentinelBf16 = 0x3F81, kNanBf16 = 0xFFFF;

template <typename F>
void parallel_for(int n, F&& f) {
  const int workers = static_cast<int>(std::clamp(std::thread::hardware_concurrency(), 1u, 32u));
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int w = 0; w < workers; ++w)
    pool.emplace_back([&] {
      for (int i; (i = next++) < n;) f(i);
    });
  for (auto& t : pool) t.join();
}

double dot(const double* a, const double* b, int n) {  // n % 4 == 0
  double s[4] = {0, 0, 0, 0};
  for (int k = 0; k < n; k += 4)
    for (int i = 0; i < 4; ++i) s[i] += a[k + i] * b[k + i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// Random bf16 activations [rows][cols] stored with row stride ld; the padding columns
// hold NaN, so a kernel reading past K poisons its result.
struct Bf16Mat {
  int rows, cols, ld;
  std::vector<uint16_t> bits;
  std::vector<double> val;  // [rows][cols], the exact bf16 values
  const double* row(int r) const { return val.data() + static_cast<size_t>(r) * cols; }
};

Bf16Mat random_bf16(int rows, int cols, int ld, Rng& r) {
  Bf16Mat m{rows, cols, ld, std::vector<uint16_t>(static_cast<size_t>(rows) * ld, kNanBf16),
            std::vector<double>(static_cast<size_t>(rows) * cols)};
  for (int i = 0; i < rows; ++i)
    for (int c = 0; c < cols; ++c) {
      const uint16_t b = float_to_bf16(static_cast<float>(r.normal()));
      m.bits[static_cast<size_t>(i) * ld + c] = b;
      m.val[static_cast<size_t>(i) * cols + c] = bf16_to_float(b);
    }
  return m;
}

// The weights and their bf16-rounded copy as qmatmul_prefill with weights_bf16 uses them:
// bf16(s q + b), an fp32 fma rounded to nearest even (exact in fp32 here, so this is
// the single rounding of the device's bf16x2 fma).
struct Weights {
  const HostQ& q;
  std::vector<double> w16;
  explicit Weights(const HostQ& W) : q(W), w16(W.deq.size()) {
    const int words = W.cols / 8, groups = W.cols / 64;
    for (int r = 0; r < W.rows; ++r)
      for (int c = 0; c < W.cols; ++c) {
        const uint32_t sb = W.sb[static_cast<size_t>(r) * groups + c / 64];
        const float sc = bf16_to_float(static_cast<uint16_t>(sb)), b = bf16_to_float(static_cast<uint16_t>(sb >> 16));
        const uint32_t code = (W.codes[static_cast<size_t>(r) * words + c / 8] >> (4 * (c % 8))) & 15u;
        w16[static_cast<size_t>(r) * W.cols + c] = round_bf16(std::fma(sc, static_cast<float>(code), b));
      }
  }
  const double* row(int r, bool bf16) const { return (bf16 ? w16 : q.deq).data() + static_cast<size_t>(r) * q.cols; }
};

// An output buffer [rows][ld] on the host: its initial contents, and the value each
// element must end with where the kernel writes it: want[0] with the exact weights,
// want[1] with the bf16-rounded ones.
template <typename E>
struct Expect {
  int rows, ld;
  std::vector<E> init;
  std::vector<char> written;
  std::vector<double> want[2];
  Expect(int rows_, int ld_, E fill)
      : rows(rows_), ld(ld_), init(static_cast<size_t>(rows_) * ld_, fill), written(init.size(), 0),
        want{std::vector<double>(init.size(), 0), std::vector<double>(init.size(), 0)} {}
  void set(int r, int c, double v, double v16, E initial) {
    const size_t i = static_cast<size_t>(r) * ld + c;
    written[i] = 1;
    want[0][i] = v;
    want[1][i] = v16;
    init[i] = initial;
  }
};

// Max error over the written elements relative to their RMS (bf16: relative to |want| +
// RMS, as the rounding is relative); untouched: every other element kept its initial value.
template <typename E>
double compare(const Expect<E>& ex, const std::vector<double>& want, const std::vector<E>& got, bool& untouched) {
  double ss = 0;
  size_t n = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (ex.written[i]) ss += want[i] * want[i], ++n;
  const double rms = std::sqrt(ss / std::max<size_t>(n, 1)) + 1e-30;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!ex.written[i]) {
      if (std::memcmp(&got[i], &ex.init[i], sizeof(E)) != 0) untouched = false;
      continue;
    }
    double v;
    if constexpr (sizeof(E) == 2) v = bf16_to_float(got[i]);
    else v = got[i];
    if (!std::isfinite(v)) return INFINITY;
    const double scale = sizeof(E) == 2 ? std::fabs(want[i]) + rms : rms;
    worst = std::max(worst, std::fabs(v - want[i]) / scale);
  }
  return worst;
}

// Bound on max error / RMS of the bf16-weight kernel against the exact weights: one
// bf16 rounding per weight gives errors of std ~2e-3 of the output RMS (max 1.1e-2 over
// the 58k outputs of test_grouped in emulation), so ~1.3e-2 at 5.5 sigma.
constexpr double kBf16WeightsTol = 2e-2;

// The three kernels: exact maths, bf16 weights (mma.sync), bf16 weights on wgmma.
enum class Route { Exact, Bf16w, Wgmma };
constexpr Route kRoutes[] = {Route::Exact, Route::Bf16w, Route::Wgmma};

// Runs qmatmul_prefill on a fresh copy of ex.init (into a.y or a.act) with each kernel and
// reports: exact kernel vs want[0] (tol); bf16-weight kernels vs want[1] (tol) and vs
// want[0] (tol + kBf16WeightsTol).
template <typename E>
void run_and_compare(GemmArgs a, int tile_m, const Expect<E>& ex, const std::string& name, double tol,
                     bool& untouched) {
  for (Route route : kRoutes) {
    E* out = to_dev(ex.init);
    if constexpr (sizeof(E) == 2) a.act = out;
    else a.y = out;
    a.ldy = ex.ld;
    a.weights_bf16 = route != Route::Exact;
    a.wgmma = route == Route::Wgmma;
    qmatmul_prefill(a, tile_m, 0);
    CK(cudaGetLastError());
    const std::vector<E> got = from_dev(out, ex.init.size());
    cudaFree(out);
    const bool w16 = a.weights_bf16;
    const std::string tag = route == Route::Exact ? "" : route == Route::Bf16w ? " [bf16 w]" : " [wgmma]";
    report(name + tag, compare(ex, ex.want[w16], got, untouched), tol);
    if (w16) report(name + tag + " vs exact w", compare(ex, ex.want[0], got, untouched), tol + kBf16WeightsTol);
  }
}

// wgmma_probe_kernel<N, ksteps> against the fp64 product of the same bf16
// values: the sums of 16 ksteps bf16 products agree to fp32 accumulation (~1e-6 of the RMS).
template <int N, int ksteps>
void test_wgmma_probe(uint64_t seed) {
  Rng r(seed);
  const Bf16Mat A = random_bf16(64, 64, 64, r), B = random_bf16(N, 64, 64, r);
  uint16_t *da = to_dev(A.bits), *db = to_dev(B.bits);
  float* dd = dev_alloc<float>(64 * N);
  const size_t smem = 1024 + (64 + N) * 128;
  launch("wgmma probe", wgmma_probe_kernel<N, ksteps>, dim3(1), dim3(128), smem, 0, static_cast<const uint16_t*>(da),
         static_cast<const uint16_t*>(db), dd);
  CK(cudaGetLastError());
  const std::vector<float> got = from_dev(dd, 64 * N);
  double ss = 0, worst = 0;
  std::vector<double> want(64 * N);
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      want[m * N + n] = dot(A.row(m), B.row(n), 16 * ksteps);
      ss += want[m * N + n] * want[m * N + n];
    }
  const double rms = std::sqrt(ss / (64 * N));
  for (int i = 0; i < 64 * N; ++i)
    worst = std::isfinite(got[i]) ? std::max(worst, std::fabs(got[i] - want[i]) / rms) : INFINITY;
  char name[96];
  std::snprintf(name, sizeof name, "wgmma probe m64n%dk16 x %d (smem A, B: K-major, 128B swizzle)", N, ksteps);
  report(name, worst, 1e-5);
  cudaFree(da), cudaFree(db), cudaFree(dd);
}

void test_dense(int M, int N, int K, int ldx, uint64_t seed) {
  Rng r(seed);
  const HostQ W = make_q(N, K, 4, 64, r);
  const Weights Wd(W);
  QMat dW = upload_q_tiled(W);
  const Bf16Mat X = random_bf16(M, K, ldx, r);
  uint16_t* dx = to_dev(X.bits);
  std::vector<double> ref(static_cast<size_t>(M) * N), ref16(ref.size());
  parallel_for(M, [&](int m) {
    for (int n = 0; n < N; ++n) {
      ref[static_cast<size_t>(m) * N + n] = dot(X.row(m), Wd.row(n, false), K);
      ref16[static_cast<size_t>(m) * N + n] = dot(X.row(m), Wd.row(n, true), K);
    }
  });
  const std::vector<float> y0 = randn(static_cast<size_t>(M) * N, r);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Expect<float> store(M + 2, N + 3, kSentinel), add(M + 2, N + 3, kSentinel);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      const size_t i = static_cast<size_t>(m) * N + n;
      store.set(m, n, ref[i], ref16[i], nan);
      add.set(m, n, y0[i] + ref[i], y0[i] + ref16[i], y0[i]);
    }
  GemmArgs a;
  a.W = dW;
  a.x = dx;
  a.ldx = ldx;
  a.M = M;
  bool untouched = true;
  for (int tile : kTiles)
    for (GemmEpilogue epi : {GemmEpilogue::Store, GemmEpilogue::Add}) {
      a.epi = epi;
      char name[160];
      std::snprintf(name, sizeof name, "qmatmul_prefill dense %s M%d N%d K%d ldx%d tile %d",
                    epi == GemmEpilogue::Store ? "store" : "add", M, N, K, ldx, tile);
      run_and_compare(a, tile, epi == GemmEpilogue::Store ? store : add, name, 1e-4, untouched);
    }
  expect("  nothing written outside the M x N output (all tiles, store and add, all kernels)", untouched);
  free_q(dW);
  cudaFree(dx);
}

// Dense SwiGLU: W = [I gate rows; I up rows] packed with interleave I (the shared expert).
void test_swiglu(int M, int I, int K, uint64_t seed) {
  Rng r(seed);
  const HostQ W = make_q(2 * I, K, 4, 64, r);
  const Weights Wd(W);
  QMat dW = upload_q_tiled(W, I);
  const Bf16Mat X = random_bf16(M, K, K, r);
  uint16_t* dx = to_dev(X.bits);
  Expect<uint16_t> ex(M + 2, I + 8, kSentinelBf16);
  const size_t n_out = static_cast<size_t>(M) * I;
  std::vector<double> want[2] = {std::vector<double>(n_out), std::vector<double>(n_out)};
  parallel_for(M, [&](int m) {
    for (int i = 0; i < I; ++i)
      for (int w16 = 0; w16 < 2; ++w16)
        want[w16][static_cast<size_t>(m) * I + i] =
            silu(dot(X.row(m), Wd.row(i, w16), K)) * dot(X.row(m), Wd.row(I + i, w16), K);
  });
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < I; ++i) {
      const size_t k = static_cast<size_t>(m) * I + i;
      ex.set(m, i, want[0][k], want[1][k], kNanBf16);
    }
  GemmArgs a;
  a.W = dW;
  a.x = dx;
  a.ldx = K;
  a.M = M;
  a.epi = GemmEpilogue::SwiGlu;
  a.swiglu_inter = I;
  bool untouched = true;
  for (int tile : kTiles) {
    char name[160];
    std::snprintf(name, sizeof name, "qmatmul_prefill dense swiglu M%d I%d K%d tile %d", M, I, K, tile);
    run_and_compare(a, tile, ex, name, 1e-2, untouched);
  }
  expect("  nothing written outside the M x I activations", untouched);
  free_q(dW);
  cudaFree(dx);
}

// Grouped mode over E = 5 experts holding 0, 1, 17, 64 and 100 of the R sorted rows. The
// row arrays have 8 more rows that only two decoy tiles past *n_tiles point at: their
// outputs must stay untouched.
struct Routing {
  static constexpr int kE = 5, kDecoy = 8;
  std::vector<int> count = {0, 1, 17, 64, 100};
  int R = 0, M = 0;            // routed rows; rows including the decoy rows
  std::vector<int> expert_of;  // [R]
  std::vector<int> x_rows;     // [M] token of each row
  std::vector<int> y_rows;     // [M] distinct output rows in [0, n_out)
  int n_out = 0;

  Routing(int tokens, Rng& r) {
    for (int e = 0; e < kE; ++e) expert_of.insert(expert_of.end(), count[e], e);
    R = static_cast<int>(expert_of.size());
    M = R + kDecoy;
    n_out = M + 6;
    for (int i = 0; i < M; ++i) x_rows.push_back(static_cast<int>(r.next() % tokens));
    std::vector<int> perm(n_out);
    std::iota(perm.begin(), perm.end(), 0);
    for (int i = n_out - 1; i > 0; --i) std::swap(perm[i], perm[r.next() % (i + 1)]);
    y_rows.assign(perm.begin(), perm.begin() + M);
  }

  // Tiles of at most tile_m rows per expert, experts in order, then the two decoys.
  std::vector<int4> tiles(int tile_m, int& n_tiles) const {
    std::vector<int4> t;
    for (int e = 0, row0 = 0; e < kE; row0 += count[e], ++e)
      for (int s = 0; s < count[e]; s += tile_m) t.push_back(make_int4(e, row0 + s, std::min(tile_m, count[e] - s), 0));
    n_tiles = static_cast<int>(t.size());
    t.push_back(make_int4(2, R, kDecoy, 0));
    t.push_back(make_int4(4, R + 4, 4, 0));
    return t;
  }
};

// Runs `a` in grouped mode for every tile size with the routing's tile list.
template <typename E>
void run_grouped(GemmArgs a, const Routing& rt, const Expect<E>& ex, const char* what, double tol) {
  bool untouched = true;
  for (int tile : kTiles) {
    int n = 0;
    const std::vector<int4> tiles = rt.tiles(tile, n);
    a.tiles = to_dev(tiles);
    a.n_tiles = to_dev(std::vector<int>{n});
    a.max_tiles = static_cast<int>(tiles.size());
    char name[160];
    std::snprintf(name, sizeof name, "qmatmul_prefill grouped %s tile %d (%d tiles + 2 past n_tiles)", what, tile, n);
    run_and_compare(a, tile, ex, name, tol, untouched);
    cudaFree(const_cast<int4*>(a.tiles));
    cudaFree(const_cast<int*>(a.n_tiles));
  }
  expect(std::string("  ") + what + ": rows of other tiles, decoy tiles and padding untouched", untouched);
}

void test_grouped(uint64_t seed) {
  Rng r(seed);
  const int T = 61, H = 320, I = 192, E = Routing::kE;
  const Routing rt(T, r);
  const HostQ gu = make_q(E * 2 * I, H, 4, 64, r), down = make_q(E * H, I, 4, 64, r);
  const Weights gud(gu), downd(down);
  QMat dgu = upload_q_tiled(gu, I), ddown = upload_q_tiled(down);
  const Bf16Mat X = random_bf16(T, H, H, r), Xi = random_bf16(T, I, I, r), act = random_bf16(rt.M, I, I, r);
  uint16_t *dX = to_dev(X.bits), *dXi = to_dev(Xi.bits), *dact = to_dev(act.bits);
  int *dx_rows = to_dev(rt.x_rows), *dy_rows = to_dev(rt.y_rows);
  std::vector<float> y_scale(rt.n_out);
  for (float& v : y_scale) v = static_cast<float>(0.1 + 0.9 * r.uniform());
  float* dscale = to_dev(y_scale);

  {  // gate/up + SwiGLU: tokens gathered by x_rows, activations in sorted-row order
    Expect<uint16_t> ex(rt.M + 3, I + 8, kSentinelBf16);
    for (int row = 0; row < rt.R; ++row) {
      const int e = rt.expert_of[row];
      const double* x = X.row(rt.x_rows[row]);
      auto v = [&](int i, bool w16) {
        return silu(dot(x, gud.row(e * 2 * I + i, w16), H)) * dot(x, gud.row(e * 2 * I + I + i, w16), H);
      };
      for (int i = 0; i < I; ++i) ex.set(row, i, v(i, false), v(i, true), kNanBf16);
    }
    GemmArgs a;
    a.W = dgu;
    a.x = dX;
    a.ldx = H;
    a.M = rt.M;
    a.x_rows = dx_rows;
    a.epi = GemmEpilogue::SwiGlu;
    a.swiglu_inter = I;
    a.expert_rows = 2 * I;
    run_grouped(a, rt, ex, "gate/up swiglu, x_rows gather", 1e-2);
  }
  {  // down: Store scattered by y_rows, times the routing weight y_scale[out]
    Expect<float> ex(rt.n_out, H + 4, kSentinel);
    for (int row = 0; row < rt.R; ++row) {
      const int e = rt.expert_of[row], out = rt.y_rows[row];
      auto v = [&](int n, bool w16) { return y_scale[out] * dot(act.row(row), downd.row(e * H + n, w16), I); };
      for (int n = 0; n < H; ++n) ex.set(out, n, v(n, false), v(n, true), std::numeric_limits<float>::quiet_NaN());
    }
    GemmArgs a;
    a.W = ddown;
    a.x = dact;
    a.ldx = I;
    a.M = rt.M;
    a.y_rows = dy_rows;
    a.y_scale = dscale;
    a.expert_rows = H;
    run_grouped(a, rt, ex, "down store, y_rows scatter + y_scale", 1e-4);
  }
  {  // Add with both the gather and the scatter
    std::vector<float> y0 = randn(static_cast<size_t>(rt.n_out) * (H + 4), r);
    Expect<float> ex(rt.n_out, H + 4, 0.0f);
    ex.init = y0;
    for (int row = 0; row < rt.R; ++row) {
      const int e = rt.expert_of[row], out = rt.y_rows[row];
      const size_t i0 = static_cast<size_t>(out) * (H + 4);
      const double* x = Xi.row(rt.x_rows[row]);
      for (int n = 0; n < H; ++n)
        ex.set(out, n, y0[i0 + n] + dot(x, downd.row(e * H + n, false), I),
               y0[i0 + n] + dot(x, downd.row(e * H + n, true), I), y0[i0 + n]);
    }
    GemmArgs a;
    a.W = ddown;
    a.x = dXi;
    a.ldx = I;
    a.M = rt.M;
    a.x_rows = dx_rows;
    a.y_rows = dy_rows;
    a.epi = GemmEpilogue::Add;
    a.expert_rows = H;
    run_grouped(a, rt, ex, "down add, x_rows gather + y_rows scatter", 1e-4);
  }
  free_q(dgu);
  free_q(ddown);
  cudaFree(dX), cudaFree(dXi), cudaFree(dact), cudaFree(dx_rows), cudaFree(dy_rows), cudaFree(dscale);
}

// Bad arguments are refused by name before anything is launched.
void test_rejects() {
  Rng r(3);
  const HostQ W = make_q(32, 128, 4, 64, r);
  QMat dW = upload_q_tiled(W);
  uint16_t* dx = dev_alloc<uint16_t>(4 * 128);
  float* dy = dev_alloc<float>(4 * 32);
  auto refused = [&](const char* what, int tile_m, auto edit) {
    GemmArgs a;
    a.W = dW;
    a.x = dx;
    a.ldx = 128;
    a.M = 4;
    a.y = dy;
    a.ldy = 32;
    edit(a);
    bool thrown = false;
    try {
      qmatmul_prefill(a, tile_m, 0);
    } catch (const lily::Error&) {
      thrown = true;
    }
    expect(std::string("qmatmul_prefill refuses ") + what, thrown);
  };
  refused("tile_m 48", 48, [](GemmArgs&) {});
  refused("a row-major (untiled) W", 64, [&](GemmArgs& a) { a.W.tiled = false; });
  refused("ldx not a multiple of 8", 64, [](GemmArgs& a) { a.ldx = 132; });
  refused("y_scale with Add", 64, [&](GemmArgs& a) {
    a.epi = GemmEpilogue::Add;
    a.y_scale = dy;
  });
  refused("wgmma without weights_bf16", 64, [](GemmArgs& a) { a.wgmma = true; });
  refused("SwiGlu with W.rows != 2 * swiglu_inter", 64, [](GemmArgs& a) {
    a.epi = GemmEpilogue::SwiGlu;
    a.act = reinterpret_cast<uint16_t*>(a.y);
    a.swiglu_inter = 8;
  });
  free_q(dW);
  cudaFree(dx), cudaFree(dy);
}

}  // namespace

void run_qmatmul_prefill_tests() {
  test_wgmma_probe<128, 1>(41);
  test_wgmma_probe<256, 1>(42);
  test_wgmma_probe<128, 4>(43);
  test_wgmma_probe<256, 4>(44);
  test_rejects();
  test_dense(1, 16, 64, 64, 11);
  test_dense(7, 40, 128, 136, 12);
  test_dense(100, 1024, 2048, 2048, 13);
  test_dense(257, 12352, 2048, 2048, 14);
  test_dense(300, 2048, 4096, 4096, 15);
  test_swiglu(100, 64, 128, 21);
  test_swiglu(257, 512, 2048, 22);
  test_grouped(31);
}

}  // namespace lily::cuda::test
