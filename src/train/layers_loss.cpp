// Output head and cross-entropy, fused and chunked: the logits of a whole batch (tokens × 50257 floats)
// would dominate memory, so each chunk of rows goes logits -> loss -> dlogits -> dx, dW before the next.
#include <algorithm>

#include "core/thread_pool.h"
#include "train/gemm.h"
#include "train/layers.h"
#include "train/train_kernels.h"

namespace merlin::train {
namespace {
constexpr int64_t kChunkRows = 128;
}

HeadScratch::HeadScratch(int64_t n, int64_t vocab) : chunk(std::min(n, kChunkRows)) {
  logits.resize(chunk * vocab);
  losses.resize(n);
}

double head_loss(ThreadPool& pool, const float* x, const float* w, const int32_t* targets, int64_t n, int64_t d,
                 int64_t vocab, float grad_scale, HeadScratch& scratch, float* dx, float* dw) {
  const kern::Table& kt = kern::table();
  float* logits = scratch.logits.data();
  for (int64_t r0 = 0; r0 < n; r0 += scratch.chunk) {
    const int64_t rows = std::min(scratch.chunk, n - r0);
    linear_forward(pool, x + r0 * d, w, rows, d, vocab, logits);
    pool.parallel_for(rows, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        scratch.losses[r0 + r] = kt.xent_row(logits + r * vocab, vocab, targets[r0 + r], grad_scale);
    });
    if (grad_scale == 0.0f) continue;
    linear_backward_input(pool, logits, w, rows, d, vocab, dx + r0 * d, /*accumulate=*/false);
    linear_backward_weight(pool, logits, x + r0 * d, rows, d, vocab, dw);
  }
  double sum = 0;  // in row order, in double: the logged loss must not depend on threading
  for (int64_t r = 0; r < n; ++r) sum += scratch.losses[r];
  return sum;
}

}  // namespace merlin::train
