// Neural-network kernels on contiguous CPU tensors: embedding, layernorm, RMSNorm, GELU,
// SwiGLU, rotary embeddings, softmax.
// Rows are independent and split across OpenMP threads; inner loops run over the
// contiguous channel dimension so they vectorize.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"

namespace tally::runtime::cpu {

namespace {
int64_t index_value(const Tensor& idx, int64_t i) {
  switch (idx.dtype()) {
    case DType::I32: return idx.data<int32_t>()[i];
    case DType::I64: return idx.data<int64_t>()[i];
    case DType::U16: return idx.data<uint16_t>()[i];
    default: TALLY_FAIL("indices must be an integer tensor, got ", idx.str());
  }
}

// out[c] = the sum over threads t < used of partial[t * C + c]: a weight gradient's
// per-thread partial sums, added in thread order (deterministic for a fixed thread count).
// Does nothing when out is undefined (that gradient is not wanted).
template <class T>
void sum_partials(const Tensor& out, const std::vector<T>& partial, int used, int64_t C) {
  if (!out.defined()) return;
  T* po = out.data<T>();
  for (int64_t c = 0; c < C; ++c) {
    T s = 0;
    for (int t = 0; t < used; ++t) s += partial[static_cast<size_t>(t * C + c)];
    po[c] = s;
  }
}
}  // namespace

// out[n, :] = weight[indices[n], :]
void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices) {
  const int64_t N = indices.numel(), V = weight.shape()[0], C = weight.shape()[1];
  for (int64_t n = 0; n < N; ++n) {
    int64_t ix = index_value(indices, n);
    TALLY_CHECK(ix >= 0 && ix < V, "embedding: index ", ix, " at position ", n, " is out of range for ", weight.str());
  }
  dispatch_floating(weight.dtype(), "embedding", [&](auto tag) {
    using T = decltype(tag);
    const T* w = weight.data<T>();
    T* o = out.data<T>();
#pragma omp parallel for schedule(static) if (N * C > (1 << 15))
    for (int64_t n = 0; n < N; ++n) {
      const T* src = w + index_value(indices, n) * C;
      T* dst = o + n * C;
      for (int64_t c = 0; c < C; ++c) dst[c] = src[c];
    }
  });
}

// dweight[indices[n], :] += dout[n, :]. Threads own disjoint column ranges, so rows
// that repeat an index never race.
void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices) {
  const int64_t N = indices.numel(), C = dweight.shape()[1];
  dispatch_floating(dweight.dtype(), "embedding backward", [&](auto tag) {
    using T = decltype(tag);
    T* dw = dweight.data<T>();
    const T* g = dout.data<T>();
#pragma omp parallel if (N * C > (1 << 15))
    {
      const int nt = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t c0 = C * t / nt, c1 = C * (t + 1) / nt;
      for (int64_t n = 0; n < N; ++n) {
        T* dst = dw + index_value(indices, n) * C;
        const T* src = g + n * C;
        for (int64_t c = c0; c < c1; ++c) dst[c] += src[c];
      }
    }
  });
  dweight.storage().bump_version();
}

// Per row of C: mean, rstd = 1/sqrt(var + eps) (biased variance), out = (x-mean)*rstd*w + b.
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b, double eps) {
  const int64_t C = x.shape().back(), N = x.numel() / C;
  dispatch_floating(x.dtype(), "layernorm", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* pb = b.defined() ? b.data<T>() : nullptr;
    T* po = out.data<T>();
    T* pm = mean.data<T>();
    T* pr = rstd.data<T>();
#pragma omp parallel for schedule(static) if (N * C > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const T* row = px + n * C;
      // The sums are simd reductions: without them GCC keeps each a scalar chain of
      // dependent adds (it may not reassociate floating point on its own).
      T m = 0;
#pragma omp simd reduction(+ : m)
      for (int64_t c = 0; c < C; ++c) m += row[c];
      m /= static_cast<T>(C);
      T v = 0;
#pragma omp simd reduction(+ : v)
      for (int64_t c = 0; c < C; ++c) v += (row[c] - m) * (row[c] - m);
      v /= static_cast<T>(C);
      T r = T(1) / std::sqrt(v + static_cast<T>(eps));
      T* o = po + n * C;
      if (pb) {
        for (int64_t c = 0; c < C; ++c) o[c] = (row[c] - m) * r * pw[c] + pb[c];
      } else {
        for (int64_t c = 0; c < C; ++c) o[c] = (row[c] - m) * r * pw[c];
      }
      pm[n] = m;
      pr[n] = r;
    }
  });
}

