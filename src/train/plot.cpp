#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "train/metrics.h"

namespace merlin::train {
namespace {

struct Series {
  std::vector<double> x, y;
};

// Round tick spacing (1, 2 or 5 times a power of ten) giving about `target` ticks over [lo, hi].
double tick_step(double lo, double hi, int target) {
  const double raw = (hi - lo) / target;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (raw <= m * mag) return m * mag;
  return 10 * mag;
}

std::string fmt(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", std::abs(v) < 1e-12 ? 0.0 : v);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

class Canvas {
 public:
  Canvas(const PlotOptions& o, double x0, double x1, double y0, double y1)
      : o_(o), x0_(x0), x1_(x1 > x0 ? x1 : x0 + 1), y0_(y0), y1_(y1 > y0 ? y1 : y0 + 1) {}
  double px(double x) const { return kLeft + (x - x0_) / (x1_ - x0_) * (o_.width - kLeft - kRight); }
  double py(double y) const { return o_.height - kBottom - (y - y0_) / (y1_ - y0_) * (o_.height - kTop - kBottom); }
  void axes(std::ostringstream& s) const {
    const double w = o_.width - kRight, h = o_.height - kBottom;
    s << "<rect x='" << kLeft << "' y='" << kTop << "' width='" << w - kLeft << "' height='" << h - kTop
      << "' fill='none' stroke='#444'/>\n";
    const double xs = tick_step(x0_, x1_, 8), ys = tick_step(y0_, y1_, 6);
    for (double x = std::ceil(x0_ / xs) * xs; x <= x1_ + 1e-9; x += xs)
      s << "<line x1='" << px(x) << "' y1='" << kTop << "' x2='" << px(x) << "' y2='" << h
        << "' stroke='#ddd'/><text x='" << px(x) << "' y='" << h + 16 << "' text-anchor='middle'>" << fmt(x)
        << "</text>\n";
    for (double y = std::ceil(y0_ / ys) * ys; y <= y1_ + 1e-9; y += ys)
      s << "<line x1='" << kLeft << "' y1='" << py(y) << "' x2='" << w << "' y2='" << py(y)
        << "' stroke='#ddd'/><text x='" << kLeft - 6 << "' y='" << py(y) + 4 << "' text-anchor='end'>" << fmt(y)
        << "</text>\n";
    s << "<text x='" << (kLeft + w) / 2 << "' y='" << o_.height - 8 << "' text-anchor='middle'>step</text>\n"
      << "<text transform='translate(16," << (kTop + h) / 2 << ") rotate(-90)' text-anchor='middle'>loss (nats/token)"
      << "</text>\n<text x='" << (kLeft + w) / 2 << "' y='22' text-anchor='middle' font-size='16'>"
      << escape(o_.title) << "</text>\n";
  }
  void line(std::ostringstream& s, const Series& d, const char* color) const {
    if (d.x.empty()) return;
    s << "<polyline fill='none' stroke='" << color << "' stroke-width='1.5' points='";
    for (size_t i = 0; i < d.x.size(); ++i) s << px(d.x[i]) << "," << py(d.y[i]) << " ";
    s << "'/>\n";
  }
  void dots(std::ostringstream& s, const Series& d, const char* color) const {
    for (size_t i = 0; i < d.x.size(); ++i)
      s << "<circle cx='" << px(d.x[i]) << "' cy='" << py(d.y[i]) << "' r='3' fill='" << color << "'/>\n";
  }
  void legend(std::ostringstream& s, int row, const char* color, const std::string& label) const {
    const double x = o_.width - kRight - 150, y = kTop + 18 + 18 * row;
    s << "<line x1='" << x << "' y1='" << y - 4 << "' x2='" << x + 24 << "' y2='" << y - 4 << "' stroke='" << color
      << "' stroke-width='2'/><text x='" << x + 30 << "' y='" << y << "'>" << escape(label) << "</text>\n";
  }

 private:
  static constexpr double kLeft = 64, kRight = 20, kTop = 36, kBottom = 44;
  const PlotOptions& o_;
  double x0_, x1_, y0_, y1_;
};

}  // namespace

std::string plot_metrics_svg(const std::string& path, const PlotOptions& o) {
  Series train, val;
  for (const nlohmann::ordered_json& j : read_metrics(path)) {
    if (!j.contains("step") || !j["step"].is_number()) continue;
    const double step = j["step"].get<double>();
    if (j.contains("loss") && j["loss"].is_number()) {
      train.x.push_back(step);
      train.y.push_back(j["loss"].get<double>());
    }
    if (j.contains("val_loss") && j["val_loss"].is_number()) {
      val.x.push_back(step);
      val.y.push_back(j["val_loss"].get<double>());
    }
  }
  MERLIN_CHECK(!train.x.empty() || !val.x.empty(), path, ": no loss records to plot");
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  for (const Series* s : {&train, &val})
    for (size_t i = 0; i < s->x.size(); ++i) {
      x0 = std::min(x0, s->x[i]);
      x1 = std::max(x1, s->x[i]);
      y0 = std::min(y0, s->y[i]);
      y1 = std::max(y1, s->y[i]);
    }
  const double pad = (y1 - y0) * 0.05 + 1e-6;
  const Canvas cv(o, std::min(0.0, x0), x1, std::max(0.0, y0 - pad), y1 + pad);
  std::ostringstream s;
  s << "<?xml version='1.0' encoding='UTF-8'?>\n<svg xmlns='http://www.w3.org/2000/svg' width='" << o.width
    << "' height='" << o.height << "' font-family='sans-serif' font-size='12'>\n"
    << "<rect width='100%' height='100%' fill='white'/>\n";
  cv.axes(s);
  cv.line(s, train, "#1f77b4");
  cv.line(s, val, "#d62728");
  cv.dots(s, val, "#d62728");
  int row = 0;
  if (!train.x.empty()) cv.legend(s, row++, "#1f77b4", "train loss");
  if (!val.x.empty()) cv.legend(s, row++, "#d62728", "val loss");
  s << "</svg>\n";
  return s.str();
}

}  // namespace merlin::train
