// Elementwise kernels and reductions on CUDA: strided copies with dtype conversion and
// broadcasting, fills, binary ops, affine maps, in-place adds, sums over dimensions and
// the sum of squares. A walk over contiguous tensors skips the index arithmetic; any other
// layout maps each linear index to its offsets (StridedWalk).
#include <array>
#include <vector>

#include "runtime/cuda/device_math.cuh"
#include "runtime/cuda/kernels.h"

namespace tally::runtime::cuda {

namespace {

// ---------------------------------------------------------------- copy and fill

template <class D, class S>
__global__ void copy_kernel(D* dst, const S* src, int64_t n, StridedWalk<2> walk, bool linear) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (linear) {
      dst[i] = convert<D>(src[i]);
    } else {
      int64_t off[2];
      walk.offsets(i, off);
      dst[off[0]] = convert<D>(src[off[1]]);
    }
  }
}

// A contiguous copy with conversion, a pack per thread (n a multiple of kPack).
template <class D, class S> __global__ void copy_packed_kernel(D* dst, const S* src, int64_t packs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const Pack<S> in = reinterpret_cast<const Pack<S>*>(src)[i];
    Pack<D> out;
#pragma unroll
    for (int j = 0; j < kPack; ++j) out.v[j] = convert<D>(in.v[j]);
    reinterpret_cast<Pack<D>*>(dst)[i] = out;
  }
}

// A strided copy whose last dimension is contiguous on both sides (a head-major
// rearrangement, a slice of a fused projection): a pack of the last dimension per thread,
// the other dimensions' offsets found once per pack. `rows` walks the leading dimensions.
template <class D, class S>
__global__ void copy_rows_kernel(D* dst, const S* src, int64_t packs, int64_t packs_per_row, StridedWalk<2> rows) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / packs_per_row, col = (i - row * packs_per_row) * kPack;
    int64_t off[2];
    rows.offsets(row, off);
    const Pack<S> in = *reinterpret_cast<const Pack<S>*>(src + off[1] + col);
    Pack<D> out;
#pragma unroll
    for (int j = 0; j < kPack; ++j) out.v[j] = convert<D>(in.v[j]);
    *reinterpret_cast<Pack<D>*>(dst + off[0] + col) = out;
  }
}

template <class T> __global__ void fill_kernel(T* dst, T value, int64_t n, StridedWalk<1> walk, bool linear) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (linear) {
      dst[i] = value;
    } else {
      int64_t off[1];
      walk.offsets(i, off);
      dst[off[0]] = value;
    }
  }
}

// ---------------------------------------------------------------- binary, affine, add_

// The arithmetic of T, in fp32 for bf16 (rounded once), as the CPU does it.
template <class T> struct Arith {
  using type = T;
};
template <> struct Arith<bf16> {
  using type = float;
};

template <class T>
__global__ void binary_kernel(BinaryOp op, T* out, const T* a, const T* b, int64_t n, StridedWalk<3> walk, bool linear) {
  using A = typename Arith<T>::type;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[3] = {i, i, i};
    if (!linear) walk.offsets(i, off);
    const A x = convert<A>(a[off[1]]), y = convert<A>(b[off[2]]);
    A r;
    switch (op) {
      case BinaryOp::Add: r = x + y; break;
      case BinaryOp::Sub: r = x - y; break;
      case BinaryOp::Mul: r = x * y; break;
      default: r = x / y; break;
    }
    out[off[0]] = convert<T>(r);
  }
}

template <class T>
__global__ void binary_packed_kernel(BinaryOp op, T* out, const T* a, const T* b, int64_t packs) {
  using A = typename Arith<T>::type;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < packs; i += int64_t(gridDim.x) * blockDim.x) {
    const Pack<T> x = reinterpret_cast<const Pack<T>*>(a)[i], y = reinterpret_cast<const Pack<T>*>(b)[i];
    Pack<T> r;
#pragma unroll
    for (int j = 0; j < kPack; ++j) {
      const A u = convert<A>(x.v[j]), w = convert<A>(y.v[j]);
      r.v[j] = convert<T>(op == BinaryOp::Add ? u + w : op == BinaryOp::Sub ? u - w : op == BinaryOp::Mul ? u * w : u / w);
    }
    reinterpret_cast<Pack<T>*>(out)[i] = r;
  }
}

