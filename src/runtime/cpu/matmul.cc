// GEMM on CPU through oneDNN (JIT kernels, AVX-512 / AMX where present, OpenMP threads):
// fp32 through sgemm, or through the matmul primitive for x @ W^T; bf16 through the
// matmul primitive, or (without AMX) the inner-product primitives for a written dW = dy^T x
// or dx = dy W. fp64 (gradient checks only) through a plain loop.
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>

#include <algorithm>
#include <array>
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"

namespace tally::runtime::cpu {

namespace {

// How a 2-D strided view is handed to a row-major BLAS: base pointer, whether the
// BLAS should transpose it, and its leading dimension.
struct Operand {
  Tensor storage_view;  // keeps a contiguous copy alive when one was needed
  bool trans;
  int64_t ld;
};

// How a 2-D view's elements are laid out: rows contiguous (a row-major matrix with row
// stride >= columns), columns contiguous (column-major), or neither.
enum class Layout { RowMajor, ColumnMajor, Strided };
Layout layout_of(const Tensor& t) {
  const int64_t R = t.shape()[0], C = t.shape()[1];
  const int64_t sr = t.strides()[0], sc = t.strides()[1];
  if ((sc == 1 || C == 1) && (R == 1 || sr >= C)) return Layout::RowMajor;
  if ((sr == 1 || R == 1) && (C == 1 || sc >= R)) return Layout::ColumnMajor;
  return Layout::Strided;
}

// A dense row-major copy of a view, owned as the GEMM's.
Tensor dense_copy(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device(), current_owner("gemm_copy"));
  copy(c, t);
  return c;
}

// `t` is (R, C); the logical operand is t (transpose=false) or t^T (transpose=true).
Operand describe(const Tensor& t, bool transpose) {
  const int64_t R = t.shape()[0], C = t.shape()[1];
  switch (layout_of(t)) {
    case Layout::RowMajor: return {t, transpose, std::max<int64_t>(R == 1 ? C : t.strides()[0], 1)};
    case Layout::ColumnMajor: return {t, !transpose, std::max<int64_t>(C == 1 ? R : t.strides()[1], 1)};
    case Layout::Strided: break;
  }
  return {dense_copy(t), transpose, std::max<int64_t>(C, 1)};
}

template <class T>
void naive_gemm(int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, bool ta, const T* B, int64_t ldb,
                bool tb, T beta, T* C, int64_t ldc) {
#pragma omp parallel for schedule(static) if (M * N * K > (1 << 18))
  for (int64_t i = 0; i < M; ++i) {
    std::vector<T> row(static_cast<size_t>(N), T(0));
    for (int64_t p = 0; p < K; ++p) {
      T a = ta ? A[p * lda + i] : A[i * lda + p];
      if (tb) {
        for (int64_t j = 0; j < N; ++j) row[j] += a * B[j * ldb + p];
      } else {
        const T* b = B + p * ldb;
        for (int64_t j = 0; j < N; ++j) row[j] += a * b[j];
      }
    }
    T* c = C + i * ldc;
    for (int64_t j = 0; j < N; ++j) c[j] = alpha * row[j] + (beta == T(0) ? T(0) : beta * c[j]);
  }
}

// Below this many output rows an fp32 GEMM stays on sgemm (see gemm()).
constexpr int64_t kPrimitiveMinRows = 64;

// oneDNN's CPU engine, shared by every primitive this file makes (engines are thread-safe).
const dnnl::engine& cpu_engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// C = alpha op(A) op(B) + beta C in oneDNN's terms: alpha scales the product, beta C is a
// sum post-op.
dnnl::primitive_attr gemm_attr(float alpha, float beta) {
  dnnl::primitive_attr attr;
  if (alpha != 1.f) attr.set_output_scales(0, {alpha});
  if (beta != 0.f) {
    dnnl::post_ops po;
    po.append_sum(beta);
    attr.set_post_ops(po);
  }
  return attr;
}

// A GEMM through oneDNN's matmul primitive (brgemm kernels: AMX / AVX-512 BF16 for bf16
// operands where the CPU has them, AVX-512 for fp32). Operands are fp32 or bf16 (fp32
// accumulation); the output is c's dtype (fp32 for mixed precision, or bf16). Strided
// operands are described as they are. Making a primitive costs a few hundred microseconds
// (descriptor plus JIT), about a small GEMM's time, so primitives are kept per (shapes,
// strides, dtypes, bias, alpha, beta): a training step reuses a few dozen. An optional
// bias (one value per column of c) is added by the primitive as it writes c.
void primitive_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, float alpha, float beta,
                    const Tensor& bias) {
  using dnnl::memory;
  const dnnl::engine& engine = cpu_engine();
  static dnnl::stream stream(engine);
  struct Cached {
    memory::desc ad, bd, cd, biasd;
    dnnl::matmul primitive;
  };
  // The key: each operand's dims and strides as the primitive sees them, the dtypes (the
  // bias's, or -1), and alpha's and beta's bits.
  using Key = std::array<int64_t, 17>;
  static std::mutex mutex;
  static std::map<Key, Cached> cache;
  auto dims_strides = [](const Tensor& t, bool transpose) {
    std::array<int64_t, 4> d = {t.shape()[0], t.shape()[1], t.strides()[0], t.strides()[1]};
    if (transpose) std::swap(d[0], d[1]), std::swap(d[2], d[3]);
    return d;
  };
  const auto da = dims_strides(a, ta), db = dims_strides(b, tb), dc = dims_strides(c, false);
  const Key key = {da[0], da[1], da[2], da[3], db[0], db[1], db[2], db[3], dc[0], dc[1], dc[2], dc[3],
                   static_cast<int64_t>(a.dtype()), static_cast<int64_t>(c.dtype()),
                   bias.defined() ? static_cast<int64_t>(bias.dtype()) : -1, std::bit_cast<int32_t>(alpha),
                   std::bit_cast<int32_t>(beta)};
  std::unique_lock lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) {
    auto desc = [](const std::array<int64_t, 4>& d, memory::data_type type) {
      return memory::desc({d[0], d[1]}, type, memory::dims{d[2], d[3]});
    };
    auto type_of = [](DType d) { return d == DType::F32 ? memory::data_type::f32 : memory::data_type::bf16; };
    memory::desc ad = desc(da, type_of(a.dtype())), bd = desc(db, type_of(b.dtype())), cd = desc(dc, type_of(c.dtype()));
    const dnnl::primitive_attr attr = gemm_attr(alpha, beta);
    // The bias is one value per output column, broadcast over the rows.
    memory::desc biasd = bias.defined() ? memory::desc({1, dc[1]}, type_of(bias.dtype()), memory::dims{dc[1], 1})
                                        : memory::desc();
    dnnl::matmul::primitive_desc pd =
        bias.defined() ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, biasd, cd), attr, engine)
                       : dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), attr, engine);
    if (cache.size() >= 512) cache.clear();  // sampling grows M token by token: keep it bounded
    it = cache.emplace(key, Cached{ad, bd, cd, biasd, dnnl::matmul(pd)}).first;
  }
  const Cached k = it->second;  // a copy (the primitive is a shared handle): another thread may clear the cache
  lock.unlock();
  memory am(k.ad, engine, a.raw_data()), bm(k.bd, engine, b.raw_data()), cm(k.cd, engine, c.raw_data());
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (bias.defined()) args.emplace(DNNL_ARG_BIAS, memory(k.biasd, engine, bias.raw_data()));
  k.primitive.execute(stream, args);
  stream.wait();
}

