// A seeded pseudo-random permutation of [0, n) that is computed, not stored: the loader's
// order of training sequences under --shuffle, a new order for every pass over the data.
//
// Why not a shuffled array: a corpus of 10B tokens in sequences of 1024 is 10M sequences,
// 80 MB of indices per pass held by every rank, outside the model's memory and rebuilt at
// each epoch. A computed permutation keeps the loader's position a pure function of
// (step, microbatch, row), as it is without shuffling, so resuming and data parallel need
// no loader state: every rank agrees on the whole order without talking.
//
// How: a balanced Feistel network on 2h bits (the smallest even width with 2^2h >= n),
// four rounds, each round's function a SplitMix64 hash of the right half and a round key
// drawn from the seed. A Feistel network is a bijection of [0, 2^2h) whatever its round
// function; "cycle walking" (apply it again while the value is >= n) restricts it to a
// bijection of [0, n), since the walk from i stays on i's cycle and that cycle re-enters
// [0, n). 2^2h <= 4n, so a walk takes at most four applications on average. n up to 2^62.
#pragma once
#include <array>
#include <cstdint>

namespace tally::data {

class Permutation {
 public:
  // The permutation of [0, n) (n >= 1) that `key` picks.
  Permutation(int64_t n, uint64_t key);
  int64_t size() const { return n_; }
  // The image of i, for 0 <= i < n.
  int64_t operator()(int64_t i) const;

 private:
  uint64_t network(uint64_t x) const;  // the Feistel network on [0, 2^2h)

  int64_t n_;
  int half_bits_ = 1;
  uint64_t half_mask_ = 1;
  std::array<uint64_t, 4> round_keys_{};
};

}  // namespace tally::data
