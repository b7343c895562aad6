#include "step/cuda_weights.h"

#include "attention/attention_decode.h"
#include "qmatmul/qmatmul_tiles.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace lily::cuda {
namespace {

int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return (1 << s) == v ? s : -1;
}

}  // namespace

const float* DeviceWeights::upload_floats(const std::vector<float>& v, const std::string& what) {
  DeviceBuffer b(v.size() * sizeof(float), what.c_str());
  check(cudaMemcpy(b.as<void>(), v.data(), b.bytes(), cudaMemcpyHostToDevice), what.c_str());
  bytes += b.bytes();
  owned_.push_back(std::move(b));
  return owned_.back().as<float>();
}

const float* DeviceWeights::upload_dense(const Dense& d, const std::string& what) { return upload_floats(d.values, what); }

Layout DeviceWeights::tiles_if_eligible(const QWeight& w) const {
  const bool ok = tensor_cores && w.bits == 4 && w.group_size == 64 && w.cols % 64 == 0 && w.cols <= 4096;
  return ok ? Layout::Tiles : Layout::Mlx;
}

QMat upload_qmat(const std::vector<QWeight>& parts, const std::string& what, Layout layout, int interleave,
                 std::vector<DeviceBuffer>& owned) {
  const QWeight& f = parts.front();
  int64_t rows = 0;
  for (const QWeight& p : parts) {
    if (p.cols != f.cols || p.bits != f.bits || p.group_size != f.group_size)
      fail("CUDA executor: ", what, " stacks matrices of different shapes or quantization (", std::to_string(p.bits),
           "-bit group ", std::to_string(p.group_size), " vs ", std::to_string(f.bits), "-bit group ",
           std::to_string(f.group_size), ")");
    rows += p.experts * p.rows;
  }
  if (f.bits != 4 && f.bits != 8) fail("CUDA executor: ", what, " is ", std::to_string(f.bits), "-bit; only 4 and 8 are supported");
  const int cpc = 128 / f.bits;
  const int gshift = log2_exact(f.group_size / cpc);
  if (f.group_size < cpc || gshift < 0 || f.cols % f.group_size != 0)
    fail("CUDA executor: ", what, " has group size ", std::to_string(f.group_size), "; need a power of two >= ",
         std::to_string(cpc));
  if (rows > (int64_t(1) << 31) / 2) fail("CUDA executor: ", what, " has too many rows");
  const size_t row_bytes = static_cast<size_t>(f.cols) * f.bits / 8, groups = f.cols / f.group_size;
  DeviceBuffer codes(rows * row_bytes, what.c_str());
  DeviceBuffer sb(rows * groups * 4, (what + " scales").c_str());
  std::vector<uint32_t> packed;
  size_t row0 = 0;
  for (const QWeight& p : parts) {
    const size_t n = static_cast<size_t>(p.experts * p.rows);
    check(cudaMemcpy(codes.as<uint8_t>() + row0 * row_bytes, p.codes, n * row_bytes, cudaMemcpyHostToDevice), what.c_str());
    packed.resize(n * groups);
    for (size_t i = 0; i < packed.size(); ++i) packed[i] = uint32_t(p.scales[i]) | (uint32_t(p.biases[i]) << 16);
    check(cudaMemcpy(sb.as<uint32_t>() + row0 * groups, packed.data(), packed.size() * 4, cudaMemcpyHostToDevice),
          what.c_str());
    row0 += n;
  }
  QMat m;
  m.rows = static_cast<int>(rows);
  m.cols = static_cast<int>(f.cols);
  m.bits = f.bits;
  m.gshift = gshift;
  if (layout != Layout::Mlx) {  // re-pack on the device, drop the MLX-order copy
    DeviceBuffer tc(tiled_code_bytes(m.rows, m.cols), what.c_str());
    DeviceBuffer ts(tiled_sb_bytes(m.rows, m.cols), (what + " scales").c_str());
    pack_tiles(codes.as<uint32_t>(), sb.as<uint32_t>(), m.rows, m.cols, layout == Layout::GateUpTiles ? interleave : 0,
               tc.as<uint4>(), ts.as<uint32_t>(), 0);
    check(cudaDeviceSynchronize(), "pack_tiles");
    codes = std::move(tc);
    sb = std::move(ts);
    m.tiled = true;
  }
  m.codes = codes.as<uint4>();
  m.sb = sb.as<uint32_t>();
  owned.push_back(std::move(codes));
  owned.push_back(std::move(sb));
  return m;
}

QMat DeviceWeights::upload_stack(const std::vector<QWeight>& parts, const std::string& what, Layout layout,
                                 int interleave) {
  const QMat m = upload_qmat(parts, what, layout, interleave, owned_);
  bytes += owned_[owned_.size() - 2].bytes() + owned_.back().bytes();
  return m;
}

