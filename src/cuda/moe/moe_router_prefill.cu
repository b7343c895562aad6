// Router GEMM of the prefill MoE block: for tokens t < T and W rows n <= E
//   part[s][t][n] = sum_{c in slice s} W[n][c] * x[t][c]        (fp32, c ascending)
// with W the MLX affine router (w = scale * q + bias, 4 or 8 bits, dequantised exactly
// into shared memory) and x fp32. The top-k kernel adds the S slices in order.
//
// Block: 128 tokens x 128 experts, 256 threads, k-steps of 16 columns double-buffered in
// shared memory (x transposed to A[c][m], W dequantised to B[c][n]). Warp w owns tokens
// 16w..16w+15, half-warp g tokens 16w + 8g .. +7, lane l experts 4 (l%16) .. +3 and
// 64 + 4 (l%16) .. +3: 8 x 8 fp32 accumulators, 4 conflict-free LDS.128 per 64 FMAs.
// The gate row (row E) would waste a third block column, so the blocks of column 0 also
// dot it with their x tile (lane l: column l % 16 of the step, the half-warp's 8 tokens).
#include <algorithm>
#include <cstdint>
#include <string>

#include "common/device_common.cuh"
#include "moe/moe_route_prefill.h"

namespace lily::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBM = 128;               // tokens per block (16 per warp)
constexpr int kBN = 128;               // experts per block (8 per lane)
constexpr int kBK = 16;                // columns per k-step
constexpr int kAStride = kBM + 4;      // A[c][m]: padded so the gate dot's column-strided reads miss no bank
constexpr int kBStride = kBN + 4;      // B[c][n]: experts, then the gate row at n = kBN
constexpr int kMaxSplits = 16;
constexpr int kSplitTokens = 8192;     // splits * padded T stays within this: ~128 blocks at E = 256
static_assert(kBM * kBK == 8 * kThreads && kBN * kBK == 8 * kThreads, "two float4 of x, 8 codes of W per thread");

struct GemmParams {
  QMat W;
  const float* x;
  int T, E, k_len;  // k_len: columns per slice
  float* part;      // [S][T][E]
  float* gpart;     // [S][T]
  int* counts;      // zeroed here for the top-k kernel
  unsigned* counter;
};

// q as a float: 2^23 + q has q in the low mantissa bits.
__device__ __forceinline__ float code_float(uint32_t q) { return __uint_as_float(q | 0x4B000000u) - 8388608.0f; }

template <int BITS>
__device__ __forceinline__ float code_of(const uint2& c, int j) {  // j < 8, compile-time after unrolling
  if constexpr (BITS == 8) {
    const uint32_t f = __byte_perm(j < 4 ? c.x : c.y, 0x4B000000u, 0x7440 | (j & 3));  // 0x4B0000qq
    return __uint_as_float(f) - 8388608.0f;
  } else {
    return code_float((c.x >> (4 * j)) & 0xFu);
  }
}

// One thread's share of a k-step: a float4 of x for tokens tid/4 and tid/4 + 64 (columns
// 4 (tid%4) ..), 8 codes of one W row (row tid%128, columns 8 (tid/128) ..) and, on gate
// blocks, lanes 0-1 of each warp one gate-row code (column 2 warp + lane). Loaded a step
// ahead of use. Rows past T or E are clamped to valid ones: their sums are never stored.
template <int BITS>
struct StepLoader {
  const float *xa, *xb;
  const uint8_t* w;       // byte of the thread's first code
  const uint32_t* sb;     // the row's scale/bias words
  const uint32_t* gw;     // gate row: the word holding the thread's code
  const uint32_t* gsb;
  int col, gshift;        // this step's first column; log2(group size)
  bool gate_loader;
  float4 xva, xvb;
  uint2 code;
  uint32_t s, gcode, gs;

  __device__ StepLoader(const GemmParams& p, int t0, int n0, int c0, bool gate_block) {
    const int tid = threadIdx.x, H = p.W.cols;
    const int ta = min(t0 + (tid >> 2), p.T - 1), tb = min(t0 + (tid >> 2) + kBM / 2, p.T - 1);
    const int n = min(n0 + (tid & (kBN - 1)), p.E);
    xa = p.x + static_cast<size_t>(ta) * H + c0 + 4 * (tid & 3);
    xb = p.x + static_cast<size_t>(tb) * H + c0 + 4 * (tid & 3);
    w = reinterpret_cast<const uint8_t*>(p.W.codes) + (static_cast<size_t>(n) * H + c0 + 8 * (tid / kBN)) * BITS / 8;
    sb = p.W.sb + static_cast<size_t>(n) * p.W.groups();
    gate_loader = gate_block && (tid & 31) < 2;
    const int gc = c0 + 2 * (tid >> 5) + (tid & 31);
    gw = reinterpret_cast<const uint32_t*>(p.W.codes) + (static_cast<size_t>(p.E) * H + gc) / (32 / BITS);
    gsb = p.W.sb + static_cast<size_t>(p.E) * p.W.groups();
    col = c0;
    gshift = (BITS == 8 ? 4 : 5) + p.W.gshift;
  }

