// Start-up: the one call a program makes before its first tensor.
//
// Core declares what it needs from the layers above it as interfaces (the devices'
// memory and copies, core/device_hooks.h; the differentiable Tensor methods, views and
// backward, core/tensor_methods.h). install() connects them: it registers the runtime's
// built-in backends (the CPU's, and CUDA's in a CUDA build) and this layer's Tensor
// methods. Idempotent and thread-safe; `tally`, the tests' main and the benchmarks call
// it first thing.
#pragma once

namespace tally::ops {

void install();

}  // namespace tally::ops
