// Helpers for the serve tests: a small random model, backends with a paged cache, stream draining and the
// reference output of generate().
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "random_model.h"
#include "runtime/backend.h"
#include "runtime/generate.h"
#include "serve/engine.h"

namespace merlin::test {

struct StreamOutput {
  std::vector<int32_t> tokens;
  std::vector<serve::TokenEvent> events;
  serve::FinishReason finish = serve::FinishReason::None;
  std::string error;
};

// Drains a stream to its final event. The engine always sends one; the long timeout only guards a hang.
inline StreamOutput collect(serve::RequestStream& s) {
  StreamOutput out;
  serve::TokenEvent ev;
  for (int waited = 0; waited < 1200; ++waited) {
    if (!s.next(ev, std::chrono::milliseconds(100))) continue;
    if (ev.token >= 0) out.tokens.push_back(ev.token);
    out.events.push_back(ev);
    if (ev.finish != serve::FinishReason::None) {
      out.finish = ev.finish;
      out.error = ev.error;
      return out;
    }
  }
  ADD_FAILURE() << "stream did not finish";
  return out;
}

// The events already pushed, without waiting (for the step-driven scheduler tests).
inline StreamOutput take(serve::RequestStream& s, StreamOutput out = {}) {
  serve::TokenEvent ev;
  while (s.next(ev, std::chrono::milliseconds(0))) {
    if (ev.token >= 0) out.tokens.push_back(ev.token);
    out.events.push_back(ev);
    if (ev.finish != serve::FinishReason::None) {
      out.finish = ev.finish;
      out.error = ev.error;
    }
  }
  return out;
}

inline std::vector<int32_t> prompt_of(int n, int salt) {
  std::vector<int32_t> p;
  for (int i = 0; i < n; ++i) p.push_back(3 + (i * 37 + salt * 101 + i * i * salt) % 500);
  return p;
}

inline serve::GenerationRequest greedy(std::vector<int32_t> prompt, int max_tokens) {
  serve::GenerationRequest r;
  r.prompt = std::move(prompt);
  r.max_tokens = max_tokens;
  r.sampling.temperature = 0;
  r.stop_at_eos = false;
  return r;
}

class ServeFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = write_small_model(dir_, DType::F32);
    if (path_.empty()) GTEST_SKIP() << "shared data file '" << kTokenizerModel << "' not found";
    model_ = Model::load(path_);
  }

  std::unique_ptr<Backend> paged_backend(int n_seq, int n_blocks, int block_size = 16, int max_batch = 512) {
    BackendOptions bo;
    bo.n_threads = 1;  // a tiny model: thread synchronisation would cost more than it saves
    bo.n_seq = n_seq;
    bo.kv_block_size = block_size;
    bo.n_kv_blocks = n_blocks;
    bo.max_batch = max_batch;
    return make_cpu_backend(*model_, bo);
  }

  // generate() on a fresh backend with identity tables: the reference for every greedy engine output.
  std::vector<int32_t> reference(const std::vector<int32_t>& prompt, int n) {
    BackendOptions bo;
    bo.n_threads = 1;  // a tiny model: thread synchronisation would cost more than it saves
    auto b = make_cpu_backend(*model_, bo);
    GenerateOptions go;
    go.n_predict = n;
    go.stop_at_eos = false;
    go.sampling.temperature = 0;
    std::vector<int32_t> out;
    generate(*model_, *b, prompt, go, [&](int32_t t) {
      out.push_back(t);
      return true;
    });
    return out;
  }

  TempDir dir_;
  std::string path_;
  std::unique_ptr<Model> model_;
};

}  // namespace merlin::test
