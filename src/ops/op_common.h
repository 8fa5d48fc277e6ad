// Helpers shared by the differentiable op implementations (not part of the public API).
#pragma once
#include <initializer_list>

#include "autograd/function.h"
#include "core/tensor.h"
#include "ops/cpu/kernels.h"
#include "ops/ops.h"

namespace tally::ops::detail {

// A fresh output tensor for `op`, owned by the current module path (":op" appended).
inline Tensor new_output(const Shape& shape, DType dtype, Device device, const char* op) {
  return Tensor::empty(shape, dtype, device, memory::current_owner(op));
}

// `t` itself when contiguous, otherwise a contiguous copy. Never records a graph: used
// inside ops and backward formulas to feed kernels.
inline Tensor materialize(const Tensor& t) { return cpu::dense(t); }

// CPU is the only backend whose kernels are linked in this build's op layer; CUDA tensors
// are rejected with a clear message instead of being read from host code.
inline void require_cpu(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    if (t->defined())
      TALLY_CHECK(t->device().is_cpu(), op, ": tensor ", t->str(), " is on ", t->device().str(),
                  "; this op has no kernel for that device yet");
}

inline void require_same_dtype(const char* op, const Tensor& a, const Tensor& b) {
  TALLY_CHECK(a.dtype() == b.dtype(), op, ": dtype mismatch between ", a.str(), " and ", b.str());
}

}  // namespace tally::ops::detail
