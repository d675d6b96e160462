// merlin bench (work in progress).
#include "commands.h"
#include "core/error.h"

namespace merlin::cli {

Action add_bench(CLI::App& app) {
  (void)app;
  return [] { fail("merlin bench: not implemented yet"); return 1; };
}

}  // namespace merlin::cli
