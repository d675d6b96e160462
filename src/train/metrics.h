// metrics.jsonl: one JSON object per line, flushed as written.
//   train step: {"step":N,"loss":..,"lr":..,"grad_norm":..,"tokens_per_s":..,"elapsed":..}
//   evaluation: {"step":N,"val_loss":..,"val_ppl":..,"val_bpb":..,"val_tokens":..,"elapsed":..}
// "step" counts completed optimizer steps (0: the untrained model). Numbers are written in shortest
// round-trip form, so equal doubles print equal text.
#pragma once
#include <cstdint>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace merlin::train {

class MetricsLog {
 public:
  // A fresh run truncates the file. A resumed run keeps only the lines of steps <= keep_through_step (a
  // crashed run may have logged steps past its last checkpoint, which are about to be redone) and appends.
  MetricsLog(const std::string& path, bool resume, uint64_t keep_through_step);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write(const nlohmann::ordered_json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// All records of a metrics file, in order; throws merlin::Error naming the line on malformed JSON.
std::vector<nlohmann::ordered_json> read_metrics(const std::string& path);

}  // namespace merlin::train
