// Elementwise, reduction and indexing kernels on strided CPU tensors.
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"

namespace tally::runtime::cpu {

Tensor dense(const Tensor& t) {
  if (!t.defined() || t.is_contiguous()) return t;
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device(), current_owner("contiguous"));
  copy(c, t);
  return c;
}

Shape broadcast_strides(const Tensor& t, const Shape& shape) {
  Shape out(shape.size(), 0);
  int64_t offset = static_cast<int64_t>(shape.size()) - t.dim();
  TALLY_CHECK(offset >= 0, "cannot broadcast ", t.str(), " to ", shape_str(shape));
  for (int64_t d = 0; d < t.dim(); ++d) {
    int64_t sz = t.shape()[d];
    TALLY_CHECK(sz == shape[d + offset] || sz == 1, "cannot broadcast ", t.str(), " to ", shape_str(shape));
    out[d + offset] = sz == 1 ? 0 : t.strides()[d];
  }
  return out;
}


namespace {
// Contiguous fp32 <-> bf16: the casts of mixed precision (activations into a GEMM, the
// parameter block's bf16 copy once per step) are memory-bound passes; use every thread.
bool convert_contiguous(const Tensor& dst, const Tensor& src) {
  if (!dst.is_contiguous() || !src.is_contiguous() || dst.shape() != src.shape()) return false;
  const int64_t n = dst.numel();
  if (dst.dtype() == DType::BF16 && src.dtype() == DType::F32) {
    BFloat16* d = dst.data<BFloat16>();
    const float* s = src.data<float>();
    constexpr int64_t kBlock = 4096;  // a thread's piece: whole 16-value vectors
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t start = 0; start < n; start += kBlock)
      round_to_bf16(s + start, d + start, std::min(kBlock, n - start));
    return true;
  }
  if (dst.dtype() == DType::F32 && src.dtype() == DType::BF16) {
    float* d = dst.data<float>();
    const BFloat16* s = src.data<BFloat16>();
#pragma omp parallel for simd schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t u = static_cast<uint32_t>(s[i].bits) << 16;
      std::memcpy(d + i, &u, 4);
    }
    return true;
  }
  return false;
}
}  // namespace

void copy(const Tensor& dst, const Tensor& src) {
  TALLY_CHECK(dst.device().is_cpu() && src.device().is_cpu(), "copy: CPU kernel got ", dst.device().str(), " and ",
              src.device().str());
  if (dst.dtype() != src.dtype() && convert_contiguous(dst, src)) return;
  std::array<Shape, 2> strides{dst.strides(), broadcast_strides(src, dst.shape())};
  dispatch_all(dst.dtype(), [&](auto dtag) {
    using D = decltype(dtag);
    D* d = dst.data<D>();
    dispatch_all(src.dtype(), [&](auto stag) {
      using S = decltype(stag);
      const S* s = src.data<S>();
      for_each_row<2>(dst.shape(), strides, [&](auto off, int64_t n, auto inc) {
        D* dp = d + off[0];
        const S* sp = s + off[1];
        if (inc[0] == 1 && inc[1] == 1) {
          for (int64_t i = 0; i < n; ++i) dp[i] = convert<D>(sp[i]);
        } else {
          for (int64_t i = 0; i < n; ++i) dp[i * inc[0]] = convert<D>(sp[i * inc[1]]);
        }
      });
    });
  });
}

void fill(const Tensor& dst, double value) {
  TALLY_CHECK(dst.device().is_cpu(), "fill: CPU kernel got ", dst.str(), " on ", dst.device().str());
  std::array<Shape, 1> strides{dst.strides()};
  dispatch_all(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* d = dst.data<T>();
    T v = convert<T>(value);
    for_each_row<1>(dst.shape(), strides, [&](auto off, int64_t n, auto inc) {
      T* p = d + off[0];
      for (int64_t i = 0; i < n; ++i) p[i * inc[0]] = v;
    });
  });
}

