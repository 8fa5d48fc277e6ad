#include "memory/allocator.h"

#include <cstdlib>
#include <memory>

#include "core/error.h"

namespace tally::memory {

int64_t size_class(int64_t bytes) {
  if (bytes <= 0) return 0;
  if (bytes <= 4096) return (bytes + 255) / 256 * 256;
  // Eight classes per power of two: step = 2^(floor(log2(bytes)) - 3).
  int log2 = 63 - __builtin_clzll(static_cast<unsigned long long>(bytes));
  int64_t step = int64_t{1} << (log2 - 3);
  return (bytes + step - 1) / step * step;
}

Block CachingAllocator::allocate(int64_t bytes, OwnerTag owner) {
  TALLY_CHECK(bytes >= 0, "allocation of negative size ", bytes, " for '", owner.name, "'");
  Block block;
  block.bytes = bytes;
  block.capacity = size_class(bytes);
  if (block.capacity > 0) {
    bool hit = false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_blocks_.find(block.capacity);
      if (it != free_blocks_.end() && !it->second.empty()) {
        block.ptr = it->second.back();
        it->second.pop_back();
        hit = true;
      }
    }
    if (hit) {
      ledger().on_cache_hit();
    } else {
      block.ptr = system_alloc(block.capacity);
      if (!block.ptr) {
        // Give the cache back and try once more before failing.
        empty_cache();
        block.ptr = system_alloc(block.capacity);
      }
      TALLY_CHECK(block.ptr, "out of memory on ", device().str(), ": could not allocate ",
                  format_bytes(block.capacity), " for '", owner.name, "' (",
                  category_name(owner.category), "); currently allocated ",
                  format_bytes(ledger().stats().allocated));
      ledger().on_reserve(block.capacity);
    }
  }
  block.id = ledger().on_alloc(bytes, std::move(owner));
  return block;
}

void CachingAllocator::free(const Block& block) {
  if (block.id) ledger().on_free(block.id);
  if (!block.ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  free_blocks_[block.capacity].push_back(block.ptr);
}

void CachingAllocator::empty_cache() {
  std::map<int64_t, std::vector<void*>> blocks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    blocks.swap(free_blocks_);
  }
  for (auto& [capacity, ptrs] : blocks) {
    for (void* p : ptrs) {
      system_free(p, capacity);
      ledger().on_reserve(-capacity);
    }
  }
}

void* CpuAllocator::system_alloc(int64_t bytes) {
  // 64-byte alignment: one cache line, the width of an AVX-512 register.
  size_t rounded = (static_cast<size_t>(bytes) + 63) / 64 * 64;
  return std::aligned_alloc(64, rounded);
}

void CpuAllocator::system_free(void* ptr, int64_t) { std::free(ptr); }

#ifdef TALLY_CUDA
DeviceAllocator* cuda_allocator(int index);  // memory/cuda/cuda_allocator.cc
#else
int cuda_device_count() { return 0; }
#endif

DeviceAllocator& allocator(Device device) {
  if (device.is_cpu()) {
    // Never destroyed: tensors in static storage may be freed after main returns.
    static auto* cpu = new CpuAllocator();
    return *cpu;
  }
#ifdef TALLY_CUDA
  DeviceAllocator* a = cuda_allocator(device.index);
  TALLY_CHECK(a, "device ", device.str(), " is not available (", cuda_device_count(), " CUDA device(s) visible)");
  return *a;
#else
  TALLY_FAIL("device ", device.str(), ": this build of tally has no CUDA support (configure with -DTALLY_CUDA=ON)");
#endif
}

}  // namespace tally::memory
