// The gradient norm that clipping needs, summed while backward still runs.
//
// Clipping scales every gradient by max_norm / ||g|| with ||g||^2 = sum_i ||g_i||^2 over
// all parameters, so AdamW may touch no parameter before the whole sum is known. Summed
// after backward, that is one more pass over the gradient block (4 bytes a parameter)
// at memory bandwidth: 14 ms of GPT-2 124M's step on a 2-core Zen 4, ~22 ms on Sapphire
// Rapids. But g_i is final as soon as backward has made its last contribution to it (the
// engine's gradient_ready), and that contribution (a weight gradient's GEMM, a bias's row
// sum, a LayerNorm's reduction) has just written g_i: its squares summed then come from
// cache. BackwardGradientNorm does that during a step's last backward.
//
// Both ways sum each parameter's gradient on its own and add the sums in the parameters'
// order, in fp64, so they give the same bits: a run that sums during backward and one that
// sums after it (data parallel, whose gradients are final only once all-reduced) agree
// exactly.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "nn/parameters.h"

namespace tally::optim {

// sqrt(sum over parameters of sum(g_i^2)): ops::global_norm of the parameters' gradients,
// each one's sum in its own call, added in parameter order in fp64 (which finish() below
// repeats exactly). Parameters without a gradient count as zero.
double gradient_norm(const nn::ParameterStore& params);
// The same norm as one sum over the whole gradient block (discarded gradients read as
// zeros): on a GPU, one wait for the device instead of one per parameter. Its fp64 sum is
// added in another order than gradient_norm's, so the two may differ in the last bits.
double block_gradient_norm(const nn::ParameterStore& params);

class BackwardGradientNorm final {
 public:
  // Hooks every parameter of `params` as they are now (post-accumulate hooks, removed
  // with this object).
  explicit BackwardGradientNorm(const nn::ParameterStore& params);
  ~BackwardGradientNorm();
  BackwardGradientNorm(const BackwardGradientNorm&) = delete;
  BackwardGradientNorm& operator=(const BackwardGradientNorm&) = delete;

  // The next backward is the step's last one: sum each parameter's gradient as it becomes
  // final. Gradients that anything changes after that backward (a data-parallel
  // all-reduce, a tied weight's sum across stages) must not be summed this way.
  void arm();
  // The norm of the gradients as they are now, equal to gradient_norm(params): the
  // parameters the armed backward reached were summed then; the rest (reached only by
  // earlier microbatches, or not at all) are summed here. Disarms.
  double finish();

 private:
  void gradient_final(size_t param);  // parameter `param`'s post-accumulate hook

  const nn::ParameterStore& params_;
  std::vector<double> squares_;  // per parameter, valid where summed_
  std::vector<char> summed_;
  bool armed_ = false;
  std::vector<HookHandle> hooks_;
};

}  // namespace tally::optim
