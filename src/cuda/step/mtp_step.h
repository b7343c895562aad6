// The MTP head's decode-side steps (MODEL.md §7; the CPU executor's cpu::mtp_head is the
// reference): the rows its cache gains as the trunk feeds tokens, and recursive drafts.
// The head's row at position q pairs the normed trunk state at q with the token at q + 1:
//   u = fc([rmsnorm(embed(token), norm_embed) | rmsnorm(state, norm_hidden)])
//   u += attention(rmsnorm(u, input_norm)) (its own KV cache);  u += moe(rmsnorm(u, post_norm))
//   out = rmsnorm(u, norm);  the draft = argmax lm_head(out); out is the next draft's state.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "step/decode_step.h"

namespace lily::cuda {

// Why this device cannot run the head of W (its steps need what verify steps of
// verify_rows >= 2 tokens need, and its matrices in the tensor-core layout); empty if it can.
std::string mtp_unsupported(const ModelConfig& c, const DeviceWeights& W, int verify_rows);

// After a body of `rows` tokens[0 .. rows) (device) fed from parity: the head's cache rows
// for the positions before each of them (skip = 1 at a session's first token, which has
// none) and mtp_hidden[1 - parity] row 0 = the normed state after the last. Only K/V are
// kept: the attention's output is not needed until a draft. Reads ws.h, before the head.
void enqueue_mtp_follow(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int parity,
                        const int* tokens, int rows, int skip, cudaStream_t stream);

// n drafts after ws.draft_tokens[0] (the token to be fed next, at *s.pos) from
// mtp_hidden[parity]: draft i at head position *s.pos - 1 + i, into ws.draft_tokens[1 + i]
// (greedy below vocab_limit; 0: all) with its logits in ws.draft_logits[i]. The cache rows
// it writes lie at or past the head's last valid row; the trunk is untouched.
void enqueue_mtp_draft(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int parity,
                       int n, int vocab_limit, cudaStream_t stream);

}  // namespace lily::cuda