template <class T>
__global__ void affine_kernel(T* out, const T* x, double alpha, double beta, int64_t n, StridedWalk<2> walk,
                              bool linear) {
  using A = typename Arith<T>::type;
  const A a = static_cast<A>(alpha), b = static_cast<A>(beta);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2] = {i, i};
    if (!linear) walk.offsets(i, off);
    out[off[0]] = convert<T>(a * convert<A>(x[off[1]]) + b);
  }
}

template <class T>
__global__ void add_inplace_kernel(T* dst, const T* src, double alpha, int64_t n, StridedWalk<2> walk, bool linear) {
  using A = typename Arith<T>::type;
  const A a = static_cast<A>(alpha);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t off[2] = {i, i};
    if (!linear) walk.offsets(i, off);
    dst[off[0]] = convert<T>(convert<A>(dst[off[0]]) + a * convert<A>(src[off[1]]));
  }
}

// ---------------------------------------------------------------- reductions

// sum_into in two passes, deterministic (no atomics): x seen as (outer, reduced, inner)
// is not general enough (any set of dimensions may be reduced), so each output element's
// inputs are enumerated through two walks: `kept` maps an output index to x's offset of
// its first input, `reduced` maps a reduced index to the offset from there. Pass one
// sums each output's reduced range in `chunks` slices into partial[chunk][out]; pass two
// adds the slices in order. Consecutive threads take consecutive outputs, so a bias
// gradient ((N, C) -> (C)) reads rows of x coalesced.
template <class In, class Acc>
__global__ void sum_partial_kernel(Acc* partial, const In* x, int64_t n_out, int64_t n_reduced, int64_t per_chunk,
                                   StridedWalk<1> kept, StridedWalk<1> reduced) {
  const int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (o >= n_out) return;
  const int64_t chunk = blockIdx.y;
  int64_t base[1];
  kept.offsets(o, base);
  Acc s = 0;
  const int64_t end = min(n_reduced, (chunk + 1) * per_chunk);
  for (int64_t r = chunk * per_chunk; r < end; ++r) {
    int64_t off[1];
    reduced.offsets(r, off);
    s += static_cast<Acc>(to_float(x[base[0] + off[0]]));
  }
  partial[chunk * n_out + o] = s;
}

// The common case of sum_into: x contiguous, seen as (rows, cols), summed over rows (a
// bias's gradient). Thread per column and slice of rows: plain indexing, coalesced rows.
template <class In, class Acc>
__global__ void sum_rows_partial_kernel(Acc* partial, const In* x, int64_t rows, int64_t cols, int64_t per_chunk) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= cols) return;
  const int64_t chunk = blockIdx.y, end = min(rows, (chunk + 1) * per_chunk);
  Acc s = 0;
  for (int64_t r = chunk * per_chunk; r < end; ++r) s += static_cast<Acc>(to_float(x[r * cols + c]));
  partial[chunk * cols + c] = s;
}