// xhat = (x-mean)*rstd, g = dout*w:
//   dx = rstd * (g - mean(g) - xhat * mean(g*xhat));  dw = sum_n dout*xhat;  db = sum_n dout.
// dw/db are reduced from per-thread partial sums (deterministic for a fixed thread count).
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  const int64_t C = x.shape().back(), N = x.numel() / C;
  dispatch_floating(x.dtype(), "layernorm backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* pg = dout.data<T>();
    const T* pm = mean.data<T>();
    const T* pr = rstd.data<T>();
    T* pdx = dx.defined() ? dx.data<T>() : nullptr;
    const int max_threads = omp_get_max_threads();
    std::vector<T> partial_w(static_cast<size_t>(max_threads * C), T(0)), partial_b(partial_w.size(), T(0));
    int used_threads = 1;
#pragma omp parallel if (N * C > (1 << 14))
    {
      const int t = omp_get_thread_num();
#pragma omp single
      used_threads = omp_get_num_threads();
      T* lw = partial_w.data() + t * C;
      T* lb = partial_b.data() + t * C;
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const T* row = px + n * C;
        const T* g = pg + n * C;
        const T m = pm[n], r = pr[n];
        T mean_g = 0, mean_gx = 0;
#pragma omp simd reduction(+ : mean_g, mean_gx)
        for (int64_t c = 0; c < C; ++c) {
          T xhat = (row[c] - m) * r;
          T gw = g[c] * pw[c];
          mean_g += gw;
          mean_gx += gw * xhat;
          lw[c] += g[c] * xhat;
          lb[c] += g[c];
        }
        mean_g /= static_cast<T>(C);
        mean_gx /= static_cast<T>(C);
        if (pdx) {
          T* d = pdx + n * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) {
            T xhat = (row[c] - m) * r;
            d[c] = r * (g[c] * pw[c] - mean_g - xhat * mean_gx);
          }
        }
      }
    }
    sum_partials(dw, partial_w, used_threads, C);
    sum_partials(db, partial_b, used_threads, C);
  });
}

// GELU, tanh approximation (GPT-2): y = 0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi).
namespace {
// GELU's tanh form at v, and its derivative:
//   gelu(v) = 0.5 v (1 + t),  gelu'(v) = 0.5 (1 + t) + 0.5 v (1 - t^2) s (1 + 3 * 0.044715 v^2),
//   t = tanh(s (v + 0.044715 v^3)).
// (The logistic form v sigma(2u), one exp and one division, runs no faster once its far-left
// sigma, which underflows to denormals, is taken as 0 for a finite slope.)
template <class T> inline T gelu_tanh(T v) {
  const T s = static_cast<T>(0.7978845608028654);
  return vtanh(s * (v + T(0.044715) * v * v * v));
}
template <class T> inline T gelu_value(T v) { return T(0.5) * v * (T(1) + gelu_tanh(v)); }
template <class T> inline T gelu_slope(T v) {
  const T s = static_cast<T>(0.7978845608028654);
  const T t = gelu_tanh(v);
  const T sech2 = T(1) - t * t;
  // Far out (|v| > ~10) sech2 is 0, and beyond |v| ~ 5e19 the v^2 factor overflows to inf:
  // the term is 0 there, not 0 * inf = NaN.
  const T tail = sech2 == T(0) ? T(0) : T(0.5) * v * sech2 * s * (T(1) + T(3) * T(0.044715) * v * v);
  return T(0.5) * (T(1) + t) + tail;
}
constexpr int64_t kBf16Block = 512;  // values per rounded block: 2 KiB of fp32, in L1

// out[i] = value(i) rounded to bf16 for i < n, on every thread: blocks of fp32 values on
// the stack, each rounded by round_to_bf16 (one instruction per 16 values).
template <class F> void write_bf16(BFloat16* out, int64_t n, F value) {
#pragma omp parallel for schedule(static) if (n > (1 << 15))
  for (int64_t start = 0; start < n; start += kBf16Block) {
    const int64_t len = std::min(kBf16Block, n - start);
    float block[kBf16Block];
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) block[i] = value(start + i);
    round_to_bf16(block, out + start, len);
  }
}

