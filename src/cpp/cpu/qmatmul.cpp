// y[T, N] = x[T, K] @ W^T for an MLX affine-quantized W [N, K].
//
// Each thread owns a range of output rows. It dequantizes a block of kRowBlock weight
// rows (w = scale*q + bias, from the bf16 scales/biases) into a small buffer and dots
// them with a tile of kTokenTile input rows, so both stay in L2 while they are reused:
// per tile the dequantization costs N*K against the tile's kTokenTile*N*K multiply-adds.
// Every output is one fp32 dot of a full row, so the result does not depend on T, the
// tiling or the thread count.
#include <algorithm>
#include <vector>

#include "check.h"
#include "ops.h"
#include "quant.h"
#include "threadpool.h"
#include "vec.h"

namespace lily::cpu {
namespace {

constexpr int64_t kRowBlock = 16;   // weight rows per block: 4 calls of dot4
constexpr int64_t kTokenTile = 32;  // input rows swept per dequantized block

}  // namespace

void qmatmul(const float* x, int64_t T, const QWeight& w, float* y) {
  check_qweight(w, "qmatmul", "the weight");
  check(w.experts == 1, "qmatmul", "the weight is a stack of ", str(w.experts), " matrices; pass one expert");
  check(T >= 0 && (T == 0 || (x && y)), "qmatmul", "missing input or output for ", str(T), " rows");
  const int64_t N = w.rows, K = w.cols, words = w.words_per_row(), groups = w.groups_per_row();
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    std::vector<float> rows(kRowBlock * K);
    for (int64_t t0 = 0; t0 < T; t0 += kTokenTile) {
      const int64_t t1 = std::min(T, t0 + kTokenTile);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kRowBlock, nr = std::min(kRowBlock, N - n0);
        for (int64_t r = 0; r < nr; ++r)
          affine_dequantize_row(w.codes + (n0 + r) * words, w.scales + (n0 + r) * groups,
                                w.biases + (n0 + r) * groups, K, w.group_size, w.bits, rows.data() + r * K);
        // The last block may end inside a group of four rows: pad it with zero rows.
        const int64_t padded = (nr + 3) / 4 * 4;
        std::fill(rows.begin() + nr * K, rows.begin() + padded * K, 0.0f);
        for (int64_t t = t0; t < t1; ++t) {
          float* yt = y + t * N + n0;
          for (int64_t r = 0; r < nr; r += 4) {
            float out[4];
            dot4(x + t * K, rows.data() + r * K, K, out);
            std::copy(out, out + std::min<int64_t>(4, nr - r), yt + r);
          }
        }
      }
    }
  });
}

}  // namespace lily::cpu
