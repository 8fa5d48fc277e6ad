// The backend of one device: its memory (the caching allocator, which owns the device's
// ledger), its streams, and the typed kernel entries every op dispatches to.
//
// Ops find the backend of their tensors' device (runtime::backend(device)) and call its
// kernels; nothing above this layer names a device's implementation. Kernels write into
// preallocated outputs and know nothing of autograd; the differentiable ops (ops/*.cc)
// allocate, call them, and record backward. A backend that lacks a kernel reports it
// with the kernel's and the device's name. `cpu/` implements every entry; a CUDA
// backend plugs in beside it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/device_hooks.h"
#include "core/tensor.h"
#include "memory/caching_allocator.h"
#include "runtime/stream.h"

namespace tally::runtime {

enum class BinaryOp { Add, Sub, Mul, Div };

// The per-step constants of one AdamW update (optim/adamw.h derives them; `keep` is
// 1 - lr * weight_decay for a decayed parameter, else 1).
struct AdamWScalars {
  float beta1, beta2, step_size, inv_bc2_sqrt, eps, grad_scale, keep;
};

class Backend : public DeviceHooks {
 public:
  // ---- memory
  virtual memory::CachingAllocator& caching_allocator() = 0;
  Allocator& allocator() final { return caching_allocator(); }
  memory::Ledger& ledger() { return caching_allocator().ledger(); }

  // ---- streams
  virtual Stream& default_stream() = 0;

  // ---- elementwise and reductions. copy() and fill() come from DeviceHooks.
  // `t` itself when contiguous (or undefined), else a contiguous copy. Records no graph.
  virtual Tensor dense(const Tensor& t);
  virtual void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);  // out contiguous
  virtual void affine(const Tensor& out, const Tensor& x, double alpha, double beta);     // out = alpha*x + beta
  virtual void add_inplace(const Tensor& dst, const Tensor& src, double alpha = 1.0);     // dst += alpha*src
  // Reduces x into out, where out.shape has x's rank with 1 on every reduced dimension.
  virtual void sum_into(const Tensor& out, const Tensor& x);
  virtual void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);
  virtual void argmax_last(const Tensor& out, const Tensor& x);
  virtual double sum_squares(const Tensor& x);

  // ---- GEMM: C = alpha * op(A) @ op(B) + beta * C for 2-D strided views whose rows or
  // columns are contiguous.
  virtual void gemm(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c,
                    float alpha = 1.f, float beta = 0.f);
  // C = op(A) @ op(B) + bias, the bias (one value per column of C) added to every row: a
  // linear layer's forward. This default writes the bias into every row and accumulates
  // the GEMM onto it; a backend whose GEMM adds a bias itself overrides it.
  virtual void gemm_bias(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c,
                         const Tensor& bias);
  // Measured GEMM throughput of this device in FLOP/s with operands of `dtype` (fp32, or
  // bf16 with fp32 accumulation), cached per dtype after the first call. `probe_again`
  // measures once more and keeps the larger: on a shared machine a neighbour can slow a
  // whole probe (two cores read as one), which would flatter every "% of peak" after it,
  // so a benchmark probes again after its timed steps.
  virtual double measured_gemm_peak_flops(DType dtype = DType::F32, bool probe_again = false);
  // What a run in `dtype` should know about how this device runs its GEMMs, or "" (the
  // CPU's: bf16 widened to fp32 where oneDNN has no bf16 kernel). Said by the caller, once:
  // the runtime knows no ranks.
  virtual std::string gemm_note(DType) const { return ""; }

  // ---- neural-network kernels
  virtual void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices);
  virtual void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices);  // accumulates
  virtual void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                 const Tensor& w, const Tensor& b, double eps);
  virtual void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                                  const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd);
  virtual void gelu_forward(const Tensor& out, const Tensor& x);
  virtual void gelu_backward(const Tensor& dx, const Tensor& dout, const Tensor& x);
  // RMSNorm (LLaMA): out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps) per row.
  virtual void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps);
  virtual void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                                const Tensor& w, const Tensor& rstd);
  // Rotary embedding of x (B,T,heads,D) at positions offset..offset+T-1: each pair
  // (x[2i], x[2i+1]) is rotated by the angle pos * inv_freq[i] (backward: by minus it).
  virtual void rotary(const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset, bool inverse);
  // SwiGLU: out = silu(gate) * up, silu(g) = g * sigmoid(g).
  virtual void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
  virtual void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate,
                               const Tensor& up);
  virtual void softmax_forward(const Tensor& out, const Tensor& x);
  virtual void softmax_backward(const Tensor& dx, const Tensor& dout, const Tensor& y);
  virtual void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k,
                                 const Tensor& v);
  virtual void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout,
                                  const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse);
  // losses[n] = logsumexp(logits[n, :V]) - logits[n, target[n]]; lse[n] saved for backward.
  // Logits fp32 or fp64 (losses and lse alike), or bf16 (mixed precision: read as fp32,
  // losses and lse fp32); dlogits has the logits' dtype and may be the logits themselves.
  virtual void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits,
                                     const Tensor& targets, int64_t valid_vocab);
  // dlogits[n, j] = scale * (softmax_j - [j == target]) for j < V, 0 for padding columns.
  virtual void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                                      const Tensor& targets, int64_t valid_vocab, double scale);

  // ---- the optimizer: AdamW's update of contiguous fp32 parameters p with gradients g and
  // moments m, v (optim/adamw.cc has the formula), the bf16 compute copy written in the same
  // pass when defined, the gradients zeroed when asked. The CPU's loop lives in optim (it
  // threads over the whole block at once); a device backend implements this entry.
  virtual void adamw_update(const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
                            const Tensor& p_compute, const AdamWScalars& k, bool zero_grad);

  // A meta backend drops what it keeps from one dry run to the next (the GEMM library's
  // workspace it stands in for), so that the next starts as a fresh process does; a real
  // backend keeps its own.
  virtual void end_stand_in() {}

  // ---- indexing
  virtual void gather(const Tensor& out, const Tensor& x, int64_t dim, const Tensor& index);
  virtual void scatter_add(const Tensor& dx, int64_t dim, const Tensor& index, const Tensor& src);

 protected:
  [[noreturn]] void no_kernel(const char* kernel) const;
  // 2 M N K: a GEMM's multiply-adds, for the profiler's GFLOP/s (C = op(A) op(B), A's inner
  // dimension K).
  static double gemm_flops(const Tensor& a, bool transpose_a, const Tensor& c) {
    return 2.0 * static_cast<double>(c.numel()) * static_cast<double>(a.shape()[transpose_a ? 0 : 1]);
  }
};

