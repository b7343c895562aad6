// The prefill GEMMs (qgemm) of a chunk of T = 4096 tokens at Qwen3.6-35B-A3B shapes, called
// as src/cuda/prefill_step.cpp calls them: dense tiles of 64 and 128 rows, grouped expert
// tiles of 32, 64 and 128; each with the exact kernel and with bf16 weights ("bf16 w",
// GemmArgs::weights_bf16).
#include <algorithm>

#include "bench.h"
#include "qgemm.h"
#include "shapes.h"

namespace lily::bench {
namespace {

using namespace lily::cuda;

const char* epi_name(GemmEpilogue e) { return e == GemmEpilogue::Store ? "" : e == GemmEpilogue::Add ? " +res" : " +swiglu"; }
std::string variant(int tile_m, bool w16) { return ", tile_m " + std::to_string(tile_m) + (w16 ? ", bf16 w" : ""); }

// Y [M, N] = X [M, K] W^T over every row. SwiGlu: W is one gate/up stack, N / 2 outputs.
void add_dense(std::vector<Op>& ops, const std::string& what, int M, int N, int K, GemmEpilogue epi, int tile_m,
               bool w16) {
  const double out = epi == GemmEpilogue::SwiGlu ? M * (N / 2) * 2.0 : epi == GemmEpilogue::Add ? M * 8.0 * N : M * 4.0 * N;
  ops.push_back({"qgemm " + what + epi_name(epi) + variant(tile_m, w16),
                 "M " + std::to_string(M) + ", " + dims(N, K), qbytes(N, K, 4) + M * 2.0 * K + out, 2.0 * M * N * K,
                 [=](Arena& A) -> Launch {
                   GemmArgs g;
                   g.W = A.qmat(N, K, 4, true);
                   g.x = A.normal_bf16(size_t(M) * K);
                   g.ldx = K;
                   g.M = M;
                   g.epi = epi;
                   g.weights_bf16 = w16;
                   if (epi == GemmEpilogue::SwiGlu) {
                     g.act = A.normal_bf16(size_t(M) * (N / 2));
                     g.ldy = N / 2;
                     g.swiglu_inter = N / 2;
                   } else {
                     g.y = A.normal(size_t(M) * N);
                     g.ldy = N;
                   }
                   return [=](cudaStream_t s) { qgemm(g, tile_m, s); };
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
void add_grouped(std::vector<Op>& ops, int tile_m, bool w16) {
  const int rows = kT * kTopK;
  ops.push_back({"qgemm experts gate/up +swiglu (grouped)" + variant(tile_m, w16),
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
                   g.weights_bf16 = w16;
                   set_tiles(g, A, r, 2 * kI);
                   return [=](cudaStream_t s) { qgemm(g, tile_m, s); };
                 }});
  ops.push_back({"qgemm experts down x route_w (grouped)" + variant(tile_m, w16),
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
                   g.weights_bf16 = w16;
                   set_tiles(g, A, r, kH);
                   return [=](cudaStream_t s) { qgemm(g, tile_m, s); };
                 }});
}

}  // namespace

void add_prefill_gemm_ops(std::vector<Op>& ops) {
  for (int tile_m : {128, 64})
    for (bool w16 : {false, true}) {
      add_dense(ops, "gdn in_proj", kT, kGdnRows, kH, GemmEpilogue::Store, tile_m, w16);
      add_dense(ops, "attn qkv", kT, kAttnRows, kH, GemmEpilogue::Store, tile_m, w16);
      add_dense(ops, "gdn out_proj / attn o_proj", kT, kH, kHq * kD, GemmEpilogue::Add, tile_m, w16);
      add_dense(ops, "shared expert gate/up", kT, 2 * kIs, kH, GemmEpilogue::SwiGlu, tile_m, w16);
      add_dense(ops, "shared expert down", kT, kH, kIs, GemmEpilogue::Store, tile_m, w16);
    }
  for (int tile_m : {32, 64, 128})
    for (bool w16 : {false, true}) add_grouped(ops, tile_m, w16);
  for (bool w16 : {false, true})
    add_dense(ops, "lm_head (teacher-forced logits)", 64, kV, kH, GemmEpilogue::Store, 64, w16);
}

}  // namespace lily::bench
