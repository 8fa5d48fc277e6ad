// Causal attention on CPU, blocked as FlashAttention-2 is: tiles of Bq queries x Bk keys,
// each product a small GEMM, with an online softmax, so the (T,T) score matrix is never
// stored. Memory beyond the inputs and outputs: lse[b,h,t] (kept for backward), a few
// (Bq x Bk) tiles per thread, and under bf16 one kv head's dk and dv accumulators per
// thread in backward (2 Tk D floats: linear in T).
//
//   s_tj = scale * q_t . k_j  (j <= t),  p_tj = softmax_j(s_tj),  o_t = sum_j p_tj v_j
// Forward, per query tile, over the key tiles it sees: S = scale Q K^T, then per row the
// running max m and sum l: m' = max(m, max_j s_j), O <- O exp(m - m') + exp(S - m') V,
// l <- l exp(m - m') + sum_j exp(s_j - m'); at the end o = O / l and lse = m' + log l.
// Backward, with D_t = do_t . o_t, recomputing P = exp(S - lse) per tile:
//   dV += P^T dO,  dP = dO V^T,  dS = P o (dP - D),  dQ += scale dS K,  dK += scale dS^T Q
//
// Queries may be fewer than keys (decoding with a KV cache): q holds the last Tq of Tk
// positions, so query row t sits at position t + Tk - Tq and sees keys j <= that.
//
// Mixed precision: q, k and v may be bf16, and then the output (and so its gradient dO)
// may be bf16 too, as autocast's attention writes it; lse and the gradients of q, k, v stay
// fp32. The tile GEMMs take bf16 operands with fp32 accumulation, as the projections'
// GEMMs do: P and dS are rounded to bf16 for the products they feed, dO once per query
// tile (a bf16 dO is copied into a dense tile); the softmax statistics, D and every sum
// stay fp32, and the output is rounded once, from its fp32 accumulator. Every bf16 tile
// product reads and writes dense tiles (the op copies q, k, v into head-major storage;
// score tiles are as wide as their rows; dq accumulates per query tile, dk and dv per kv
// head, in dense fp32 buffers added into the gradients' rows once): oneDNN's AMX and
// AVX512-BF16 kernels take nothing else. P and dS are rounded as they are made, in the
// pass that computes them (exp_shifted, softmax_gradient_row_bf16): under bf16 the forward's
// P and backward's dS exist in fp32 only in registers.
//
// Forward runs (batch, head, query tile) items in parallel. Backward runs (batch, kv head)
// items: the query heads that share a kv head (GQA) and every tile of them run in the same
// thread, so dq, dk and dv accumulate without races or per-thread copies.
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <exception>
#include <limits>
#include <type_traits>
#include <vector>

#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"

namespace tally::runtime::cpu {

namespace {
// Query tiles of 128 rows. Forward takes keys 512 at a time: a 128 x 512 fp32 score tile is
// 256 KiB, in a thread's L2, and a query tile of W3 (T = 1024) needs at most two tile
// products of each kind instead of eight: fewer calls (each has a fixed cost) and longer
// ones. Backward, whose five products per tile and dk/dv terms keep more tiles live, takes
// 256. On W3 (Sapphire Rapids, two threads) the forward takes 13% (fp32) to 22% (bf16)
// less time with 512 keys a tile than with 128; the backward 1-2% less with 256 than with
// 128, and no less with 512 or 1024 (more with 1024 in bf16).
// The diagonal tile's masked part is the only waste: a tile is as wide as the keys its
// queries see.
constexpr int64_t kBlockQ = kAttentionQueryTile, kForwardBlockK = 512, kBackwardBlockK = 256;

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

// C (m x n, row stride ldc) = alpha op(A) op(B) + beta C, all row-major. fp32 through
// oneDNN's sgemm, which runs on the calling thread inside a parallel region; fp64 (the
// gradient checks) through a plain loop.
void tile_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  TALLY_CHECK(st == dnnl_success, "attention: oneDNN sgemm failed with status ", static_cast<int>(st), " for a ", m,
              "x", n, "x", k, " tile");
}
void tile_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a, int64_t lda,
               const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += (ta ? a[p * lda + i] : a[i * lda + p]) * (tb ? b[j * ldb + p] : b[p * ldb + j]);
      c[i * ldc + j] = alpha * s + (beta == 0 ? 0 : beta * c[i * ldc + j]);
    }
}

