// Reads (B, T) training batches from llm.c token shards, deterministically:
// microbatch m of step k (N microbatches per step) reads the B*T+1 tokens starting at
// token (k*N + m)*B*T of the concatenated shards, wrapping at the end; inputs are the
// first B*T, targets the same shifted by one. The position is a function of (k, m), so
// resuming needs no loader state.
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

class TokenLoader {
 public:
  // `pattern` is a glob; every matching shard is opened and validated now, every token
  // included (one outside the vocabulary is reported before the first step, naming the
  // shard, the position and `split`, e.g. "--train-data").
  TokenLoader(const std::string& pattern, int64_t batch_size, int64_t seq_len, int64_t vocab_size,
              const std::string& split = "data");

  // Fills and returns the loader's two persistent buffers (no allocation per batch).
  const Batch& batch_at(int64_t step, int64_t microbatch, int64_t microbatches_per_step);
  // The `index`-th consecutive batch (for validation: 0, 1, 2, ...).
  const Batch& batch_from(int64_t first_token);

  int64_t total_tokens() const { return total_; }
  int64_t tokens_per_batch() const { return B_ * T_; }
  const std::vector<std::string>& files() const { return files_; }
  // The first shard holding 16-bit tokens (llm.c's version 1, which GPT-2's tokenizer
  // writes), or "" when every shard is 32-bit.
  std::string first_16_bit_shard() const;

 private:
  int64_t B_, T_, vocab_;
  std::vector<std::string> files_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> starts_;  // first global token index of each shard
  int64_t total_ = 0;
  Batch batch_;
  std::vector<int32_t> window_;
};

}  // namespace tally::data
