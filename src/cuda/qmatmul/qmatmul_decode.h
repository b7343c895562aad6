// y = W x for one token (decode), or for `rows` tokens at once: W an MLX affine 4/8-bit
// matrix, x built by the block from an XSpec (plain, RMSNorm, embedding + RMSNorm); row t
// of x at X.x + t * cols (or token X.token[t]), of y at Y.y + t * W.rows. Several rows
// need tiled weights; each row's y is bit-identical to a one-row launch.
#pragma once
#include <cuda_runtime.h>

#include "common/kernel_types.h"

namespace lily::cuda {

enum class YMode : int { Store, Add };  // y[r] = v, or y[r] += v (residual add)

struct YSpec {
  YMode mode = YMode::Store;
  float* y = nullptr;
};

// halt: when non-null and *halt != 0 the kernel does nothing (a finished decode loop). The
// flag is read before the PDL wait, except by the embedding qmatmul_decode (XMode::EmbedRmsNorm), the
// step's first kernel, which follows the token choice that writes it (decode_ctl.h).
// YMode::Add on tiled weights reads a block's first rows of y before waiting on the kernel
// launched just before it (PDL), so that kernel must not write y; any earlier one may, as
// every kernel here lets its dependents start only after its own wait.
void qmatmul_decode(const QMat& W, const XSpec& X, const YSpec& Y, const int* halt, cudaStream_t stream, int rows = 1);

// Dynamic shared memory of a qmatmul_decode (and of the tensor-core lm_head) over W for `rows` tokens.
size_t qmatmul_decode_smem_bytes(const QMat& W, int rows);

}  // namespace lily::cuda
