#include "data/permutation.h"

#include "core/error.h"
#include "core/random.h"

namespace tally::data {

namespace {
// SplitMix64's finalizer: every input bit reaches every output bit.
uint64_t mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

Permutation::Permutation(int64_t n, uint64_t key) : n_(n) {
  TALLY_CHECK(n >= 1 && n <= (int64_t{1} << 62), "a permutation of ", n, " elements (1 to 2^62)");
  // The smallest h with 2^(2h) >= n (h >= 1, so n = 1 and n = 2 have a network too).
  while (half_bits_ < 31 && (uint64_t{1} << (2 * half_bits_)) < static_cast<uint64_t>(n)) ++half_bits_;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  Rng rng(key);
  for (uint64_t& k : round_keys_) k = rng.next_u64();
}

uint64_t Permutation::network(uint64_t x) const {
  uint64_t left = x >> half_bits_, right = x & half_mask_;
  for (const uint64_t k : round_keys_) {
    const uint64_t next = left ^ (mix(right ^ k) & half_mask_);
    left = right;
    right = next;
  }
  return (left << half_bits_) | right;
}

int64_t Permutation::operator()(int64_t i) const {
  TALLY_CHECK(i >= 0 && i < n_, "permutation of ", n_, " elements: index ", i, " is outside it");
  uint64_t x = static_cast<uint64_t>(i);
  do x = network(x);
  while (x >= static_cast<uint64_t>(n_));
  return static_cast<int64_t>(x);
}

}  // namespace tally::data
