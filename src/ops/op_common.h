// Helpers shared by the differentiable op implementations (not part of the public API).
#pragma once
#include <initializer_list>

#include "autograd/function.h"
#include "core/tensor.h"
#include "ops/ops.h"
#include "runtime/backend.h"

namespace tally::ops::detail {

// The backend of the device `t` lives on: where its kernels run.
inline runtime::Backend& on(const Tensor& t) { return runtime::backend(t.device()); }

// A fresh output tensor for `op`, owned by the current module path (":op" appended).
inline Tensor new_output(const Shape& shape, DType dtype, Device device, const char* op) {
  return Tensor::empty(shape, dtype, device, current_owner(op));
}

// `t` itself when contiguous, otherwise a contiguous copy. Never records a graph: used
// inside ops and backward formulas to feed kernels.
inline Tensor materialize(const Tensor& t) { return t.defined() && !t.is_contiguous() ? on(t).dense(t) : t; }

// An op's tensors must share one device; the error names the op and both devices.
inline void require_same_device(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor* first = nullptr;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!first) first = t;
    else
      TALLY_CHECK(t->device() == first->device(), op, ": tensors on different devices: ", first->str(), " on ",
                  first->device().str(), " and ", t->str(), " on ", t->device().str());
  }
}

// x rounded to bf16 into a fresh contiguous tensor owned by the current module path
// (":owner" appended), whatever x's strides: mixed precision's GEMM operands.
inline Tensor to_bf16(const Tensor& x, const char* owner) {
  Tensor out = Tensor::empty(x.shape(), DType::BF16, x.device(), current_owner(owner));
  on(x).copy(out, x);
  return out;
}

inline void require_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  TALLY_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch between ", a.str(), " and ", b.str());
}

}  // namespace tally::ops::detail
