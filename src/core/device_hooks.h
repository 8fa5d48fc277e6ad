// What core needs from the backend of a device, and where core finds it.
//
// Core is the lowest layer: it cannot include the runtime that implements devices. It
// declares this interface instead (as PyTorch's c10 declares the allocator and hooks that
// ATen and CUDA implement), and the runtime registers each backend here at start-up
// (ops::install, the one call a program makes before its first tensor).
// Tensor creation, Tensor::copy_ and Tensor::fill_ go through it, so nothing in core
// names the CPU.
#pragma once
#include "core/allocator.h"
#include "core/device.h"

namespace tally {

class Tensor;

class DeviceHooks {
 public:
  virtual ~DeviceHooks() = default;
  virtual Device device() const = 0;
  virtual Allocator& allocator() = 0;
  // dst = src, broadcasting src to dst's shape and converting dtypes. Both live on this
  // device, or one of them on this device and the other on the CPU (a host copy).
  virtual void copy(const Tensor& dst, const Tensor& src) = 0;
  virtual void fill(const Tensor& dst, double value) = 0;
};

// A backend's factory: the hooks of device `index`, or nullptr when there is no such device.
using DeviceHooksFactory = DeviceHooks* (*)(int index);
void register_device_hooks(DeviceType type, DeviceHooksFactory factory);
// The hooks of `device`; throws naming the device when no backend provides it.
DeviceHooks& device_hooks(Device device);
// The hooks for a copy between dst's and src's devices (the non-CPU side when they differ).
DeviceHooks& copy_hooks(Device dst, Device src);

}  // namespace tally
