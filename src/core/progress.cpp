#include "core/progress.h"

#include <cstdio>

#include "core/sys.h"

namespace merlin {

Progress::Progress(std::string label, uint64_t total, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), start_(now_seconds()),
      tty_(stderr_is_terminal()) {}

Progress::~Progress() { finish(); }

void Progress::update(uint64_t done) {
  done_ = done;
  const double t = now_seconds();
  if (t - last_draw_ >= (tty_ ? 0.1 : 5.0)) {
    last_draw_ = t;
    draw(false);
  }
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  draw(true);
}

void Progress::draw(bool final) {
  const double elapsed = now_seconds() - start_;
  const double frac = total_ ? (double)done_ / (double)total_ : 1.0;
  const double rate = elapsed > 0 ? (double)done_ / elapsed : 0;
  const double eta = rate > 0 && total_ > done_ ? (double)(total_ - done_) / rate : 0;
  const bool bytes = unit_ == "B";
  const std::string rate_s = bytes ? format_bytes((uint64_t)rate) + "/s" : std::to_string((uint64_t)rate) + " " + unit_ + "/s";
  if (tty_) {
    const int width = 30, filled = (int)(frac * width);
    std::string bar(filled, '#');
    bar.resize(width, '.');
    std::fprintf(stderr, "\r%s [%s] %5.1f%% %s ETA %.0fs   ", label_.c_str(), bar.c_str(), frac * 100,
                 rate_s.c_str(), eta);
    if (final) std::fprintf(stderr, "\n");
  } else {
    std::fprintf(stderr, "%s: %.1f%% (%llu/%llu) %s, elapsed %.1fs, ETA %.0fs\n", label_.c_str(), frac * 100,
                 (unsigned long long)done_, (unsigned long long)total_, rate_s.c_str(), elapsed, eta);
  }
  std::fflush(stderr);
}

}  // namespace merlin
