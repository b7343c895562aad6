#include "quant.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "bf16.h"
#include "threadpool.h"

namespace lily {

// Per group (MLX's affine scheme): the endpoint with the larger magnitude ("edge")
// becomes the bias exactly, and the scale is adjusted so that edge = q0 * scale for an
// integer q0; codes are rint((w - bias) / scale) clipped to [0, 2^b - 1], computed with
// the fp32 scale before it is rounded to bf16.
static void quantize_group(const float* w, int group_size, int bits, uint32_t* codes, uint16_t* scale_out,
                           uint16_t* bias_out) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  float w_min = std::numeric_limits<float>::infinity(), w_max = -w_min;
  for (int j = 0; j < group_size; ++j) {
    w_max = std::max(w_max, w[j]);
    w_min = std::min(w_min, w[j]);
  }
  const bool min_is_edge = std::fabs(w_min) > std::fabs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, eps);
  scale = min_is_edge ? scale : -scale;
  const float edge = min_is_edge ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0;
  if (q0 != 0) {
    scale = edge / q0;
    bias = edge;
  }
  const int per_word = 32 / bits;
  for (int j = 0; j < group_size / per_word; ++j) {
    uint32_t word = 0;
    for (int n = 0; n < per_word; ++n) {
      float q = std::rint((w[j * per_word + n] - bias) / scale);
      q = std::min(std::max(q, 0.0f), n_bins);
      word |= static_cast<uint32_t>(q) << (n * bits);
    }
    codes[j] = word;
  }
  *scale_out = float_to_bf16(scale);
  *bias_out = float_to_bf16(bias);
}

void affine_quantize(const float* w, int64_t rows, int64_t cols, int group_size, int bits, uint32_t* codes,
                     uint16_t* scales, uint16_t* biases) {
  const int64_t groups = cols / group_size, words = cols * bits / 32;
  // Per value: a min/max pass, a rounding and a shift into its word.
  parallel_for(rows, 8 * cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < groups; ++g)
        quantize_group(w + r * cols + g * group_size, group_size, bits,
                       codes + r * words + g * group_size * bits / 32, scales + r * groups + g,
                       biases + r * groups + g);
  });
}

void affine_dequantize_row(const uint32_t* codes, const uint16_t* scales, const uint16_t* biases, int64_t cols,
                           int group_size, int bits, float* out) {
  const uint32_t mask = (1u << bits) - 1;
  const int per_word = 32 / bits;
  for (int64_t g = 0; g < cols / group_size; ++g) {
    const float s = bf16_to_float(scales[g]), b = bf16_to_float(biases[g]);
    const uint32_t* wg = codes + g * group_size / per_word;
    float* og = out + g * group_size;
    for (int j = 0; j < group_size / per_word; ++j) {
      uint32_t word = wg[j];
      for (int n = 0; n < per_word; ++n) og[j * per_word + n] = s * static_cast<float>((word >> (n * bits)) & mask) + b;
    }
  }
}

void affine_dequantize(const uint32_t* codes, const uint16_t* scales, const uint16_t* biases, int64_t rows,
                       int64_t cols, int group_size, int bits, float* w) {
  const int64_t groups = cols / group_size, words = cols * bits / 32;
  parallel_for(rows, 2 * cols, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      affine_dequantize_row(codes + r * words, scales + r * groups, biases + r * groups, cols, group_size, bits,
                            w + r * cols);
  });
}

}  // namespace lily
