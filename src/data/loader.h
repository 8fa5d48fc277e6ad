// Reads (B, T) training batches from llm.c token shards, deterministically. In file order
// (the default): microbatch m of step k (N microbatches per step) reads the B*T+1 tokens
// starting at token (k*N + m)*B*T of the concatenated shards, wrapping at the end; inputs
// are the first B*T, targets the same shifted by one.
//
// Shuffled (shuffle_sequences): the data is S = floor((tokens - 1) / T) sequences of T+1
// tokens, sequence s starting at token s*T. Row b of that microbatch is the data's
// sequence number n = (k*N + m)*B + b in the order of pass e = n / S over the data, which
// is a fresh permutation of the S sequences per pass (data/permutation.h, keyed by the
// seed and e): every sequence once per pass, in a new order each time.
//
// Either way the position is a function of (k, m), so resuming needs no loader state and
// data-parallel ranks, reading microbatches k*N*D + m*D + r, split one global order.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/token_shard.h"

namespace tally::data {

struct Batch {
  Tensor inputs;   // (B, T) int32
  Tensor targets;  // (B, T) int32
};

// Where a step's batches come from: the loader's two persistent (B, T) buffers, filled
// for microbatch `microbatch` of step `step`, or from data position `first_token`.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  virtual const Batch& batch_at(int64_t step, int64_t microbatch, int64_t microbatches_per_step) = 0;
  virtual const Batch& batch_from(int64_t first_token) = 0;
};

// The two persistent, owner-tagged (B, T) buffers a loader fills for every batch.
Batch batch_buffers(int64_t batch_size, int64_t seq_len, Device device);

// A dry run's batches (the meta device's): the loader's buffers, with shapes and no tokens.
class ShapeOnlyBatches final : public BatchSource {
 public:
  ShapeOnlyBatches(int64_t batch_size, int64_t seq_len, Device device)
      : batch_(batch_buffers(batch_size, seq_len, device)) {}
  const Batch& batch_at(int64_t, int64_t, int64_t) override { return batch_; }
  const Batch& batch_from(int64_t) override { return batch_; }

 private:
  Batch batch_;
};

class TokenLoader final : public BatchSource {
 public:
  // `pattern` is a glob; every matching shard is opened and validated now, every token
  // included (one outside the vocabulary is reported before the first step, naming the
  // shard, the position and `split`, e.g. "--train-data").
  TokenLoader(const std::string& pattern, int64_t batch_size, int64_t seq_len, int64_t vocab_size,
              const std::string& split = "data");

  // Reads sequences in a fresh order on every pass over the data, keyed by `seed`.
  void shuffle_sequences(uint64_t seed);

  // Fills and returns the loader's two persistent buffers (no allocation per batch).
  const Batch& batch_at(int64_t step, int64_t microbatch, int64_t microbatches_per_step) override;
  // The batch of B*T + 1 consecutive tokens from data position `first_token` (validation
  // walks 0, B*T, 2*B*T, ...).
  const Batch& batch_from(int64_t first_token) override;

  int64_t total_tokens() const { return total_; }
  // A fingerprint of every token in order (TokenShard::Scan): ranks compare it.
  uint64_t fingerprint() const { return fingerprint_; }
  // Input tokens one pass over the data feeds the model: all of them in file order, S*T
  // shuffled (the last (tokens - 1) mod T begin no sequence).
  int64_t tokens_per_pass() const { return shuffled_ ? sequences_ * T_ : total_; }
  int64_t tokens_per_batch() const { return B_ * T_; }
  const std::vector<std::string>& files() const { return files_; }
  // The first shard holding 16-bit tokens (llm.c's version 1, which GPT-2's tokenizer
  // writes), or "" when every shard is 32-bit.
  std::string first_16_bit_shard() const;

 private:
  void read(int64_t pos, int64_t n, int32_t* out);  // n tokens from position pos, wrapping
  void check_vocabulary(const int32_t* tokens, int64_t n, int64_t pos) const;  // tokens read from pos
  const Batch& published();  // the batch's buffers, their versions bumped

  int64_t B_, T_, vocab_;
  std::vector<std::string> files_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> starts_;  // first global token index of each shard
  int64_t total_ = 0;
  uint64_t fingerprint_ = 0;
  bool shuffled_ = false;
  uint64_t seed_ = 0;
  int64_t sequences_ = 0;  // S, when shuffled
  Batch batch_;
  std::vector<int32_t> window_;
};

}  // namespace tally::data
