// The model's weights on the device, re-packed once at load into what the kernels read:
// projections that read the same input are stacked into one matrix (GDN qkv|z|b|a,
// attention q|k|v, router|shared-expert gate, shared gate|up), each routed expert's gate
// and up rows sit together, scales and biases are interleaved (one 4-byte load per
// group), and small float tensors are fp32.
#pragma once
#include <vector>

#include "common/device_buffer.h"
#include "common/kernel_types.h"
#include "moe/moe_experts_decode.h"
#include "weights.h"

namespace lily::cuda {

struct DeviceLayer {
  LayerKind kind = LayerKind::Linear;
  const float* input_norm = nullptr;  // [H]
  const float* post_norm = nullptr;   // [H]
  // Gated DeltaNet
  QMat gdn_in;                    // [conv_dim + Hv*Dv + 2*Hv, H]: q|k|v, z, b, a
  QMat gdn_out;                   // [H, Hv*Dv]
  const float* conv_w = nullptr;  // [conv_dim][4]
  const float* dt_bias = nullptr;  // [Hv]
  const float* neg_A = nullptr;   // [Hv] = -exp(A_log)
  const float* gdn_norm = nullptr;  // [Dv]
  // Attention
  QMat attn_in;                   // [Hq*2D + 2*Hkv*D, H]: q|gate, k, v
  QMat attn_out;                  // [H, Hq*D]
  const float* q_norm = nullptr;  // [D]
  const float* k_norm = nullptr;  // [D]
  // MoE
  QMat router;                    // [E + 1, H]: router rows, shared-expert gate row
  MoeExperts experts;
};

// How a matrix is laid out on the device: MLX order (fp32 dot, any bits/group), or the
// tensor-core tile order (4-bit, group 64), optionally with expert gate/up rows interleaved.
enum class Layout { Mlx, Tiles, GateUpTiles };

// The rows of `parts` (each possibly a stack of experts) as one matrix on the device, its
// buffers appended to `owned`. interleave: GateUpTiles' rows per expert half.
QMat upload_qmat(const std::vector<QWeight>& parts, const std::string& what, Layout layout, int interleave,
                 std::vector<DeviceBuffer>& owned);

// The MTP head (MODEL.md §7): fc over [rmsnorm(embed(next)) | rmsnorm(hidden)], one
// full-attention decoder layer with its own KV cache, then norm before the shared lm_head.
struct DeviceMtp {
  QMat fc;                              // [H, 2H]: the embedding half of the input first
  const float* norm_embed = nullptr;    // [H] pre_fc_norm_embedding
  const float* norm_hidden = nullptr;   // [H] pre_fc_norm_hidden
  const float* norm = nullptr;          // [H]
  DeviceLayer layer;                    // kind Full
};

class DeviceWeights {
 public:
  DeviceWeights(const ModelWeights& w, bool tensor_cores);
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;

  QMat embed, lm_head;
  const float* final_norm = nullptr;
  const float* rope_inv_freq = nullptr;  // [rotary_dim / 2]
  std::vector<DeviceLayer> layers;
  bool has_mtp = false;  // the checkpoint's MTP head is in mtp
  DeviceMtp mtp;
  size_t bytes = 0;  // device memory held
  bool tensor_cores = true;  // 4-bit group-64 matrices tiled for the tensor-core GEMV (LILY_CUDA_TENSOR_CORES)

 private:
  const float* upload_dense(const Dense& d, const std::string& what);
  const float* upload_floats(const std::vector<float>& v, const std::string& what);
  QMat upload_stack(const std::vector<QWeight>& parts, const std::string& what, Layout layout = Layout::Mlx,
                    int interleave = 0);
  Layout tiles_if_eligible(const QWeight& w) const;
  DeviceLayer upload_layer(const ModelConfig& c, const LayerWeights& L, const std::string& prefix);
  std::vector<DeviceBuffer> owned_;
};

}  // namespace lily::cuda
