// Deterministic random numbers: xoshiro256** with a Box-Muller normal. The state is four
// words, saved in checkpoints, so a resumed run draws the same numbers (bit-exact resume)
// on any machine; std:: distributions are not portable across library versions.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>

namespace tally {

class Rng {
 public:
  explicit Rng(uint64_t seed = 1337) { reseed(seed); }

  void reseed(uint64_t seed) {
    // SplitMix64 spreads any seed over the four state words.
    for (auto& w : state_) {
      seed += 0x9E3779B97F4A7C15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      w = z ^ (z >> 31);
    }
  }

  uint64_t next_u64() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1) with 53 random bits.
  double uniform() { return static_cast<double>(next_u64() >> 11) * (1.0 / 9007199254740992.0); }

  // Standard normal (Box-Muller; one draw per call keeps the state simple).
  double normal() {
    double u1 = uniform(), u2 = uniform();
    if (u1 < 1e-300) u1 = 1e-300;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

  // Moves past n normal() draws without computing them (each takes two words).
  void discard_normals(int64_t n) {
    for (int64_t i = 0; i < 2 * n; ++i) next_u64();
  }

  const std::array<uint64_t, 4>& state() const { return state_; }
  void set_state(const std::array<uint64_t, 4>& s) { state_ = s; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  std::array<uint64_t, 4> state_{};
};

}  // namespace tally
