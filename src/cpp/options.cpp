#include "options.h"

#include <cerrno>
#include <cstdlib>
#include <functional>

#include "error.h"
#include "threadpool.h"

namespace lily {
namespace {

// A variable of the table: name, accepted values, default as the docs show it, what it
// does, and how a set value lands in the options (after its check).
struct Option {
  OptionInfo info;
  std::function<void(ExecutorOptions&, const std::string&)> set;
};

int whole_number(const std::string& name, const std::string& v, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (errno || end == v.c_str() || *end || x < lo || x > hi)
    fail(name, " must be a whole number from ", std::to_string(lo), " to ", std::to_string(hi), ", got '", v, "'");
  return static_cast<int>(x);
}

Option number(const char* name, long lo, long hi, int ExecutorOptions::*field, const char* doc,
              const char* def_label = nullptr) {
  const int def = ExecutorOptions{}.*field;
  return {{name, std::to_string(lo) + " to " + std::to_string(hi), def_label ? def_label : std::to_string(def), doc},
          [=](ExecutorOptions& o, const std::string& v) { o.*field = whole_number(name, v, lo, hi); }};
}

Option tile(const char* name, int ExecutorOptions::*field, const char* doc) {
  return {{name, "16, 32, 64 or 128", "by shape", doc}, [=](ExecutorOptions& o, const std::string& v) {
            const int t = whole_number(name, v, 16, 128);
            if (t != 16 && t != 32 && t != 64 && t != 128) fail(name, " must be 16, 32, 64 or 128, got '", v, "'");
            o.*field = t;
          }};
}

Option flag(const char* name, bool ExecutorOptions::*field, const char* doc) {
  const bool def = ExecutorOptions{}.*field;
  return {{name, "0 or 1", def ? "1" : "0", doc},
          [=](ExecutorOptions& o, const std::string& v) { o.*field = whole_number(name, v, 0, 1) != 0; }};
}

template <typename E>
Option choice(const char* name, E ExecutorOptions::*field, std::vector<std::pair<const char*, E>> values,
              const char* def, const char* doc) {
  std::string names;
  for (const auto& [n, e] : values) names += (names.empty() ? "" : ", ") + std::string(n);
  return {{name, names, def, doc}, [=](ExecutorOptions& o, const std::string& v) {
            for (const auto& [n, e] : values)
              if (v == n) return void(o.*field = e);
            fail(name, " must be one of ", names, ", got '", v, "'");
          }};
}

Option path(const char* name, std::string ExecutorOptions::*field, const char* doc) {
  return {{name, "a file path", "unset", doc}, [=](ExecutorOptions& o, const std::string& v) { o.*field = v; }};
}

const std::vector<Option>& table() {
  using O = ExecutorOptions;
  static const std::vector<Option> t = {
      number("LILY_NUM_THREADS", 1, kMaxThreads, &O::num_threads,
             "CPU executor: worker threads (also lily._lily.set_num_threads)", "one per hardware thread"),
      flag("LILY_CUDA_PREFILL", &O::cuda_prefill, "CUDA: chunked prefill; 0 feeds prompts token by token through the decode step"),
      number("LILY_PREFILL_CHUNK", 1, 1 << 20, &O::prefill_chunk, "CUDA: tokens per prefill pass"),
      number("LILY_PREFILL_MIN_TOKENS", 1, 1 << 20, &O::prefill_min_tokens,
             "CUDA: feeds shorter than this run through the decode step"),
      tile("LILY_PREFILL_MOE_TILE", &O::prefill_moe_tile, "CUDA prefill: rows per grouped (expert) GEMM tile"),
      tile("LILY_PREFILL_DENSE_TILE", &O::prefill_dense_tile, "CUDA prefill: rows per dense GEMM tile"),
      flag("LILY_PREFILL_HOST_ROUTING", &O::prefill_host_routing,
           "CUDA prefill ablation: expert offsets through a host round trip per layer"),
      flag("LILY_PREFILL_PROFILE", &O::prefill_profile, "CUDA prefill: per-op times of every chunk on stderr"),
      choice("LILY_PREFILL_GEMM", &O::prefill_gemm,
             {{"exact", GemmRoute::Exact}, {"bf16w", GemmRoute::Bf16w}, {"wgmma", GemmRoute::Wgmma}}, "by shape",
             "CUDA prefill GEMMs: scale and bias folded per group in fp32 (exact), weights rounded to bf16 on "
             "mma.sync (bf16w), or bf16w on Hopper warpgroup MMA for every GEMM (wgmma)"),
      choice("LILY_PREFILL_ATTN", &O::prefill_attn, {{"mma", AttnRoute::Mma}, {"wgmma", AttnRoute::Wgmma}}, "by head dim",
             "CUDA prefill flash attention: the mma.sync kernel (every head dim) or the warpgroup-MMA one (head dim 256)"),
      choice("LILY_PREFILL_GDN", &O::prefill_gdn, {{"scan", GdnRoute::Scan}, {"chunked", GdnRoute::Chunked}}, "by length",
             "CUDA prefill Gated DeltaNet recurrence: the sequential register scan or the chunked WY form"),
      flag("LILY_CUDA_PDL", &O::cuda_pdl, "CUDA: programmatic dependent launch (process-wide: the last executor made sets it)"),
      flag("LILY_CUDA_TENSOR_CORES", &O::cuda_tensor_cores, "CUDA decode: the tensor-core GEMV; 0: the fp32-dot GEMV"),
      flag("LILY_CUDA_ATTN_TC", &O::cuda_attn_tc, "CUDA decode attention on tensor cores; 0: the SIMT kernel"),
      number("LILY_CUDA_ATTN_SPLIT_KEYS", 16, 1 << 18, &O::cuda_attn_split_keys,
             "CUDA decode attention: keys per split-K block at least"),
      path("LILY_CUDA_TIMELINE_OUT", &O::timeline_out, "timeline build (LILY_CUDA_TIMELINE=ON): each kernel's records, appended"),
      path("LILY_CUDA_TIMELINE_BLOCKS", &O::timeline_blocks, "timeline build: every block's stamps of the last call"),
  };
  return t;
}

}  // namespace

ExecutorOptions ExecutorOptions::from_env(const char* only) {
  ExecutorOptions o;
  for (const Option& opt : table())
    if (!only || opt.info.name == only)
      if (const char* v = std::getenv(opt.info.name.c_str()); v && *v) opt.set(o, v);
  return o;
}

const std::vector<OptionInfo>& executor_option_table() {
  static const std::vector<OptionInfo> infos = [] {
    std::vector<OptionInfo> v;
    for (const Option& opt : table()) v.push_back(opt.info);
    return v;
  }();
  return infos;
}

}  // namespace lily
