// The runtime layer: per-device backends, streams and events, and the promise that core
// and autograd reach a device only through its backend (nothing there names the CPU).
//
// A fake device proves the last point: a backend over host memory that counts its calls,
// registered in the CUDA slot of this test program (in a CUDA build it replaces the real
// CUDA backend here, which no test in this program uses). Tensor creation, copy_, fill_,
// to(Device), the engine's gradient sums and AccumulateGrad must all land in it.
#include <gtest/gtest.h>

#include <omp.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "autograd/engine.h"
#include "autograd/function.h"
#include "memory/caching_allocator.h"
#include "ops/ops.h"
#include "runtime/backend.h"
#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"
#include "runtime/profiler.h"
#include "support.h"

using namespace tally;

namespace {

class HostMemory final : public memory::SystemMemory {
 public:
  Device device() const override { return Device::cuda(0); }
  void* allocate(int64_t bytes) override { return std::aligned_alloc(64, static_cast<size_t>(bytes)); }
  void free(void* p, int64_t) override { std::free(p); }
  bool host_accessible() const override { return true; }
};

class NullStream final : public runtime::Stream {
 public:
  Device device() const override { return Device::cuda(0); }
  std::shared_ptr<runtime::Event> record() override { return nullptr; }
  void wait(const runtime::Event&) override {}
  void synchronize() override {}
};

// Float32, contiguous tensors only: enough to watch the calls go by.
class FakeDevice final : public runtime::Backend {
 public:
  FakeDevice() : allocator_(std::make_unique<HostMemory>()) {}
  Device device() const override { return Device::cuda(0); }
  memory::CachingAllocator& caching_allocator() override { return allocator_; }
  runtime::Stream& default_stream() override { return stream_; }

  void copy(const Tensor& dst, const Tensor& src) override {
    ++copies;
    EXPECT_TRUE(dst.device() == device() || src.device() == device());
    ASSERT_TRUE(dst.is_contiguous() && src.is_contiguous() && dst.shape() == src.shape());
    std::memcpy(dst.raw_data(), src.raw_data(), static_cast<size_t>(dst.nbytes()));
  }
  void fill(const Tensor& dst, double value) override {
    ++fills;
    float* p = dst.data<float>();
    for (int64_t i = 0; i < dst.numel(); ++i) p[i] = static_cast<float>(value);
  }
  Tensor dense(const Tensor& t) override { return t; }
  void binary(runtime::BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) override {
    ++binaries;
    EXPECT_EQ(op, runtime::BinaryOp::Add);
    for (int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] = a.data<float>()[i] + b.data<float>()[i];
  }
  void add_inplace(const Tensor& dst, const Tensor& src, double alpha) override {
    ++accumulations;
    for (int64_t i = 0; i < dst.numel(); ++i) dst.data<float>()[i] += static_cast<float>(alpha) * src.data<float>()[i];
  }

  int copies = 0, fills = 0, binaries = 0, accumulations = 0;

 private:
  memory::CachingAllocator allocator_;
  NullStream stream_;
};

FakeDevice& fake() {
  static auto* device = new FakeDevice();
  return *device;
}

const Device kFake = Device::cuda(0);

struct FakeDeviceRegistered : ::testing::Test {
  void SetUp() override {
    runtime::register_backend(
        DeviceType::CUDA, [](int index) -> runtime::Backend* { return index == 0 ? &fake() : nullptr; },
        [] { return 1; });
  }
};

// A function on the fake device: y = x (identity), its gradient the incoming one.
struct Identity {
  static constexpr const char* kName = "identity";
  using Context = autograd::Context;
  static std::vector<Tensor> backward(Context&, std::vector<Tensor>& grads) { return {grads[0]}; }
};
Tensor identity(const Tensor& x) {
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  out.copy_(x);
  autograd::record<Identity>(std::make_unique<Identity::Context>(), {x}, {out});
  return out;
}

}  // namespace

TEST_F(FakeDeviceRegistered, TensorsAllocateFillAndCopyThroughTheirDevicesBackend) {
  const int64_t before = fake().ledger().stats().allocated;
  Tensor t = Tensor::zeros({4}, DType::F32, kFake);
  EXPECT_EQ(t.device(), kFake);
  EXPECT_EQ(fake().ledger().stats().allocated - before, 16) << "allocated through the fake device's allocator";
  EXPECT_EQ(runtime::ledger().find(t.storage().allocation_id()).id, 0u) << "not in the CPU ledger";
  const int fills = fake().fills;
  t.fill_(3.0);
  EXPECT_EQ(fake().fills, fills + 1);

  const int copies = fake().copies;
  Tensor host = Tensor::from_vector<float>({1, 2, 3, 4}, {4});
  Tensor moved = host.to(kFake);
  EXPECT_EQ(moved.device(), kFake);
  EXPECT_EQ(fake().copies, copies + 1);
  EXPECT_EQ(moved.to_vector<float>(), (std::vector<float>{1, 2, 3, 4}));  // to_vector copies back: the same hooks
  EXPECT_EQ(fake().copies, copies + 2);
  EXPECT_EQ(host.to(Device::cpu()).impl(), host.impl()) << "to() the tensor's own device is the tensor itself";
}