void tile_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const BFloat16* a, int64_t lda,
               const BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  tile_gemm_bf16(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// A (rows x cols, row stride ld) tile of Src as a GEMM operand of type In, with its row
// stride: fp32 and fp64 tiles as they are (sgemm takes any stride); for bf16 operands a
// dense bf16 tile as it is, else the tile copied (bf16) or rounded (fp32) into `scratch`
// with rows of `cols`.
template <class In> struct TileOperand {
  const In* data;
  int64_t ld;
};
template <class In, class Src>
TileOperand<In> as_operand(const Src* tile, int64_t ld, int64_t rows, int64_t cols, std::vector<In>& scratch) {
  if constexpr (!std::is_same_v<In, BFloat16>) {
    static_assert(std::is_same_v<In, Src>, "fp32 and fp64 tiles are their own operands");
    return {tile, ld};
  } else if constexpr (std::is_same_v<Src, BFloat16>) {
    if (ld == cols) return {tile, ld};
    for (int64_t i = 0; i < rows; ++i) std::memcpy(scratch.data() + i * cols, tile + i * ld, sizeof(BFloat16) * cols);
    return {scratch.data(), cols};
  } else {
    for (int64_t i = 0; i < rows; ++i) round_to_bf16(tile + i * ld, scratch.data() + i * cols, cols);
    return {scratch.data(), cols};
  }
}

// A dense tile (rows of its width) as a GEMM operand of type In: the tile itself when In
// is its type T, else its bf16 copy (mixed precision).
template <class In, class T> const In* dense_operand(const T* tile, const In* rounded) {
  if constexpr (std::is_same_v<In, T>) return tile;
  else return rounded;
}

// One row of softmax's gradient under mixed precision, rounded for the GEMMs it feeds:
// out = bf16(p o (dp - d)) over n values (the fp32 products only in registers).
inline void softmax_gradient_row_bf16(const float* p, const float* dp, float d, int64_t n, BFloat16* out) {
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512 dv = _mm512_set1_ps(d);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 mask = lanes_mask(n - c);
    const __m512 ds = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, p + c), _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, dp + c), dv));
    store_bf16x16(out + c, mask, ds);
  }
#else
  for (int64_t c = 0; c < n; ++c) out[c].bits = bf16_round_bits(p[c] * (dp[c] - d));
#endif
}

// Runs body(Out{}) with Out the storage type of the output (and of its gradient): T, or
// bf16 beside bf16 operands (mixed precision's attention, whose math stays T = fp32).
template <class In, class T, class F> void dispatch_output(const Tensor& out, const char* what, F&& body) {
  if constexpr (std::is_same_v<In, BFloat16>) {
    if (out.dtype() == DType::BF16) return body(BFloat16{});
  }
  TALLY_CHECK(out.dtype() == DTypeOf<T>::value, what, ": output ", out.str(), " must be ", dtype_name(DTypeOf<T>::value),
              std::is_same_v<In, BFloat16> ? " or bfloat16" : "");
  body(T{});
}

// Scratch of Elem that only mixed precision (In != T) uses: the rounded operands of
// as_operand (Elem = In) and the dense accumulators of dq, dk and dv (Elem = T).
// Empty when In is T: nothing is rounded, and the tile GEMMs accumulate in place.
template <class Elem, class In, class T> std::vector<Elem> mixed_precision_scratch(int64_t elements) {
  return std::vector<Elem>(std::is_same_v<In, T> ? 0 : static_cast<size_t>(elements));
}