  __device__ __forceinline__ void load_weights() {
    if constexpr (BITS == 8) code = __ldg(reinterpret_cast<const uint2*>(w));
    else code.x = __ldg(reinterpret_cast<const uint32_t*>(w));
    s = __ldg(sb + (col >> gshift));  // a step lies within one group
    if (gate_loader) {
      gcode = __ldg(gw);
      gs = __ldg(gsb + (col >> gshift));
    }
  }
  __device__ __forceinline__ void load_x() {
    xva = __ldcg(reinterpret_cast<const float4*>(xa));
    xvb = __ldcg(reinterpret_cast<const float4*>(xb));
  }
  __device__ __forceinline__ void advance() {
    xa += kBK;
    xb += kBK;
    w += kBK * BITS / 8;
    gw += kBK * BITS / 32;
    col += kBK;
  }

  __device__ __forceinline__ void store(float* A, float* B) const {
    const int tid = threadIdx.x;
    {
      float* a = A + 4 * (tid & 3) * kAStride + (tid >> 2);
      a[0] = xva.x;
      a[kAStride] = xva.y;
      a[2 * kAStride] = xva.z;
      a[3 * kAStride] = xva.w;
      a[kBM / 2] = xvb.x;
      a[kAStride + kBM / 2] = xvb.y;
      a[2 * kAStride + kBM / 2] = xvb.z;
      a[3 * kAStride + kBM / 2] = xvb.w;
    }
    {
      float* b = B + 8 * (tid / kBN) * kBStride + (tid & (kBN - 1));
      const float sc = bf16_lo(s), bi = bf16_hi(s);
#pragma unroll
      for (int j = 0; j < 8; ++j) b[j * kBStride] = fmaf(sc, code_of<BITS>(code, j), bi);
    }
    if (gate_loader) {
      const int c = 2 * (tid >> 5) + (tid & 31);  // steps start at multiples of 16: word-aligned
      const uint32_t q = (gcode >> (BITS * (c % (32 / BITS)))) & ((1u << BITS) - 1u);
      B[c * kBStride + kBN] = fmaf(bf16_lo(gs), code_float(q), bf16_hi(gs));
    }
  }
};

// Stores 4 sums of token row `out` at experts n..n+3 (those < E).
__device__ __forceinline__ void store4(float* out, int n, int E, float a, float b, float c, float d) {
  if (E % 4 == 0) {
    if (n < E) *reinterpret_cast<float4*>(out + n) = make_float4(a, b, c, d);
  } else {
    const float v[4] = {a, b, c, d};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (n + j < E) out[n + j] = v[j];
  }
}