TEST_F(FakeDeviceRegistered, EngineSumsAndAccumulateGradRunOnTheGradientsDevice) {
  Tensor x = Tensor::zeros({3}, DType::F32, kFake);
  x.set_requires_grad(true);
  Tensor a = identity(x), b = identity(x);  // two paths: the engine must sum them
  Tensor seed = Tensor::zeros({3}, DType::F32, kFake);
  seed.fill_(1.0);
  const int binaries = fake().binaries, copies = fake().copies, accumulations = fake().accumulations;
  autograd::backward({a, b}, {seed, seed});
  EXPECT_GE(fake().binaries, binaries + 1) << "the engine summed the two paths on the fake device";
  EXPECT_GE(fake().copies, copies + 1) << "AccumulateGrad made .grad with a device copy";
  EXPECT_EQ(x.grad().device(), kFake);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 2, 2}));
  autograd::backward({identity(x)}, {seed});
  EXPECT_EQ(fake().accumulations, accumulations + 1) << "a second backward accumulates through the backend";
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 3, 3}));
}

TEST_F(FakeDeviceRegistered, AKernelTheDeviceLacksIsAClearError) {
  Tensor t = Tensor::zeros({2, 2}, DType::F32, kFake);
  std::string m = test::message_of<Error>([&] { runtime::backend(kFake).gelu_forward(t, t); });
  EXPECT_NE(m.find("gelu"), std::string::npos) << m;
  EXPECT_NE(m.find("cuda:0"), std::string::npos) << m;
}

TEST(Runtime, OpsOnTensorsOfDifferentDevicesNameBothDevices) {
  runtime::register_backend(
      DeviceType::CUDA, [](int index) -> runtime::Backend* { return index == 0 ? &fake() : nullptr; },
      [] { return 1; });
  Tensor a = Tensor::zeros({2}), b = Tensor::zeros({2}, DType::F32, kFake);
  std::string m = test::message_of<Error>([&] { ops::add(a, b); });
  EXPECT_NE(m.find("different devices"), std::string::npos) << m;
  EXPECT_NE(m.find("cuda:0"), std::string::npos) << m;
}

TEST(Runtime, CpuStreamEventsAreReadyWhenRecorded) {
  runtime::Stream& s = runtime::backend(Device::cpu()).default_stream();
  EXPECT_EQ(s.device(), Device::cpu());
  std::shared_ptr<runtime::Event> e = s.record();
  ASSERT_TRUE(e);
  EXPECT_TRUE(e->ready());  // CPU kernels run on the calling thread as they are submitted
  s.wait(*e);
  e->synchronize();
  s.synchronize();
}

TEST(Runtime, EachBackendOwnsItsLedger) {
  runtime::Backend& cpu = runtime::backend(Device::cpu());
  EXPECT_EQ(&cpu.ledger(), &runtime::ledger(Device::cpu()));
  EXPECT_EQ(&cpu.ledger(), &cpu.caching_allocator().ledger());
  EXPECT_EQ(&cpu.allocator(), static_cast<Allocator*>(&cpu.caching_allocator()));
}

// The GEMM peak is measured once and cached; probing again keeps the larger of the two
// (a probe a neighbour slowed must not stand), and the cache then returns that.
TEST(Runtime, GemmPeakIsCachedAndAProbeAgainKeepsTheLarger) {
  runtime::Backend& cpu = runtime::backend(Device::cpu());
  const double first = cpu.measured_gemm_peak_flops(DType::F32);
  EXPECT_GT(first, 1e9) << "any CPU this runs on does more than a GFLOP/s";
  EXPECT_EQ(cpu.measured_gemm_peak_flops(DType::F32), first) << "cached";
  const double again = cpu.measured_gemm_peak_flops(DType::F32, /*probe_again=*/true);
  EXPECT_GE(again, first);
  EXPECT_EQ(cpu.measured_gemm_peak_flops(DType::F32), again);
}

namespace {
// The VmFlags line of the mapping that holds `address` in /proc/self/smaps ("" if none).
std::string mapping_flags(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  const auto at = reinterpret_cast<uintptr_t>(address);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    unsigned long long start = 0, end = 0;
    if (std::sscanf(line.c_str(), "%llx-%llx ", &start, &end) == 2 && line.find(':') > line.find(' ')) {
      inside = at >= start && at < end;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      return line;
    }
  }
  return "";
}
}  // namespace

