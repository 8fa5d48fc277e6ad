#include "optim/adamw.h"

#include <omp.h>

#include <cmath>

#include "runtime/backend.h"
#include "runtime/profiler.h"

namespace tally::optim {

AdamWCoefficients adamw_coefficients(const AdamWConfig& c, int64_t t, double lr, double grad_scale) {
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(c.beta2, static_cast<double>(t));
  AdamWCoefficients k;
  k.beta1 = static_cast<float>(c.beta1);
  k.beta2 = static_cast<float>(c.beta2);
  k.step_size = static_cast<float>(lr / bc1);
  k.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));  // one division per element, not two
  k.eps = static_cast<float>(c.eps);
  k.grad_scale = static_cast<float>(grad_scale);
  k.lr = lr;
  k.weight_decay = c.weight_decay;
  return k;
}

namespace {
template <bool kZeroGrad, bool kCopy>
void adamw_loop(float* p, float* g, float* m, float* v, int64_t n, const AdamWCoefficients& k, float keep,
                BFloat16* p_bf16) {
  const float b1 = k.beta1, b2 = k.beta2, step_size = k.step_size, inv_bc2_sqrt = k.inv_bc2_sqrt, eps = k.eps,
              gs = k.grad_scale;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float gj = g[j] * gs;
    const float mj = b1 * m[j] + (1.f - b1) * gj;
    const float vj = b2 * v[j] + (1.f - b2) * gj * gj;
    m[j] = mj;
    v[j] = vj;
    const float pj = p[j] * keep - step_size * mj / (std::sqrt(vj) * inv_bc2_sqrt + eps);
    p[j] = pj;
    if constexpr (kCopy) p_bf16[j].bits = bf16_round_bits(pj);
    if constexpr (kZeroGrad) g[j] = 0.f;
  }
}
}  // namespace

void adamw_update(float* p, float* g, float* m, float* v, int64_t n, const AdamWCoefficients& k, bool decay,
                  bool zero_grad, BFloat16* p_bf16) {
  const float keep = k.keep(decay);
  if (zero_grad) {
    if (p_bf16) adamw_loop<true, true>(p, g, m, v, n, k, keep, p_bf16);
    else adamw_loop<true, false>(p, g, m, v, n, k, keep, p_bf16);
  } else {
    if (p_bf16) adamw_loop<false, true>(p, g, m, v, n, k, keep, p_bf16);
    else adamw_loop<false, false>(p, g, m, v, n, k, keep, p_bf16);
  }
}

AdamW::AdamW(nn::ParameterStore& params, AdamWConfig config) : params_(params), config_(config) {
  const Tensor& p = params_.flat_params();
  m_ = Tensor::zeros(p.shape(), p.dtype(), p.device(), make_owner(Category::OptimizerState, "adamw.m"));
  v_ = Tensor::zeros(p.shape(), p.dtype(), p.device(), make_owner(Category::OptimizerState, "adamw.v"));
}

void AdamW::step(double lr, double grad_scale, bool zero_grad) {
  runtime::profiler::KernelScope scope("adamw");
  ++t_;
  const AdamWCoefficients k = adamw_coefficients(config_, t_, lr, grad_scale);
  if (!params_.device().is_cpu()) return step_on_device(k, zero_grad);
  float* p = params_.flat_params().data<float>();
  const Tensor& grads = params_.flat_grads();
  float* g = grads.data<float>();
  float* m = m_.data<float>();
  float* v = v_.data<float>();
  // Mixed precision: the bf16 copy is written in the same pass.
  BFloat16* p_bf16 = params_.has_compute_copy() ? params_.compute_block().data<BFloat16>() : nullptr;
  // Every parameter's range split into chunks across the threads (static schedule over a
  // flat index of (parameter, chunk) pairs keeps the work even).
  constexpr int64_t kChunk = 1 << 14;
#pragma omp parallel
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t begin = params_.offset(i), n = params_[i].numel();
    const bool decay = config_.decay_all || params_.spec(i).decay;
#pragma omp for schedule(static) nowait
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t j = begin + c;
      adamw_update(p + j, g + j, m + j, v + j, std::min(kChunk, n - c), k, decay, zero_grad, p_bf16 ? p_bf16 + j : nullptr);
    }
  }
  params_.flat_params().storage().bump_version();
  if (p_bf16) params_.compute_copy_refreshed();
  if (zero_grad) grads.storage().bump_version();
}

// On a device the backend runs the update, one launch per parameter (its decay flag
// decides `keep`); the same formula as adamw_update.
void AdamW::step_on_device(const AdamWCoefficients& k, bool zero_grad) {
  runtime::Backend& backend = runtime::backend(params_.device());
  const bool compute_copy = params_.has_compute_copy();
  const Tensor& grads = params_.flat_grads();  // settles discarded gradients once, not per parameter
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t begin = params_.offset(i), n = params_[i].numel();
    const bool decay = config_.decay_all || params_.spec(i).decay;
    const runtime::AdamWScalars scalars{k.beta1, k.beta2, k.step_size, k.inv_bc2_sqrt, k.eps, k.grad_scale, k.keep(decay)};
    auto range = [&](const Tensor& block) { return make_view(block, {n}, {1}, begin); };
    backend.adamw_update(range(params_.flat_params()), range(grads), range(m_), range(v_),
                         compute_copy ? range(params_.compute_block()) : Tensor(), scalars, zero_grad);
  }
  params_.flat_params().storage().bump_version();
  if (compute_copy) params_.compute_copy_refreshed();
  if (zero_grad) grads.storage().bump_version();
}

Tensor AdamW::moment_unit(int which, size_t unit) {
  const nn::ParameterUnit& u = params_.unit(unit);
  const Tensor& moment = which == 0 ? m_ : v_;
  return make_view(moment, {u.numel()}, {1}, u.begin);
}

void AdamW::set_moment_unit(int which, size_t unit, const Tensor& values) {
  Tensor dst = moment_unit(which, unit);
  TALLY_CHECK(values.numel() == dst.numel(), "AdamW: ", values.numel(), " moment values for unit '",
              params_.unit(unit).name, "' of ", dst.numel(), " parameters");
  dst.copy_(values.reshape({-1}));
}

double clip_scale(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

}  // namespace tally::optim
