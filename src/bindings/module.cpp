#include "bindings.h"

NB_MODULE(_lily, m) {
  m.doc() = "lily's C++ core: weights, sessions and the CPU/CUDA executors";
  lily::register_engine(m);
  lily::register_quant(m);
  lily::register_ops(m);
  lily::register_checkpoint(m);
  lily::register_metal_emulator(m);
}