// An exception must not leave an OpenMP region (the process would terminate): a tile GEMM
// that throws (oneDNN's error, a failed check) has its exception kept, the remaining items
// are skipped, and the first one is rethrown once the region has ended.
class RegionErrors {
 public:
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void keep(std::exception_ptr e) {
    bool expected = false;
    if (failed_.compare_exchange_strong(expected, true)) first_ = std::move(e);
  }
  void rethrow() const {
    if (first_) std::rethrow_exception(first_);
  }

 private:
  std::atomic<bool> failed_{false};
  std::exception_ptr first_;
};

template <class T, class A, class B> inline T dot(const A* a, const B* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += static_cast<T>(a[i]) * static_cast<T>(b[i]);
  return s;
}

// dst (rows x cols, row stride ld) += src (rows x cols, dense).
template <class T> void add_rows(T* dst, int64_t ld, const T* src, int64_t rows, int64_t cols) {
  for (int64_t i = 0; i < rows; ++i) {
    T* d = dst + i * ld;
    const T* s = src + i * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) d[c] += s[c];
  }
}

// The key tiles query tile [t0, t0 + rows) sees: keys [0, t0 + rows + offset).
inline int64_t keys_seen(int64_t t0, int64_t rows, int64_t offset) { return t0 + rows + offset; }

