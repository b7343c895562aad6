// Token sampling with top-k / top-p / min-p on the device (one block), following the
// host Sampler's rules: candidates are the top_k penalised logits (ties to the lower
// id), softmax at temperature over them, top-p keeps the smallest prefix whose mass
// reaches top_p, min-p keeps p >= min_p * p_max, then one draw. The candidates are found
// by a radix select over the logits and sorted exactly; at most kSampleCap of them (so
// top_k = 0 or > kSampleCap with top_p < 1 considers the kSampleCap most likely tokens).
#pragma once
#include <cuda_runtime.h>

#include "common/decode_ctl.h"

namespace lily::cuda {

constexpr int kSampleCap = 4096;

void sample_topk(const float* logits, int vocab, const DecodeCtl* ctl, const TokenSink& sink, const int* halt,
                 cudaStream_t stream);

}  // namespace lily::cuda
