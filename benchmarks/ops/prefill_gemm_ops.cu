// The prefill GEMMs (qmatmul_prefill) of a chunk of T = 4096 tokens at Qwen3.6-35B-A3B shapes, called
// as src/cuda/step/prefill_step.cpp calls them: dense tiles of 64 and 128 rows, grouped expert
// tiles of 32, 64 and 128; each with the exact kernel, with bf16 weights ("bf16 w",
// GemmArgs::weights_bf16) and with bf16 weights on warpgroup MMA ("wgmma", GemmArgs::wgmma). For the three large dense GEMMs, after their tile_m 64 rows, the
// ablation of dequantising inside the GEMM: a separate dequantisation pass to a bf16 copy
// followed by a bf16 GEMM, and that pass alone.
#include <algorithm>
#include <cmath>
#include <vector>

#include "bench.h"
#include "common/cuda_check.h"
#include "dequant_pass.h"
#include "qmatmul/qmatmul_prefill.h"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;

const char* epi_name(GemmEpilogue e) { return e == GemmEpilogue::Store ? "" : e == GemmEpilogue::Add ? " +res" : " +swiglu"; }

// The qmatmul_prefill kernels: exact maths, bf16 weights (mma.sync), bf16 weights on wgmma (sm_90a).
enum class Kernel { Exact, Bf16w, Wgmma };
constexpr Kernel kKernels[] = {Kernel::Exact, Kernel::Bf16w, Kernel::Wgmma};
std::string variant(int tile_m, Kernel k) {
  return ", tile_m " + std::to_string(tile_m) + (k == Kernel::Bf16w ? ", bf16 w" : k == Kernel::Wgmma ? ", wgmma" : "");
}
void set_kernel(GemmArgs& g, Kernel k) {
  g.weights_bf16 = k != Kernel::Exact;
  g.wgmma = k == Kernel::Wgmma;
}

// Y [M, N] = X [M, K] W^T over every row. SwiGlu: W is one gate/up stack, N / 2 outputs.
void add_dense(std::vector<Op>& ops, const std::string& what, int M, int N, int K, GemmEpilogue epi, int tile_m,
               Kernel kernel) {
  const double out = epi == GemmEpilogue::SwiGlu ? M * (N / 2) * 2.0 : epi == GemmEpilogue::Add ? M * 8.0 * N : M * 4.0 * N;
  ops.push_back({"qmatmul_prefill " + what + epi_name(epi) + variant(tile_m, kernel),
                 "M " + std::to_string(M) + ", " + dims(N, K), qbytes(N, K, 4) + M * 2.0 * K + out, 2.0 * M * N * K,
                 [=](Arena& A) -> Launch {
                   GemmArgs g;
                   g.W = A.qmat(N, K, 4, true);
                   g.x = A.normal_bf16(size_t(M) * K);
                   g.ldx = K;
                   g.M = M;
                   g.epi = epi;
                   set_kernel(g, kernel);
                   if (epi == GemmEpilogue::SwiGlu) {
                     g.act = A.normal_bf16(size_t(M) * (N / 2));
                     g.ldy = N / 2;
                     g.swiglu_inter = N / 2;
                   } else {
                     g.y = A.normal(size_t(M) * N);
                     g.ldy = N;
                   }
                   return [=](cudaStream_t s) { qmatmul_prefill(g, tile_m, s); };
                 }});
}

int round_up(int v, int m) { return (v + m - 1) / m * m; }

// The separate path (dequant_bf16 + probe_gemm into y [kProbeTileM][Np]) against qmatmul_prefill
// with bf16 weights on the first kProbeTileM rows of x: the same weights bit for bit (both
// round with weights_bf16x2) and the same bf16 x, so only the order of the fp32 sums
// differs (~1e-6 of the output RMS). Fails when any output is off by more than 1e-3 of
// the RMS, or unwritten (both outputs start as NaN).
void check_separate(const std::string& op, Arena& A, const QMat& W, const uint16_t* x, uint16_t* w16, int Np) {
  constexpr int M = kProbeTileM;
  const int N = W.rows, K = W.cols;
  float* y = A.zeros<float>(size_t(M) * Np);
  float* y_ref = A.zeros<float>(size_t(M) * N);
  check(cudaMemset(y, 0xFF, size_t(M) * Np * 4), "separate dequant check: poison");
  check(cudaMemset(y_ref, 0xFF, size_t(M) * N * 4), "separate dequant check: poison");
  check(cudaDeviceSynchronize(), "separate dequant check: inputs");
  GemmArgs g;
  g.W = W;
  g.x = x;
  g.ldx = K;
  g.M = M;
  g.y = y_ref;
  g.ldy = N;
  g.weights_bf16 = true;
  qmatmul_prefill(g, 64, nullptr);
  dequant_bf16(W, w16, K, nullptr);
  probe_gemm(x, w16, y, M, Np, K, nullptr);
  check(cudaDeviceSynchronize(), "separate dequant check: run");
  std::vector<float> got(size_t(M) * Np), want(size_t(M) * N);
  check(cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost), "separate dequant check: download");
  check(cudaMemcpy(want.data(), y_ref, want.size() * 4, cudaMemcpyDeviceToHost), "separate dequant check: download");
  double ss = 0, worst = 0;
  for (float v : want) ss += double(v) * v;
  const double rms = std::sqrt(ss / double(want.size()));
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      const double d = std::fabs(double(got[size_t(m) * Np + n]) - want[size_t(m) * N + n]);
      worst = std::isnan(d) ? INFINITY : std::max(worst, d);  // NaN: unwritten
    }
  if (!(worst <= 1e-3 * rms))  // also catches a NaN rms (qmatmul_prefill left y_ref unwritten)
    fail(op, ": the separate path differs from qmatmul_prefill (bf16 w) on ", std::to_string(M), " rows by ",
         std::to_string(worst / rms), " of the output RMS ", std::to_string(rms), " (tolerance 1e-3)");
}

