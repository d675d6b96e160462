// The backend interface: one forward step over a batch of tokens. The CPU backend implements it today;
// a CUDA (or Metal) backend implements the same interface, so the generator, sampler, scheduler and
// server never know which one runs.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace merlin {

class Model;

// One forward step. Token i sits at position pos[i] of sequence seq[i]; its K/V are written to that
// sequence's cache and it attends to positions 0..pos[i] of the same sequence. Rows with want_logits
// produce a row of vocab_size logits, in batch order.
struct Batch {
  std::vector<int32_t> tokens, pos, seq;
  std::vector<uint8_t> want_logits;

  void clear() { tokens.clear(); pos.clear(); seq.clear(); want_logits.clear(); }
  void add(int32_t token, int32_t position, int32_t sequence, bool logits) {
    tokens.push_back(token);
    pos.push_back(position);
    seq.push_back(sequence);
    want_logits.push_back(logits ? 1 : 0);
  }
  size_t size() const { return tokens.size(); }
  size_t n_logits() const {
    size_t n = 0;
    for (uint8_t w : want_logits) n += w;
    return n;
  }
};

struct BackendOptions {
  int n_threads = 0;     // 0: all hardware threads
  int n_ctx = 0;         // 0: the model's context length
  int n_seq = 1;         // independent sequences (KV cache slots)
  int max_batch = 512;   // most tokens in one forward() call
  // K/V cache element type: F16 (default, as llama.cpp), F32 (exact fp32 attention, used by the parity
  // tests) or Q8_0 (half the memory of F16 again; needs a head size that is a multiple of 32).
  DType kv_type = DType::F16;
};

// "f32" | "f16" | "q8_0" -> DType; throws merlin::Error otherwise.
DType parse_kv_type(const std::string& name);

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual int n_ctx() const = 0;
  virtual int max_batch() const = 0;
  virtual int n_seq() const = 0;
  // Runs the batch; `logits` receives batch.n_logits() rows of vocab_size floats.
  virtual void forward(const Batch& batch, float* logits) = 0;
  // Forgets everything cached for a sequence (the next token of it starts at position 0).
  virtual void clear_sequence(int seq) = 0;
};

std::unique_ptr<Backend> make_cpu_backend(const Model& model, const BackendOptions& opts);

}  // namespace merlin
