// The MSL emulator's runtime (docs/metal.md): each threadgroup of a dispatch runs its
// threads as fibers on one OS thread; SIMD ops and barriers are rendezvous of those fibers.
// Kernels reach it only through msl.h; the host through dispatch().
#pragma once
#include <cstddef>
#include <cstdint>
#include <source_location>
#include <span>
#include <string>
#include <vector>

namespace lily::metal_emu {

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
};

// A fiber's builtins, all as 3-vectors; a kernel parameter of a narrower type takes the
// leading components (msl.h builtin_as).
struct ThreadIds {
  Size3 thread_position_in_threadgroup, threadgroup_position_in_grid, thread_position_in_grid;
  Size3 threads_per_threadgroup, threadgroups_per_grid, threads_per_grid;
  uint32_t thread_index_in_threadgroup = 0, simdgroup_index_in_threadgroup = 0, thread_index_in_simdgroup = 0;
  uint32_t simdgroups_per_threadgroup = 0, threads_per_simdgroup = 32;
};

// One [[kernel]] function of a .metal file, as msl_to_cpp.py registers it: `run` binds
// buffers[k] to its [[buffer(k)]] parameters and the ids to its builtin parameters.
struct KernelEntry {
  const char* name;
  const char* file;
  int buffers;  // 1 + the highest [[buffer(k)]]
  void (*run)(void* const* buffers, const ThreadIds& ids);
};
const std::vector<KernelEntry>& kernels();  // generated: every kernel of src/metal

// The scheduler's knobs, process-wide (tests set them through lily._lily.metal_emulator):
// the seed of the fiber order, and a barrier source line to treat as a plain yield.
struct DispatchOptions {
  uint64_t seed = 0;
  int skip_barrier_line = 0;  // 0: none
};
DispatchOptions& dispatch_options();

// Runs kernel over groups x threads, threadgroups in order on the calling thread. An
// unknown kernel, a missing buffer or a divergent SIMD op or barrier throws lily::Error.
void dispatch(const std::string& kernel, Size3 groups, Size3 threads, std::span<void* const> buffers);

// ---- what msl.h calls from inside a fiber ----------------------------------------------

// One lane's part in a SIMD op: its operand, where its result goes, its lane argument.
struct LaneArgs {
  const void* in;
  void* out;
  uint32_t arg;
};
// Computes every lane's result from the lanes of a simdgroup, in lane order; returns the
// lane whose argument names no lane of the simdgroup, or -1.
using SimdCombine = int (*)(const LaneArgs* lanes, int n);

void simd_rendezvous(const char* op, std::source_location where, LaneArgs lane, SimdCombine combine);
void barrier_rendezvous(std::source_location where);
// The index-th `threadgroup` variable of the kernel: bytes shared by the group's fibers,
// 0xff-filled (NaN) at the start of each threadgroup.
void* threadgroup_alloc(size_t index, size_t bytes, size_t align);

}  // namespace lily::metal_emu
