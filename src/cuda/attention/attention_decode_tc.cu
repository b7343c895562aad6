// Decode attention on tensor cores: attention_decode's maths, routing (splits of at least
// min_chunk keys, at most max_splits per KV head), partial layout and merge launch, with
// the scores and the P·V products as mma.sync m16n8k16 (bf16 operands, fp32 accumulate).
//
// Block = one split of one KV head, 4 warps. The G <= 16 query heads of the KV head are
// the 16 rows of the A operand (rows >= G are zero and never stored), so one K/V tile in
// shared memory serves every head. Tiles of 64 keys stream through a 3-stage cp.async
// ring (two tiles = 2 x 66 KB in flight per SM at D = 256); warp w owns keys
// 16w .. 16w+15 of every tile with its own fp32 online softmax and O (16 x D in
// registers), as the prefill kernel does per 64 keys:
//   S = Q K^T (16 x 16), P = exp(S - m) rounded to bf16 as the A operand of O += P V.
// The warps are merged by log-sum-exp through shared memory at the end. Rows in shared
// memory are D bf16 + 16 bytes (stride = 4 banks mod 32: the 8 row addresses of an
// ldmatrix hit distinct banks).
//
// Prologue (bit for bit attention_decode's): q = RoPE(RMSNorm(q) * q_norm) / sqrt(D) for
// the G heads (to bf16 in shared memory); the block holding the position also appends
// k = RoPE(RMSNorm(k) * k_norm) and v to the cache. The first tiles are already
// streaming meanwhile (issued before the wait on the previous kernel); the keys of this
// step (the new one; with several rows, those of the earlier tokens too), not in the cache
// when the tiles are issued, are normed and put into shared memory by the block itself.
#include <string>

#include "common/async_copy.cuh"
#include "attention/attention_common.cuh"
#include "attention/attention_decode_tc.h"
#include "common/device_common.cuh"
#include "qmatmul/qmatmul_decode_mma.cuh"

namespace lily::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kKeys = 16 * kWarps;  // keys per tile: 16 per warp (the k of the P·V mma)
constexpr int kStages = 3;
constexpr int kRowsQ = 16;          // mma rows: the query heads of the KV head, zero-padded
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
constexpr int kRowBytes = D * 2 + 16;
template <int D>
constexpr int kSmemBytes = (kRowsQ + kStages * 2 * kKeys) * kRowBytes<D>;  // Q, then per stage K and V
template <int D>
constexpr int kSlabStride = D + 8;  // floats per row of the warp-merge slabs (conflict-free float2 stores)
static_assert(kWarps * kRowsQ * (kSlabStride<256> * 4) <= kStages * 2 * kKeys * kRowBytes<256>, "slabs fit the stages");

