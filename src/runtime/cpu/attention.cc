// Causal attention on CPU, computed one query row at a time so the (T,T) score matrix
// is never stored: forward keeps the output and lse[b,h,t] = log sum_j exp(s_tj);
// backward recomputes p_tj = exp(s_tj - lse_t) from q, k and lse.
//
//   s_tj = scale * q_t . k_j  (j <= t),  p_tj = softmax_j(s_tj),  o_t = sum_j p_tj v_j
// Backward, with D_t = do_t . o_t:
//   dp_tj = do_t . v_j,  ds_tj = p_tj (dp_tj - D_t)
//   dq_t = scale * sum_j ds_tj k_j,  dk_j += scale * ds_tj q_t,  dv_j += p_tj do_t
//
// Queries may be fewer than keys (decoding with a KV cache): q holds the last Tq of Tk
// positions, so query row t sits at position t + Tk - Tq and sees keys j <= that.
//
// Parallel over (batch, kv head): the query heads that share a kv head (GQA) run in the
// same thread, so dk/dv accumulate without races.
#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"

namespace tally::runtime::cpu {

namespace {
struct Geometry {
  int64_t B, Tq, Tk, H, KV, D;
  // element strides of q, k, v along (b, t, h); the last dim is contiguous
  int64_t qb, qt, qh, kb, kt, kh, vb, vt, vh;
};

Geometry geometry(const Tensor& q, const Tensor& k, const Tensor& v) {
  Geometry g{q.shape()[0], q.shape()[1], k.shape()[1], q.shape()[2], k.shape()[2], q.shape()[3],
             q.strides()[0], q.strides()[1], q.strides()[2], k.strides()[0], k.strides()[1], k.strides()[2],
             v.strides()[0], v.strides()[1], v.strides()[2]};
  return g;
}

template <class T> inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v) {
  const Geometry g = geometry(q, k, v);
  const int64_t group = g.H / g.KV;
  dispatch_floating(q.dtype(), "attention", [&](auto tag) {
    using T = decltype(tag);
    const T* pq = q.data<T>();
    const T* pk = k.data<T>();
    const T* pv = v.data<T>();
    T* po = out.data<T>();
    T* pl = lse.data<T>();
    const T scale = T(1) / std::sqrt(static_cast<T>(g.D));
    const int64_t offset = g.Tk - g.Tq;
    const bool parallel = g.B * g.H * g.Tq * g.Tk * g.D > (1 << 16);
#pragma omp parallel if (parallel)
    {
      std::vector<T> p(static_cast<size_t>(g.Tk));
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t h = 0; h < g.H; ++h) {
          const int64_t kvh = h / group;
          for (int64_t t = 0; t < g.Tq; ++t) {
            const T* qrow = pq + b * g.qb + t * g.qt + h * g.qh;
            const int64_t last = t + offset;  // the last key this query sees
            T m = -std::numeric_limits<T>::infinity();
            for (int64_t j = 0; j <= last; ++j) {
              p[j] = scale * dot(qrow, pk + b * g.kb + j * g.kt + kvh * g.kh, g.D);
              m = std::max(m, p[j]);
            }
            T sum = 0;
            for (int64_t j = 0; j <= last; ++j) sum += (p[j] = vexp(p[j] - m));
            const T inv = T(1) / sum;
            T* orow = po + ((b * g.Tq + t) * g.H + h) * g.D;
            for (int64_t d = 0; d < g.D; ++d) orow[d] = 0;
            for (int64_t j = 0; j <= last; ++j) {
              const T w = p[j] * inv;
              const T* vrow = pv + b * g.vb + j * g.vt + kvh * g.vh;
#pragma omp simd
              for (int64_t d = 0; d < g.D; ++d) orow[d] += w * vrow[d];
            }
            pl[(b * g.H + h) * g.Tq + t] = m + std::log(sum);
          }
        }
    }
  });
}

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) {
  const Geometry g = geometry(q, k, v);
  const int64_t group = g.H / g.KV;
  dispatch_floating(q.dtype(), "attention backward", [&](auto tag) {
    using T = decltype(tag);
    const T* pq = q.data<T>();
    const T* pk = k.data<T>();
    const T* pv = v.data<T>();
    const T* po = out.data<T>();
    const T* pdo = dout.data<T>();
    const T* pl = lse.data<T>();
    T* pdq = dq.data<T>();  // contiguous (B,T,H,D), zero-initialized
    T* pdk = dk.data<T>();  // contiguous (B,T,KV,D), zero-initialized
    T* pdv = dv.data<T>();
    const T scale = T(1) / std::sqrt(static_cast<T>(g.D));
    const int64_t offset = g.Tk - g.Tq;
    const bool parallel = g.B * g.H * g.Tq * g.Tk * g.D > (1 << 16);
#pragma omp parallel if (parallel)
    {
      std::vector<T> p(static_cast<size_t>(g.Tk)), ds(static_cast<size_t>(g.Tk));
#pragma omp for collapse(2) schedule(static)
      for (int64_t b = 0; b < g.B; ++b)
        for (int64_t kvh = 0; kvh < g.KV; ++kvh)
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h)
            for (int64_t t = 0; t < g.Tq; ++t) {
              const T* qrow = pq + b * g.qb + t * g.qt + h * g.qh;
              const T* dorow = pdo + ((b * g.Tq + t) * g.H + h) * g.D;
              const T* orow = po + ((b * g.Tq + t) * g.H + h) * g.D;
              const T l = pl[(b * g.H + h) * g.Tq + t];
              const T Dt = dot(dorow, orow, g.D);
              const int64_t last = t + offset;
              for (int64_t j = 0; j <= last; ++j) {
                const T* krow = pk + b * g.kb + j * g.kt + kvh * g.kh;
                const T* vrow = pv + b * g.vb + j * g.vt + kvh * g.vh;
                p[j] = vexp(scale * dot(qrow, krow, g.D) - l);
                ds[j] = p[j] * (dot(dorow, vrow, g.D) - Dt);
              }
              T* dqrow = pdq + ((b * g.Tq + t) * g.H + h) * g.D;
              for (int64_t j = 0; j <= last; ++j) {
                const T* krow = pk + b * g.kb + j * g.kt + kvh * g.kh;
                T* dkrow = pdk + ((b * g.Tk + j) * g.KV + kvh) * g.D;
                T* dvrow = pdv + ((b * g.Tk + j) * g.KV + kvh) * g.D;
                const T a = scale * ds[j], w = p[j];
#pragma omp simd
                for (int64_t d = 0; d < g.D; ++d) {
                  dqrow[d] += a * krow[d];
                  dkrow[d] += a * qrow[d];
                  dvrow[d] += w * dorow[d];
                }
              }
            }
    }
  });
}

}  // namespace tally::runtime::cpu
