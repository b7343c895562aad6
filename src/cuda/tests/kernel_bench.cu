// Times each decode kernel at Qwen3.6-35B-A3B sizes: a graph of back-to-back launches
// (rotating over enough weight/state copies that L2 cannot hold them) is replayed and
// timed with events. Prints µs per launch and GB/s against the measured copy rate.
#include <functional>

#include "attention_decode.h"
#include "gdn_decode.h"
#include "gemv.h"
#include "lm_head.h"
#include "moe_experts.h"
#include "moe_router.h"
#include "test_util.h"

namespace lily::cuda::test {
namespace {

// Average µs per launch of `enqueue(i)` for i = 0..n-1, captured into one graph.
cudaStream_t g_stream;  // the stream every timed launch goes to

double time_graph(int n, const std::function<void(int)>& enqueue, int replays = 10) {
  cudaStream_t s = g_stream;
  cudaGraph_t g;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < n; ++i) enqueue(i);
  CK(cudaStreamEndCapture(s, &g));
  cudaGraphExec_t e;
  CK(cudaGraphInstantiate(&e, g, 0));
  CK(cudaGraphLaunch(e, s));  // warm-up
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  CK(cudaEventRecord(a, s));
  for (int r = 0; r < replays; ++r) CK(cudaGraphLaunch(e, s));
  CK(cudaEventRecord(b, s));
  CK(cudaEventSynchronize(b));
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, a, b));
  CK(cudaGraphExecDestroy(e));
  CK(cudaGraphDestroy(g));
  return 1000.0 * ms / (n * replays);
}

void row(const char* op, double us, double bytes, double copy_gbs) {
  const double gbs = bytes / us * 1e-3;
  std::printf("| %-44s | %8.2f | %7.0f | %5.0f%% |\n", op, us, gbs, 100 * gbs / copy_gbs);
}

double copy_rate() {
  const size_t n = size_t(1) << 30;
  void *a, *b;
  CK(cudaMalloc(&a, n));
  CK(cudaMalloc(&b, n));
  CK(cudaMemset(a, 1, n));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(e0));
  for (int i = 0; i < 5; ++i) CK(cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice));
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  cudaFree(a), cudaFree(b);
  return 2.0 * n * 5 / (ms * 1e-3) * 1e-9;
}

double qbytes(const HostQ& q) { return double(q.rows) * q.cols * q.bits / 8 + double(q.rows) * (q.cols / q.group) * 4; }

void bench_gemv(const char* op, int rows, int cols, XMode mode, int copies, double copy_gbs, bool tiled = true) {
  Rng r(rows + cols);
  std::vector<QMat> W;
  HostQ q = make_q(rows, cols, 4, 64, r, false);
  for (int i = 0; i < copies; ++i) W.push_back(upload_as(q, tiled));
  float* x = to_dev(randn(cols, r));
  float* w = to_dev(randn(cols, r));
  float* z = to_dev(randn(cols, r));
  float* y = dev_alloc<float>(rows, false);
  XSpec X;
  X.mode = mode;
  X.x = x, X.w = w, X.z = z, X.head_dim = 128;
  const double us = time_graph(4 * copies, [&](int i) { gemv(W[i % copies], X, {YMode::Add, y}, nullptr, g_stream); });
  row(op, us, qbytes(q), copy_gbs);
  for (auto& m : W) free_q(m);
  cudaFree(x), cudaFree(w), cudaFree(z), cudaFree(y);
}

}  // namespace

