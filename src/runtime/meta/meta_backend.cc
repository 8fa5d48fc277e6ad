// The meta backend (core/device.h): addresses without bytes, through the same caching
// allocator and ledger as the device it stands in for, and kernels that compute nothing
// but make the allocations that device's kernels make (their dense copies and scratch
// tensors), so that a step run on it is the real step's allocation sequence.
//
// It stands in for the CPU. (A CUDA stand-in would mirror the CUDA kernels' scratch and
// cuBLASLt's workspace; until it does, meta(cuda) is not available.)
#include <atomic>

#include "runtime/backend.h"
#include "runtime/cpu/kernels.h"

namespace tally::runtime {

namespace {

// Addresses that no one may touch: each block gets the next range of a counter that starts
// above the first page, so no two live blocks share an address and none is null.
class MetaMemory final : public memory::SystemMemory {
 public:
  explicit MetaMemory(Device device) : device_(device) {}
  Device device() const override { return device_; }
  void* allocate(int64_t bytes) override {
    const uintptr_t at = next_.fetch_add(static_cast<uintptr_t>(bytes) + kGap, std::memory_order_relaxed);
    return reinterpret_cast<void*>(at);
  }
  void free(void*, int64_t) override {}
  bool host_accessible() const override { return false; }

 private:
  static constexpr uintptr_t kGap = 4096;
  Device device_;
  std::atomic<uintptr_t> next_{uintptr_t{1} << 40};
};

class MetaStream final : public Stream {
 public:
  explicit MetaStream(Device device) : device_(device) {}
  Device device() const override { return device_; }
  std::shared_ptr<Event> record() override { return std::make_shared<ReadyEvent>(); }
  void wait(const Event&) override {}
  void synchronize() override {}

 private:
  struct ReadyEvent final : Event {
    bool ready() const override { return true; }
    void synchronize() const override {}
  };
  Device device_;
};

// A copy of `t` the CPU kernel would make: its bytes, under `owner`, alive until the caller
// drops it.
Tensor scratch_like(const Tensor& t, const char* owner) {
  return Tensor::empty(t.shape(), t.dtype(), t.device(), current_owner(owner));
}
// cpu::dense's allocation: a contiguous copy of a view that is not contiguous.
Tensor dense_like(const Tensor& t) { return !t.defined() || t.is_contiguous() ? t : scratch_like(t, "contiguous"); }

class MetaBackend final : public Backend {
 public:
  MetaBackend() : device_(Device::meta(DeviceType::CPU)), allocator_(std::make_unique<MetaMemory>(device_)), stream_(device_) {}

  Device device() const override { return device_; }
  memory::CachingAllocator& caching_allocator() override { return allocator_; }
  Stream& default_stream() override { return stream_; }

  // Nothing moves: a copy into the meta device drops the values, one out of it writes
  // zeros (a meta tensor reads as zeros).
  void copy(const Tensor& dst, const Tensor&) override {
    if (!dst.device().is_meta()) cpu::fill(dst, 0.0);
  }
  void fill(const Tensor&, double) override {}
  Tensor dense(const Tensor& t) override { return dense_like(t); }
  void binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) override {}
  void affine(const Tensor&, const Tensor&, double, double) override {}
  void add_inplace(const Tensor&, const Tensor&, double) override {}
  void sum_into(const Tensor&, const Tensor&) override {}
  void max_dim(const Tensor&, const Tensor&, const Tensor& x, int64_t) override { dense_like(x); }
  void argmax_last(const Tensor& out, const Tensor& x) override {
    const Tensor values = Tensor::empty(out.shape(), x.dtype(), x.device(), current_owner("argmax"));
    dense_like(x);
  }
  double sum_squares(const Tensor& x) override {
    dense_like(x);
    return 0.0;
  }
  void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, float alpha, float beta) override {
    gemm_scratch(a, ta, b, tb, c, alpha, beta, Tensor());
  }
  void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, const Tensor& bias) override {
    if (!cpu::gemm_adds_bias(a, ta, b, tb, c, bias)) return Backend::gemm_bias(a, ta, b, tb, c, bias);
    gemm_scratch(a, ta, b, tb, c, 1.f, 0.f, bias);
  }
  double measured_gemm_peak_flops(DType, bool) override { return 0.0; }
  void embedding_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void embedding_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void layernorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         double) override {}
  void layernorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&) override {}
  void gelu_forward(const Tensor&, const Tensor&) override {}
  void gelu_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void rmsnorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) override {}
  void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&) override {}
  void rotary(const Tensor&, const Tensor&, const Tensor&, int64_t, bool) override {}
  void swiglu_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void softmax_forward(const Tensor&, const Tensor&) override {}
  void softmax_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const Tensor&) override {}
  void cross_entropy_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double) override {}
  void adamw_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamWScalars&,
                    bool) override {}
  void gather(const Tensor&, const Tensor& x, int64_t, const Tensor& index) override {
    const Tensor xc = dense_like(x), ic = dense_like(index);
  }
  void scatter_add(const Tensor&, int64_t, const Tensor& index, const Tensor& src) override {
    const Tensor ic = dense_like(index), sc = dense_like(src);
  }

 private:
  // cpu::gemm's dense copies, all alive until it returns.
  void gemm_scratch(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, float alpha, float beta,
                    const Tensor& bias) const {
    std::vector<Tensor> copies;
    for (const Tensor& t : cpu::gemm_dense_copies(a, ta, b, tb, c, alpha, beta, bias))
      copies.push_back(scratch_like(t, "gemm_copy"));
  }

  Device device_;
  memory::CachingAllocator allocator_;
  MetaStream stream_;
};

Backend* meta_backend(int index) {
  // Never destroyed, as the CPU's: tensors in static storage may be freed after main returns.
  static auto* backend = new MetaBackend();
  return index == static_cast<int>(DeviceType::CPU) ? backend : nullptr;
}

int meta_count() { return 1; }

}  // namespace

void register_meta_backend() { register_backend(DeviceType::Meta, meta_backend, meta_count); }

}  // namespace tally::runtime
