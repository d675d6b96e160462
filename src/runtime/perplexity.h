// Perplexity as llama.cpp's llama-perplexity computes it, so the numbers of the two tools compare:
//   - the whole text is tokenized once, with BOS when the vocabulary adds one;
//   - it is cut into n_chunk = n_tokens / n_ctx non-overlapping chunks of n_ctx tokens (the tail is
//     dropped); each chunk is evaluated from an empty cache with its first token replaced by BOS;
//   - only the second half is scored: the logits at positions [n_ctx/2, n_ctx-1) predict the next token,
//     so each chunk contributes n_ctx - n_ctx/2 - 1 predictions;
//   - PPL = exp(mean NLL), and its error is PPL * sd(NLL) / sqrt(count - 1), llama.cpp's estimate.
// Bits per byte: the summed NLL in bits over the bytes of the predicted tokens' text, where a token's
// bytes are its piece as it appears in running text (SentencePiece's "▁the" is 4 bytes, a byte-fallback
// token 1). Tokenizer-independent, so models with different vocabularies compare.
// With a base model: mean KL(base || model) over the same predictions, and how often both pick the same
// top-1 token.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace merlin {

class Model;
class Tokenizer;

struct PerplexityOptions {
  int n_ctx = 512;      // tokens per chunk (llama-perplexity -c)
  int n_batch = 2048;   // tokens per forward call; n_batch / n_ctx chunks are evaluated together
  int n_threads = 0;    // 0: all cores
  DType kv_type = DType::F16;
  std::string device = "cpu";  // make_backend device
  int max_chunks = -1;  // -1: all
};

struct PerplexityResult {
  int n_ctx = 0, n_chunks = 0;
  int64_t n_scored = 0;       // predictions scored
  int64_t n_evaluated = 0;    // tokens run through the model
  double nll = 0;             // mean negative log-likelihood, nats
  double nll_err = 0;         // its standard error
  double ppl = 0, ppl_err = 0;
  uint64_t scored_bytes = 0;
  double bits_per_byte = 0;
  double seconds = 0;         // spent in the model's forward passes (not the base model's)
  bool has_base = false;
  double kl = 0, kl_err = 0;  // mean KL(base || model), nats, and its standard error
  double top1 = 0;            // fraction of predictions where both argmaxes agree
};

// The text's tokens as llama-perplexity makes them: BOS (when the vocabulary adds one), then the text.
// llama-perplexity encodes special-token text such as "<|endoftext|>" as ordinary text; with parse_special
// it becomes the special token, which is how a model trained on separated documents saw it.
std::vector<int32_t> perplexity_tokens(const Tokenizer& tok, const std::string& text, bool parse_special = false);

// on_chunk(i, ppl_so_far) after chunk i (0-based) is scored. `base` may be null.
PerplexityResult compute_perplexity(const Model& model, const std::vector<int32_t>& tokens,
                                    const PerplexityOptions& opts, const Model* base = nullptr,
                                    const std::function<void(int, double)>& on_chunk = {});

}  // namespace merlin
