#include "runtime/backend.h"

#include <array>
#include <atomic>

#include "core/error.h"

namespace tally::runtime {

namespace {
struct Registration {
  std::atomic<BackendFactory> factory{nullptr};
  std::atomic<DeviceCounter> count{nullptr};
};
std::array<Registration, kDeviceTypes>& registry() {
  static std::array<Registration, kDeviceTypes> r;
  return r;
}
std::atomic<Backend*> g_cpu{nullptr};  // the hot path: most ops run on the CPU backend

DeviceHooks* hooks_of(int index, DeviceType type) {
  BackendFactory f = registry()[static_cast<size_t>(type)].factory.load(std::memory_order_acquire);
  return f ? f(index) : nullptr;
}
DeviceHooks* cpu_hooks(int index) { return hooks_of(index, DeviceType::CPU); }
DeviceHooks* cuda_hooks(int index) { return hooks_of(index, DeviceType::CUDA); }
DeviceHooks* meta_hooks(int index) { return hooks_of(index, DeviceType::Meta); }
DeviceHooksFactory hooks_factory(DeviceType type) {
  switch (type) {
    case DeviceType::CPU: return cpu_hooks;
    case DeviceType::CUDA: return cuda_hooks;
    case DeviceType::Meta: return meta_hooks;
  }
  return nullptr;
}
}  // namespace

void register_backend(DeviceType type, BackendFactory factory, DeviceCounter count) {
  Registration& r = registry()[static_cast<size_t>(type)];
  r.factory.store(factory, std::memory_order_release);
  r.count.store(count, std::memory_order_release);
  register_device_hooks(type, hooks_factory(type));
}

void install_backends() {
  register_cpu_backend();
  register_meta_backend();
#ifdef TALLY_CUDA
  register_cuda_backend();
#endif
}

Backend& backend(Device device) {
  if (device.is_cpu()) {
    if (Backend* b = g_cpu.load(std::memory_order_acquire)) return *b;
  }
  BackendFactory f = registry()[static_cast<size_t>(device.type)].factory.load(std::memory_order_acquire);
  TALLY_CHECK(f, "device ", device.str(), ": no backend is registered for it (",
              device.is_cuda() ? "this build of tally has no CUDA backend; configure with -DTALLY_CUDA=ON"
                               : "tally::ops::install() registers the built-in ones: call it first thing in main",
              ")");
  Backend* b = f(device.index);
  TALLY_CHECK(b, "device ", device.str(), " is not available (", device_count(device.type), " ",
              device.is_cpu() ? "CPU" : device.is_cuda() ? "CUDA" : "meta", " device(s) visible)");
  if (device.is_cpu()) g_cpu.store(b, std::memory_order_release);
  return *b;
}

memory::Ledger& ledger(Device device) { return backend(device).ledger(); }

int device_count(DeviceType type) {
  DeviceCounter c = registry()[static_cast<size_t>(type)].count.load(std::memory_order_acquire);
  return c ? c() : 0;
}

std::vector<Backend*> active_backends() {
  std::vector<Backend*> out{&backend(Device::cpu())};
  for (int i = 0; i < device_count(DeviceType::CUDA); ++i) out.push_back(&backend(Device::cuda(i)));
  return out;
}

// ---------------------------------------------------------------- kernels a backend lacks

void Backend::no_kernel(const char* kernel) const {
  TALLY_FAIL(kernel, ": device ", device().str(), " has no kernel for it yet");
}

Tensor Backend::dense(const Tensor&) { no_kernel("contiguous"); }
void Backend::binary(BinaryOp, const Tensor&, const Tensor&, const Tensor&) { no_kernel("elementwise binary op"); }
void Backend::affine(const Tensor&, const Tensor&, double, double) { no_kernel("scale"); }
void Backend::add_inplace(const Tensor&, const Tensor&, double) { no_kernel("add_"); }
void Backend::sum_into(const Tensor&, const Tensor&) { no_kernel("sum"); }
void Backend::max_dim(const Tensor&, const Tensor&, const Tensor&, int64_t) { no_kernel("max"); }
void Backend::argmax_last(const Tensor&, const Tensor&) { no_kernel("argmax"); }
double Backend::sum_squares(const Tensor&) { no_kernel("sum of squares"); }
void Backend::gemm(const Tensor&, bool, const Tensor&, bool, const Tensor&, float, float) { no_kernel("matmul"); }
void Backend::gemm_bias(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c,
                        const Tensor& bias) {
  // The bias written first and the product accumulated onto it: a bf16 C would round
  // twice (the bias, then the sum), so a backend must add a bias to bf16 inside its GEMM.
  TALLY_CHECK(c.dtype() != DType::BF16, "gemm: ", device().str(), " adds no bias inside its GEMM, and writing it into ",
              "the bfloat16 output ", c.str(), " first would round twice");
  copy(c, bias);
  gemm(a, transpose_a, b, transpose_b, c, 1.f, 1.f);
}
double Backend::measured_gemm_peak_flops(DType, bool) { no_kernel("GEMM peak measurement"); }
void Backend::embedding_forward(const Tensor&, const Tensor&, const Tensor&) { no_kernel("embedding"); }
void Backend::embedding_backward(const Tensor&, const Tensor&, const Tensor&) { no_kernel("embedding backward"); }
void Backend::layernorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, double) {
  no_kernel("layernorm");
}
void Backend::layernorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&) {
  no_kernel("layernorm backward");
}
void Backend::gelu_forward(const Tensor&, const Tensor&) { no_kernel("gelu"); }
void Backend::gelu_backward(const Tensor&, const Tensor&, const Tensor&) { no_kernel("gelu backward"); }
void Backend::rmsnorm_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, double) {
  no_kernel("rmsnorm");
}
void Backend::rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                               const Tensor&) {
  no_kernel("rmsnorm backward");
}
void Backend::rotary(const Tensor&, const Tensor&, const Tensor&, int64_t, bool) { no_kernel("rotary"); }
void Backend::swiglu_forward(const Tensor&, const Tensor&, const Tensor&) { no_kernel("swiglu"); }
void Backend::swiglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_kernel("swiglu backward");
}
void Backend::softmax_forward(const Tensor&, const Tensor&) { no_kernel("softmax"); }
void Backend::softmax_backward(const Tensor&, const Tensor&, const Tensor&) { no_kernel("softmax backward"); }
void Backend::attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_kernel("causal_attention");
}
void Backend::attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                 const Tensor&, const Tensor&, const Tensor&, const Tensor&) {
  no_kernel("causal_attention backward");
}
void Backend::cross_entropy_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t) {
  no_kernel("cross_entropy");
}
void Backend::cross_entropy_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, int64_t, double) {
  no_kernel("cross_entropy backward");
}
void Backend::gather(const Tensor&, const Tensor&, int64_t, const Tensor&) { no_kernel("gather"); }
void Backend::scatter_add(const Tensor&, int64_t, const Tensor&, const Tensor&) { no_kernel("scatter_add"); }
void Backend::adamw_update(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const AdamWScalars&, bool) {
  no_kernel("adamw_update");
}

}  // namespace tally::runtime