namespace {
template <class T, class F>
void binary_loop(const Tensor& out, const Tensor& a, const Tensor& b, F f) {
  std::array<Shape, 3> strides{out.strides(), broadcast_strides(a, out.shape()), broadcast_strides(b, out.shape())};
  T* o = out.data<T>();
  const T* pa = a.data<T>();
  const T* pb = b.data<T>();
  for_each_row<3>(out.shape(), strides, [&](auto off, int64_t n, auto inc) {
    T* op = o + off[0];
    const T* ap = pa + off[1];
    const T* bp = pb + off[2];
    // Specialized unit/zero-stride rows vectorize; the general row does not need to.
    if (inc[0] == 1 && inc[1] == 1 && inc[2] == 1) {
      for (int64_t i = 0; i < n; ++i) op[i] = f(ap[i], bp[i]);
    } else if (inc[0] == 1 && inc[1] == 1 && inc[2] == 0) {
      const T bv = *bp;
      for (int64_t i = 0; i < n; ++i) op[i] = f(ap[i], bv);
    } else if (inc[0] == 1 && inc[1] == 0 && inc[2] == 1) {
      const T av = *ap;
      for (int64_t i = 0; i < n; ++i) op[i] = f(av, bp[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) op[i * inc[0]] = f(ap[i * inc[1]], bp[i * inc[2]]);
    }
  });
}
}  // namespace

void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  TALLY_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), "elementwise op on ", a.str(), " and ", b.str(),
              ": dtypes differ");
  if (out.dtype() == DType::BF16) {
    // In fp32, rounded once: mixed precision's bf16 tensors (the logits) and the engine's
    // sums of their gradients.
    auto in_fp32 = [&](auto f) {
      binary_loop<BFloat16>(out, a, b, [f](BFloat16 x, BFloat16 y) {
        return BFloat16(f(static_cast<float>(x), static_cast<float>(y)));
      });
    };
    switch (op) {
      case BinaryOp::Add: in_fp32([](float x, float y) { return x + y; }); break;
      case BinaryOp::Sub: in_fp32([](float x, float y) { return x - y; }); break;
      case BinaryOp::Mul: in_fp32([](float x, float y) { return x * y; }); break;
      case BinaryOp::Div: in_fp32([](float x, float y) { return x / y; }); break;
    }
    return;
  }
  dispatch_floating(out.dtype(), "elementwise", [&](auto tag) {
    using T = decltype(tag);
    switch (op) {
      case BinaryOp::Add: binary_loop<T>(out, a, b, [](T x, T y) { return x + y; }); break;
      case BinaryOp::Sub: binary_loop<T>(out, a, b, [](T x, T y) { return x - y; }); break;
      case BinaryOp::Mul: binary_loop<T>(out, a, b, [](T x, T y) { return x * y; }); break;
      case BinaryOp::Div: binary_loop<T>(out, a, b, [](T x, T y) { return x / y; }); break;
    }
  });
}

void affine(const Tensor& out, const Tensor& x, double alpha, double beta) {
  std::array<Shape, 2> strides{out.strides(), broadcast_strides(x, out.shape())};
  dispatch_floating(out.dtype(), "affine", [&](auto tag) {
    using T = decltype(tag);
    T* o = out.data<T>();
    const T* px = x.data<T>();
    const T a = static_cast<T>(alpha), b = static_cast<T>(beta);
    for_each_row<2>(out.shape(), strides, [&](auto off, int64_t n, auto inc) {
      T* op = o + off[0];
      const T* xp = px + off[1];
      if (inc[0] == 1 && inc[1] == 1) {
        for (int64_t i = 0; i < n; ++i) op[i] = a * xp[i] + b;
      } else {
        for (int64_t i = 0; i < n; ++i) op[i * inc[0]] = a * xp[i * inc[1]] + b;
      }
    });
  });
}

