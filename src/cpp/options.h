// Every route switch and ablation of the executors in one table (options.cpp): its
// environment variable, default and what it does. The engine parses them once (make_executor)
// and hands the executors an ExecutorOptions; nothing else reads the environment.
#pragma once
#include <string>
#include <vector>

namespace lily {

// The route a prefill kernel family takes: by shape or length (the measured default), or
// one forced for every call (ablations, tests).
enum class GemmRoute { ByShape, Exact, Bf16w, Wgmma };
enum class AttnRoute { ByHeadDim, Mma, Wgmma };
enum class GdnRoute { ByLength, Scan, Chunked };

struct ExecutorOptions {
  int num_threads = 0;  // CPU worker threads; 0: one per hardware thread

  bool cuda_prefill = true;    // chunked prefill (else token by token through the decode step)
  int prefill_chunk = 4096;    // tokens per prefill pass on the GPU
  int prefill_min_tokens = 2;  // shorter feeds run through the decode step
  int prefill_moe_tile = 0;    // rows per grouped-GEMM tile (0: by load)
  int prefill_dense_tile = 0;  // rows per dense-GEMM tile (0: by length)
  bool prefill_host_routing = false;
  bool prefill_profile = false;
  GemmRoute prefill_gemm = GemmRoute::ByShape;
  AttnRoute prefill_attn = AttnRoute::ByHeadDim;
  GdnRoute prefill_gdn = GdnRoute::ByLength;

  bool cuda_pdl = true;           // programmatic dependent launch
  bool cuda_tensor_cores = true;  // 4-bit group-64 matrices tiled for the tensor-core GEMV
  bool cuda_attn_tc = true;       // decode attention on tensor cores (else the SIMT kernel)
  int cuda_attn_split_keys = 128; // decode attention: keys per split-K block at least

  std::string timeline_out, timeline_blocks;  // a timeline build's record files ("": none)

  // The LILY_* variables of the environment over the defaults (only the one named, when
  // given); a malformed value is refused with an error that names its variable.
  static ExecutorOptions from_env(const char* only = nullptr);
};

// One row of the table, for the docs and for `lily._lily.executor_options()`.
struct OptionInfo {
  std::string name, values, default_value, doc;
};
const std::vector<OptionInfo>& executor_option_table();

}  // namespace lily