TEST(Runtime, BlocksOfWholeHugePagesAreAdvisedHugeAndOthersAreNot) {
  // The CPU backend asks for transparent huge pages (madvise: the mapping's VmFlags show
  // "hg") on blocks of whole 2 MiB pages, and on nothing else: a block rounded up to them
  // would put bytes in RSS that the ledger does not count.
  if (!std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled")) GTEST_SKIP() << "no transparent huge pages here";
  const char* off = std::getenv("TALLY_HUGE_PAGES");
  if (off && std::string(off) == "0") GTEST_SKIP() << "TALLY_HUGE_PAGES=0";
  Tensor whole = Tensor::empty({int64_t{16} << 18}, DType::F32);  // 16 MiB: a size class of 8 huge pages
  Tensor partial = Tensor::empty({int64_t{5} << 18}, DType::F32);  // 5 MiB: a class of 2.5 of them
  ASSERT_EQ(memory::size_class(whole.nbytes()), int64_t{16} << 20);
  ASSERT_EQ(memory::size_class(partial.nbytes()), int64_t{5} << 20);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(whole.raw_data()) % (uintptr_t{2} << 20), 0u) << "aligned to a huge page";
  const std::string whole_flags = mapping_flags(whole.raw_data()), partial_flags = mapping_flags(partial.raw_data());
  ASSERT_FALSE(whole_flags.empty()) << "no mapping holds the 16 MiB block";
  EXPECT_NE(whole_flags.find(" hg"), std::string::npos) << whole_flags;
  EXPECT_EQ(partial_flags.find(" hg"), std::string::npos) << partial_flags;
}

TEST(Runtime, EmptyInnerDimensionGemmScalesCAndReductionsCheckShapes) {
  // C = alpha A B + beta C with K = 0 is beta C: it was left as C for any beta but 0.
  runtime::Backend& cpu = runtime::backend(Device::cpu());
  Tensor a = Tensor::zeros({2, 0}), b = Tensor::zeros({0, 3}), c = Tensor::full({2, 3}, 4.0).to(DType::F32);
  const uint64_t version = c.storage().version();
  cpu.gemm(a, false, b, false, c, 1.f, 0.5f);
  EXPECT_EQ(c.to_vector<float>(), std::vector<float>(6, 2.f));
  EXPECT_GT(c.storage().version(), version) << "C was written";
  // A reduction whose output dimension is neither the input's nor 1 wrote past its buffer.
  Tensor x = Tensor::zeros({4, 5}), bad = Tensor::zeros({3, 5});
  try {
    cpu.sum_into(bad, x);
    FAIL() << "a (3, 5) sum of a (4, 5) tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sum_into"), std::string::npos) << e.what();
  }
}

TEST(Runtime, Bf16GemmRunsWidenedWhereAskedOrWhereOneDnnHasNoBf16Kernel) {
  // CTest runs the bf16 tests a second time with TALLY_BF16_GEMM=widened (the path an AVX2
  // CPU takes): that run must be on it.
  const char* asked = std::getenv("TALLY_BF16_GEMM");
  const bool widened = runtime::cpu::bf16_gemm_widened();
  const bool avx512 = __builtin_cpu_supports("avx512f");
  if (asked && std::string(asked) == "widened") {
    EXPECT_TRUE(widened);
  } else if (!avx512) {
    EXPECT_TRUE(widened) << "oneDNN 2.6 has no bf16 kernel without AVX-512";
  } else {
    EXPECT_FALSE(widened) << "oneDNN runs bf16 on AVX-512";
  }
}

TEST(Runtime, Bf16GemmOverSeveralTilesMatchesFp64) {
  // Shapes past the widened path's tiles (M 256, K 768, N 1024) and its bf16 output's fp32
  // blocks (1024 x 1024): C accumulates over K tiles, beta applies once, a bf16 C is rounded
  // once per block, the bias lands on its own columns in every column block. (The second
  // shape crosses the row blocks with a short K, so the fp64 reference stays cheap.)
  // Bounds as in the test below.
  runtime::Backend& cpu = runtime::backend(Device::cpu());
  for (const auto& [M, K, N] : std::vector<std::array<int64_t, 3>>{{257, 769, 1025}, {1025, 33, 65}})
    for (bool transpose : {false, true})
      for (DType out : {DType::F32, DType::BF16})
        for (int variant = 0; variant < 3; ++variant) {  // beta 0, beta 1, beta 0 with a bias
          const float beta = variant == 1 ? 1.f : 0.f;
          const bool with_bias = variant == 2;
          Tensor a = transpose ? test::random_tensor({K, M}, 80).to(DType::BF16) : test::random_tensor({M, K}, 80).to(DType::BF16);
          Tensor b = transpose ? test::random_tensor({N, K}, 81).to(DType::BF16) : test::random_tensor({K, N}, 81).to(DType::BF16);
          Tensor c0 = test::random_tensor({M, N}, 82).to(out);
          Tensor c = c0.to(DType::F64).to(out);
          Tensor want = ops::matmul(a.to(DType::F64), b.to(DType::F64), transpose, transpose);
          if (with_bias) {
            Tensor bias = test::random_tensor({N}, 83, DType::F32);  // as mixed precision's biases are
            cpu.gemm_bias(a, transpose, b, transpose, c, bias);
            want = ops::add(want, bias.to(DType::F64).view({1, N}));
          } else {
            cpu.gemm(a, transpose, b, transpose, c, 1.f, beta);
          }
          if (beta != 0.f) want = ops::add(want, c0.to(DType::F64));
          test::Diff d = test::compare(c.to(DType::F64), want);
          const double bound = out == DType::F32 ? 4.0 * K * std::ldexp(1.0, -24) * d.ref_scale
                                                 : std::ldexp(1.0, -8) * d.ref_scale + 4.0 * K * std::ldexp(1.0, -24);
          EXPECT_LE(d.max_abs, bound) << M << "x" << K << "x" << N << (transpose ? " TT " : " NN ") << dtype_name(out)
                                      << (with_bias ? " with a bias" : beta != 0.f ? " beta 1" : " beta 0");
        }
}

