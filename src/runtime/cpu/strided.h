// Strided iteration over N operands that share one logical shape (after broadcasting):
// the loop nest every elementwise CPU kernel is built on.
//
// Dimensions are first coalesced (adjacent dims that are contiguous in every operand
// merge into one), so contiguous tensors run as one long row and the inner loops see
// unit or zero strides, which the compiler vectorizes.
#pragma once
#include <omp.h>

#include <array>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace tally::runtime::cpu {

// Broadcast strides of `t` viewed as `shape` (zero where t has size 1 or is missing).
Shape broadcast_strides(const Tensor& t, const Shape& shape);

template <size_t N> struct Rows {
  Shape shape;                       // coalesced, last dim is the row
  std::array<Shape, N> strides;      // per operand, in elements
};

template <size_t N> Rows<N> coalesce(const Shape& shape, const std::array<Shape, N>& strides) {
  Rows<N> r;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    bool merge = !r.shape.empty();
    for (size_t k = 0; merge && k < N; ++k) merge = r.strides[k].back() == strides[k][d] * shape[d];
    if (merge) {
      r.shape.back() *= shape[d];
      for (size_t k = 0; k < N; ++k) r.strides[k].back() = strides[k][d];
    } else {
      r.shape.push_back(shape[d]);
      for (size_t k = 0; k < N; ++k) r.strides[k].push_back(strides[k][d]);
    }
  }
  if (r.shape.empty()) {  // a scalar: one row of one element
    r.shape.push_back(1);
    for (size_t k = 0; k < N; ++k) r.strides[k].push_back(0);
  }
  return r;
}

// body(std::array<int64_t,N> offsets, int64_t n, std::array<int64_t,N> inner_strides)
// over every element, as runs of n along the innermost (coalesced) dimension. Runs are
// independent; they run in parallel when the work is large enough. A long row is cut into
// pieces of kPiece elements: a contiguous tensor coalesces into a single row, and uncut it
// would run on one thread (as every residual add, fill and copy of a step would).
template <size_t N, class Body>
void for_each_row(const Shape& shape, const std::array<Shape, N>& strides, Body&& body) {
  Rows<N> r = coalesce<N>(shape, strides);
  const int64_t ndim = static_cast<int64_t>(r.shape.size());
  const int64_t row_len = r.shape.back();
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < ndim; ++d) rows *= r.shape[d];
  std::array<int64_t, N> inner;
  for (size_t k = 0; k < N; ++k) inner[k] = r.strides[k].back();
  // The run [start, start + n) of row `row`.
  auto run = [&](int64_t row, int64_t start, int64_t n) {
    std::array<int64_t, N> off{};
    int64_t rem = row;
    for (int64_t d = ndim - 2; d >= 0; --d) {
      int64_t i = rem % r.shape[d];
      rem /= r.shape[d];
      for (size_t k = 0; k < N; ++k) off[k] += i * r.strides[k][d];
    }
    for (size_t k = 0; k < N; ++k) off[k] += start * inner[k];
    body(off, n, inner);
  };
  // Small work runs inline: even a one-thread OpenMP region costs more than a small op.
  if (rows * row_len < (1 << 15)) {
    for (int64_t row = 0; row < rows; ++row) run(row, 0, row_len);
    return;
  }
  constexpr int64_t kPiece = 1 << 14;  // 64 KiB of fp32: long enough to stream, short enough to share
  const int64_t pieces = (row_len + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < rows * pieces; ++item) {
    const int64_t row = item / pieces, start = item % pieces * kPiece;
    run(row, start, std::min(kPiece, row_len - start));
  }
}

// Runs f.template operator()<T>() for a floating dtype (fp32 or fp64).
template <class F> void dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::F64: f(double{}); return;
    default: TALLY_FAIL(op, ": dtype ", dtype_name(t), " is not supported (expected float32 or float64)");
  }
}

// Runs body(In{}, T{}) with In = the storage type of `operand` and T = that of `result`
// and of the math: (float, float), (double, double), or (BFloat16, float) for mixed
// precision, whose bf16 operands are read as fp32 and whose results stay fp32.
template <class F> void dispatch_mixed(const Tensor& operand, const Tensor& result, const char* what, F&& body) {
  if (operand.dtype() == DType::BF16) {
    TALLY_CHECK(result.dtype() == DType::F32, what, ": a bf16 ", operand.str(), " needs fp32 results, got ", result.str());
    body(BFloat16{}, float{});
    return;
  }
  TALLY_CHECK(operand.dtype() == result.dtype(), what, ": ", operand.str(), " and ", result.str(), " differ in dtype");
  dispatch_floating(operand.dtype(), what, [&](auto tag) { body(tag, tag); });
}

// Runs f for any dtype tensor data can be converted from/to.
template <class F> void dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); return;
    case DType::F64: f(double{}); return;
    case DType::BF16: f(BFloat16{}); return;
    case DType::I32: f(int32_t{}); return;
    case DType::I64: f(int64_t{}); return;
    case DType::U16: f(uint16_t{}); return;
  }
}

template <class To, class From> inline To convert(From v) {
  if constexpr (std::is_same_v<To, BFloat16>) return BFloat16(static_cast<float>(v));
  else if constexpr (std::is_same_v<From, BFloat16>) return static_cast<To>(static_cast<float>(v));
  else return static_cast<To>(v);
}

}  // namespace tally::runtime::cpu
