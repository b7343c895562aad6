// Output head for one token: logits = lm_head(RMSNorm(h)) and, in the same launch, the
// choice of the next token when it is an argmax: greedy (argmax of the penalised
// logits) or temperature sampling by the Gumbel-max trick (argmax of l/T + Gumbel noise,
// an exact sample of softmax(l/T)). The last block to finish reduces the block winners
// and emits the token. Other sampling rules run in sample_topk() afterwards.
#pragma once
#include <cuda_runtime.h>

#include "common/decode_ctl.h"
#include "common/kernel_types.h"

namespace lily::cuda {

enum class HeadSelect : int { None, Greedy, Gumbel };

constexpr int kLmHeadMaxBlocks = 1024;  // blocks of one launch at most (the partials' size per row)

struct HeadArgs {
  QMat W;                // [V, H]
  XSpec X;               // RMSNorm(h) with the final norm
  float* logits = nullptr;  // [rows][V]
  bool compute = true;   // false: the logits are already there (choose only)
  HeadSelect select = HeadSelect::None;
  const DecodeCtl* ctl = nullptr;  // sampling parameters (select != None)
  float2* partial = nullptr;       // [kLmHeadMaxBlocks] block winners
  unsigned* counter = nullptr;     // zero; the last block resets it
  TokenSink sink;
  // Several rows (a speculative verify step: tiled weights, select None): row t of x at
  // X.x + t * H; each row's logits are bit-identical to a one-row launch's, and, with
  // argmax set, argmax[t] receives row t's greedy choice among rows < argmax_limit (all
  // when 0). partial then holds rows * kLmHeadMaxBlocks entries.
  int rows = 1;
  int* argmax = nullptr;
  int argmax_limit = 0;
};

void lm_head(const HeadArgs& a, const int* halt, cudaStream_t stream);

}  // namespace lily::cuda