// The backend of `device` (throws naming the device when there is none).
Backend& backend(Device device);
// The ledger of `device`'s allocator.
memory::Ledger& ledger(Device device = Device::cpu());
// Every backend created so far (CPU first): what the sanitizer walks to see all memory.
std::vector<Backend*> active_backends();


// A backend's factory (nullptr for an index that does not exist), registered once per
// device type. Registering also makes the backend core's DeviceHooks for that device
// type. A later registration of the same type replaces the earlier one (a test's fake
// device stands in for CUDA so).
using BackendFactory = Backend* (*)(int index);
using DeviceCounter = int (*)();
void register_backend(DeviceType type, BackendFactory factory, DeviceCounter count);
// Registers the backends this build has: the CPU's (runtime/cpu), and CUDA's when built
// with it (runtime/cuda). Done once at start-up, by ops::install.
void install_backends();
void register_cpu_backend();   // runtime/cpu/cpu_backend.cc
void register_meta_backend();  // runtime/meta/meta_backend.cc
void register_cuda_backend();  // runtime/cuda/cuda_backend.cc (TALLY_CUDA builds)
// Number of devices of `type` this process can use (CPU: 1; meta: 2, meta(cpu) and
// meta(cuda), indexed by the DeviceType they stand in for).
int device_count(DeviceType type);
// Bytes the GEMM library of a device of this type keeps for itself once the first GEMM
// runs (a persistent allocation the ledger shows; the memory plan counts it), known
// without such a device (a GPU run planned on a machine without one): cuBLASLt's 32 MiB on
// CUDA, its recommendation for Hopper; the CPU's oneDNN: none.
inline constexpr int64_t kCudaMatmulWorkspaceBytes = int64_t{32} << 20;
inline int64_t library_workspace_bytes(DeviceType type) {
  return type == DeviceType::CUDA ? kCudaMatmulWorkspaceBytes : 0;
}

}  // namespace tally::runtime