// write_bf16 with two results a value: values(i, a, b) sets both (SwiGLU's two gradients).
template <class F> void write_bf16_pair(BFloat16* out_a, BFloat16* out_b, int64_t n, F values) {
#pragma omp parallel for schedule(static) if (n > (1 << 15))
  for (int64_t start = 0; start < n; start += kBf16Block) {
    const int64_t len = std::min(kBf16Block, n - start);
    float a[kBf16Block], b[kBf16Block];
#pragma omp simd
    for (int64_t i = 0; i < len; ++i) values(start + i, a[i], b[i]);
    round_to_bf16(a, out_a + start, len);
    round_to_bf16(b, out_b + start, len);
  }
}
}  // namespace

// bf16 (GPT-2's MLP under --dtype bf16, as autocast runs it): read as fp32, the math in
// fp32, the result rounded once.
void gelu_forward(const Tensor& out, const Tensor& x) {
  const int64_t n = x.numel();
  TALLY_CHECK(out.dtype() == x.dtype(), "gelu: output ", out.str(), " and input ", x.str(), " differ in dtype");
  if (x.dtype() == DType::BF16) {
    const BFloat16* px = x.data<BFloat16>();
    write_bf16(out.data<BFloat16>(), n, [px](int64_t i) { return gelu_value(static_cast<float>(px[i])); });
    return;
  }
  dispatch_floating(x.dtype(), "gelu", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* po = out.data<T>();
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
    for (int64_t i = 0; i < n; ++i) po[i] = gelu_value(px[i]);
  });
}

void gelu_backward(const Tensor& dx, const Tensor& dout, const Tensor& x) {
  const int64_t n = x.numel();
  TALLY_CHECK(dx.dtype() == x.dtype() && dout.dtype() == x.dtype(), "gelu backward: gradient ", dout.str(),
              " and input ", x.str(), " differ in dtype");
  if (x.dtype() == DType::BF16) {
    const BFloat16* px = x.data<BFloat16>();
    const BFloat16* pg = dout.data<BFloat16>();
    write_bf16(dx.data<BFloat16>(), n, [px, pg](int64_t i) {
      return static_cast<float>(pg[i]) * gelu_slope(static_cast<float>(px[i]));
    });
    return;
  }
  dispatch_floating(x.dtype(), "gelu backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pg = dout.data<T>();
    T* pd = dx.data<T>();
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
    for (int64_t i = 0; i < n; ++i) pd[i] = pg[i] * gelu_slope(px[i]);
  });
}

// Per row of C: rstd = 1/sqrt(mean(x^2) + eps), out = x * rstd * w (LLaMA's RMSNorm, with
// the statistics in the tensor's own precision, as Meta's reference computes them in fp32).
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps) {
  const int64_t C = x.shape().back(), N = x.numel() / C;
  dispatch_floating(x.dtype(), "rmsnorm", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    T* po = out.data<T>();
    T* pr = rstd.data<T>();
#pragma omp parallel for schedule(static) if (N * C > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const T* row = px + n * C;
      T ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += row[c] * row[c];
      const T r = T(1) / std::sqrt(ss / static_cast<T>(C) + static_cast<T>(eps));
      T* o = po + n * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] = row[c] * r * pw[c];
      pr[n] = r;
    }
  });
}

