// Parameters, laid out like llm.c: every parameter is a named view into ONE parameter
// block, and its gradient a view at the same offset of ONE gradient block. Sizes are
// known before anything is allocated; the optimizer's state mirrors the same layout.
//
// Why one block: loading/saving a model is one read/write, zero_grad and the gradient
// norm are one pass each, AdamW runs as one fused loop, and the memory report shows
// exactly two allocations of 4 bytes per parameter.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally::nn {

struct ParameterSpec {
  std::string name;   // e.g. "h.3.attn.c_attn.weight"
  Shape shape;
  bool decay = true;  // weight decay applies (2-D weights); false for biases and norms
};

class ParameterStore {
 public:
  // Declares a parameter; returns its index. Only before allocate().
  size_t declare(std::string name, Shape shape, bool decay);
  // Allocates the parameter and gradient blocks and creates the views.
  void allocate(DType dtype = DType::F32, Device device = Device::cpu());

  size_t size() const { return specs_.size(); }
  const ParameterSpec& spec(size_t i) const { return specs_[i]; }
  const Tensor& param(size_t i) const { return params_[i]; }
  const Tensor& operator[](size_t i) const { return params_[i]; }
  const Tensor& get(const std::string& name) const;
  int64_t offset(size_t i) const { return offsets_[i]; }  // element offset in the blocks
  int64_t numel() const { return total_; }

  const Tensor& flat_params() const { return flat_params_; }  // (numel), Category::Parameter
  const Tensor& flat_grads() const { return flat_grads_; }    // (numel), Category::Gradient
  void zero_grad() const { flat_grads_.zero_(); }

 private:
  std::vector<ParameterSpec> specs_;
  std::vector<int64_t> offsets_;
  std::vector<Tensor> params_;
  int64_t total_ = 0;
  Tensor flat_params_, flat_grads_;
};

}  // namespace tally::nn
