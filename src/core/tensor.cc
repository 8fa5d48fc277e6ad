#include "core/tensor.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_set>

#include <sys/uio.h>
#include <unistd.h>

#include "core/checked.h"
#include "core/device_hooks.h"
#include "core/tensor_methods.h"

namespace tally {

int64_t wrap_dim(int64_t d, int64_t ndim, const char* what) {
  int64_t w = d < 0 ? d + ndim : d;
  TALLY_CHECK(w >= 0 && w < ndim, what, " ", d, " is out of range for a tensor of ", ndim, " dimensions");
  return w;
}

// ---------------------------------------------------------------- the methods registry

namespace {
std::atomic<TensorMethods*>& methods_slot() {
  static std::atomic<TensorMethods*> slot{nullptr};
  return slot;
}
}  // namespace

void register_tensor_methods(TensorMethods* methods) { methods_slot().store(methods, std::memory_order_release); }

TensorMethods& tensor_methods() {
  TensorMethods* m = methods_slot().load(std::memory_order_acquire);
  TALLY_CHECK(m, "this Tensor method is implemented by tally's ops layer, which registers it at start-up: call "
              "tally::ops::install() first thing in main");
  return *m;
}

// ---------------------------------------------------------------- TensorImpl

namespace {
bool compute_contiguous(const Shape& shape, const Shape& strides) {
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}
}  // namespace

TensorImpl::TensorImpl(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype)
    : storage_(std::move(storage)),
      shape_(shape),
      strides_(strides),
      offset_(offset),
      dtype_(dtype),
      contiguous_(compute_contiguous(shape_, strides_)),
      numel_(shape_numel(shape_)) {
  storage_->add_view(this);
}

TensorImpl::~TensorImpl() { storage_->remove_view(this); }

Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>(base.storage_ptr(), shape, strides, offset, base.dtype());
  impl->set_name(base.name());
  return Tensor(std::move(impl));
}

// ---------------------------------------------------------------- creation

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return empty(shape, dtype, device, current_owner());
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, const OwnerTag& owner) {
  const int64_t bytes = checked_mul(shape_numel(shape), static_cast<int64_t>(dtype_size(dtype)), "tensor of shape ",
                                    shape_str(shape), " in ", dtype_name(dtype), ": bytes");
  return Tensor(std::make_shared<TensorImpl>(Storage::create(bytes, device, owner), shape, contiguous_strides(shape),
                                             0, dtype));
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(0.0);
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device, const OwnerTag& owner) {
  Tensor t = empty(shape, dtype, device, owner);
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
  // A meta tensor reads as zeros, after the copy the device it stands in for would make:
  // the CPU's host copy (on the meta device itself: the copy is the run's memory), a CUDA
  // device's staging of the converted or strided values before their transfer.
  if (device().is_meta()) {
    if (dtype() != DTypeOf<T>::value || !is_contiguous())
      Tensor::empty(shape(), DTypeOf<T>::value, device(),
                    current_owner(device().runs_as() == DeviceType::CPU ? "to_vector" : "device_staging"));
    return std::vector<T>(static_cast<size_t>(numel()), T{});
  }
  if (!device().is_cpu() || dtype() != DTypeOf<T>::value || !is_contiguous()) {
    Tensor tmp = Tensor::empty(shape(), DTypeOf<T>::value, Device::cpu(), current_owner("to_vector"));
    copy_hooks(Device::cpu(), device()).copy(tmp, *this);
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

Tensor Tensor::view(const Shape& s) const { return tensor_methods().view(*this, s); }
Tensor Tensor::reshape(const Shape& s) const { return tensor_methods().reshape(*this, s); }
Tensor Tensor::transpose(int64_t d0, int64_t d1) const { return tensor_methods().transpose(*this, d0, d1); }
Tensor Tensor::permute(const std::vector<int64_t>& dims) const { return tensor_methods().permute(*this, dims); }
Tensor Tensor::slice(int64_t d, int64_t start, int64_t end, int64_t step) const {
  return tensor_methods().slice(*this, d, start, end, step);
}
Tensor Tensor::expand(const Shape& s) const { return tensor_methods().expand(*this, s); }
Tensor Tensor::unsqueeze(int64_t d) const {
  int64_t w = wrap_dim(d, dim() + 1);
  Shape s = shape();
  s.insert(s.begin() + w, 1);
  return reshape(s);
}
Tensor Tensor::contiguous() const { return tensor_methods().contiguous(*this); }

// ---------------------------------------------------------------- copies

Tensor Tensor::detach() const { return make_view(*this, shape(), strides(), offset()); }

Tensor Tensor::clone() const { return tensor_methods().clone(*this); }

Tensor Tensor::to(DType t) const { return tensor_methods().to_dtype(*this, t); }

Tensor Tensor::to(Device d) const { return d == device() ? *this : tensor_methods().to_device(*this, d); }

void Tensor::copy_(const Tensor& src) const {
  TALLY_CHECK(src.defined(), "copy_ into ", str(), " from an undefined tensor");
  copy_hooks(device(), src.device()).copy(*this, src);
  storage().bump_version();
}

void Tensor::restore_(const Tensor& values, const OwnerTag& owner) const {
  TALLY_CHECK(values.defined(), "restore_ into ", str(), " from an undefined tensor");
  TALLY_CHECK(storage().released(), "restore_ into ", str(),
              ": its storage holds its bytes (restore_ re-gathers a released storage; copy_ writes a live one)");
  TALLY_CHECK(offset() == 0 && is_contiguous() && nbytes() == storage().nbytes(), "restore_ into ", str(),
              ": it views part of a storage of ", storage().nbytes(),
              " bytes; only a tensor viewing its whole storage can be re-gathered");
  TALLY_CHECK(values.shape() == shape() && values.dtype() == dtype(), "restore_ into ", str(), " from ", values.str(),
              ": shape and dtype must match");
  storage().reacquire(owner);
  copy_hooks(device(), values.device()).copy(*this, values);
}

void Tensor::fill_(double value) const {
  device_hooks(device()).fill(*this, value);
  storage().bump_version();
}

// ---------------------------------------------------------------- autograd

bool Tensor::requires_grad() const {
  return !std::holds_alternative<autograd::NoGrad>(impl_->autograd_);
}

const Tensor& Tensor::set_requires_grad(bool enabled) const {
  auto& state = impl_->autograd_;
  if (auto* interior = std::get_if<autograd::InteriorState>(&state)) {
    (void)interior;
    TALLY_FAIL("set_requires_grad on ", str(),
               ", the output of an op: only leaves can be made to require grad. An interior tensor already "
               "receives its gradient through its grad_fn (memory contract R1)");
  }
  if (enabled && std::holds_alternative<autograd::NoGrad>(state)) {
    TALLY_CHECK(is_floating(dtype()), "set_requires_grad on ", str(), ": only floating tensors can require grad");
    state = autograd::LeafState{};
  } else if (!enabled) {
    state = autograd::NoGrad{};
  }
  return *this;
}

const Tensor& Tensor::set_parameter() const {
  set_requires_grad(true);
  std::get<autograd::LeafState>(impl_->autograd_).parameter = true;
  return *this;
}

bool Tensor::is_parameter() const {
  auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd_);
  return leaf && leaf->parameter;
}

bool Tensor::is_leaf() const { return !std::holds_alternative<autograd::InteriorState>(impl_->autograd_); }

Tensor Tensor::grad() const {
  auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd_);
  if (!leaf) return Tensor();
  if (leaf->grad_discarded) {
    leaf->grad.fill_(0.0);
    leaf->grad_discarded = false;
  }
  return leaf->grad;
}

