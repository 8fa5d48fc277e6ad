#include "train/run_data.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "train/run_setup.h"

namespace tally::train {

namespace fs = std::filesystem;

RunData::RunData(const TrainConfig& c, const dist::World& world, const nn::TransformerConfig& model)
    : root_(world.is_root()), train_(c.data.train, c.batch.batch_size, c.batch.seq_len, model.vocab_size, "--train-data") {
  if (c.data.shuffle) train_.shuffle_sequences(c.seed);
  if (!c.data.val.empty())
    val_ = std::make_unique<data::TokenLoader>(c.data.val, c.batch.batch_size, c.batch.seq_len, model.vocab_size, "--val-data");
  check_ranks_read_the_same_tokens(world);
  warn_of_mismatches(model);
  fit_val_batches(c);
}

// The data each rank reads (a path may differ between machines; what it holds may not).
// The tokens themselves, not only their count: a node holding another subset of shards of
// one size (llm.c's are all 100M tokens), or a stale copy, would train on them unseen.
void RunData::check_ranks_read_the_same_tokens(const dist::World& world) const {
  check_ranks_agree(world, {{"--train-data's token count", std::to_string(train_.total_tokens())},
                            {"--val-data's token count", val_ ? std::to_string(val_->total_tokens()) : "none"},
                            {"--train-data's tokens (a fingerprint of every token)", std::to_string(train_.fingerprint())},
                            {"--val-data's tokens (a fingerprint of every token)",
                             val_ ? std::to_string(val_->fingerprint()) : "none"}});
}

void RunData::warn_of_mismatches(const nn::TransformerConfig& model) const {
  if (!root_) return;
  // A vocabulary wider than 16 bits (LLaMA-3's 128,256) is not the tokenizer that wrote a
  // 16-bit shard (GPT-2's writes those): the ids are valid, the text they stand for is not.
  const data::TokenLoader* loaders[] = {&train_, val_.get()};
  for (const data::TokenLoader* loader : loaders) {
    const std::string narrow = loader && model.vocab_size > 65536 ? loader->first_16_bit_shard() : "";
    if (!narrow.empty())
      std::fprintf(stderr, "tally: warning: shard '%s' holds 16-bit tokens (a tokenizer of at most 65,536, such as "
                   "GPT-2's), but the model's vocabulary has %lld: was it tokenized for this model?\n",
                   narrow.c_str(), static_cast<long long>(model.vocab_size));
  }
  // A validation shard that is also a training shard (a glob that takes in the split held
  // out, the same file under two names): the validation loss would measure text the model
  // trains on. Said, not refused: a smoke run may validate on its training data on purpose.
  if (!val_) return;
  for (const std::string& val_file : val_->files()) {
    std::error_code ec;
    auto same = std::find_if(train_.files().begin(), train_.files().end(),
                             [&](const std::string& train_file) { return fs::equivalent(val_file, train_file, ec); });
    if (same == train_.files().end()) continue;
    std::fprintf(stderr, "tally: warning: --val-data shard '%s' is also a --train-data shard ('%s'): the validation "
                 "loss measures text the model trains on\n", val_file.c_str(), same->c_str());
    break;  // once: the first is enough to say the splits overlap
  }
}

// Validation reads consecutive batches; past the end of the data they would wrap around
// and count tokens twice. At most the batches the data holds (at least one).
void RunData::fit_val_batches(const TrainConfig& c) {
  val_batches_ = c.validation.batches;
  if (!val_) return;
  const int64_t held = std::max<int64_t>(1, (val_->total_tokens() - 1) / val_->tokens_per_batch());
  if (val_batches_ <= held) return;
  if (!c.metrics.quiet && root_) {
    std::printf("validation: --val-batches %lld, but --val-data holds %lld tokens: %lld batch%s of %lld x %lld; "
                "validating on those\n",
                static_cast<long long>(val_batches_), static_cast<long long>(val_->total_tokens()),
                static_cast<long long>(held), held == 1 ? "" : "es", static_cast<long long>(c.batch.batch_size),
                static_cast<long long>(c.batch.seq_len));
    std::fflush(stdout);
  }
  val_batches_ = held;
}

}  // namespace tally::train
