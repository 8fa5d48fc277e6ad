// Softmax cross-entropy over a (possibly padded) vocabulary, one row at a time:
// forward stores only lse[n]; backward recomputes softmax from the logits and lse, so the
// (N, V) probabilities never exist as a tensor.
#include <cmath>

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
}  // namespace

void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                           int64_t V) {
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  for (int64_t n = 0; n < N; ++n) {
    int64_t t = target_at(targets, n);
    TALLY_CHECK(t < V, "cross_entropy: target ", t, " at row ", n, " is outside the vocabulary of ", V);
  }
  dispatch_floating(logits.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    const T* pl = logits.data<T>();
    T* ploss = losses.data<T>();
    T* plse = lse.data<T>();
#pragma omp parallel for schedule(static) if (N * V > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const T* row = pl + n * Vp;
      const T m = row_max(row, V, row[0]);
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < V; ++j) s += vexp(row[j] - m);
      const T l = m + std::log(s);
      plse[n] = l;
      const int64_t t = target_at(targets, n);
      ploss[n] = t < 0 ? T(0) : l - row[t];
    }
  });
}

void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            int64_t V, double scale) {
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  dispatch_floating(logits.dtype(), "cross_entropy backward", [&](auto tag) {
    using T = decltype(tag);
    const T* pl = logits.data<T>();
    const T* plse = lse.data<T>();
    T* pd = dlogits.data<T>();
    const T sc = static_cast<T>(scale);
#pragma omp parallel for schedule(static) if (N * V > (1 << 14))
    for (int64_t n = 0; n < N; ++n) {
      const T* row = pl + n * Vp;
      T* d = pd + n * Vp;
      const int64_t t = target_at(targets, n);
      if (t < 0) {
        for (int64_t j = 0; j < Vp; ++j) d[j] = 0;
        continue;
      }
      const T l = plse[n];
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) d[j] = sc * vexp(row[j] - l);
      d[t] -= sc;
      for (int64_t j = V; j < Vp; ++j) d[j] = 0;
    }
  });
}

}  // namespace tally::runtime::cpu
