// The memory of one device, as core sees it: allocations that carry an owner, and the
// owner bookkeeping behind them (the ledger).
//
// Core declares this interface and a Storage uses it; the memory layer implements it
// (memory::CachingAllocator) and the runtime layer gives each device one (a Backend
// owns its device's allocator, and the allocator owns its ledger).
#pragma once
#include <cstdint>
#include <memory>

#include "core/device.h"
#include "core/owner.h"

namespace tally {

class Storage;

struct Allocation {
  void* ptr = nullptr;
  int64_t bytes = 0;     // requested
  int64_t capacity = 0;  // reserved: the size class the allocator handed out
  uint64_t id = 0;       // ledger id, unique and increasing in birth order (0: none)
  uint32_t slot = 0;     // the ledger's record of it (internal to the allocator)
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  // `storage` is the Storage the bytes are for: the ledger keeps it weakly, to answer
  // "who holds this allocation" (memory contract S4) without keeping it alive.
  virtual Allocation allocate(int64_t bytes, const OwnerTag& owner, std::weak_ptr<const Storage> storage) = 0;
  virtual void free(const Allocation& allocation) = 0;
  // Owner bookkeeping of a live allocation.
  virtual OwnerTag owner(const Allocation& allocation) const = 0;
  virtual void retag(const Allocation& allocation, Category category) = 0;
};

}  // namespace tally