// Y [M, N] = X [M, K] W^T (fp32, stored) through a bf16 copy of W: dequant_bf16 writes
// W16 [N][K], then the probe GEMM of the matmul ceiling reads it. The probe needs multiples
// of its 128 x 256 x 64 tile, so the entry pads: W16 to Np = N rounded up to 256 rows
// (zeros) and Y to Np columns (row stride Np); the padding is in neither bytes nor FLOPs.
// Bytes: the 4-bit W read, W16 written and read, X read, Y written.
void add_separate(std::vector<Op>& ops, const std::string& what, int M, int N, int K) {
  const int Np = round_up(N, kProbeTileN);
  const std::string op = "dequant pass + bf16 GEMM (separate) " + what;
  ops.push_back({op, "M " + std::to_string(M) + ", " + dims(N, K),
                 qbytes(N, K, 4) + 2 * 2.0 * N * K + M * 2.0 * K + M * 4.0 * N, 2.0 * M * N * K,
                 [=](Arena& A) -> Launch {
                   if (M % kProbeTileM != 0 || K % kProbeTileK != 0)
                     fail(op, ": M and K must be multiples of ", std::to_string(kProbeTileM), " and ",
                          std::to_string(kProbeTileK));
                   const QMat W = A.qmat(N, K, 4, true);
                   const uint16_t* x = A.normal_bf16(size_t(M) * K);
                   uint16_t* w16 = A.zeros<uint16_t>(size_t(Np) * K);
                   float* y = A.normal(size_t(M) * Np);
                   check_separate(op, A, W, x, w16, Np);
                   return [=](cudaStream_t s) {
                     dequant_bf16(W, w16, K, s);
                     probe_gemm(x, w16, y, M, Np, K, s);
                   };
                 }});
  ops.push_back({"dequant pass alone " + what, dims(N, K), qbytes(N, K, 4) + 2.0 * N * K, 0, [=](Arena& A) -> Launch {
                   const QMat W = A.qmat(N, K, 4, true);
                   uint16_t* w16 = A.zeros<uint16_t>(size_t(N) * K);
                   return [=](cudaStream_t s) { dequant_bf16(W, w16, K, s); };
                 }});
}

// Routed rows sorted by expert, as moe_route_prefill leaves them: each token picks kTopK
// distinct experts uniformly at random (random router weights route almost uniformly).
struct Routing {
  std::vector<int> x_rows, y_rows;  // sorted row -> token, -> slot t * kTopK + j
  std::vector<int4> tiles;          // {expert, row0, rows <= tile_m, 0}
};

Routing route(int tile_m) {
  uint64_t state = 0x2545f4914f6cdd1dull;
  auto next = [&] {  // xorshift64
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return state;
  };
  std::vector<std::vector<int>> slots(kE);
  for (int t = 0; t < kT; ++t) {
    int chosen[kTopK];
    for (int j = 0; j < kTopK; ++j) {
      bool taken = true;
      while (taken) {
        chosen[j] = static_cast<int>(next() % kE);
        taken = std::find(chosen, chosen + j, chosen[j]) != chosen + j;
      }
      slots[chosen[j]].push_back(t * kTopK + j);
    }
  }
  Routing r;
  for (int e = 0; e < kE; ++e) {
    const int row0 = static_cast<int>(r.x_rows.size()), n = static_cast<int>(slots[e].size());
    for (int slot : slots[e]) {
      r.x_rows.push_back(slot / kTopK);
      r.y_rows.push_back(slot);
    }
    for (int i = 0; i < n; i += tile_m) r.tiles.push_back(make_int4(e, row0 + i, std::min(tile_m, n - i), 0));
  }
  return r;
}

