#include "optim/grad_norm.h"

#include <algorithm>
#include <cmath>

#include "ops/ops.h"
#include "runtime/backend.h"

namespace tally::optim {

namespace {
// sum(g^2) of a parameter's gradient as it reads now (zeros if discarded and not written).
double squares_of(const Tensor& param) {
  const Tensor g = param.grad();
  return g.defined() ? runtime::backend(g.device()).sum_squares(g) : 0.0;
}
}  // namespace

double gradient_norm(const nn::ParameterStore& params) {
  std::vector<Tensor> grads;
  grads.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) grads.push_back(params[i].grad());
  return ops::global_norm(grads);  // each tensor's sum_squares, added in order in fp64
}

double block_gradient_norm(const nn::ParameterStore& params) {
  const Tensor& grads = params.flat_grads();  // settles discarded gradients as zeros
  return std::sqrt(runtime::backend(grads.device()).sum_squares(grads));
}

BackwardGradientNorm::BackwardGradientNorm(const nn::ParameterStore& params)
    : params_(params), squares_(params.size(), 0.0), summed_(params.size(), 0) {
  for (size_t i = 0; i < params.size(); ++i)
    hooks_.push_back(params[i].register_post_accumulate_hook([this, i](const Tensor&) { gradient_final(i); }));
}

BackwardGradientNorm::~BackwardGradientNorm() {
  for (HookHandle& h : hooks_) h.remove();
}

void BackwardGradientNorm::arm() {
  armed_ = true;
  std::fill(summed_.begin(), summed_.end(), 0);
}

void BackwardGradientNorm::gradient_final(size_t param) {
  if (!armed_) return;
  // A second call for the same parameter (one it reached through a recomputed region's
  // own backward and again through the outer one) means it changed since: sum it again.
  squares_[param] = squares_of(params_[param]);
  summed_[param] = 1;
}

double BackwardGradientNorm::finish() {
  armed_ = false;
  double total = 0;
  for (size_t i = 0; i < params_.size(); ++i) total += summed_[i] ? squares_[i] : squares_of(params_[i]);
  return std::sqrt(total);
}

}  // namespace tally::optim
