// `merlin train --dump DIR`: what the PyTorch parity test (tests/train/check_train_parity.py) needs to
// replay a run: the parameter layout, the weights before and after every step, every step's batch and
// its (unclipped) gradient.
//   layout.json          [{"name", "dims" (GGUF order), "offset", "size"}] into the flat buffers below
//   weights-NNNNNN.gguf  f32 model (no tokenizer) after NNNNNN steps
//   batch-NNNNNN.i32     int32 tokens of step NNNNNN (0-based): [accum][batch][seq+1]
//   grads-NNNNNN.f32     float32 gradient of step NNNNNN, flat, layout.json order
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace merlin::train {

class Network;

class DebugDump {
 public:
  DebugDump(std::string dir, const Network& net);
  void weights(uint64_t steps_done);
  void batch(uint64_t step, const std::vector<int32_t>& tokens);
  void gradients(uint64_t step);

 private:
  std::string file(const char* stem, uint64_t step, const char* ext) const;
  std::string dir_;
  const Network& net_;
};

}  // namespace merlin::train
