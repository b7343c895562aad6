#include "cpu/ops.h"

namespace lily::cpu {

const ops::HostOps& host_ops() {
  static const ops::HostOps ops{.device = "cpu",
                                .embedding = embedding,
                                .rmsnorm = rmsnorm,
                                .qmatmul = qmatmul,
                                .qmatmul_batch = qmatmul_batch,
                                .gated_delta_step = gated_delta_step,
                                .gated_attention = gated_attention,
                                .moe_block = nullptr,
                                .keeps_rows = true};
  return ops;
}

}  // namespace lily::cpu
