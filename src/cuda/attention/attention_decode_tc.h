#pragma once
#include <cuda_runtime.h>

#include "attention/attention_decode.h"

namespace lily::cuda {

// The same op on tensor cores (attention_decode_tc.cu): same arguments, split routing,
// partial layout, merge launch and outputs; the 16 rows of an mma tile are the G query
// heads of a KV head, so G = Hq/Hkv <= 16 (D in 64, 128, 256). The appended K/V rows are
// bit-identical to attention_decode's; q and P enter the mma as bf16, so outputs differ
// from it by bf16 rounding (~1e-2 of their RMS). It reads pos and the cached K/V rows of earlier
// positions before waiting on the kernel launched just before it (PDL), which must
// therefore write neither (decode writes qkv there); any earlier kernel may, as every
// kernel here lets its dependents start only after its own wait.
// With rows > 1, the tokens at pos .. pos + rows - 1 of one speculative step: token r
// attends to keys 0 .. pos + r with exactly the splits, arithmetic and outputs of a one-row
// step at that position (qkv, out and partial rows as above), and appends its K/V row.
void attention_decode_tc(const AttnArgs& a, const int* halt, cudaStream_t stream, int rows = 1);

}  // namespace lily::cuda
