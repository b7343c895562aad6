// Prefill of one chunk of prompt tokens on the device: every layer processes the whole
// chunk at once (4-bit tensor-core GEMMs with dequantisation in the tile, MoE routing
// and grouped expert GEMMs on the GPU, the chunked (WY) Gated DeltaNet recurrence, flash
// attention against the cache), with no host synchronisation anywhere in the chunk.
// The session is left exactly as T decode steps would leave it: KV cache rows, conv
// ring, recurrent state (in place, state[parity]) and, via the head, logits[parity].
#pragma once
#include <cuda_runtime.h>

#include <deque>

#include "step/cuda_weights.h"
#include "step/decode_step.h"
#include "common/device_buffer.h"
#include "options.h"

namespace lily::cuda {

// Knobs of the prefill route (ExecutorOptions' LILY_PREFILL_* rows, options.cpp;
// docs/perf-log.md holds their measured effect where one was measured).
struct PrefillOptions {
  int moe_tile = 0;          // rows per grouped-GEMM tile (16/32/64/128; 0 = by load)
  int dense_tile = 0;        // rows per dense-GEMM tile (16/32/64/128; 0 = by length)
  bool host_routing = false; // ablation: expert offsets via a host round trip per layer
  bool profile = false;      // per-op times of each chunk to stderr
  // The Gated DeltaNet recurrence: by length, the chunked WY form from kGdnChunkedMinTokens
  // on (the scan faster below, perf-log P4).
  GdnRoute gdn = GdnRoute::ByLength;
  static constexpr int kGdnChunkedMinTokens = 1024;
  // The GEMMs: by shape, bf16 weights (as MLX's GPU kernels compute, perf-log P3) on Hopper
  // warpgroup MMA for the dense GEMMs with K >= kWgmmaMinK in chunks of kWgmmaMinTokens or
  // more, on mma.sync otherwise (perf-log P5); or one route for every GEMM.
  GemmRoute gemm = GemmRoute::ByShape;
  static constexpr int kWgmmaMinK = 2048, kWgmmaMinTokens = 2048;
  AttnRoute attn = AttnRoute::ByHeadDim;  // the flash attention kernel
  bool gemm_bf16w() const { return gemm != GemmRoute::Exact; }
  bool gemm_wgmma_dense(int K, int T) const {
    return gemm == GemmRoute::Wgmma || (gemm == GemmRoute::ByShape && K >= kWgmmaMinK && T >= kWgmmaMinTokens);
  }
  bool gemm_wgmma_grouped() const { return gemm == GemmRoute::Wgmma; }
  bool gdn_chunked(int T) const { return gdn == GdnRoute::Chunked || (gdn == GdnRoute::ByLength && T >= kGdnChunkedMinTokens); }
  // The prefill part of the executor options, refused by name where unfit for `c`.
  static PrefillOptions from(const ExecutorOptions& o, const ModelConfig& c);
};

// Activations of one chunk, allocated for `capacity` tokens once and reused; peak
// memory depends on the chunk size, never on the prompt length.
class PrefillWorkspace {
 public:
  // mtp: with the MTP head's buffers (mtp_state, mtp_cat).
  PrefillWorkspace(const ModelConfig& c, int capacity, const PrefillOptions& opt, bool mtp);
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
  // The MTP head: the normed trunk states [T + 1][H] (before the chunk, then each row's) and
  // its fc input [T][2H] bf16
  float* mtp_state = nullptr;
  uint16_t* mtp_cat = nullptr;

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

// The MoE sublayer alone over the T rows of ws.h, as every layer of enqueue_prefill runs it:
// h += moe(rmsnorm(h, L.post_norm)) (the op tests reach the prefill's MoE kernels by it).
void enqueue_moe_prefill(const ModelConfig& c, const DeviceLayer& L, PrefillWorkspace& ws, const PrefillOptions& opt, int T,
                         cudaStream_t stream);

// The MTP head's cache rows for the chunk (session made with it; step/mtp_step.h): after the
// chunk's trunk and heads (ws.h is overwritten), the rows at positions pos0 - 1 .. pos0 + T - 2
// (from 0 when pos0 == 0), and mtp_hidden[parity] row 0 = the normed state at pos0 + T - 1.
void enqueue_mtp_prefill(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, const PrefillOptions& opt,
                         const SessionState& s, int parity, int pos0, int T, cudaStream_t stream);

// logits[r][V] = lm_head(final_norm(h[row0 + r])) for r < rows <= kLogitRows.
void enqueue_logit_rows(const ModelConfig& c, const DeviceWeights& W, PrefillWorkspace& ws, int row0, int rows,
                        cudaStream_t stream);

}  // namespace lily::cuda
