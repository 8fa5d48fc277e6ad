// The ledger: every live allocation of one device, with its owner, and the device's
// memory statistics. The allocator reports to it; the sanitizer and the trainer read it.
//
// It also keeps an optional history of alloc/free events (off by default; when off the
// cost is one branch per event) that exports as a Perfetto/Chrome trace.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/device.h"
#include "memory/owner.h"

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

struct LiveAllocation {
  uint64_t id = 0;
  int64_t bytes = 0;
  OwnerTag owner;
  const Storage* storage = nullptr;  // non-owning: the storage unregisters before it dies
  std::vector<void*> stack;          // native return addresses, when history asks for them
};

struct MemoryEvent {
  double time_us = 0;
  int64_t delta = 0;  // +bytes on alloc, -bytes on free
  Category category = Category::Other;
  std::string name;
  int64_t step = -1;
  int64_t microbatch = -1;
  std::vector<void*> stack;
  bool retag = false;  // one half of a category change, not an allocation or a free
};

class Ledger {
 public:
  explicit Ledger(Device device) : device_(device) {}

  Device device() const { return device_; }

  // Allocator hooks.
  uint64_t on_alloc(int64_t bytes, OwnerTag owner);
  void on_free(uint64_t id);
  void on_reserve(int64_t delta_bytes);
  void on_cache_hit();

  // Storage hooks: lets the ledger answer "who holds this storage" (S4).
  void attach_storage(uint64_t id, const Storage* storage);
  void detach_storage(uint64_t id);

  // Changes an allocation's category (e.g. activation -> saved_for_backward when an
  // op saves it, activation -> gradient when the engine hands it to a leaf).
  void retag(uint64_t id, Category category);
  void set_name(uint64_t id, const std::string& name);

  Stats stats() const;
  void reset_peaks();
  std::vector<LiveAllocation> live() const;
  LiveAllocation find(uint64_t id) const;  // id 0 when not live

  // History: alloc/free events, optionally with native stacks.
  void enable_history(bool enabled, bool with_stacks = false);
  bool history_enabled() const { return history_enabled_; }
  std::vector<MemoryEvent> history() const;
  void clear_history();

 private:
  Device device_;
  mutable std::mutex mutex_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, LiveAllocation> live_;
  Stats stats_;
  bool history_enabled_ = false;
  bool history_stacks_ = false;
  std::vector<MemoryEvent> history_;
};

// The ledger of a device (created on first use).
Ledger& ledger(Device device = Device::cpu());

// Writes `events` as a Chrome/Perfetto trace: one counter track per category
// ("ph":"C") plus an instant event per allocation larger than `instant_min_bytes`.
void write_chrome_trace(const std::string& path, const std::vector<MemoryEvent>& events,
                        int64_t instant_min_bytes = 1 << 20);

// Writes `events` as a self-contained HTML page: a plot of live bytes per category over
// time (inline SVG, no scripts or network), the peak, and the largest allocations.
void write_html_report(const std::string& path, const std::vector<MemoryEvent>& events);

// Human-readable symbol for a return address (function name when available).
std::string symbolize(void* address);

std::string format_bytes(int64_t bytes);

}  // namespace tally::memory
