// embedding: out[t] = the row ids[t] of the MLX affine table [V, H] dequantised, s q + b per
// group in fp32 (contract: src/cpp/ops/qmatmul.h). A thread a word (32/BITS values) of a row;
// grid (ceil(words / 64), T), 64 threads a threadgroup. bits 4 or 8, uniform.
#include <metal_stdlib>
using namespace metal;

template <int BITS>
void embed_word(device const int* ids, device const uint* codes, device const bfloat* scales,
                device const bfloat* biases, device float* out, uint H, uint group_size, uint t, uint wd) {
  constexpr uint PACK = 32 / BITS, MASK = (1u << BITS) - 1;
  const uint words = H / PACK;
  if (wd >= words) return;
  const size_t row = size_t(ids[t]);
  const uint q = codes[row * words + wd];
  const size_t g = row * (H / group_size) + wd * PACK / group_size;
  const float s = float(scales[g]), b = float(biases[g]);
  for (uint i = 0; i < PACK; ++i) out[size_t(t) * H + wd * PACK + i] = s * float((q >> (BITS * i)) & MASK) + b;
}

kernel void embedding(device const int* ids [[buffer(0)]],
                      device const uint* codes [[buffer(1)]],
                      device const bfloat* scales [[buffer(2)]],
                      device const bfloat* biases [[buffer(3)]],
                      device float* out [[buffer(4)]],
                      constant uint3& dims [[buffer(5)]],
                      uint2 tg [[threadgroup_position_in_grid]],
                      uint tid [[thread_position_in_threadgroup]]) {
  const uint H = dims.x, group_size = dims.y, bits = dims.z, wd = tg.x * 64 + tid;
  if (bits == 4) embed_word<4>(ids, codes, scales, biases, out, H, group_size, tg.y, wd);
  else embed_word<8>(ids, codes, scales, biases, out, H, group_size, tg.y, wd);
}
