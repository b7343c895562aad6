// Argument checks shared by the CPU ops; failures throw lily::Error naming the op.
#pragma once
#include <string>

#include "error.h"
#include "weights.h"

namespace lily::cpu {

template <typename... Args>
inline void check(bool ok, const char* op, const Args&... why) {
  if (!ok) fail(op, ": ", why...);
}

inline std::string str(int64_t v) { return std::to_string(v); }

// A quantized matrix the CPU kernels can read: data present, MLX's bit widths that divide
// 32 and MLX's group sizes, groups tiling each row.
inline void check_qweight(const QWeight& w, const char* op, const char* name) {
  check(w.codes && w.scales && w.biases, op, name, " has no data");
  check(w.bits == 2 || w.bits == 4 || w.bits == 8, op, name, " has ", str(w.bits), " bits; supported: 2, 4, 8");
  check(w.group_size == 32 || w.group_size == 64 || w.group_size == 128, op, name, " has group size ",
        str(w.group_size), "; supported: 32, 64, 128");
  check(w.rows > 0 && w.cols > 0 && w.cols % w.group_size == 0, op, name, " is [", str(w.rows), ", ", str(w.cols),
        "]; cols must be a positive multiple of the group size ", str(w.group_size));
}

// The MoE block's matrices against c's shapes (moe_layer.cpp; every backend's moe_block op
// checks them first), failing with the matrix's name and its shape against the expected one.
void check_moe_weights(const MoeWeights& w, const ModelConfig& c);

}  // namespace lily::cpu
