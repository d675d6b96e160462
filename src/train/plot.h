// `merlin plot`: a metrics.jsonl file to a self-contained SVG of train and validation loss against step.
#pragma once
#include <string>

namespace merlin::train {

struct PlotOptions {
  std::string title = "Merlin training";
  int width = 800, height = 480;
};

// Returns the SVG document; throws merlin::Error when the file has no loss records.
std::string plot_metrics_svg(const std::string& metrics_path, const PlotOptions& o);

}  // namespace merlin::train
