// Tests for the training data's order: the computed permutation (data/permutation.h) and
// the loader's file-order and shuffled batches (data/loader.h).
#include <gtest/gtest.h>

#include "support.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "data/loader.h"
#include "data/permutation.h"
#include "data/token_shard.h"

namespace tally {
namespace {

std::vector<int64_t> images(int64_t n, uint64_t key) {
  data::Permutation p(n, key);
  std::vector<int64_t> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = p(i);
  return out;
}

TEST(Permutation, IsABijectionOfEverySizeAndEachKeyPicksItsOwnOrder) {
  for (const int64_t n : {1, 2, 3, 4, 5, 7, 16, 17, 255, 1000, 4097}) {
    for (const uint64_t key : {0ull, 1ull, 1337ull}) {
      std::vector<int64_t> got = images(n, key);
      std::vector<int64_t> sorted = got;
      std::sort(sorted.begin(), sorted.end());
      std::vector<int64_t> all(static_cast<size_t>(n));
      std::iota(all.begin(), all.end(), 0);
      ASSERT_EQ(sorted, all) << "n " << n << ", key " << key << ": not every index once";
      EXPECT_EQ(got, images(n, key)) << "n " << n << ": the same key must give the same order";
      if (n >= 16) {
        EXPECT_NE(got, all) << "n " << n << ", key " << key << ": the identity";
        EXPECT_NE(got, images(n, key + 1)) << "n " << n << ": keys " << key << " and " << key + 1 << " agree";
      }
    }
  }
  EXPECT_THROW(data::Permutation(0, 1), std::exception);
  EXPECT_THROW(data::Permutation(5, 1)(5), std::exception);
}

// A shuffle that only stirred the low bits, or sent neighbours to neighbours, would pass
// the bijection test. Against what a uniformly random permutation of n gives: the mean
// displacement E|p(i) - i| = (n^2 - 1) / 3n ~ n/3; about one fixed point; and successive
// images (p(i), p(i+1)) spread evenly over an 8 x 8 grid of [0, n)^2, a chi-square of 63
// degrees of freedom (mean 63, sd 11). Bounds at several standard deviations. A network
// of one round (which maps i to (i mod 2^h) 2^h + ...) or two fails the grid (chi-square
// 21509; 353 and 516); the four rounds read 31-58, displacement 0.324-0.339 n, 1 fixed point.
TEST(Permutation, MovesIndicesAsFarAsAUniformShuffleDoes) {
  const int64_t n = 4096;
  for (const uint64_t key : {1ull, 2ull, 99ull}) {
    const std::vector<int64_t> p = images(n, key);
    double displacement = 0;
    int fixed = 0;
    std::vector<double> grid(64, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      displacement += static_cast<double>(std::llabs(p[static_cast<size_t>(i)] - i));
      fixed += p[static_cast<size_t>(i)] == i;
      if (i + 1 < n) grid[static_cast<size_t>(p[static_cast<size_t>(i)] * 8 / n * 8 + p[static_cast<size_t>(i + 1)] * 8 / n)] += 1;
    }
    displacement /= static_cast<double>(n);
    const double expected = static_cast<double>(n - 1) / 64.0;
    double chi2 = 0;
    for (const double count : grid) chi2 += (count - expected) * (count - expected) / expected;
    EXPECT_NEAR(displacement / static_cast<double>(n), 1.0 / 3.0, 0.03) << "key " << key;
    EXPECT_LE(fixed, 8) << "key " << key;
    EXPECT_LT(chi2, 130) << "key " << key << ": successive images cluster";
  }
}

// Two shards whose token at global position i is i (so a row says where it was read
// from), 1000 tokens in all: the last sequences cross from the first shard into the second.
std::string write_counting_shards() {
  std::vector<int32_t> a(600), b(400);
  std::iota(a.begin(), a.end(), 0);
  std::iota(b.begin(), b.end(), 600);
  const std::string dir = test::temp_path("counting");
  std::filesystem::create_directories(dir);
  data::write_token_shard(dir + "/part_0.bin", a, data::TokenWidth::U16);
  data::write_token_shard(dir + "/part_1.bin", b, data::TokenWidth::U16);
  return dir + "/part_*.bin";
}

// The first token of every row of `batches` batches (microbatch 0 of steps 0, 1, ...),
// after checking that each row is one window of T+1 tokens read in place.
std::vector<int32_t> row_starts(data::TokenLoader& loader, int64_t batches, int64_t B, int64_t T) {
  std::vector<int32_t> starts;
  for (int64_t k = 0; k < batches; ++k) {
    const data::Batch& batch = loader.batch_at(k, 0, 1);
    const int32_t* in = batch.inputs.data<int32_t>();
    const int32_t* tg = batch.targets.data<int32_t>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        EXPECT_EQ(in[b * T + t], in[b * T] + t) << "batch " << k << " row " << b;
        EXPECT_EQ(tg[b * T + t], in[b * T + t] + 1) << "batch " << k << " row " << b;
      }
      starts.push_back(in[b * T]);
    }
  }
  return starts;
}

