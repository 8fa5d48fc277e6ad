// The meta backend (core/device.h): addresses without bytes, through the same caching
// allocator and ledger as the device it stands in for, and kernels that compute nothing
// but make the allocations that device's kernels make (their dense copies and scratch
// tensors), so that a step run on it is the real step's allocation sequence.
//
// It stands in for the CPU (meta(cpu)) or a CUDA device (meta(cuda)); each mirrors its
// device's kernels' scratch.
#include <algorithm>
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

// A tensor a kernel of the device stood in for would make: its bytes, under `owner`,
// alive until the caller drops it.
Tensor scratch(const Shape& shape, DType dtype, Device device, const char* owner) {
  return Tensor::empty(shape, dtype, device, current_owner(owner));
}
Tensor scratch_like(const Tensor& t, const char* owner) { return scratch(t.shape(), t.dtype(), t.device(), owner); }
// cpu::dense's allocation: a contiguous copy of a view that is not contiguous.
Tensor dense_like(const Tensor& t) { return !t.defined() || t.is_contiguous() ? t : scratch_like(t, "contiguous"); }

bool stands_for_cuda(const Tensor& t) { return t.device().is_meta() && t.device().runs_as() == DeviceType::CUDA; }

// What every meta backend shares: no bytes move, no kernel computes.
class MetaBackend : public Backend {
 public:
  explicit MetaBackend(DeviceType stands_for)
      : device_(Device::meta(stands_for)), allocator_(std::make_unique<MetaMemory>(device_)), stream_(device_) {}

  Device device() const override { return device_; }
  memory::CachingAllocator& caching_allocator() override { return allocator_; }
  Stream& default_stream() override { return stream_; }

  void fill(const Tensor&, double) override {}
  void binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) override {}
  void affine(const Tensor&, const Tensor&, double, double) override {}
  void add_inplace(const Tensor&, const Tensor&, double) override {}
  double measured_gemm_peak_flops(DType, bool) override { return 0.0; }
  void embedding_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void embedding_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void layernorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         double) override {}
  void gelu_forward(const Tensor&, const Tensor&) override {}
  void gelu_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void rmsnorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) override {}
  void rotary(const Tensor&, const Tensor&, const Tensor&, int64_t, bool) override {}
  void swiglu_forward(const Tensor&, const Tensor&, const Tensor&) override {}
  void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void cross_entropy_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double) override {}
  void adamw_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const AdamWScalars&,
                    bool) override {}

 protected:
  Device device_;

 private:
  memory::CachingAllocator allocator_;
  MetaStream stream_;
};

// Standing in for the CPU: the CPU kernels' dense copies (runtime/cpu).
class MetaCpuBackend final : public MetaBackend {
 public:
  MetaCpuBackend() : MetaBackend(DeviceType::CPU) {}

  // Nothing moves: a copy into the meta device drops the values, one out of it writes
  // zeros (a meta tensor reads as zeros). A copy with a CUDA stand-in is that device's.
  void copy(const Tensor& dst, const Tensor& src) override {
    if (stands_for_cuda(src)) return backend(src.device()).copy(dst, src);
    if (!dst.device().is_meta()) cpu::fill(dst, 0.0);
  }
  Tensor dense(const Tensor& t) override { return dense_like(t); }
  void sum_into(const Tensor&, const Tensor&) override {}
  void max_dim(const Tensor&, const Tensor&, const Tensor& x, int64_t) override { dense_like(x); }
  void argmax_last(const Tensor& out, const Tensor& x) override {
    const Tensor values = scratch(out.shape(), x.dtype(), x.device(), "argmax");
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
  void layernorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&) override {}
  void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&) override {}
  void softmax_forward(const Tensor&, const Tensor&) override {}
  void softmax_backward(const Tensor&, const Tensor&, const Tensor&) override {}
  void attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {}
  void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const Tensor&, const Tensor&) override {}
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
};

// Standing in for a CUDA device: the scratch runtime/cuda's kernels make (cuda_backend.cc,
// elementwise.cu, nn.cu), with their owners, and cuBLASLt's workspace, made at the first
// GEMM and kept, as cuda::Matmul does. Assumed where the device decides at run time:
// cuBLASLt has an algorithm with the bias epilogue for every biased GEMM (else the real
// run adds an fp32 product of the output's shape).
class MetaCudaBackend final : public MetaBackend {
 public:
  MetaCudaBackend() : MetaBackend(DeviceType::CUDA) {}

  void end_stand_in() override { library_workspace_ = Tensor(); }

