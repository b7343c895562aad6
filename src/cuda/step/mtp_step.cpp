#include "step/mtp_step.h"

#include "head/lm_head.h"
#include "norm/embedding_prefill.h"
#include "norm/rmsnorm_prefill.h"
#include "qmatmul/qmatmul_decode.h"

namespace lily::cuda {
namespace {

// ws.mtp_u [rows][H] = fc([rmsnorm(embed(tokens[r])) | rmsnorm(state[r])]) for `rows` rows.
void enqueue_fc(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const int* tokens, const float* state,
                int rows, cudaStream_t stream) {
  const int H = static_cast<int>(c.hidden_size);
  const float eps = c.rms_norm_eps;
  embedding_prefill(W.embed, tokens, rows, ws.mtp_e, stream);
  rmsnorm_prefill(ws.mtp_e, W.mtp.norm_embed, rows, H, eps, nullptr, ws.mtp_cat, stream, 2 * H);
  rmsnorm_prefill(state, W.mtp.norm_hidden, rows, H, eps, nullptr, ws.mtp_cat + H, stream, 2 * H);
  XSpec x;
  x.x = ws.mtp_cat;
  qmatmul_decode(W.mtp.fc, x, {YMode::Store, ws.mtp_u}, &ws.ctl->halt, stream, rows);
}

XSpec layer_input(const ModelConfig& c, const DeviceLayer& L, const float* u) {
  XSpec x;
  x.mode = XMode::RmsNorm;
  x.x = u;
  x.w = L.input_norm;
  x.eps = c.rms_norm_eps;
  return x;
}

}  // namespace

std::string mtp_unsupported(const ModelConfig& c, const DeviceWeights& W, int verify_rows) {
  if (!W.has_mtp) return "the checkpoint has no MTP head";
  if (verify_rows < 2) return "the CUDA executor verifies no drafts with these weights";
  const DeviceLayer& L = W.mtp.layer;
  if (!(W.mtp.fc.tiled && L.attn_in.tiled && L.attn_out.tiled && tiled(L.experts)))
    return "the MTP head's matrices are not all 4-bit group-64 at most 4096 columns (the tensor-core layout)";
  if (c.hidden_size > 8192) return "the MTP head's norms take hidden_size <= 8192";
  int dev = 0, optin = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), "cudaDeviceGetAttribute");
  for (const QMat* m : {&W.mtp.fc, &L.attn_in, &L.attn_out})
    if (qmatmul_decode_smem_bytes(*m, verify_rows) > static_cast<size_t>(optin))
      return "the MTP head's projections do not fit shared memory for " + std::to_string(verify_rows) + " rows";
  return "";
}

void enqueue_mtp_follow(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int parity,
                        const int* tokens, int rows, int skip, cudaStream_t stream) {
  const int H = static_cast<int>(c.hidden_size), n = rows - skip;
  float* state = s.mtp_hidden[parity];  // row 0: the state before this step; rows 1 .. rows: its own
  rmsnorm_prefill(ws.h, W.final_norm, rows, H, c.rms_norm_eps, nullptr, state + H, stream);
  if (n > 0) {
    enqueue_fc(c, W, ws, tokens + skip, state + static_cast<size_t>(skip) * H, n, stream);
    // *s.pos is past this step's rows now: the head's first row sits at *pos - rows - 1 + skip.
    enqueue_attention(c, W, W.mtp.layer, ws, {s.mtp_k, s.mtp_v, s.pos, skip - rows - 1},
                      layer_input(c, W.mtp.layer, ws.mtp_u), nullptr, n, stream);
  }
  check(cudaMemcpyAsync(s.mtp_hidden[1 - parity], state + static_cast<size_t>(rows) * H, H * sizeof(float),
                        cudaMemcpyDeviceToDevice, stream),
        "cudaMemcpyAsync (MTP state)");
}

void enqueue_mtp_draft(const ModelConfig& c, const DeviceWeights& W, Workspace& ws, const SessionState& s, int parity,
                       int n, int vocab_limit, cudaStream_t stream) {
  const DeviceMtp& m = W.mtp;
  const size_t H = c.hidden_size;
  for (int i = 0; i < n; ++i) {
    const float* state = i == 0 ? s.mtp_hidden[parity] : ws.mtp_out + (i - 1) * H;
    enqueue_fc(c, W, ws, ws.draft_tokens + i, state, 1, stream);
    enqueue_attention(c, W, m.layer, ws, {s.mtp_k, s.mtp_v, s.pos, i - 1}, layer_input(c, m.layer, ws.mtp_u), ws.mtp_u,
                      1, stream);
    enqueue_moe(c, m.layer, ws, ws.mtp_u, nullptr, 1, stream);
    rmsnorm_prefill(ws.mtp_u, m.norm, 1, static_cast<int>(H), c.rms_norm_eps, nullptr, ws.mtp_out + i * H, stream);
    HeadArgs h;
    h.W = W.lm_head;
    h.X.x = ws.mtp_out + i * H;
    h.logits = ws.draft_logits + static_cast<size_t>(i) * c.vocab_size;
    h.partial = ws.head_partial;
    h.counter = ws.head_counter;
    h.argmax = ws.draft_tokens + i + 1;
    h.argmax_limit = vocab_limit;
    lm_head(h, &ws.ctl->halt, stream);
  }
}

}  // namespace lily::cuda
