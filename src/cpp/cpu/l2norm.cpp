// L2 normalisation of the GDN q/k heads (MODEL.md §4.5 step 6):
// x = x * rsqrt(sum(x^2) + eps) * scale per row (scale = Dk^-0.5 for q, 1 for k).
#include <algorithm>
#include <cmath>

#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {

void l2norm(const ops::L2Norm& args) {
  const auto& [x, rows, dim, eps, scale] = args;
  check(dim > 0 && rows >= 0, "l2norm", "bad shape [", str(rows), ", ", str(dim), "]");
  check(rows == 0 || x, "l2norm", "missing data");
  parallel_for(rows, 2 * dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* xr = x + r * dim;
      const float f = scale / std::sqrt(dot(xr, xr, dim) + eps);
      for (int64_t i = 0; i < dim; ++i) xr[i] *= f;
    }
  });
}

}  // namespace lily::cpu
