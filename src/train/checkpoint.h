// Training checkpoints: a GGUF file (so `merlin info` can read it) holding the model config (llama.*
// keys), the weights under their model tensor names, the AdamW moments as "adam.m.<name>" /
// "adam.v.<name>", and the training state as merlin.train.* keys: steps done, the data sampler's RNG
// state, elapsed time, the hyperparameters, and a 64-bit checksum over all of it so a damaged file is
// refused instead of silently resumed. Written through gguf::Writer, i.e. to a temporary file that is
// fsynced and renamed into place.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/rng.h"
#include "model/config.h"
#include "train/params.h"

namespace merlin::train {

struct TrainState {
  uint64_t step = 0;  // optimizer steps completed
  Rng::State data_rng{};
  double elapsed = 0;  // seconds of training so far
  std::string tokenizer = "gpt2";
  // Hyperparameters the run was started with (name, value), for a warning when a resume changes them.
  std::vector<std::pair<std::string, double>> hyper;
};

struct Checkpoint {
  ModelConfig config;
  TrainState state;
  std::vector<float> params, m, v;  // ParamLayout(config) order
};

void save_checkpoint(const std::string& path, const ModelConfig& c, const ParamLayout& layout, const TrainState& s,
                     const float* params, const float* m, const float* v);
// Throws merlin::Error for a file that is not a checkpoint, is damaged (checksum) or inconsistent.
Checkpoint load_checkpoint(const std::string& path);
// The model config and training state only (params, m and v left empty), without reading the tensors.
Checkpoint read_checkpoint_header(const std::string& path);
// Throws a clear error when a checkpoint's model differs from the one being trained.
void check_same_model(const ModelConfig& ckpt, const ModelConfig& run, const std::string& path);
// The checkpoint with the most steps in a directory ("" when none).
std::string latest_checkpoint(const std::string& dir);
// A checkpoint file itself, or a directory's latest; throws merlin::Error when a directory holds none.
std::string resolve_checkpoint(const std::string& file_or_dir);
std::string checkpoint_name(uint64_t step);  // "ckpt-000100.ckpt"

}  // namespace merlin::train
