#include "core/tensor.h"

#include <sstream>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "ops/cpu/kernels.h"
#include "ops/ops.h"

namespace tally {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

int64_t wrap_dim(int64_t d, int64_t ndim, const char* what) {
  int64_t w = d < 0 ? d + ndim : d;
  TALLY_CHECK(w >= 0 && w < ndim, what, " ", d, " is out of range for a tensor of ", ndim, " dimensions");
  return w;
}

// ---------------------------------------------------------------- TensorImpl

TensorImpl::TensorImpl(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype)
    : storage_(std::move(storage)),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      offset_(offset),
      dtype_(dtype),
      numel_(shape_numel(shape_)) {
  storage_->add_view(this);
}

TensorImpl::~TensorImpl() { storage_->remove_view(this); }

bool TensorImpl::is_contiguous() const {
  int64_t expected = 1;
  for (size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>(base.storage_ptr(), std::move(shape), std::move(strides), offset, base.dtype());
  impl->set_name(base.name());
  return Tensor(std::move(impl));
}

// ---------------------------------------------------------------- creation

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return empty(shape, dtype, device, memory::current_owner());
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, memory::OwnerTag owner) {
  for (int64_t d : shape) TALLY_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  int64_t bytes = shape_numel(shape) * static_cast<int64_t>(dtype_size(dtype));
  auto storage = std::make_shared<Storage>(bytes, device, std::move(owner));
  return Tensor(std::make_shared<TensorImpl>(std::move(storage), shape, contiguous_strides(shape), 0, dtype));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(0.0);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, memory::OwnerTag owner) {
  Tensor t = empty(shape, dtype, device, std::move(owner));
  t.fill_(0.0);
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::ones(const Shape& shape, DType dtype, Device device) { return full(shape, 1.0, dtype, device); }

Tensor Tensor::scalar(double value, DType dtype) { return full({}, value, dtype); }

template <class T> Tensor Tensor::from_vector(const std::vector<T>& values, const Shape& shape) {
  TALLY_CHECK(static_cast<int64_t>(values.size()) == shape_numel(shape), "from_vector: ", values.size(),
              " values for shape ", shape_str(shape));
  Tensor t = empty(shape, DTypeOf<T>::value);
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}
template Tensor Tensor::from_vector(const std::vector<float>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<double>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<int32_t>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<int64_t>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<uint16_t>&, const Shape&);
template Tensor Tensor::from_vector(const std::vector<BFloat16>&, const Shape&);

// ---------------------------------------------------------------- metadata

int64_t Tensor::size(int64_t d) const { return shape()[wrap_dim(d, dim())]; }
int64_t Tensor::stride(int64_t d) const { return strides()[wrap_dim(d, dim())]; }

const Tensor& Tensor::set_name(const std::string& name) const {
  impl_->set_name(name);
  return *this;
}

std::string Tensor::str() const {
  if (!impl_) return "<undefined tensor>";
  std::string s = std::string(dtype_name(dtype())) + shape_str(shape());
  if (!name().empty()) s += " '" + name() + "'";
  return s;
}

// ---------------------------------------------------------------- data

double Tensor::item() const {
  TALLY_CHECK(numel() == 1, "item() on ", str(), " which has ", numel(), " elements");
  return to_vector<double>()[0];
}

template <class T> std::vector<T> Tensor::to_vector() const {
  Tensor src = *this;
  if (!device().is_cpu() || dtype() != DTypeOf<T>::value || !is_contiguous()) {
    Tensor tmp = Tensor::empty(shape(), DTypeOf<T>::value, Device::cpu(), memory::current_owner("to_vector"));
    ops::cpu::copy(tmp, *this);
    src = tmp;
  }
  const T* p = src.data<T>();
  return std::vector<T>(p, p + numel());
}
template std::vector<float> Tensor::to_vector() const;
template std::vector<double> Tensor::to_vector() const;
template std::vector<int32_t> Tensor::to_vector() const;
template std::vector<int64_t> Tensor::to_vector() const;
template std::vector<uint16_t> Tensor::to_vector() const;

// ---------------------------------------------------------------- views

Tensor Tensor::view(const Shape& s) const { return ops::view(*this, s); }
Tensor Tensor::reshape(const Shape& s) const { return ops::reshape(*this, s); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return ops::transpose(*this, d0, d1); }
Tensor Tensor::permute(const std::vector<int64_t>& dims) const { return ops::permute(*this, dims); }
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return ops::slice(*this, d, start, end, step);
}
Tensor Tensor::expand(const Shape& s) const { return ops::expand(*this, s); }
Tensor Tensor::unsqueeze(int64_t d) const {
  int64_t w = wrap_dim(d, dim() + 1);
  Shape s = shape();
  s.insert(s.begin() + w, 1);
  return ops::reshape(*this, s);
}
Tensor Tensor::contiguous() const { return ops::contiguous(*this); }

// ---------------------------------------------------------------- copies

Tensor Tensor::detach() const { return make_view(*this, shape(), strides(), offset()); }

Tensor Tensor::clone() const { return ops::scale(*this, 1.0); }

Tensor Tensor::to(DType t) const { return ops::to_dtype(*this, t); }

void Tensor::copy_(const Tensor& src) const {
  ops::cpu::copy(*this, src);
  storage().bump_version();
}

void Tensor::fill_(double value) const {
  ops::cpu::fill(*this, value);
  storage().bump_version();
}

// ---------------------------------------------------------------- autograd

bool Tensor::requires_grad() const {
  return !std::holds_alternative<autograd::NoGrad>(impl_->autograd());
}

const Tensor& Tensor::set_requires_grad(bool enabled) const {
  auto& state = impl_->autograd();
  TALLY_CHECK(!std::holds_alternative<autograd::InteriorState>(state), "set_requires_grad on ", str(),
              ", the output of '", std::get<autograd::InteriorState>(state).grad_fn->name(),
              "': only leaves can be made to require grad. An interior tensor already receives "
              "its gradient through its grad_fn (memory contract R1)");
  if (enabled && std::holds_alternative<autograd::NoGrad>(state)) {
    TALLY_CHECK(is_floating(dtype()), "set_requires_grad on ", str(), ": only floating tensors can require grad");
    state = autograd::LeafState{};
  } else if (!enabled) {
    state = autograd::NoGrad{};
  }
  return *this;
}

bool Tensor::is_leaf() const { return !std::holds_alternative<autograd::InteriorState>(impl_->autograd()); }

Tensor Tensor::grad() const {
  if (auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd())) return leaf->grad;
  return Tensor();
}

