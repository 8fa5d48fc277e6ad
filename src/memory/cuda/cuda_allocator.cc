// The CUDA caching allocator: the same size classes, owner tags, ledger, statistics,
// history and explicit release as the CPU allocator (memory contract R6, S1-S4), over
// cudaMalloc. Compiled only with TALLY_CUDA.
//
// Not yet here (issue 4): stream-ordered frees (a block freed while a kernel or a
// collective on another stream may still read it must wait for an event before reuse).
// Until then tally issues all CUDA work on the default stream, where reuse is safe.
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"
#include "memory/allocator.h"

namespace tally::memory {

namespace {
class CudaAllocator final : public CachingAllocator {
 public:
  explicit CudaAllocator(int index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }

 protected:
  void* system_alloc(int64_t bytes) override {
    TALLY_CHECK(cudaSetDevice(index_) == cudaSuccess, "cannot select CUDA device ", index_);
    void* p = nullptr;
    if (cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
      cudaGetLastError();  // clear the error: the caller empties the cache and retries
      return nullptr;
    }
    return p;
  }
  void system_free(void* ptr, int64_t) override {
    cudaSetDevice(index_);
    cudaFree(ptr);
  }

 private:
  int index_;
};
}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

DeviceAllocator* cuda_allocator(int index) {
  static std::mutex mutex;
  static auto* allocators = new std::map<int, std::unique_ptr<CudaAllocator>>();  // never destroyed
  std::lock_guard<std::mutex> lock(mutex);
  if (index < 0 || index >= cuda_device_count()) return nullptr;
  auto& slot = (*allocators)[index];
  if (!slot) slot = std::make_unique<CudaAllocator>(index);
  return slot.get();
}

}  // namespace tally::memory