// Grid: x = KV head, y = split (blocks past the live splits of this position return), z =
// token of a several-row step (kMulti; the token at pos + z attends to keys 0 .. pos + z:
// its blocks are exactly those of a one-row step at that position).
template <int D, bool kMulti>
__global__ void __launch_bounds__(kThreads, 1) attention_tc_kernel(AttnArgs a, const int* halt) {
  constexpr int DPL = D / 32, RB = kRowBytes<D>, CPR = D / 8, NT = D / 8, SS = kSlabStride<D>;
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float m_s[kWarps][kRowsQ], l_s[kWarps][kRowsQ], head_m[kRowsQ], head_l[kRowsQ];
  const int g = blockIdx.x, split = blockIdx.y, row = blockIdx.z, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int G = a.Hq / a.Hkv;

  // pos and the cached keys before it were written a step ago or earlier, so the first
  // tiles stream before the wait on the QKV projection (attention_decode.h); a block past
  // the live splits may leave at once (those of split 0 always wait).
  const int pos = __ldcg(a.pos) + a.pos_offset, p = pos + row, L = p + 1;
  const auto [chunk, n_splits, start, end] = split_range(a, L, split);
  if (split >= n_splits) return;
  const int n_tiles = (end - start + kKeys - 1) / kKeys;
  const bool appends = split == n_splits - 1;  // this block's last key is its token's own
  // Keys [fresh, end) are this step's (the QKV projection has just made them; the other
  // tokens' blocks write them to the cache): this block puts them into shared memory itself.
  // With one token the only one is its own, which this block also writes to the cache
  // before the loop's first barrier: a tile after the prologue's reads it back from there.
  const int fresh = max(start, pos);
  auto is_fresh = [&](int key, int t) { return key >= fresh && key < end && (kMulti || t < kStages - 1); };
  const size_t qkv_floats = attention_qkv_floats(a);
  const float* qkv = a.qkv + row * qkv_floats;

  const uint32_t s_q = smem_addr(smem), s_kv = s_q + kRowsQ * RB;  // stage st: K at s_kv + st*2*kKeys*RB, V after it
  // Tile t -> stage t % kStages; keys past the split are zeros (P is 0 there, V finite).
  // This step's keys are left alone.
  auto load_tile = [&](int t) {
    const uint32_t sk = s_kv + (t % kStages) * 2 * kKeys * RB, sv = sk + kKeys * RB;
#pragma unroll
    for (int j = 0; j < kKeys * CPR / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i / CPR, c = i % CPR, key = start + t * kKeys + r;
      if (is_fresh(key, t)) continue;
      const bool ok = key < end;
      const size_t src = (static_cast<size_t>(ok ? key : start) * a.Hkv + g) * D + c * 8;
      cp_async16(sk + r * RB + c * 16, a.k_cache + src, ok ? 16 : 0);
      cp_async16(sv + r * RB + c * 16, a.v_cache + src, ok ? 16 : 0);
    }
  };
  // Key `key` of this step (one warp): k = RoPE(RMSNorm(k) * k_norm) and v from its token's
  // QKV row, into the shared-memory rows of its tile; the token's own key also to the cache.
  auto put_fresh = [&](int key) {
    const float* kv_in = a.qkv + (key - pos) * qkv_floats + static_cast<size_t>(a.Hq) * 2 * D;
    float x[DPL], v[DPL];
    const float* ksrc = kv_in + static_cast<size_t>(g) * D + lane * DPL;
    const float* vsrc = kv_in + static_cast<size_t>(a.Hkv + g) * D + lane * DPL;
#pragma unroll
    for (int i = 0; i < DPL; ++i) x[i] = ksrc[i], v[i] = vsrc[i];
    norm_rope<DPL>(x, a.k_norm, key, a.rot_dim, a.inv_freq, a.eps, lane);
    if (key == p && appends) {
      const size_t at = (static_cast<size_t>(p) * a.Hkv + g) * D + lane * DPL;
      store_bf16<DPL>(a.k_cache + at, x);
      store_bf16<DPL>(a.v_cache + at, v);
    }
    const int t = (key - start) / kKeys;
    if (!is_fresh(key, t)) return;
    uint8_t* k_row = smem + kRowsQ * RB + ((t % kStages) * 2 * kKeys + (key - start) % kKeys) * RB;
    store_bf16<DPL>(reinterpret_cast<uint16_t*>(k_row) + lane * DPL, x);
    store_bf16<DPL>(reinterpret_cast<uint16_t*>(k_row + kKeys * RB) + lane * DPL, v);
  };
  // The first kStages-1 tiles stream during the prologue; this step's keys among them are
  // written below, straight into shared memory.
#pragma unroll
  for (int t = 0; t < kStages - 1; ++t) {
    if (t < n_tiles) load_tile(t);
    cp_async_commit();  // one group per tile slot, empty or not: group t holds tile t
  }
  if (wait_halted(halt)) {
    cp_async_wait<0>();  // leave no copy into this block's shared memory in flight
    return;
  }

  // Items 0 .. n_fresh-1: this step's keys in the prologue's tiles (one token: its key in
  // any tile, for the cache); then query rows 0 .. 15.
  const int prologue_end = kMulti ? min(end, start + (kStages - 1) * kKeys) : end;
  const int n_fresh = max(0, prologue_end - fresh);
  for (int item = warp; item < n_fresh + kRowsQ; item += kWarps) {
    if (item < n_fresh) {
      put_fresh(fresh + item);
    } else {
      float x[DPL];
      const int h = item - n_fresh;
      if (h < G) {
        const float* src = qkv + static_cast<size_t>(g * G + h) * 2 * D + lane * DPL;
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = src[i];
        norm_rope<DPL>(x, a.q_norm, p, a.rot_dim, a.inv_freq, a.eps, lane);
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] *= rsqrtf(static_cast<float>(D));
      } else {
#pragma unroll
        for (int i = 0; i < DPL; ++i) x[i] = 0.0f;
      }
      store_bf16<DPL>(reinterpret_cast<uint16_t*>(smem + h * RB) + lane * DPL, x);
    }
  }
  // (The first loop iteration's barrier publishes Q and the fresh rows, before any later
  // tile is issued.)

  // ldmatrix lane addresses (fragment layouts of mma.m16n8k16):
  //   Q (A, x4): (heads 0-7 | 8-15) x (d 0-7 | 8-15) -> lane row l&15, chunk l>>4
  //   K (B, x4): (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15)
  //              = b0, b1 of key tile 0 and of key tile 1 -> lane key (l&7) + (l>>4)*8, chunk (l>>3)&1
  //   V (B, x4.trans): (keys 0-7 | 8-15) x (d 0-7 | 8-15) = b0, b1 of d tile n, b0, b1 of n+1
  //              -> lane key (l&7) + ((l>>3)&1)*8, chunk l>>4
  const uint32_t a_q = s_q + (lane & 15) * RB + (lane >> 4) * 16;
  const uint32_t a_k = (warp * 16 + (lane & 7) + (lane >> 4) * 8) * RB + ((lane >> 3) & 1) * 16;
  const uint32_t a_v = (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RB + (lane >> 4) * 16;
  const int quad = lane & 3, gid = lane >> 2;

  float o[NT][4];  // O rows gid, gid + 8; columns 8n + 2 quad + (0, 1)
#pragma unroll
  for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // row max of the scores, this thread's part of the row sum

  for (int t = 0; t < n_tiles; ++t) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile t visible to all; every warp is done with the stage refilled next
    if (t + kStages - 1 < n_tiles) {
      const int tn = t + kStages - 1;
      load_tile(tn);
      if constexpr (kMulti) {  // published by tile tn's barrier
        const int first = max(fresh, start + tn * kKeys), last = min(end, start + (tn + 1) * kKeys);
        for (int key = first + warp; key < last; key += kWarps) put_fresh(key);
      }
    }
    cp_async_commit();
    const int key0 = start + t * kKeys + warp * 16;  // this warp's first key
    if (key0 >= end) continue;
    const uint32_t sk = s_kv + (t % kStages) * 2 * kKeys * RB, sv = sk + kKeys * RB;

    // S = Q K^T, s[n] = keys key0 + 8n .. +7; even and odd k-steps in separate
    // accumulators (two dependent mma chains of D/32 instead of one of D/16).
    float s[2][4] = {}, s2[2][4] = {};
#pragma unroll
    for (int ks = 0; ks < D / 16; ks += 2) {
      uint32_t qa[4], kb[4];
      ldmatrix_x4(a_q + ks * 32, qa);
      ldmatrix_x4(sk + a_k + ks * 32, kb);
      mma_16816(s[0], qa, kb[0], kb[1]);
      mma_16816(s[1], qa, kb[2], kb[3]);
      ldmatrix_x4(a_q + ks * 32 + 32, qa);
      ldmatrix_x4(sk + a_k + ks * 32 + 32, kb);
      mma_16816(s2[0], qa, kb[0], kb[1]);
      mma_16816(s2[1], qa, kb[2], kb[3]);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] += s2[n][e];
        if (key0 + 8 * n + 2 * quad + (e & 1) >= end) s[n][e] = -INFINITY;
      }

    // Online softmax per row (a row's 16 scores sit in the 4 threads of a quad).
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = fmaxf(fmaxf(s[0][2 * i], s[0][2 * i + 1]), fmaxf(s[1][2 * i], s[1][2 * i + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m[i], mx);
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row with no key yet: keep exp finite
      const float sub = m_use * kLog2e;
      corr[i] = exp2f((m[i] - m_use) * kLog2e);
      m[i] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        s[n][2 * i] = exp2f(fmaf(s[n][2 * i], kLog2e, -sub));
        s[n][2 * i + 1] = exp2f(fmaf(s[n][2 * i + 1], kLog2e, -sub));
        sum += s[n][2 * i] + s[n][2 * i + 1];
      }
      l[i] = l[i] * corr[i] + sum;
    }
    // Rescale O only when some row max of the warp moved (rare once the max settles).
    if (__any_sync(0xffffffffu, corr[0] != 1.0f || corr[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        o[n][0] *= corr[0];
        o[n][1] *= corr[0];
        o[n][2] *= corr[1];
        o[n][3] *= corr[1];
      }
    }

    // O += P V: the S fragments of the warp's 16 keys are exactly the A fragment.
    const uint32_t pa[4] = {pack_bf16(s[0][0], s[0][1]), pack_bf16(s[0][2], s[0][3]), pack_bf16(s[1][0], s[1][1]),
                            pack_bf16(s[1][2], s[1][3])};
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t vb[4];
      ldmatrix_x4_trans(sv + a_v + dp * 32, vb);
      mma_16816(o[2 * dp], pa, vb[0], vb[1]);
      mma_16816(o[2 * dp + 1], pa, vb[2], vb[3]);
    }
  }
  cp_async_wait<0>();  // (only empty groups remain; the stages become the merge slabs)
  timeline_done();

  // Merge the warps: each rescales its O to the block max of a row, writes it to its
  // slab [warp][row][SS]; the sum over slabs runs in warp order (deterministic).
