// The CUDA backend: device memory through the same owner-tagged caching allocator as the
// CPU (ledger, statistics, history, explicit release, the sanitizer's view), one stream
// per device on which every kernel and copy runs in order, host <-> device copies, and the
// kernels of runtime/cuda (elementwise.cu, nn.cu, attention.cu, cuBLASLt in matmul.cc).
// Compiled only with TALLY_CUDA.
//
// Ordering: all work of a device goes to its one stream, so a block the caching allocator
// hands out again is only touched by work queued after the work that used it before: the
// stream's order is the reuse rule, and no event per block is needed. Copies to the host
// wait for the stream (the host reads the bytes next); copies from pageable host memory
// return once CUDA has staged the bytes, so the host buffer may be freed at once.
#include <cuda_runtime.h>

#include <cmath>
#include <map>
#include <memory>
#include <mutex>

#include "core/error.h"
#include "runtime/backend.h"
#include "runtime/cuda/attention.h"
#include "runtime/cuda/cuda_check.h"
#include "runtime/cuda/kernels.h"
#include "runtime/cuda/matmul.h"
#include "runtime/profiler.h"

namespace tally::runtime {

namespace {

class CudaMemory final : public memory::SystemMemory {
 public:
  explicit CudaMemory(int index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }
  void* allocate(int64_t bytes) override {
    TALLY_CUDA_CHECK(cudaSetDevice(index_));
    void* p = nullptr;
    if (cudaMalloc(&p, static_cast<size_t>(bytes)) != cudaSuccess) {
      cudaGetLastError();  // clear the error: the caller empties the cache and retries
      return nullptr;
    }
    return p;
  }
  void free(void* ptr, int64_t) override {
    cudaSetDevice(index_);
    cudaFree(ptr);  // waits for the device: cached blocks are only returned when the cache is emptied
  }
  bool host_accessible() const override { return false; }

