// Tensor: a view (shape, strides, offset, dtype) over a reference-counted Storage,
// plus its autograd state.
//
// Ownership, as PyTorch writes it down and tally enforces it (memory contract R1, R2):
//   Tensor --(shared_ptr)--> TensorImpl --(shared_ptr)--> Storage
//   TensorImpl (interior) --(shared_ptr)--> grad_fn Node --(edges, shared_ptr)--> next Nodes
//   TensorImpl (leaf) --(weak_ptr)--> AccumulateGrad --(weak_ptr)--> TensorImpl
// Nothing in the graph holds a tensor strongly except saved tensors, which are saved
// without autograd state, so a graph can never keep itself alive.
//
// Layering: core knows the *shape* of autograd state (the three-way variant below) but
// none of its behaviour. Differentiable methods (views, backward, interior hooks) reach
// the ops layer through TensorMethods; copies and fills reach the device's backend
// through DeviceHooks. The state itself is private: only autograd's internals may change
// it, so R1 (leaf xor interior) cannot be bypassed through a public accessor.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/grad_hook.h"
#include "core/owner.h"
#include "core/shape.h"
#include "core/storage.h"

namespace tally {

namespace autograd {
class Node;
class AccumulateGrad;
namespace detail {
struct StateAccess;  // autograd's internals: the only code that changes autograd state
}
}  // namespace autograd

class TensorImpl;

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- creation (owner defaults to current_owner(): category from the CategoryScope,
  // name from the module path, and the clock)
  static Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor empty(const Shape& shape, DType dtype, Device device, const OwnerTag& owner);
  static Tensor zeros(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device, const OwnerTag& owner);
  static Tensor full(const Shape& shape, double value, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor ones(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());
  static Tensor scalar(double value, DType dtype = DType::F32);
  template <class T> static Tensor from_vector(const std::vector<T>& values, const Shape& shape);

  // ---- metadata
  bool defined() const { return impl_ != nullptr; }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }
  const Shape& shape() const;
  const Shape& strides() const;
  int64_t offset() const;
  int64_t dim() const;
  int64_t size(int64_t d) const;  // negative d counts from the end
  int64_t stride(int64_t d) const;
  int64_t numel() const;
  int64_t nbytes() const;
  DType dtype() const;
  Device device() const;
  bool is_contiguous() const;
  Storage& storage() const;
  const std::shared_ptr<Storage>& storage_ptr() const;
  const std::string& name() const;
  const Tensor& set_name(const std::string& name) const;
  std::string str() const;  // "float32[2,3] 'name'"

  // ---- data (throws if the storage was released, or on a dtype mismatch)
  template <class T> T* data() const;
  void* raw_data() const;
  double item() const;
  template <class T> std::vector<T> to_vector() const;  // element-converted, in logical order

  // ---- views (autograd-aware: a view of a tensor that requires grad is interior)
  Tensor view(const Shape& shape) const;     // -1 allowed once; requires compatible strides
  Tensor reshape(const Shape& shape) const;  // view when possible, else a contiguous copy
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(const std::vector<int64_t>& dims) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor expand(const Shape& shape) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor contiguous() const;

  // ---- copies and in-place writes (in-place writes bump the storage version)
  Tensor detach() const;  // same storage, no autograd state
  Tensor clone() const;   // new storage, differentiable
  Tensor to(DType dtype) const;
  Tensor to(Device device) const;  // differentiable; this tensor itself when already there
  void copy_(const Tensor& src) const;
  // Re-gathers a tensor whose storage was released (R6), as ZeRO-3 does: gives the
  // storage its bytes back, owned by `owner`, and fills them with `values` (the values it
  // held when released, e.g. gathered from shards). Unlike copy_ it does not bump the
  // version, so tensors saved for backward from it stay valid. The tensor must view its
  // whole storage (one released parameter, not a slice of a flat buffer).
  void restore_(const Tensor& values, const OwnerTag& owner) const;
  void fill_(double value) const;
  void zero_() const { fill_(0.0); }

  // ---- autograd
  bool requires_grad() const;
  const Tensor& set_requires_grad(bool enabled) const;  // leaves and plain tensors only (R1)
  // Registers this leaf as a model parameter: it requires grad, and its .grad is
  // persistent state rather than an activation (sanitizer S1). Whether a gradient is
  // persistent is decided here, by the leaf, never by the storage it shares: an alias of
  // a weight (w.detach() made to require grad) is not a parameter.
  const Tensor& set_parameter() const;
  bool is_parameter() const;
  bool is_leaf() const;
  // The leaf's gradient. After discard_grad() and before any gradient arrived, it is
  // filled with zeros here first: a discarded gradient always reads as zero.
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  void zero_grad() const;  // fills .grad with zeros, keeping its allocation
  // Makes .grad zero without writing it (PyTorch's zero_grad(set_to_none=True), keeping
  // the allocation): the next gradient to arrive overwrites the buffer instead of adding
  // to it, saving the zeroing pass and the read of the old values (a weight gradient's
  // GEMM then runs with beta 0). A handle to the buffer taken before the discard sees its
  // old bytes until then; grad() never does.
  void discard_grad() const;
  std::shared_ptr<autograd::Node> grad_fn() const;
  uint32_t output_nr() const;
  void backward(const Tensor& gradient = Tensor(), bool retain_graph = false) const;
  // Hooks the gradient: a leaf's before it is accumulated, an interior tensor's before
  // its grad_fn runs. `f(grad)` returns a replacement, or an undefined Tensor to keep it.
  // A leaf's hooks live as long as the leaf; an interior tensor's die with its graph.
  // The handle removes the hook (and destroys its captures) early.
  template <class F> HookHandle register_hook(F&& f) const {
    return add_hook(std::make_unique<GradHookOf<std::decay_t<F>>>(std::forward<F>(f)));
  }
  // Hooks the end of a leaf's accumulation (PyTorch's register_post_accumulate_grad_hook):
  // `f(leaf)` runs once in every backward that reaches the leaf, after that backward's
  // last contribution is in its .grad (written in place through a grad sink included).
  // What data parallel and ZeRO start their reductions from. Leaves only; lives as long as
  // the leaf, and the handle removes it early.
  template <class F> HookHandle register_post_accumulate_hook(F&& f) const {
    auto call = [f = std::forward<F>(f)](const Tensor& leaf) {
      f(leaf);
      return Tensor();
    };
    return add_post_accumulate_hook(std::make_unique<GradHookOf<decltype(call)>>(std::move(call)));
  }

 private:
  HookHandle add_hook(std::unique_ptr<GradHook> hook) const;
  HookHandle add_post_accumulate_hook(std::unique_ptr<GradHook> hook) const;
  template <class F> friend class GradHookOf;
  std::shared_ptr<TensorImpl> impl_;
};

template <class F> class GradHookOf final : public GradHook {
 public:
  explicit GradHookOf(F f) : f_(std::move(f)) {}
  Tensor operator()(const Tensor& grad) const override { return f_(grad); }
  std::span<const std::byte> captured_bytes() const override {
    return {reinterpret_cast<const std::byte*>(&f_), sizeof(F)};
  }
  bool holds(const Tensor& t) const override;

 private:
  F f_;
};

namespace autograd {
// R1: a tensor's autograd state is exactly one of these three.
struct NoGrad {};
struct LeafState {
  Tensor grad;                                     // owned: the accumulated gradient
  std::weak_ptr<AccumulateGrad> accumulator;       // non-owning: the graph owns it (R2)
  std::vector<std::shared_ptr<HookEntry>> hooks;   // owned: live as long as the leaf
  std::vector<std::shared_ptr<HookEntry>> post_accumulate_hooks;  // owned likewise; called with the leaf
  bool parameter = false;                          // a registered model parameter
  // discard_grad() was called and no gradient has arrived since: the gradient is zero,
  // and `grad`'s bytes are stale (overwritten by the next gradient, zeroed if read first).
  bool grad_discarded = false;
};
struct InteriorState {
  std::shared_ptr<Node> grad_fn;  // owning: a tensor keeps the node that made it alive
  uint32_t output_nr = 0;
};
using AutogradState = std::variant<NoGrad, LeafState, InteriorState>;
}  // namespace autograd

class TensorImpl : public std::enable_shared_from_this<TensorImpl> {
 public:
  TensorImpl(std::shared_ptr<Storage> storage, Shape shape, Shape strides, int64_t offset, DType dtype);
  ~TensorImpl();
  TensorImpl(const TensorImpl&) = delete;
  TensorImpl& operator=(const TensorImpl&) = delete;