// Per block a partial sum of squares in fp64 (each thread's own sum too): exact enough
// that the order of the blocks' sums does not show, and the host adds them in order.
template <class T> __global__ void sum_squares_kernel(double* partial, const T* x, int64_t n) {
  __shared__ double scratch[32];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double v = to_float(x[i]);
    s += v * v;
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
template <> __global__ void sum_squares_kernel(double* partial, const double* x, int64_t n) {
  __shared__ double scratch[32];
  double s = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    s += x[i] * x[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// max over the last dimension of a contiguous (rows, n) x: one block per row; ties take
// the first index, as the CPU does.
template <class T, class I>
__global__ void argmax_rows_kernel(T* values, I* indices, const T* x, int64_t n) {
  const T* row = x + blockIdx.x * n;
  // Each thread's first maximum (its indices rise), then the smallest index among equals. A
  // NaN is the maximum of a row holding one (its first, as in PyTorch and the CPU).
  float best = -INFINITY;
  int64_t at = n;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const float v = to_float(row[j]);
    if (at == n || v > best || (isnan(v) && !isnan(best))) best = v, at = j;
  }
  __shared__ float sv[1024];
  __shared__ int64_t si[1024];
  sv[threadIdx.x] = best;
  si[threadIdx.x] = at;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = sv[threadIdx.x + s];
      const int64_t oi = si[threadIdx.x + s];
      const float mv = sv[threadIdx.x];
      const int64_t mi = si[threadIdx.x];
      const bool other_nan = isnan(ov), mine_nan = isnan(mv);
      const bool other_wins = other_nan != mine_nan ? other_nan
                              : other_nan         ? oi < mi
                                                  : ov > mv || (ov == mv && oi < mi);
      if (other_wins) sv[threadIdx.x] = ov, si[threadIdx.x] = oi;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    if (values) values[blockIdx.x] = convert<T>(sv[0]);
    indices[blockIdx.x] = static_cast<I>(si[0]);
  }
}

Tensor scratch_tensor(int64_t numel, DType dtype, Device device, const char* owner) {
  return Tensor::empty({numel}, dtype, device, current_owner(owner));
}

}  // namespace

// ---------------------------------------------------------------- host entries