template <class In, class T, class Out>
void forward_tiles(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v) {
  const Geometry g = geometry(q, k, v);
  const int64_t group = g.H / g.KV;
  const int64_t q_tiles = (g.Tq + kBlockQ - 1) / kBlockQ;
  const In* pq = q.data<In>();
  const In* pk = k.data<In>();
  const In* pv = v.data<In>();
  Out* po = out.data<Out>();  // contiguous (B, Tq, H, D)
  T* pl = lse.data<T>();      // (B, H, Tq)
  const T scale = T(1) / std::sqrt(static_cast<T>(g.D));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t offset = g.Tk - g.Tq;
  const int64_t items = g.B * g.H * q_tiles;
  // Mixed precision: P = exp(S - m) goes straight into the bf16 operand of P V.
  constexpr bool kRoundedP = !std::is_same_v<In, T>;
  const bool parallel = g.B * g.H * g.Tq * g.Tk * g.D > (1 << 16);
  RegionErrors errors;
#pragma omp parallel if (parallel)
  {
    std::vector<T> s(static_cast<size_t>(kBlockQ * kForwardBlockK)), acc(static_cast<size_t>(kBlockQ * g.D));
    std::vector<T> m(kBlockQ), l(kBlockQ);
    std::vector<In> p_rounded = mixed_precision_scratch<In, In, T>(kBlockQ * kForwardBlockK);
    // Later query tiles see more keys: hand items out dynamically, longest first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      if (errors.failed()) continue;
      try {
        const int64_t tile = q_tiles - 1 - item % q_tiles, bh = item / q_tiles, b = bh / g.H, h = bh % g.H;
        const int64_t kvh = h / group;
        const int64_t t0 = tile * kBlockQ, rows = std::min(kBlockQ, g.Tq - t0);
        const In* qtile = pq + b * g.qb + t0 * g.qt + h * g.qh;
        std::fill(m.begin(), m.end(), neg_inf);
        std::fill(l.begin(), l.end(), T(0));
        std::fill(acc.begin(), acc.end(), T(0));
        const int64_t seen = keys_seen(t0, rows, offset);
        for (int64_t j0 = 0; j0 < seen; j0 += kForwardBlockK) {
          const int64_t cols = std::min(kForwardBlockK, seen - j0);
          const In* ktile = pk + b * g.kb + j0 * g.kt + kvh * g.kh;
          tile_gemm(false, true, rows, cols, g.D, scale, qtile, g.qt, ktile, g.kt, T(0), s.data(), cols);
          for (int64_t i = 0; i < rows; ++i) {
            T* srow = s.data() + i * cols;
            // Row i sees columns c <= last (its position minus j0); the rest get p = 0.
            const int64_t last = std::min(cols - 1, t0 + i + offset - j0);
            if (last < 0) {
              if constexpr (kRoundedP) std::fill(p_rounded.data() + i * cols, p_rounded.data() + (i + 1) * cols, BFloat16{});
              else std::fill(srow, srow + cols, T(0));
              continue;
            }
            const T mx = row_max(srow, last + 1, m[i]);
            const T rescale = vexp(m[i] - mx);  // 0 on the first tile (m = -inf)
            T sum = 0;
            if constexpr (kRoundedP) {
              // P straight into its bf16 operand tile, the fp32 values only in registers
              BFloat16* prow = p_rounded.data() + i * cols;
              sum = exp_shifted(srow, mx, last + 1, nullptr, prow);
              std::fill(prow + last + 1, prow + cols, BFloat16{});
            } else if constexpr (std::is_same_v<T, float>) {
              sum = exp_shifted(srow, mx, last + 1, srow, nullptr);
              std::fill(srow + last + 1, srow + cols, T(0));
            } else {
#pragma omp simd reduction(+ : sum)
              for (int64_t c = 0; c <= last; ++c) sum += (srow[c] = vexp(srow[c] - mx));
              std::fill(srow + last + 1, srow + cols, T(0));
            }
            l[i] = l[i] * rescale + sum;
            m[i] = mx;
            T* arow = acc.data() + i * g.D;
            if (rescale != T(1))
              for (int64_t d = 0; d < g.D; ++d) arow[d] *= rescale;
          }
          const In* vtile = pv + b * g.vb + j0 * g.vt + kvh * g.vh;
          const In* p = dense_operand<In>(s.data(), p_rounded.data());
          tile_gemm(false, false, rows, g.D, cols, T(1), p, cols, vtile, g.vt, T(1), acc.data(), g.D);
        }
        for (int64_t i = 0; i < rows; ++i) {
          const T inv = T(1) / l[i];
          Out* orow = po + ((b * g.Tq + t0 + i) * g.H + h) * g.D;
          T* arow = acc.data() + i * g.D;
          if constexpr (std::is_same_v<Out, T>) {
            for (int64_t d = 0; d < g.D; ++d) orow[d] = arow[d] * inv;
          } else {
            for (int64_t d = 0; d < g.D; ++d) arow[d] *= inv;
            round_to_bf16(arow, orow, g.D);
          }
          pl[(b * g.H + h) * g.Tq + t0 + i] = m[i] + std::log(l[i]);
        }
      } catch (...) {
        errors.keep(std::current_exception());
      }
    }
  }
  errors.rethrow();
}
}  // namespace

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v) {
  dispatch_mixed(q, lse, "attention", [&](auto in_tag, auto tag) {
    using In = decltype(in_tag);
    using T = decltype(tag);
    dispatch_output<In, T>(out, "attention", [&](auto out_tag) {
      forward_tiles<In, T, decltype(out_tag)>(out, lse, q, k, v);
    });
  });
}

