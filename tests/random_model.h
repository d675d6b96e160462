// Small random models for runtime and serve tests: a llama config with stories260K's 512-token vocabulary,
// written with random weights and optionally quantized, so a forward pass takes microseconds.
#pragma once
#include <memory>
#include <string>

#include "core/dtype.h"
#include "format/gguf.h"
#include "model/config.h"
#include "model/init.h"
#include "runtime/model.h"
#include "runtime/quantize_model.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

namespace merlin::test {

inline const char* kTokenizerModel = "models/stories260K/stories260K.gguf";

// dim 64, two heads of 32 (so a Q8_0 K/V cache works) sharing one K/V head (GQA), 2 layers.
inline ModelConfig small_config() {
  ModelConfig c;
  c.name = "merlin-test";
  c.dim = 64;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.n_layers = 2;
  c.ffn_dim = 128;
  c.context_length = 256;
  return c;
}

// Writes a random model of `type` (F32, F16 or a quantized type) into `dir`; "" when the tokenizer's data
// file is missing (the caller skips). A larger init std than training's makes greedy text less uniform.
inline std::string write_small_model(const TempDir& dir, DType type, uint64_t seed = 1,
                                     ModelConfig c = small_config()) {
  const std::string tok_path = data_file(kTokenizerModel);
  if (tok_path.empty()) return "";
  auto file = gguf::File::open(tok_path);
  auto tok = Tokenizer::from_gguf(file->metadata());
  c.vocab_size = tok->vocab_size();
  InitOptions io;
  io.seed = seed;
  io.std = 0.3f;
  io.n_threads = 2;
  io.progress = false;
  const std::string f32 = dir.file("model-f32-" + std::to_string(seed) + ".gguf");
  write_random_model(c, *tok, io, f32);
  if (type == DType::F32) return f32;
  QuantizeOptions qo;
  qo.type = type;
  qo.n_threads = 2;
  qo.progress = false;
  const std::string out = dir.file(std::string("model-") + dtype_name(type) + "-" + std::to_string(seed) + ".gguf");
  quantize_model(f32, out, qo);
  return out;
}

}  // namespace merlin::test
