// Process-wide launch settings of the CUDA kernels, set by each CUDA executor from its
// options (options.h): the last executor made decides.
#pragma once

namespace lily::cuda {

// Whether kernels are launched with programmatic stream serialization (LILY_CUDA_PDL).
bool pdl_enabled();
void set_pdl_enabled(bool on);

}  // namespace lily::cuda