  const std::shared_ptr<Storage>& storage() const { return storage_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int64_t offset() const { return offset_; }  // in elements
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  bool is_contiguous() const { return contiguous_; }
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }

  // Read-only view of the autograd state (mutation: autograd internals only).
  const autograd::AutogradState& autograd() const { return autograd_; }

 private:
  friend struct autograd::detail::StateAccess;
  friend class Tensor;
  std::shared_ptr<Storage> storage_;  // owning: views keep their storage alive (until release())
  Shape shape_;
  Shape strides_;
  int64_t offset_;
  DType dtype_;
  bool contiguous_;
  int64_t numel_;
  std::string name_;
  autograd::AutogradState autograd_;
};

// Whether `bytes` contain a by-value handle of `t` (a Tensor, or the shared_ptr inside
// one): its exact object representation, the TensorImpl pointer followed by the
// control-block pointer. Matching both words means a stray pointer that happens to equal
// the tensor's address (one past a neighbouring buffer, say) is not mistaken for a
// reference. Used to find tensors kept in contexts and hooks (memory contract S3).
bool bytes_hold_tensor(std::span<const std::byte> bytes, const Tensor& t);

// The spans a scan for tensor handles held by an object looks in: the object's bytes
// (visited with container = false), and the elements of each std::vector<Tensor> among
// them (container = true, a copy): three adjacent words begin <= end <= capacity, begin
// 16-byte aligned, whole Tensor slots up to 64 KiB, all of it readable memory in which
// every slot is shaped as a handle (two null words, or two aligned pointers). Containers
// inside containers are not followed.
using HandleSpanVisitor = std::function<void(std::span<const std::byte> bytes, bool container)>;
void for_each_handle_span(std::span<const std::byte> bytes, const HandleSpanVisitor& visit);
// Whether `bytes` hold a handle of `t` in any of those spans.
bool bytes_reach_tensor(std::span<const std::byte> bytes, const Tensor& t);

template <class F> bool GradHookOf<F>::holds(const Tensor& t) const {
  if (!t.defined()) return false;
  if (bytes_reach_tensor(captured_bytes(), t)) return true;
  if constexpr (std::is_copy_constructible_v<F>) {
    const long before = t.impl_.use_count();
    const F copy(f_);
    return t.impl_.use_count() > before;
  }
  return false;
}

// Makes a tensor viewing `base`'s storage with new geometry and no autograd state.
Tensor make_view(const Tensor& base, Shape shape, Shape strides, int64_t offset);

// ---- inline accessors
inline const Shape& Tensor::shape() const { return impl_->shape(); }
inline const Shape& Tensor::strides() const { return impl_->strides(); }
inline int64_t Tensor::offset() const { return impl_->offset(); }
inline int64_t Tensor::dim() const { return static_cast<int64_t>(impl_->shape().size()); }
inline int64_t Tensor::numel() const { return impl_->numel(); }
inline int64_t Tensor::nbytes() const { return impl_->numel() * static_cast<int64_t>(dtype_size(impl_->dtype())); }
inline DType Tensor::dtype() const { return impl_->dtype(); }
inline Device Tensor::device() const { return impl_->storage()->device(); }
inline bool Tensor::is_contiguous() const { return impl_->is_contiguous(); }
inline Storage& Tensor::storage() const { return *impl_->storage(); }
inline const std::shared_ptr<Storage>& Tensor::storage_ptr() const { return impl_->storage(); }
inline const std::string& Tensor::name() const { return impl_->name(); }

inline void* Tensor::raw_data() const {
  return static_cast<char*>(impl_->storage()->data(impl_->name())) + impl_->offset() * dtype_size(impl_->dtype());
}

template <class T> T* Tensor::data() const {
  TALLY_CHECK(impl_, "data() on an undefined tensor");
  TALLY_CHECK(DTypeOf<T>::value == impl_->dtype(), "tensor ", str(), " holds ", dtype_name(impl_->dtype()),
              ", accessed as ", dtype_name(DTypeOf<T>::value));
  return static_cast<T*>(raw_data());
}

// Normalizes a possibly negative dimension index against `ndim`.
int64_t wrap_dim(int64_t d, int64_t ndim, const char* what = "dimension");

}  // namespace tally
