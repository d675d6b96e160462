// Trained weights to a runnable GGUF model: the same metadata and tensor names/order `merlin init` writes
// (ModelConfig::write_gguf + the tokenizer's keys), matrices in f32, f16 or bf16, norms always f32.
#pragma once
#include <string>

#include "core/dtype.h"
#include "model/config.h"
#include "train/params.h"

namespace merlin {
class Tokenizer;
}

namespace merlin::train {

// `tokenizer` may be null (debug dumps read by the Python tests, or vocabularies no tokenizer matches).
void write_model_gguf(const std::string& path, const ModelConfig& c, const ParamLayout& layout, const float* params,
                      DType type, const Tokenizer* tokenizer);

// Checkpoint (from `merlin train`) to model; returns the checkpoint's step count.
uint64_t export_checkpoint(const std::string& ckpt_path, const std::string& out_path, DType type,
                           const Tokenizer& tokenizer);

}  // namespace merlin::train
