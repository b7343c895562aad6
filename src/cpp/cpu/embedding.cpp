// Token embedding: out[t] = the dequantized row ids[t] of the table [V, H]
// (what MLX's QuantizedEmbedding does).
#include "check.h"
#include "ops.h"
#include "quant.h"
#include "threadpool.h"

namespace lily::cpu {

void embedding(const ops::Embedding& args) {
  const auto& [table, ids, T, out] = args;
  check_qweight(table, "embedding", "the table");
  check(T == 0 || (ids && out), "embedding", "missing ids or output");
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= table.rows)
      fail("embedding: token id ", str(ids[t]), " at index ", str(t), " is outside [0, ", str(table.rows), ")");
  const int64_t H = table.cols, words = table.words_per_row(), groups = table.groups_per_row();
  parallel_for(T, H, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      affine_dequantize_row(table.codes + ids[t] * words, table.scales + ids[t] * groups,
                            table.biases + ids[t] * groups, H, table.group_size, table.bits, out + t * H);
  });
}

}  // namespace lily::cpu