TEST(Runtime, Bf16GemmMatchesFp64InEveryLayoutWrittenOrAccumulated) {
  // bf16 GEMMs take three routes (runtime/cpu/matmul.cc): x W^T on the matmul primitive, a
  // written fp32 dW = dy^T x and dx = dy W on the inner-product primitives (without AMX), an
  // accumulated one on the matmul primitive's sum post-op. Every layout (contiguous, a column
  // slice of a wider tensor, column-major), shapes with M, N or K of 1, fp32 and bf16
  // outputs, beta 0 and 1, against the fp64 product of the same bf16 values. bf16 products
  // are exact in fp32, so an fp32 C differs by accumulation order only (|err| <= K 2^-24
  // sum|a b| <= 4 K 2^-24 scale here); a bf16 C adds its one rounding (2^-8 relative to the
  // largest value, at most).
  runtime::Backend& cpu = runtime::backend(Device::cpu());
  enum class Layout { Contiguous, Sliced, ColumnMajor };
  const std::vector<std::array<int64_t, 3>> shapes = {{80, 256, 72}, {1, 256, 72}, {80, 256, 1}, {80, 1, 72}};
  for (const auto& [M, K, N] : shapes)
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (Layout layout : {Layout::Contiguous, Layout::Sliced, Layout::ColumnMajor})
          for (DType out : {DType::F32, DType::BF16})
            for (float beta : {0.f, 1.f}) {
              // A (rows, cols) bf16 operand: contiguous, a column slice of a wider tensor, or
              // the transpose of a contiguous (cols, rows) tensor (strides (1, rows)).
              auto operand = [&](int64_t rows, int64_t cols, uint64_t seed) {
                if (layout == Layout::ColumnMajor)
                  return test::random_tensor({cols, rows}, seed).to(DType::BF16).transpose(0, 1);
                Tensor wide = test::random_tensor({rows, cols + (layout == Layout::Sliced ? 6 : 0)}, seed).to(DType::BF16);
                return layout == Layout::Sliced ? wide.slice(1, 3, 3 + cols) : wide;
              };
              Tensor a = ta ? operand(K, M, 70) : operand(M, K, 70);
              Tensor b = tb ? operand(N, K, 71) : operand(K, N, 71);
              Tensor c0 = test::random_tensor({M, N}, 72).to(out);  // beta 1 adds the product onto it
              Tensor c = c0.to(DType::F64).to(out);  // c0's values (exact in fp64), in a buffer of its own
              cpu.gemm(a, ta, b, tb, c, 1.f, beta);
              Tensor want = ops::matmul(a.to(DType::F64), b.to(DType::F64), ta, tb);
              if (beta != 0.f) want = ops::add(want, c0.to(DType::F64));
              test::Diff d = test::compare(c.to(DType::F64), want);
              const double bound = out == DType::F32
                                       ? 4.0 * K * std::ldexp(1.0, -24) * d.ref_scale
                                       : std::ldexp(1.0, -8) * d.ref_scale + 4.0 * K * std::ldexp(1.0, -24);
              EXPECT_LE(d.max_abs, bound) << M << "x" << K << "x" << N << " " << (ta ? "T" : "N") << (tb ? "T" : "N")
                                          << " layout " << static_cast<int>(layout) << " " << dtype_name(out)
                                          << " beta " << beta << ": scale " << d.ref_scale;
            }
}

