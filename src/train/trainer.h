// The training loop behind `merlin train`: batches from token shards, forward/backward with gradient
// accumulation, clipping, AdamW on the warm-up + cosine schedule, metrics, evaluation, checkpoints.
//
// Resume determinism: a checkpoint holds everything the next step depends on (weights, AdamW moments,
// the step count, which fixes the learning rate and bias corrections, and the data sampler's RNG state),
// and every computation is independent of thread count and timing (see gemm.h, layers.h), so a resumed
// run reproduces the uninterrupted one bit for bit.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"
#include "train/optimizer.h"

namespace merlin::train {

struct TrainOptions {
  ModelConfig model;
  std::string data;        // train shard, or a directory of train-*.tok (and val-*.tok) shards
  std::string val;         // validation shard or directory; default: val-*.tok beside the training data
  std::string out_dir;     // metrics.jsonl and checkpoints
  std::string resume;      // checkpoint file, or a directory (its latest checkpoint)
  std::string dump_dir;    // debug: weights, batches and gradients of every step (for the PyTorch parity test)
  int64_t batch = 8, seq = 256, accum = 1;
  int64_t eval_every = 100, eval_tokens = 1 << 16, ckpt_every = 500, print_every = 10;
  int keep_checkpoints = 2;  // older ones are deleted
  OptimConfig optim;         // optim.steps is the number of steps to train
  uint64_t seed = 0;
  float dropout = 0.0f;  // residual dropout while training (Network::set_dropout); masks from (seed, step)
  int threads = 0;
  bool progress = true;  // live line on a terminal, plain lines otherwise
};

struct TrainResult {
  uint64_t steps_done = 0;
  double last_loss = 0, last_val_loss = -1;
  std::string last_checkpoint;
};

// Throws merlin::Error on bad options or data, and when the loss or gradient stops being finite (the last
// good checkpoint is kept and named in the message).
TrainResult train_model(const TrainOptions& opts);

}  // namespace merlin::train