TEST(TokenLoader, FileOrderReadsConsecutiveTokens) {
  const int64_t B = 3, T = 10;
  data::TokenLoader loader(write_counting_shards(), B, T, 1000);
  EXPECT_EQ(loader.tokens_per_pass(), 1000);
  const std::vector<int32_t> starts = row_starts(loader, 4, B, T);
  for (size_t i = 0; i < starts.size(); ++i) EXPECT_EQ(starts[i], static_cast<int32_t>(i * T));
}

TEST(TokenLoader, ShuffledReadsEverySequenceOncePerPassInANewOrderEachPass) {
  const int64_t B = 3, T = 10;
  // 1000 tokens: S = 999 / 10 = 99 sequences, 33 batches of 3 rows a pass.
  data::TokenLoader loader(write_counting_shards(), B, T, 1000);
  loader.shuffle_sequences(1337);
  EXPECT_EQ(loader.tokens_per_pass(), 990);
  const std::vector<int32_t> starts = row_starts(loader, 66, B, T);
  const std::vector<int32_t> pass1(starts.begin(), starts.begin() + 99), pass2(starts.begin() + 99, starts.end());
  std::vector<int32_t> sequences(99);
  for (int i = 0; i < 99; ++i) sequences[static_cast<size_t>(i)] = i * T;
  for (const auto* pass : {&pass1, &pass2}) {
    std::vector<int32_t> sorted = *pass;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, sequences) << "a pass reads every sequence once";
  }
  EXPECT_NE(pass1, sequences) << "the first pass is in file order";
  EXPECT_NE(pass1, pass2) << "the second pass repeats the first's order";

  // The order is a function of the seed and the position alone: a second loader reading
  // the same batches out of order agrees, and another seed does not.
  data::TokenLoader again(write_counting_shards(), B, T, 1000);
  again.shuffle_sequences(1337);
  const data::Batch& b40 = again.batch_at(40, 0, 1);
  for (int64_t b = 0; b < B; ++b) EXPECT_EQ(b40.inputs.data<int32_t>()[b * T], starts[static_cast<size_t>(40 * B + b)]);
  data::TokenLoader other(write_counting_shards(), B, T, 1000);
  other.shuffle_sequences(1338);
  EXPECT_NE(row_starts(other, 33, B, T), pass1);
}

TEST(TokenLoader, ShuffledPassesEndMidBatchAndAcrossMicrobatches) {
  // B = 4 rows, 2 microbatches a step: 99 sequences a pass end inside a batch (row 3 of
  // microbatch 0 of step 12). Rows in reading order are the global sequence order: each
  // run of 99 is a pass, every sequence once.
  const int64_t B = 4, T = 10, M = 2;
  data::TokenLoader loader(write_counting_shards(), B, T, 1000);
  loader.shuffle_sequences(5);
  std::vector<int32_t> rows;
  for (int64_t k = 0; k < 25; ++k)
    for (int64_t m = 0; m < M; ++m) {
      const int32_t* in = loader.batch_at(k, m, M).inputs.data<int32_t>();
      for (int64_t b = 0; b < B; ++b) rows.push_back(in[b * T]);
    }
  ASSERT_GE(rows.size(), 198u);
  std::vector<int32_t> sequences(99);
  for (int i = 0; i < 99; ++i) sequences[static_cast<size_t>(i)] = i * T;
  for (size_t pass = 0; pass < 2; ++pass) {
    std::vector<int32_t> seen(rows.begin() + static_cast<std::ptrdiff_t>(99 * pass),
                              rows.begin() + static_cast<std::ptrdiff_t>(99 * (pass + 1)));
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, sequences) << "pass " << pass;
  }
}

}  // namespace
}  // namespace tally
