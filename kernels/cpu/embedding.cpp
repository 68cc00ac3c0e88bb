// Token embedding on the CPU: the forward gathers table rows by token id, the backward scatters the
// output gradient back into the table rows (+=, a parameter gradient). Ids come from the data, so
// an id outside [0, V) is bad input (InputError naming the id and the vocab size), checked before
// any parallel work starts. The backward must not race when a token repeats: it parallelises over
// column blocks of d, and within a block adds the token rows in token order, so the sums are
// bitwise the same for any thread count.
#include <algorithm>
#include <cstring>
#include <string>

#include "common/embedding_checks.hpp"
#include "cpu/cpu_common.hpp"
#include "moe/ops/embedding.hpp"

namespace moe::cpu {
namespace {

constexpr int64_t kColumnBlock = 64;  // columns per backward task (a few cache lines)

// ids: [N] i32, every id in [0, vocab); throws InputError on the first one outside.
void check_ids(const Tensor& ids, int64_t n, int64_t vocab, const char* op) {
  check_embedding_ids_args(ids, n, op);
  const int32_t* p = ids.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (p[i] < 0 || p[i] >= vocab)
      throw InputError(std::string(op) + ": token id " + std::to_string(p[i]) + " at position " +
                       std::to_string(i) + " is outside the vocabulary [0, " +
                       std::to_string(vocab) + ")");
  }
}

}  // namespace

// out: [N, d], ids: [N], table: [V, d]
void embedding_forward(Ctx& ctx, Tensor out, Tensor ids, Tensor table) {
  check_embedding_forward_args(out, ids, table);
  const int64_t vocab = table.size(0), d = table.size(1), n = ids.numel();
  check_ids(ids, n, vocab, "embedding_forward");
  dispatch_float(table.dtype, "embedding_forward", [&](auto zero) {
    using T = decltype(zero);
    const int32_t* id = ids.ptr<int32_t>();
    const T* tab = table.ptr<T>();
    T* o = out.ptr<T>();
#pragma omp parallel for if (parallel_worth(n * d))
    for (int64_t i = 0; i < n; ++i) std::copy_n(tab + id[i] * d, d, o + i * d);
  });
}

// dtable: [V, d] (+=), dout: [N, d], ids: [N]
void embedding_backward(Ctx& ctx, Tensor dtable, Tensor dout, Tensor ids) {
  check_embedding_backward_args(dtable, dout, ids);
  const int64_t vocab = dtable.size(0), d = dtable.size(1), n = ids.numel();
  check_ids(ids, n, vocab, "embedding_backward");
  dispatch_float(dtable.dtype, "embedding_backward", [&](auto zero) {
    using T = decltype(zero);
    const int32_t* id = ids.ptr<int32_t>();
    const T* g = dout.ptr<T>();
    T* dt = dtable.ptr<T>();
    const int64_t blocks = (d + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for if (parallel_worth(n * d))
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c0 = b * kColumnBlock, c1 = std::min(d, c0 + kColumnBlock);
      for (int64_t i = 0; i < n; ++i) {  // token order: deterministic sums for repeated ids
        T* row = dt + id[i] * d;
        const T* gi = g + i * d;
        for (int64_t c = c0; c < c1; ++c) row[c] += gi[c];
      }
    }
  });
}

}  // namespace moe::cpu
