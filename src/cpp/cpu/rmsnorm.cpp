// RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w, per row of dim values (MODEL.md §4.1;
// the +1 of the zero-centred norms is already in w).
#include <algorithm>
#include <cmath>

#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {

void rmsnorm(const ops::RmsNorm& args) {
  const auto& [x, rows, dim, w, eps, y] = args;
  check(dim > 0 && rows >= 0, "rmsnorm", "bad shape [", str(rows), ", ", str(dim), "]");
  check(rows == 0 || (x && w && y), "rmsnorm", "missing input, weight or output");
  parallel_for(rows, 3 * dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * dim;
      float* yr = y + r * dim;
      const float inv_rms = 1.0f / std::sqrt(dot(xr, xr, dim) / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv_rms * w[i];
    }
  });
}

}  // namespace lily::cpu
