// merlin perplexity (work in progress).
#include "commands.h"
#include "core/error.h"

namespace merlin::cli {

Action add_perplexity(CLI::App& app) {
  (void)app;
  return [] { fail("merlin perplexity: not implemented yet"); return 1; };
}

}  // namespace merlin::cli
