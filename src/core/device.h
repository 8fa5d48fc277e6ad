// Where a tensor's bytes live. CPU is always present; CUDA devices exist when tally
// is built with TALLY_CUDA and a GPU is visible.
//
// The meta device holds no bytes: a meta tensor has its shape, dtype, strides and a
// storage of its size, its allocations go through the same caching allocator and ledger
// as a real device's, and its kernels do nothing. It stands in for a real device (the one
// it runs as: the CPU or CUDA), making the allocations that device's kernels make, so a
// step run on it is a dry run of that device's step: `tally plan`'s memory.
#pragma once
#include <cstdint>
#include <string>

namespace tally {

enum class DeviceType : uint8_t { CPU, CUDA, Meta };
inline constexpr int kDeviceTypes = 3;

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;  // meta: the DeviceType it stands in for

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::CUDA, i}; }
  static Device meta(DeviceType stands_for = DeviceType::CPU) { return {DeviceType::Meta, static_cast<int>(stands_for)}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool is_cuda() const { return type == DeviceType::CUDA; }
  bool is_meta() const { return type == DeviceType::Meta; }
  // The device whose behaviour this one has: itself, or the one a meta device stands in for.
  DeviceType runs_as() const { return is_meta() ? static_cast<DeviceType>(index) : type; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string str() const {
    if (is_meta()) return runs_as() == DeviceType::CPU ? "meta(cpu)" : "meta(cuda)";
    return is_cpu() ? "cpu" : "cuda:" + std::to_string(index);
  }
};

}  // namespace tally
