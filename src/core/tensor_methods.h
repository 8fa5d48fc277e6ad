// The Tensor methods whose implementation lives above core.
//
// Views, copies and backward are Tensor methods because that is how users write them
// (x.view(...), loss.backward()), but they record autograd graphs, so they are
// implemented by the ops layer (over autograd). Core declares this interface and the
// ops layer registers its implementation in one call at start-up (ops::install, in
// ops/install.h), as PyTorch's Tensor methods reach autograd through a dispatcher declared
// below it. Nothing here is a cast table: every entry is a typed virtual function.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/shape.h"

namespace tally {

class Tensor;
struct HookEntry;

class TensorMethods {
 public:
  virtual ~TensorMethods() = default;
  virtual Tensor view(const Tensor& x, const Shape& shape) = 0;
  virtual Tensor reshape(const Tensor& x, const Shape& shape) = 0;
  virtual Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) = 0;
  virtual Tensor permute(const Tensor& x, const std::vector<int64_t>& dims) = 0;
  virtual Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) = 0;
  virtual Tensor expand(const Tensor& x, const Shape& shape) = 0;
  virtual Tensor contiguous(const Tensor& x) = 0;
  virtual Tensor clone(const Tensor& x) = 0;
  virtual Tensor to_dtype(const Tensor& x, DType dtype) = 0;
  virtual Tensor to_device(const Tensor& x, Device device) = 0;
  virtual void backward(const Tensor& root, const Tensor& gradient, bool retain_graph) = 0;
  // Attaches a hook to the gradient of an interior tensor (a pre-hook of its grad_fn).
  virtual void add_interior_hook(const Tensor& x, std::shared_ptr<HookEntry> entry) = 0;
};

void register_tensor_methods(TensorMethods* methods);
TensorMethods& tensor_methods();  // throws when the ops layer is not linked

}  // namespace tally
