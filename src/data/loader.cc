#include "data/loader.h"

#include <algorithm>

namespace tally::data {

TokenLoader::TokenLoader(const std::string& pattern, int64_t batch_size, int64_t seq_len, int64_t vocab_size,
                         const std::string& split)
    : B_(batch_size), T_(seq_len), vocab_(vocab_size) {
  TALLY_CHECK(B_ > 0 && T_ > 0, "--batch-size and --seq-len must be positive (got ", B_, " and ", T_, ")");
  files_ = expand_glob(pattern, split);
  for (const std::string& f : files_) {
    shards_.push_back(TokenShard::open(f));
    const int64_t bad = shards_.back().find_token_at_or_above(vocab_);
    TALLY_CHECK(bad < 0, split, " shard '", f, "': token ", bad < 0 ? 0 : shards_.back().at(bad), " at position ", bad,
                " is outside the model's vocabulary of ", vocab_, " (was it tokenized for another model?)");
    starts_.push_back(total_);
    total_ += shards_.back().size();
  }
  TALLY_CHECK(total_ >= B_ * T_ + 1, split, " '", pattern, "' holds ", total_, " tokens; one batch of ", B_, "x", T_,
              " needs ", B_ * T_ + 1);
  // Persistent, owner-tagged buffers reused for every batch: the loader never grows.
  auto owner = [](const char* n) { return make_owner(Category::Data, n, /*persistent=*/true); };
  batch_.inputs = Tensor::empty({B_, T_}, DType::I32, Device::cpu(), owner("loader.inputs"));
  batch_.targets = Tensor::empty({B_, T_}, DType::I32, Device::cpu(), owner("loader.targets"));
  window_.resize(static_cast<size_t>(B_ * T_ + 1));
}

const Batch& TokenLoader::batch_at(int64_t step, int64_t microbatch, int64_t microbatches_per_step) {
  return batch_from((step * microbatches_per_step + microbatch) * B_ * T_);
}

std::string TokenLoader::first_16_bit_shard() const {
  for (size_t i = 0; i < shards_.size(); ++i)
    if (shards_[i].width() == TokenWidth::U16) return files_[i];
  return "";
}

const Batch& TokenLoader::batch_from(int64_t first_token) {
  const int64_t n = B_ * T_ + 1;
  TALLY_CHECK(first_token >= 0, "data loader: negative token position ", first_token);
  int64_t pos = first_token % total_;
  int64_t filled = 0;
  while (filled < n) {
    // Find the shard holding `pos` and copy as much as it has.
    size_t s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), pos) - starts_.begin() - 1);
    int64_t local = pos - starts_[s];
    int64_t take = std::min(n - filled, shards_[s].size() - local);
    shards_[s].read(local, take, window_.data() + filled);
    filled += take;
    pos = (pos + take) % total_;
  }
  int32_t* in = batch_.inputs.data<int32_t>();
  int32_t* tg = batch_.targets.data<int32_t>();
  for (int64_t i = 0; i < n - 1; ++i) {
    TALLY_CHECK(window_[i] >= 0 && window_[i] < vocab_, "token ", window_[i], " at data position ",
                (first_token + i) % total_, " is outside the model's vocabulary of ", vocab_);
    in[i] = window_[i];
    tg[i] = window_[i + 1];
  }
  TALLY_CHECK(window_[n - 1] >= 0 && window_[n - 1] < vocab_, "token ", window_[n - 1], " is outside the vocabulary of ", vocab_);
  batch_.inputs.storage().bump_version();
  batch_.targets.storage().bump_version();
  return batch_;
}

}  // namespace tally::data
