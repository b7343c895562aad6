// ops_bench: lily's CUDA kernels at Qwen3.6-35B-A3B shapes, each timed after an L2 flush
// and back-to-back, against the card's copy and bf16 matmul rates measured in the same run.
//   ops_bench [--only SUBSTRING]... [--json PATH] [--reps N] [--list]
// --only keeps the entries whose "name shape" contains a SUBSTRING (repeatable);
// --list prints the entries and exits. The table goes to stdout; exit status 1 when an
// entry failed (its row says why).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common/cuda_check.h"
#include "common/device_common.cuh"
#include "harness.h"

namespace lily::bench {
namespace {

using cuda::check;

struct Options {
  std::vector<std::string> only;
  std::string json;
  int reps = 20;
  bool list = false;
};

struct Result {
  const Op* op;
  Timing t;
  std::string error;
};

struct Ceilings {
  double copy_gbs, matmul_tflops;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--only" && has_value) o.only.push_back(argv[++i]);
    else if (a == "--json" && has_value) o.json = argv[++i];
    else if (a == "--reps" && has_value) o.reps = std::atoi(argv[++i]);
    else if (a == "--list") o.list = true;
    else fail("ops_bench: unknown or incomplete argument '", a, "' (--only SUBSTRING, --json PATH, --reps N, --list)");
  }
  return o;
}

std::string label(const Op& op) { return op.name + " " + op.shape; }

bool selected(const Op& op, const Options& o) {
  if (o.only.empty()) return true;
  for (const std::string& s : o.only)
    if (label(op).find(s) != std::string::npos) return true;
  return false;
}

void print_row(const Result& r, const Ceilings& c) {
  const Op& op = *r.op;
  if (!r.error.empty()) {
    std::printf("| %s | %s | FAIL: %s |\n", op.name.c_str(), op.shape.c_str(), r.error.c_str());
    return;
  }
  const double gbs = op.bytes / r.t.us_median * 1e-3, tflops = op.flops / r.t.us_median * 1e-6;
  std::printf("| %s | %s | %.2f | %.2f | %.2f | %.0f | %.0f%% |", op.name.c_str(), op.shape.c_str(), r.t.us_median,
              r.t.us_min, r.t.us_warm, gbs, 100 * gbs / c.copy_gbs);
  if (op.flops > 0) std::printf(" %.3g | %.1f%% |\n", tflops, 100 * tflops / c.matmul_tflops);
  else std::printf(" - | - |\n");
  std::fflush(stdout);
}

// A JSON number, or null (a failed ceiling makes the percentages NaN).
std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (const char ch : s) {
    if (ch == '"' || ch == '\\') q += '\\', q += ch;
    else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      q += buf;
    } else q += ch;
  }
  return q + "\"";
}

void write_json(const std::string& path, const cudaDeviceProp& prop, const Ceilings& c, const Options& o,
                size_t flush_bytes, const std::vector<Result>& results) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (!f) fail("ops_bench: cannot write ", path);
  const char* commit = std::getenv("LILY_GIT_COMMIT");
  std::fprintf(f, "{\n  \"device\": %s,\n  \"sms\": %d,\n  \"l2_bytes\": %d,\n  \"commit\": %s,\n  \"pdl\": %s,\n",
               quoted(prop.name).c_str(), prop.multiProcessorCount, prop.l2CacheSize, commit ? quoted(commit).c_str() : "null",
               cuda::pdl_enabled() ? "true" : "false");
  std::fprintf(f,
               "  \"ceilings\": {\"copy_gbs\": %s, \"matmul_tflops\": %s, \"matmul\": \"mma.sync m16n8k16 bf16 probe, "
               "8192^3, fp32 accumulate (a lower bound of the card's bf16 rate)\"},\n",
               num(c.copy_gbs).c_str(), num(c.matmul_tflops).c_str());
  std::fprintf(f, "  \"reps\": %d,\n  \"l2_flush_bytes\": %zu,\n  \"warm_graph_launches\": %d,\n  \"warm_replays\": %d,\n",
               o.reps, flush_bytes, Timer::kWarmLaunches, Timer::kWarmReplays);
  std::fprintf(f, "  \"ops\": [");
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    const Op& op = *r.op;
    std::fprintf(f, "%s\n    {\"op\": %s, \"shape\": %s, \"bytes\": %s, \"flops\": %s", i ? "," : "",
                 quoted(op.name).c_str(), quoted(op.shape).c_str(), num(op.bytes).c_str(), num(op.flops).c_str());
    if (!r.error.empty()) {
      std::fprintf(f, ", \"error\": %s}", quoted(r.error).c_str());
      continue;
    }
    const double gbs = op.bytes / r.t.us_median * 1e-3, tflops = op.flops / r.t.us_median * 1e-6;
    std::fprintf(f, ", \"us_median\": %s, \"us_min\": %s, \"us_warm\": %s, \"gbs\": %s, \"pct_copy\": %s",
                 num(r.t.us_median).c_str(), num(r.t.us_min).c_str(), num(r.t.us_warm).c_str(), num(gbs).c_str(),
                 num(100 * gbs / c.copy_gbs).c_str());
    if (op.flops > 0)
      std::fprintf(f, ", \"tflops\": %s, \"pct_matmul\": %s}", num(tflops).c_str(), num(100 * tflops / c.matmul_tflops).c_str());
    else
      std::fprintf(f, ", \"tflops\": null, \"pct_matmul\": null}");
  }
  std::fprintf(f, "\n  ]\n}\n");
  if (std::fclose(f) != 0) fail("ops_bench: cannot write ", path);
}

