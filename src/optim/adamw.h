// AdamW (Loshchilov & Hutter), fused over the parameter block, with the gradient clip
// folded into the same pass. Follows torch.optim.AdamW's arithmetic order, the parity
// oracle:
//   p <- p * (1 - lr * wd)                       (decoupled decay, 2-D weights only)
//   m <- b1 m + (1 - b1) g ;  v <- b2 v + (1 - b2) g^2       (g already clipped)
//   p <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "nn/parameters.h"
#include "optim/optimizer.h"

namespace tally::optim {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  bool decay_all = false;  // llm.c's CPU reference decays every parameter; default: 2-D only
};

// The per-step constants of one AdamW update (step t counts from 1).
struct AdamWCoefficients {
  float beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale;
  double lr, weight_decay;
  float keep(bool decay) const { return decay ? static_cast<float>(1.0 - lr * weight_decay) : 1.f; }
};
AdamWCoefficients adamw_coefficients(const AdamWConfig& config, int64_t t, double lr, double grad_scale);

// Updates n consecutive elements in place (parameters p, gradients g, moments m and v);
// with zero_grad, each gradient is zeroed in the same pass that reads it. Runs on the
// calling thread: callers parallelize over ranges.
// With `p_bf16`, the updated parameters are also written rounded to bf16 there (mixed
// precision's copy, refreshed in the same pass instead of another read of the block).
void adamw_update(float* p, float* g, float* m, float* v, int64_t n, const AdamWCoefficients& k, bool decay,
                  bool zero_grad, BFloat16* p_bf16 = nullptr);

class AdamW final : public Optimizer {
 public:
  AdamW(nn::ParameterStore& params, AdamWConfig config);

  // One update with learning rate `lr`. grad_scale multiplies every gradient first
  // (1 when not clipping). With zero_grad, each gradient is zeroed in the same pass that
  // reads it (saves a separate pass over the gradient block).
  void step(double lr, double grad_scale = 1.0, bool zero_grad = false);

  int64_t steps_taken() const override { return t_; }
  void set_steps_taken(int64_t t) override { t_ = t; }
  Tensor moment_unit(int which, size_t unit) override;
  void set_moment_unit(int which, size_t unit, const Tensor& values) override;
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  const AdamWConfig& config() const { return config_; }

 private:
  void step_on_device(const AdamWCoefficients& k, bool zero_grad);
  nn::ParameterStore& params_;
  AdamWConfig config_;
  Tensor m_, v_;  // Category::OptimizerState, same layout as the parameter block
  int64_t t_ = 0;
};

// The scale that clips a gradient of global L2 norm `norm` to max_norm (torch's
// clip_grad_norm_: max_norm / (norm + 1e-6) when norm > max_norm, else 1).
double clip_scale(double norm, double max_norm);

}  // namespace tally::optim
