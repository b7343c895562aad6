#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "attention/attention_prefill.h"

namespace lily::cuda {

// Step 1 alone (attention_prefill calls it): q -> q_out bf16 [T][Hq][D], k/v -> cache.
void attention_prep_prefill(const AttnPrefillArgs& a, uint16_t* q_out, cudaStream_t stream);

}  // namespace lily::cuda
