#include "memory/caching_allocator.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "memory/report.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define TALLY_ASAN 1
#endif

namespace tally::memory {

namespace {
// Blocks are multiples of 64 bytes (one cache line, an AVX-512 register): what the CPU
// system allocator hands out, and what poisoning covers.
int64_t block_bytes(int64_t capacity) { return (capacity + 63) / 64 * 64; }

// The index of a size class in the free lists: 1..16 for 256-byte steps up to 4 KiB,
// then eight per power of two.
size_t class_index(int64_t capacity) {
  if (capacity <= 4096) return static_cast<size_t>(capacity / 256);
  const int lg = 63 - __builtin_clzll(static_cast<unsigned long long>(capacity));
  const int64_t sub = (capacity >> (lg - 3)) - 8;  // 0..7
  return static_cast<size_t>(17 + (lg - 12) * 8 + sub);
}

// The capacity of the blocks in free list `index` (the inverse of class_index).
int64_t class_capacity(size_t index) {
  if (index <= 16) return static_cast<int64_t>(index) * 256;
  const size_t k = index - 17;
  const int lg = static_cast<int>(k / 8) + 12;
  return (int64_t{8} + static_cast<int64_t>(k % 8)) << (lg - 3);
}
}  // namespace

int64_t size_class(int64_t bytes) {
  if (bytes <= 0) return 0;
  if (bytes <= 4096) return (bytes + 255) / 256 * 256;
  // Eight classes per power of two: step = 2^(floor(log2(bytes)) - 3).
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
  int64_t step = int64_t{1} << (log2 - 3);
  return (bytes + step - 1) / step * step;
}

CachingAllocator::CachingAllocator(std::unique_ptr<SystemMemory> system)
    : system_(std::move(system)), ledger_(system_->device()) {}

CachingAllocator::~CachingAllocator() { empty_cache(); }

namespace {
// Who holds the memory, for an out-of-memory error: the live bytes of each owner name,
// the five largest.
std::string largest_holders(const Ledger& ledger) {
  std::map<std::string, int64_t> by_owner;
  for (const LiveAllocation& a : ledger.live()) by_owner[a.owner.name_str()] += a.bytes;
  std::vector<std::pair<int64_t, std::string>> order;
  for (auto& [name, bytes] : by_owner) order.emplace_back(bytes, name);
  std::sort(order.rbegin(), order.rend());
  std::string out = "largest holders:";
  for (size_t i = 0; i < order.size() && i < 5; ++i)
    out += (i ? ", '" : " '") + order[i].second + "' " + format_bytes(order[i].first);
  return order.empty() ? "nothing is allocated" : out;
}
}  // namespace

void CachingAllocator::poison(void* ptr, int64_t bytes) const {
#ifdef TALLY_ASAN
  if (ptr && system_->host_accessible()) ASAN_POISON_MEMORY_REGION(ptr, static_cast<size_t>(bytes));
#else
  (void)ptr, (void)bytes;
#endif
}

void CachingAllocator::unpoison(void* ptr, int64_t bytes) const {
#ifdef TALLY_ASAN
  if (ptr && system_->host_accessible()) ASAN_UNPOISON_MEMORY_REGION(ptr, static_cast<size_t>(bytes));
#else
  (void)ptr, (void)bytes;
#endif
}

Allocation CachingAllocator::allocate(int64_t bytes, const OwnerTag& owner, std::weak_ptr<const Storage> storage) {
  TALLY_CHECK(bytes >= 0, "allocation of negative size ", bytes, " for '", owner.name_str(), "'");
  // Past this, rounding up to a size class would overflow int64 (and no machine has it).
  constexpr int64_t kLargestBlock = int64_t{1} << 62;
  TALLY_CHECK(bytes <= kLargestBlock, "allocation of ", bytes, " bytes for '", owner.name_str(),
              "' exceeds the largest block this allocator makes (2^62 bytes, 4 EiB): a size from corrupt or misread "
              "dimensions");
  Allocation a;
  a.bytes = bytes;
  a.capacity = size_class(bytes);
  bool need_system = false;
  {
    std::lock_guard<std::mutex> lock(ledger_.mutex_);
    if (a.capacity > 0) {
      const size_t index = class_index(a.capacity);
      if (index < free_blocks_.size() && !free_blocks_[index].empty()) {
        a.ptr = free_blocks_[index].back();
        free_blocks_[index].pop_back();
        ledger_.record_cache_hit();
      } else {
        need_system = true;
      }
    }
    if (!need_system) a.slot = ledger_.record_alloc(bytes, owner, std::move(storage), &a.id);
  }
  if (need_system) {
    // The system call happens outside the lock; on failure give the cache back and retry once.
    a.ptr = system_->allocate(block_bytes(a.capacity));
    if (!a.ptr) {
      empty_cache();
      a.ptr = system_->allocate(block_bytes(a.capacity));
    }
    TALLY_CHECK(a.ptr, "out of memory on ", device().str(), ": could not allocate ", format_bytes(a.capacity),
                " for '", owner.name_str(), "' (", category_name(owner.category), "); currently allocated ",
                format_bytes(ledger_.stats().allocated), ", the cache emptied and the allocation tried again; ",
                largest_holders(ledger_));
    std::lock_guard<std::mutex> lock(ledger_.mutex_);
    ledger_.record_reserve(block_bytes(a.capacity));
    a.slot = ledger_.record_alloc(bytes, owner, std::move(storage), &a.id);
  }
  // Only the requested bytes are addressable; the block's slack stays poisoned.
  poison(a.ptr, block_bytes(a.capacity));
  unpoison(a.ptr, a.bytes);
  return a;
}

void CachingAllocator::free(const Allocation& a) {
  poison(a.ptr, block_bytes(a.capacity));  // a cached block belongs to no tensor
  std::lock_guard<std::mutex> lock(ledger_.mutex_);
  if (a.id) ledger_.record_free(a.slot, a.id);
  if (!a.ptr) return;
  const size_t index = class_index(a.capacity);
  if (index >= free_blocks_.size()) free_blocks_.resize(index + 1);
#ifdef TALLY_ASAN
  if (system_->host_accessible()) return quarantine(a.ptr, index);
#endif
  free_blocks_[index].push_back(a.ptr);
}

void CachingAllocator::quarantine(void* ptr, size_t index) {
  quarantine_.push_back({ptr, index});
  quarantined_bytes_ += block_bytes(class_capacity(index));
  while (quarantined_bytes_ > kQuarantineBytes) {
    const Quarantined oldest = quarantine_.front();
    quarantine_.pop_front();
    quarantined_bytes_ -= block_bytes(class_capacity(oldest.index));
    free_blocks_[oldest.index].push_back(oldest.ptr);
  }
}

OwnerTag CachingAllocator::owner(const Allocation& a) const {
  std::lock_guard<std::mutex> lock(ledger_.mutex_);
  const LiveAllocation* rec = ledger_.record_at(a.slot, a.id);
  return rec ? rec->owner : OwnerTag{};
}

void CachingAllocator::retag(const Allocation& a, Category category) {
  std::lock_guard<std::mutex> lock(ledger_.mutex_);
  ledger_.record_retag(a.slot, a.id, category);
}

void CachingAllocator::empty_cache() {
  std::vector<std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(ledger_.mutex_);
    for (const Quarantined& q : quarantine_) free_blocks_[q.index].push_back(q.ptr);
    quarantine_.clear();
    quarantined_bytes_ = 0;
    blocks.swap(free_blocks_);
  }
  int64_t returned = 0;
  for (size_t index = 0; index < blocks.size(); ++index) {
    const int64_t block = block_bytes(class_capacity(index));
    for (void* p : blocks[index]) {
      unpoison(p, block);
      system_->free(p, block);
      returned += block;
    }
  }
  std::lock_guard<std::mutex> lock(ledger_.mutex_);
  ledger_.record_reserve(-returned);
}

}  // namespace tally::memory