TEST(StridedLoops, AContiguousTensorIsCutIntoPiecesThatEveryThreadRuns) {
  // A contiguous tensor coalesces into one row; it ran on one thread whatever its size, so
  // every residual add, fill and copy of a training step left the other threads idle. The
  // row is now cut into pieces: each element visited once, by more than one thread when
  // there are several; a small tensor stays on the calling thread.
  const int threads = std::min(omp_get_max_threads(), 4);
  if (threads < 2) GTEST_SKIP() << "one OpenMP thread";
  for (const Shape& shape : {Shape{1 << 20}, Shape{1024, 768}, Shape{3, 1 << 18}, Shape{64, 8}}) {
    const int64_t n = shape_numel(shape);
    std::vector<std::atomic<int>> visits(static_cast<size_t>(n));
    std::vector<std::atomic<bool>> ran_on(static_cast<size_t>(omp_get_max_threads()));
    std::array<Shape, 1> strides{contiguous_strides(shape)};
    runtime::cpu::for_each_row<1>(shape, strides, [&](auto off, int64_t len, auto inc) {
      ran_on[static_cast<size_t>(omp_get_thread_num())] = true;
      for (int64_t i = 0; i < len; ++i) visits[static_cast<size_t>(off[0] + i * inc[0])]++;
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(visits[static_cast<size_t>(i)].load(), 1) << shape_str(shape) << " element " << i;
    int used = 0;
    for (auto& r : ran_on) used += r.load();
    if (n >= (1 << 16)) EXPECT_GE(used, 2) << shape_str(shape) << " ran on one thread";
    else EXPECT_EQ(used, 1) << shape_str(shape) << ": a small tensor is not worth a parallel region";
  }
  // Strided views: rows of a wider buffer (each row cut into pieces at its own offset), and
  // an inner stride of 2 (a piece's start is start x stride): each element's offset once.
  struct View {
    Shape shape, strides;
    int64_t span;
  };
  for (const View& v : {View{{3, 40000}, {80000, 1}, 200000}, View{{2, 40000}, {1, 2}, 80000}}) {
    std::vector<std::atomic<int>> visits(static_cast<size_t>(v.span));
    std::array<Shape, 1> strides{v.strides};
    runtime::cpu::for_each_row<1>(v.shape, strides, [&](auto off, int64_t len, auto inc) {
      for (int64_t i = 0; i < len; ++i) visits[static_cast<size_t>(off[0] + i * inc[0])]++;
    });
    for (int64_t i = 0; i < v.shape[0]; ++i)
      for (int64_t j = 0; j < v.shape[1]; ++j) {
        const int64_t at = i * v.strides[0] + j * v.strides[1];
        ASSERT_EQ(visits[static_cast<size_t>(at)].exchange(0), 1) << shape_str(v.shape) << " element (" << i << ", " << j << ")";
      }
    for (auto& x : visits) ASSERT_EQ(x.load(), 0) << shape_str(v.shape) << ": an offset outside the view was visited";
  }
}

TEST(VecMath, RowMaxFindsTheLargestEntryWhereverItSits) {
  // Every length around the 16-lane blocking, the maximum in every position (lanes and
  // tail alike), a NaN that must be skipped, and `init` winning when it is larger.
  for (int64_t n : {1, 5, 15, 16, 17, 31, 32, 33, 100}) {
    for (int64_t at = 0; at < n; ++at) {
      std::vector<float> x(static_cast<size_t>(n));
      for (int64_t j = 0; j < n; ++j) x[j] = -1.0f - 0.01f * static_cast<float>((j * 7) % 13);
      x[at] = 3.5f;
      if (n > 2) x[(at + 1) % n] = std::numeric_limits<float>::quiet_NaN();
      EXPECT_EQ(runtime::cpu::row_max(x.data(), n, -std::numeric_limits<float>::infinity()), 3.5f) << n << " " << at;
      EXPECT_EQ(runtime::cpu::row_max(x.data(), n, 7.0f), 7.0f);
    }
  }
  EXPECT_EQ(runtime::cpu::row_max(static_cast<const float*>(nullptr), 0, -2.0f), -2.0f);  // nothing read
  const double d[3] = {-2.0, -0.5, -1.0};
  EXPECT_EQ(runtime::cpu::row_max(d, 3, -10.0), -0.5);
}

TEST(VecMath, ExpIsFiniteWhereverTheTrueValueIs) {
  // exp(88.5) = 2.7e38 is below fp32's largest value (3.4e38), but the clamp at 88.7 let
  // x / ln2 round to 128, whose 2^128 is infinity. vexp now stops at 127.5 ln2 = 88.376
  // (2.4e38): finite everywhere, within 1e-6 relative of exp below that, its largest
  // value above it (no caller needs more: softmax and the loss take x <= 0, tanh is 1
  // long before, and SwiGLU holds its x at the clamp: silu_arg).
  for (float x : {80.0f, 88.0f, 88.3f, 88.5f, 88.7f, 88.72f, 1000.0f}) {
    const float got = runtime::cpu::vexp(x);
    EXPECT_TRUE(std::isfinite(got)) << x;
    const double want = std::exp(static_cast<double>(std::min(x, 88.37626f)));  // 127.5 ln2, rounded to fp32
    EXPECT_NEAR(got, want, 1e-6 * want) << x;
  }
}

// Below -87.3 (where the clamp keeps 2^n a normal float) exp is 0: -inf, a masked score,
// gave exp(-87.3) = 1.2e-38, so a masked entry of a softmax was not exactly 0. In the
// one-value form and in exp_shifted's (vexp16 on AVX-512), every lane position; a NaN
// stays NaN.
TEST(VecMath, ExpOfMinusInfinityAndFarBelowIsZero) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-inf, -1e30f, -104.0f, -87.5f}) EXPECT_EQ(runtime::cpu::vexp(x), 0.0f) << x;
  EXPECT_NEAR(runtime::cpu::vexp(-87.0f), std::exp(-87.0), 1e-6 * std::exp(-87.0));
  EXPECT_TRUE(std::isnan(runtime::cpu::vexp(std::numeric_limits<float>::quiet_NaN())));
  std::vector<float> x(37), out(37);
  for (size_t j = 0; j < x.size(); ++j) x[j] = j % 3 == 0 ? -inf : -0.25f * static_cast<float>(j);
  const float sum = runtime::cpu::exp_shifted(x.data(), 0.0f, 37, out.data(), nullptr);
  double want = 0;
  for (size_t j = 0; j < x.size(); ++j) {
    if (j % 3 == 0) EXPECT_EQ(out[j], 0.0f) << j;
    else want += out[j];
  }
  EXPECT_NEAR(sum, want, 1e-6 * want);
}

