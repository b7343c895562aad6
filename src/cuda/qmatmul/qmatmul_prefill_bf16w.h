// qmatmul_prefill with bf16 weights on mma.sync (qmatmul_prefill_bf16w.cu).
#pragma once
#include <cuda_runtime.h>

#include "qmatmul/qmatmul_prefill.h"

namespace lily::cuda {

// qmatmul_prefill with GemmArgs::weights_bf16 on validated arguments; blocks_y: row tiles (dense)
// or max_tiles (grouped), > 0.
void qmatmul_prefill_bf16w(const GemmArgs& a, int tile_m, int blocks_y, cudaStream_t stream);

}  // namespace lily::cuda
