// Progress reporting for long work: a redrawn bar with rate and ETA on a terminal, plain lines
// (at most one every few seconds) otherwise.
#pragma once
#include <cstdint>
#include <string>

namespace merlin {

class Progress {
 public:
  Progress(std::string label, uint64_t total, std::string unit = "");
  ~Progress();
  void update(uint64_t done);  // absolute position
  void advance(uint64_t n) { update(done_ + n); }
  void finish();

 private:
  void draw(bool final);
  std::string label_, unit_;
  uint64_t total_, done_ = 0;
  double start_, last_draw_ = 0;
  bool tty_, finished_ = false;
};

}  // namespace merlin
