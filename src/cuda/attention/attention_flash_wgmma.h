#pragma once
#include <cuda_runtime.h>

#include "attention/attention_flash.h"

namespace lily::cuda {

// Flash step on Hopper warpgroup MMA (attention_flash_wgmma.cu): same grid, outputs and
// partial results as the mma.sync kernel; the caller launches the merge when p.splits > 1.
void launch_flash_wgmma(const FlashParams& p, int D, cudaStream_t stream);

}  // namespace lily::cuda
