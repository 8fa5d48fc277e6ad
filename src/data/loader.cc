#include "data/loader.h"

#include <algorithm>

#include "data/permutation.h"

namespace tally::data {

// Reused for every batch: the loader never grows.
Batch batch_buffers(int64_t batch_size, int64_t seq_len, Device device) {
  auto owner = [](const char* n) { return make_owner(Category::Data, n, /*persistent=*/true); };
  return {Tensor::empty({batch_size, seq_len}, DType::I32, device, owner("loader.inputs")),
          Tensor::empty({batch_size, seq_len}, DType::I32, device, owner("loader.targets"))};
}

TokenLoader::TokenLoader(const std::string& pattern, int64_t batch_size, int64_t seq_len, int64_t vocab_size,
                         const std::string& split)
    : B_(batch_size), T_(seq_len), vocab_(vocab_size) {
  TALLY_CHECK(B_ > 0 && T_ > 0, "--batch-size and --seq-len must be positive (got ", B_, " and ", T_, ")");
  files_ = expand_glob(pattern, split);
  for (const std::string& f : files_) {
    shards_.push_back(TokenShard::open(f));
    const TokenShard::Scan scanned = shards_.back().scan(vocab_, total_);
    const int64_t bad = scanned.first_at_or_above;
    fingerprint_ += scanned.fingerprint;
    // (Named as the unsigned value the file holds: a 32-bit token past INT32_MAX reads back
    // as a negative int32.)
    TALLY_CHECK(bad < 0, split, " shard '", f, "': token ", bad < 0 ? 0u : static_cast<uint32_t>(shards_.back().at(bad)),
                " at position ", bad,
                " is outside the model's vocabulary of ", vocab_, " (was it tokenized for another model?)");
    starts_.push_back(total_);
    total_ += shards_.back().size();
  }
  TALLY_CHECK(total_ >= B_ * T_ + 1, split, " '", pattern, "' holds ", total_, " tokens; one batch of ", B_, "x", T_,
              " needs ", B_ * T_ + 1);
  batch_ = batch_buffers(B_, T_, Device::cpu());
  window_.resize(static_cast<size_t>(B_ * T_ + 1));
}

void TokenLoader::shuffle_sequences(uint64_t seed) {
  shuffled_ = true;
  seed_ = seed;
  sequences_ = (total_ - 1) / T_;  // >= B >= 1: the constructor checked B*T + 1 tokens
}

const Batch& TokenLoader::batch_at(int64_t step, int64_t microbatch, int64_t microbatches_per_step) {
  const int64_t index = step * microbatches_per_step + microbatch;
  if (!shuffled_) return batch_from(index * B_ * T_);
  int32_t* in = batch_.inputs.data<int32_t>();
  int32_t* tg = batch_.targets.data<int32_t>();
  for (int64_t b = 0; b < B_; ++b) {
    const int64_t n = index * B_ + b;  // the data's sequence number, counted over every pass
    // Pass e's order, keyed by the seed and e together (the generator that draws the
    // network's round keys spreads the key's bits).
    const uint64_t pass = static_cast<uint64_t>(n / sequences_);
    const Permutation order(sequences_, seed_ ^ (pass * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull));
    const int64_t pos = order(n % sequences_) * T_;
    read(pos, T_ + 1, window_.data());
    check_vocabulary(window_.data(), T_ + 1, pos);
    std::copy(window_.begin(), window_.begin() + T_, in + b * T_);
    std::copy(window_.begin() + 1, window_.begin() + T_ + 1, tg + b * T_);
  }
  return published();
}

std::string TokenLoader::first_16_bit_shard() const {
  for (size_t i = 0; i < shards_.size(); ++i)
    if (shards_[i].width() == TokenWidth::U16) return files_[i];
  return "";
}

void TokenLoader::read(int64_t pos, int64_t n, int32_t* out) {
  pos %= total_;
  int64_t filled = 0;
  while (filled < n) {
    // Find the shard holding `pos` and copy as much as it has.
    size_t s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin() - 1);
    int64_t local = pos - starts_[s];
    int64_t take = std::min(n - filled, shards_[s].size() - local);
    shards_[s].read(local, take, out + filled);
    filled += take;
    pos = (pos + take) % total_;
  }
}

void TokenLoader::check_vocabulary(const int32_t* tokens, int64_t n, int64_t pos) const {
  for (int64_t i = 0; i < n; ++i)
    TALLY_CHECK(tokens[i] >= 0 && tokens[i] < vocab_, "token ", static_cast<uint32_t>(tokens[i]), " at data position ",
                (pos + i) % total_,
                " is outside the model's vocabulary of ", vocab_);
}

const Batch& TokenLoader::published() {
  batch_.inputs.storage().bump_version();
  batch_.targets.storage().bump_version();
  return batch_;
}

const Batch& TokenLoader::batch_from(int64_t first_token) {
  const int64_t n = B_ * T_ + 1;
  TALLY_CHECK(first_token >= 0, "data loader: negative token position ", first_token);
  read(first_token, n, window_.data());
  check_vocabulary(window_.data(), n, first_token);
  std::copy(window_.begin(), window_.begin() + (n - 1), batch_.inputs.data<int32_t>());
  std::copy(window_.begin() + 1, window_.end(), batch_.targets.data<int32_t>());
  return published();
}

}  // namespace tally::data