// grid (ceil(E / kBN), ceil(T / kBM), S).
template <int BITS>
__global__ void __launch_bounds__(kThreads, 1) router_gemm_kernel(GemmParams p) {
  __shared__ __align__(16) float As[2][kBK * kAStride];
  __shared__ __align__(16) float Bs[2][kBK * kBStride];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 4, l16 = lane & 15;
  const int n0 = blockIdx.x * kBN, t0 = blockIdx.y * kBM, c0 = blockIdx.z * p.k_len;
  const int steps = p.k_len / kBK;
  const bool gate_block = blockIdx.x == 0;
  const bool warp_live = t0 + 16 * warp < p.T;

  StepLoader<BITS> ld(p, t0, n0, c0, gate_block);
  ld.load_weights();  // weights only before the wait
  pdl_wait();
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
    for (int e = tid; e < p.E; e += kThreads) p.counts[e] = 0;
    if (tid == 0) *p.counter = 0u;
  }
  ld.load_x();
  ld.store(As[0], Bs[0]);
  __syncthreads();

  float acc[8][8] = {};  // [token 16w + 8g + i][expert 4 l16 + j, then 64 + 4 l16 + j - 4]
  float gacc[8] = {};    // gate row, token 16w + 8g + i, column l16 of each step
  for (int it = 0; it < steps; ++it) {
    const int buf = it & 1;
    const bool more = it + 1 < steps;
    if (more) {
      ld.advance();
      ld.load_weights();
      ld.load_x();
    }
    if (warp_live) {
      const float* A = As[buf] + 16 * warp + 8 * g;
      const float* B = Bs[buf] + 4 * l16;
#pragma unroll
      for (int c = 0; c < kBK; ++c) {
        const float4 a0 = *reinterpret_cast<const float4*>(A + c * kAStride);
        const float4 a1 = *reinterpret_cast<const float4*>(A + c * kAStride + 4);
        const float4 b0 = *reinterpret_cast<const float4*>(B + c * kBStride);
        const float4 b1 = *reinterpret_cast<const float4*>(B + c * kBStride + kBN / 2);
        const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
        const float bv[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
      }
      if (gate_block) {
        const float4 a0 = *reinterpret_cast<const float4*>(A + l16 * kAStride);
        const float4 a1 = *reinterpret_cast<const float4*>(A + l16 * kAStride + 4);
        const float gate_w = Bs[buf][l16 * kBStride + kBN];
        const float av[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) gacc[i] = fmaf(av[i], gate_w, gacc[i]);
      }
    }
    if (more) ld.store(As[buf ^ 1], Bs[buf ^ 1]);
    __syncthreads();
  }
  pdl_trigger();
  if (!warp_live) return;

  const size_t slice = static_cast<size_t>(blockIdx.z) * p.T;
  const int tw = t0 + 16 * warp + 8 * g, n = n0 + 4 * l16;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if (tw + i >= p.T) break;
    float* out = p.part + (slice + tw + i) * p.E;
    store4(out, n, p.E, acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    store4(out, n + kBN / 2, p.E, acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
  }
  if (gate_block) {  // sum the 16 columns over the half-warp (fixed order)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int o = 1; o < 16; o <<= 1) gacc[i] += __shfl_xor_sync(0xffffffffu, gacc[i], o);
    if (l16 == 0)
#pragma unroll
      for (int i = 0; i < 8; ++i)
        if (tw + i < p.T) p.gpart[slice + tw + i] = gacc[i];
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace

namespace moe_route_detail {

// Slices of H: the most (up to 16, dividing H into whole k-steps) that keep
// splits * padded T <= kSplitTokens, so small chunks still fill the GPU.
int router_splits(int T, int H) {
  const int t_pad = (T + kBM - 1) / kBM * kBM;
  int s = 1;
  while (s < kMaxSplits && 2 * s * t_pad <= kSplitTokens && (H / kBK) % (2 * s) == 0) s *= 2;
  return s;
}

void launch_router_gemm(const MoeRouteArgs& a, int splits, cudaStream_t stream) {
  GemmParams p{a.router, a.x, a.T, a.E, a.router.cols / splits, a.partials,
               a.partials + static_cast<size_t>(splits) * a.T * a.E, a.counts, a.counter};
  const dim3 grid((a.E + kBN - 1) / kBN, (a.T + kBM - 1) / kBM, splits);
  if (a.router.bits == 8) launch("moe_router_prefill", router_gemm_kernel<8>, grid, dim3(kThreads), 0, stream, p);
  else launch("moe_router_prefill", router_gemm_kernel<4>, grid, dim3(kThreads), 0, stream, p);
}

}  // namespace moe_route_detail

size_t moe_router_partial_floats(int max_T, int n_experts) {
  // splits > 1 only while splits * T <= kSplitTokens (router_splits).
  return static_cast<size_t>(std::max(max_T, kSplitTokens)) * (n_experts + 1);
}

void moe_route_prefill(const MoeRouteArgs& a, cudaStream_t stream) {
  const QMat& W = a.router;
  const int max_T = 65535 * kBM;  // grid.y
  if (W.tiled) fail("moe_route_prefill: the router must be in the MLX row layout, not tiled");
  if (W.bits != 4 && W.bits != 8)
    fail("moe_route_prefill: ", std::to_string(W.bits), "-bit router weights are not supported");
  if (a.E < 1 || a.E > kMoeMaxExperts)
    fail("moe_route_prefill: expert count must be in [1, ", std::to_string(kMoeMaxExperts), "], got ",
         std::to_string(a.E));
  if (W.rows != a.E + 1) fail("moe_route_prefill: the router must hold E expert rows plus the shared-expert gate row");
  if (a.k < 1 || a.k > kMoeMaxTopK || a.k > a.E)
    fail("moe_route_prefill: top_k must be in [1, min(16, E)], got ", std::to_string(a.k));
  if (a.T < 1 || a.T > max_T)
    fail("moe_route_prefill: token count must be in [1, ", std::to_string(max_T), "], got ", std::to_string(a.T));
  if (W.cols <= 0 || W.cols % kBK != 0)
    fail("moe_route_prefill: hidden size must be a positive multiple of ", std::to_string(kBK));
  if (a.tile_m != 16 && a.tile_m != 32 && a.tile_m != 64 && a.tile_m != 128)
    fail("moe_route_prefill: tile_m must be 16, 32, 64 or 128, got ", std::to_string(a.tile_m));
  if (a.max_tiles < moe_max_tiles(a.T * a.k, a.tile_m, a.E))
    fail("moe_route_prefill: max_tiles is below moe_max_tiles(T * k, tile_m, E)");
  if (!W.codes || !W.sb || !a.x || !a.route_w || !a.expert_ids || !a.shared_logit || !a.counts || !a.offsets ||
      !a.x_rows || !a.y_rows || !a.tiles || !a.n_tiles || !a.partials || !a.cursor || !a.counter)
    fail("moe_route_prefill: a required pointer is null");
  if (!aligned16(a.x) || !aligned16(a.partials) || !aligned16(W.codes))
    fail("moe_route_prefill: x, partials and the router codes must be 16-byte aligned");
  const int splits = moe_route_detail::router_splits(a.T, W.cols);
  moe_route_detail::launch_router_gemm(a, splits, stream);
  moe_route_detail::launch_route_sort(a, splits, stream);
}

}  // namespace lily::cuda