void copy(cudaStream_t stream, const Tensor& dst, const Tensor& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  std::array<Shape, 2> strides{dst.strides(), broadcast_strides_to(src, dst.shape())};
  const bool linear = all_contiguous<2>(dst.shape(), strides);
  if (linear && dst.dtype() == src.dtype()) {
    TALLY_CUDA_CHECK(cudaMemcpyAsync(dst.raw_data(), src.raw_data(), static_cast<size_t>(n) * dtype_size(dst.dtype()),
                                     cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const Shape& shape = dst.shape();
  const int64_t inner = shape.empty() ? 1 : shape.back();
  dispatch_all(dst.dtype(), [&](auto dtag) {
    using D = decltype(dtag);
    dispatch_all(src.dtype(), [&](auto stag) {
      using S = decltype(stag);
      D* d = static_cast<D*>(dst.raw_data());
      const S* s = static_cast<const S*>(src.raw_data());
      const bool aligned = pack_aligned<D>(d) && pack_aligned<S>(s);
      if (linear && aligned && n % kPack == 0) {
        copy_packed_kernel<D, S><<<pack_grid(n / kPack), 256, 0, stream>>>(d, s, n / kPack);
        TALLY_CUDA_LAUNCHED(copy_packed_kernel);
        return;
      }
      // Rows of whole packs: the last dimension contiguous on both sides, and every row
      // starting on a pack.
      bool rows_ok = aligned && shape.size() >= 2 && inner % kPack == 0 && strides[0].back() == 1 &&
                     strides[1].back() == 1;
      for (size_t k = 0; rows_ok && k < 2; ++k)
        for (size_t dim = 0; dim + 1 < shape.size(); ++dim) rows_ok = rows_ok && strides[k][dim] % kPack == 0;
      if (rows_ok) {
        const Shape outer(shape.begin(), shape.end() - 1);
        const std::array<Shape, 2> outer_strides{Shape(strides[0].begin(), strides[0].end() - 1),
                                                 Shape(strides[1].begin(), strides[1].end() - 1)};
        const int64_t packs = n / kPack;
        copy_rows_kernel<D, S><<<pack_grid(packs), 256, 0, stream>>>(d, s, packs, inner / kPack,
                                                                       make_walk<2>(outer, outer_strides));
        TALLY_CUDA_LAUNCHED(copy_rows_kernel);
        return;
      }
      const StridedWalk<2> walk = make_walk<2>(shape, strides);
      copy_kernel<D, S><<<grid_for(n), 256, 0, stream>>>(d, s, n, walk, linear);
      TALLY_CUDA_LAUNCHED(copy_kernel);
    });
  });
}

void fill(cudaStream_t stream, const Tensor& dst, double value) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  std::array<Shape, 1> strides{dst.strides()};
  const bool linear = all_contiguous<1>(dst.shape(), strides);
  const StridedWalk<1> walk = make_walk<1>(dst.shape(), strides);
  dispatch_all(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T v;
    if constexpr (std::is_same_v<T, bf16>) v = __float2bfloat16_rn(static_cast<float>(value));
    else v = static_cast<T>(value);
    fill_kernel<T><<<grid_for(n), 256, 0, stream>>>(static_cast<T*>(dst.raw_data()), v, n, walk, linear);
    TALLY_CUDA_LAUNCHED(fill_kernel);
  });
}

void binary(cudaStream_t stream, BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b) {
  TALLY_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), "elementwise op on ", a.str(), " and ", b.str(),
              ": dtypes differ");
  const int64_t n = out.numel();
  if (n == 0) return;
  std::array<Shape, 3> strides{out.strides(), broadcast_strides_to(a, out.shape()), broadcast_strides_to(b, out.shape())};
  const bool linear = all_contiguous<3>(out.shape(), strides);
  const StridedWalk<3> walk = make_walk<3>(out.shape(), strides);
  dispatch_floating(out, "elementwise op", [&](auto tag) {
    using T = decltype(tag);
    if (linear && n % kPack == 0 && pack_aligned<T>(out.raw_data()) && pack_aligned<T>(a.raw_data()) &&
        pack_aligned<T>(b.raw_data())) {
      binary_packed_kernel<T><<<pack_grid(n / kPack), 256, 0, stream>>>(
          op, static_cast<T*>(out.raw_data()), static_cast<const T*>(a.raw_data()), static_cast<const T*>(b.raw_data()),
          n / kPack);
      TALLY_CUDA_LAUNCHED(binary_packed_kernel);
      return;
    }
    binary_kernel<T><<<grid_for(n), 256, 0, stream>>>(op, static_cast<T*>(out.raw_data()),
                                                       static_cast<const T*>(a.raw_data()),
                                                       static_cast<const T*>(b.raw_data()), n, walk, linear);
    TALLY_CUDA_LAUNCHED(binary_kernel);
  });
}

void affine(cudaStream_t stream, const Tensor& out, const Tensor& x, double alpha, double beta) {
  TALLY_CHECK(out.dtype() == x.dtype(), "affine: ", out.str(), " and ", x.str(), " differ in dtype");
  const int64_t n = out.numel();
  if (n == 0) return;
  std::array<Shape, 2> strides{out.strides(), broadcast_strides_to(x, out.shape())};
  const bool linear = all_contiguous<2>(out.shape(), strides);
  const StridedWalk<2> walk = make_walk<2>(out.shape(), strides);
  dispatch_floating(out, "affine", [&](auto tag) {
    using T = decltype(tag);
    affine_kernel<T><<<grid_for(n), 256, 0, stream>>>(static_cast<T*>(out.raw_data()),
                                                       static_cast<const T*>(x.raw_data()), alpha, beta, n, walk, linear);
    TALLY_CUDA_LAUNCHED(affine_kernel);
  });
}

void add_inplace(cudaStream_t stream, const Tensor& dst, const Tensor& src, double alpha) {
  TALLY_CHECK(dst.dtype() == src.dtype(), "add_: dtypes differ: ", dst.str(), " += ", src.str());
  const int64_t n = dst.numel();
  if (n == 0) return;
  std::array<Shape, 2> strides{dst.strides(), broadcast_strides_to(src, dst.shape())};
  const bool linear = all_contiguous<2>(dst.shape(), strides);
  const StridedWalk<2> walk = make_walk<2>(dst.shape(), strides);
  dispatch_floating(dst, "add_", [&](auto tag) {
    using T = decltype(tag);
    add_inplace_kernel<T><<<grid_for(n), 256, 0, stream>>>(static_cast<T*>(dst.raw_data()),
                                                            static_cast<const T*>(src.raw_data()), alpha, n, walk, linear);
    TALLY_CUDA_LAUNCHED(add_inplace_kernel);
  });
}

