// lily._lily.metal_emulator: the MSL emulator (src/metal/emulator, docs/metal.md) for tests:
// its kernels, its scheduler's knobs, and a dispatch of any kernel on numpy buffers (the
// test-only kernels of src/metal/emulator/tests have no op).
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "bindings.h"

#ifdef LILY_HAS_METAL_EMULATOR
#include "emulator/runtime.h"

namespace nb = nanobind;

namespace lily {

void register_metal_emulator(nb::module_& m) {
  using namespace metal_emu;
  nb::module_ e = m.def_submodule("metal_emulator", "the MSL emulator: Metal kernels compiled as C++, run as fibers");
  e.def("kernels", [] {
    std::vector<std::tuple<std::string, std::string>> r;
    for (const KernelEntry& k : kernels()) r.emplace_back(k.name, k.file);
    return r;
  }, "(name, .metal file) of every kernel the emulator has");
  e.def("dispatch_options", [](uint64_t seed, int skip_barrier_line) {
    dispatch_options() = {seed, skip_barrier_line};
  }, nb::arg("seed") = 0, nb::arg("skip_barrier_line") = 0,
     "for every later dispatch: the seed of the fiber order, and a threadgroup_barrier source line to skip (0: none)");
  using Dims = std::tuple<uint32_t, uint32_t, uint32_t>;
  e.def("dispatch", [](const std::string& kernel, Dims groups, Dims threads,
                       std::vector<nb::ndarray<nb::c_contig, nb::device::cpu>> buffers) {
    std::vector<void*> b;
    for (auto& a : buffers) b.push_back(a.data());
    nb::gil_scoped_release nogil;
    dispatch(kernel, {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)},
             {std::get<0>(threads), std::get<1>(threads), std::get<2>(threads)}, b);
  }, nb::arg("kernel"), nb::arg("groups"), nb::arg("threads"), nb::arg("buffers"),
     "runs kernel over groups x threads; buffers[k] is its [[buffer(k)]] (numpy arrays, written in place)");
}

}  // namespace lily
#else
void lily::register_metal_emulator(nanobind::module_&) {}
#endif