int run(const Options& o) {
  std::vector<Op> all, ops;
  add_probe_ops(all);
  add_phase_probe_ops(all);
  add_release_probe_ops(all);
  add_decode_ops(all);
  add_prefill_ops(all);
  add_prefill_gemm_ops(all);
  for (const Op& op : all)
    if (selected(op, o)) ops.push_back(op);
  if (o.list) {
    for (const Op& op : ops) std::printf("%s\n", label(op).c_str());
    return 0;
  }
  if (ops.empty()) fail("ops_bench: no entry matches --only");

  cudaDeviceProp prop;
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  Timer timer(o.reps);
  int failures = 0;
  auto ceiling = [&](const char* what, const std::function<double()>& measure) {
    try {
      return measure();
    } catch (const std::exception& e) {  // the entries still run; their % column reads nan
      std::printf("FAIL %s: %s\n", what, e.what());
      ++failures;
      return std::nan("");
    }
  };
  const Ceilings c{ceiling("copy ceiling", [&] { return copy_gbs(timer); }),
                   ceiling("matmul ceiling", [&] { return matmul_probe_tflops(timer); })};
  std::printf("device: %s, %d SMs, L2 %d MiB; PDL %s\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20,
              cuda::pdl_enabled() ? "on" : "off (LILY_CUDA_PDL=0)");
  std::printf("ceilings (this run): device copy %.0f GB/s (1 GiB, read + write); bf16 matmul %.0f TFLOP/s "
              "(mma.sync probe, 8192^3: a lower bound of the card's rate)\n",
              c.copy_gbs, c.matmul_tflops);
  std::printf("cold: one launch after reading %zu MiB through L2, median and min of %d (µs); warm: per launch in a graph "
              "of %d back-to-back launches; GB/s and TFLOP/s from the cold median\n\n",
              timer.flush_bytes() >> 20, o.reps, Timer::kWarmLaunches);
  std::printf("| op | shape | µs median | µs min | µs warm | GB/s | %% copy | TFLOP/s | %% matmul |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  std::fflush(stdout);

  std::vector<Result> results;
  for (const Op& op : ops) {
    Result r{&op, {}, {}};
    {
      Arena arena;
      try {
        const Launch launch = op.setup(arena);
        check(cudaDeviceSynchronize(), "ops_bench: setup");
        r.t = timer.time(launch);
      } catch (const std::exception& e) {
        r.error = e.what();
      }
      cudaDeviceSynchronize();  // nothing may still use the arena when it is freed
    }
    print_row(r, c);
    results.push_back(r);
    if (r.error.empty()) continue;
    ++failures;
    cudaGetLastError();
    if (cudaDeviceSynchronize() != cudaSuccess) {  // a sticky error: the context is lost
      std::printf("FAIL the device is in an error state after '%s'; the remaining entries are not run\n", label(op).c_str());
      break;
    }
  }
  if (!o.json.empty()) write_json(o.json, prop, c, o, timer.flush_bytes(), results);
  std::printf("\n%d entr%s, %d failed\n", static_cast<int>(results.size()), results.size() == 1 ? "y" : "ies", failures);
  return failures ? 1 : 0;
}

}  // namespace
}  // namespace lily::bench

int main(int argc, char** argv) {
  try {
    return lily::bench::run(lily::bench::parse(argc, argv));
  } catch (const std::exception& e) {
    std::printf("FAIL %s\n", e.what());
    return 1;
  }
}