void sum_into(cudaStream_t stream, const Tensor& out, const Tensor& x) {
  TALLY_CHECK(out.dim() == x.dim(), "sum_into: rank mismatch ", out.str(), " vs ", x.str());
  for (int64_t d = 0; d < x.dim(); ++d)
    TALLY_CHECK(out.shape()[d] == x.shape()[d] || out.shape()[d] == 1, "sum_into: ", out.str(), " is not ", x.str(),
                " with some dimensions reduced to 1");
  TALLY_CHECK(out.is_contiguous(), "sum_into: output must be contiguous");
  const int64_t n_out = out.numel();
  if (n_out == 0) return;
  // The kept dimensions walk the outputs; the reduced ones walk each output's inputs.
  Shape kept_shape, kept_strides, red_shape, red_strides;
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (out.shape()[d] == x.shape()[d]) kept_shape.push_back(x.shape()[d]), kept_strides.push_back(x.strides()[d]);
    else red_shape.push_back(x.shape()[d]), red_strides.push_back(x.strides()[d]);
  }
  if (kept_shape.empty()) kept_shape.push_back(1), kept_strides.push_back(0);
  if (red_shape.empty()) red_shape.push_back(1), red_strides.push_back(0);
  const int64_t n_reduced = shape_numel(red_shape);
  // Reduced dimensions all before the kept ones, in a contiguous x: rows of a matrix.
  bool leading_rows = x.is_contiguous();
  for (int64_t d = 0, seen_kept = 0; d < x.dim(); ++d) {
    const bool kept_dim = out.shape()[d] == x.shape()[d] && x.shape()[d] != 1;
    if (kept_dim) seen_kept = 1;
    else if (seen_kept && x.shape()[d] != 1) leading_rows = false;
  }
  const StridedWalk<1> kept = make_walk<1>(kept_shape, {kept_strides});
  const StridedWalk<1> reduced = make_walk<1>(red_shape, {red_strides});
  // Enough slices to fill the GPU when outputs are few, each at least 64 inputs long.
  const int64_t out_blocks = (n_out + 255) / 256;
  int64_t chunks = std::max<int64_t>(1, std::min<int64_t>((n_reduced + 63) / 64, std::max<int64_t>(1, 1024 / out_blocks)));
  chunks = std::min<int64_t>(chunks, 65535);
  const int64_t per_chunk = (n_reduced + chunks - 1) / chunks;
  chunks = (n_reduced + per_chunk - 1) / per_chunk;
  const bool fp64 = x.dtype() == DType::F64;
  Tensor partial = scratch_tensor(chunks * n_out, fp64 ? DType::F64 : DType::F32, x.device(), "sum_into_partial");
  dispatch_floating(x, "sum", [&](auto in_tag) {
    using In = decltype(in_tag);
    using Acc = std::conditional_t<std::is_same_v<In, double>, double, float>;
    const dim3 grid(static_cast<unsigned>(out_blocks), static_cast<unsigned>(chunks));
    if (leading_rows) {
      sum_rows_partial_kernel<In, Acc><<<grid, 256, 0, stream>>>(static_cast<Acc*>(partial.raw_data()),
                                                                  static_cast<const In*>(x.raw_data()), n_reduced,
                                                                  n_out, per_chunk);
      TALLY_CUDA_LAUNCHED(sum_rows_partial_kernel);
    } else {
      sum_partial_kernel<In, Acc><<<grid, 256, 0, stream>>>(static_cast<Acc*>(partial.raw_data()),
                                                             static_cast<const In*>(x.raw_data()), n_out, n_reduced,
                                                             per_chunk, kept, reduced);
      TALLY_CUDA_LAUNCHED(sum_partial_kernel);
    }
    dispatch_floating(out, "sum", [&](auto out_tag) {
      using Out = decltype(out_tag);
      launch_sum_slices<Acc, Out>(stream, static_cast<Out*>(out.raw_data()), static_cast<const Acc*>(partial.raw_data()),
                                  chunks, n_out);
    });
  });
}

