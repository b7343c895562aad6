// The SwiGLU MLP of an expert (routed or shared), MODEL.md §4.6 step 3:
//   y[T, H] = down( silu(x gate^T) * (x up^T) ),  gate/up [I, H], down [H, I].
// The experts of a MoE block run together, so a decode step's many small products
// form two loops worth splitting instead of three per expert that are not.
#include "check.h"
#include "ops.h"
#include "vec.h"

namespace lily::cpu {

void moe_experts(std::span<const MoeExpert> mlps, std::vector<float>& scratch) {
  int64_t values = 0;  // sum of T * I: the gate (then activation) values, and as many up values
  for (const MoeExpert& m : mlps) {
    check(m.gate.rows == m.up.rows && m.gate.cols == m.up.cols && m.down.cols == m.gate.rows &&
              m.down.rows == m.gate.cols,
          "moe_experts", "shapes disagree: gate [", str(m.gate.rows), ", ", str(m.gate.cols), "], up [", str(m.up.rows),
          ", ", str(m.up.cols), "], down [", str(m.down.rows), ", ", str(m.down.cols), "]");
    values += m.T * m.gate.rows;
  }
  scratch.resize(2 * values);
  float* g = scratch.data();
  float* u = g + values;

  std::vector<QMatmul> gate_up, down;
  int64_t at = 0;
  for (const MoeExpert& m : mlps) {
    gate_up.push_back({m.x, m.T, m.gate, g + at});
    gate_up.push_back({m.x, m.T, m.up, u + at});
    down.push_back({g + at, m.T, m.down, m.y});
    at += m.T * m.gate.rows;
  }
  qmatmul_batch(gate_up);
  for (int64_t i = 0; i < values; ++i) g[i] = silu(g[i]) * u[i];
  qmatmul_batch(down);
}

}  // namespace lily::cpu