// The bf16 backward GEMMs of a linear layer y = x W^T, W stored (out, in), through oneDNN's
// inner-product primitives: the weight gradient dW = dy^T x (the "TN" case) and the input
// gradient dx = dy W ("NN"). With plain layouts oneDNN 2.6 runs them on its jit bf16 GEMM
// (gemm:jit), which on Zen 4 (AVX-512 BF16, no AMX) beats the matmul primitive's brgemm
// into an fp32 C: weight gradients 4-13% faster (the head's at 256 tokens 46.7 against 53.6 ms),
// input gradients -1% to +11% (bench/gemm_layouts.cc, section 5). Into a bf16 C it does
// not (the MLP's dx, 2.97 against 3.04 ms), nor for the forward, so those stay on brgemm.
// Where the matmul primitive runs bf16 on AMX (1000-1340 GFLOP/s on the Intel VMs, against
// ~420 for AVX-512 BF16 here) this path is off: oneDNN 2.6's AMX kernels are brgemm's.
// Only what the primitives can do: dense operands, alpha 1, beta 0 (a written gradient; an
// accumulated one takes the matmul primitive's sum post-op), no bias.
enum class InnerProductPass { BackwardData, BackwardWeights };

// The implementation oneDNN's matmul primitive chooses for a small bf16 GEMM (its name:
// "brg:avx512_core_amx", ...), or "" where this CPU has no bf16 kernel at all: oneDNN 2.6
// runs bf16 only from AVX-512 up, so an AVX2 CPU has none. Asking oneDNN rather than CPUID
// lets a newer ISA it knows count too.
const std::string& bf16_matmul_impl() {
  static const std::string impl = [] {
    using dnnl::memory;
    const memory::desc m({64, 64}, memory::data_type::bf16, memory::format_tag::ab);
    const memory::desc out({64, 64}, memory::data_type::f32, memory::format_tag::ab);
    try {
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(m, m, out), cpu_engine());
      return std::string(pd.impl_info_str());
    } catch (const dnnl::error&) {
      return std::string();
    }
  }();
  return impl;
}

