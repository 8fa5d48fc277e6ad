#include "optim/adamw.h"

#include <cmath>

namespace tally::optim {

AdamW::AdamW(nn::ParameterStore& params, AdamWConfig config) : params_(params), config_(config) {
  const Tensor& p = params_.flat_params();
  m_ = Tensor::zeros(p.shape(), p.dtype(), p.device(), make_owner(Category::OptimizerState, "adamw.m"));
  v_ = Tensor::zeros(p.shape(), p.dtype(), p.device(), make_owner(Category::OptimizerState, "adamw.v"));
}

void AdamW::step(double lr, double grad_scale, bool zero_grad) {
  ++t_;
  const float b1 = static_cast<float>(config_.beta1), b2 = static_cast<float>(config_.beta2);
  const double bc1 = 1.0 - std::pow(config_.beta1, static_cast<double>(t_));
  const double bc2 = 1.0 - std::pow(config_.beta2, static_cast<double>(t_));
  const float step_size = static_cast<float>(lr / bc1);
  const float inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));  // one division per element, not two
  const float eps = static_cast<float>(config_.eps);
  const float gs = static_cast<float>(grad_scale);
  float* p = params_.flat_params().data<float>();
  float* g = params_.flat_grads().data<float>();
  float* m = m_.data<float>();
  float* v = v_.data<float>();
#pragma omp parallel
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t begin = params_.offset(i), end = begin + params_[i].numel();
    const bool decay = config_.decay_all || params_.spec(i).decay;
    const float keep = decay ? static_cast<float>(1.0 - lr * config_.weight_decay) : 1.f;
#pragma omp for simd schedule(static) nowait
    for (int64_t j = begin; j < end; ++j) {
      const float gj = g[j] * gs;
      const float mj = b1 * m[j] + (1.f - b1) * gj;
      const float vj = b2 * v[j] + (1.f - b2) * gj * gj;
      m[j] = mj;
      v[j] = vj;
      p[j] = p[j] * keep - step_size * mj / (std::sqrt(vj) * inv_bc2_sqrt + eps);
      if (zero_grad) g[j] = 0.f;
    }
  }
  params_.flat_params().storage().bump_version();
  if (zero_grad) params_.flat_grads().storage().bump_version();
}

double clip_scale(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

}  // namespace tally::optim