DeviceWeights::DeviceWeights(const ModelWeights& w, bool tensor_cores_) : tensor_cores(tensor_cores_) {
  const ModelConfig& c = w.config;
  if (c.linear_conv_kernel_dim != 4 && c.num_linear_layers() > 0)
    fail("CUDA executor: linear_conv_kernel_dim ", std::to_string(c.linear_conv_kernel_dim), " is not supported (4)");
  embed = upload_stack({w.embed}, "embed_tokens");
  lm_head = upload_stack({w.lm_head}, "lm_head", tiles_if_eligible(w.lm_head));
  final_norm = upload_dense(w.final_norm, "norm");
  if (c.num_full_layers() > 0 || w.has_mtp) rope_inv_freq = upload_floats(lily::cuda::rope_inv_freq(c.rope_theta, c.rotary_dim()), "rope");
  for (size_t i = 0; i < w.layers.size(); ++i)
    layers.push_back(upload_layer(c, w.layers[i], "layers." + std::to_string(i) + "."));
  if (w.has_mtp) {
    has_mtp = true;
    mtp.fc = upload_stack({w.mtp.fc}, "mtp.fc", tiles_if_eligible(w.mtp.fc));
    mtp.norm_embed = upload_dense(w.mtp.pre_fc_norm_embedding, "mtp.pre_fc_norm_embedding");
    mtp.norm_hidden = upload_dense(w.mtp.pre_fc_norm_hidden, "mtp.pre_fc_norm_hidden");
    mtp.norm = upload_dense(w.mtp.norm, "mtp.norm");
    mtp.layer = upload_layer(c, w.mtp.layer, "mtp.layers.0.");
  }
}

DeviceLayer DeviceWeights::upload_layer(const ModelConfig& c, const LayerWeights& L, const std::string& p) {
  DeviceLayer d;
  d.kind = L.kind;
  d.input_norm = upload_dense(L.input_norm, p + "input_layernorm");
  d.post_norm = upload_dense(L.post_norm, p + "post_attention_layernorm");
  if (L.kind == LayerKind::Linear) {
    const GdnWeights& g = L.gdn;
    d.gdn_in = upload_stack({g.in_proj_qkv, g.in_proj_z, g.in_proj_b, g.in_proj_a}, p + "linear_attn.in_proj",
                            tiles_if_eligible(g.in_proj_qkv));
    d.gdn_out = upload_stack({g.out_proj}, p + "linear_attn.out_proj", tiles_if_eligible(g.out_proj));
    d.conv_w = upload_dense(g.conv1d, p + "linear_attn.conv1d");
    d.dt_bias = upload_dense(g.dt_bias, p + "linear_attn.dt_bias");
    std::vector<float> neg_a(g.A_log.values.size());
    for (size_t j = 0; j < neg_a.size(); ++j) neg_a[j] = static_cast<float>(-std::exp(double(g.A_log.values[j])));
    d.neg_A = upload_floats(neg_a, p + "linear_attn.A_log");
    d.gdn_norm = upload_dense(g.norm, p + "linear_attn.norm");
  } else {
    const AttnWeights& a = L.attn;
    d.attn_in = upload_stack({a.q_proj, a.k_proj, a.v_proj}, p + "self_attn.qkv_proj", tiles_if_eligible(a.q_proj));
    d.attn_out = upload_stack({a.o_proj}, p + "self_attn.o_proj", tiles_if_eligible(a.o_proj));
    d.q_norm = upload_dense(a.q_norm, p + "self_attn.q_norm");
    d.k_norm = upload_dense(a.k_norm, p + "self_attn.k_norm");
  }
  const MoeWeights& m = L.moe;
  d.router = upload_stack({m.router, m.shared_expert_gate}, p + "mlp.gate");
  std::vector<QWeight> gate_up;
  gate_up.reserve(2 * m.gate_proj.experts);
  for (int64_t e = 0; e < m.gate_proj.experts; ++e) {
    gate_up.push_back(m.gate_proj.expert(e));
    gate_up.push_back(m.up_proj.expert(e));
  }
  // Experts go to the tensor cores only all together (the MoE kernels take one path).
  const int I = static_cast<int>(c.moe_intermediate_size), Is = static_cast<int>(c.shared_expert_intermediate_size);
  const int pairs = static_cast<int>(c.num_experts_per_tok) * (I / 64) + Is / 64;
  const bool tile = tiles_if_eligible(m.gate_proj) == Layout::Tiles && tiles_if_eligible(m.shared_gate_proj) == Layout::Tiles &&
                    tiles_if_eligible(m.down_proj) == Layout::Tiles && tiles_if_eligible(m.shared_down_proj) == Layout::Tiles &&
                    c.hidden_size % 16 == 0 && pairs <= 80;
  const Layout gu = tile ? Layout::GateUpTiles : Layout::Mlx, rows = tile ? Layout::Tiles : Layout::Mlx;
  d.experts.gate_up = upload_stack(gate_up, p + "mlp.experts.gate_up", gu, I);
  d.experts.down = upload_stack({m.down_proj}, p + "mlp.experts.down_proj", rows);
  d.experts.shared_gate_up =
      upload_stack({m.shared_gate_proj, m.shared_up_proj}, p + "mlp.shared_expert.gate_up", gu, Is);
  d.experts.shared_down = upload_stack({m.shared_down_proj}, p + "mlp.shared_expert.down_proj", rows);
  d.experts.n_experts = static_cast<int>(c.num_experts);
  d.experts.inter = static_cast<int>(c.moe_intermediate_size);
  d.experts.shared_inter = static_cast<int>(c.shared_expert_intermediate_size);
  return d;
}

}  // namespace lily::cuda
