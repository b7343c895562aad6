// Output head for one token: logits = lm_head(RMSNorm(h)) and, in the same launch, the
// choice of the next token when it is an argmax: greedy (argmax of the penalised
// logits) or temperature sampling by the Gumbel-max trick (argmax of l/T + Gumbel noise,
// an exact sample of softmax(l/T)). The last block to finish reduces the block winners
// and emits the token. Other sampling rules run in sample_topk() afterwards.
#pragma once
#include <cuda_runtime.h>

#include "decode_ctl.h"
#include "kernel_types.h"

namespace lily::cuda {

enum class HeadSelect : int { None, Greedy, Gumbel };

struct HeadArgs {
  QMat W;                // [V, H]
  XSpec X;               // RMSNorm(h) with the final norm
  float* logits = nullptr;  // [V]
  bool compute = true;   // false: the logits are already there (choose only)
  HeadSelect select = HeadSelect::None;
  const DecodeCtl* ctl = nullptr;  // sampling parameters (select != None)
  float2* partial = nullptr;       // [lm_head_max_blocks()] block winners
  unsigned* counter = nullptr;     // zero; the last block resets it
  TokenSink sink;
};

void lm_head(const HeadArgs& a, const int* halt, cudaStream_t stream);
int lm_head_max_blocks();

}  // namespace lily::cuda
