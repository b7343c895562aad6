// MLX affine quantization: affine_quantize is bit-exact with mx.quantize on bf16
// input; the dequantizers compute scale * q + bias in fp32 (what the executors use;
// mx.dequantize additionally rounds to bf16 twice, see lily.quant.dequantize).
//
// A weight [N, K] with group size g and b bits is stored as
//   codes  uint32 [N, K*b/32]  (element 32/b*j + n is (word[j] >> b*n) & (2^b-1))
//   scales bf16   [N, K/g], biases bf16 [N, K/g]
// and w[r, k] = scales[r, k/g] * q[r, k] + biases[r, k/g].
#pragma once
#include <cstdint>

namespace lily {

// w: N*K floats (bf16-representable values for bit-exactness with bf16 input).
void affine_quantize(const float* w, int64_t rows, int64_t cols, int group_size, int bits, uint32_t* codes,
                     uint16_t* scales_bf16, uint16_t* biases_bf16);

void affine_dequantize(const uint32_t* codes, const uint16_t* scales_bf16, const uint16_t* biases_bf16,
                       int64_t rows, int64_t cols, int group_size, int bits, float* w);

// Dequantizes one row (cols values), in float: scale * q + bias, both from bf16.
void affine_dequantize_row(const uint32_t* codes, const uint16_t* scales_bf16, const uint16_t* biases_bf16,
                           int64_t cols, int group_size, int bits, float* out);

}  // namespace lily
