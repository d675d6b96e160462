// Sampling a logits row where the logits are (Backend::forward_sample): a few adjustments, then the argmax
// or one draw, over the whole vocabulary or over the candidates that top-k, top-p and min-p keep. The server
// sends what its request samplers decided (biases, penalties, filters, the draw's uniform) and gets token
// ids back, so a GPU copies 4 bytes per sequence instead of a row of vocab_size floats. sample_row is the
// host definition every backend must match.
#pragma once
#include <cstdint>
#include <utility>
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

// A row's sampling; its adjustments are adjust[first, first + n_adjust) of the step's list. On the adjusted
// logits l: temperature <= 0 takes the first index of the largest (argmax() in sampler.h). Otherwise, with
// no filter, the token is the first i (in id order) at which u * sum_j w_j - (w_0 + ... + w_i) < 0,
// w_j = exp((l_j - max l) / temperature) in double: a draw from softmax(l / temperature) with the uniform
// u in [0, 1). With filters (top_k > 0, top_p < 1 or min_p > 0) the candidates are the best tokens (logit
// descending, then id) that survive top-k, then top-p, then min-p, with probabilities at temperature 1 over
// the top-k set (llama.cpp's chain), and the same draw runs over them in that order.
struct RowSampling {
  float temperature = 0.0f;
  int32_t top_k = 0;     // <= 0: off
  float top_p = 1.0f;    // >= 1: off
  float min_p = 0.0f;    // <= 0: off
  int32_t first = 0;
  int32_t n_adjust = 0;
  double u = 0.0;

  bool filtered() const { return top_k > 0 || top_p < 1.0f || min_p > 0; }
};

// Scratch reused between calls of sample_row.
struct SampleScratch {
  std::vector<float> work;                         // the adjusted row
  std::vector<std::pair<int32_t, float>> cand;     // the best candidates, sorted
  std::vector<double> weights;
  std::vector<double> p1;      // the row's exp(l - max), without top-k
  std::vector<double> bucket;  // their mass by logit below the maximum (the top-p prefix's histogram)
  std::vector<std::pair<int32_t, float>> cand_tmp;  // the top-p prefix's radix sort: the other buffer
  std::vector<uint32_t> keys, keys_tmp;             // and its keys
};

// The host definition of RowSampling: adjust is the step's whole list. (Plain pointers: the CUDA sources,
// compiled as C++17, include this header.)
int32_t sample_row(const float* logits, int64_t n_vocab, const RowSampling& r, const LogitAdjust* adjust,
                   SampleScratch& scratch);

}  // namespace merlin
