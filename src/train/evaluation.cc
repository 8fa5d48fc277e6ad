#include "train/evaluation.h"

#include <cstdio>

#include "autograd/grad_mode.h"
#include "train/sampler.h"

namespace tally::train {

Evaluator::Evaluator(const TrainConfig& c, const dist::World& world, const nn::TransformerConfig& model)
    : c_(c), world_(world), model_(model), sample_rng_(c.seed + 1) {
  if (c.data.tokenizer.empty()) return;
  tokenizer_ = std::make_unique<data::Tokenizer>(data::Tokenizer::load_path(c.data.tokenizer));
  check_tokenizer_for_model(*tokenizer_, c.data.tokenizer, model.vocab_size, "", world.is_root());
}

bool Evaluator::validates_at(int64_t step, bool last, const RunData& data) const {
  const int64_t every = c_.validation.every;
  return data.val() && ((every > 0 && step % every == 0) || last);
}

double Evaluator::validate(dist::StepEngine& engine, RunData& data) const {
  autograd::InferenceModeGuard inference;
  OwnerScope scope("eval");
  const PhaseMark phase("validation");
  data::TokenLoader& loader = *data.val();
  double total = 0;
  for (int64_t i = 0; i < data.val_batches(); ++i) total += engine.evaluate(loader.batch_from(i * loader.tokens_per_batch()));
  return total / static_cast<double>(std::max<int64_t>(data.val_batches(), 1));
}

bool Evaluator::samples_at(int64_t step, bool last) const {
  const SamplingConfig& s = c_.sampling;
  return (s.every > 0 && step % s.every == 0) || (last && s.tokens > 0 && s.every >= 0);
}

std::string Evaluator::text(const std::vector<int32_t>& ids) const {
  if (tokenizer_) return decode_known(*tokenizer_, ids);
  std::string s;
  for (int32_t i : ids) s += std::to_string(i) + " ";
  return s;
}

std::exception_ptr Evaluator::sample(dist::StepEngine& engine, bool last) {
  const bool say = !c_.metrics.quiet && world_.is_root();
  if (!engine.holds_whole_model()) {
    if (last && say)
      std::printf("sample: not drawn: sampling runs on a whole model, and this run's is split by --tp/--pp/--ep; %s\n",
                  c_.checkpoint.save_every > 0
                      ? ("`tally sample --model-file " + c_.checkpoint.out_dir + "` draws from its checkpoints").c_str()
                      : "save checkpoints (--save-every) and `tally sample --model-file <out-dir>` draws from them");
    return nullptr;
  }
  try {
    SampleOptions options;
    options.tokens = c_.sampling.tokens;
    options.temperature = c_.sampling.temperature;
    options.top_k = c_.sampling.top_k;
    // Samples start where a document does: after the separator tally's tokenize writes.
    const int32_t start = document_bounds(model_, tokenizer_.get()).start;
    const std::vector<int32_t> ids = train::sample(engine.model(), {start}, options, sample_rng_);
    if (say) std::printf("sample:\n---\n%s\n---\n", text(ids).c_str());
  } catch (...) {
    return std::current_exception();
  }
  if (say) std::fflush(stdout);
  return nullptr;
}

}  // namespace tally::train
