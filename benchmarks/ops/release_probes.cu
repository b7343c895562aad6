// Does a kernel's release wait on the loads its dependent has in flight? (docs/perf-log.md
// 11: in situ, a kernel's dependent is released 2.5-3.7 µs after its last block triggers,
// 1.6 µs where the dependent reads nothing before its wait; the router's tail grew 1.3 µs
// when gate/up began reading 1 MB before its wait.) A chain of kChain dependent kernels,
// two 256-thread blocks per SM, each block reading B bytes of fresh (L2-cold) weights
// either before its PDL wait or right after it, then triggering at its end as every decode
// kernel did until perf-log 13 (they now trigger right after their wait). Read the cold
// column per kernel (µs / kChain):
//   before(B) - nothing: what B bytes a block cost when asked for before the wait
//   after(B) - nothing:  the same asked for after it
// If loads in flight held the predecessor's release back, before(B) would cost about as
// much as after(B); if they overlap the release, before(B) is cheaper by about their time.
// A kernel's blocks start only ~1 µs before its release when every kernel triggers at
// its end, so the pair "triggering at their wait" (the dependent resident while its
// predecessor loads) gives the loads before the wait a whole predecessor to hide behind.
#include "bench.h"
#include "common/device_common.cuh"

namespace lily::bench {
namespace {

using namespace lily::cuda;

constexpr int kThreads = 256, kChain = 21;
constexpr size_t kBufferBytes = size_t(512) << 20;  // kChain regions of up to 264 x 48 KB

int release_grid() { return 2 * sm_count(); }

// Region `link` of the buffer (regions of gridDim.x * N * 4 KB); a replay re-reads the
// regions of the last one, so read the cold column (the L2 emptied before each replay).
// The loads are ld.global.cg: ptxas may schedule griddepcontrol.wait above non-coherent
// (.nc) loads written before it, and did here, which made "before" run them after the
// wait; the decode kernels' .nc loads sit in a branch of their own (`if (rb < n_rb)
// load`), which keeps them above (check the SASS: every LDG above the ACQBULK).
template <int N, bool BEFORE, bool EARLY>
__global__ void __launch_bounds__(kThreads) traffic_kernel(const uint4* buf, int link, const int* halt, float* sink) {
  const uint4* p = buf + (static_cast<size_t>(link) * gridDim.x + blockIdx.x) * N * kThreads + threadIdx.x;
  uint4 v[N > 0 ? N : 1];
  auto load = [&] {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = __ldcg(p + i * kThreads);  // L2 only, as load_stream
  };
  if (BEFORE) load();
  if (wait_halted(halt)) return;  // as the decode kernels wait (the flag is 0 here)
  if (EARLY) pdl_trigger();
  if (!BEFORE) load();
  uint32_t acc = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) acc ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = 1.0f;  // keeps the loads
  if (!EARLY) pdl_trigger();
}

template <int N, bool BEFORE, bool EARLY = false>
void add_chain(std::vector<Op>& ops) {
  const std::string what =
      (N == 0 ? "nothing" : std::to_string(N * 4) + " KB a block " + (BEFORE ? "before" : "after") + " their wait") +
      (EARLY ? ", triggering at their wait" : "");
  const double bytes = static_cast<double>(kChain) * 264 * N * 4096;  // an H200's grid (listing needs no device)
  ops.push_back({"probe: release, " + std::to_string(kChain) + " kernels reading " + what,
                 std::to_string(kThreads) + " threads x 2 per SM", bytes, 0, [](Arena& A) -> Launch {
                   const int grid = release_grid();
                   const uint4* buf = reinterpret_cast<const uint4*>(A.words(N == 0 ? 4 : kBufferBytes / 4));
                   float* sink = A.zeros<float>(grid);
                   const int* halt = A.zeros<int>(1);
                   return [=](cudaStream_t s) {
                     for (int i = 0; i < kChain; ++i)
                       launch("probe release", traffic_kernel<N, BEFORE, EARLY>, dim3(grid), dim3(kThreads), 0, s, buf,
                              i, halt, sink);
                   };
                 }});
}

}  // namespace

void add_release_probe_ops(std::vector<Op>& ops) {
  add_chain<0, true>(ops);
  add_chain<1, true>(ops);
  add_chain<1, false>(ops);
  add_chain<4, true>(ops);
  add_chain<4, false>(ops);
  add_chain<12, true>(ops);
  add_chain<12, false>(ops);
  add_chain<4, true, true>(ops);
  add_chain<4, false, true>(ops);
}

}  // namespace lily::bench
