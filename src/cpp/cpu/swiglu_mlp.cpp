// The SwiGLU MLP of an expert (routed or shared), MODEL.md §4.6 step 3:
//   y[T, H] = down( silu(x gate^T) * (x up^T) ),  gate/up [I, H], down [H, I].
#include "check.h"
#include "ops.h"
#include "vec.h"

namespace lily::cpu {

void swiglu_mlp(const float* x, int64_t T, const QWeight& gate, const QWeight& up, const QWeight& down,
                float* scratch, float* y) {
  check(gate.rows == up.rows && gate.cols == up.cols && down.cols == gate.rows && down.rows == gate.cols,
        "swiglu_mlp", "shapes disagree: gate [", str(gate.rows), ", ", str(gate.cols), "], up [", str(up.rows), ", ",
        str(up.cols), "], down [", str(down.rows), ", ", str(down.cols), "]");
  check(T == 0 || scratch, "swiglu_mlp", "missing scratch");
  const int64_t I = gate.rows;
  float* g = scratch;
  float* u = scratch + T * I;
  qmatmul(x, T, gate, g);
  qmatmul(x, T, up, u);
  for (int64_t i = 0; i < T * I; ++i) g[i] = silu(g[i]) * u[i];
  qmatmul(g, T, down, y);
}

}  // namespace lily::cpu
