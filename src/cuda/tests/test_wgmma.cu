// Single-instruction probes of the Hopper wgmma forms the prefill attention kernel uses
// (attention_flash_wgmma.cu), each against a CPU matmul, so a descriptor, swizzle or
// fragment-layout error shows here in isolation rather than as a wrong attention:
//   1. A and B from shared memory, both K-major, 128B swizzle (S = Q K^T): a 128 x 256
//      tile (two warpgroups, 64 rows each) times a 64 x 256 tile, 16 K-steps of
//      wgmma m64n64k16 that walk the 32-byte steps inside a swizzle row and the 4 panels;
//   2. A from registers and B MN-major (imm-trans-b) from shared memory, 128B swizzle
//      (O += P V): 128 x 64 P times a 64 x 256 V tile over 4 K-steps of m64n256k16,
//      accumulating onto a random C.
// On a mismatch the first wrong elements are printed with the reference position whose
// value they hold, which names a permutation (a layout error) at a glance.
#include <cmath>

#include "common/async_copy.cuh"
#include "common/device_common.cuh"
#include "test_util.h"
#include "common/wgmma.cuh"

namespace lily::cuda::test {
namespace {

constexpr int kRowsA = 128, kKeys = 64, kD = 256;
constexpr int kSmemBytes = kSwizzleAtomBytes + (kRowsA + kKeys) * kD * 2;  // 1 KB alignment slack + A + B tiles

// [rows][256] bf16 from global into the panelled 128B-swizzle layout at `dst`.
__device__ void stage_sw128(uint32_t dst, const uint16_t* src, int rows) {
  for (int i = threadIdx.x; i < rows * kD / 8; i += blockDim.x)
    cp_async16(dst + sw128_chunk_offset(rows, i / (kD / 8), i % (kD / 8)), src + i * 8);
}

__device__ uint32_t aligned_base(const uint8_t* smem) {
  return (smem_addr(smem) + kSwizzleAtomBytes - 1) & ~uint32_t(kSwizzleAtomBytes - 1);
}

// This thread's D-fragment element e of an m64nN accumulator -> (row, column) of the
// 128-row output (warpgroup wg holds rows 64wg ..).
__device__ int frag_row(int e) { return (threadIdx.x >> 7) * 64 + ((threadIdx.x >> 5) & 3) * 16 + ((threadIdx.x & 31) >> 2) + 8 * ((e >> 1) & 1); }
__device__ int frag_col(int e) { return 8 * (e >> 2) + 2 * (threadIdx.x & 3) + (e & 1); }

// d [128][64] = a [128][256] b[64][256]^T.
__global__ void __launch_bounds__(256) probe_ss_kmajor_kernel(const uint16_t* a, const uint16_t* b, float* d) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t s_a = aligned_base(smem), s_b = s_a + kRowsA * kD * 2;
  stage_sw128(s_a, a, kRowsA);
  stage_sw128(s_b, b, kKeys);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_smem();
  __syncthreads();
  const uint32_t s_awg = s_a + (threadIdx.x >> 7) * 64 * kSwizzleRowBytes;
  float acc[32] = {};
  wgmma_fence();
  for (int ks = 0; ks < kD / 16; ++ks)
    wgmma_ss<64>(acc, wgmma_desc_kmajor_sw128(s_awg + sw128_kstep_offset(kRowsA, ks)),
                 wgmma_desc_kmajor_sw128(s_b + sw128_kstep_offset(kKeys, ks)), ks > 0);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(acc);
  for (int e = 0; e < 32; ++e) d[frag_row(e) * kKeys + frag_col(e)] = acc[e];
}

// d [128][256] = c + p [128][64] v [64][256], p from registers, v MN-major.
__global__ void __launch_bounds__(256) probe_rs_mnmajor_kernel(const uint16_t* p, const uint16_t* v, const float* c,
                                                                 float* d) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t s_v = aligned_base(smem);
  stage_sw128(s_v, v, kKeys);
  cp_async_commit();
  cp_async_wait<0>();
  fence_proxy_async_smem();
  __syncthreads();
  float acc[128];
  for (int e = 0; e < 128; ++e) acc[e] = c[frag_row(e) * kD + frag_col(e)];
  // A fragment of K-step kk: register r = bf16 pair (row gid + 8 (r & 1), k 16kk + 2t + 8 (r >> 1) + {0, 1}).
  uint32_t a[4][4];
  const int row0 = frag_row(0), t = threadIdx.x & 3;
  for (int kk = 0; kk < 4; ++kk)
    for (int r = 0; r < 4; ++r) {
      const uint16_t* src = p + (row0 + 8 * (r & 1)) * kKeys + 16 * kk + 2 * t + 8 * (r >> 1);
      a[kk][r] = src[0] | static_cast<uint32_t>(src[1]) << 16;
    }
  wgmma_hold(acc);
  wgmma_fence();
  for (int kk = 0; kk < 4; ++kk)
    wgmma_m64n256k16_rs_tb(acc, a[kk],
                           wgmma_desc_sw128(s_v + kk * 16 * kSwizzleRowBytes, kKeys * kSwizzleRowBytes, 8 * kSwizzleRowBytes));
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_hold(acc);
  for (int e = 0; e < 128; ++e) d[frag_row(e) * kD + frag_col(e)] = acc[e];
}

