// Random device data for the benchmark entries: counter-based hashes (no host copies of
// the large matrices), so a 286 MB lm_head is filled in microseconds.
#include <cmath>

#include "bench.h"
#include "common/cuda_check.h"
#include "common/device_common.cuh"
#include "qmatmul/qmatmul_tiles.h"

namespace lily::bench {
namespace {

using cuda::check;

constexpr int kFillThreads = 256, kFillBlocks = 4096;

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in (0, 1] from (seed, i).
__device__ __forceinline__ float uniform(uint64_t seed, uint64_t i) {
  return (static_cast<float>(mix64(seed + 0x9e3779b97f4a7c15ull * (i + 1)) >> 40) + 1.0f) * 0x1p-24f;
}

__device__ __forceinline__ float normal(uint64_t seed, uint64_t i) {  // Box-Muller
  return sqrtf(-2.0f * logf(uniform(seed, 2 * i))) * cospif(2.0f * uniform(seed, 2 * i + 1));
}

__global__ void fill_normal_kernel(float* p, size_t n, float mean, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = mean + scale * normal(seed, i);
}

__global__ void fill_normal_bf16_kernel(uint16_t* p, size_t n, float scale, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = cuda::to_bf16_bits(scale * normal(seed, i));
}

__global__ void fill_words_kernel(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint32_t>(mix64(seed + 0x9e3779b97f4a7c15ull * (i + 1)));
}

// bf16 scale | bf16 bias << 16 per group: |s| = spread * U(0.8, 1.2) with a random sign,
// b = -s * levels / 2 + 0.1 * spread * U(-1, 1), so W x is centred and O(1) (test_util.h make_q).
__global__ void fill_scale_bias_kernel(uint32_t* p, size_t n, float spread, int levels, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u0 = uniform(seed, 3 * i), u1 = uniform(seed, 3 * i + 1), u2 = uniform(seed, 3 * i + 2);
    const float s = spread * (0.8f + 0.4f * u0) * (u1 < 0.5f ? -1.0f : 1.0f);
    const float b = -s * levels * 0.5f + 0.1f * spread * (2.0f * u2 - 1.0f);
    p[i] = uint32_t(cuda::to_bf16_bits(s)) | (uint32_t(cuda::to_bf16_bits(b)) << 16);
  }
}

template <typename Kernel, typename... Args>
void fill(const char* what, Kernel kernel, Args... args) {
  kernel<<<kFillBlocks, kFillThreads>>>(args...);
  check(cudaGetLastError(), what);
}

}  // namespace

Arena::~Arena() {
  for (void* p : owned_) cudaFree(p);  // errors ignored: a destructor must not throw
}

void* Arena::raw(size_t bytes, bool zero) {
  void* p = cuda::device_alloc(bytes > 0 ? bytes : 1, "benchmark inputs");
  owned_.push_back(p);
  if (zero) check(cudaMemset(p, 0, bytes), "benchmark inputs: memset");
  return p;
}

void Arena::copy_in(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "benchmark inputs: upload");
}

float* Arena::normal(size_t n, float scale) {
  float* p = static_cast<float*>(raw(n * sizeof(float), false));
  fill("fill normal", fill_normal_kernel, p, n, 0.0f, scale, seed_++);
  return p;
}

float* Arena::near_one(size_t n) {
  float* p = static_cast<float*>(raw(n * sizeof(float), false));
  fill("fill norm weights", fill_normal_kernel, p, n, 1.0f, 0.1f, seed_++);
  return p;
}

uint16_t* Arena::normal_bf16(size_t n, float scale) {
  uint16_t* p = static_cast<uint16_t*>(raw(n * sizeof(uint16_t), false));
  fill("fill bf16", fill_normal_bf16_kernel, p, n, scale, seed_++);
  return p;
}

uint32_t* Arena::words(size_t n) {
  uint32_t* p = static_cast<uint32_t*>(raw(n * sizeof(uint32_t), false));
  fill("fill words", fill_words_kernel, p, n, seed_++);
  return p;
}

cuda::QMat Arena::qmat(int rows, int cols, int bits, bool tiled) {
  if (bits != 4 && bits != 8) fail("Arena::qmat: ", std::to_string(bits), "-bit matrices are not supported (4 or 8)");
  if (rows <= 0 || cols <= 0 || cols % 64 != 0) fail("Arena::qmat: cols ", std::to_string(cols), " must be a positive multiple of 64");
  if (tiled && bits != 4) fail("Arena::qmat: the tiled layout is 4-bit only");
  const size_t code_bytes = tiled ? cuda::tiled_code_bytes(rows, cols) : size_t(rows) * cols * bits / 8;
  const size_t sb_words = tiled ? cuda::tiled_sb_bytes(rows, cols) / 4 : size_t(rows) * (cols / 64);
  const int levels = (1 << bits) - 1;
  const float spread = static_cast<float>(1.0 / std::sqrt(double(cols)) / std::sqrt((std::pow(4.0, bits) - 1) / 12.0));
  uint32_t* sb = static_cast<uint32_t*>(raw(sb_words * 4, false));
  fill("fill scales", fill_scale_bias_kernel, sb, sb_words, spread, levels, seed_++);
  cuda::QMat m;
  m.codes = reinterpret_cast<const uint4*>(words(code_bytes / 4));
  m.sb = sb;
  m.rows = rows;
  m.cols = cols;
  m.bits = bits;
  m.gshift = bits == 4 ? 1 : 2;  // log2(64 / columns per 16-byte chunk)
  m.tiled = tiled;
  return m;
}

}  // namespace lily::bench
