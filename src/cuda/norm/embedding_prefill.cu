#include "norm/embedding_prefill.h"

#include <string>

#include "common/device_common.cuh"
#include "error.h"

namespace lily::cuda {
namespace {

// One thread per 16-byte chunk of a row (32 codes at 4 bits, 16 at 8): w = s * q + b.
template <int BITS>
__global__ void embedding_prefill_kernel(QMat E, const int* tokens, float* h) {
  constexpr int kCols = 128 / BITS, kMask = (1 << BITS) - 1;
  pdl_wait();
  const int t = blockIdx.y, chunk = blockIdx.x * blockDim.x + threadIdx.x;
  if (chunk >= E.chunks()) return;
  const size_t row = static_cast<size_t>(tokens[t]);
  const uint4 c = __ldg(E.codes + row * E.chunks() + chunk);
  const uint32_t sb = __ldg(E.sb + row * E.groups() + (chunk >> E.gshift));
  const float s = bf16_lo(sb), b = bf16_hi(sb);
  const uint32_t w[4] = {c.x, c.y, c.z, c.w};
  float4* out = reinterpret_cast<float4*>(h + static_cast<size_t>(t) * E.cols + static_cast<size_t>(chunk) * kCols);
#pragma unroll
  for (int i = 0; i < kCols / 4; ++i) {
    float v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int code = 4 * i + j;  // code index within the chunk: word code / (32 / BITS)
      v[j] = fmaf(s, static_cast<float>((w[code / (32 / BITS)] >> (BITS * (code % (32 / BITS)))) & kMask), b);
    }
    out[i] = make_float4(v[0], v[1], v[2], v[3]);
  }
  pdl_trigger();
}

}  // namespace

void embedding_prefill(const QMat& embed, const int* tokens, int T, float* h, cudaStream_t stream) {
  if (embed.tiled || (embed.bits != 4 && embed.bits != 8))
    fail("embedding_prefill: the embedding must be a 4- or 8-bit matrix in MLX row order");
  if (T <= 0) fail("embedding_prefill: no tokens (T = ", std::to_string(T), ")");
  const int threads = 128;
  const dim3 grid((embed.chunks() + threads - 1) / threads, T);
  if (embed.bits == 4)
    launch("embedding_prefill", embedding_prefill_kernel<4>, grid, dim3(threads), 0, stream, embed, tokens, h);
  else
    launch("embedding_prefill", embedding_prefill_kernel<8>, grid, dim3(threads), 0, stream, embed, tokens, h);
}

}  // namespace lily::cuda
