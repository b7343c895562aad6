// attention: causal GQA attention over the cache (contract: src/cpp/ops/attention.h) for
// decode and short chunks; fp32 throughout. For token t (position pos0 + t) and query head h
// of KV head h' = h / G, G = Hq / Hkv:
//   out[t, h] = sum_j softmax_j(scale q[t, h] . k[j, h']) v[j, h'],  j <= pos0 + t
// A threadgroup owns one token and one KV head, grid (T, Hkv); its G simdgroups are the query
// heads of that KV head, so each K/V row is read from device memory once for all G of them.
// Keys go BK at a time through threadgroup memory, an online softmax (running max m and sum l,
// the output rescaled by exp(m_old - m_new)) carried across blocks in registers.
#include <metal_stdlib>
using namespace metal;

// DMAX: the instance's bound on D. A block holds BK = 2048 / DMAX keys, LPK = 32 / BK lanes a
// key: lane = key * LPK + part scores key j0 + key over the float4 chunks part, part + LPK, ..
// of D, and the LPK partial dots are joined by log2(LPK) simd_shuffle_xor. For the output the
// lanes split D instead: lane holds chunks lane, lane + 32, .. of acc.
// ks, vs: a block's K, V rows [BK][DMAX + 4] (padded against bank conflicts); ps: the block's
// softmax weights, [simdgroup][BK].
template <uint DMAX>
void attention_block_scan(device const float* q, device const float* k, device const float* v, device float* out,
                          uint pos0, uint Hq, uint Hkv, uint D, float scale, threadgroup float* ks,
                          threadgroup float* vs, threadgroup float* ps, uint2 tg, uint sg, uint lane, uint tid,
                          uint tpg) {
  constexpr uint BK = 2048 / DMAX, LPK = 32 / BK, LD = DMAX + 4;
  constexpr uint QC = DMAX / 4 / LPK;      // q chunks a lane holds for its key's partial dot
  constexpr uint AC = (DMAX + 127) / 128;  // output chunks a lane holds
  const uint t = tg.x, hk = tg.y, h = hk * (Hq / Hkv) + sg, chunks = D / 4;
  const uint key = lane / LPK, part = lane % LPK, L = pos0 + t + 1;  // keys 0 .. L-1 are visible
  const size_t row = (size_t(t) * Hq + h) * D;

  float qr[4 * QC];  // scale * q, the chunks of this lane's part
  for (uint i = 0; i < QC; ++i) {
    const uint c = part + LPK * i;
    for (uint e = 0; e < 4; ++e) qr[4 * i + e] = c < chunks ? scale * q[row + 4 * c + e] : 0.0f;
  }
  float acc[4 * AC];
  for (uint e = 0; e < 4 * AC; ++e) acc[e] = 0.0f;
  float m = -INFINITY, l = 0.0f;

  for (uint j0 = 0; j0 < L; j0 += BK) {
    const uint n = min(BK, L - j0);
    for (uint e = tid; e < n * D; e += tpg) {  // coalesced: rows j0 .. j0+n-1 of KV head hk
      const uint r = e / D, i = e % D;
      const size_t src = (size_t(j0 + r) * Hkv + hk) * D + i;
      ks[r * LD + i] = k[src];
      vs[r * LD + i] = v[src];
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    float s = 0.0f;
    for (uint i = 0; i < QC; ++i) {
      const uint c = part + LPK * i;
      if (c < chunks)
        for (uint e = 0; e < 4; ++e) s = fma(qr[4 * i + e], ks[key * LD + 4 * c + e], s);
    }
    for (ushort o = 1; o < LPK; o *= 2) s += simd_shuffle_xor(s, o);
    s = key < n ? s : -INFINITY;  // rows past n are stale
    // Online softmax: the block's max joins the running one, the old sum and output rescale.
    const float m_new = max(m, simd_max(s));
    const float alpha = exp(m - m_new), p = exp(s - m_new);
    l = l * alpha + simd_sum(part == 0 ? p : 0.0f);
    m = m_new;
    if (part == 0) ps[sg * BK + key] = p;
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (uint i = 0; i < AC; ++i) {
      const uint c = lane + 32 * i;
      if (c < chunks)
        for (uint e = 0; e < 4; ++e) {
          float a = acc[4 * i + e] * alpha;
          for (uint j = 0; j < n; ++j) a = fma(ps[sg * BK + j], vs[j * LD + 4 * c + e], a);
          acc[4 * i + e] = a;
        }
    }
    // Every simdgroup is done with this block before the next one overwrites ks, vs and ps.
    if (j0 + BK < L) threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  const float inv = 1.0f / l;
  for (uint i = 0; i < AC; ++i) {
    const uint c = lane + 32 * i;
    if (c < chunks)
      for (uint e = 0; e < 4; ++e) out[row + 4 * c + e] = acc[4 * i + e] * inv;
  }
}

// One instance per D bound (metal_ops picks the smallest): D <= 64, 128, 256; G = Hq / Hkv
// simdgroups a threadgroup, up to 32.
kernel void attention_d64(device const float* q [[buffer(0)]],
                          device const float* k [[buffer(1)]],
                          device const float* v [[buffer(2)]],
                          device float* out [[buffer(3)]],
                          constant uint& pos0 [[buffer(4)]],
                          constant uint& Hq [[buffer(5)]],
                          constant uint& Hkv [[buffer(6)]],
                          constant uint& D [[buffer(7)]],
                          constant float& scale [[buffer(8)]],
                          uint2 tg [[threadgroup_position_in_grid]],
                          uint sg [[simdgroup_index_in_threadgroup]],
                          uint lane [[thread_index_in_simdgroup]],
                          uint tid [[thread_index_in_threadgroup]],
                          uint tpg [[threads_per_threadgroup]]) {
  threadgroup float ks[32 * 68];
  threadgroup float vs[32 * 68];
  threadgroup float ps[32 * 32];
  attention_block_scan<64>(q, k, v, out, pos0, Hq, Hkv, D, scale, ks, vs, ps, tg, sg, lane, tid, tpg);
}

kernel void attention_d128(device const float* q [[buffer(0)]],
                           device const float* k [[buffer(1)]],
                           device const float* v [[buffer(2)]],
                           device float* out [[buffer(3)]],
                           constant uint& pos0 [[buffer(4)]],
                           constant uint& Hq [[buffer(5)]],
                           constant uint& Hkv [[buffer(6)]],
                           constant uint& D [[buffer(7)]],
                           constant float& scale [[buffer(8)]],
                           uint2 tg [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint tpg [[threads_per_threadgroup]]) {
  threadgroup float ks[16 * 132];
  threadgroup float vs[16 * 132];
  threadgroup float ps[32 * 16];
  attention_block_scan<128>(q, k, v, out, pos0, Hq, Hkv, D, scale, ks, vs, ps, tg, sg, lane, tid, tpg);
}

kernel void attention_d256(device const float* q [[buffer(0)]],
                           device const float* k [[buffer(1)]],
                           device const float* v [[buffer(2)]],
                           device float* out [[buffer(3)]],
                           constant uint& pos0 [[buffer(4)]],
                           constant uint& Hq [[buffer(5)]],
                           constant uint& Hkv [[buffer(6)]],
                           constant uint& D [[buffer(7)]],
                           constant float& scale [[buffer(8)]],
                           uint2 tg [[threadgroup_position_in_grid]],
                           uint sg [[simdgroup_index_in_threadgroup]],
                           uint lane [[thread_index_in_simdgroup]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint tpg [[threads_per_threadgroup]]) {
  threadgroup float ks[8 * 260];
  threadgroup float vs[8 * 260];
  threadgroup float ps[32 * 8];
  attention_block_scan<256>(q, k, v, out, pos0, Hq, Hkv, D, scale, ks, vs, ps, tg, sg, lane, tid, tpg);
}
