// Text generation on top of a Backend: prompt processing in chunks, then one token per step, each
// handed to a callback as soon as it is sampled. The CLI, the server and the tests all use this.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "runtime/sampler.h"

namespace merlin {

class Backend;
class Model;

struct GenerateOptions {
  int n_predict = 128;         // tokens to generate (stops earlier at EOS or a full context)
  bool use_kv_cache = true;    // false: every step recomputes the whole sequence
  bool stop_at_eos = true;
  int seq = 0;                 // which backend sequence to use
  SamplerOptions sampling;
};

struct GenerateStats {
  int n_prompt = 0;
  int n_generated = 0;
  double prompt_seconds = 0;   // until the first generated token's logits are ready
  double gen_seconds = 0;      // for the remaining tokens
  std::string stop_reason;     // "length", "eos", "context", "callback"
};

// on_token(id) is called for every generated token; returning false stops generation.
GenerateStats generate(const Model& model, Backend& backend, const std::vector<int32_t>& prompt,
                       const GenerateOptions& opts, const std::function<bool(int32_t)>& on_token);

// Runs `tokens` through sequence `seq` starting at position `start`, in chunks of the backend's batch
// size. When all_logits, returns logits for every token ([n][vocab]); otherwise only for the last.
std::vector<float> prefill(const Model& model, Backend& backend, const std::vector<int32_t>& tokens, int seq,
                           int start, bool all_logits);

}  // namespace merlin