 private:
  int index_;
};

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(cudaStream_t stream) {
    TALLY_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    TALLY_CUDA_CHECK(cudaEventRecord(event_, stream));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  bool ready() const override {
    const cudaError_t st = cudaEventQuery(event_);
    if (st == cudaErrorNotReady) return false;
    TALLY_CUDA_CHECK(st);
    return true;
  }
  void synchronize() const override { TALLY_CUDA_CHECK(cudaEventSynchronize(event_)); }
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

class CudaStream final : public Stream {
 public:
  explicit CudaStream(int index) : index_(index) {
    TALLY_CUDA_CHECK(cudaSetDevice(index));
    TALLY_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  Device device() const override { return Device::cuda(index_); }
  std::shared_ptr<Event> record() override { return std::make_shared<CudaEvent>(stream_); }
  void wait(const Event& event) override {
    const auto* e = dynamic_cast<const CudaEvent*>(&event);
    if (!e) return event.synchronize();  // another device's event: the host waits for it
    TALLY_CUDA_CHECK(cudaStreamWaitEvent(stream_, e->get(), 0));
  }
  void synchronize() override { TALLY_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  cudaStream_t get() const { return stream_; }

 private:
  int index_;
  cudaStream_t stream_ = nullptr;
};

cuda::AttnType attention_type(const Tensor& t, const char* what) {
  switch (t.dtype()) {
    case DType::F32: return cuda::AttnType::F32;
    case DType::BF16: return cuda::AttnType::BF16;
    default: TALLY_FAIL("causal_attention on CUDA: ", what, " ", t.str(), " must be float32 or bfloat16");
  }
}

cuda::AttentionGeometry attention_geometry(const Tensor& q, const Tensor& k, const Tensor& v) {
  for (const Tensor* t : {&q, &k, &v})
    TALLY_CHECK(t->dim() == 4 && t->strides()[3] == 1, "causal_attention on CUDA: ", t->str(),
                " must be (B, T, heads, D) with contiguous head vectors");
  return {q.shape()[0],   q.shape()[1],   k.shape()[1],   q.shape()[2],   k.shape()[2],
          q.shape()[3],   q.strides()[0], q.strides()[1], q.strides()[2], k.strides()[0],
          k.strides()[1], k.strides()[2], v.strides()[0], v.strides()[1], v.strides()[2]};
}

class CudaBackend final : public Backend {
  cudaStream_t s() const { return stream_.get(); }
  // Kernels are asynchronous: the profiler's host timer would time the launch, so a
  // profiled kernel waits for the stream (only under --profile-ops).
  // Every entry also makes the stream's device the current one (the device guard): a
  // process that touches two GPUs launches each kernel on its own tensors' device.
  struct Scope {
    profiler::KernelScope scope;
    const CudaStream& stream;
    Scope(const char* name, const CudaStream& st, double flops = 0) : scope(name, flops), stream(st) {
      int current = -1;
      cudaGetDevice(&current);
      if (current != st.device().index) TALLY_CUDA_CHECK(cudaSetDevice(st.device().index));
    }
    ~Scope() {
      if (profiler::enabled()) cudaStreamSynchronize(stream.get());
    }
  };

 public:
  explicit CudaBackend(int index)
      : index_(index), allocator_(std::make_unique<CudaMemory>(index)), stream_(index) {}

  Device device() const override { return Device::cuda(index_); }
  memory::CachingAllocator& caching_allocator() override { return allocator_; }
  Stream& default_stream() override { return stream_; }

  void copy(const Tensor& dst, const Tensor& src) override {
    Scope scope("copy", stream_);
    const bool dst_here = dst.device() == device(), src_here = src.device() == device();
    if (dst_here && src_here) return cuda::copy(s(), dst, src);
    TALLY_CHECK((dst_here && src.device().is_cpu()) || (src_here && dst.device().is_cpu()), "copy: ",
                device().str(), " cannot copy ", src.device().str(), " -> ", dst.device().str());
    if (dst_here) return copy_from_host(dst, src);
    copy_to_host(dst, src);
  }
  void fill(const Tensor& dst, double value) override {
    Scope scope("fill", stream_);
    cuda::fill(s(), dst, value);
  }
  Tensor dense(const Tensor& t) override {
    if (!t.defined() || t.is_contiguous()) return t;
    Scope scope("dense", stream_);
    Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device(), current_owner("dense"));
    cuda::copy(s(), out, t);
    return out;
  }
  void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) override {
    Scope scope("binary", stream_);
    cuda::binary(s(), op, out, a, b);
  }
  void affine(const Tensor& out, const Tensor& x, double alpha, double beta) override {
    Scope scope("affine", stream_);
    cuda::affine(s(), out, x, alpha, beta);
  }
  void add_inplace(const Tensor& dst, const Tensor& src, double alpha) override {
    Scope scope("add_inplace", stream_);
    cuda::add_inplace(s(), dst, src, alpha);
    dst.storage().bump_version();
  }
  void sum_into(const Tensor& out, const Tensor& x) override {
    Scope scope("sum_into", stream_);
    cuda::sum_into(s(), out, x);
  }
  void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) override {
    Scope scope("max_dim", stream_);
    cuda::max_dim(s(), values, indices, x, dim);
  }
  void argmax_last(const Tensor& out, const Tensor& x) override {
    Scope scope("argmax_last", stream_);
    cuda::argmax_last(s(), out, x);
  }
  double sum_squares(const Tensor& x) override {
    Scope scope("sum_squares", stream_);
    return cuda::sum_squares(s(), x);
  }
  void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, float alpha, float beta) override {
    Scope scope("gemm", stream_, gemm_flops(a, ta, c));
    matmul().run(s(), a, ta, b, tb, c, alpha, beta);
  }
  void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, const Tensor& bias) override {
    {
      Scope scope("gemm", stream_, gemm_flops(a, ta, c));
      TALLY_CHECK(bias.dim() == 1 && bias.is_contiguous() && bias.numel() == c.shape()[1], "gemm: bias ", bias.str(),
                  " for output ", c.str());
      if (matmul().run(s(), a, ta, b, tb, c, 1.f, 0.f, bias)) return;
      // A bf16 output whose fp32 bias cuBLASLt does not take: the bias in bf16, as
      // PyTorch's autocast casts it (one rounding of the bias, then of the sum).
      if (c.dtype() == DType::BF16 && bias.dtype() == DType::F32 &&
          matmul().run(s(), a, ta, b, tb, c, 1.f, 0.f, dense_as(bias, DType::BF16)))
        return;
    }
    // No epilogue for this bias: the product in fp32, the bias added, then rounded once.
    Scope scope("gemm_bias_unfused", stream_);
    Tensor product = c.dtype() == DType::F32 ? c : Tensor::empty(c.shape(), DType::F32, device(), current_owner("gemm_bias_fp32"));
    gemm(a, ta, b, tb, product, 1.f, 0.f);
    Tensor bias32 = bias.dtype() == DType::F32 ? bias : dense_as(bias, DType::F32);
    binary(BinaryOp::Add, product, product, bias32.reshape({1, bias.numel()}));
    if (product.raw_data() != c.raw_data()) copy(c, product);
  }
  double measured_gemm_peak_flops(DType dtype, bool probe_again) override;

