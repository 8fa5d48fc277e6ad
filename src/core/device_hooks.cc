#include "core/device_hooks.h"

#include <array>
#include <atomic>

#include "core/error.h"

namespace tally {

namespace {
// One factory per device type, written by the runtime's registration at start-up
// (runtime::install_backends, which ops::install calls).
std::array<std::atomic<DeviceHooksFactory>, kDeviceTypes>& factories() {
  static std::array<std::atomic<DeviceHooksFactory>, kDeviceTypes> f{};
  return f;
}
}  // namespace

void register_device_hooks(DeviceType type, DeviceHooksFactory factory) {
  factories()[static_cast<size_t>(type)].store(factory, std::memory_order_release);
}

DeviceHooks& device_hooks(Device device) {
  DeviceHooksFactory f = factories()[static_cast<size_t>(device.type)].load(std::memory_order_acquire);
  TALLY_CHECK(f, "device ", device.str(), ": no backend is registered for it (",
              device.is_cuda() ? "this build of tally has no CUDA backend; configure with -DTALLY_CUDA=ON"
                               : "tally::ops::install() registers the built-in backends: call it first thing in main",
              ")");
  DeviceHooks* hooks = f(device.index);
  TALLY_CHECK(hooks, "device ", device.str(), " is not available on this machine");
  return *hooks;
}

DeviceHooks& copy_hooks(Device dst, Device src) { return device_hooks(dst.is_cpu() ? src : dst); }

}  // namespace tally