// Whether the matmul primitive runs bf16 on AMX here.
bool matmul_runs_bf16_on_amx() { return bf16_matmul_impl().find("amx") != std::string::npos; }

}  // namespace

bool bf16_gemm_has_no_kernel() {
  static const bool none = bf16_matmul_impl().empty();
  return none;
}

// Whether bf16 GEMMs are widened to fp32 (widened_bf16_gemm): where oneDNN has no bf16
// kernel, or where TALLY_BF16_GEMM=widened asks for it (the tests run that path on every
// machine so).
bool bf16_gemm_widened() {
  static const bool widened = [] {
    const char* env = std::getenv("TALLY_BF16_GEMM");
    const std::string asked = env ? env : "";
    TALLY_CHECK(asked.empty() || asked == "widened" || asked == "onednn", "TALLY_BF16_GEMM='", asked,
                "': expected 'widened' (fp32 GEMMs of the widened operands) or 'onednn' (its bf16 kernels, the default)");
    return bf16_gemm_has_no_kernel() || asked == "widened";
  }();
  return widened;
}

namespace {

// A bf16 operand as the GEMM reads it: logical element (i, p) at data[i * rows + p * cols]
// (a transposed or strided view is only other strides).
struct Bf16Operand {
  const BFloat16* data;
  int64_t rows, cols;  // strides, in elements
  Bf16Operand at(int64_t i, int64_t p) const { return {data + i * rows + p * cols, rows, cols}; }
};

// C (M x N, fp32, row stride ldc) = alpha op(A) op(B) + beta C for bf16 A and B, on a CPU
// where oneDNN has no bf16 kernel. A bf16 value widens to fp32 exactly and the product of
// two is exact in fp32; oneDNN's bf16 kernels also sum those products in fp32. So this
// computes the same sum as they do (up to the order of the fp32 additions) on the fp32
// sgemm: tiles of A (mc x kc) and B (kc x nc) are widened into this thread's workspace
// (at most 3.75 MiB: a 256 x 768 and a 768 x 1024 tile; kernel-private like oneDNN's own
// scratchpad) and multiplied, C accumulating over K. A K tile of 768 (a whole GPT-2
// projection's) rather than 256 makes fewer passes of sgemm over C (W1's bf16 step on an
// AVX2 EPYC: 1.70-1.82 s against 1.83-1.86 s). Inside an OpenMP region (attention's
// tiles) it runs on the calling thread, as sgemm does there.
void widened_bf16_gemm(int64_t M, int64_t N, int64_t K, float alpha, Bf16Operand a, Bf16Operand b, float beta,
                       float* c, int64_t ldc) {
  constexpr int64_t mc = 256, nc = 1024, kc = 768;
  thread_local std::vector<float> a_tile, b_tile;
  // (Sized to this GEMM's tiles: attention's per-thread tile products need far less.)
  a_tile.resize(std::max(a_tile.size(), static_cast<size_t>(std::min(mc, M) * std::min(kc, K))));
  b_tile.resize(std::max(b_tile.size(), static_cast<size_t>(std::min(kc, K) * std::min(nc, N))));
  // Widens rows x cols of `src` into `dst` in the order `src` stores them, so the reads are
  // contiguous: row-major (row stride cols) when its rows are, else column-major (column
  // stride rows), which sgemm is told to read transposed. (A transposed weight read row by
  // row would be a strided gather, and the forward's GEMMs would run at two thirds of the
  // backward's rate.)
  // Returns whether the tile is column-major.
  auto widen = [](Bf16Operand src, int64_t rows, int64_t cols, float* dst) {
    const bool column_major = src.cols != 1 && src.rows == 1;
    const int64_t outer = column_major ? cols : rows, inner = column_major ? rows : cols;
    const int64_t outer_stride = column_major ? src.cols : src.rows, inner_stride = column_major ? src.rows : src.cols;
#pragma omp parallel for schedule(static) if (!omp_in_parallel() && rows * cols >= (1 << 16))
    for (int64_t o = 0; o < outer; ++o) {
      const BFloat16* from = src.data + o * outer_stride;
      float* to = dst + o * inner;
      if (inner_stride == 1) widen_bf16(from, to, inner);
      else
        for (int64_t e = 0; e < inner; ++e) to[e] = static_cast<float>(from[e * inner_stride]);
    }
    return column_major;
  };
  for (int64_t n0 = 0; n0 < N; n0 += nc) {
    const int64_t n = std::min(nc, N - n0);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t k = std::min(kc, K - k0);
      const bool b_transposed = widen(b.at(k0, n0), k, n, b_tile.data());
      for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m = std::min(mc, M - m0);
        const bool a_transposed = widen(a.at(m0, k0), m, k, a_tile.data());
        // The first K tile applies beta (beta 0 writes C without reading it); later ones add.
        const dnnl_status_t st =
            dnnl_sgemm(a_transposed ? 'T' : 'N', b_transposed ? 'T' : 'N', m, n, k, alpha, a_tile.data(),
                       a_transposed ? m : k, b_tile.data(), b_transposed ? k : n, k0 == 0 ? beta : 1.f,
                       c + m0 * ldc + n0, ldc);
        TALLY_CHECK(st == dnnl_success, "oneDNN sgemm failed with status ", static_cast<int>(st), " for a widened bf16 ",
                    m, "x", n, "x", k, " tile");
      }
    }
  }
}

