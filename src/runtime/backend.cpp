#include "runtime/backend.h"

#include <vector>

#include "core/error.h"
#include "runtime/sampler.h"

namespace merlin {

void Backend::forward_greedy(const Batch& batch, int64_t n_vocab, int32_t* tokens) {
  std::vector<float> logits(batch.n_logits() * (size_t)n_vocab);
  forward(batch, logits.data());
  for (size_t r = 0; r < batch.n_logits(); ++r) tokens[r] = argmax(logits.data() + r * (size_t)n_vocab, n_vocab);
}

int Backend::decode_greedy(int32_t token, int32_t pos, int seq, int n_steps, int64_t n_vocab,
                           const std::function<bool(int32_t)>& on_token) {
  Batch batch;
  for (int i = 0; i < n_steps; ++i) {
    batch.clear();
    batch.add(token, pos + i, seq, true);
    forward_greedy(batch, n_vocab, &token);
    if (!on_token(token)) return i + 1;
  }
  return n_steps;
}

void Backend::decode_greedy_batch(std::span<const int32_t> tokens, std::span<const int32_t> pos,
                                  std::span<const int32_t> seqs, int n_steps, int64_t n_vocab, int32_t* ids) {
  const size_t n = tokens.size();
  MERLIN_CHECK(pos.size() == n && seqs.size() == n, "decode_greedy_batch: ", n, " tokens, ", pos.size(),
               " positions, ", seqs.size(), " sequences");
  Batch batch;
  for (int i = 0; i < n_steps; ++i) {
    batch.clear();
    for (size_t r = 0; r < n; ++r)
      batch.add(i == 0 ? tokens[r] : ids[(size_t)(i - 1) * n + r], pos[r] + i, seqs[r], true);
    forward_greedy(batch, n_vocab, ids + (size_t)i * n);
  }
}

int Backend::decode_sample(int32_t token, int32_t pos, int seq, std::span<const RowSampling> rows, int64_t n_vocab,
                           const std::function<bool(int32_t)>& on_token) {
  Batch batch;
  for (size_t i = 0; i < rows.size(); ++i) {
    batch.clear();
    batch.add(token, pos + (int32_t)i, seq, true);
    forward_sample(batch, n_vocab, rows.subspan(i, 1), {}, &token);
    if (!on_token(token)) return (int)i + 1;
  }
  return (int)rows.size();
}

void Backend::forward_sample(const Batch& batch, int64_t n_vocab, std::span<const RowSampling> rows,
                             std::span<const LogitAdjust> adjust, int32_t* tokens) {
  const size_t n_rows = batch.n_logits();
  MERLIN_CHECK(rows.size() == n_rows, "forward_sample: ", rows.size(), " sampling rows for ", n_rows, " logits rows");
  sample_logits_.resize(n_rows * (size_t)n_vocab);
  forward(batch, sample_logits_.data());
  for (size_t r = 0; r < n_rows; ++r)
    tokens[r] = sample_row(sample_logits_.data() + r * (size_t)n_vocab, n_vocab, rows[r], adjust.data(),
                           sample_scratch_);
}

#ifdef MERLIN_HAVE_CUDA
// Defined in src/kernels/cuda (built only with MERLIN_CUDA); throws merlin::Error when no GPU is present.
std::unique_ptr<Backend> make_cuda_backend(const Model& model, const BackendOptions& opts);
#endif

std::unique_ptr<Backend> make_backend(const std::string& device, const Model& model, const BackendOptions& opts) {
  if (device == "cpu") return make_cpu_backend(model, opts);
  if (device == "cuda") {
#ifdef MERLIN_HAVE_CUDA
    return make_cuda_backend(model, opts);
#else
    fail("this build of Merlin has no CUDA backend (configure with -DMERLIN_CUDA=ON and nvcc on PATH)");
#endif
  }
  fail("unknown device '", device, "' (expected cpu or cuda)");
}

}  // namespace merlin
