// Softmax cross-entropy over a (possibly padded) vocabulary, one row at a time:
// forward stores only lse[n]; backward recomputes softmax from the logits and lse, so the
// (N, V) probabilities never exist as a tensor.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "runtime/cpu/kernels.h"
#include "runtime/cpu/strided.h"
#include "runtime/cpu/vec_math.h"

namespace tally::runtime::cpu {

namespace {
int64_t target_at(const Tensor& targets, int64_t n) {
  switch (targets.dtype()) {
    case DType::I32: return targets.data<int32_t>()[n];
    case DType::I64: return targets.data<int64_t>()[n];
    case DType::U16: return targets.data<uint16_t>()[n];
    default: TALLY_FAIL("cross_entropy: targets must be integers, got ", targets.str());
  }
}

// bf16 rows are widened a block at a time into fp32 (a stack buffer, widen_bf16), so the
// max, exp and sum loops run on floats and vectorize as fp32's do.
constexpr int64_t kWidenBlock = 1024;

// The log-sum-exp of row[0..V) in one pass over blocks (the online softmax): each block's
// max, then the running sum rescaled when the running max grows, and the block's exps
// summed while it is in L1. bf16 blocks are widened into fp32 first.
template <class In, class T> T row_logsumexp(const In* row, int64_t V) {
  T widened[std::is_same_v<In, T> ? 1 : kWidenBlock];
  T m = -std::numeric_limits<T>::infinity(), s = 0;
  for (int64_t j0 = 0; j0 < V; j0 += kWidenBlock) {
    const int64_t n = std::min(kWidenBlock, V - j0);
    const T* block;
    if constexpr (std::is_same_v<In, T>) {
      block = row + j0;
    } else {
      widen_bf16(row + j0, widened, n);
      block = widened;
    }
    const T bm = row_max(block, n, m);
    if (bm == -std::numeric_limits<T>::infinity()) continue;  // nothing but -inf so far (masked): adds 0
    if (bm > m) s *= vexp(m - bm), m = bm;                    // s is 0 while m is -inf
    T bs = 0;
    if constexpr (std::is_same_v<T, float>) {
      bs = exp_shifted(block, m, n, nullptr, nullptr);
    } else {
#pragma omp simd reduction(+ : bs)
      for (int64_t j = 0; j < n; ++j) bs += vexp(block[j] - m);
    }
    s += bs;
  }
  return m + std::log(s);
}

// d[j] = sc * exp(row[j] - l) for j < n, d may be row.
template <class T> void scaled_softmax(const T* row, T* d, int64_t n, T l, T sc) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] = sc * vexp(row[j] - l);
}
void scaled_softmax(const float* row, float* d, int64_t n, float l, float sc) { exp_shifted(row, l, n, d, nullptr, sc); }
void scaled_softmax(const BFloat16* row, BFloat16* d, int64_t n, float l, float sc) {
  float block[kWidenBlock];
  for (int64_t j0 = 0; j0 < n; j0 += kWidenBlock) {
    const int64_t k = std::min(kWidenBlock, n - j0);
    widen_bf16(row + j0, block, k);
    exp_shifted(block, l, k, nullptr, d + j0, sc);
  }
}

template <class T> T value_of(T v) { return v; }
float value_of(BFloat16 v) { return static_cast<float>(v); }
template <class Out, class T> Out stored_as(T v) {
  if constexpr (std::is_same_v<Out, BFloat16>) return BFloat16(static_cast<float>(v));
  else return static_cast<Out>(v);
}
}  // namespace

void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                           int64_t V) {
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  for (int64_t n = 0; n < N; ++n) {
    int64_t t = target_at(targets, n);
    TALLY_CHECK(t < V, "cross_entropy: target ", t, " at row ", n, " is outside the vocabulary of ", V);
  }
  dispatch_mixed(logits, lse, "cross_entropy", [&](auto in_tag, auto tag) {
    using In = decltype(in_tag);
    using T = decltype(tag);
    const In* pl = logits.data<In>();
    T* ploss = losses.data<T>();
    T* plse = lse.data<T>();
#pragma omp parallel for schedule(static) if (N * V > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const In* row = pl + n * Vp;
      const T l = row_logsumexp<In, T>(row, V);
      plse[n] = l;
      const int64_t t = target_at(targets, n);
      ploss[n] = t < 0 ? T(0) : l - value_of(row[t]);
    }
  });
}

// dlogits may be the logits themselves (the op overwrites them in place): each element is
// read before it is written, the target's included.
void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            int64_t V, double scale) {
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  TALLY_CHECK(dlogits.dtype() == logits.dtype(), "cross_entropy backward: the gradient ", dlogits.str(),
              " must have the logits' dtype (", dtype_name(logits.dtype()), ")");
  dispatch_mixed(logits, lse, "cross_entropy backward", [&](auto in_tag, auto tag) {
    using In = decltype(in_tag);
    using T = decltype(tag);
    const In* pl = logits.data<In>();
    const T* plse = lse.data<T>();
    In* pd = dlogits.data<In>();
    const T sc = static_cast<T>(scale);
#pragma omp parallel for schedule(static) if (N * V > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const In* row = pl + n * Vp;
      In* d = pd + n * Vp;
      const int64_t t = target_at(targets, n);
      if (t < 0) {
        for (int64_t j = 0; j < Vp; ++j) d[j] = stored_as<In>(T(0));
        continue;
      }
      const T l = plse[n];
      // The target's entry, sc (p_t - 1), is rounded once (under bf16) from its fp32 value.
      const T target_grad = sc * vexp(value_of(row[t]) - l) - sc;
      scaled_softmax(row, d, V, l, sc);
      d[t] = stored_as<In>(target_grad);
      for (int64_t j = V; j < Vp; ++j) d[j] = stored_as<In>(T(0));
    }
  });
}

}  // namespace tally::runtime::cpu
