#include "train/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tally::train {

namespace {
// The next token from the last position's logits (the first vocab_size of them).
int32_t choose(const float* logits, int64_t vocab, const SampleOptions& opt, Rng& rng) {
  std::vector<std::pair<float, int32_t>> scored;
  scored.reserve(static_cast<size_t>(vocab));
  for (int64_t v = 0; v < vocab; ++v) {
    // (NaN breaks the ordering the sort below needs; a sample of it would be garbage.)
    TALLY_CHECK(std::isfinite(logits[v]), "sample: the model's logits are not finite (token ", v, "'s is ", logits[v],
                "): its weights hold NaN or infinity, or overflow");
    scored.emplace_back(logits[v], static_cast<int32_t>(v));
  }
  // Likelier first; equal logits (bf16 logits tie often) by the lower token id, as argmax
  // breaks ties in PyTorch and llm.c.
  auto likelier = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (opt.temperature <= 0) return std::min_element(scored.begin(), scored.end(), likelier)->second;
  const size_t keep = opt.top_k > 0 && opt.top_k < vocab ? static_cast<size_t>(opt.top_k) : scored.size();
  std::partial_sort(scored.begin(), scored.begin() + static_cast<std::ptrdiff_t>(keep), scored.end(), likelier);
  scored.resize(keep);
  // softmax(logits / temperature) over the kept tokens, most likely first.
  const double max_logit = scored.front().first;
  std::vector<double> probs;
  double total = 0;
  for (auto& [l, v] : scored) total += probs.emplace_back(std::exp((l - max_logit) / opt.temperature));
  if (opt.top_p < 1.0) {
    // The nucleus: the shortest prefix whose probability reaches top_p.
    double mass = 0;
    size_t n = 0;
    while (n < probs.size() && mass < opt.top_p * total) mass += probs[n++];
    probs.resize(std::max<size_t>(n, 1));
    total = 0;
    for (double p : probs) total += p;
  }
  double r = rng.uniform() * total;
  size_t j = 0;
  for (; j + 1 < probs.size() && r >= probs[j]; ++j) r -= probs[j];
  return scored[j].second;
}
}  // namespace

std::vector<int32_t> sample(const nn::Transformer& model, std::vector<int32_t> tokens, const SampleOptions& opt,
                            Rng& rng) {
  autograd::InferenceModeGuard inference;
  OwnerScope scope("sample");
  const auto& c = model.config();
  TALLY_CHECK(!tokens.empty(), "sample: the prompt must hold at least one token");
  TALLY_CHECK(opt.top_p > 0 && opt.top_p <= 1, "sample: top_p must be in (0, 1], got ", opt.top_p);
  // (The sum is bounded first: --tokens may be as large as int64 holds, a sample that runs
  // until a stop token.)
  const int64_t capacity = std::min<int64_t>(
      c.max_seq_len, static_cast<int64_t>(tokens.size()) + std::clamp<int64_t>(opt.tokens, 1, c.max_seq_len));
  nn::KvCache cache = model.make_kv_cache(1, capacity);
  // Runs `ids` through the model after what the cache holds; returns the last logits row.
  auto feed = [&](const std::vector<int32_t>& ids) {
    Tensor input = Tensor::from_vector(ids, {1, static_cast<int64_t>(ids.size())}).to(model.device());
    Tensor logits = model.forward(input, Tensor(), true, &cache).logits;  // (1, T, Vp)
    // The next token is drawn on the host: the last row comes back as fp32.
    Tensor last_row = logits.slice(1, logits.shape()[1] - 1, logits.shape()[1]);
    Tensor host = Tensor::empty(last_row.shape(), DType::F32, Device::cpu(), current_owner("sample_logits"));
    host.copy_(last_row);
    return host;
  };
  const int64_t window = std::min<int64_t>(static_cast<int64_t>(tokens.size()), capacity);
  Tensor last = feed(std::vector<int32_t>(tokens.end() - window, tokens.end()));
  std::vector<int32_t> generated;
  for (int64_t i = 0; i < opt.tokens; ++i) {
    const int32_t next = choose(last.data<float>(), c.vocab_size, opt, rng);
    tokens.push_back(next);
    generated.push_back(next);
    const bool stop = std::find(opt.stop_tokens.begin(), opt.stop_tokens.end(), next) != opt.stop_tokens.end();
    if (stop || i + 1 == opt.tokens) break;
    if (cache.length == cache.capacity()) {
      // Context full: restart the cache from the last half of the sequence.
      cache.length = 0;
      const int64_t keep = std::max<int64_t>(cache.capacity() / 2, 1);
      last = feed(std::vector<int32_t>(tokens.end() - keep, tokens.end()));
    } else {
      last = feed({next});
    }
  }
  return generated;
}

void check_tokenizer_for_model(const data::Tokenizer& tok, const std::string& tokenizer, int64_t model_vocab,
                               const std::string& model, bool warn) {
  const std::string named = model.empty() ? "" : " '" + model + "'";
  TALLY_CHECK(tok.vocab_size() <= model_vocab, "--tokenizer '", tokenizer, "' has ", tok.vocab_size(),
              " tokens but the model", named, " only ", model_vocab, ": it is not this model's tokenizer");
  // Qwen's models round the vocabulary up past the tokenizer's: the rows past it are the
  // models' own padding.
  const bool qwen_padding =
      tok.is_qwen() && (model_vocab == data::kQwenVocabSize || model_vocab == data::kQwen25LargeVocabSize);
  if (warn && tok.vocab_size() < model_vocab && !qwen_padding)
    std::fprintf(stderr, "tally: warning: --tokenizer '%s' has %lld tokens and the model%s %lld: is it this model's "
                 "tokenizer? (ids it lacks cannot be shown as text)\n", tokenizer.c_str(),
                 static_cast<long long>(tok.vocab_size()), named.c_str(), static_cast<long long>(model_vocab));
}

std::string decode_known(const data::Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string text;
  std::vector<int32_t> run;
  for (int32_t id : ids) {
    if (id >= 0 && id < tok.vocab_size()) {
      run.push_back(id);
      continue;
    }
    text += tok.decode(run) + "<|id " + std::to_string(id) + "|>";
    run.clear();
  }
  return text + tok.decode(run);
}

DocumentBounds document_bounds(const nn::TransformerConfig& config, const data::Tokenizer* tok) {
  // A LLaMA or Qwen model's bounds come from its tokenizer.json, not from an llm.c .bin,
  // which only decodes and names one token (its end of text).
  using Family = nn::TransformerConfig::Family;
  if (tok && (tok->is_llama3() || tok->is_qwen() || !config.llama_architecture()))
    return {tok->document_separator_id(), tok->stop_ids()};
  if (config.family == Family::Llama3 && config.vocab_size == data::kLlama3VocabSize)
    return {data::kLlama3BeginOfText, {data::kLlama3EndOfText, data::kLlama3BeginOfText}};
  if ((config.family == Family::Qwen2 || config.family == Family::Qwen3) && config.vocab_size > data::kQwenImEnd)
    return {data::kQwenEndOfText, {data::kQwenEndOfText, data::kQwenImEnd}};
  const auto last = static_cast<int32_t>(config.vocab_size - 1);
  return {last, {last}};
}

}  // namespace tally::train
