// The caching allocator of one device: every allocation carries an OwnerTag and is
// recorded in the device's Ledger, which this allocator owns.
//
// Caching: freed blocks go to a free list per size class and are reused by the next
// request of the same class, so a training loop that repeats the same shapes stops
// touching the system allocator after its first step. Size classes are 256-byte steps
// up to 4 KiB and eight classes per power of two above (at most 12.5% slack).
//
// One lock (the ledger's) guards both the cache and the ledger, so an allocation and a
// free each take one uncontended lock and allocate nothing themselves.
//
// Under AddressSanitizer (TALLY_SANITIZE builds) the allocator poisons what no tensor
// may touch: a cached block, and the slack between a tensor's bytes and its block's end.
// A use-after-free through a stale pointer into a cached block, or a kernel reading past
// the end of a tensor, then fails the ASan run instead of reading recycled memory. A
// freed or released block is also quarantined there, as ASan's own allocator does: it
// is reused only once kQuarantineBytes of blocks freed after it have been, so a stale
// pointer does not silently read the tensor that took its block next.
#pragma once
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "core/allocator.h"
#include "memory/ledger.h"

namespace tally::memory {

// The raw memory of a device: what the caching allocator asks for when its cache has no
// block of the right class. CPU: aligned_alloc; CUDA: cudaMalloc.
class SystemMemory {
 public:
  virtual ~SystemMemory() = default;
  virtual Device device() const = 0;
  virtual void* allocate(int64_t bytes) = 0;  // nullptr when the device is out of memory
  virtual void free(void* ptr, int64_t bytes) = 0;
  // Whether host code may touch the memory (and so AddressSanitizer may poison it).
  virtual bool host_accessible() const = 0;
};

// Rounds a request up to its size class (for at most 2^62 bytes, which CachingAllocator
// refuses past: above 2^63 - 2^59 the rounding would overflow).
int64_t size_class(int64_t bytes);

class CachingAllocator final : public Allocator {
 public:
  explicit CachingAllocator(std::unique_ptr<SystemMemory> system);
  ~CachingAllocator() override;

  Device device() const override { return system_->device(); }
  Allocation allocate(int64_t bytes, const OwnerTag& owner, std::weak_ptr<const Storage> storage) override;
  void free(const Allocation& allocation) override;
  OwnerTag owner(const Allocation& allocation) const override;
  void retag(const Allocation& allocation, Category category) override;

  // Returns cached (unused) blocks to the system.
  void empty_cache();
  Ledger& ledger() { return ledger_; }
  const Ledger& ledger() const { return ledger_; }

  // Under AddressSanitizer: how many bytes of freed blocks wait before any is reused.
  static constexpr int64_t kQuarantineBytes = int64_t{64} << 20;

 private:
  void poison(void* ptr, int64_t bytes) const;
  void unpoison(void* ptr, int64_t bytes) const;

  struct Quarantined {
    void* ptr;
    size_t index;  // its size class
  };
  // Under AddressSanitizer a freed block waits here, oldest first, before its free list.
  void quarantine(void* ptr, size_t index);

  std::unique_ptr<SystemMemory> system_;  // owning
  Ledger ledger_;                         // owning; its mutex also guards free_blocks_ and quarantine_
  std::vector<std::vector<void*>> free_blocks_;  // by size-class index
  std::deque<Quarantined> quarantine_;
  int64_t quarantined_bytes_ = 0;
};

}  // namespace tally::memory