// xhat = x * rstd, g = dout * w. From d rstd / d x_j = -rstd^3 x_j / C:
//   dx = rstd * (g - xhat * mean(g * xhat));  dw = sum_n dout * xhat.
// dw is reduced from per-thread partial sums (deterministic for a fixed thread count).
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd) {
  const int64_t C = x.shape().back(), N = x.numel() / C;
  dispatch_floating(x.dtype(), "rmsnorm backward", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    const T* pw = w.data<T>();
    const T* pg = dout.data<T>();
    const T* pr = rstd.data<T>();
    T* pdx = dx.defined() ? dx.data<T>() : nullptr;
    std::vector<T> partial_w(static_cast<size_t>(omp_get_max_threads() * C), T(0));
    int used_threads = 1;
#pragma omp parallel if (N * C > (1 << 14))
    {
      const int t = omp_get_thread_num();
#pragma omp single
      used_threads = omp_get_num_threads();
      T* lw = partial_w.data() + t * C;
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const T* row = px + n * C;
        const T* g = pg + n * C;
        const T r = pr[n];
        T mean_gx = 0;
#pragma omp simd reduction(+ : mean_gx)
        for (int64_t c = 0; c < C; ++c) {
          const T xhat = row[c] * r;
          mean_gx += g[c] * pw[c] * xhat;
          lw[c] += g[c] * xhat;
        }
        mean_gx /= static_cast<T>(C);
        if (pdx) {
          T* d = pdx + n * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) d[c] = r * (g[c] * pw[c] - row[c] * r * mean_gx);
        }
      }
    }
    sum_partials(dw, partial_w, used_threads, C);
  });
}

// Rotary position embedding, Meta's LLaMA convention: the head vector is D/2 complex
// numbers (x[2i], x[2i+1]), each multiplied by exp(i * pos * inv_freq[i]):
//   out[2i]   = x[2i] cos a - x[2i+1] sin a
//   out[2i+1] = x[2i] sin a + x[2i+1] cos a,     a = pos * inv_freq[i].
// The rotation is orthogonal, so its backward is the rotation by -a (inverse = true).
// The angle is formed in the tensor's precision (fp32: as Meta's reference does).
void rotary(const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset, bool inverse) {
  const int64_t B = x.shape()[0], T = x.shape()[1], H = x.shape()[2], D = x.shape()[3], half = D / 2;
  dispatch_floating(x.dtype(), "rotary", [&](auto tag) {
    using F = decltype(tag);
    const F* px = x.data<F>();
    const F* pf = inv_freq.data<F>();
    F* po = out.data<F>();
    const F sign = inverse ? F(-1) : F(1);
#pragma omp parallel if (B * T * H * D > (1 << 15))
    {
      std::vector<F> cosines(static_cast<size_t>(half)), sines(static_cast<size_t>(half));
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) {
          const F pos = static_cast<F>(offset + t);
          for (int64_t i = 0; i < half; ++i) {
            const F angle = pos * pf[i];
            cosines[i] = std::cos(angle);
            sines[i] = sign * std::sin(angle);
          }
          for (int64_t h = 0; h < H; ++h) {
            const F* xr = px + ((b * T + t) * H + h) * D;
            F* o = po + ((b * T + t) * H + h) * D;
            for (int64_t i = 0; i < half; ++i) {
              const F re = xr[2 * i], im = xr[2 * i + 1];
              o[2 * i] = re * cosines[i] - im * sines[i];
              o[2 * i + 1] = re * sines[i] + im * cosines[i];
            }
          }
        }
    }
  });
}

// SwiGLU (LLaMA's MLP): out = silu(g) * u with silu(g) = g s, s = sigmoid(g).
//   d out / d g = u s (1 + g (1 - s)),   d out / d u = g s.
// bf16 (LLaMA's MLP under --dtype bf16, as autocast runs it): read as fp32, the math in
// fp32, each result rounded once.
namespace {
template <class T> inline T swiglu_value(T g, T u) { return silu_arg(g) / (T(1) + vexp(-g)) * u; }
template <class T> inline void swiglu_slopes(T g, T u, T d, T& dg, T& du) {
  const T s = T(1) / (T(1) + vexp(-g)), gs = silu_arg(g);
  dg = d * u * s * (T(1) + gs * (T(1) - s));
  du = d * gs * s;
}
void check_swiglu_dtypes(const char* what, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors)
    TALLY_CHECK(t->dtype() == (*tensors.begin())->dtype(), what, ": ", t->str(), " and ", (*tensors.begin())->str(),
                " differ in dtype");
}
}  // namespace

