// The emulator's scheduler (docs/metal.md). A threadgroup's threads are ucontext fibers,
// each with its own stack; one runs at a time, chosen at random (seeded) among the ready
// ones, until it returns or reaches a rendezvous: a SIMD op completes when all lanes of
// its simdgroup reach the same op at the same source line, a barrier when all threads of
// the group reach the same barrier. Anything else (a lane that returned, or waits at
// another op or line) is an error naming the kernel, the op and its line.
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <random>

#include "error.h"
#include "runtime.h"

namespace lily::metal_emu {
namespace {

constexpr int kSimdWidth = 32;
constexpr size_t kThreadgroupBytes = 32 * 1024;  // Apple GPUs' threadgroup memory
constexpr size_t kStackBytes = 64 * 1024;
constexpr uint32_t kMaxThreads = 1024;  // per threadgroup

enum class State { Ready, Simd, Barrier, Done };

// Where a fiber waits: op and source line (one call site is one rendezvous).
struct Site {
  const char* op = nullptr;
  const char* file = nullptr;
  uint32_t line = 0, column = 0;
  bool operator==(const Site& o) const {
    return op && o.op && !std::strcmp(op, o.op) && line == o.line && column == o.column && !std::strcmp(file, o.file);
  }
};

struct Fiber {
  ucontext_t ctx;
  ThreadIds ids;
  State state = State::Ready;
  Site site;
  LaneArgs lane{};
  SimdCombine combine = nullptr;
};

struct Simdgroup {
  int lanes = 0, at_simd = 0, at_barrier = 0, done = 0;
  Site site;  // of the SIMD op its waiting lanes are at
};

struct Group {
  const KernelEntry* entry = nullptr;
  void* const* buffers = nullptr;
  Size3 position;
  std::vector<Fiber> fibers;
  std::vector<Simdgroup> simd;
  std::vector<int> ready;
  int at_barrier = 0, done = 0;
  Site barrier;
  std::mt19937_64 rng;
  ucontext_t scheduler;
  std::string error;
  alignas(16) std::array<unsigned char, kThreadgroupBytes> memory;
  std::vector<std::pair<size_t, size_t>> vars;  // (offset, bytes) of each threadgroup variable
  size_t used = 0;
};

thread_local Group* g_group = nullptr;
thread_local Fiber* g_fiber = nullptr;

std::string at(const Site& s) { return std::string(s.op) + " (" + s.file + ":" + std::to_string(s.line) + ")"; }

std::string where(const Group& g) {
  return "metal-emulator: " + std::string(g.entry->name) + " threadgroup (" + std::to_string(g.position.x) + ", " +
         std::to_string(g.position.y) + ", " + std::to_string(g.position.z) + "): ";
}

// Records the group's first error; the scheduler throws it once the fiber is off its stack.
void error(Group& g, const std::string& what) {
  if (g.error.empty()) g.error = where(g) + what;
}

void fiber_main() {
  Fiber* f = g_fiber;
  g_group->entry->run(g_group->buffers, f->ids);
  f->state = State::Done;  // uc_link returns to the scheduler
}

// Back to the scheduler until the rendezvous releases this fiber.
void wait(State s, Site site) {
  Fiber* f = g_fiber;
  f->state = s;
  f->site = site;
  swapcontext(&f->ctx, &g_group->scheduler);
}

Site site_of(const char* op, std::source_location w) { return {op, w.file_name(), w.line(), w.column()}; }

// The lanes of simdgroup s of the group, in lane order.
std::span<Fiber> lanes_of(Group& g, uint32_t s) {
  const size_t first = static_cast<size_t>(s) * kSimdWidth;
  return {g.fibers.data() + first, static_cast<size_t>(g.simd[s].lanes)};
}

void release(Group& g, Fiber& f) {
  f.state = State::Ready;
  g.ready.push_back(static_cast<int>(&f - g.fibers.data()));
}

// Where the lanes of f's simdgroup s are, f included: "16 at simd_sum (file:line), 16 returned".
std::string lanes_at(const Group& g, const Simdgroup& s, const Fiber& f) {
  std::string r;
  auto add = [&](int k, const Site* site) {
    if (k) r += (r.empty() ? "" : ", ") + std::to_string(k) + (site ? " at " + at(*site) : " returned");
  };
  const bool same = f.state == State::Simd && s.at_simd && s.site == f.site;
  if (f.state == State::Simd) add(1 + (same ? s.at_simd : 0), &f.site);
  if (!same) add(s.at_simd, &s.site);
  add(s.at_barrier + (f.state == State::Barrier), f.state == State::Barrier ? &f.site : &g.barrier);
  add(s.done, nullptr);
  return r;
}

// Checks the rendezvous the fiber f just reached (or its return) and completes it if all
// its participants are there.
void arrived(Group& g, Fiber& f) {
  const uint32_t si = f.ids.simdgroup_index_in_threadgroup;
  Simdgroup& s = g.simd[si];
  auto lanes = [&] {  // built only for an error: this is the emulator's hot path
    return " not reached by all " + std::to_string(s.lanes) + " lanes of simdgroup " + std::to_string(si) + ": " +
           lanes_at(g, s, f);
  };
  auto threads = [&] { return " not reached by all " + std::to_string(g.fibers.size()) + " threads: "; };
  if (f.state == State::Simd) {
    if (s.at_simd && !(s.site == f.site)) return error(g, at(f.site) + lanes());
    if (s.done || s.at_barrier) return error(g, at(f.site) + lanes());
    s.site = f.site;
    if (++s.at_simd < s.lanes) return;
    std::array<LaneArgs, kSimdWidth> args;
    std::span<Fiber> group_lanes = lanes_of(g, si);
    for (size_t i = 0; i < group_lanes.size(); ++i) args[i] = group_lanes[i].lane;
    if (const int bad = group_lanes[0].combine(args.data(), s.lanes); bad >= 0)
      return error(g, at(f.site) + ": lane " + std::to_string(bad) + " of simdgroup " + std::to_string(si) +
                          " reads lane " + std::to_string(args[bad].arg) + " of " + std::to_string(s.lanes));
    s.at_simd = 0;
    for (Fiber& l : group_lanes) release(g, l);
  } else if (f.state == State::Barrier) {
    if (g.at_barrier && !(g.barrier == f.site))
      return error(g, at(f.site) + threads() + "1 waits here, " + std::to_string(g.at_barrier) + " wait at " + at(g.barrier));
    if (g.done) return error(g, at(f.site) + threads() + std::to_string(g.at_barrier + 1) + " wait here, " +
                                    std::to_string(g.done) + " returned");
    if (s.at_simd) return error(g, at(f.site) + lanes());
    g.barrier = f.site;
    ++s.at_barrier;
    if (++g.at_barrier < static_cast<int>(g.fibers.size())) return;
    g.at_barrier = 0;
    for (Simdgroup& t : g.simd) t.at_barrier = 0;
    for (Fiber& t : g.fibers) release(g, t);
  } else if (f.state == State::Done) {
    ++g.done, ++s.done;
    if (s.at_simd) return error(g, at(s.site) + lanes());
    if (g.at_barrier) return error(g, at(g.barrier) + threads() + std::to_string(g.at_barrier) + " wait here, " +
                                          std::to_string(g.done) + " returned");
  } else {
    release(g, f);  // a skipped barrier: a yield
  }
}

ThreadIds ids_of(Size3 grid, Size3 tpg, Size3 group, uint32_t t) {
  ThreadIds id;
  id.thread_position_in_threadgroup = {t % tpg.x, t / tpg.x % tpg.y, t / (tpg.x * tpg.y)};
  id.threadgroup_position_in_grid = group;
  id.thread_position_in_grid = {group.x * tpg.x + id.thread_position_in_threadgroup.x,
                                group.y * tpg.y + id.thread_position_in_threadgroup.y,
                                group.z * tpg.z + id.thread_position_in_threadgroup.z};
  id.threads_per_threadgroup = tpg;
  id.threadgroups_per_grid = grid;
  id.threads_per_grid = {grid.x * tpg.x, grid.y * tpg.y, grid.z * tpg.z};
  id.thread_index_in_threadgroup = t;
  id.simdgroup_index_in_threadgroup = t / kSimdWidth;
  id.thread_index_in_simdgroup = t % kSimdWidth;
  const uint32_t n = tpg.x * tpg.y * tpg.z;
  id.simdgroups_per_threadgroup = (n + kSimdWidth - 1) / kSimdWidth;
  return id;
}

void run_group(Group& g, Size3 grid, Size3 tpg, std::vector<char>& stacks) {
  const uint32_t n = tpg.x * tpg.y * tpg.z;
  g.fibers.assign(n, Fiber{});
  g.simd.assign((n + kSimdWidth - 1) / kSimdWidth, Simdgroup{});
  for (size_t s = 0; s < g.simd.size(); ++s) g.simd[s].lanes = static_cast<int>(std::min<size_t>(kSimdWidth, n - s * kSimdWidth));
  g.ready.clear();
  g.at_barrier = g.done = 0;
  g.memory.fill(0xff);
  for (uint32_t t = 0; t < n; ++t) {
    Fiber& f = g.fibers[t];
    f.ids = ids_of(grid, tpg, g.position, t);
    getcontext(&f.ctx);
    f.ctx.uc_stack = {stacks.data() + t * kStackBytes, 0, kStackBytes};
    f.ctx.uc_link = &g.scheduler;
    makecontext(&f.ctx, fiber_main, 0);
    g.ready.push_back(static_cast<int>(t));
  }
  while (!g.ready.empty() && g.error.empty()) {
    const size_t pick = g.rng() % g.ready.size();
    std::swap(g.ready[pick], g.ready.back());
    Fiber& f = g.fibers[g.ready.back()];
    g.ready.pop_back();
    g_fiber = &f;
    swapcontext(&g.scheduler, &f.ctx);
    arrived(g, f);
  }
  if (g.error.empty() && g.done != static_cast<int>(n))
    error(g, "deadlock: " + std::to_string(n - g.done) + " threads wait and none can run");
}

}  // namespace

DispatchOptions& dispatch_options() {
  static DispatchOptions options;
  return options;
}

void simd_rendezvous(const char* op, std::source_location where, LaneArgs lane, SimdCombine combine) {
  g_fiber->lane = lane;
  g_fiber->combine = combine;
  wait(State::Simd, site_of(op, where));
}

void barrier_rendezvous(std::source_location where) {
  const bool skip = static_cast<int>(where.line()) == dispatch_options().skip_barrier_line;
  wait(skip ? State::Ready : State::Barrier, site_of("threadgroup_barrier", where));
}

void* threadgroup_alloc(size_t index, size_t bytes, size_t align) {
  Group& g = *g_group;
  if (index >= g.vars.size()) g.vars.resize(index + 1, {0, 0});
  auto& [offset, size] = g.vars[index];
  if (size == 0) {
    offset = (g.used + align - 1) / align * align;
    size = bytes;
    g.used = offset + bytes;
    if (g.used > kThreadgroupBytes) {  // never resumed: no exception crosses a fiber's stack
      error(g, "threadgroup variables need " + std::to_string(g.used) + " bytes, more than " +
                   std::to_string(kThreadgroupBytes));
      swapcontext(&g_fiber->ctx, &g.scheduler);
    }
  }
  return g.memory.data() + offset;
}

void dispatch(const std::string& kernel, Size3 groups, Size3 threads, std::span<void* const> buffers) {
  const auto& all = kernels();
  const auto it = std::find_if(all.begin(), all.end(), [&](const KernelEntry& k) { return kernel == k.name; });
  if (it == all.end()) fail("metal-emulator: no kernel '", kernel, "'");
  if (static_cast<int>(buffers.size()) < it->buffers)
    fail("metal-emulator: ", kernel, " takes ", std::to_string(it->buffers), " buffers, got ",
         std::to_string(buffers.size()));
  const uint64_t n = uint64_t(threads.x) * threads.y * threads.z;
  if (n == 0 || n > kMaxThreads) fail("metal-emulator: ", kernel, ": ", std::to_string(n), " threads per threadgroup");
  std::vector<char> stacks(n * kStackBytes);
  auto g = std::make_unique<Group>();
  g->entry = &*it;
  g->buffers = buffers.data();
  g_group = g.get();
  const uint64_t seed = dispatch_options().seed;
  for (uint32_t z = 0; z < groups.z; ++z)
    for (uint32_t y = 0; y < groups.y; ++y)
      for (uint32_t x = 0; x < groups.x; ++x) {
        g->position = {x, y, z};
        g->rng.seed(seed * 0x9e3779b97f4a7c15ull + (uint64_t(z) * groups.y + y) * groups.x + x);
        run_group(*g, groups, threads, stacks);
        if (!g->error.empty()) {
          g_group = nullptr;
          throw Error(g->error);
        }
      }
  g_group = nullptr;
}

}  // namespace lily::metal_emu
