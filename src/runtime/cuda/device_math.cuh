// Device-side helpers shared by the CUDA kernels: element types, conversions, strided
// indexing and block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"
#include "runtime/cuda/cuda_check.h"

namespace tally::runtime::cuda {

// ---- element types: the device type of each DType, and conversions through fp32 (bf16)
// or fp64 (everything else, which keeps int64 and fp64 exact).
using bf16 = __nv_bfloat16;

template <class T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

template <class D, class S> __device__ __forceinline__ D convert(S v) {
  if constexpr (std::is_same_v<D, S>) return v;
  else if constexpr (std::is_same_v<D, bf16>) return __float2bfloat16_rn(to_float(v));  // nearest even, as the CPU
  else if constexpr (std::is_same_v<S, bf16>) return static_cast<D>(__bfloat162float(v));
  else return static_cast<D>(v);
}
template <class T> __device__ __forceinline__ T from_float(float v) { return convert<T>(v); }

// Calls f(T{}) with T the device type of `dtype`.
template <class F> void dispatch_all(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(bf16{});
    case DType::F64: return f(double{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    case DType::U16: return f(uint16_t{});
  }
  TALLY_FAIL("CUDA: unknown dtype");
}
// fp32, bf16 and fp64: the elementwise kernels and sums (integers refused, naming the op).
template <class F> void dispatch_floating(const Tensor& t, const char* op, F&& f) {
  switch (t.dtype()) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(bf16{});
    case DType::F64: return f(double{});
    default: TALLY_FAIL(op, " on CUDA: ", t.str(), " is not floating point");
  }
}
// fp32 and bf16: what the training kernels take (fp64 is the CPU's gradient-check type).
template <class F> void dispatch_training_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::F32: return f(float{});
    case DType::BF16: return f(bf16{});
    default: TALLY_FAIL(op, " on CUDA: expected float32 or bfloat16, got ", dtype_name(dtype));
  }
}
template <class F> void dispatch_index(const Tensor& t, const char* op, F&& f) {
  switch (t.dtype()) {
    case DType::I32: return f(static_cast<const int32_t*>(t.raw_data()));
    case DType::I64: return f(static_cast<const int64_t*>(t.raw_data()));
    case DType::U16: return f(static_cast<const uint16_t*>(t.raw_data()));
    default: TALLY_FAIL(op, ": indices must be integers, got ", t.str());
  }
}

// ---- strided indexing: up to kMaxDims dimensions, `K` tensors walked together over one
// shape. A linear index over the shape (row-major) maps to each tensor's element offset.
constexpr int kMaxDims = 8;
template <int K> struct StridedWalk {
  int rank;
  bool small;  // the shape has fewer than 2^31 elements: 32-bit division (64-bit is a long call)
  int64_t shape[kMaxDims];
  int64_t strides[K][kMaxDims];
  __device__ __forceinline__ void offsets(int64_t linear, int64_t (&off)[K]) const {
#pragma unroll
    for (int k = 0; k < K; ++k) off[k] = 0;
    if (small) {
      uint32_t rest = static_cast<uint32_t>(linear);
      for (int d = rank - 1; d >= 0; --d) {
        const uint32_t n = static_cast<uint32_t>(shape[d]);
        const uint32_t i = rest % n;
        rest /= n;
#pragma unroll
        for (int k = 0; k < K; ++k) off[k] += static_cast<int64_t>(i) * strides[k][d];
      }
      return;
    }
    for (int d = rank - 1; d >= 0; --d) {
      const int64_t i = linear % shape[d];
      linear /= shape[d];
#pragma unroll
      for (int k = 0; k < K; ++k) off[k] += i * strides[k][d];
    }
  }
};

// Strides of `t` broadcast to `shape` (aligned at the right; 0 where t has size 1 or no
// such dimension), as the CPU's elementwise kernels read them.
inline Shape broadcast_strides_to(const Tensor& t, const Shape& shape) {
  const int64_t r = static_cast<int64_t>(shape.size()), tr = t.dim();
  TALLY_CHECK(tr <= r, "broadcast: ", t.str(), " has more dimensions than ", shape_str(shape));
  Shape s(static_cast<size_t>(r), 0);
  for (int64_t d = 0; d < tr; ++d) {
    const int64_t sd = r - tr + d;
    const int64_t n = t.shape()[d];
    TALLY_CHECK(n == shape[sd] || n == 1, "broadcast: ", t.str(), " does not broadcast to ", shape_str(shape));
    s[sd] = n == 1 ? 0 : t.strides()[d];
  }
  return s;
}

