// Re-packs an MLX 4-bit, group-64 matrix (already on the device) into the tensor-core
// tile order of qmatmul_decode_mma.cuh. With interleave I > 0 the rows are stacks of [I gate rows;
// I up rows] per expert and each 16-row block gets 8 gate rows then the 8 matching up
// rows, so one block yields SiLU(gate) * up for 8 outputs.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace lily::cuda {

// codes: [rows][cols/8] uint32; sb: [rows][cols/64] (bf16 scale | bias << 16).
// out_codes: [ceil(rows/16)][cols/64][32] uint4; out_sb: [ceil(rows/16)][cols/64][16] uint32.
void pack_tiles(const uint32_t* codes, const uint32_t* sb, int rows, int cols, int interleave, uint4* out_codes,
                uint32_t* out_sb, cudaStream_t stream);

inline size_t tiled_code_bytes(int rows, int cols) { return static_cast<size_t>((rows + 15) / 16) * (cols / 64) * 512; }
inline size_t tiled_sb_bytes(int rows, int cols) { return static_cast<size_t>((rows + 15) / 16) * (cols / 64) * 64; }

}  // namespace lily::cuda