namespace {
template <class In, class T, class Out>
void backward_tiles(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) {
  const Geometry g = geometry(q, k, v);
  const int64_t group = g.H / g.KV;
  const In* pq = q.data<In>();
  const In* pk = k.data<In>();
  const In* pv = v.data<In>();
  const Out* po = out.data<Out>();
  const Out* pdo = dout.data<Out>();
  const T* pl = lse.data<T>();
  T* pdq = dq.data<T>();  // contiguous (B,Tq,H,D), zero-initialized
  T* pdk = dk.data<T>();  // contiguous (B,Tk,KV,D), zero-initialized
  T* pdv = dv.data<T>();
  const T scale = T(1) / std::sqrt(static_cast<T>(g.D));
  const int64_t offset = g.Tk - g.Tq;
  const int64_t ld_q = g.H * g.D, ld_kv = g.KV * g.D;  // row strides of dq/dout/out and of dk/dv
  const bool parallel = g.B * g.H * g.Tq * g.Tk * g.D > (1 << 16);
  RegionErrors errors;
#pragma omp parallel if (parallel)
  {
    std::vector<T> p(static_cast<size_t>(kBlockQ * kBackwardBlockK)), dp(static_cast<size_t>(kBlockQ * kBackwardBlockK));
    std::vector<T> delta(static_cast<size_t>(kBlockQ));  // D for the query tile's rows
    // bf16 tile products write dense results only. dq accumulates over a query tile's key
    // tiles in a dense tile, added into its rows once the tile is complete; dk and dv over
    // every query tile of the kv head's query heads in dense (Tk, D) buffers, added into
    // their rows once the item is done. (A dense term per tile added into the strided rows
    // at once would cost bf16's backward 7-10% at T = 8192.) fp32 and fp64 tile GEMMs take
    // any stride and accumulate into the gradients' rows in place.
    constexpr bool kDenseResults = !std::is_same_v<In, T>;
    std::vector<T> dq_acc = mixed_precision_scratch<T, In, T>(kBlockQ * g.D);
    std::vector<T> dk_acc = mixed_precision_scratch<T, In, T>(g.Tk * g.D);
    std::vector<T> dv_acc = mixed_precision_scratch<T, In, T>(g.Tk * g.D);
    const int64_t ld_dkv_into = kDenseResults ? g.D : ld_kv;
    std::vector<In> p_rounded = mixed_precision_scratch<In, In, T>(kBlockQ * kBackwardBlockK);
    std::vector<In> ds_rounded = mixed_precision_scratch<In, In, T>(kBlockQ * kBackwardBlockK);
    std::vector<In> do_rounded = mixed_precision_scratch<In, In, T>(kBlockQ * g.D);
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < g.B; ++b)
      for (int64_t kvh = 0; kvh < g.KV; ++kvh) {
        if (errors.failed()) continue;
        try {
          T* dk_item = pdk + b * g.Tk * ld_kv + kvh * g.D;  // this kv head's rows of dk and dv
          T* dv_item = pdv + b * g.Tk * ld_kv + kvh * g.D;
          std::fill(dk_acc.begin(), dk_acc.end(), T(0));
          std::fill(dv_acc.begin(), dv_acc.end(), T(0));
          for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
            const T* lrow = pl + (b * g.H + h) * g.Tq;
            for (int64_t t0 = 0; t0 < g.Tq; t0 += kBlockQ) {
              const int64_t rows = std::min(kBlockQ, g.Tq - t0);
              const In* qtile = pq + b * g.qb + t0 * g.qt + h * g.qh;
              const TileOperand<In> dotile =
                  as_operand(pdo + ((b * g.Tq + t0) * g.H + h) * g.D, ld_q, rows, g.D, do_rounded);
              // D = dO . o from the dO that dP = dO V^T takes (under bf16, rounded): the
              // rows of dS = P (dP - D) then sum to zero as softmax's shift invariance says
              // (up to o's own rounding when the output is bf16, as FlashAttention's is).
              for (int64_t i = 0; i < rows; ++i)
                delta[i] = dot<T>(dotile.data + i * dotile.ld, po + ((b * g.Tq + t0 + i) * g.H + h) * g.D, g.D);
              T* dqtile = pdq + ((b * g.Tq + t0) * g.H + h) * g.D;
              T* dq_into = kDenseResults ? dq_acc.data() : dqtile;
              const int64_t ld_dq_into = kDenseResults ? g.D : ld_q;
              std::fill(dq_acc.begin(), dq_acc.end(), T(0));
              const int64_t seen = keys_seen(t0, rows, offset);
              for (int64_t j0 = 0; j0 < seen; j0 += kBackwardBlockK) {
                const int64_t cols = std::min(kBackwardBlockK, seen - j0);
                const In* ktile = pk + b * g.kb + j0 * g.kt + kvh * g.kh;
                const In* vtile = pv + b * g.vb + j0 * g.vt + kvh * g.vh;
                T* dk_into = kDenseResults ? dk_acc.data() + j0 * g.D : dk_item + j0 * ld_kv;
                T* dv_into = kDenseResults ? dv_acc.data() + j0 * g.D : dv_item + j0 * ld_kv;
                // P = exp(scale Q K^T - lse), masked; the score tiles are dense (rows of cols)
                tile_gemm(false, true, rows, cols, g.D, scale, qtile, g.qt, ktile, g.kt, T(0), p.data(), cols);
                // (Mixed precision rounds P and dS into their bf16 operand tiles as they are
                // made; dS's fp32 values live only in registers.)
                for (int64_t i = 0; i < rows; ++i) {
                  T* prow = p.data() + i * cols;
                  const int64_t seen_in_tile = std::max<int64_t>(0, std::min(cols - 1, t0 + i + offset - j0) + 1);
                  const T li = lrow[t0 + i];
                  if constexpr (std::is_same_v<T, float>) {
                    BFloat16* rounded = nullptr;
                    if constexpr (kDenseResults) {
                      rounded = p_rounded.data() + i * cols;
                      std::fill(rounded + seen_in_tile, rounded + cols, BFloat16{});
                    }
                    exp_shifted(prow, li, seen_in_tile, prow, rounded);
                    std::fill(prow + seen_in_tile, prow + cols, T(0));
                  } else {
#pragma omp simd
                    for (int64_t c = 0; c < cols; ++c) prow[c] = c < seen_in_tile ? vexp(prow[c] - li) : T(0);
                  }
                }
                const In* pt = dense_operand<In>(p.data(), p_rounded.data());
                // dV += P^T dO;  dP = dO V^T
                tile_gemm(true, false, cols, g.D, rows, T(1), pt, cols, dotile.data, dotile.ld, T(1), dv_into, ld_dkv_into);
                tile_gemm(false, true, rows, cols, g.D, T(1), dotile.data, dotile.ld, vtile, g.vt, T(0), dp.data(), cols);
                // dS = P o (dP - D), in place of dP (masked entries have P = 0)
                for (int64_t i = 0; i < rows; ++i) {
                  const T* prow = p.data() + i * cols;
                  T* dsrow = dp.data() + i * cols;
                  if constexpr (kDenseResults) {
                    softmax_gradient_row_bf16(prow, dsrow, delta[i], cols, ds_rounded.data() + i * cols);
                  } else {
                    const T di = delta[i];
#pragma omp simd
                    for (int64_t c = 0; c < cols; ++c) dsrow[c] = prow[c] * (dsrow[c] - di);
                  }
                }
                const In* ds = dense_operand<In>(dp.data(), ds_rounded.data());
                // dQ += scale dS K;  dK += scale dS^T Q
                tile_gemm(false, false, rows, g.D, cols, scale, ds, cols, ktile, g.kt, T(1), dq_into, ld_dq_into);
                tile_gemm(true, false, cols, g.D, rows, scale, ds, cols, qtile, g.qt, T(1), dk_into, ld_dkv_into);
              }
              if constexpr (kDenseResults) add_rows(dqtile, ld_q, dq_acc.data(), rows, g.D);
            }
          }
          if constexpr (kDenseResults) {
            add_rows(dk_item, ld_kv, dk_acc.data(), g.Tk, g.D);
            add_rows(dv_item, ld_kv, dv_acc.data(), g.Tk, g.D);
          }
        } catch (...) {
          errors.keep(std::current_exception());
        }
      }
  }
  errors.rethrow();
}
}  // namespace

void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) {
  TALLY_CHECK(dout.dtype() == out.dtype(), "attention backward: gradient ", dout.str(), " and output ", out.str(),
              " differ in dtype");
  dispatch_mixed(q, dq, "attention backward", [&](auto in_tag, auto tag) {
    using In = decltype(in_tag);
    using T = decltype(tag);
    dispatch_output<In, T>(out, "attention backward", [&](auto out_tag) {
      backward_tiles<In, T, decltype(out_tag)>(dq, dk, dv, dout, q, k, v, out, lse);
    });
  });
}

}  // namespace tally::runtime::cpu