void set_tiles(GemmArgs& g, Arena& A, const Routing& r, int expert_rows) {
  g.tiles = A.upload(r.tiles);
  g.n_tiles = A.upload(std::vector<int>{static_cast<int>(r.tiles.size())});
  g.max_tiles = static_cast<int>(r.tiles.size());
  g.expert_rows = expert_rows;
}

// The routed experts of one MoE block, T * k rows grouped by expert:
//   gate/up: act [T*k, I] = SwiGLU(X[x_rows] W_gu(e)^T);  down: y_slots[y_rows] = route_w * act W_d(e)^T.
void add_grouped(std::vector<Op>& ops, int tile_m, Kernel kernel) {
  const int rows = kT * kTopK;
  ops.push_back({"qmatmul_prefill experts gate/up +swiglu (grouped)" + variant(tile_m, kernel),
                 "M " + std::to_string(rows) + ", 256x" + dims(2 * kI, kH),
                 qbytes(kE * 2.0 * kI, kH, 4) + kT * 2.0 * kH + rows * 2.0 * kI, 2.0 * rows * 2 * kI * kH,
                 [=](Arena& A) -> Launch {
                   const Routing r = route(tile_m);
                   GemmArgs g;
                   g.W = A.qmat(kE * 2 * kI, kH, 4, true);
                   g.x = A.normal_bf16(size_t(kT) * kH);
                   g.ldx = kH;
                   g.M = rows;
                   g.x_rows = A.upload(r.x_rows);
                   g.epi = GemmEpilogue::SwiGlu;
                   g.act = A.normal_bf16(size_t(rows) * kI);
                   g.ldy = kI;
                   g.swiglu_inter = kI;
                   set_kernel(g, kernel);
                   set_tiles(g, A, r, 2 * kI);
                   return [=](cudaStream_t s) { qmatmul_prefill(g, tile_m, s); };
                 }});
  ops.push_back({"qmatmul_prefill experts down x route_w (grouped)" + variant(tile_m, kernel),
                 "M " + std::to_string(rows) + ", 256x" + dims(kH, kI),
                 qbytes(kE * double(kH), kI, 4) + rows * 2.0 * kI + rows * 4.0 * kH + rows * 4.0, 2.0 * rows * kH * kI,
                 [=](Arena& A) -> Launch {
                   const Routing r = route(tile_m);
                   GemmArgs g;
                   g.W = A.qmat(kE * kH, kI, 4, true);
                   g.x = A.normal_bf16(size_t(rows) * kI);
                   g.ldx = kI;
                   g.M = rows;
                   g.epi = GemmEpilogue::Store;
                   g.y = A.normal(size_t(rows) * kH);
                   g.ldy = kH;
                   g.y_rows = A.upload(r.y_rows);
                   g.y_scale = A.near_one(rows);
                   set_kernel(g, kernel);
                   set_tiles(g, A, r, kH);
                   return [=](cudaStream_t s) { qmatmul_prefill(g, tile_m, s); };
                 }});
}

}  // namespace

void add_prefill_gemm_ops(std::vector<Op>& ops) {
  struct Dense {
    const char* what;
    int N, K;
    GemmEpilogue epi;
    bool ablation;  // + the separate dequantisation pass after its tile_m 64 rows
  };
  const Dense dense[] = {{"gdn in_proj", kGdnRows, kH, GemmEpilogue::Store, true},
                         {"attn qkv", kAttnRows, kH, GemmEpilogue::Store, true},
                         {"gdn out_proj / attn o_proj", kH, kHq * kD, GemmEpilogue::Add, true},
                         {"shared expert gate/up", 2 * kIs, kH, GemmEpilogue::SwiGlu, false},
                         {"shared expert down", kH, kIs, GemmEpilogue::Store, false}};
  // Per shape: in-tile dequantisation exact, in-tile to bf16 weights (mma.sync, wgmma), then
  // (tile_m 64) a separate pass.
  for (int tile_m : {128, 64})
    for (const Dense& d : dense) {
      for (Kernel k : kKernels) add_dense(ops, d.what, kT, d.N, d.K, d.epi, tile_m, k);
      if (tile_m == 64 && d.ablation) add_separate(ops, d.what, kT, d.N, d.K);
    }
  for (int tile_m : {32, 64, 128})
    for (Kernel k : kKernels) add_grouped(ops, tile_m, k);
  for (Kernel k : kKernels) add_dense(ops, "lm_head (teacher-forced logits)", 64, kV, kH, GemmEpilogue::Store, 64, k);
}

}  // namespace lily::bench
