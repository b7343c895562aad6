// The Metal backend's ops on host arrays in the reference layout (src/cpp/ops/*.h), for the
// per-backend op tests (tests/test_ops.py through lily._lily.ops, device="metal-emulator"):
// each call NaN-poisons the outputs and dispatches the op's .metal kernel on the MSL
// emulator (src/metal/emulator), its buffers the host arrays themselves.
#pragma once
#include "ops/norm.h"
#include "ops/qmatmul.h"

namespace lily::metal_ops {

void rmsnorm(const ops::RmsNorm& a);             // src/metal/norm/rmsnorm.metal
void gated_rmsnorm(const ops::GatedRmsNorm& a);  // src/metal/norm/rmsnorm.metal
// qmatmul_decode_{4,8}bit (src/metal/qmatmul/qmatmul_decode.metal), all T rows in one dispatch.
void qmatmul(const ops::QMatmul& a);

}  // namespace lily::metal_ops
