// Partial rotary position embedding, NeoX "rotate half" pairing (MODEL.md §4.3).
// For position p and j < R/2 (R = rotary_dim): angle = p * theta^(-2j/R), and
//   x[j]       <- x[j] cos - x[j + R/2] sin
//   x[j + R/2] <- x[j + R/2] cos + x[j] sin
// Dims R.. of each head pass through. Like both references, the inverse frequency and
// the angle are fp32 values (their cos/sin are taken exactly), so long positions carry
// the same angle rounding as MLX and transformers.
#include <cmath>
#include <vector>

#include "check.h"
#include "ops.h"
#include "threadpool.h"

namespace lily::cpu {

void rope(const ops::Rope& args) {
  const auto& [x, T, heads, head_dim, rotary_dim, pos0, theta] = args;
  check(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, "rope", "rotary_dim ", str(rotary_dim),
        " must be even and in (0, head_dim = ", str(head_dim), "]");
  check(T >= 0 && heads > 0 && pos0 >= 0 && theta > 0, "rope", "bad arguments: T ", str(T), ", heads ",
        str(heads), ", pos0 ", str(pos0));
  check(T == 0 || x, "rope", "missing data");
  const int64_t half = rotary_dim / 2;
  std::vector<float> cos_table(T * half), sin_table(T * half);
  for (int64_t j = 0; j < half; ++j) {
    const float inv_freq = static_cast<float>(std::pow(theta, -2.0 * static_cast<double>(j) / rotary_dim));
    for (int64_t t = 0; t < T; ++t) {
      const float angle = static_cast<float>(pos0 + t) * inv_freq;
      cos_table[t * half + j] = static_cast<float>(std::cos(static_cast<double>(angle)));
      sin_table[t * half + j] = static_cast<float>(std::sin(static_cast<double>(angle)));
    }
  }
  parallel_for(T * heads, 6 * half, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / heads;
      const float *c = cos_table.data() + t * half, *s = sin_table.data() + t * half;
      float* lo = x + i * head_dim;
      float* hi = lo + half;
      for (int64_t j = 0; j < half; ++j) {
        const float a = lo[j], b = hi[j];
        lo[j] = a * c[j] - b * s[j];
        hi[j] = b * c[j] + a * s[j];
      }
    }
  });
}

}  // namespace lily::cpu