#pragma unroll
  for (int i = 0; i < 2; ++i) l[i] = quad_sum(l[i]);
  if (quad == 0)
#pragma unroll
    for (int i = 0; i < 2; ++i) m_s[warp][gid + 8 * i] = m[i], l_s[warp][gid + 8 * i] = l[i];
  __syncthreads();  // m/l of every warp visible; every warp is done with the stages
  float* slab = reinterpret_cast<float*>(smem + kRowsQ * RB);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = gid + 8 * i;
    if (r >= G) continue;
    float M = m_s[0][r];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) M = fmaxf(M, m_s[w][r]);  // finite: warp 0 sees the split's first key
    const float f = exp2f((m[i] - M) * kLog2e);                  // 0 for a warp that saw no key
    float* dst = slab + (warp * kRowsQ + r) * SS + 2 * quad;
#pragma unroll
    for (int n = 0; n < NT; ++n) *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * i] * f, o[n][2 * i + 1] * f);
    if (warp == 0 && quad == 0) {
      float S = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) S += l_s[w][r] * exp2f((m_s[w][r] - M) * kLog2e);
      head_m[r] = M;
      head_l[r] = S;
    }
  }
  __syncthreads();

  auto acc_at = [&](int h, int d) {
    float y = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) y += slab[(w * kRowsQ + h) * SS + d];
    return y;
  };
  if (n_splits == 1) {
    const float* gate = qkv + static_cast<size_t>(g) * G * 2 * D + D;  // + h*2D + d
    float* out = a.out + (static_cast<size_t>(row) * a.Hq + g * G) * D;
    for (int i = tid; i < G * D; i += kThreads) {
      const int h = i / D, d = i % D;
      out[i] = acc_at(h, d) / head_l[h] * sigmoidf_(gate[h * 2 * D + d]);
    }
    return;
  }
  const size_t stride = static_cast<size_t>(G) * (D + 2);
  float* part = a.partial + ((static_cast<size_t>(row) * a.Hkv + g) * a.max_splits + split) * stride;
  for (int i = tid; i < G * D; i += kThreads) part[(i / D) * (D + 2) + i % D] = acc_at(i / D, i % D);
  if (tid < G) {
    part[tid * (D + 2) + D] = head_m[tid];
    part[tid * (D + 2) + D + 1] = head_l[tid];
  }
}

