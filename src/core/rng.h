// Deterministic random numbers (xoshiro256** seeded by splitmix64). The standard library's distributions
// differ between implementations; ours give the same model for the same seed everywhere.
#pragma once
#include <cmath>
#include <cstdint>

namespace merlin {

// splitmix64's finalizer: a well-mixed 64-bit hash of z (seeding, and hashed masks such as the trainer's dropout).
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) { reseed(seed); }
  void reseed(uint64_t seed) {
    for (auto& w : s_) {
      seed += 0x9e3779b97f4a7c15ull;
      w = mix64(seed);
    }
    has_spare_ = false;
  }
  uint64_t next_u64() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // Uniform in [0, 1) with 24 bits, exactly representable as float.
  float uniform() { return (float)(next_u64() >> 40) * (1.0f / 16777216.0f); }
  double uniform_double() { return (double)(next_u64() >> 11) * (1.0 / 9007199254740992.0); }
  uint64_t below(uint64_t n) { return n == 0 ? 0 : next_u64() % n; }
  // Standard normal (Box-Muller, in double so the result is portable).
  float normal() {
    if (has_spare_) {
      has_spare_ = false;
      return (float)spare_;
    }
    double u1 = uniform_double(), u2 = uniform_double();
    if (u1 < 1e-300) u1 = 1e-300;
    const double r = std::sqrt(-2.0 * std::log(u1));
    spare_ = r * std::sin(2.0 * M_PI * u2);
    has_spare_ = true;
    return (float)(r * std::cos(2.0 * M_PI * u2));
  }
  // Full state, for checkpoints.
  struct State {
    uint64_t s[4];
    double spare;
    bool has_spare;
  };
  State state() const { return {{s_[0], s_[1], s_[2], s_[3]}, spare_, has_spare_}; }
  void set_state(const State& st) {
    for (int i = 0; i < 4; ++i) s_[i] = st.s[i];
    spare_ = st.spare;
    has_spare_ = st.has_spare;
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
  double spare_ = 0;
  bool has_spare_ = false;
};

}  // namespace merlin
