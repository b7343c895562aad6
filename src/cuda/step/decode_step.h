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
};

// Scratch of one executor (one forward or generation runs at a time).
class Workspace {
 public:
  // attn_tc: decode attention on tensor cores (LILY_CUDA_ATTN_TC); attn_split_keys: keys per
  // attention split at least (LILY_CUDA_ATTN_SPLIT_KEYS).
  Workspace(const ModelConfig& c, bool attn_tc, int attn_split_keys);
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

// Head: when `compute`, logits[dst] = lm_head(norm(h)); then, when `choose`, picks a
// token from logits[dst] into token slot `dst` (and the host's copy of that slot).
void enqueue_head(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int dst,
                  bool compute, bool choose, Choice how, cudaStream_t stream);

// A verify step's head: s.verify_logits[r] = lm_head(norm(h[r])) and ws.step_argmax[r]
// (its argmax below vocab_limit; 0: all) for every row r < rows.
void enqueue_verify_head(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int rows,
                         int vocab_limit, cudaStream_t stream);

}  // namespace lily::cuda
