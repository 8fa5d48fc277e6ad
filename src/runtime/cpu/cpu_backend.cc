// The CPU backend: host memory through the caching allocator, a synchronous stream, and
// the kernels of runtime/cpu. runtime::install_backends registers it (as core's
// DeviceHooks for the CPU, and as the runtime's CPU backend).
#include <sys/mman.h>

#include <cstdlib>
#include <string>

#include "runtime/backend.h"
#include "runtime/cpu/kernels.h"
#include "runtime/profiler.h"

namespace tally::runtime {

namespace {

bool huge_pages_wanted() {
  static const bool wanted = [] {
    const char* v = std::getenv("TALLY_HUGE_PAGES");
    return v == nullptr || std::string(v) != "0";
  }();
  return wanted;
}

class CpuMemory final : public memory::SystemMemory {
 public:
  Device device() const override { return Device::cpu(); }
  // 64-byte alignment: one cache line, the width of an AVX-512 register. `bytes` is a
  // multiple of 64 (the caching allocator's block size).
  //
  // A block of whole 2 MiB pages (every size class from 16 MiB up, some from 4 MiB: the
  // parameter, gradient and Adam blocks, the logits) is aligned to 2 MiB and asked to be
  // backed by transparent huge pages, as PyTorch does under THP_MEM_ALLOC_ENABLE: a
  // training step sweeps a gigabyte or more of them, and with 4 KiB pages that overflows
  // the TLB. On Zen 4 (bench/RESULTS.md) W1's median step is 1.6% faster with huge pages
  // (12 of 16 alternating rounds); its best steps, W1-bf16 and W3 are the same within the noise;
  // peak RSS is 6 MB more. Only whole pages: rounding a block up would put bytes in
  // RSS that the ledger does not count. Where the kernel's THP setting is "never" the
  // advice changes nothing; TALLY_HUGE_PAGES=0 turns it off.
  void* allocate(int64_t bytes) override {
    constexpr int64_t kHugePage = int64_t{2} << 20;
    if (bytes < kHugePage || bytes % kHugePage != 0 || !huge_pages_wanted())
      return std::aligned_alloc(64, static_cast<size_t>(bytes));
    void* ptr = std::aligned_alloc(kHugePage, static_cast<size_t>(bytes));
    if (ptr) ::madvise(ptr, static_cast<size_t>(bytes), MADV_HUGEPAGE);  // advice: a failure changes nothing
    return ptr;
  }
  void free(void* ptr, int64_t) override { std::free(ptr); }
  bool host_accessible() const override { return true; }
};

// Kernels run on the calling thread as they are submitted, so every event is ready the
// moment it is recorded.
class CpuEvent final : public Event {
 public:
  bool ready() const override { return true; }
  void synchronize() const override {}
};

class CpuStream final : public Stream {
 public:
  Device device() const override { return Device::cpu(); }
  std::shared_ptr<Event> record() override { return std::make_shared<CpuEvent>(); }
  void wait(const Event&) override {}
  void synchronize() override {}
};

class CpuBackend final : public Backend {
 public:
  CpuBackend() : allocator_(std::make_unique<CpuMemory>()) {}

  Device device() const override { return Device::cpu(); }
  memory::CachingAllocator& caching_allocator() override { return allocator_; }
  Stream& default_stream() override { return stream_; }

