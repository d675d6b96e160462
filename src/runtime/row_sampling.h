// Sampling a logits row where the logits are (Backend::forward_sample): a few adjustments, then the argmax
// or one draw over the whole vocabulary. The server sends what its request samplers decided (biases,
// penalties, the draw's uniform) and gets token ids back, so a GPU copies 4 bytes per sequence instead of a
// row of vocab_size floats. sample_row is the host definition every backend must match.
#pragma once
#include <cstdint>
#include <vector>

namespace merlin {

// One token's adjustment: logit + bias (when kBias is set), then - penalty (when kPenalty is set), in float,
// in that order (the server's order: OpenAI logit_bias, then presence / frequency penalties).
struct LogitAdjust {
  static constexpr int32_t kBias = 1, kPenalty = 2;
  int32_t token = 0;
  float bias = 0.0f;
  float penalty = 0.0f;
  int32_t flags = 0;
};

// A row's sampling: its adjustments are adjust[first, first + n_adjust) of the step's list. temperature <= 0
// takes the first index of the largest adjusted logit (argmax() in sampler.h); otherwise the token is the
// first i (in id order) at which u * sum_j w_j - (w_0 + ... + w_i) < 0, w_j = exp((l_j - max l) / temperature)
// in double: a draw from softmax(l / temperature) with the uniform u in [0, 1).
struct RowSampling {
  float temperature = 0.0f;
  int32_t first = 0;
  int32_t n_adjust = 0;
  int32_t pad = 0;
  double u = 0.0;
};

// The host definition of RowSampling: adjust is the step's whole list (work: scratch for the adjusted row).
// (Plain pointers: the CUDA sources, compiled as C++17, include this header.)
int32_t sample_row(const float* logits, int64_t n_vocab, const RowSampling& r, const LogitAdjust* adjust,
                   std::vector<float>& work);

// The draw of RowSampling over a row whose largest value is max_logit.
int32_t draw_row(const float* logits, int64_t n_vocab, float max_logit, float temperature, double u,
                 std::vector<double>& weights);

}  // namespace merlin
