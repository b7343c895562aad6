// One decode step as a sequence of kernel launches on a stream (captured into CUDA
// graphs by the executor): the body feeds the token in a device slot through every
// layer; the head computes logits and/or chooses the next token.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "attention/attention_decode.h"
#include "step/cuda_weights.h"
#include "common/decode_ctl.h"
#include "common/device_buffer.h"
#include "sampling.h"

namespace lily::cuda {

// Per-session device state.
struct SessionState {
  std::vector<uint16_t*> k_cache, v_cache;  // per full layer: bf16 [ctx][Hkv][D]
  std::vector<float*> ring;                 // per linear layer: [kGdnRingRows][conv_dim]
  std::vector<float*> state[2];             // per linear layer, double-buffered [Hv*Dk*Dv]
  std::vector<float*> state_rows;           // per linear layer, [kMaxStepRows - 1][Hv*Dk*Dv] (verify steps)
  float* verify_logits = nullptr;           // [kMaxStepRows][V] a verify step's logits
  float* logits[2] = {nullptr, nullptr};    // [V]; logits[parity] hold the current ones
  int* pos = nullptr;                       // tokens fed so far
  int ctx = 0;                              // positions the KV cache holds
  // The MTP head (sessions made with it; step/mtp_step.h): its KV cache holds a row for every
  // fed position but the last; mtp_hidden[parity] row 0 is the normed trunk state at the last
  // fed position, rows 1 .. rows a step's own (before its last row's moves to the other parity).
  uint16_t *mtp_k = nullptr, *mtp_v = nullptr;  // bf16 [ctx][Hkv][D]
  float* mtp_hidden[2] = {nullptr, nullptr};    // [kMaxStepRows + 1][H]
};

// Scratch of one executor (one forward or generation runs at a time).
class Workspace {
 public:
  // attn_tc: decode attention on tensor cores (LILY_CUDA_ATTN_TC); attn_split_keys: keys per
  // attention split at least (LILY_CUDA_ATTN_SPLIT_KEYS).
  // mtp: with the MTP head's buffers below.
  Workspace(const ModelConfig& c, bool attn_tc, int attn_split_keys, bool mtp);
  // Each holds kMaxStepRows rows (a verify step's tokens).
  float *h = nullptr, *proj = nullptr, *mix = nullptr, *route_w = nullptr, *shared_gate = nullptr, *act = nullptr,
        *attn_partial = nullptr;
  int *ids = nullptr, *tok_slots = nullptr, *counts = nullptr;
  unsigned char* seen = nullptr;
  unsigned* head_counter = nullptr;
  bool attn_tensor_cores = true;  // attention_decode_tc (mma over the GQA group); else the SIMT kernel
  float2* head_partial = nullptr;
  DecodeCtl* ctl = nullptr;
  MappedHostBuffer host_tokens;  // int[2]: the token each slot received, for the host
  int max_splits = AttnArgs{}.max_splits;  // attention split-K routing (attention_decode.h)
  int min_chunk = AttnArgs{}.min_chunk;    // LILY_CUDA_ATTN_SPLIT_KEYS=N
  int* step_tokens = nullptr;   // [kMaxStepRows] a verify step's tokens
  int* step_argmax = nullptr;   // [kMaxStepRows] its greedy choices
  // The MTP head's rows (step/mtp_step.h): embeddings, its fc input [rmsnorm(e) | rmsnorm(hidden)],
  // its residual stream, its outputs (mtp.norm), the token drafted after and the drafts, their logits.
  float *mtp_e = nullptr, *mtp_cat = nullptr, *mtp_u = nullptr, *mtp_out = nullptr, *draft_logits = nullptr;
  int* draft_tokens = nullptr;  // [kMaxStepRows]: the token drafted after, then the drafts

 private:
  std::vector<DeviceBuffer> owned_;
  template <typename T>
  T* alloc(size_t n, const char* what);
};

enum class Choice : int { Greedy, Gumbel, TopK };

// The most tokens a verify step of these weights takes (0: none, and why; fewer than
// kMaxStepRows: why no more).
int verify_rows_limit(const ModelConfig& c, const DeviceWeights& W, const Workspace& ws, std::string* why);

Choice choice_for(const SamplingParams& p);

// Feeds the tokens[0 .. rows) (device memory: a token slot, or a verify step's tokens) at
// once, each row computed exactly as by its own step: state[parity] -> state_rows (after
// each token but the last) and state[1-parity] (after the last), pos += rows.
void enqueue_body(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int parity,
                  const int* tokens, int rows, cudaStream_t stream);

// Where an attention layer's keys go: the cache, and the position of the step's first row
// (*pos + pos_offset).
struct AttnCache {
  uint16_t *k = nullptr, *v = nullptr;
  const int* pos = nullptr;
  int pos_offset = 0;
};

// A full-attention mixer over `rows` tokens: ws.proj = attn_in(x), the attention into
// ws.mix (keys appended to the cache), then y += attn_out(ws.mix) unless y is null.
void enqueue_attention(const ModelConfig& c, const DeviceWeights& W, const DeviceLayer& L, Workspace& ws,
                       const AttnCache& cache, const XSpec& xin, float* y, int rows, cudaStream_t stream);

// The MoE block: h += moe(rmsnorm(h, post_norm)); then, with pos, *pos += rows.
void enqueue_moe(const ModelConfig& c, const DeviceLayer& L, Workspace& ws, float* h, int* pos, int rows,
                 cudaStream_t stream);

// Head: when `compute`, logits[dst] = lm_head(norm(h)); then, when `choose`, picks a
// token from logits[dst] into token slot `dst` (and the host's copy of that slot).
void enqueue_head(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int dst,
                  bool compute, bool choose, Choice how, cudaStream_t stream);

// A verify step's head: s.verify_logits[r] = lm_head(norm(h[r])) and ws.step_argmax[r]
// (its argmax below vocab_limit; 0: all) for every row r < rows.
void enqueue_verify_head(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int rows,
                         int vocab_limit, cudaStream_t stream);

}  // namespace lily::cuda
