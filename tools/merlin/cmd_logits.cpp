// merlin logits: raw float32 logits [n_tokens][vocab] of a token sequence, computed three ways, so tests
// can compare every path of the forward pass with an independent implementation.
#include <cstdio>

#include "commands.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/generate.h"
#include "runtime/model.h"

namespace merlin::cli {
namespace {

struct LogitsArgs {
  std::string model, tokens, out, mode = "prefill", kv_type = "f32";
  int threads = 0;
};

int logits(const LogitsArgs& a) {
  auto model = Model::load(a.model);
  const std::vector<int32_t> ids = parse_id_list(a.tokens);
  MERLIN_CHECK(!ids.empty(), "--tokens is empty");
  BackendOptions bo;
  bo.n_threads = a.threads;
  bo.kv_type = parse_kv_type(a.kv_type);
  auto backend = make_cpu_backend(*model, bo);
  const size_t vocab = (size_t)model->config().vocab_size;
  std::vector<float> out;
  if (a.mode == "prefill") {
    out = prefill(*model, *backend, ids, 0, 0, true);
  } else if (a.mode == "decode") {
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::vector<float> row = prefill(*model, *backend, {ids[i]}, 0, (int)i, false);
      out.insert(out.end(), row.begin(), row.end());
    }
  } else if (a.mode == "nocache") {
    for (size_t i = 0; i < ids.size(); ++i) {
      backend->clear_sequence(0);
      const std::vector<int32_t> head(ids.begin(), ids.begin() + (ptrdiff_t)i + 1);
      const std::vector<float> row = prefill(*model, *backend, head, 0, 0, false);
      out.insert(out.end(), row.begin(), row.end());
    }
  } else {
    fail("--mode must be prefill, decode or nocache");
  }
  MERLIN_CHECK(out.size() == ids.size() * vocab, "internal error: wrong logits size");
  AtomicFileWriter w(a.out);
  w.write(out.data(), out.size() * sizeof(float));
  w.commit();
  return 0;
}

}  // namespace

Action add_logits(CLI::App& app) {
  auto a = std::make_shared<LogitsArgs>();
  app.add_option("-m,--model", a->model, "GGUF model file")->required();
  app.add_option("--tokens", a->tokens, "comma-separated token ids")->required();
  app.add_option("-o,--output", a->out, "output file (float32 [n_tokens][vocab])")->required();
  app.add_option("--mode", a->mode, "prefill (one batch) | decode (one token at a time, KV cache) | nocache");
  app.add_option("-t,--threads", a->threads, "threads");
  app.add_option("--kv-type", a->kv_type, "KV cache type: f32 (default here: exact fp32) | f16 | q8_0");
  return [a] { return logits(*a); };
}

}  // namespace merlin::cli
