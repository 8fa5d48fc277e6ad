#include "train/sampler.h"

#include <algorithm>
#include <cmath>

#include "autograd/grad_mode.h"

namespace tally::train {

std::vector<int32_t> sample(const nn::Transformer& model, std::vector<int32_t> tokens, const SampleOptions& opt,
                            Rng& rng) {
  autograd::InferenceModeGuard inference;
  OwnerScope scope("sample");
  const auto& c = model.config();
  TALLY_CHECK(!tokens.empty(), "sample: the prompt must hold at least one token");
  std::vector<int32_t> generated;
  for (int64_t i = 0; i < opt.tokens; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(tokens.size()), c.max_seq_len);
    std::vector<int32_t> window(tokens.end() - T, tokens.end());
    Tensor input = Tensor::from_vector(window, {1, T});
    Tensor logits = model.forward(input, Tensor(), true).logits;  // (1, T, Vp)
    const float* last = logits.data<float>() + (T - 1) * c.padded_vocab_size;
    std::vector<std::pair<float, int32_t>> scored;
    scored.reserve(static_cast<size_t>(c.vocab_size));
    for (int64_t v = 0; v < c.vocab_size; ++v) scored.emplace_back(last[v], static_cast<int32_t>(v));
    int32_t next;
    if (opt.temperature <= 0) {
      next = std::max_element(scored.begin(), scored.end())->second;
    } else {
      if (opt.top_k > 0 && opt.top_k < static_cast<int64_t>(scored.size())) {
        std::partial_sort(scored.begin(), scored.begin() + opt.top_k, scored.end(), std::greater<>());
        scored.resize(static_cast<size_t>(opt.top_k));
      }
      double max_logit = -1e30;
      for (auto& [l, v] : scored) max_logit = std::max<double>(max_logit, l);
      std::vector<double> probs;
      double total = 0;
      for (auto& [l, v] : scored) total += probs.emplace_back(std::exp((l - max_logit) / opt.temperature));
      double r = rng.uniform() * total;
      size_t j = 0;
      for (; j + 1 < probs.size() && r >= probs[j]; ++j) r -= probs[j];
      next = scored[j].second;
    }
    tokens.push_back(next);
    generated.push_back(next);
    if (next == opt.stop_token) break;
  }
  return generated;
}

}  // namespace tally::train