void Tensor::set_grad(const Tensor& g) const {
  auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd());
  TALLY_CHECK(leaf, "set_grad on ", str(), " which is not a leaf that requires grad");
  TALLY_CHECK(!g.defined() || g.shape() == shape(), "set_grad: gradient shape ", shape_str(g.shape()), " for ", str());
  leaf->grad = g;
}

void Tensor::zero_grad() const {
  if (auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd()))
    if (leaf->grad.defined()) leaf->grad.fill_(0.0);
}

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  if (auto* in = std::get_if<autograd::InteriorState>(&impl_->autograd())) return in->grad_fn;
  return nullptr;
}

uint32_t Tensor::output_nr() const {
  if (auto* in = std::get_if<autograd::InteriorState>(&impl_->autograd())) return in->output_nr;
  return 0;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  autograd::backward({*this}, {gradient}, retain_graph);
}

void Tensor::register_hook(TensorHook hook) const {
  auto& state = impl_->autograd();
  if (auto* leaf = std::get_if<autograd::LeafState>(&state)) {
    leaf->hooks.push_back(std::move(hook));
  } else if (auto* in = std::get_if<autograd::InteriorState>(&state)) {
    in->grad_fn->add_pre_hook(in->output_nr, std::move(hook));
  } else {
    TALLY_FAIL("register_hook on ", str(), " which does not require grad");
  }
}

}  // namespace tally
