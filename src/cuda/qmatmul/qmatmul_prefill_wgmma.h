// qmatmul_prefill on Hopper warpgroup MMA (qmatmul_prefill_wgmma.cu, sm_90a).
#pragma once
#include <cuda_runtime.h>

#include "qmatmul/qmatmul_prefill.h"

namespace lily::cuda {

// qmatmul_prefill with GemmArgs::wgmma on validated arguments (M > 0; grouped: max_tiles > 0).
void qmatmul_prefill_wgmma(const GemmArgs& a, int tile_m, cudaStream_t stream);

}  // namespace lily::cuda