template <int D>
void launch_tc(const AttnArgs& a, const int* halt, cudaStream_t stream, int rows) {
  auto kernel = rows > 1 ? attention_tc_kernel<D, true> : attention_tc_kernel<D, false>;
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kSmemBytes<D>, "attention_decode_tc: shared memory opt-in");
  launch("attention_decode_tc", kernel, dim3(a.Hkv, a.max_splits, rows), dim3(kThreads), kSmemBytes<D>, stream, a, halt);
  launch("attention_merge", attention_merge_kernel<D>, dim3(a.Hq, rows), dim3(kAttnMergeWarps * 32), 0, stream, a, halt);
}

bool misaligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; }

}  // namespace

void attention_decode_tc(const AttnArgs& a, const int* halt, cudaStream_t stream, int rows) {
  using std::to_string;
  if (rows < 1 || rows > kMaxStepRows)
    fail("attention_decode_tc: ", to_string(rows), " rows; a step takes 1 to ", to_string(kMaxStepRows));
  if (a.Hkv <= 0 || a.Hq % a.Hkv != 0 || a.Hq / a.Hkv > kRowsQ)
    fail("attention_decode_tc: needs Hq (", to_string(a.Hq), ") a multiple of Hkv (", to_string(a.Hkv),
         ") with at most ", to_string(kRowsQ), " query heads per KV head");
  const int dpl = a.D / 32, half = a.rot_dim / 2;
  if (a.D != 64 && a.D != 128 && a.D != 256)
    fail("attention_decode_tc: head dim ", to_string(a.D), " is not supported (64, 128, 256)");
  if (a.rot_dim <= 0 || a.rot_dim > a.D || half % dpl != 0 || ((half / dpl) & (half / dpl - 1)) != 0)
    fail("attention_decode_tc: rotary dim ", to_string(a.rot_dim), " does not fit head dim ", to_string(a.D));
  if (a.max_splits < 1 || a.max_splits > kAttnMaxSplits || a.min_chunk < 1)
    fail("attention_decode_tc: max_splits must be in [1, ", to_string(kAttnMaxSplits), "], min_chunk positive");
  if (!a.qkv || !a.q_norm || !a.k_norm || !a.k_cache || !a.v_cache || !a.partial || !a.out || !a.pos || !a.inv_freq)
    fail("attention_decode_tc: null pointer among qkv, q_norm, k_norm, k_cache, v_cache, partial, out, pos, inv_freq");
  if (misaligned(a.k_cache, 16) || misaligned(a.v_cache, 16))
    fail("attention_decode_tc: k_cache and v_cache must be 16-byte aligned (cp.async)");
  switch (a.D) {
    case 64: launch_tc<64>(a, halt, stream, rows); break;
    case 128: launch_tc<128>(a, halt, stream, rows); break;
    default: launch_tc<256>(a, halt, stream, rows); break;
  }
}

}  // namespace lily::cuda