void add_inplace(const Tensor& dst, const Tensor& src, double alpha) {
  TALLY_CHECK(dst.dtype() == src.dtype(), "add_: dtypes differ: ", dst.str(), " += ", src.str());
  std::array<Shape, 2> strides{dst.strides(), broadcast_strides(src, dst.shape())};
  dispatch_floating(dst.dtype(), "add_", [&](auto tag) {
    using T = decltype(tag);
    T* d = dst.data<T>();
    const T* s = src.data<T>();
    const T a = static_cast<T>(alpha);
    for_each_row<2>(dst.shape(), strides, [&](auto off, int64_t n, auto inc) {
      T* dp = d + off[0];
      const T* sp = s + off[1];
      if (inc[0] == 1 && inc[1] == 1) {
        for (int64_t i = 0; i < n; ++i) dp[i] += a * sp[i];
      } else {
        for (int64_t i = 0; i < n; ++i) dp[i * inc[0]] += a * sp[i * inc[1]];
      }
    });
  });
  dst.storage().bump_version();
}

namespace {
// A reduction of x to out's shape as (outer, reduced, inner): the dims out keeps before
// one run of reduced dims, that run, and the kept dims after it (dims of size 1 go with
// either). False when the reduced dims are not one run.
struct ReductionBlocks {
  int64_t outer = 1, reduced = 1, inner = 1;
};
bool one_reduced_run(const Shape& x, const Shape& out, ReductionBlocks& b) {
  int run = 0;  // 0: before the run, 1: in it, 2: after it
  for (size_t d = 0; d < x.size(); ++d) {
    if (x[d] == 1) continue;
    const bool reduced = out[d] == 1;
    if (reduced && run == 2) return false;
    if (reduced) run = 1;
    else if (run == 1) run = 2;
    (reduced ? b.reduced : run == 0 ? b.outer : b.inner) *= x[d];
  }
  if (run == 0) std::swap(b.outer, b.inner);  // nothing reduced: one row of all of it
  return true;
}
}  // namespace