void run_kernel_bench() {
  const double copy_gbs = copy_rate();
  std::printf("\ndevice-to-device copy: %.0f GB/s (read + write)\n\n", copy_gbs);
  std::printf("| %-44s | %8s | %7s | %6s |\n", "kernel (35B-A3B shapes)", "us", "GB/s", "copy");
  std::printf("|---|---|---|---|\n");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  g_stream = s;
  bench_gemv("gemv GDN in_proj 12352x2048 +rmsnorm (fp32 dot)", 12352, 2048, XMode::RmsNorm, 8, copy_gbs, false);
  bench_gemv("gemv GDN in_proj 12352x2048 +rmsnorm", 12352, 2048, XMode::RmsNorm, 8, copy_gbs);
  bench_gemv("gemv attn qkv 9216x2048 +rmsnorm", 9216, 2048, XMode::RmsNorm, 8, copy_gbs);
  bench_gemv("gemv out_proj 2048x4096 +headnorm gate +res", 2048, 4096, XMode::HeadNormGate, 16, copy_gbs);
  bench_gemv("gemv o_proj 2048x4096 +res", 2048, 4096, XMode::Plain, 16, copy_gbs);

  Rng r(7);
  {  // lm_head + greedy argmax
    HostQ q = make_q(248320, 2048, 4, 64, r, false);
    DecodeCtl* ctl = dev_alloc<DecodeCtl>(1, false);
    DecodeCtl c;
    c.max_tokens = c.max_context = 1 << 30;
    CK(cudaMemcpy(ctl, &c, sizeof c, cudaMemcpyHostToDevice));
    HeadArgs a;
    a.W = upload_q_tiled(q);
    a.X.mode = XMode::RmsNorm;
    a.X.x = to_dev(randn(2048, r));
    a.X.w = to_dev(randn(2048, r));
    a.logits = dev_alloc<float>(248320);
    a.select = HeadSelect::Greedy;
    a.ctl = ctl;
    a.partial = dev_alloc<float2>(lm_head_max_blocks());
    a.counter = dev_alloc<unsigned>(1, false);
    int* pos = dev_alloc<int>(1, false);
    a.sink = {ctl, pos, dev_alloc<int>(1), dev_alloc<int>(1), dev_alloc<int>(248320, false), dev_alloc<unsigned char>(248320, false)};
    const double us = time_graph(4, [&](int) { lm_head(a, nullptr, s); });
    row("lm_head 248320x2048 +rmsnorm +argmax", us, qbytes(q), copy_gbs);
    free_q(a.W);
  }
  {  // MoE: router + gate/up + down, 16 inputs so the chosen experts change
    const int H = 2048, E = 256, k = 8, I = 512;
    HostQ router = make_q(E + 1, H, 8, 64, r, false), gu = make_q(E * 2 * I, H, 4, 64, r, false),
          down = make_q(E * H, I, 4, 64, r, false);
    HostQ sgu = make_q(2 * I, H, 4, 64, r, false), sdown = make_q(H, I, 4, 64, r, false);
    MoeExperts m{upload_q_tiled(gu, I), upload_q_tiled(down), upload_q_tiled(sgu, I), upload_q_tiled(sdown), E, I, I};
    QMat R = upload_q(router);
    std::vector<float*> hs;
    for (int i = 0; i < 16; ++i) hs.push_back(to_dev(randn(H, r)));
    float* w = to_dev(randn(H, r));
    RouterOut out{dev_alloc<float>(E + 1), dev_alloc<int>(k), dev_alloc<float>(k), dev_alloc<float>(1), dev_alloc<unsigned>(1, false)};
    float* act = dev_alloc<float>(k * I + I);
    auto X = [&](int i) {
      XSpec x;
      x.mode = XMode::RmsNorm;
      x.x = hs[i % 16];
      x.w = w;
      return x;
    };
    const double expert_bytes = (qbytes(gu) + qbytes(down)) / E * k + qbytes(sgu) + qbytes(sdown);
    double us = time_graph(16, [&](int i) { moe_router(R, X(i), E, k, true, out, nullptr, s); });
    row("moe router 257x2048 8-bit +rmsnorm +top-8", us, qbytes(router), copy_gbs);
    us = time_graph(16, [&](int i) {
      moe_router(R, X(i), E, k, true, out, nullptr, s);
      moe_gate_up(m, X(i), out.ids, k, act, nullptr, s);
      moe_down(m, act, out.ids, out.weights, out.shared_gate, k, hs[i % 16], nullptr, nullptr, s);
    });
    row("moe block (router, gate/up, down): 3 launches", us, qbytes(router) + expert_bytes, copy_gbs);
  }
  {  // Gated DeltaNet, 16 state copies
    const int Hk = 16, Hv = 32, D = 128, conv = 2 * Hk * D + Hv * D;
    GdnArgs a;
    a.proj = to_dev(randn(conv + Hv * D + 2 * Hv, r));
    a.conv_w = to_dev(randn(conv * 4, r, 0.3));
    a.ring = dev_alloc<float>(4 * conv, false);
    a.dt_bias = to_dev(randn(Hv, r));
    a.neg_A = to_dev(std::vector<float>(Hv, -1.0f));
    a.out = dev_alloc<float>(Hv * D);
    a.pos = dev_alloc<int>(1, false);
    a.Hk = Hk, a.Hv = Hv, a.Dk = D, a.Dv = D;
    std::vector<float*> st;
    for (int i = 0; i < 17; ++i) st.push_back(dev_alloc<float>(size_t(Hv) * D * D, false));
    const double us = time_graph(16, [&](int i) {
      GdnArgs b = a;
      b.state_in = st[i];
      b.state_out = st[i + 1];
      gdn_decode(b, nullptr, s);
    });
    row("gdn_decode 32 heads 128x128 (state in + out)", us, 2.0 * Hv * D * D * 4, copy_gbs);
  }
  const int attn_cases[][2] = {{1024, 64}, {4096, 256}, {4096, 128}, {4096, 64}, {4096, 32}, {32768, 64}, {131072, 64}};
  for (const auto& ac : attn_cases) {  // attention at context L with min_chunk keys per split
    const int L = ac[0], Hq = 16, Hkv = 2, D = 256, copies = L <= 4096 ? 8 : 1;
    AttnArgs a;
    a.qkv = to_dev(randn(Hq * 2 * D + 2 * Hkv * D, r));
    a.q_norm = to_dev(std::vector<float>(D, 1.0f));
    a.k_norm = a.q_norm;
    a.partial = dev_alloc<float>(attention_partial_floats(Hq, Hkv, D, 64));
    a.out = dev_alloc<float>(Hq * D);
    a.pos = to_dev(std::vector<int>{L - 1});
    a.Hq = Hq, a.Hkv = Hkv, a.D = D, a.rot_dim = 64;
    a.inv_freq = to_dev(rope_inv_freq(1e7, 64));
    a.min_chunk = ac[1];
    std::vector<uint16_t*> kc, vc;
    const size_t n = size_t(L) * Hkv * D;
    for (int i = 0; i < copies; ++i) {
      kc.push_back(dev_alloc<uint16_t>(n, false));
      vc.push_back(dev_alloc<uint16_t>(n, false));
    }
    const double us = time_graph(2 * copies, [&](int i) {
      AttnArgs b = a;
      b.k_cache = kc[i % copies];
      b.v_cache = vc[i % copies];
      attention_decode(b, nullptr, s);
    });
    char name[80];
    std::snprintf(name, sizeof name, "attention_decode context %d, min_chunk %d", L, ac[1]);
    row(name, us, 4.0 * n, copy_gbs);  // two launches (split + merge)
    for (int i = 0; i < copies; ++i) cudaFree(kc[i]), cudaFree(vc[i]);
  }
}

}  // namespace lily::cuda::test
