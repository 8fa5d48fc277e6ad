#include "nn/parameters.h"

#include "runtime/profiler.h"

namespace tally::nn {

size_t ParameterStore::begin_unit(std::string name) {
  TALLY_CHECK(!allocated_, "unit '", name, "' declared after allocation");
  units_.push_back({std::move(name), total_, total_, specs_.size(), specs_.size()});
  return units_.size() - 1;
}

size_t ParameterStore::declare(std::string name, Shape shape, bool decay) {
  TALLY_CHECK(!allocated_, "parameter '", name, "' declared after allocation");
  TALLY_CHECK(index_by_name_.emplace(name, specs_.size()).second, "parameter '", name, "' declared twice");
  if (units_.empty()) begin_unit("all");
  offsets_.push_back(total_);
  total_ += shape_numel(shape);
  specs_.push_back({std::move(name), std::move(shape), decay, units_.size() - 1});
  units_.back().end = total_;
  units_.back().last = specs_.size();
  return specs_.size() - 1;
}

void ParameterStore::allocate(DType dtype, Device device, Blocks blocks) {
  allocated_ = true;
  device_ = device;
  dtype_ = dtype;
  params_.clear();
  if (blocks == Blocks::None) {
    flat_params_ = flat_grads_ = Tensor();
    params_.resize(specs_.size());
    return;
  }
  const bool with_gradients = blocks == Blocks::ParametersAndGradients;
  flat_params_ = Tensor::empty({total_}, dtype, device, make_owner(Category::Parameter, "parameters"));
  // The gradients of registered parameters are persistent model state (sanitizer S1).
  // They start discarded (zero, unwritten: see discard_grads), so the first step's
  // backward writes them as every later step's does, and nothing zeroes them first.
  flat_grads_ = with_gradients ? Tensor::empty({total_}, dtype, device, make_owner(Category::Gradient, "gradients", /*persistent=*/true))
                               : Tensor();
  flat_params_.set_name("parameters");
  for (size_t i = 0; i < specs_.size(); ++i) {
    const Shape& shape = specs_[i].shape;
    Tensor p = make_view(flat_params_, shape, contiguous_strides(shape), offsets_[i]);
    p.set_name(specs_[i].name);
    p.set_parameter();
    if (with_gradients) {
      Tensor g = make_view(flat_grads_, shape, contiguous_strides(shape), offsets_[i]);
      g.set_name(specs_[i].name + ".grad");
      p.set_grad(g);
      p.discard_grad();
    }
    params_.push_back(p);
  }
}

void ParameterStore::move_to(Device device) {
  if (device == device_) return;
  TALLY_CHECK(flat_params_.defined(), "move_to(", device.str(), "): no parameter block (allocate first; not with ZeRO-3)");
  TALLY_CHECK(!compute_block_.defined(), "move_to(", device.str(), "): after enable_compute_copy; move the model first");
  const Tensor host = flat_params_;
  allocate(host.dtype(), device, flat_grads_.defined() ? Blocks::ParametersAndGradients : Blocks::Parameters);  // the views now point at the new blocks; `host` holds the old values
  flat_params_.copy_(host);
}

void ParameterStore::enable_compute_copy(DType dtype) {
  TALLY_CHECK(flat_params_.defined(), "mixed precision needs the parameter block (allocate first; not with ZeRO-3)");
  TALLY_CHECK(dtype == DType::BF16, "mixed precision: compute dtype ", dtype_name(dtype), " is not supported (bfloat16)");
  compute_block_ = Tensor::empty({total_}, dtype, flat_params_.device(), make_owner(Category::Parameter, "parameters.bf16"));
  compute_views_.clear();
  for (size_t i = 0; i < specs_.size(); ++i)
    compute_views_.push_back(make_view(compute_block_, specs_[i].shape, contiguous_strides(specs_[i].shape), offsets_[i]));
  compute_version_.reset();
}

const Tensor& ParameterStore::compute_copy(size_t i) const {
  TALLY_CHECK(compute_block_.defined(), "parameter '", specs_.at(i).name, "': no compute copy (enable_compute_copy)");
  const uint64_t version = flat_params_.storage().version();
  if (compute_version_ != version) {
    runtime::profiler::KernelScope scope("parameters_to_bf16");
    compute_block_.copy_(flat_params_);
    compute_version_ = version;
  }
  return compute_views_.at(i);
}

void ParameterStore::compute_copy_refreshed() {
  compute_block_.storage().bump_version();
  compute_version_ = flat_params_.storage().version();
}

void ParameterStore::rebind(size_t i, const Tensor& param) {
  TALLY_CHECK(i < params_.size(), "parameter index ", i, " out of range");
  TALLY_CHECK(param.shape() == specs_[i].shape, "rebinding '", specs_[i].name, "' ", shape_str(specs_[i].shape),
              " to ", param.str());
  param.set_name(specs_[i].name);
  param.set_parameter();
  params_[i] = param;
}

const Tensor& ParameterStore::flat_grads() const {
  for (const Tensor& p : params_) p.grad();  // fills a gradient discarded and not written since
  return flat_grads_;
}

Tensor ParameterStore::grads_of(size_t first, size_t last) const {
  TALLY_CHECK(first <= last && last <= params_.size() && flat_grads_.defined(), "gradients of parameters [", first, ", ",
              last, ") of ", params_.size(), flat_grads_.defined() ? "" : ": no gradient block");
  if (first == last) return make_view(flat_grads_, {0}, {1}, flat_grads_.offset());
  for (size_t i = first; i < last; ++i) params_[i].grad();
  const int64_t begin = offsets_[first], end = offsets_[last - 1] + params_[last - 1].numel();
  return make_view(flat_grads_, {end - begin}, {1}, flat_grads_.offset() + begin);
}

void ParameterStore::zero_grad() const {
  for (const Tensor& p : params_) p.zero_grad();
}

void ParameterStore::discard_grads() const {
  for (const Tensor& p : params_) p.discard_grad();
}

void ParameterStore::release_grads() {
  for (const Tensor& p : params_) p.set_grad(Tensor());
  flat_grads_ = Tensor();
}

void ParameterStore::release_params() { flat_params_ = Tensor(); }

size_t ParameterStore::index_of(const std::string& name) const {
  const auto it = index_by_name_.find(name);
  TALLY_CHECK(it != index_by_name_.end(), "no parameter named '", name, "'");
  return it->second;
}

const Tensor& ParameterStore::get(const std::string& name) const { return params_[index_of(name)]; }

}  // namespace tally::nn
