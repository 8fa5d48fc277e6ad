// Autoregressive sampling with temperature and top-k (no KV cache: each new token runs the
// model over the last max_seq_len tokens, in inference mode, so nothing is saved).
#pragma once
#include <vector>

#include "core/random.h"
#include "nn/transformer.h"

namespace tally::train {

struct SampleOptions {
  int64_t tokens = 64;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 40;        // 0: no truncation
  int32_t stop_token = -1;   // generation ends after this token (GPT-2's <|endoftext|>); -1: never
};

std::vector<int32_t> sample(const nn::Transformer& model, std::vector<int32_t> prompt, const SampleOptions& options,
                            Rng& rng);

}  // namespace tally::train