  // The host <-> device staging of cuda_backend.cc's copies; nothing within the device.
  void copy(const Tensor& dst, const Tensor& src) override {
    const bool dst_here = stands_for_cuda(dst), src_here = stands_for_cuda(src);
    if (dst_here && src_here) return;
    if (dst_here) {
      const Tensor host = src.is_contiguous() ? src : scratch_like(src, "host_staging");
      if (!(dst.is_contiguous() && dst.dtype() == src.dtype() && dst.shape() == src.shape()))
        scratch(src.shape(), src.dtype(), device_, "device_staging");
      return;
    }
    const bool same = src.is_contiguous() && src.dtype() == dst.dtype() && src.shape() == dst.shape();
    const Tensor staged = same ? src : scratch(dst.shape(), dst.dtype(), device_, "device_staging");
    const Tensor host = dst.is_contiguous() ? dst : scratch_like(dst, "host_staging");
    if (!dst.device().is_meta()) cpu::fill(dst, 0.0);
  }
  Tensor dense(const Tensor& t) override { return !t.defined() || t.is_contiguous() ? t : scratch_like(t, "dense"); }
  // cuda::sum_into's partial sums: `chunks` slices of the reduced elements per output.
  void sum_into(const Tensor& out, const Tensor& x) override {
    const int64_t n_out = out.numel();
    if (n_out == 0) return;
    int64_t n_reduced = 1;
    for (int64_t d = 0; d < x.dim(); ++d)
      if (out.shape()[d] != x.shape()[d]) n_reduced *= x.shape()[d];
    const int64_t out_blocks = (n_out + 255) / 256;
    int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((n_reduced + 63) / 64, std::max<int64_t>(1, 1024 / out_blocks)));
    chunks = std::min<int64_t>(chunks, 65535);
    const int64_t per_chunk = (n_reduced + chunks - 1) / chunks;
    chunks = (n_reduced + per_chunk - 1) / per_chunk;
    scratch({chunks * n_out}, x.dtype() == DType::F64 ? DType::F64 : DType::F32, device_, "sum_into_partial");
  }
  void max_dim(const Tensor&, const Tensor&, const Tensor&, int64_t) override {}
  void argmax_last(const Tensor&, const Tensor&) override {}
  double sum_squares(const Tensor& x) override {
    const int64_t n = x.numel();
    if (n == 0) return 0.0;
    const Tensor dense_x = x.is_contiguous() ? x : scratch_like(x, "sum_squares_dense");
    const int64_t blocks = std::min<int64_t>(std::max<int64_t>(1, (n + 511) / 512), 1024);
    scratch({blocks}, DType::F64, device_, "sum_squares_partial");
    return 0.0;
  }
  void gemm(const Tensor&, bool, const Tensor&, bool, const Tensor&, float, float) override { cublaslt_workspace(); }
  void gemm_bias(const Tensor&, bool, const Tensor&, bool, const Tensor&, const Tensor&) override {
    cublaslt_workspace();
  }
  void layernorm_backward(const Tensor&, const Tensor& dw, const Tensor& db, const Tensor&, const Tensor& x,
                          const Tensor&, const Tensor&, const Tensor&) override {
    norm_weight_partials(dw, db, x);
  }
  void rmsnorm_backward(const Tensor&, const Tensor& dw, const Tensor&, const Tensor& x, const Tensor&,
                        const Tensor&) override {
    norm_weight_partials(dw, Tensor(), x);
  }
  // Head sizes other than 16, 32, 64 and 128 run zero-padded to the next of them.
  void attention_forward(const Tensor& out, const Tensor&, const Tensor& q, const Tensor& k,
                         const Tensor& v) override {
    const int64_t D = q.shape()[3], Dp = padded_head_size(D);
    if (Dp == D) return;
    const Tensor out_p = padded(out, Dp, out.dtype());
    const Tensor qp = padded(q, Dp, q.dtype()), kp = padded(k, Dp, k.dtype()), vp = padded(v, Dp, v.dtype());
  }
  void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor&) override {
    const int64_t D = q.shape()[3], Dp = padded_head_size(D);
    auto delta = [&] { return scratch({q.shape()[0], q.shape()[2], q.shape()[1]}, DType::F32, device_, "attention_delta"); };
    if (Dp == D) {
      const Tensor dout_dense = dense(dout), scratch_delta = delta(), out_dense = dense(out);
      return;
    }
    const Tensor dqp = padded(dq, Dp, DType::F32), dkp = padded(dk, Dp, DType::F32), dvp = padded(dv, Dp, DType::F32);
    const Tensor doutp = padded(dout, Dp, dout.dtype()), qp = padded(q, Dp, q.dtype()), kp = padded(k, Dp, k.dtype());
    const Tensor vp = padded(v, Dp, v.dtype()), outp = padded(out, Dp, out.dtype()), scratch_delta = delta();
  }

 private:
  void cublaslt_workspace() {
    if (library_workspace_.defined()) return;
    OwnerTag tag = make_owner(Category::Other, "cublaslt.workspace");
    tag.persistent = true;
    library_workspace_ = Tensor::empty({kCudaMatmulWorkspaceBytes / 2}, DType::U16, device_, tag);
  }
  // cuda::norm_weight_grads' per-slice partial sums of dw (and db).
  void norm_weight_partials(const Tensor& dw, const Tensor& db, const Tensor& x) {
    if (!dw.defined() && !db.defined()) return;
    const int64_t C = x.shape().back(), N = x.numel() / C;
    if (N == 0) return;
    const int64_t col_blocks = (C + 255) / 256;
    const int64_t slices = std::max<int64_t>(1, std::min<int64_t>((N + 63) / 64, std::max<int64_t>(1, 1024 / col_blocks)));
    const Tensor pw = scratch({slices, C}, DType::F32, device_, "norm_dw_partial");
    const Tensor pb = db.defined() ? scratch({slices, C}, DType::F32, device_, "norm_db_partial") : Tensor();
  }
  static int64_t padded_head_size(int64_t D) {
    for (int64_t p : {16, 32, 64, 128})
      if (D <= p) return p;
    TALLY_FAIL("causal_attention on CUDA: head size ", D, " is larger than 128, the largest the kernels take");
  }
  Tensor padded(const Tensor& like, int64_t Dp, DType dtype) const {
    Shape shape = like.shape();
    shape.back() = Dp;
    return scratch(shape, dtype, device_, "attention_padded");
  }

  Tensor library_workspace_;
};

Backend* meta_backend(int index) {
  // Never destroyed, as the CPU's: tensors in static storage may be freed after main returns.
  static auto* cpu = new MetaCpuBackend();
  static auto* cuda = new MetaCudaBackend();
  if (index == static_cast<int>(DeviceType::CPU)) return cpu;
  return index == static_cast<int>(DeviceType::CUDA) ? cuda : nullptr;
}

int meta_count() { return 2; }

}  // namespace

void register_meta_backend() { register_backend(DeviceType::Meta, meta_backend, meta_count); }

}  // namespace tally::runtime
