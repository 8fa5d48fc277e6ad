// The ledger: every live allocation of one device, with its owner, and the device's
// memory statistics. Each caching allocator owns the ledger of its device and updates it
// under its own lock, so an allocation costs one lock, not two; the sanitizer and the
// trainer read it.
//
// Records live in slots reused through a free list (no node allocation per record);
// owner names are interned ids. The optional history of alloc/free events (off by
// default: one branch per event when off) exports as a Perfetto/Chrome trace or an HTML
// report (memory/report.h).
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "core/device.h"
#include "core/owner.h"

namespace tally {
class Storage;
}

namespace tally::memory {

struct Stats {
  int64_t allocated = 0;       // bytes handed out and not yet freed (requested sizes)
  int64_t peak_allocated = 0;  // since start or the last reset_peaks()
  int64_t reserved = 0;        // bytes the allocator holds from the system (in use + cached)
  int64_t peak_reserved = 0;
  std::array<int64_t, kNumCategories> allocated_by_category{};
  std::array<int64_t, kNumCategories> peak_by_category{};
  int64_t live_non_persistent = 0;  // what the step-boundary check compares
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_cache_hits = 0;
  int64_t num_system_allocs = 0;
};

// Native return addresses of an allocation site, shared between the history and the record.
using StackTrace = std::vector<void*>;

struct LiveAllocation {
  uint64_t id = 0;  // 0: not live
  int64_t bytes = 0;
  OwnerTag owner;
  std::weak_ptr<const Storage> storage;     // non-owning: who holds it is asked of the storage (S4)
  std::shared_ptr<const StackTrace> stack;  // when history asks for stacks
};

struct MemoryEvent {
  double time_us = 0;
  int64_t delta = 0;  // +bytes on alloc, -bytes on free
  Category category = Category::Other;
  NameId name = 0;
  int64_t step = -1;
  int64_t microbatch = -1;
  std::shared_ptr<const StackTrace> stack;
  bool retag = false;  // one half of a category change, not an allocation or a free
  uint64_t id = 0;     // the allocation's id: pairs a free (or retag) with its allocation
};

class CachingAllocator;

// The moment a peak was reached: the allocation that raised it (its owner, whose name
// holds the module path and the op, and the step and microbatch it was made in) and the
// phase of the step its thread was in (core/owner.h's PhaseMark; "" for none).
struct PeakMoment {
  OwnerTag owner;
  const char* phase = "";
  int64_t bytes = 0;  // the peak it made (0: none tracked yet)
};

// Live bytes of one owner (category and name) at a moment.
struct OwnerBytes {
  Category category = Category::Other;
  NameId name = 0;
  int64_t bytes = 0;
};

class Ledger {
 public:
  explicit Ledger(Device device) : device_(device) {}
  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  Device device() const { return device_; }

  Stats stats() const;
  void reset_peaks();
  std::vector<LiveAllocation> live() const;
  LiveAllocation find(uint64_t id) const;  // id 0 when not live
  // The largest id handed out so far: allocations with a larger id are born after this call.
  uint64_t last_id() const;

  // Who holds the peak: while on, every allocation that raises the peak records the live
  // bytes by owner (category and name), largest first. A scan of the live records per new
  // peak: meant for a few steps of diagnosis (the trainer's check against its plan), not
  // for every step. reset_peaks() keeps the last snapshot until the peak rises again.
  void track_peak_owners(bool on);
  std::vector<OwnerBytes> peak_owners() const;
  PeakMoment peak_moment() const;  // of the same snapshot

  // History: alloc/free events, optionally with native stacks.
  void enable_history(bool enabled, bool with_stacks = false);
  bool history_enabled() const;
  bool history_stacks() const;  // whether the history records each allocation's stack
  std::vector<MemoryEvent> history() const;
  // Stops recording and hands the history over (no copy: it may be most of a long run's
  // host memory).
  std::vector<MemoryEvent> take_history();
  void clear_history();

 private:
  // The allocator updates the ledger with its own lock held (mutex_ below).
  friend class CachingAllocator;
  // Each returns or takes the slot of the record; `mutex_` must be held.
  uint32_t record_alloc(int64_t bytes, const OwnerTag& owner, std::weak_ptr<const Storage> storage, uint64_t* id);
  void record_free(uint32_t slot, uint64_t id);
  void record_reserve(int64_t delta_bytes);
  void record_cache_hit() { stats_.num_cache_hits++; }
  LiveAllocation* record_at(uint32_t slot, uint64_t id);
  const LiveAllocation* record_at(uint32_t slot, uint64_t id) const;
  void record_retag(uint32_t slot, uint64_t id, Category category);

  Device device_;
  mutable std::mutex mutex_;  // guards everything below (and the allocator's cache)
  uint64_t next_id_ = 1;
  std::vector<LiveAllocation> slots_;  // a record is live when its id is not 0
  std::vector<uint32_t> free_slots_;
  Stats stats_;
  void snapshot_peak_owners();  // mutex_ held
  bool track_peak_owners_ = false;
  std::vector<OwnerBytes> peak_owners_;
  PeakMoment peak_moment_;
  bool history_enabled_ = false;
  bool history_stacks_ = false;
  std::vector<MemoryEvent> history_;
};

}  // namespace tally::memory
