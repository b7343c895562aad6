// The Gated DeltaNet mixer of one decode token in one launch: the in-projection (4-bit
// tensor-core GEMV of x = RMSNorm(h)) followed by gdn_decode's step (conv + SiLU, l2
// norms, gates, delta rule, gated RMSNorm), without the launch boundary between them
// (~3 us in situ, docs/perf-log.md section 8).
//
// One thread-block cluster of C = (Hv/Hk) * kGdnSplit blocks per key head kh (grid C x Hk):
//   1. the in-projection rows of kh, in 16-row blocks: q and k of kh, v and z of its Hv/Hk
//      value heads, and the row blocks holding their b and a rows, dealt to the C blocks
//      (to each half of a block's warps in turn, so a multiprocessor streams two chains
//      of row blocks as the two blocks per multiprocessor of gemv do); each block writes its rows' outputs into every block's shared copy of the head's
//      projection (distributed shared memory); one cluster barrier;
//   2. block r is split r % kGdnSplit of value head kh * Hv/Hk + r / kGdnSplit, as in
//      gdn_decode (same state layout, gdn_state_index), with the head's sums of squares
//      for the gated norm exchanged through distributed shared memory.
// The conv ring, pos and the state are read before the PDL wait (gdn_decode.h says why
// that is safe); x (from h) after it. Outputs as gdn_decode: ring row, state_out, out.
// x must not come from the embedding (XMode::EmbedRmsNorm writes h, which the
// out-projection launched next reads before its wait): layer 0 keeps the two launches.
#pragma once
#include <cuda_runtime.h>

#include "gdn_decode.h"
#include "kernel_types.h"

namespace lily::cuda {

// Whether the fused kernel takes this shape: tiled 4-bit in-projection of
// 2*Hk*Dk + 2*Hv*Dv + 2*Hv rows, clusters of at most 16 blocks (Hv/Hk <= 4), Hv/Hk a
// divisor of 16, Dk and Dv multiples of 16 up to 128, hidden size a multiple of 64 up to 4096.
bool gdn_fused_supported(const QMat& W_in, const GdnArgs& g);

// W_in: the in-projection [q | k | v | z | b | a rows, H]; X: x = RMSNorm(h) (or the embedding
// row + RMSNorm in layer 0); g as for gdn_decode (g.proj is not used).
void gdn_fused_decode(const QMat& W_in, const XSpec& X, const GdnArgs& g, const int* halt, cudaStream_t stream);

// How many of its clusters the device holds at once (all Hk of them should fit in one wave).
int gdn_fused_max_active_clusters(const QMat& W_in, const GdnArgs& g);

}  // namespace lily::cuda