void sum_into(const Tensor& out, const Tensor& x) {
  TALLY_CHECK(out.dim() == x.dim(), "sum_into: rank mismatch ", out.str(), " vs ", x.str());
  for (int64_t d = 0; d < x.dim(); ++d)
    TALLY_CHECK(out.shape()[d] == x.shape()[d] || out.shape()[d] == 1, "sum_into: ", out.str(), " is not ", x.str(),
                " with some dimensions reduced to 1");
  TALLY_CHECK(out.is_contiguous(), "sum_into: output must be contiguous");
  // bf16 input (a bias's gradient under mixed precision) sums into fp32.
  dispatch_mixed(x, out, "sum", [&](auto in_tag, auto tag) {
    using In = decltype(in_tag);
    using T = decltype(tag);
    // Accumulate in double for fp32 sums over long axes, then store.
    const int64_t n_out = out.numel();
    const int64_t n_in = x.numel();
    T* o = out.data<T>();
    const In* px = x.data<In>();
    // Output strides as seen from x's index space: 0 on reduced dims.
    Shape ostr(x.dim());
    Shape ocontig = contiguous_strides(out.shape());
    for (int64_t d = 0; d < x.dim(); ++d) ostr[d] = out.shape()[d] == 1 ? 0 : ocontig[d];
    std::vector<double> acc(static_cast<size_t>(n_out), 0.0);
    ReductionBlocks blocks;
    const bool run = x.is_contiguous() && n_in > 0 && one_reduced_run(x.shape(), out.shape(), blocks);
    const int64_t inner = blocks.inner;
    if (run && blocks.outer == 1) {
      // Reducing leading dims (bias gradients: (N, C) -> (C)).
      // Whole rows at a time (contiguous, vectorized loads; a column at a time would stride
      // through memory, 30x slower on a (1024, 3072) bias gradient). The rows go in fixed
      // blocks, each summed by one thread into its own partial, and the partials are added
      // in block order: every thread streams contiguous memory whatever the width (blocks
      // of columns would leave a thread idle on 768-wide rows), and the result does not
      // depend on the number of threads.
      const int64_t rows = n_in / inner;
      constexpr int64_t kRows = 64;
      const int64_t blocks = (rows + kRows - 1) / kRows;
      const bool parallel = n_in > (1 << 15);
      std::vector<double> partial(static_cast<size_t>(blocks * inner));
#pragma omp parallel if (parallel)
      {
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < blocks; ++blk) {
          double* a = partial.data() + blk * inner;
          const int64_t end = std::min(rows, (blk + 1) * kRows);
          int64_t r = blk * kRows;
          // Four rows per pass over the partial: a quarter of its loads and stores.
          for (; r + 4 <= end; r += 4) {
            const In* r0 = px + r * inner;
            const In *r1 = r0 + inner, *r2 = r1 + inner, *r3 = r2 + inner;
#pragma omp simd
            for (int64_t j = 0; j < inner; ++j)
              a[j] += (convert<double>(r0[j]) + convert<double>(r1[j])) +
                      (convert<double>(r2[j]) + convert<double>(r3[j]));
          }
          for (; r < end; ++r) {
            const In* row = px + r * inner;
#pragma omp simd
            for (int64_t j = 0; j < inner; ++j) a[j] += convert<double>(row[j]);
          }
        }
#pragma omp for schedule(static)
        for (int64_t j = 0; j < inner; ++j) {
          double sum = 0;
          for (int64_t blk = 0; blk < blocks; ++blk) sum += partial[static_cast<size_t>(blk * inner + j)];
          acc[static_cast<size_t>(j)] = sum;
        }
      }
    } else if (run) {
      // Reducing middle or trailing dims ((N, k, C) -> (N, 1, C), (R, C) -> (R, 1)): each
      // output row of `inner` is its own sum, in order, so rows go to threads freely.
      const int64_t outer = blocks.outer, reduced = blocks.reduced;
#pragma omp parallel for schedule(static) if (n_in > (1 << 15))
      for (int64_t o = 0; o < outer; ++o) {
        const In* block = px + o * reduced * inner;
        double* a = acc.data() + o * inner;
        if (inner == 1) {
          double sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int64_t r = 0; r < reduced; ++r) sum += convert<double>(block[r]);
          a[0] = sum;
          continue;
        }
        for (int64_t r = 0; r < reduced; ++r) {
          const In* row = block + r * inner;
#pragma omp simd
          for (int64_t j = 0; j < inner; ++j) a[j] += convert<double>(row[j]);
        }
      }
    } else {
      // General path (serial: different rows may hit the same output element).
      const Shape& shape = x.shape();
      std::vector<int64_t> idx(shape.size(), 0);
      for (int64_t lin = 0; lin < n_in; ++lin) {
        int64_t xo = 0, oo = 0;
        for (size_t d = 0; d < shape.size(); ++d) {
          xo += idx[d] * x.strides()[d];
          oo += idx[d] * ostr[d];
        }
        acc[oo] += convert<double>(px[xo]);
        for (size_t d = shape.size(); d-- > 0;) {
          if (++idx[d] < shape[d]) break;
          idx[d] = 0;
        }
      }
    }
    for (int64_t i = 0; i < n_out; ++i) o[i] = static_cast<T>(acc[i]);
  });
}

void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  Tensor xc = dense(x);
  int64_t outer = 1, inner = 1, n = xc.shape()[dim];
  for (int64_t d = 0; d < dim; ++d) outer *= xc.shape()[d];
  for (int64_t d = dim + 1; d < xc.dim(); ++d) inner *= xc.shape()[d];
  dispatch_floating(x.dtype(), "max", [&](auto tag) {
    using T = decltype(tag);
    const T* px = xc.data<T>();
    T* pv = values.data<T>();
    int64_t* pi = indices.data<int64_t>();
#pragma omp parallel for collapse(2) if (outer * inner > 4096)
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t i = 0; i < inner; ++i) {
        const T* row = px + o * n * inner + i;
        // The first maximum; a NaN is the maximum of a row holding one (its first, as in
        // PyTorch): once best is NaN nothing compares greater, and nothing is sought.
        T best = row[0];
        int64_t arg = 0;
        for (int64_t j = 1; j < n && best == best; ++j) {
          const T v = row[j * inner];
          if (v > best || v != v) best = v, arg = j;
        }
        pv[o * inner + i] = best;
        pi[o * inner + i] = arg;
      }
  });
}