  void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices) override {
    Scope scope("embedding_forward", stream_);
    cuda::embedding_forward(s(), out, weight, indices);
  }
  void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices) override {
    Scope scope("embedding_backward", stream_);
    cuda::embedding_backward(s(), dweight, dout, indices);
  }
  void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                         const Tensor& b, double eps) override {
    Scope scope("layernorm_forward", stream_);
    cuda::layernorm_forward(s(), out, mean, rstd, x, w, b, eps);
  }
  void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                          const Tensor& w, const Tensor& mean, const Tensor& rstd) override {
    Scope scope("layernorm_backward", stream_);
    cuda::layernorm_backward(s(), dx, dw, db, dout, x, w, mean, rstd);
  }
  void gelu_forward(const Tensor& out, const Tensor& x) override {
    Scope scope("gelu_forward", stream_);
    cuda::gelu_forward(s(), out, x);
  }
  void gelu_backward(const Tensor& dx, const Tensor& dout, const Tensor& x) override {
    Scope scope("gelu_backward", stream_);
    cuda::gelu_backward(s(), dx, dout, x);
  }
  void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps) override {
    Scope scope("rmsnorm_forward", stream_);
    cuda::rmsnorm_forward(s(), out, rstd, x, w, eps);
  }
  void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& rstd) override {
    Scope scope("rmsnorm_backward", stream_);
    cuda::rmsnorm_backward(s(), dx, dw, dout, x, w, rstd);
  }
  void rotary(const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset, bool inverse) override {
    Scope scope("rotary", stream_);
    cuda::rotary(s(), out, x, inv_freq, offset, inverse);
  }
  void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) override {
    Scope scope("swiglu_forward", stream_);
    cuda::swiglu_forward(s(), out, gate, up);
  }
  void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                       const Tensor& up) override {
    Scope scope("swiglu_backward", stream_);
    cuda::swiglu_backward(s(), dgate, dup, dout, gate, up);
  }
  // Attention's kernels take head sizes 16, 32, 64 and 128; other sizes up to 128 run
  // zero-padded to the next of those (zeros add nothing to q.k, and the padded output and
  // gradient columns are zero), with the scale of the real size.
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                         const Tensor& v) override {
    Scope scope("attention_forward", stream_);
    TALLY_CHECK(out.is_contiguous() && lse.is_contiguous() && lse.dtype() == DType::F32,
                "causal_attention on CUDA: out ", out.str(), " and float32 lse ", lse.str(), " must be contiguous");
    const int64_t D = q.shape()[3], Dp = padded_head_size(D);
    if (Dp != D) {
      Tensor out_p = Tensor::empty(padded(out.shape(), Dp), out.dtype(), device(), current_owner("attention_padded"));
      attention_forward_kernel(out_p, lse, pad_heads(q, Dp), pad_heads(k, Dp), pad_heads(v, Dp), D);
      cuda::copy(s(), out, out_p.slice(3, 0, D));
      return;
    }
    attention_forward_kernel(out, lse, q, k, v, D);
  }
  void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) override {
    Scope scope("attention_backward", stream_);
    for (const Tensor* t : {&dq, &dk, &dv})
      TALLY_CHECK(t->is_contiguous() && t->dtype() == DType::F32, "causal_attention backward on CUDA: ", t->str(),
                  " must be contiguous float32");
    const int64_t D = q.shape()[3], Dp = padded_head_size(D);
    if (Dp != D) {
      auto zeros = [&](const Tensor& like) {
        Tensor t = Tensor::empty(padded(like.shape(), Dp), DType::F32, device(), current_owner("attention_padded"));
        cuda::fill(s(), t, 0.0);
        return t;
      };
      Tensor dq_p = zeros(dq), dk_p = zeros(dk), dv_p = zeros(dv);
      attention_backward_kernel(dq_p, dk_p, dv_p, pad_heads(dout, Dp), pad_heads(q, Dp), pad_heads(k, Dp),
                                pad_heads(v, Dp), pad_heads(out, Dp), lse, D);
      cuda::add_inplace(s(), dq, dq_p.slice(3, 0, D), 1.0);
      cuda::add_inplace(s(), dk, dk_p.slice(3, 0, D), 1.0);
      cuda::add_inplace(s(), dv, dv_p.slice(3, 0, D), 1.0);
      return;
    }
    attention_backward_kernel(dq, dk, dv, dense(dout), q, k, v, out, lse, D);
  }
  void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                             int64_t valid_vocab) override {
    Scope scope("cross_entropy_forward", stream_);
    cuda::cross_entropy_forward(s(), losses, lse, logits, targets, valid_vocab);
  }
  void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                              int64_t valid_vocab, double scale) override {
    Scope scope("cross_entropy_backward", stream_);
    cuda::cross_entropy_backward(s(), dlogits, logits, lse, targets, valid_vocab, scale);
  }
  void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v, const Tensor& p_compute,
                    const AdamWScalars& k, bool zero_grad) override {
    Scope scope("adamw", stream_);
    cuda::adamw(s(), p, g, m, v, p_compute, k, zero_grad);
  }

 private:
  cuda::Matmul& matmul() {
    if (!matmul_) matmul_ = std::make_unique<cuda::Matmul>(device());
    return *matmul_;
  }
  static int64_t padded_head_size(int64_t D) {
    for (int64_t p : {16, 32, 64, 128})
      if (D <= p) return p;
    TALLY_FAIL("causal_attention on CUDA: head size ", D, " is larger than 128, the largest the kernels take");
  }
  static Shape padded(Shape shape, int64_t Dp) {
    shape.back() = Dp;
    return shape;
  }
  // x (B, T, heads, D) copied into zeros of (B, T, heads, Dp).
  Tensor pad_heads(const Tensor& x, int64_t Dp) {
    Tensor p = Tensor::empty(padded(x.shape(), Dp), x.dtype(), device(), current_owner("attention_padded"));
    cuda::fill(s(), p, 0.0);
    cuda::copy(s(), p.slice(3, 0, x.shape()[3]), x);
    return p;
  }
  void attention_forward_kernel(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                const Tensor& v, int64_t head_size) {
    cuda::AttentionGeometry g = attention_geometry(q, k, v);
    g.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_size)));
    cuda::attention_forward(s(), g, attention_type(q, "q"), q.raw_data(), k.raw_data(), v.raw_data(),
                            attention_type(out, "out"), out.raw_data(), static_cast<float*>(lse.raw_data()));
  }
  void attention_backward_kernel(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                 const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                 const Tensor& lse, int64_t head_size) {
    cuda::AttentionGeometry g = attention_geometry(q, k, v);
    g.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_size)));
    // The rows' dO . o, the backward's scratch, owned here so the ledger names it.
    Tensor delta = Tensor::empty({g.B, g.H, g.Tq}, DType::F32, device(), current_owner("attention_delta"));
    const Tensor out_dense = dense(out);
    cuda::attention_backward(s(), g, attention_type(q, "q"), q.raw_data(), k.raw_data(), v.raw_data(),
                             attention_type(out, "out"), out_dense.raw_data(), dout.raw_data(),
                             static_cast<const float*>(lse.raw_data()), static_cast<float*>(dq.raw_data()),
                             static_cast<float*>(dk.raw_data()), static_cast<float*>(dv.raw_data()),
                             static_cast<float*>(delta.raw_data()));
  }
  Tensor dense_as(const Tensor& t, DType dtype) {
    Tensor out = Tensor::empty(t.shape(), dtype, device(), current_owner("convert"));
    cuda::copy(s(), out, t);
    return out;
  }
  // Host -> device: the host side made contiguous in its own dtype on the host, sent as
  // one transfer, then converted, broadcast and strided on the device.
  void copy_from_host(const Tensor& dst, const Tensor& src) {
    const Tensor host = src.is_contiguous() ? src : [&] {
      Tensor t = Tensor::empty(src.shape(), src.dtype(), Device::cpu(), current_owner("host_staging"));
      device_hooks(Device::cpu()).copy(t, src);
      return t;
    }();
    const size_t bytes = static_cast<size_t>(src.numel()) * dtype_size(src.dtype());
    if (dst.is_contiguous() && dst.dtype() == src.dtype() && dst.shape() == src.shape()) {
      TALLY_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), host.raw_data(), bytes, cudaMemcpyHostToDevice, s()));
      return;
    }
    Tensor staged = Tensor::empty(src.shape(), src.dtype(), device(), current_owner("device_staging"));
    TALLY_CUDA_CHECK(cudaMemcpyAsync(staged.raw_data(), host.raw_data(), bytes, cudaMemcpyHostToDevice, s()));
    cuda::copy(s(), dst, staged);
  }
  // Device -> host: converted and broadcast to the destination's shape and dtype on the
  // device, one transfer, and the stream waited for (the host reads the bytes next).
  void copy_to_host(const Tensor& dst, const Tensor& src) {
    const Tensor dev = src.is_contiguous() && src.dtype() == dst.dtype() && src.shape() == dst.shape() ? src : [&] {
      Tensor t = Tensor::empty(dst.shape(), dst.dtype(), device(), current_owner("device_staging"));
      cuda::copy(s(), t, src);
      return t;
    }();
    const size_t bytes = static_cast<size_t>(dst.numel()) * dtype_size(dst.dtype());
    const Tensor host = dst.is_contiguous() ? dst : Tensor::empty(dst.shape(), dst.dtype(), Device::cpu(),
                                                                 current_owner("host_staging"));
    TALLY_CUDA_CHECK(cudaMemcpyAsync(host.raw_data(), dev.raw_data(), bytes, cudaMemcpyDeviceToHost, s()));
    TALLY_CUDA_CHECK(cudaStreamSynchronize(s()));
    if (host.raw_data() != dst.raw_data()) device_hooks(Device::cpu()).copy(dst, host);
  }

  int index_;
  memory::CachingAllocator allocator_;
  CudaStream stream_;
  std::unique_ptr<cuda::Matmul> matmul_;
  std::map<DType, double> peak_;
};