double sum_squares(cudaStream_t stream, const Tensor& x) {
  const int64_t n = x.numel();
  if (n == 0) return 0.0;
  const Tensor dense_x = x.is_contiguous() ? x : [&] {
    Tensor d = Tensor::empty(x.shape(), x.dtype(), x.device(), current_owner("sum_squares_dense"));
    copy(stream, d, x);
    return d;
  }();
  const unsigned blocks = std::min<unsigned>(grid_for(n, 512), 1024);
  Tensor partial = scratch_tensor(blocks, DType::F64, x.device(), "sum_squares_partial");
  dispatch_floating(x, "sum of squares", [&](auto tag) {
    using T = decltype(tag);
    sum_squares_kernel<T><<<blocks, 512, 0, stream>>>(static_cast<double*>(partial.raw_data()),
                                                       static_cast<const T*>(dense_x.raw_data()), n);
    TALLY_CUDA_LAUNCHED(sum_squares_kernel);
  });
  std::vector<double> host(blocks);
  TALLY_CUDA_CHECK(cudaMemcpyAsync(host.data(), partial.raw_data(), blocks * sizeof(double), cudaMemcpyDeviceToHost, stream));
  TALLY_CUDA_CHECK(cudaStreamSynchronize(stream));
  double s = 0;
  for (double v : host) s += v;
  return s;
}

namespace {
void argmax_rows(cudaStream_t stream, const Tensor& values, const Tensor& indices, const Tensor& x, const char* op) {
  TALLY_CHECK(x.is_contiguous(), op, " on CUDA: ", x.str(), " must be contiguous");
  const int64_t n = x.shape().back(), rows = x.numel() / std::max<int64_t>(n, 1);
  if (rows == 0) return;
  TALLY_CHECK(indices.is_contiguous() && indices.numel() == rows, op, ": indices ", indices.str(), " for ", rows, " rows");
  TALLY_CHECK(!values.defined() || (values.is_contiguous() && values.dtype() == x.dtype()), op, ": values ",
              values.str());
  dispatch_training_float(x.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    T* pv = values.defined() ? static_cast<T*>(values.raw_data()) : nullptr;
    switch (indices.dtype()) {
      case DType::I64:
        argmax_rows_kernel<T, int64_t><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
            pv, static_cast<int64_t*>(indices.raw_data()), static_cast<const T*>(x.raw_data()), n);
        break;
      case DType::I32:
        argmax_rows_kernel<T, int32_t><<<static_cast<unsigned>(rows), 256, 0, stream>>>(
            pv, static_cast<int32_t*>(indices.raw_data()), static_cast<const T*>(x.raw_data()), n);
        break;
      default: TALLY_FAIL(op, ": indices must be int32 or int64, got ", indices.str());
    }
    TALLY_CUDA_LAUNCHED(argmax_rows_kernel);
  });
}
}  // namespace

void max_dim(cudaStream_t stream, const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim) {
  TALLY_CHECK(wrap_dim(dim, x.dim()) == x.dim() - 1, "max over dimension ", dim, " of ", x.str(),
              " on CUDA: only the last dimension is supported");
  argmax_rows(stream, values, indices, x, "max");
}

void argmax_last(cudaStream_t stream, const Tensor& out, const Tensor& x) {
  argmax_rows(stream, Tensor(), out, x, "argmax");
}

}  // namespace tally::runtime::cuda