// gemm() for bf16 operands where oneDNN has no bf16 kernel: widened_bf16_gemm into C (fp32),
// or, for a bf16 C, into an fp32 tile that is rounded once into C, as oneDNN's kernels
// round their fp32 accumulator. The bias (fp32, or bf16 for a bf16 C) is added to the fp32
// sum, as the primitive adds it.
void widened_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, float alpha, float beta,
                  const Tensor& bias) {
  const int64_t M = c.shape()[0], N = c.shape()[1], K = ta ? a.shape()[0] : a.shape()[1];
  auto operand = [](const Tensor& t, bool transpose) {
    const Bf16Operand o{t.data<BFloat16>(), t.strides()[0], t.strides()[1]};
    return transpose ? Bf16Operand{o.data, o.cols, o.rows} : o;
  };
  const Bf16Operand A = operand(a, ta), B = operand(b, tb);
  std::vector<float> bias_fp32;
  if (bias.defined()) {
    bias_fp32.resize(static_cast<size_t>(N));
    for (int64_t j = 0; j < N; ++j)
      bias_fp32[j] = bias.dtype() == DType::F32 ? bias.data<float>()[j * bias.strides()[0]]
                                                : static_cast<float>(bias.data<BFloat16>()[j * bias.strides()[0]]);
  }
  const int64_t ldc = c.strides()[0];
  if (c.dtype() == DType::F32) {
    float* C = c.data<float>();
    widened_bf16_gemm(M, N, K, alpha, A, B, beta, C, ldc);
    if (bias.defined())
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) C[i * ldc + j] += bias_fp32[j];
    return;
  }
  // A bf16 C: blocks of up to 1024 x 1024 accumulate in fp32 (this thread's workspace, at
  // most 4 MiB) and are rounded once. A block as tall as widened_bf16_gemm's row tiles allow
  // widens each B tile once per block, and keeps its sgemm calls at full height (64-row
  // blocks of the whole width would run the forward's GEMMs at half the fp32 rate).
  constexpr int64_t block_rows = 1024, block_cols = 1024;
  thread_local std::vector<float> tile;
  tile.resize(static_cast<size_t>(std::min(block_rows, M) * std::min(block_cols, N)));
  BFloat16* C = c.data<BFloat16>();
  for (int64_t n0 = 0; n0 < N; n0 += block_cols) {
    const int64_t n = std::min(block_cols, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += block_rows) {
      const int64_t m = std::min(block_rows, M - m0);
      float* acc = tile.data();
      if (beta != 0.f)
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) acc[i * n + j] = beta * static_cast<float>(C[(m0 + i) * ldc + n0 + j]);
      widened_bf16_gemm(m, n, K, alpha, A.at(m0, 0), B.at(0, n0), beta != 0.f ? 1.f : 0.f, acc, n);
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < m; ++i) {
        float* row = acc + i * n;
        if (bias.defined())
          for (int64_t j = 0; j < n; ++j) row[j] += bias_fp32[n0 + j];
        round_to_bf16(row, C + (m0 + i) * ldc + n0, n);
      }
    }
  }
}

// Whether oneDNN chose its jit GEMM ("x64:gemm:jit") for an inner product.
bool on_jit_gemm(const dnnl::primitive_desc_base& pd) {
  return std::string(pd.impl_info_str()).find("gemm:jit") != std::string::npos;
}

// Whether a 2-D view is a dense row-major matrix or the transpose of one: layout_of's row-
// or column-major with a leading dimension of exactly the width (a single row or column is
// dense whatever its other stride).
struct DenseMatrix {
  bool dense = false;
  bool transposed = false;  // the logical operand is the stored matrix's transpose
};
DenseMatrix dense_matrix(const Tensor& t, bool transpose) {
  const int64_t R = t.shape()[0], C = t.shape()[1];
  switch (layout_of(t)) {
    case Layout::RowMajor: return {R == 1 || t.strides()[0] == C, transpose};
    case Layout::ColumnMajor: return {C == 1 || t.strides()[1] == R, !transpose};
    case Layout::Strided: break;
  }
  return {};
}