// A large square product (8192^3 in bf16, 4096^3 in fp32), three warm-ups, then the
// best of ten timed with events: the rate the rest of the step is measured against.
double CudaBackend::measured_gemm_peak_flops(DType dtype, bool probe_again) {
  auto it = peak_.find(dtype);
  if (it != peak_.end() && !probe_again) return it->second;
  const int64_t n = dtype == DType::BF16 ? 8192 : 4096;
  const OwnerTag tag = make_owner(Category::Other, "gemm_peak_probe");
  Tensor a = Tensor::empty({n, n}, dtype, device(), tag), b = Tensor::empty({n, n}, dtype, device(), tag);
  Tensor c = Tensor::empty({n, n}, DType::F32, device(), tag);
  // Random-looking operands (zeros run faster than real data): a hash of the index.
  Tensor host = Tensor::empty({n, n}, DType::F32, Device::cpu(), tag);
  float* h = host.data<float>();
  for (int64_t i = 0; i < n * n; ++i) h[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.f - 1.f;
  copy(a, host);
  copy(b, host);
  cudaEvent_t start, stop;
  TALLY_CUDA_CHECK(cudaEventCreate(&start));
  TALLY_CUDA_CHECK(cudaEventCreate(&stop));
  double best = 0;
  for (int r = 0; r < 13; ++r) {
    TALLY_CUDA_CHECK(cudaEventRecord(start, s()));
    matmul().run(s(), a, false, b, true, c, 1.f, 0.f);
    TALLY_CUDA_CHECK(cudaEventRecord(stop, s()));
    TALLY_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    TALLY_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (r >= 3) best = std::max(best, 2.0 * n * n * n / (ms * 1e-3));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  double& peak = peak_[dtype];
  peak = std::max(peak, best);
  return peak;
}

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

void register_cuda_backend() { register_backend(DeviceType::CUDA, cuda_backend, cuda_count); }

}  // namespace tally::runtime