  void copy(const Tensor& dst, const Tensor& src) override {
    profiler::KernelScope scope("copy");
    TALLY_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "copy: the CPU backend got ", dst.device().str(),
                " <- ", src.device().str());
    cpu::copy(dst, src);
  }
  void fill(const Tensor& dst, double value) override {
    profiler::KernelScope scope("fill");
    cpu::fill(dst, value);
  }
  Tensor dense(const Tensor& t) override {
    profiler::KernelScope scope("dense");
    return cpu::dense(t);
  }
  void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) override {
    profiler::KernelScope scope(op == BinaryOp::Add   ? "add"
                                 : op == BinaryOp::Sub ? "sub"
                                 : op == BinaryOp::Mul ? "mul"
                                                       : "div");
    cpu::binary(op, out, a, b);
  }
  void affine(const Tensor& out, const Tensor& x, double alpha, double beta) override {
    profiler::KernelScope scope("affine");
    cpu::affine(out, x, alpha, beta);
  }
  void add_inplace(const Tensor& dst, const Tensor& src, double alpha) override {
    profiler::KernelScope scope("add_inplace");
    cpu::add_inplace(dst, src, alpha);
  }
  void sum_into(const Tensor& out, const Tensor& x) override {
    profiler::KernelScope scope("sum_into");
    cpu::sum_into(out, x);
  }
  void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) override {
    profiler::KernelScope scope("max_dim");
    cpu::max_dim(values, indices, x, dim);
  }
  void argmax_last(const Tensor& out, const Tensor& x) override {
    profiler::KernelScope scope("argmax_last");
    cpu::argmax_last(out, x);
  }
  double sum_squares(const Tensor& x) override {
    profiler::KernelScope scope("sum_squares");
    return cpu::sum_squares(x);
  }
  void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, float alpha, float beta) override {
    profiler::KernelScope scope("gemm", gemm_flops(a, ta, c));
    cpu::gemm(a, ta, b, tb, c, alpha, beta);
  }
  void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, const Tensor& bias) override {
    // The matmul primitive adds the bias as it writes C. Elsewhere the base class writes
    // it first (a timed copy, which also converts its dtype) and accumulates the GEMM.
    if (!cpu::gemm_adds_bias(a, ta, b, tb, c, bias)) return Backend::gemm_bias(a, ta, b, tb, c, bias);
    profiler::KernelScope scope("gemm", gemm_flops(a, ta, c));
    cpu::gemm(a, ta, b, tb, c, 1.f, 0.f, bias);
  }
  std::string gemm_note(DType dtype) const override {
    if (dtype != DType::BF16 || !cpu::bf16_gemm_has_no_kernel()) return "";
    return "oneDNN has no bf16 GEMM kernel for this CPU (it needs AVX-512); bf16 GEMMs run as fp32 GEMMs of the bf16 "
           "operands widened to fp32: the same products and fp32 sums, with widening and rounding passes on top, so "
           "--dtype fp32 trains faster on this CPU";
  }
  double measured_gemm_peak_flops(DType dtype, bool probe_again) override {
    return cpu::measured_gemm_peak_flops(dtype, probe_again);
  }
  void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices) override {
    profiler::KernelScope scope("embedding_forward");
    cpu::embedding_forward(out, weight, indices);
  }
  void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices) override {
    profiler::KernelScope scope("embedding_backward");
    cpu::embedding_backward(dweight, dout, indices);
  }
  void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                         const Tensor& b, double eps) override {
    profiler::KernelScope scope("layernorm_forward");
    cpu::layernorm_forward(out, mean, rstd, x, w, b, eps);
  }
  void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                          const Tensor& w, const Tensor& mean, const Tensor& rstd) override {
    profiler::KernelScope scope("layernorm_backward");
    cpu::layernorm_backward(dx, dw, db, dout, x, w, mean, rstd);
  }
  void gelu_forward(const Tensor& out, const Tensor& x) override {
    profiler::KernelScope scope("gelu_forward");
    cpu::gelu_forward(out, x);
  }
  void gelu_backward(const Tensor& dx, const Tensor& dout, const Tensor& x) override {
    profiler::KernelScope scope("gelu_backward");
    cpu::gelu_backward(dx, dout, x);
  }
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps) override {
    profiler::KernelScope scope("rmsnorm_forward");
    cpu::rmsnorm_forward(out, rstd, x, w, eps);
  }
  void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& rstd) override {
    profiler::KernelScope scope("rmsnorm_backward");
    cpu::rmsnorm_backward(dx, dw, dout, x, w, rstd);
  }
  void rotary(const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset, bool inverse) override {
    profiler::KernelScope scope("rotary");
    cpu::rotary(out, x, inv_freq, offset, inverse);
  }
  void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override {
    profiler::KernelScope scope("swiglu_forward");
    cpu::swiglu_forward(out, gate, up);
  }
  void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                       const Tensor& up) override {
    profiler::KernelScope scope("swiglu_backward");
    cpu::swiglu_backward(dgate, dup, dout, gate, up);
  }
  void softmax_forward(const Tensor& out, const Tensor& x) override {
    profiler::KernelScope scope("softmax_forward");
    cpu::softmax_forward(out, x);
  }
  void softmax_backward(const Tensor& dx, const Tensor& dout, const Tensor& y) override {
    profiler::KernelScope scope("softmax_backward");
    cpu::softmax_backward(dx, dout, y);
  }
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                         const Tensor& v) override {
    profiler::KernelScope scope("attention_forward");
    cpu::attention_forward(out, lse, q, k, v);
  }
  void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) override {
    profiler::KernelScope scope("attention_backward");
    cpu::attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
  }
  void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                             int64_t valid_vocab) override {
    profiler::KernelScope scope("cross_entropy_forward");
    cpu::cross_entropy_forward(losses, lse, logits, targets, valid_vocab);
  }
  void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                              int64_t valid_vocab, double scale) override {
    profiler::KernelScope scope("cross_entropy_backward");
    cpu::cross_entropy_backward(dlogits, logits, lse, targets, valid_vocab, scale);
  }
  void gather(const Tensor& out, const Tensor& x, int64_t dim, const Tensor& index) override {
    profiler::KernelScope scope("gather");
    cpu::gather(out, x, dim, index);
  }
  void scatter_add(const Tensor& dx, int64_t dim, const Tensor& index, const Tensor& src) override {
    profiler::KernelScope scope("scatter_add");
    cpu::scatter_add(dx, dim, index, src);
  }

 private:
  memory::CachingAllocator allocator_;
  CpuStream stream_;
};

Backend* cpu_backend(int index) {
  // Never destroyed: tensors in static storage may be freed after main returns.
  static auto* backend = new CpuBackend();
  return index == 0 ? backend : nullptr;
}

int cpu_count() { return 1; }

}  // namespace

void register_cpu_backend() { register_backend(DeviceType::CPU, cpu_backend, cpu_count); }

}  // namespace tally::runtime