void Tensor::set_grad(const Tensor& g) const {
  auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd_);
  TALLY_CHECK(leaf, "set_grad on ", str(), " which is not a leaf that requires grad");
  TALLY_CHECK(!g.defined() || (g.shape() == shape() && g.dtype() == dtype() && g.device() == device()),
              "set_grad: gradient ", g.str(), " on ", g.defined() ? g.device().str() : "", " for ", str(), " on ",
              device().str());
  leaf->grad = g;
  leaf->grad_discarded = false;
}

void Tensor::zero_grad() const {
  auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd_);
  if (!leaf || !leaf->grad.defined()) return;
  leaf->grad.fill_(0.0);
  leaf->grad_discarded = false;
}

void Tensor::discard_grad() const {
  auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd_);
  if (!leaf || !leaf->grad.defined()) return;
  leaf->grad_discarded = true;
  leaf->grad.storage().bump_version();  // its value changed (to zero) without a write
}

std::shared_ptr<autograd::Node> Tensor::grad_fn() const {
  if (auto* in = std::get_if<autograd::InteriorState>(&impl_->autograd_)) return in->grad_fn;
  return nullptr;
}

uint32_t Tensor::output_nr() const {
  if (auto* in = std::get_if<autograd::InteriorState>(&impl_->autograd_)) return in->output_nr;
  return 0;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  tensor_methods().backward(*this, gradient, retain_graph);
}

bool bytes_hold_tensor(std::span<const std::byte> bytes, const Tensor& t) {
  static_assert(sizeof(Tensor) == 2 * sizeof(void*), "a Tensor is one shared_ptr: {object, control block}");
  if (!t.defined()) return false;
  std::byte handle[sizeof(Tensor)];
  std::memcpy(handle, static_cast<const void*>(&t), sizeof handle);
  for (size_t i = 0; i + sizeof handle <= bytes.size(); i += alignof(void*))
    if (std::memcmp(bytes.data() + i, handle, sizeof handle) == 0) return true;
  return false;
}