TEST(VecMath, ExpShiftedIsVexpInOnePassWithItsSumAndRounding) {
  // exp_shifted (softmax's numerators, vexp16 where the CPU has AVX-512) against vexp one
  // value at a time, over every length around the 16-lane blocking: the values within
  // 2 ulp of vexp's (equal but where x log2 e is a half-integer, rounded to even there and
  // away from zero in vexp), the sum within fp32's error of a 100-term sum, the bf16 copy
  // the same bits as round_to_bf16 of the fp32 values, the scale applied, nothing written
  // beyond n, and in place (out == x) the same as out of place.
  for (int64_t n : {0, 1, 7, 15, 16, 17, 31, 32, 33, 100}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (int64_t j = 0; j < n; ++j) x[j] = 1.5f - 0.37f * static_cast<float>((j * 11) % 29) + 1e-3f * static_cast<float>(j);
    const float shift = 0.75f, scale = 0.125f;
    std::vector<float> out(static_cast<size_t>(n) + 3, -7.0f), in_place = x;
    std::vector<BFloat16> rounded(static_cast<size_t>(n) + 3, BFloat16(-7.0f)), want_rounded(static_cast<size_t>(n));
    const float sum = runtime::cpu::exp_shifted(x.data(), shift, n, out.data(), rounded.data(), scale);
    const float sum_in_place = runtime::cpu::exp_shifted(in_place.data(), shift, n, in_place.data(), nullptr, scale);
    EXPECT_EQ(sum, sum_in_place) << n;
    double want_sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float want = scale * runtime::cpu::vexp(x[j] - shift);
      EXPECT_NEAR(out[j], want, 2.4e-7 * want) << n << " at " << j;
      EXPECT_EQ(in_place[j], out[j]) << n << " at " << j;
      want_sum += static_cast<double>(out[j]);
    }
    EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum + 1e-30) << n;
    runtime::cpu::round_to_bf16(out.data(), want_rounded.data(), n);
    for (int64_t j = 0; j < n; ++j) EXPECT_EQ(rounded[j].bits, want_rounded[j].bits) << n << " at " << j;
    for (size_t j = static_cast<size_t>(n); j < out.size(); ++j) {
      EXPECT_EQ(out[j], -7.0f) << n << ": wrote past the end";
      EXPECT_EQ(rounded[j].bits, BFloat16(-7.0f).bits) << n << ": wrote past the end";
    }
    // The sum alone (no outputs, unscaled) is the sum that comes with them.
    EXPECT_EQ(runtime::cpu::exp_shifted(x.data(), shift, n, nullptr, nullptr),
              runtime::cpu::exp_shifted(x.data(), shift, n, out.data(), nullptr)) << n;
  }
  // vexp's range: 0 or a normal float at the bottom (no denormal reaches a GEMM; -inf and
  // anything below -87.3 give 0), a finite value at the top, and NaN kept.
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> edge = {-1000.0f, -inf, -87.0f, 0.0f, 88.3f, 1000.0f, inf, nan};
  std::vector<float> got(edge.size());
  runtime::cpu::exp_shifted(edge.data(), 0.0f, static_cast<int64_t>(edge.size()), got.data(), nullptr);
  for (size_t j = 0; j + 1 < edge.size(); ++j) {
    const float want = runtime::cpu::vexp(edge[j]);
    EXPECT_NEAR(got[j], want, 2.4e-7 * want) << edge[j];
    EXPECT_TRUE(got[j] == 0.0f || got[j] >= std::numeric_limits<float>::min()) << edge[j];
    EXPECT_EQ(got[j] == 0.0f, edge[j] < -87.3f) << edge[j];
    EXPECT_TRUE(std::isfinite(got[j])) << edge[j];
  }
  EXPECT_TRUE(std::isnan(got.back()));
}