void argmax_last(const Tensor& out, const Tensor& x) {
  Tensor values = Tensor::empty(out.shape(), x.dtype(), x.device(), current_owner("argmax"));
  max_dim(values, out, x, x.dim() - 1);
}

double sum_squares(const Tensor& x) {
  Tensor xc = dense(x);
  double total = 0;
  dispatch_floating(x.dtype(), "norm", [&](auto tag) {
    using T = decltype(tag);
    const T* p = xc.data<T>();
    const int64_t n = xc.numel();
    // Blocks of 4096 are summed in T (short enough that fp32 rounding stays ~1e-7
    // relative); block sums accumulate in double. Within a block, kLanes partial sums (four
    // 512-bit vectors of fp32): one chain of dependent adds would wait on each add's
    // latency, which a gradient still in cache after backward wrote it makes the limit
    // (on a 9 MB gradient in a Zen 4's L3, 181 GB/s against one chain's 121; from DRAM
    // both read at its ~31).
    constexpr int64_t kBlock = 4096, kLanes = 64;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for reduction(+ : total) schedule(static) if (n > (1 << 16))
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kBlock, end = std::min(n, begin + kBlock);
      T lanes[kLanes] = {};
      int64_t i = begin;
      for (; i + kLanes <= end; i += kLanes)
#pragma omp simd
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += p[i + l] * p[i + l];
      T s = 0;
      for (; i < end; ++i) s += p[i] * p[i];
      for (int64_t l = 0; l < kLanes; ++l) s += lanes[l];
      total += static_cast<double>(s);
    }
  });
  return total;
}

namespace {
int64_t index_at(const Tensor& index, int64_t lin) {
  return index.dtype() == DType::I64 ? index.data<int64_t>()[lin] : index.data<int32_t>()[lin];
}
}  // namespace

void gather(const Tensor& out, const Tensor& x, int64_t dim, const Tensor& index) {
  Tensor xc = dense(x);
  Tensor ic = dense(index);
  Shape xs = contiguous_strides(xc.shape());
  Shape is = contiguous_strides(ic.shape());
  const int64_t n = ic.numel();
  dispatch_floating(x.dtype(), "gather", [&](auto tag) {
    using T = decltype(tag);
    const T* px = xc.data<T>();
    T* po = out.data<T>();
    for (int64_t lin = 0; lin < n; ++lin) {
      int64_t rem = lin, xo = 0;
      for (int64_t d = 0; d < ic.dim(); ++d) {
        int64_t i = rem / is[d];
        rem %= is[d];
        if (d == dim) {
          int64_t j = index_at(ic, lin);
          TALLY_CHECK(j >= 0 && j < xc.shape()[d], "gather: index ", j, " out of range for dimension ", d, " of size ",
                      xc.shape()[d]);
          xo += j * xs[d];
        } else {
          xo += i * xs[d];
        }
      }
      po[lin] = px[xo];
    }
  });
}

void scatter_add(const Tensor& dx, int64_t dim, const Tensor& index, const Tensor& src) {
  Tensor ic = dense(index);
  Tensor sc = dense(src);
  Shape xs = contiguous_strides(dx.shape());
  Shape is = contiguous_strides(ic.shape());
  const int64_t n = ic.numel();
  dispatch_floating(dx.dtype(), "scatter_add", [&](auto tag) {
    using T = decltype(tag);
    T* pd = dx.data<T>();
    const T* ps = sc.data<T>();
    for (int64_t lin = 0; lin < n; ++lin) {
      int64_t rem = lin, xo = 0;
      for (int64_t d = 0; d < ic.dim(); ++d) {
        int64_t i = rem / is[d];
        rem %= is[d];
        xo += (d == dim ? index_at(ic, lin) : i) * xs[d];
      }
      pd[xo] += ps[lin];
    }
  });
}

}  // namespace tally::runtime::cpu
