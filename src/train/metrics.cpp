#include "train/metrics.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/atomic_file.h"
#include "core/error.h"

namespace merlin::train {

MetricsLog::MetricsLog(const std::string& path, bool resume, uint64_t keep_through_step) : path_(path) {
  if (resume && std::filesystem::exists(path)) {
    std::string kept;
    for (const nlohmann::ordered_json& j : read_metrics(path))
      if (j.value("step", (uint64_t)0) <= keep_through_step) kept += j.dump() + "\n";
    AtomicFileWriter w(path);
    w.write(kept.data(), kept.size());
    w.commit();
  }
  f_ = std::fopen(path.c_str(), resume ? "ab" : "wb");
  MERLIN_CHECK(f_, "cannot write ", path, ": ", std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (f_) std::fclose(f_);
}

void MetricsLog::write(const nlohmann::ordered_json& record) {
  const std::string line = record.dump() + "\n";
  MERLIN_CHECK(std::fwrite(line.data(), 1, line.size(), f_) == line.size() && std::fflush(f_) == 0, "cannot write ",
               path_, ": ", std::strerror(errno));
}

std::vector<nlohmann::ordered_json> read_metrics(const std::string& path) {
  std::ifstream in(path);
  MERLIN_CHECK(in, "cannot read ", path);
  std::vector<nlohmann::ordered_json> out;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::ordered_json j = nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    MERLIN_CHECK(j.is_object(), path, " line ", n, ": not a JSON object");
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace merlin::train
