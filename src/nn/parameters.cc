#include "nn/parameters.h"

namespace tally::nn {

size_t ParameterStore::declare(std::string name, Shape shape, bool decay) {
  TALLY_CHECK(!flat_params_.defined(), "parameter '", name, "' declared after allocation");
  offsets_.push_back(total_);
  total_ += shape_numel(shape);
  specs_.push_back({std::move(name), std::move(shape), decay});
  return specs_.size() - 1;
}

void ParameterStore::allocate(DType dtype, Device device) {
  flat_params_ = Tensor::empty({total_}, dtype, device, make_owner(Category::Parameter, "parameters"));
  // The gradients of registered parameters are persistent model state (sanitizer S1).
  flat_grads_ = Tensor::zeros({total_}, dtype, device, make_owner(Category::Gradient, "gradients", /*persistent=*/true));
  flat_params_.set_name("parameters");
  params_.clear();
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Shape& shape = specs_[i].shape;
    Tensor p = make_view(flat_params_, shape, contiguous_strides(shape), offsets_[i]);
    p.set_name(specs_[i].name);
    p.set_parameter();
    Tensor g = make_view(flat_grads_, shape, contiguous_strides(shape), offsets_[i]);
    g.set_name(specs_[i].name + ".grad");
    p.set_grad(g);
    params_.push_back(p);
  }
}

const Tensor& ParameterStore::get(const std::string& name) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) return params_[i];
  TALLY_FAIL("no parameter named '", name, "'");
}

}  // namespace tally::nn
