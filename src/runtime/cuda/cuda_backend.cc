// The CUDA backend as far as it goes today: device memory through the same caching
// allocator as the CPU (owner tags, ledger, statistics, history and explicit release,
// memory contract R6 and S1-S4), over cudaMalloc. Compiled only with TALLY_CUDA.
//
// Not here yet (the CUDA issue, which needs a GPU to verify): streams and stream-ordered
// frees, copies, and kernels. Until then every kernel entry refuses with a clear error
// naming the kernel and the device (runtime::Backend's defaults).
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"
#include "runtime/backend.h"

namespace tally::runtime {

namespace {

class CudaMemory final : public memory::SystemMemory {
 public:
  explicit CudaMemory(int index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }
  void* allocate(int64_t bytes) override {
    TALLY_CHECK(cudaSetDevice(index_) == cudaSuccess, "cannot select CUDA device ", index_);
    void* p = nullptr;
    if (cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
      cudaGetLastError();  // clear the error: the caller empties the cache and retries
      return nullptr;
    }
    return p;
  }
  void free(void* ptr, int64_t) override {
    cudaSetDevice(index_);
    cudaFree(ptr);
  }
  bool host_accessible() const override { return false; }

 private:
  int index_;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int index) : index_(index), allocator_(std::make_unique<CudaMemory>(index)) {}
  Device device() const override { return Device::cuda(index_); }
  memory::CachingAllocator& caching_allocator() override { return allocator_; }
  Stream& default_stream() override { no_kernel("CUDA streams"); }
  void copy(const Tensor&, const Tensor&) override { no_kernel("copy"); }
  void fill(const Tensor&, double) override { no_kernel("fill"); }

 private:
  int index_;
  memory::CachingAllocator allocator_;
};

int cuda_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

Backend* cuda_backend(int index) {
  static std::mutex mutex;
  static auto* backends = new std::map<int, std::unique_ptr<CudaBackend>>();  // never destroyed
  std::lock_guard<std::mutex> lock(mutex);
  if (index < 0 || index >= cuda_count()) return nullptr;
  auto& slot = (*backends)[index];
  if (!slot) slot = std::make_unique<CudaBackend>(index);
  return slot.get();
}

}  // namespace

}  // namespace tally::runtime

extern "C" {
int tally_cuda_backend_anchor = [] {
  tally::runtime::register_backend(tally::DeviceType::CUDA, tally::runtime::cuda_backend, tally::runtime::cuda_count);
  return 1;
}();
}