struct InnerProduct {
  InnerProductPass pass = InnerProductPass::BackwardData;
  dnnl::primitive primitive;  // null where oneDNN would not run it on its GEMM
  dnnl::memory::desc a, b, c;
};

// The inner-product primitive that runs C = op(A) B, or one whose primitive is null where
// that pass does not apply (see inner_product_gemm).
InnerProduct find_inner_product(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c) {
  if (a.dtype() != DType::BF16 || c.dtype() != DType::F32 || c.strides()[0] != c.shape()[1])
    return {};
  if (matmul_runs_bf16_on_amx()) return {};
  // Whether the logical operand is a stored dense matrix's transpose (a view that is not
  // dense is copied as it is viewed, which is not transposed).
  auto stored_transposed = [](const Tensor& t, bool transpose) {
    const DenseMatrix d = dense_matrix(t, transpose);
    return d.dense ? d.transposed : transpose;
  };
  if (stored_transposed(b, tb)) return {};  // x W^T, a forward: the matmul primitive's
  const InnerProductPass pass =
      stored_transposed(a, ta) ? InnerProductPass::BackwardWeights : InnerProductPass::BackwardData;
  // C (M, N) = op(A) (M, K) B (K, N).
  const int64_t M = c.shape()[0], N = c.shape()[1], K = tb ? b.shape()[1] : b.shape()[0];
  using dnnl::memory;
  using tag = memory::format_tag;
  const dnnl::engine& engine = cpu_engine();
  using Cached = InnerProduct;
  using Key = std::array<int64_t, 4>;
  static std::mutex mutex;
  static std::map<Key, Cached> cache;
  const Key key = {static_cast<int64_t>(pass), M, N, K};
  std::unique_lock lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) {
    const auto bf16 = memory::data_type::bf16;
    const auto f32 = memory::data_type::f32;
    Cached made;
    made.pass = pass;
    // In the inner product's terms: tokens, out (OC) and in (IC) features.
    const int64_t tokens = pass == InnerProductPass::BackwardWeights ? K : M;
    const int64_t out = pass == InnerProductPass::BackwardWeights ? M : K;
    const int64_t in = N;
    const memory::desc x({tokens, in}, bf16, tag::ab), w({out, in}, bf16, tag::ab), dy({tokens, out}, bf16, tag::ab);
    try {
      const auto hint = dnnl::inner_product_forward::primitive_desc(
          dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, x, w, dy), engine);
      if (pass == InnerProductPass::BackwardWeights) {
        // dW (out, in) = dy^T x: A is dy stored (tokens, out), B is x.
        const memory::desc dw({out, in}, f32, tag::ab);
        const auto pd = dnnl::inner_product_backward_weights::primitive_desc(
            dnnl::inner_product_backward_weights::desc(x, dw, dy), engine, hint);
        if (on_jit_gemm(pd)) made = {pass, dnnl::inner_product_backward_weights(pd), dy, x, dw};
      } else {
        // dx (tokens, in) = dy W: A is dy, B is W stored (out, in).
        const memory::desc dx({tokens, in}, f32, tag::ab);
        const auto pd = dnnl::inner_product_backward_data::primitive_desc(
            dnnl::inner_product_backward_data::desc(dx, w, dy), engine, hint);
        if (on_jit_gemm(pd)) made = {pass, dnnl::inner_product_backward_data(pd), dy, w, dx};
      }
    } catch (const dnnl::error&) {
      made = Cached();  // a shape oneDNN's inner product refuses: the matmul primitive runs it
      made.pass = pass;
    }
    if (cache.size() >= 512) cache.clear();
    it = cache.emplace(key, made).first;
  }
  return it->second;
}

// Runs C = op(A) B on an inner-product primitive and returns true, or returns false where
// that pass does not apply (C not a dense fp32 matrix, B transposed, the CPU has
// AMX, oneDNN would not pick its GEMM). Any other view of A or B is copied dense first, so
// a matrix product's bits do not depend on its operands' strides.
bool inner_product_gemm(Tensor a, bool ta, Tensor b, bool tb, const Tensor& c) {
  const InnerProduct k = find_inner_product(a, ta, b, tb, c);
  if (!k.primitive) return false;
  using dnnl::memory;
  const dnnl::engine& engine = cpu_engine();
  static dnnl::stream stream(engine);
  for (Tensor* t : {&a, &b})
    if (!dense_matrix(*t, false).dense) *t = dense_copy(*t);
  memory am(k.a, engine, a.raw_data()), bm(k.b, engine, b.raw_data()), cm(k.c, engine, c.raw_data());
  if (k.pass == InnerProductPass::BackwardWeights)
    k.primitive.execute(stream, {{DNNL_ARG_DIFF_DST, am}, {DNNL_ARG_SRC, bm}, {DNNL_ARG_DIFF_WEIGHTS, cm}});
  else
    k.primitive.execute(stream, {{DNNL_ARG_DIFF_DST, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DIFF_SRC, cm}});
  stream.wait();
  return true;
}

}  // namespace