template <int K> StridedWalk<K> make_walk(const Shape& shape, const std::array<Shape, K>& strides) {
  TALLY_CHECK(static_cast<int>(shape.size()) <= kMaxDims, "CUDA kernels take at most ", kMaxDims, " dimensions, got ",
              shape_str(shape));
  StridedWalk<K> w{};
  w.rank = static_cast<int>(shape.size());
  w.small = shape_numel(shape) < (int64_t{1} << 31);
  for (int d = 0; d < w.rank; ++d) {
    w.shape[d] = shape[d];
    for (int k = 0; k < K; ++k) w.strides[k][d] = strides[k][d];
  }
  return w;
}

// Whether every stride set is the contiguous layout of `shape` (a linear walk).
template <int K> bool all_contiguous(const Shape& shape, const std::array<Shape, K>& strides) {
  const Shape c = contiguous_strides(shape);
  for (int k = 0; k < K; ++k)
    for (size_t d = 0; d < shape.size(); ++d)
      if (shape[d] != 1 && strides[k][d] != c[d]) return false;
  return true;
}

// A grid that covers n items with `threads` per block, capped (the kernels grid-stride).
inline unsigned grid_for(int64_t n, int threads = 256) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 65535 * 8 ? 65535 * 8 : blocks));
}

// ---- reductions within a block (blockDim.x a multiple of 32, at most 1024).
template <class T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class T> __device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The block's sum, returned to every thread. `scratch` holds 32 values.
template <class T> __device__ __forceinline__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read from an earlier call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : T(0);
  return warp_sum(v);
}
template <class T> __device__ __forceinline__ T block_max(T v, T* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : T(-INFINITY);
  return warp_max(v);
}

}  // namespace tally::runtime::cuda

namespace tally::runtime::cuda {

// ---- packs: 8 consecutive elements moved as one (16 bytes of bf16, 32 of fp32), so a
// warp's loads and stores are whole 128-bit transactions. Memory-bound kernels over
// contiguous tensors use them when every pointer is aligned to a pack.
constexpr int kPack = 8;
template <class T> struct alignas(sizeof(T) * kPack) Pack {
  T v[kPack];
};
template <class T> inline bool pack_aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kPack) == 0;
}
inline unsigned pack_grid(int64_t packs, int threads = 256) { return grid_for(packs, threads); }

}  // namespace tally::runtime::cuda

namespace tally::runtime::cuda {

// out[c] = sum over k of partial[k][c] (slices x cols): the second pass of the deterministic
// column sums (sum_into, the norms' weight gradients). A block takes 32 columns; its 16
// rows of threads each add every 16th slice, then one thread adds the 16 sums in order, so
// the result does not depend on timing. (A thread per column adding all slices in turn
// would leave the GPU with a few hundred threads each waiting on hundreds of dependent loads.)
constexpr int kSliceLanes = 16;
template <class Acc, class Out>
__global__ void sum_slices_kernel(Out* out, const Acc* partial, int64_t slices, int64_t cols) {
  __shared__ Acc lanes[kSliceLanes][33];
  const int64_t c = blockIdx.x * int64_t(32) + threadIdx.x;
  Acc s = 0;
  if (c < cols)
    for (int64_t k = threadIdx.y; k < slices; k += kSliceLanes) s += partial[k * cols + c];
  lanes[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    Acc total = 0;
#pragma unroll
    for (int l = 0; l < kSliceLanes; ++l) total += lanes[l][threadIdx.x];
    out[c] = convert<Out>(total);
  }
}
template <class Acc, class Out>
void launch_sum_slices(cudaStream_t stream, Out* out, const Acc* partial, int64_t slices, int64_t cols) {
  sum_slices_kernel<Acc, Out><<<static_cast<unsigned>((cols + 31) / 32), dim3(32, kSliceLanes), 0, stream>>>(
      out, partial, slices, cols);
  TALLY_CUDA_LAUNCHED(sum_slices_kernel);
}

}  // namespace tally::runtime::cuda
