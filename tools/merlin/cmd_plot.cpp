// merlin plot: training curves (train and validation loss) from metrics.jsonl as an SVG file.
#include <cstdio>

#include "commands.h"
#include "core/atomic_file.h"
#include "train/plot.h"

namespace merlin::cli {
namespace {

struct PlotArgs {
  std::string metrics, out;
  train::PlotOptions o;
};

int run_plot(const PlotArgs& a) {
  const std::string svg = train::plot_metrics_svg(a.metrics, a.o);
  AtomicFileWriter w(a.out);
  w.write(svg.data(), svg.size());
  w.commit();
  std::fprintf(stderr, "plot: %s -> %s\n", a.metrics.c_str(), a.out.c_str());
  return 0;
}

}  // namespace

Action add_plot(CLI::App& app) {
  auto a = std::make_shared<PlotArgs>();
  app.add_option("metrics", a->metrics, "metrics.jsonl written by 'merlin train'")->required();
  app.add_option("-o,--output", a->out, "output SVG file")->required();
  app.add_option("--title", a->o.title, "plot title")->capture_default_str();
  app.add_option("--width", a->o.width, "width in pixels")->capture_default_str();
  app.add_option("--height", a->o.height, "height in pixels")->capture_default_str();
  return [a] { return run_plot(*a); };
}

}  // namespace merlin::cli
