#include "cpu/ops.h"

namespace lily::cpu {

const ops::HostOps& host_ops() {
  static const ops::HostOps ops{"cpu", embedding, rmsnorm, qmatmul, qmatmul_batch, gated_delta_step, gated_attention,
                                nullptr, true};
  return ops;
}

}  // namespace lily::cpu
