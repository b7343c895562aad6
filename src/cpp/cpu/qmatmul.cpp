// y[T, N] = x[T, K] @ W^T for an MLX affine-quantized W [N, K].
//
// The work is a loop over blocks of kRowBlock weight rows (of one product, or of a batch
// of them: qmatmul_batch); a thread takes a range of blocks. Per block it dequantizes the
// rows (w = scale*q + bias, from the bf16 scales/biases) into a small buffer and dots
// them with a tile of kTokenTile input rows, so both stay in cache while they are reused:
// per tile the dequantization costs N*K against the tile's kTokenTile*N*K multiply-adds.
//
// Lane order. A group of g values is stored as W = g*bits/32 words, word j holding
// elements P*j + n (n < P = 32/bits) in its bit fields. Unpacking bit field n of all W
// words at once is one vector shift-and-mask, and yields the group in the order
// n*W + j. The weights are kept in that order and each input row is permuted the same
// way (xp[n*W + j] = x[P*j + n] within a group): a dot product is indifferent to the
// order of its terms, and this makes the dequantization a few vector ops per 16 values.
//
// Every output is one fp32 dot of a full row, so the result does not depend on T, the
// tiling or the thread count.
#include <algorithm>
#include <span>
#include <vector>

#include "bf16.h"
#include "check.h"
#include "ops.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {
namespace {

constexpr int64_t kRowBlock = 16;   // weight rows per block: 4 calls of dot4
constexpr int64_t kTokenTile = 32;  // input rows swept per dequantized block

// One weight row into the group lane order described above. The group shape is a
// template argument so the inner loop is a fixed run of vector lanes.
template <int bits, int group_size>
void dequantize_row_lanes(const uint32_t* codes, const uint16_t* scales, const uint16_t* biases, int64_t cols,
                          float* out) {
  constexpr int per_word = 32 / bits, words = group_size / per_word;
  constexpr uint32_t mask = (1u << bits) - 1;
  for (int64_t g = 0; g < cols / group_size; ++g) {
    const float s = bf16_to_float(scales[g]), b = bf16_to_float(biases[g]);
    const uint32_t* wg = codes + g * words;
    float* og = out + g * group_size;
    for (int n = 0; n < per_word; ++n)
      for (int j = 0; j < words; ++j) og[n * words + j] = s * static_cast<float>((wg[j] >> (n * bits)) & mask) + b;
  }
}

template <int bits>
void dequantize_row_bits(const uint32_t* codes, const uint16_t* scales, const uint16_t* biases, int64_t cols,
                         int group_size, float* out) {
  switch (group_size) {
    case 32: return dequantize_row_lanes<bits, 32>(codes, scales, biases, cols, out);
    case 64: return dequantize_row_lanes<bits, 64>(codes, scales, biases, cols, out);
    case 128: return dequantize_row_lanes<bits, 128>(codes, scales, biases, cols, out);
    default: fail("qmatmul: unsupported group size ", str(group_size));
  }
}

void dequantize_row(const QWeight& w, int64_t row, float* out) {
  const uint32_t* codes = w.codes + row * w.words_per_row();
  const uint16_t* scales = w.scales + row * w.groups_per_row();
  const uint16_t* biases = w.biases + row * w.groups_per_row();
  switch (w.bits) {
    case 2: return dequantize_row_bits<2>(codes, scales, biases, w.cols, w.group_size, out);
    case 4: return dequantize_row_bits<4>(codes, scales, biases, w.cols, w.group_size, out);
    case 8: return dequantize_row_bits<8>(codes, scales, biases, w.cols, w.group_size, out);
    default: fail("qmatmul: unsupported bits ", str(w.bits));
  }
}

// One input row into the same lane order.
void permute_input_row(const float* x, int64_t cols, int group_size, int bits, float* out) {
  const int per_word = 32 / bits, words = group_size / per_word;
  for (int64_t g0 = 0; g0 < cols; g0 += group_size)
    for (int n = 0; n < per_word; ++n)
      for (int j = 0; j < words; ++j) out[g0 + n * words + j] = x[g0 + per_word * j + n];
}

// Row blocks [b0, b1) of one product. Per-thread buffers, kept between calls: a fresh
// 100+ KB allocation per call would cost page faults comparable to a decode-sized product.
void qmatmul_blocks(const QMatmul& p, int64_t b0, int64_t b1) {
  const QWeight& w = p.w;
  const int64_t N = w.rows, K = w.cols;
  thread_local std::vector<float> rows, xp;
  rows.resize(kRowBlock * K);
  xp.resize(std::min(p.T, kTokenTile) * K);
  for (int64_t t0 = 0; t0 < p.T; t0 += kTokenTile) {
    const int64_t nt = std::min(kTokenTile, p.T - t0);
    for (int64_t t = 0; t < nt; ++t)
      permute_input_row(p.x + (t0 + t) * K, K, w.group_size, w.bits, xp.data() + t * K);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRowBlock, nr = std::min(kRowBlock, N - n0);
      for (int64_t r = 0; r < nr; ++r) dequantize_row(w, n0 + r, rows.data() + r * K);
      // The last block may end inside a group of four rows: pad it with zero rows.
      const int64_t padded = (nr + 3) / 4 * 4;
      std::fill(rows.begin() + nr * K, rows.begin() + padded * K, 0.0f);
      for (int64_t t = 0; t < nt; ++t) {
        float* yt = p.y + (t0 + t) * N + n0;
        for (int64_t r = 0; r < nr; r += 4) {
          float out[4];
          dot4(xp.data() + t * K, rows.data() + r * K, K, out);
          std::copy(out, out + std::min<int64_t>(4, nr - r), yt + r);
        }
      }
    }
  }
}

}  // namespace

void qmatmul_batch(std::span<const QMatmul> products) {
  // first[i]: the index of product i's first row block in the loop over all of them.
  std::vector<int64_t> first(products.size() + 1, 0);
  int64_t work = 0;
  for (size_t i = 0; i < products.size(); ++i) {
    const QMatmul& p = products[i];
    check_qweight(p.w, "qmatmul", "the weight");
    check(p.w.experts == 1, "qmatmul", "the weight is a stack of ", str(p.w.experts), " matrices; pass one expert");
    check(p.T >= 0 && (p.T == 0 || (p.x && p.y)), "qmatmul", "missing input or output for ", str(p.T), " rows");
    const int64_t blocks = p.T == 0 ? 0 : (p.w.rows + kRowBlock - 1) / kRowBlock;
    first[i + 1] = first[i] + blocks;
    // A block: its rows dequantized once per token tile, then dotted with every token.
    work += blocks * kRowBlock * p.w.cols * (p.T + (p.T + kTokenTile - 1) / kTokenTile);
  }
  const int64_t blocks = first.back();
  if (blocks == 0) return;
  parallel_for(blocks, work / blocks, [&](int64_t b0, int64_t b1) {
    size_t i = std::upper_bound(first.begin(), first.end(), b0) - first.begin() - 1;
    for (int64_t b = b0; b < b1; ++i) {
      const int64_t end = std::min(b1, first[i + 1]);
      if (end > b) qmatmul_blocks(products[i], b - first[i], end - first[i]);
      b = end;
    }
  });
}

void qmatmul(const ops::QMatmul& args) { qmatmul_batch({&args, 1}); }

}  // namespace lily::cpu