TEST(VecMath, RoundToBf16GivesAValueTheSameBitsWhereverItSits) {
  // A row of 16 + 5 copies of each value: the vector's 16 and the tail must agree, so a
  // tensor's rounding never depends on where a row ends. (With AVX512-BF16 a denormal
  // flushed to zero in the first 16 was kept by a scalar tail.)
  for (float v : {1.0e-39f, -3.0e-40f, 1.17549435e-38f, 1.00390625f, -2.5f, 3.0e38f}) {
    std::vector<float> x(21, v);
    std::vector<BFloat16> got(21);
    runtime::cpu::round_to_bf16(x.data(), got.data(), 21);
    for (size_t i = 1; i < got.size(); ++i) EXPECT_EQ(got[i].bits, got[0].bits) << v << " at " << i;
  }
}

TEST(VecMath, RoundToBf16IsNearestEvenAsTheScalarRounding) {
  // round_to_bf16 (vcvtneps2bf16 where the CPU has AVX512-BF16) against bf16_round_bits on
  // the cases rounding gets wrong: exact halfway points both ways (ties to even), just
  // above and below them, the largest finite values (rounding up to infinity), infinities,
  // NaNs (kept quiet NaNs), signed zeros, and a length that is not a multiple of 16 (the
  // scalar tail). fp32 denormals are left out: the instruction flushes them to zero.
  std::vector<float> x;
  for (uint32_t hi : {0x3f80u, 0x3f81u, 0x4049u, 0xc2f7u, 0x7f7fu, 0xff7fu})
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) x.push_back(std::bit_cast<float>((hi << 16) | lo));
  for (float v : {std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::quiet_NaN(), std::bit_cast<float>(0x7f800001u), 0.0f, -0.0f,
                  1.17549435e-38f, 3.0e38f})
    x.push_back(v);
  ASSERT_NE(x.size() % 16, 0u);
  std::vector<BFloat16> got(x.size());
  runtime::cpu::round_to_bf16(x.data(), got.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const uint16_t want = bf16_round_bits(x[i]);
    if (std::isnan(x[i])) {
      EXPECT_TRUE(std::isnan(static_cast<float>(got[i]))) << i;
      EXPECT_NE(got[i].bits & 0x40u, 0u) << "a quiet NaN, " << i;
    } else {
      EXPECT_EQ(got[i].bits, want) << std::hex << std::bit_cast<uint32_t>(x[i]);
    }
  }
  // Ties go to even: 1 + 2^-8 (halfway between 1 and 1 + 2^-7) rounds down to 1, and
  // 1 + 3 * 2^-8 up to 1 + 2^-6.
  EXPECT_EQ(got[3].bits, 0x3f80u);
  EXPECT_EQ(got[9].bits, 0x3f82u);
}

// --profile-ops: every kernel entry is timed under the phase that encloses it, GEMMs carry
// their FLOPs, nested phases count exclusive time, and nothing is recorded while off.
TEST(Profiler, TimesKernelsPerPhaseWithGemmFlops) {
  namespace profiler = runtime::profiler;
  Tensor a = Tensor::full({8, 16}, 0.5f), b = Tensor::full({16, 4}, 0.25f);
  profiler::enable(false);
  (void)ops::matmul(a, b);
  profiler::enable(true);
  EXPECT_TRUE(profiler::take().kernels.empty()) << "kernels ran while the profiler was off";
  {
    profiler::PhaseScope forward("forward");
    Tensor c = ops::matmul(a, b);
    Tensor d = ops::matmul(a, b);
    {
      profiler::PhaseScope inner("optimizer");
      (void)ops::add(c, d);
    }
  }
  const profiler::Report report = profiler::take();
  profiler::enable(false);
  const profiler::KernelRow* gemm = nullptr;
  const profiler::KernelRow* add = nullptr;
  for (const auto& k : report.kernels) {
    if (std::strcmp(k.kernel, "gemm") == 0) gemm = &k;
    if (std::strcmp(k.kernel, "add") == 0) add = &k;
  }
  ASSERT_NE(gemm, nullptr);
  EXPECT_STREQ(gemm->phase, "forward");
  EXPECT_EQ(gemm->calls, 2);
  EXPECT_DOUBLE_EQ(gemm->flops, 2 * (2.0 * 8 * 4 * 16));
  ASSERT_NE(add, nullptr);
  EXPECT_STREQ(add->phase, "optimizer");
  ASSERT_EQ(report.phases.size(), 2u);
  for (const auto& p : report.phases) EXPECT_GE(p.ms, p.kernel_ms) << p.phase;
  const std::string text = profiler::format(report);
  EXPECT_NE(text.find("forward"), std::string::npos) << text;
  EXPECT_NE(text.find("GFLOP/s"), std::string::npos) << text;
  EXPECT_NE(text.find("untimed"), std::string::npos) << text;
  EXPECT_TRUE(profiler::take().kernels.empty()) << "take() must clear the table";
}

// ---- AddressSanitizer sees tensor memory (TALLY_SANITIZE builds)
#if defined(__SANITIZE_ADDRESS__)
TEST(AsanPoisoning, ReadingACachedBlockThroughAStalePointerFails) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        float* stale;
        {
          Tensor t = Tensor::zeros({64});
          stale = t.data<float>();
        }  // the block goes back to the cache, poisoned
        volatile float v = stale[3];
        (void)v;
      },
      "use-after-poison");
}