std::vector<uint16_t> random_bf16(size_t n, Rng& r) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16(static_cast<float>(r.sym()));
  return v;
}

// Prints up to 4 wrong outputs of a [rows][cols] result and where their value sits in `want`.
void explain(const std::vector<float>& got, const std::vector<double>& want, int cols, double tol) {
  int shown = 0;
  for (size_t i = 0; i < want.size() && shown < 4; ++i) {
    if (std::fabs(got[i] - want[i]) <= tol) continue;
    long at = -1;
    for (size_t j = 0; j < want.size() && at < 0; ++j)
      if (std::fabs(got[i] - want[j]) <= tol) at = static_cast<long>(j);
    std::printf("     (%zu, %zu): got %.5f want %.5f; the value of reference (%ld, %ld)\n", i / cols, i % cols, got[i],
                want[i], at < 0 ? -1 : at / cols, at < 0 ? -1 : at % cols);
    ++shown;
  }
}

void check(const std::string& name, const std::vector<float>& got, const std::vector<double>& want, int cols) {
  // fp32 accumulation of <= 256 products of bf16 in [-1, 1): ~1e-6 of the RMS; a wrong
  // element from a layout error is O(1).
  constexpr double kTol = 1e-4;
  const double err = rel_err(got, want);
  report(name, err, kTol);
  if (!(err <= kTol)) explain(got, want, cols, 1e-3);
}

void test_ss_kmajor(uint64_t seed) {
  Rng r(seed);
  const auto a = random_bf16(kRowsA * kD, r), b = random_bf16(kKeys * kD, r);
  std::vector<double> want(kRowsA * kKeys, 0.0);
  for (int i = 0; i < kRowsA; ++i)
    for (int j = 0; j < kKeys; ++j)
      for (int k = 0; k < kD; ++k)
        want[i * kKeys + j] += double(bf16_to_float(a[i * kD + k])) * bf16_to_float(b[j * kD + k]);
  uint16_t *da = to_dev(a), *db = to_dev(b);
  float* dd = dev_alloc<float>(want.size());
  allow_dynamic_smem(reinterpret_cast<const void*>(probe_ss_kmajor_kernel), kSmemBytes, "wgmma probe: smem opt-in");
  launch("wgmma probe ss", probe_ss_kmajor_kernel, dim3(1), dim3(256), kSmemBytes, nullptr, da, db, dd);
  CK(cudaGetLastError());
  check("wgmma m64n64k16 smem A x smem B, K-major, 128B swizzle (128x256 . 64x256^T)",
        from_dev(dd, want.size()), want, kKeys);
  cudaFree(da), cudaFree(db), cudaFree(dd);
}

void test_rs_mnmajor(uint64_t seed) {
  Rng r(seed);
  const auto p = random_bf16(kRowsA * kKeys, r), v = random_bf16(kKeys * kD, r);
  const auto c = randn(size_t(kRowsA) * kD, r);
  std::vector<double> want(c.begin(), c.end());
  for (int i = 0; i < kRowsA; ++i)
    for (int k = 0; k < kKeys; ++k)
      for (int j = 0; j < kD; ++j) want[i * kD + j] += double(bf16_to_float(p[i * kKeys + k])) * bf16_to_float(v[k * kD + j]);
  uint16_t *dp = to_dev(p), *dv = to_dev(v);
  float *dc = to_dev(c), *dd = dev_alloc<float>(want.size());
  allow_dynamic_smem(reinterpret_cast<const void*>(probe_rs_mnmajor_kernel), kSmemBytes, "wgmma probe: smem opt-in");
  launch("wgmma probe rs", probe_rs_mnmajor_kernel, dim3(1), dim3(256), kSmemBytes, nullptr, dp, dv, dc, dd);
  CK(cudaGetLastError());
  check("wgmma m64n256k16 register A x smem B MN-major (trans), 128B swizzle, += C", from_dev(dd, want.size()), want,
        kD);
  cudaFree(dp), cudaFree(dv), cudaFree(dc), cudaFree(dd);
}

}  // namespace

void run_wgmma_tests() {
  test_ss_kmajor(901);
  test_rs_mnmajor(902);
}

}  // namespace lily::cuda::test
