// merlin info: metadata, tensor table and parameter count of any GGUF file.
#include <cstdio>

#include "commands.h"
#include "core/error.h"
#include "core/sys.h"
#include "format/gguf.h"

namespace merlin::cli {
namespace {

void print_tensors(const gguf::File& f, bool all) {
  std::printf("\n%-32s %-6s %-22s %12s\n", "tensor", "type", "shape", "bytes");
  size_t shown = 0;
  for (const gguf::TensorInfo& t : f.tensors()) {
    if (!all && shown == 40) {
      std::printf("... %zu more (use --all)\n", f.tensors().size() - shown);
      break;
    }
    std::string shape = "[";
    for (size_t i = 0; i < t.dims.size(); ++i) shape += (i ? ", " : "") + std::to_string(t.dims[i]);
    shape += "]";
    std::printf("%-32s %-6s %-22s %12llu\n", t.name.c_str(), dtype_name(t.type), shape.c_str(),
                (unsigned long long)t.n_bytes);
    ++shown;
  }
}

int info(const std::string& path, bool all) {
  auto f = gguf::File::open(path);
  std::printf("file: %s\nGGUF version %u, alignment %llu, %zu metadata keys, %zu tensors, %s\n", path.c_str(),
              f->version(), (unsigned long long)f->alignment(), f->metadata().size(), f->tensors().size(),
              format_bytes(f->file_size()).c_str());
  std::printf("\n%-44s %-8s %s\n", "key", "type", "value");
  for (const auto& [key, value] : f->metadata().entries())
    std::printf("%-44s %-8s %s\n", key.c_str(), gguf::value_type_name(value.type()), value.to_string().c_str());
  print_tensors(*f, all);
  uint64_t params = 0, bytes = 0;
  for (const gguf::TensorInfo& t : f->tensors()) {
    params += t.n_elements;
    bytes += t.n_bytes;
  }
  std::printf("\nparameters: %llu (%.2f M), tensor data %s, %.2f bits per weight\n", (unsigned long long)params,
              params / 1e6, format_bytes(bytes).c_str(), params ? 8.0 * bytes / params : 0.0);
  return 0;
}

}  // namespace

Action add_info(CLI::App& app) {
  auto path = std::make_shared<std::string>();
  auto all = std::make_shared<bool>(false);
  app.add_option("file", *path, "GGUF file")->required();
  app.add_flag("--all", *all, "list every tensor");
  return [path, all] { return info(*path, *all); };
}

}  // namespace merlin::cli
