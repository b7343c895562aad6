// The Gated DeltaNet output norm (MODEL.md §4.5 step 8): y = rmsnorm(x) * w * silu(z)
// per head row of Dv values; w is a plain weight (not zero-centred), shared by all heads.
#include <algorithm>
#include <cmath>

#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {

void gated_rmsnorm(const ops::GatedRmsNorm& args) {
  const auto& [x, z, rows, dim, w, eps, y] = args;
  check(dim > 0 && rows >= 0, "gated_rmsnorm", "bad shape [", str(rows), ", ", str(dim), "]");
  check(rows == 0 || (x && z && w && y), "gated_rmsnorm", "missing input, gate, weight or output");
  parallel_for(rows, dim * (2 + kExpWork), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *xr = x + r * dim, *zr = z + r * dim;
      float* yr = y + r * dim;
      const float inv_rms = 1.0f / std::sqrt(dot(xr, xr, dim) / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * inv_rms * w[i] * silu(zr[i]);
    }
  });
}

}  // namespace lily::cpu
