// Prefill of one chunk of prompt tokens on the device: every layer processes the whole
// chunk at once (4-bit tensor-core GEMMs with dequantisation in the tile, MoE routing
// and grouped expert GEMMs on the GPU, the chunked (WY) Gated DeltaNet recurrence, flash
// attention against the cache), with no host synchronisation anywhere in the chunk.
// The session is left exactly as T decode steps would leave it: KV cache rows, conv
// ring, recurrent state (in place, state[parity]) and, via the head, logits[parity].
#pragma once
#include <cuda_runtime.h>

#include <deque>

#include "cuda_weights.h"
#include "decode_step.h"
#include "device_buffer.h"

namespace lily::cuda {

// Knobs of the prefill route (environment, read once per executor; docs/usage.md lists
// them, docs/perf-log.md holds their measured effect where one was measured).
struct PrefillOptions {
  int moe_tile = 0;          // LILY_PREFILL_MOE_TILE: rows per grouped-GEMM tile (16/32/64/128; 0 = by load)
  int dense_tile = 0;        // LILY_PREFILL_DENSE_TILE: rows per dense-GEMM tile (16/32/64/128; 0 = by length)
  bool host_routing = false; // LILY_PREFILL_HOST_ROUTING=1: expert offsets via a host round trip per layer
  bool profile = false;      // LILY_PREFILL_PROFILE=1: per-op times of each chunk to stderr
  // LILY_PREFILL_GDN=scan|chunked: the Gated DeltaNet recurrence as the register-resident
  // sequential scan or the chunked WY form; unset: chunked from kGdnChunkedMinTokens on.
  enum class Gdn { ByLength, Scan, Chunked } gdn = Gdn::ByLength;
  // Chunk lengths 64..4096 on the H200 (perf-log P4): the scan 7.5 % / 3.9 % faster at 64 / 128,
  // even at 256-512, the chunked form 5.5 % / 2.5 % faster at 1K / 4K.
  static constexpr int kGdnChunkedMinTokens = 1024;
  // LILY_PREFILL_GEMM=exact|bf16w|wgmma: scale and bias folded per group in fp32 (exact),
  // or the weights rounded once to bf16 in registers with one accumulator over K (bf16w,
  // as MLX's GPU kernels compute; 1.30x faster end to end at 4K, perf-log P3) on mma.sync,
  // or the bf16w maths on Hopper warpgroup MMA (qgemm_wgmma.cu, sm_90a) for every GEMM.
  // Unset: bf16w, on wgmma with 128 x 256 blocks for the dense GEMMs where that measured
  // faster at 4K on the H200 (perf-log P5): K >= 2048 (in-projections 6-7 %, out-
  // projections 12 %, shared gate/up 15 %; the K = 512 shared down is 39 % slower) in
  // chunks of kWgmmaMinTokens or more (chunks of 512: 12 % slower end to end, 1K: even,
  // 2K and 4K: 3 % faster). The grouped expert GEMMs stay on mma.sync (wgmma's
  // 64 x 128 blocks are 13-23 % slower there).
  enum class Gemm { ByShape, Exact, Bf16w, Wgmma } gemm = Gemm::ByShape;
  static constexpr int kWgmmaMinK = 2048, kWgmmaMinTokens = 2048;
  bool gemm_bf16w() const { return gemm != Gemm::Exact; }
  bool gemm_wgmma_dense(int K, int T) const {
    return gemm == Gemm::Wgmma || (gemm == Gemm::ByShape && K >= kWgmmaMinK && T >= kWgmmaMinTokens);
  }
  bool gemm_wgmma_grouped() const { return gemm == Gemm::Wgmma; }
  bool gdn_chunked(int T) const { return gdn == Gdn::Chunked || (gdn == Gdn::ByLength && T >= kGdnChunkedMinTokens); }
  // LILY_PREFILL_* of the environment, each refused with its name when malformed or unfit for `c`.
  static PrefillOptions from_env(const ModelConfig& c);
};

// Activations of one chunk, allocated for `capacity` tokens once and reused; peak
// memory depends on the chunk size, never on the prompt length.
class PrefillWorkspace {
 public:
  PrefillWorkspace(const ModelConfig& c, int capacity, const PrefillOptions& opt);
  int capacity = 0;
  int* tokens = nullptr;          // [T]
  float* h = nullptr;             // [T][H] residual stream
  uint16_t* xb = nullptr;         // [T][max(H, Hv*Dv, Hq*D)] bf16 GEMM operand
  float* xf = nullptr;            // [T][H] fp32 normed input of the router
  float* proj = nullptr;          // [T][max(GDN, attention) input-projection rows]
  // Gated DeltaNet
  float *q = nullptr, *k = nullptr, *v = nullptr, *beta = nullptr, *decay = nullptr, *o = nullptr;
  void* gdn_scratch = nullptr;  // chunked form only
  size_t gdn_scratch_bytes = 0;
  // Attention
  void* attn_scratch = nullptr;
  size_t attn_scratch_bytes = 0;
  // MoE
  float *route_w = nullptr, *shared_logit = nullptr;
  int *expert_ids = nullptr, *counts = nullptr, *offsets = nullptr, *cursor = nullptr;
  unsigned* route_counter = nullptr;
  float* router_partials = nullptr;
  int *x_rows = nullptr, *y_rows = nullptr, *n_tiles = nullptr;
  int4* tiles = nullptr;
  int max_tiles = 0, tile_m = 0;
  uint16_t *act = nullptr, *act_shared = nullptr;
  float *y_slots = nullptr, *y_shared = nullptr;
  // Teacher-forced logits, kLogitRows rows at a time
  static constexpr int kLogitRows = 64;
  float* logits = nullptr;  // [kLogitRows][V]

 private:
  template <typename T>
  T* alloc(size_t n, const char* what);
  std::deque<DeviceBuffer> owned_;
};

// Whether every matrix and head shape fits the prefill kernels; otherwise the reason.
bool prefill_supported(const ModelConfig& c, const DeviceWeights& W, std::string* why);

// Runs the chunk tokens[0..T) (already in ws.tokens) at positions pos0.. through every
// layer; ws.h then holds the last layer's output rows (before the final norm).
void enqueue_prefill(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, const PrefillOptions& opt,
                     const SessionState& s, int parity, int pos0, int T, cudaStream_t stream);

// logits[r][V] = lm_head(final_norm(h[row0 + r])) for r < rows <= kLogitRows.
void enqueue_logit_rows(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, int row0, int rows,
                        cudaStream_t stream);

}  // namespace lily::cuda
