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

namespace tally::optim {

struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  bool decay_all = false;  // llm.c's CPU reference decays every parameter; default: 2-D only
};

class AdamW {
 public:
  AdamW(nn::ParameterStore& params, AdamWConfig config);

  // One update with learning rate `lr`. grad_scale multiplies every gradient first
  // (1 when not clipping). With zero_grad, each gradient is zeroed in the same pass that
  // reads it (saves a separate pass over the gradient block).
  void step(double lr, double grad_scale = 1.0, bool zero_grad = false);

  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  const Tensor& m() const { return m_; }
  const Tensor& v() const { return v_; }
  const AdamWConfig& config() const { return config_; }

 private:
  nn::ParameterStore& params_;
  AdamWConfig config_;
  Tensor m_, v_;  // Category::OptimizerState, same layout as the parameter block
  int64_t t_ = 0;
};

// Global L2 norm of the gradient block (fp64 accumulation) and the scale that clips it
// to max_norm (torch's clip_grad_norm_: max_norm / (norm + 1e-6) when norm > max_norm).
double clip_scale(double norm, double max_norm);

}  // namespace tally::optim
