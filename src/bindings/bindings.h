// Registration functions of the _lily extension, one per binding file.
#pragma once
#include <nanobind/nanobind.h>

namespace lily {
void register_engine(nanobind::module_& m);      // engine_bindings.cpp: Engine, Session, streams, convert
void register_quant(nanobind::module_& m);       // quant_bindings.cpp: quantize / dequantize
void register_ops(nanobind::module_& m);         // ops_bindings.cpp: CPU ops for tests (submodule "ops")
void register_checkpoint(nanobind::module_& m);  // checkpoint_bindings.cpp: checkpoint names, safetensors writer
void register_metal_emulator(nanobind::module_& m);  // metal_emulator_bindings.cpp: the MSL emulator (submodule)
}  // namespace lily