TEST(AsanPoisoning, ReadingPastATensorsBytesFails) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Tensor t = Tensor::zeros({5});  // 20 bytes in a 256-byte block: the rest is slack
        volatile float v = t.data<float>()[5];
        (void)v;
      },
      "use-after-poison");
}

TEST(AsanPoisoning, AReusedBlockIsAddressableAgainUpToItsNewSize) {
  { Tensor t = Tensor::zeros({60}); }
  { Tensor after = Tensor::empty({memory::CachingAllocator::kQuarantineBytes / 4}); }  // ends its quarantine
  Tensor u = Tensor::zeros({60});  // the same cached block
  EXPECT_EQ(u.data<float>()[59], 0.f);
}

// A stale pointer into a released storage was caught only while its block stayed
// cached: once a tensor of the same size took it, the read returned that tensor's bytes.
TEST(AsanPoisoning, AReleasedBlockIsQuarantinedSoAStalePointerNeverReadsTheNextTensor) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(
      {
        Tensor t = Tensor::zeros({64});
        const float* stale = t.data<float>();
        t.storage().release("zero3.release(t)");
        Tensor next = Tensor::ones({64});  // the same size class
        volatile float v = stale[3];
        (void)v;
      },
      "use-after-poison");
}
#else
TEST(AsanPoisoning, OnlyInAddressSanitizerBuilds) { GTEST_SKIP() << "built without -DTALLY_SANITIZE=ON"; }
#endif

// The meta device (core/device.h): shapes and ledger records without bytes.
TEST(MetaDevice, AllocatesThroughItsLedgerAsTheCpuWouldAndHoldsNoBytes) {
  const Device meta = Device::meta();
  EXPECT_EQ(meta.str(), "meta(cpu)");
  EXPECT_EQ(meta.runs_as(), DeviceType::CPU);
  memory::Ledger& ledger = runtime::ledger(meta);
  EXPECT_NE(&ledger, &runtime::ledger(Device::cpu()));
  const int64_t before = ledger.stats().allocated;
  {
    Tensor t = Tensor::empty({3, 1000}, DType::F32, meta, make_owner(Category::Activation, "test.meta"));
    EXPECT_EQ(ledger.stats().allocated - before, 12000);
    EXPECT_EQ(t.device(), meta);
    EXPECT_EQ(t.storage().owner().name_str(), "test.meta");
    try {
      (void)t.data<float>();
      FAIL() << "a meta tensor handed out a pointer";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("meta(cpu) device, which holds no bytes"), std::string::npos) << e.what();
    }
    // Kernels compute nothing; a value read out of the device is zero.
    t.fill_(3.0);
    Tensor y = ops::gelu(t);
    EXPECT_EQ(y.shape(), (Shape{3, 1000}));
    EXPECT_EQ(y.device(), meta);
    EXPECT_EQ(ops::sum(y).item(), 0.0);
    EXPECT_EQ(Tensor::empty({2}, DType::F32, meta).to(Device::cpu()).to_vector<float>(), (std::vector<float>{0.f, 0.f}));
  }
  EXPECT_EQ(ledger.stats().allocated, before);
}

// A GEMM's dense copies of strided operands are scratch the CPU's kernel allocates; the
// meta device makes the same, so a dry run's peak counts them.
TEST(MetaDevice, AGemmMakesTheDenseCopiesTheCpusKernelMakes) {
  auto gemm_scratch = [](Device device, DType dtype, bool strided_a, bool strided_b) {
    memory::Ledger& ledger = runtime::ledger(device);
    Tensor a = Tensor::zeros({64, 96}, dtype, device), b = Tensor::zeros({96, 80}, dtype, device);
    Tensor c = Tensor::zeros({32, 40}, DType::F32, device);
    // Every other column: a view neither row- nor column-major.
    Tensor va = strided_a ? a.slice(1, 0, 96, 2).slice(0, 0, 32) : a.slice(0, 0, 32).slice(1, 0, 48);
    Tensor vb = strided_b ? b.slice(1, 0, 80, 2).slice(0, 0, 48) : b.slice(0, 0, 48).slice(1, 0, 40);
    const int64_t live = ledger.stats().allocated;
    ledger.reset_peaks();
    runtime::backend(device).gemm(va, false, vb, false, c);
    return ledger.stats().peak_allocated - live;
  };
  for (DType dtype : {DType::F32, DType::BF16})
    for (bool sa : {false, true})
      for (bool sb : {false, true}) {
        const int64_t cpu = gemm_scratch(Device::cpu(), dtype, sa, sb);
        EXPECT_EQ(gemm_scratch(Device::meta(), dtype, sa, sb), cpu) << dtype_name(dtype) << " " << sa << sb;
        if (dtype == DType::F32 && (sa || sb)) {
          EXPECT_GT(cpu, 0) << "the CPU copies a strided operand";
        }
      }
}