// Which engine runs a GEMM. bf16 operands: oneDNN's matmul primitive (oneDNN 2.6 has no
// BLAS-like bf16 GEMM), unless inner_product_gemm takes it. fp32 x @ W^T (a linear layer's
// forward, W stored (out, in)) also takes the primitive: oneDNN's sgemm runs this NT case
// 10-35% below its NN and TN cases on these shapes (measured on Zen 4 at M = 256 and 1024:
// the MLP's down projection, K = 3072, at 130-167 GFLOP/s against 200-212 for the same
// shape through the primitive), while the primitive is slower than sgemm for the
// backward's NN and TN. Small M (decoding) stays on sgemm: a primitive per shape costs
// more than such a GEMM.
namespace {
bool gemm_on_matmul_primitive(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c) {
  if (a.dtype() == DType::BF16) return true;
  if (a.dtype() != DType::F32 || c.dtype() != DType::F32 || c.shape()[0] < kPrimitiveMinRows) return false;
  const Layout la = layout_of(a), lb = layout_of(b);
  if (la == Layout::Strided || lb == Layout::Strided) return false;
  const bool blas_ta = transpose_a != (la == Layout::ColumnMajor), blas_tb = transpose_b != (lb == Layout::ColumnMajor);
  return !blas_ta && blas_tb;
}
}  // namespace

bool gemm_adds_bias(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c,
                    const Tensor& bias) {
  // bf16 operands take an fp32 bias whatever the output (added to the fp32 accumulator,
  // before a bf16 output's one rounding).
  const bool dtype_ok = bias.dtype() == c.dtype() || (a.dtype() == DType::BF16 && bias.dtype() == DType::F32);
  return dtype_ok && bias.is_contiguous() && gemm_on_matmul_primitive(a, transpose_a, b, transpose_b, c);
}

void gemm(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c, float alpha,
          float beta, const Tensor& bias) {
  TALLY_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2, "gemm: expected 2-D operands, got ", a.str(), ", ",
              b.str(), ", ", c.str());
  const int64_t M = transpose_a ? a.shape()[1] : a.shape()[0];
  const int64_t K = transpose_a ? a.shape()[0] : a.shape()[1];
  const int64_t Kb = transpose_b ? b.shape()[1] : b.shape()[0];
  const int64_t N = transpose_b ? b.shape()[0] : b.shape()[1];
  TALLY_CHECK(K == Kb, "matmul: inner dimensions differ: ", a.str(), (transpose_a ? "^T" : ""), " @ ", b.str(),
              (transpose_b ? "^T" : ""));
  TALLY_CHECK(c.shape()[0] == M && c.shape()[1] == N, "gemm: output ", c.str(), " is not ", M, "x", N);
  TALLY_CHECK(c.strides()[1] == 1 || N == 1, "gemm: output rows must be contiguous");
  // Mixed precision: bf16 operands may write (or accumulate into) an fp32 output.
  const bool bf16_operands = a.dtype() == DType::BF16 && b.dtype() == DType::BF16;
  TALLY_CHECK(a.dtype() == b.dtype() && (a.dtype() == c.dtype() || (bf16_operands && c.dtype() == DType::F32)),
              "matmul: dtypes differ: ", a.str(), " @ ", b.str(), " -> ", c.str());
  // The bias is oneDNN's, added before alpha would apply: alpha 1, nothing accumulated.
  TALLY_CHECK(!bias.defined() || (bias.dim() == 1 && bias.shape()[0] == N && alpha == 1.f && beta == 0.f &&
                                  gemm_adds_bias(a, transpose_a, b, transpose_b, c, bias)),
              "gemm: the bias ", bias.str(), " must be a contiguous vector of the output's ", N, " columns in its dtype (",
              dtype_name(c.dtype()), ", or fp32 for bf16 operands), with alpha 1 and nothing accumulated, on a GEMM",
              " the matmul primitive runs",
              " (elsewhere Backend::gemm_bias writes it first)");
  if (M == 0 || N == 0) return;
  if (K == 0) {  // an empty sum: C = beta C (+ bias)
    if (bias.defined()) copy(c, bias);
    else if (beta == 0.f) fill(c, 0.0);
    else if (beta != 1.f) affine(c, c, beta, 0.0);
    c.storage().bump_version();
    return;
  }
  if (bf16_operands && bf16_gemm_widened()) {
    widened_gemm(a, transpose_a, b, transpose_b, c, alpha, beta, bias);
    c.storage().bump_version();
    return;
  }
  if (gemm_on_matmul_primitive(a, transpose_a, b, transpose_b, c)) {
    // The primitive reads row- or column-major operands with any leading dimension; another
    // view (a strided slice, a broadcast, overlapping rows: only bf16 gets here with one)
    // is copied dense first, as the sgemm path does.
    auto dense = [](const Tensor& t) { return layout_of(t) == Layout::Strided ? describe(t, false).storage_view : t; };
    if (!(alpha == 1.f && beta == 0.f && !bias.defined() && inner_product_gemm(a, transpose_a, b, transpose_b, c)))
      primitive_gemm(dense(a), transpose_a, dense(b), transpose_b, c, alpha, beta, bias);
    c.storage().bump_version();
    return;
  }
  Operand oa = describe(a, transpose_a);
  Operand ob = describe(b, transpose_b);
  const int64_t ldc = std::max<int64_t>(c.strides()[0], N);
  switch (c.dtype()) {
    case DType::F32: {
      dnnl_status_t st = dnnl_sgemm(oa.trans ? 'T' : 'N', ob.trans ? 'T' : 'N', M, N, K, alpha,
                                    oa.storage_view.data<float>(), oa.ld, ob.storage_view.data<float>(), ob.ld, beta,
                                    c.data<float>(), ldc);
      TALLY_CHECK(st == dnnl_success, "oneDNN sgemm failed with status ", static_cast<int>(st), " for ", M, "x", N,
                  "x", K);
      break;
    }
    case DType::F64:
      naive_gemm<double>(M, N, K, alpha, oa.storage_view.data<double>(), oa.ld, oa.trans,
                         ob.storage_view.data<double>(), ob.ld, ob.trans, beta, c.data<double>(), ldc);
      break;
    default: TALLY_FAIL("matmul: dtype ", dtype_name(c.dtype()), " is not supported on CPU (float32, bfloat16, float64)");
  }
  c.storage().bump_version();
}

