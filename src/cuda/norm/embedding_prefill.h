// Embedding gather for a chunk of prompt tokens: h[t] = dequant(embed[tokens[t]]) (fp32).
#pragma once
#include <cuda_runtime.h>

#include "common/kernel_types.h"

namespace lily::cuda {

// embed: MLX affine row layout (4 or 8 bits), [vocab, H]. tokens: [T] on the device
// (validated by the host). h: [T][H] fp32.
void embedding_prefill(const QMat& embed, const int* tokens, int T, float* h, cudaStream_t stream);

}  // namespace lily::cuda