namespace {
// Copies `n` bytes of this process's memory at `address` into `out` when all of them are
// readable: process_vm_readv fails (EFAULT) where a plain read would fault.
bool read_own_memory(uintptr_t address, size_t n, std::vector<std::byte>& out) {
  out.resize(n);
  iovec local{out.data(), n};
  iovec remote{reinterpret_cast<void*>(address), n};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(n);
}

// Whether each 16-byte slot of `bytes` could be a Tensor: both words null (an undefined
// one), or both non-null and pointer-aligned.
bool all_handle_shaped(std::span<const std::byte> bytes) {
  for (size_t i = 0; i + sizeof(Tensor) <= bytes.size(); i += sizeof(Tensor)) {
    uintptr_t w[2];
    std::memcpy(w, bytes.data() + i, sizeof w);
    const bool null = w[0] == 0 && w[1] == 0;
    const bool pointers = w[0] != 0 && w[1] != 0 && w[0] % alignof(void*) == 0 && w[1] % alignof(void*) == 0;
    if (!null && !pointers) return false;
  }
  return true;
}
}  // namespace

void for_each_handle_span(std::span<const std::byte> bytes, const HandleSpanVisitor& visit) {
  constexpr uintptr_t kMaxContainerBytes = uintptr_t{1} << 16;
  visit(bytes, false);
  std::vector<std::byte> copy;
  for (size_t i = 0; i + 3 * sizeof(uintptr_t) <= bytes.size(); i += alignof(void*)) {
    uintptr_t begin, end, capacity;  // a std::vector's three words
    std::memcpy(&begin, bytes.data() + i, sizeof begin);
    std::memcpy(&end, bytes.data() + i + sizeof begin, sizeof end);
    std::memcpy(&capacity, bytes.data() + i + 2 * sizeof begin, sizeof capacity);
    if (begin == 0 || begin % 16 != 0 || end <= begin || capacity < end || capacity - begin > kMaxContainerBytes ||
        (end - begin) % sizeof(Tensor) != 0 || (capacity - begin) % sizeof(Tensor) != 0)
      continue;
    if (read_own_memory(begin, end - begin, copy) && all_handle_shaped(copy)) visit(copy, true);
  }
}

bool bytes_reach_tensor(std::span<const std::byte> bytes, const Tensor& t) {
  bool found = false;
  for_each_handle_span(bytes, [&](std::span<const std::byte> span, bool) { found = found || bytes_hold_tensor(span, t); });
  return found;
}

namespace {
// Never destroyed: a hook held by a static object may outlive any other static.
std::mutex& hooks_mutex() {
  static auto* m = new std::mutex;
  return *m;
}
std::unordered_set<const GradHook*>& live_hooks() {
  static auto* hooks = new std::unordered_set<const GradHook*>;
  return *hooks;
}
}  // namespace

GradHook::GradHook() {
  std::lock_guard<std::mutex> lock(hooks_mutex());
  live_hooks().insert(this);
}

GradHook::~GradHook() {
  std::lock_guard<std::mutex> lock(hooks_mutex());
  live_hooks().erase(this);
}

std::vector<std::string> live_hook_targets() {
  std::lock_guard<std::mutex> lock(hooks_mutex());
  std::vector<std::string> out;
  out.reserve(live_hooks().size());
  for (const GradHook* h : live_hooks()) out.push_back(h->target);
  return out;
}

std::vector<std::string> hooks_holding(const Tensor& t) {
  std::lock_guard<std::mutex> lock(hooks_mutex());
  std::vector<std::string> out;
  for (const GradHook* h : live_hooks())
    if (h->holds(t)) out.push_back(h->target);
  return out;
}

namespace {
// The list entry of `hook`, registered on `t`.
std::shared_ptr<HookEntry> hook_entry(std::unique_ptr<GradHook> hook, const Tensor& t) {
  auto entry = std::make_shared<HookEntry>();
  hook->target = t.str();
  entry->captures_own_tensor = hook->holds(t);
  entry->registered_on = t.impl_ptr();
  entry->hook = std::move(hook);
  return entry;
}
}  // namespace

HookHandle Tensor::add_hook(std::unique_ptr<GradHook> hook) const {
  TALLY_CHECK(defined() && requires_grad(), "register_hook on ", str(), " which does not require grad");
  auto entry = hook_entry(std::move(hook), *this);
  HookHandle handle(entry);
  if (auto* leaf = std::get_if<autograd::LeafState>(&impl_->autograd_)) {
    std::erase_if(leaf->hooks, [](const std::shared_ptr<HookEntry>& e) { return !e->hook; });
    entry->output_nr = 0;
    leaf->hooks.push_back(std::move(entry));
  } else {
    entry->output_nr = output_nr();
    tensor_methods().add_interior_hook(*this, std::move(entry));
  }
  return handle;
}

HookHandle Tensor::add_post_accumulate_hook(std::unique_ptr<GradHook> hook) const {
  auto* leaf = defined() ? std::get_if<autograd::LeafState>(&impl_->autograd_) : nullptr;
  TALLY_CHECK(leaf, "register_post_accumulate_hook on ", defined() ? str() : "an undefined tensor",
              ", which is not a leaf that requires grad (only a leaf accumulates a gradient)");
  auto entry = hook_entry(std::move(hook), *this);
  HookHandle handle(entry);
  std::erase_if(leaf->post_accumulate_hooks, [](const std::shared_ptr<HookEntry>& e) { return !e->hook; });
  leaf->post_accumulate_hooks.push_back(std::move(entry));
  return handle;
}

}  // namespace tally
