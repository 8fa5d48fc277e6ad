// Caching allocators, one per device. Every allocation carries an OwnerTag and is
// recorded in the device's Ledger.
//
// Caching: freed blocks go to a free list keyed by size class and are reused by the
// next request of the same class, so a training loop that repeats the same shapes stops
// touching the system allocator after its first step. Size classes are 256-byte steps
// below 4 KiB and eight classes per power of two above (at most 12.5% slack).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

#include "core/device.h"
#include "memory/ledger.h"
#include "memory/owner.h"

namespace tally::memory {

struct Block {
  void* ptr = nullptr;
  int64_t bytes = 0;      // requested
  int64_t capacity = 0;   // size class actually reserved
  uint64_t id = 0;        // ledger id
};

class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  virtual Device device() const = 0;
  virtual Block allocate(int64_t bytes, OwnerTag owner) = 0;
  virtual void free(const Block& block) = 0;
  // Returns cached (unused) blocks to the system.
  virtual void empty_cache() = 0;
  Ledger& ledger() { return tally::memory::ledger(device()); }
};

// Rounds a request up to its size class.
int64_t size_class(int64_t bytes);

// The caching logic shared by every device; subclasses provide raw system memory.
class CachingAllocator : public DeviceAllocator {
 public:
  Block allocate(int64_t bytes, OwnerTag owner) override;
  void free(const Block& block) override;
  void empty_cache() override;

 protected:
  virtual void* system_alloc(int64_t bytes) = 0;
  virtual void system_free(void* ptr, int64_t bytes) = 0;

 private:
  std::mutex mutex_;
  std::map<int64_t, std::vector<void*>> free_blocks_;  // size class -> cached blocks
};

class CpuAllocator final : public CachingAllocator {
 public:
  Device device() const override { return Device::cpu(); }

 protected:
  void* system_alloc(int64_t bytes) override;
  void system_free(void* ptr, int64_t bytes) override;
};

// The allocator of a device. CUDA devices exist only in builds with TALLY_CUDA.
DeviceAllocator& allocator(Device device = Device::cpu());

// Number of visible CUDA devices (0 in builds without TALLY_CUDA or without a GPU).
int cuda_device_count();

}  // namespace tally::memory
