// Autoregressive sampling with temperature, top-k and top-p (nucleus), for both families.
// The prompt runs once through the model into a KV cache; each new token then runs alone,
// attending to the cache (nn::KvCache). When the sequence reaches the model's context,
// the cache restarts from the last half of it (a sliding window, re-run once).
#pragma once
#include <string>
#include <vector>

#include "core/random.h"
#include "data/tokenizer.h"
#include "nn/transformer.h"

namespace tally::train {

// The longest sample: one forward a token, and the text held whole (a million tokens is
// hours of generation on a CPU and a few MB of ids).
inline constexpr int64_t kMaxSampleTokens = 1'000'000;

struct SampleOptions {
  int64_t tokens = 64;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 40;        // 0: no truncation
  double top_p = 1.0;        // keep the most likely tokens whose probabilities sum to >= top_p; 1: all
  std::vector<int32_t> stop_tokens;  // generation ends after one of these (<|endoftext|>, ...)
};

std::vector<int32_t> sample(const nn::Transformer& model, std::vector<int32_t> prompt, const SampleOptions& options,
                            Rng& rng);

// Where a sample starts and what ends it: the separator `tally tokenize` writes before each
// document, and the tokens that end one. The tokenizer's when there is one; else the model
// family's: GPT-2's <|endoftext|> (the last of its 50,257 ids) for both, LLaMA-3's
// <|begin_of_text|> (128000) to start and <|end_of_text|> (128001) or the next document's
// start to stop, when the vocabulary is LLaMA-3's 128,256. A vocabulary of another size has
// no known separator: its last id. (A tokenizer's own bounds stand, but for a LLaMA model
// only a LLaMA-3 tokenizer's: an llm.c tokenizer .bin names only its end of text.)
struct DocumentBounds {
  int32_t start = 0;
  std::vector<int32_t> stops;
};
DocumentBounds document_bounds(const nn::TransformerConfig& config, const data::Tokenizer* tok);

// Whether `tok` (loaded from `tokenizer`, the --tokenizer flag's value) can turn a model's
// samples into text. More tokens than the model's vocabulary: another model's tokenizer
// (samples would start from a separator the embedding lacks), refused naming both. Fewer:
// it may be too, so a warning on stderr when `warn`. `model` names the model file in
// messages ("" for none).
void check_tokenizer_for_model(const data::Tokenizer& tok, const std::string& tokenizer, int64_t model_vocab,
                               const std::string& model, bool warn);

// The text of `ids`, each run of ids the tokenizer has decoded together; an id it lacks (a
// model with a larger vocabulary than the tokenizer) shows as <|id N|> rather than failing
// or vanishing from the sample. `tally sample` and the trainer's samples both print this.
std::string decode_known(const data::Tokenizer& tok, const std::vector<int32_t>& ids);

}  // namespace tally::train
