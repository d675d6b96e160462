#include "train/train_debug.h"

#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "train/export.h"
#include "train/network.h"

namespace merlin::train {

DebugDump::DebugDump(std::string dir, const Network& net) : dir_(std::move(dir)), net_(net) {
  std::filesystem::create_directories(dir_);
  nlohmann::json layout = nlohmann::json::array();
  for (const ParamTensor& t : net.layout().tensors())
    layout.push_back({{"name", t.name}, {"dims", t.dims}, {"offset", t.offset}, {"size", t.size}});
  const std::string text = layout.dump(1) + "\n";
  AtomicFileWriter w(dir_ + "/layout.json");
  w.write(text.data(), text.size());
  w.commit();
}

std::string DebugDump::file(const char* stem, uint64_t step, const char* ext) const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "/%s-%06llu.%s", stem, (unsigned long long)step, ext);
  return dir_ + buf;
}

void DebugDump::weights(uint64_t steps_done) {
  write_model_gguf(file("weights", steps_done, "gguf"), net_.config(), net_.layout(), net_.params().data(),
                   DType::F32, nullptr);
}

void DebugDump::batch(uint64_t step, const std::vector<int32_t>& tokens) {
  AtomicFileWriter w(file("batch", step, "i32"));
  w.write(tokens.data(), tokens.size() * sizeof(int32_t));
  w.commit();
}

void DebugDump::gradients(uint64_t step) {
  AtomicFileWriter w(file("grads", step, "f32"));
  w.write(net_.grads().data(), net_.grads().size() * sizeof(float));
  w.commit();
}

}  // namespace merlin::train
