// The Tensor methods core declares (core/tensor_methods.h), implemented with the ops and
// the engine, registered with the runtime's backends by install().
#include "ops/install.h"

#include <mutex>

#include "autograd/engine.h"
#include "autograd/node.h"
#include "core/tensor_methods.h"
#include "ops/ops.h"
#include "runtime/backend.h"

namespace tally::ops {

namespace {

class OpsTensorMethods final : public TensorMethods {
 public:
  Tensor view(const Tensor& x, const Shape& shape) override { return ops::view(x, shape); }
  Tensor reshape(const Tensor& x, const Shape& shape) override { return ops::reshape(x, shape); }
  Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) override { return ops::transpose(x, d0, d1); }
  Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) override { return ops::permute(x, dims); }
  Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) override {
    return ops::slice(x, dim, start, end, step);
  }
  Tensor expand(const Tensor& x, const Shape& shape) override { return ops::expand(x, shape); }
  Tensor contiguous(const Tensor& x) override { return ops::contiguous(x); }
  Tensor clone(const Tensor& x) override { return ops::clone(x); }
  Tensor to_dtype(const Tensor& x, DType dtype) override { return ops::to_dtype(x, dtype); }
  Tensor to_device(const Tensor& x, Device device) override { return ops::to_device(x, device); }
  void backward(const Tensor& root, const Tensor& gradient, bool retain_graph) override {
    autograd::backward({root}, {gradient}, retain_graph);
  }
  void add_interior_hook(const Tensor& x, std::shared_ptr<HookEntry> entry) override {
    x.grad_fn()->add_pre_hook(std::move(entry));
  }
};

}  // namespace

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    runtime::install_backends();
    // Never destroyed (core holds a non-owning pointer): tensors may be used during exit.
    register_tensor_methods(new OpsTensorMethods());
  });
}

}  // namespace tally::ops
