// Random initialisation of a model, written straight to GGUF in chunks so that even the 7.19B
// `macbook` preset never has to fit in memory.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"

namespace merlin {

class Tokenizer;

struct InitOptions {
  uint64_t seed = 0;
  DType type = DType::F32;  // F32, F16 or BF16 for the matrices; norms are always F32
  float std = 0.02f;        // residual projections (attn_output, ffn_down) use std / sqrt(2 * n_layers)
  int n_threads = 0;
  bool progress = true;
};

// Names, GGUF dims ([cols, rows] for matrices) and init std of every tensor, in file order.
struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;
  float std;  // 0 for norm weights, which start at 1
};
std::vector<TensorSpec> model_tensor_specs(const ModelConfig& c, float std);

// Deterministic values for elements [begin, end) of tensor number `tensor_index` (independent of how the
// work is chunked or threaded).
void init_values(uint64_t seed, size_t tensor_index, const TensorSpec& spec, uint64_t begin, uint64_t end,
                 float* out);

void write_random_model(const ModelConfig& config, const Tokenizer& tokenizer, const InitOptions& opts,
                        const std::string& path);

}  // namespace merlin
