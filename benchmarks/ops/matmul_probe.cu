// The bf16 matmul ceiling: C = A B^T, A [M, K], B [N, K] bf16 (K contiguous), fp32
// accumulate, bf16 C (fp32 C for the GEMM of the separate-dequantisation ablation,
// probe_gemm), on mma.sync m16n8k16 (the instruction lily's prefill kernels use;
// this machine has no cuBLAS to call, and cuBLAS's wgmma kernels are faster on Hopper,
// so the result is a lower bound of the card's bf16 rate).
//
// Block tile 128 x 256 x 64, 8 warps of 64 x 64, a 3-stage cp.async pipeline (144 KiB of
// shared memory, one block per SM). Tiles are rows of 64 bf16 = 8 chunks of 16 bytes
// with chunk c of row r stored at chunk c ^ (r & 7), so the 8 rows an ldmatrix phase
// reads fall in 8 different bank groups.
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "bf16.h"
#include "common/cuda_check.h"
#include "dequant_pass.h"
#include "harness.h"
#include "qmatmul/qmatmul_decode_mma.cuh"

namespace lily::bench {
namespace {

using cuda::check;

constexpr int kBM = kProbeTileM, kBN = kProbeTileN, kBK = kProbeTileK, kStages = 3, kThreads = 256;
constexpr int kStageBytes = (kBM + kBN) * kBK * 2;
constexpr int kSmemBytes = kStages * kStageBytes;
constexpr int kGroupM = 8;  // row panels that sweep the column panels together (L2 reuse)

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of 16-byte chunk c of row r in a [rows][kBK] bf16 tile.
__device__ __forceinline__ uint32_t swizzled(int r, int c) { return (r * kBK + ((c ^ (r & 7)) << 3)) * 2; }

// M % 128 == 0, N % 256 == 0, K % 64 == 0 (the host checks). OutT: uint16_t (bf16) or float.
template <typename OutT>
__global__ void __launch_bounds__(kThreads, 1)
    matmul_probe_kernel(const uint16_t* __restrict__ A, const uint16_t* __restrict__ B, OutT* __restrict__ C, int M,
                        int N, int K) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;  // this warp's 64 x 64 tile of the block tile

  const int tiles_m = M / kBM, tiles_n = N / kBN, per_group = kGroupM * tiles_n;
  const int first_m = static_cast<int>(blockIdx.x) / per_group * kGroupM;
  const int group_rows = min(tiles_m - first_m, kGroupM), in_group = static_cast<int>(blockIdx.x) % per_group;
  const int m0 = (first_m + in_group % group_rows) * kBM, n0 = in_group / group_rows * kBN;
  const uint16_t* Ablk = A + static_cast<size_t>(m0) * K;
  const uint16_t* Bblk = B + static_cast<size_t>(n0) * K;
  const uint32_t base = smem_addr(smem);

  auto load_stage = [&](int stage, int kt) {
    const uint32_t sa = base + stage * kStageBytes, sb = sa + kBM * kBK * 2;
    const int k0 = kt * kBK;
#pragma unroll
    for (int j = 0; j < kBM * 8 / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i >> 3, c = i & 7;
      cp_async16(sa + swizzled(r, c), Ablk + static_cast<size_t>(r) * K + k0 + c * 8);
    }
#pragma unroll
    for (int j = 0; j < kBN * 8 / kThreads; ++j) {
      const int i = tid + j * kThreads, r = i >> 3, c = i & 7;
      cp_async16(sb + swizzled(r, c), Bblk + static_cast<size_t>(r) * K + k0 + c * 8);
    }
  };

  float acc[4][8][4];
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  const int n_k = K / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {  // one commit group per k tile, empty past the end
    if (s < n_k) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < n_k; ++kt) {
    cp_async_wait<kStages - 2>();  // tile kt has landed (for this thread) ...
    __syncthreads();               // ... for every thread, and tile kt-1's stage is free
    const int next = kt + kStages - 1;
    if (next < n_k) load_stage(next % kStages, next);
    cp_async_commit();
    const uint32_t sa = base + (kt % kStages) * kStageBytes, sb = sa + kBM * kBK * 2;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t a[4][4], b[8][2];
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)  // x4: rows 0-7 / 8-15 at k 0-7, then at k 8-15 = a0..a3
        ldmatrix_x4(a[mt], sa + swizzled(wm * 64 + mt * 16 + (lane & 15), 2 * ks + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < 4; ++np) {  // x4: n 0-7 at k 0-7 / 8-15, then n 8-15 = two n8 tiles
        uint32_t t[4];
        ldmatrix_x4(t, sb + swizzled(wn * 64 + np * 16 + ((lane >> 4) << 3) + (lane & 7), 2 * ks + ((lane >> 3) & 1)));
        b[2 * np][0] = t[0];
        b[2 * np][1] = t[1];
        b[2 * np + 1][0] = t[2];
        b[2 * np + 1][1] = t[3];
      }
#pragma unroll
      for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) cuda::mma_16816(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }

  const int gid = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mt = 0; mt < 4; ++mt)
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int row = m0 + wm * 64 + mt * 16 + gid, col = n0 + wn * 64 + nt * 8 + 2 * t4;
      const float* c = acc[mt][nt];
      if constexpr (std::is_same_v<OutT, float>) {
        *reinterpret_cast<float2*>(C + static_cast<size_t>(row) * N + col) = make_float2(c[0], c[1]);
        *reinterpret_cast<float2*>(C + static_cast<size_t>(row + 8) * N + col) = make_float2(c[2], c[3]);
      } else {
        *reinterpret_cast<uint32_t*>(C + static_cast<size_t>(row) * N + col) =
            cuda::to_bf16_bits(c[0]) | (uint32_t(cuda::to_bf16_bits(c[1])) << 16);
        *reinterpret_cast<uint32_t*>(C + static_cast<size_t>(row + 8) * N + col) =
            cuda::to_bf16_bits(c[2]) | (uint32_t(cuda::to_bf16_bits(c[3])) << 16);
      }
    }
}

template <typename OutT>
void matmul_probe(const uint16_t* A, const uint16_t* B, OutT* C, int M, int N, int K, cudaStream_t stream) {
  if (M <= 0 || N <= 0 || K <= 0 || M % kBM || N % kBN || K % kBK)
    fail("matmul probe: M, N, K (", std::to_string(M), ", ", std::to_string(N), ", ", std::to_string(K),
         ") must be positive multiples of 128, 256, 64");
  static const bool configured = [] {
    check(cudaFuncSetAttribute(matmul_probe_kernel<OutT>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
          "matmul probe: set smem");
    return true;
  }();
  (void)configured;
  matmul_probe_kernel<OutT><<<(M / kBM) * (N / kBN), kThreads, kSmemBytes, stream>>>(A, B, C, M, N, K);
  check(cudaGetLastError(), "matmul probe: launch");
}

// 64 entries of C against fp64 dot products of the same bf16 rows; throws when wrong.
void spot_check(const uint16_t* A, const uint16_t* B, const uint16_t* C, int M, int N, int K) {
  std::vector<uint16_t> a(K), b(K);
  uint16_t c = 0;
  for (int s = 0; s < 64; ++s) {
    const int i = static_cast<int>((s * 2654435761u) % static_cast<unsigned>(M));
    const int j = static_cast<int>((s * 40503u + 7919u) % static_cast<unsigned>(N));
    check(cudaMemcpy(a.data(), A + static_cast<size_t>(i) * K, K * 2, cudaMemcpyDeviceToHost), "matmul probe: check");
    check(cudaMemcpy(b.data(), B + static_cast<size_t>(j) * K, K * 2, cudaMemcpyDeviceToHost), "matmul probe: check");
    check(cudaMemcpy(&c, C + static_cast<size_t>(i) * N + j, 2, cudaMemcpyDeviceToHost), "matmul probe: check");
    double want = 0;
    for (int k = 0; k < K; ++k) want += double(bf16_to_float(a[k])) * bf16_to_float(b[k]);
    const double got = bf16_to_float(c);
    // bf16 rounding of C (<= 2^-8 relative) plus fp32 accumulation error.
    if (!(std::fabs(got - want) <= std::fabs(want) * 0x1p-8 + 1e-3 * std::sqrt(double(K))))
      fail("matmul probe: C[", std::to_string(i), "][", std::to_string(j), "] = ", std::to_string(got), ", expected ",
           std::to_string(want));
  }
}

}  // namespace

void probe_gemm(const uint16_t* X, const uint16_t* W16, float* Y, int M, int N, int K, cudaStream_t stream) {
  matmul_probe(X, W16, Y, M, N, K, stream);
}

double matmul_probe_tflops(Timer& timer) {
  constexpr int M = 8192, N = 8192, K = 8192, kReps = 10;
  Arena arena;
  const uint16_t* A = arena.normal_bf16(size_t(M) * K);
  const uint16_t* B = arena.normal_bf16(size_t(N) * K);
  uint16_t* C = arena.zeros<uint16_t>(size_t(M) * N);
  check(cudaDeviceSynchronize(), "matmul probe: fill");
  cudaStream_t s = timer.stream();
  matmul_probe(A, B, C, M, N, K, s);
  check(cudaStreamSynchronize(s), "matmul probe: first run");
  spot_check(A, B, C, M, N, K);
  std::vector<cudaEvent_t> ev(2 * kReps);
  for (cudaEvent_t& e : ev) check(cudaEventCreate(&e), "matmul probe: event");
  for (int r = 0; r < kReps; ++r) {
    check(cudaEventRecord(ev[2 * r], s), "matmul probe: event record");
    matmul_probe(A, B, C, M, N, K, s);
    check(cudaEventRecord(ev[2 * r + 1], s), "matmul probe: event record");
  }
  check(cudaStreamSynchronize(s), "matmul probe: timed runs");
  std::vector<double> tflops(kReps);
  for (int r = 0; r < kReps; ++r) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, ev[2 * r], ev[2 * r + 1]), "matmul probe: event time");
    tflops[r] = 2.0 * M * N * K / (ms * 1e-3) * 1e-12;
  }
  for (cudaEvent_t e : ev) cudaEventDestroy(e);
  std::sort(tflops.begin(), tflops.end());
  return tflops[kReps / 2];
}

}  // namespace lily::bench