std::vector<Tensor> gemm_dense_copies(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                                      const Tensor& c, float alpha, float beta, const Tensor& bias) {
  const int64_t M = c.shape()[0], N = c.shape()[1], K = transpose_a ? a.shape()[0] : a.shape()[1];
  if (M == 0 || N == 0 || K == 0) return {};
  const bool bf16_operands = a.dtype() == DType::BF16 && b.dtype() == DType::BF16;
  if (bf16_operands && bf16_gemm_widened()) return {};
  std::vector<Tensor> copies;
  const bool inner_product = gemm_on_matmul_primitive(a, transpose_a, b, transpose_b, c) && alpha == 1.f &&
                             beta == 0.f && !bias.defined() &&
                             find_inner_product(a, transpose_a, b, transpose_b, c).primitive;
  for (const Tensor* t : {&a, &b})
    if (inner_product ? !dense_matrix(*t, false).dense : layout_of(*t) == Layout::Strided) copies.push_back(*t);
  return copies;
}

// A bf16 tile GEMM for kernels that run their own OpenMP threads (attention), on the
// matmul primitive (tiles are strided views, which the inner product does not take). Each
// primitive is made for one thread (oneDNN sizes its blocking and scratchpad by the thread
// count it sees when the primitive is made), so inside a parallel region it runs on the
// calling thread; outside one it runs on one thread too. Each thread keeps its own
// primitives, stream and one scratchpad (user-managed, so no two threads share oneDNN's),
// keyed by the tile's shape, layout, alpha and beta: an attention call uses at most a few
// dozen.
void tile_gemm_bf16(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (bf16_gemm_widened()) {
    // Row-major tiles; a transposed one is read with its strides swapped.
    auto operand = [](const BFloat16* t, int64_t ld, bool transposed) {
      return transposed ? Bf16Operand{t, 1, ld} : Bf16Operand{t, ld, 1};
    };
    return widened_bf16_gemm(m, n, k, alpha, operand(a, lda, transpose_a), operand(b, ldb, transpose_b), beta, c, ldc);
  }
  using dnnl::memory;
  const dnnl::engine& engine = cpu_engine();
  // A tile's primitive with its arguments, made once: each call only points the memory
  // objects at its operands (creating them and the argument map per call would be ~4% of
  // a bf16 attention's time, in malloc and free).
  struct Tile {
    dnnl::matmul primitive;
    size_t scratchpad_bytes;
    std::unordered_map<int, memory> args;  // SRC, WEIGHTS, DST (and SCRATCHPAD), handles unset
  };
  // The key: shape, layout, leading dimensions, and alpha's and beta's bits.
  using Key = std::array<int64_t, 10>;
  struct ThreadState {
    dnnl::stream stream{cpu_engine()};
    std::map<Key, Tile> tiles;
    std::vector<char> scratchpad;  // the largest any of this thread's tiles needs
  };
  static thread_local ThreadState state;
  const Key key = {m, n, k, transpose_a, transpose_b, lda, ldb, ldc, std::bit_cast<int32_t>(alpha),
                   std::bit_cast<int32_t>(beta)};
  auto it = state.tiles.find(key);
  if (it == state.tiles.end()) {
    // Row-major operands; a transposed one is described by swapping its strides.
    auto desc = [](int64_t rows, int64_t cols, bool transposed, int64_t ld, memory::data_type type) {
      return memory::desc({rows, cols}, type, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
    };
    memory::desc ad = desc(m, k, transpose_a, lda, memory::data_type::bf16);
    memory::desc bd = desc(k, n, transpose_b, ldb, memory::data_type::bf16);
    memory::desc cd = desc(m, n, false, ldc, memory::data_type::f32);
    dnnl::primitive_attr attr = gemm_attr(alpha, beta);
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    // One thread's primitive: this thread's OpenMP thread count (inside a region, only its
    // own) is 1 while oneDNN plans it, and restored however the planning ends.
    struct OneThread {
      int saved = omp_get_max_threads();
      OneThread() { omp_set_num_threads(1); }
      ~OneThread() { omp_set_num_threads(saved); }
    };
    const dnnl::matmul::primitive_desc pd = [&] {
      OneThread one;
      return dnnl::matmul::primitive_desc(dnnl::matmul::desc(ad, bd, cd), attr, engine);
    }();
    if (state.tiles.size() >= 256) state.tiles.clear();  // decoding's growing shapes: keep it bounded
    Tile tile{dnnl::matmul(pd), pd.scratchpad_desc().get_size(),
              {{DNNL_ARG_SRC, memory(ad, engine, DNNL_MEMORY_NONE)},
               {DNNL_ARG_WEIGHTS, memory(bd, engine, DNNL_MEMORY_NONE)},
               {DNNL_ARG_DST, memory(cd, engine, DNNL_MEMORY_NONE)}}};
    if (tile.scratchpad_bytes > 0)
      tile.args.emplace(DNNL_ARG_SCRATCHPAD, memory(pd.scratchpad_desc(), engine, DNNL_MEMORY_NONE));
    it = state.tiles.emplace(key, std::move(tile)).first;
    state.scratchpad.resize(std::max(state.scratchpad.size(), it->second.scratchpad_bytes));
  }
  // Each call points the tile's memory objects at its operands; the scratchpad too, since a
  // later tile may have grown (moved) it.
  const Tile& t = it->second;
  t.args.at(DNNL_ARG_SRC).set_data_handle(const_cast<BFloat16*>(a));
  t.args.at(DNNL_ARG_WEIGHTS).set_data_handle(const_cast<BFloat16*>(b));
  t.args.at(DNNL_ARG_DST).set_data_handle(c);
  if (t.scratchpad_bytes > 0) t.args.at(DNNL_ARG_SCRATCHPAD).set_data_handle(state.scratchpad.data());
  t.primitive.execute(state.stream, t.args);
  state.stream.wait();
}

namespace {
double measure_gemm_peak(DType dtype) {
  // A square GEMM large enough to reach steady state; the best of 20 repetitions (about
  // 0.2 s): on a shared machine a neighbour's burst can slow a handful of them, and with 5
  // the probe can read a third below the rate the training GEMMs then run at. bf16: bf16
  // operands into an fp32 result, as mixed precision runs its GEMMs.
  const int64_t n = 1024;
  CategoryScope scope(Category::Workspace);
  OwnerScope owner("gemm_peak_probe");  // a few MiB, freed before training starts
  Tensor a = Tensor::full({n, n}, 0.5).to(dtype), b = Tensor::full({n, n}, 0.25).to(dtype), c = Tensor::zeros({n, n});
  gemm(a, false, b, false, c);  // warm-up (JIT)
  double best = 1e30;
  for (int rep = 0; rep < 20; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    gemm(a, false, b, false, c);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, s);
  }
  return 2.0 * n * n * n / best;
}
}  // namespace

double measured_gemm_peak_flops(DType dtype, bool probe_again) {
  TALLY_CHECK(dtype == DType::F32 || dtype == DType::BF16, "GEMM peak: no measurement for ", dtype_name(dtype));
  static double f32 = 0, bf16 = 0;
  double& peak = dtype == DType::F32 ? f32 : bf16;
  if (peak == 0 || probe_again) peak = std::max(peak, measure_gemm_peak(dtype));
  return peak;
}

}  // namespace tally::runtime::cpu