void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  check_swiglu_dtypes("swiglu", {&gate, &up, &out});
  if (gate.dtype() == DType::BF16) {
    const BFloat16* pg = gate.data<BFloat16>();
    const BFloat16* pu = up.data<BFloat16>();
    write_bf16(out.data<BFloat16>(), n, [pg, pu](int64_t i) {
      return swiglu_value(static_cast<float>(pg[i]), static_cast<float>(pu[i]));
    });
    return;
  }
  dispatch_floating(gate.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gate.data<T>();
    const T* pu = up.data<T>();
    T* po = out.data<T>();
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
    for (int64_t i = 0; i < n; ++i) po[i] = swiglu_value(pg[i], pu[i]);
  });
}

void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up) {
  const int64_t n = gate.numel();
  check_swiglu_dtypes("swiglu backward", {&gate, &up, &dout, &dgate, &dup});
  if (gate.dtype() == DType::BF16) {
    const BFloat16* pg = gate.data<BFloat16>();
    const BFloat16* pu = up.data<BFloat16>();
    const BFloat16* pd = dout.data<BFloat16>();
    write_bf16_pair(dgate.data<BFloat16>(), dup.data<BFloat16>(), n, [pg, pu, pd](int64_t i, float& dg, float& du) {
      swiglu_slopes(static_cast<float>(pg[i]), static_cast<float>(pu[i]), static_cast<float>(pd[i]), dg, du);
    });
    return;
  }
  dispatch_floating(gate.dtype(), "swiglu backward", [&](auto tag) {
    using T = decltype(tag);
    const T* pg = gate.data<T>();
    const T* pu = up.data<T>();
    const T* pd = dout.data<T>();
    T* pdg = dgate.data<T>();
    T* pdu = dup.data<T>();
#pragma omp parallel for simd schedule(static) if (n > (1 << 15))
    for (int64_t i = 0; i < n; ++i) swiglu_slopes(pg[i], pu[i], pd[i], pdg[i], pdu[i]);
  });
}

// Softmax over the last dimension, max-subtracted for stability.
void softmax_forward(const Tensor& out, const Tensor& x) {
  const int64_t C = x.shape().back(), N = x.numel() / std::max<int64_t>(C, 1);
  dispatch_floating(x.dtype(), "softmax", [&](auto tag) {
    using T = decltype(tag);
    const T* px = x.data<T>();
    T* po = out.data<T>();
#pragma omp parallel for schedule(static) if (N * C > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const T* row = px + n * C;
      T* o = po + n * C;
      const T m = row_max(row, C, row[0]);
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < C; ++c) s += (o[c] = vexp(row[c] - m));
      T inv = T(1) / s;
      for (int64_t c = 0; c < C; ++c) o[c] *= inv;
    }
  });
}

// dx = y * (dout - sum(dout * y)).
void softmax_backward(const Tensor& dx, const Tensor& dout, const Tensor& y) {
  const int64_t C = y.shape().back(), N = y.numel() / std::max<int64_t>(C, 1);
  dispatch_floating(y.dtype(), "softmax backward", [&](auto tag) {
    using T = decltype(tag);
    const T* py = y.data<T>();
    const T* pg = dout.data<T>();
    T* pd = dx.data<T>();
#pragma omp parallel for schedule(static) if (N * C > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const T* yr = py + n * C;
      const T* gr = pg + n * C;
      T dot = 0;
      for (int64_t c = 0; c < C; ++c) dot += yr[c] * gr[c];
      T* d = pd + n * C;
      for (int64_t c = 0; c < C; ++c) d[c] = yr[c] * (gr[c] - dot);
    }
  });
}

}  // namespace tally::runtime::cpu
