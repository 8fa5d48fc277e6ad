// The neural-network kernels on CUDA: embedding, LayerNorm and RMSNorm, GELU, SwiGLU,
// rotary embedding, softmax cross-entropy over the vocabulary, and AdamW. The math of each
// is the CPU kernel's (runtime/cpu/nn.cc, cross_entropy.cc, optim/adamw.cc), in the same
// precision: bf16 tensors are read as fp32, computed in fp32 and rounded once.
//
// Row kernels (norms, the loss) give each row a warp or a block; the weight gradients of
// the norms are column sums over rows, made deterministic as sum_into's are: slices of rows
// into a partial buffer, then the slices added in order.
#include <cmath>
#include <vector>

#include "runtime/cuda/device_math.cuh"
#include "runtime/cuda/kernels.h"

namespace tally::runtime::cuda {

namespace {

constexpr int kRowWarps = 8;  // rows per block of the warp-per-row kernels

void require_dense(const char* op, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts)
    TALLY_CHECK(!t->defined() || t->is_contiguous(), op, " on CUDA: ", t->str(), " must be contiguous");
}

template <class T> T* ptr(const Tensor& t) { return t.defined() ? static_cast<T*>(t.raw_data()) : nullptr; }

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kRowWarps - 1) / kRowWarps); }

// Indices read back to the host and checked: an index outside the table would read or
// write another tensor's memory. They are few (one per token) and the check costs one
// small copy at the start of the forward, where the queue is short.
void check_indices_on_host(const Tensor& indices, int64_t limit, const char* what, bool allow_negative) {
  const std::vector<int64_t> p = indices.to_vector<int64_t>();  // the backend's copy: converted, then waited for
  for (int64_t n = 0; n < indices.numel(); ++n)
    TALLY_CHECK((allow_negative || p[n] >= 0) && p[n] < limit, what, p[n], " at position ", n,
                " is out of range [0, ", limit, ")");
}

// ---------------------------------------------------------------- embedding

template <class T, class I>
__global__ void embedding_forward_kernel(T* out, const T* weight, const I* indices, int64_t N, int64_t C) {
  const int64_t total = N * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    out[i] = weight[static_cast<int64_t>(indices[n]) * C + c];
  }
}

// dweight[indices[n], :] += dout[n, :]. Rows that share an index add through atomics: the
// order of those adds (and so the last bits of a repeated token's gradient) may differ
// between runs, as PyTorch's CUDA embedding backward does by default.
template <class I>
__global__ void embedding_backward_kernel(float* dweight, const float* dout, const I* indices, int64_t N, int64_t C) {
  const int64_t total = N * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t n = i / C, c = i % C;
    atomicAdd(dweight + static_cast<int64_t>(indices[n]) * C + c, dout[i]);
  }
}

// ---------------------------------------------------------------- norms

// One warp per row: mean and rstd from two passes over the row (it stays in L1), then out.
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* x, const float* w,
                                         const float* b, int64_t N, int64_t C, float eps) {
  const int64_t n = blockIdx.x * int64_t(kRowWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const float* row = x + n * C;
  float s = 0;
  for (int64_t c = lane; c < C; c += 32) s += row[c];
  const float m = warp_sum(s) / static_cast<float>(C);
  float v = 0;
  for (int64_t c = lane; c < C; c += 32) v += (row[c] - m) * (row[c] - m);
  const float r = rsqrtf(warp_sum(v) / static_cast<float>(C) + eps);
  float* o = out + n * C;
  for (int64_t c = lane; c < C; c += 32) o[c] = (row[c] - m) * r * w[c] + (b ? b[c] : 0.f);
  if (lane == 0) mean[n] = m, rstd[n] = r;
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dout w, xhat = (x - mean) rstd.
// `mean` is null for RMSNorm (xhat = x rstd, and no mean(g) term).
__global__ void norm_backward_dx_kernel(float* dx, const float* dout, const float* x, const float* w,
                                        const float* mean, const float* rstd, int64_t N, int64_t C) {
  const int64_t n = blockIdx.x * int64_t(kRowWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const float* row = x + n * C;
  const float* g = dout + n * C;
  const float m = mean ? mean[n] : 0.f, r = rstd[n];
  float sg = 0, sgx = 0;
  for (int64_t c = lane; c < C; c += 32) {
    const float gw = g[c] * w[c];
    sg += gw;
    sgx += gw * (row[c] - m) * r;
  }
  const float mean_g = mean ? warp_sum(sg) / static_cast<float>(C) : 0.f;
  const float mean_gx = warp_sum(sgx) / static_cast<float>(C);
  float* d = dx + n * C;
  for (int64_t c = lane; c < C; c += 32) d[c] = r * (g[c] * w[c] - mean_g - (row[c] - m) * r * mean_gx);
}

// Column sums over a slice of rows: partial_w[slice][c] = sum dout xhat, partial_b = sum dout.
__global__ void norm_weight_grad_partial_kernel(float* partial_w, float* partial_b, const float* dout, const float* x,
                                                const float* mean, const float* rstd, int64_t N, int64_t C,
                                                int64_t rows_per_slice) {
  const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const int64_t slice = blockIdx.y, begin = slice * rows_per_slice, end = min(N, begin + rows_per_slice);
  float sw = 0, sb = 0;
  for (int64_t n = begin; n < end; ++n) {
    const float g = dout[n * C + c];
    sw += g * (x[n * C + c] - (mean ? mean[n] : 0.f)) * rstd[n];
    sb += g;
  }
  partial_w[slice * C + c] = sw;
  if (partial_b) partial_b[slice * C + c] = sb;
}


void norm_weight_grads(cudaStream_t stream, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                       const float* mean, const float* rstd, int64_t N, int64_t C) {
  if (!dw.defined() && !db.defined()) return;
  // Slices of 64 rows or more, enough of them to fill the GPU with C columns.
  const int64_t col_blocks = (C + 255) / 256;
  const int64_t slices = std::max<int64_t>(1, std::min<int64_t>((N + 63) / 64, std::max<int64_t>(1, 1024 / col_blocks)));
  const int64_t per = (N + slices - 1) / slices;
  Tensor pw = Tensor::empty({slices, C}, DType::F32, x.device(), current_owner("norm_dw_partial"));
  Tensor pb = db.defined() ? Tensor::empty({slices, C}, DType::F32, x.device(), current_owner("norm_db_partial")) : Tensor();
  norm_weight_grad_partial_kernel<<<dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(slices)), 256, 0,
                                    stream>>>(ptr<float>(pw), ptr<float>(pb), ptr<float>(dout), ptr<float>(x), mean,
                                              rstd, N, C, per);
  TALLY_CUDA_LAUNCHED(norm_weight_grad_partial_kernel);
  if (dw.defined()) {
    launch_sum_slices<float, float>(stream, ptr<float>(dw), ptr<float>(pw), slices, C);
  }
  if (db.defined()) {
    launch_sum_slices<float, float>(stream, ptr<float>(db), ptr<float>(pb), slices, C);
  }
}

__global__ void rmsnorm_forward_kernel(float* out, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                                       float eps) {
  const int64_t n = blockIdx.x * int64_t(kRowWarps) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (n >= N) return;
  const float* row = x + n * C;
  float s = 0;
  for (int64_t c = lane; c < C; c += 32) s += row[c] * row[c];
  const float r = rsqrtf(warp_sum(s) / static_cast<float>(C) + eps);
  float* o = out + n * C;
  for (int64_t c = lane; c < C; c += 32) o[c] = row[c] * r * w[c];
  if (lane == 0) rstd[n] = r;
}

// ---------------------------------------------------------------- GELU, SwiGLU, rotary

// GELU, tanh form: gelu(v) = 0.5 v (1 + t), t = tanh(s (v + 0.044715 v^3)), s = sqrt(2/pi);
// gelu'(v) = 0.5 (1 + t) + 0.5 v (1 - t^2) s (1 + 3 * 0.044715 v^2).
__device__ __forceinline__ float gelu_value(float v) {
  const float t = tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v));
  return 0.5f * v * (1.f + t);
}
__device__ __forceinline__ float gelu_slope(float v) {
  const float s = 0.7978845608028654f;
  const float t = tanhf(s * (v + 0.044715f * v * v * v));
  const float sech2 = 1.f - t * t;
  const float tail = sech2 == 0.f ? 0.f : 0.5f * v * sech2 * s * (1.f + 3.f * 0.044715f * v * v);
  return 0.5f * (1.f + t) + tail;
}

// A pack of 8 per thread (the caller has checked n and the alignment), else one element.
template <class T, bool kPacked> __global__ void gelu_forward_kernel(T* out, const T* x, int64_t n) {
  if constexpr (kPacked) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / kPack; i += int64_t(gridDim.x) * blockDim.x) {
      const Pack<T> in = reinterpret_cast<const Pack<T>*>(x)[i];
      Pack<T> r;
#pragma unroll
      for (int j = 0; j < kPack; ++j) r.v[j] = from_float<T>(gelu_value(to_float(in.v[j])));
      reinterpret_cast<Pack<T>*>(out)[i] = r;
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
      out[i] = from_float<T>(gelu_value(to_float(x[i])));
  }
}
template <class T, bool kPacked> __global__ void gelu_backward_kernel(T* dx, const T* dout, const T* x, int64_t n) {
  if constexpr (kPacked) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / kPack; i += int64_t(gridDim.x) * blockDim.x) {
      const Pack<T> xv = reinterpret_cast<const Pack<T>*>(x)[i], gv = reinterpret_cast<const Pack<T>*>(dout)[i];
      Pack<T> r;
#pragma unroll
      for (int j = 0; j < kPack; ++j) r.v[j] = from_float<T>(to_float(gv.v[j]) * gelu_slope(to_float(xv.v[j])));
      reinterpret_cast<Pack<T>*>(dx)[i] = r;
    }
  } else {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
      dx[i] = from_float<T>(to_float(dout[i]) * gelu_slope(to_float(x[i])));
  }
}
template <class T> bool packable(int64_t n, std::initializer_list<const Tensor*> ts) {
  if (n % kPack != 0) return false;
  for (const Tensor* t : ts)
    if (!pack_aligned<T>(t->raw_data())) return false;
  return true;
}

// SwiGLU: out = g s u, s = sigmoid(g); d/dg = u s (1 + g (1 - s)), d/du = g s.
template <class T> __global__ void swiglu_forward_kernel(T* out, const T* gate, const T* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(g / (1.f + expf(-g)) * to_float(up[i]));
  }
}
template <class T>
__global__ void swiglu_backward_kernel(T* dgate, T* dup, const T* dout, const T* gate, const T* up, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float g = to_float(gate[i]), u = to_float(up[i]), d = to_float(dout[i]);
    const float s = 1.f / (1.f + expf(-g));
    dgate[i] = from_float<T>(d * u * s * (1.f + g * (1.f - s)));
    dup[i] = from_float<T>(d * g * s);
  }
}

// Rotary embedding: the pair (x[2i], x[2i+1]) of every head at position offset + t is
// rotated by a = pos inv_freq[i] (by -a for the backward); the angle formed in fp32.
__global__ void rotary_kernel(float* out, const float* x, const float* inv_freq, int64_t B, int64_t T, int64_t H,
                              int64_t D, int64_t offset, float sign) {
  const int64_t half = D / 2, total = B * T * H * half;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = i % half, row = i / half;  // row = (b, t, h)
    const int64_t t = (row / H) % T;
    const float angle = static_cast<float>(offset + t) * inv_freq[p];
    float sn, cs;
    sincosf(angle, &sn, &cs);
    sn *= sign;
    const float re = x[row * D + 2 * p], im = x[row * D + 2 * p + 1];
    out[row * D + 2 * p] = re * cs - im * sn;
    out[row * D + 2 * p + 1] = re * sn + im * cs;
  }
}

// ---------------------------------------------------------------- cross-entropy

constexpr int kLossThreads = 512;

// One block per row: the row's max, then the sum of exp(x - max) (an online pair per thread,
// merged across the block), lse = max + log(sum). loss = lse - x[target] (0 for target < 0).
// With kPacked (rows of whole, aligned packs) a thread reads 8 logits at a time.
template <class In, class I, bool kPacked>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const In* logits, const I* targets, int64_t Vp,
                                             int64_t V) {
  __shared__ float scratch[32];
  const int64_t n = blockIdx.x;
  const In* row = logits + n * Vp;
  // A masked logit (-inf) adds 0, and is skipped: while m is still -inf, exp(v - m) would
  // be exp(-inf + inf), a NaN that the first finite value would not wash out.
  float m = -INFINITY, s = 0.f;
  auto add = [&](float v) {
    if (v == -INFINITY) return;
    if (v > m) s = s * expf(m - v) + 1.f, m = v;  // s is 0 while m is -inf
    else s += expf(v - m);
  };
  if constexpr (kPacked) {
    const int64_t full = V / kPack;  // packs wholly inside the vocabulary; the tail one by one
    for (int64_t p = threadIdx.x; p < full; p += blockDim.x) {
      const Pack<In> x = reinterpret_cast<const Pack<In>*>(row)[p];
      float pm = to_float(x.v[0]);
#pragma unroll
      for (int j = 1; j < kPack; ++j) pm = fmaxf(pm, to_float(x.v[j]));
      if (pm == -INFINITY) continue;  // a wholly masked pack adds 0
      if (pm > m) s *= expf(m - pm), m = pm;
      float ps = 0.f;
#pragma unroll
      for (int j = 0; j < kPack; ++j) ps += expf(to_float(x.v[j]) - m);
      s += ps;
    }
    for (int64_t j = full * kPack + threadIdx.x; j < V; j += blockDim.x) add(to_float(row[j]));
  } else {
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) add(to_float(row[j]));
  }
  const float row_max = block_max(m, scratch);
  s = m == -INFINITY ? 0.f : s * expf(m - row_max);
  const float total = block_sum(s, scratch);
  if (threadIdx.x == 0) {
    const float l = row_max + logf(total);
    lse[n] = l;
    const int64_t t = static_cast<int64_t>(targets[n]);
    losses[n] = t < 0 ? 0.f : l - to_float(row[t]);
  }
}

// dlogits[n, j] = scale (exp(x_j - lse) - [j == target]) for j < V, 0 for padding columns
// (and for a row without target). dlogits may be the logits: each element is read by the
// thread that writes it, the target's value read before any write (a barrier between).
template <class In, class I, bool kPacked>
__global__ void cross_entropy_backward_kernel(In* dlogits, const In* logits, const float* lse, const I* targets,
                                              int64_t Vp, int64_t V, float scale) {
  const int64_t n = blockIdx.x;
  const In* row = logits + n * Vp;
  In* d = dlogits + n * Vp;
  const int64_t t = static_cast<int64_t>(targets[n]);
  const float l = lse[n];
  const float target_value = t >= 0 ? to_float(row[t]) : 0.f;
  __syncthreads();
  auto grad = [&](int64_t j, float x) {
    if (t < 0 || j >= V) return 0.f;
    return j == t ? scale * expf(target_value - l) - scale : scale * expf(x - l);
  };
  if constexpr (kPacked) {
    for (int64_t p = threadIdx.x; p < Vp / kPack; p += blockDim.x) {
      const Pack<In> x = reinterpret_cast<const Pack<In>*>(row)[p];
      Pack<In> g;
#pragma unroll
      for (int j = 0; j < kPack; ++j) g.v[j] = from_float<In>(grad(p * kPack + j, to_float(x.v[j])));
      reinterpret_cast<Pack<In>*>(d)[p] = g;
    }
  } else {
    for (int64_t j = threadIdx.x; j < Vp; j += blockDim.x) d[j] = from_float<In>(grad(j, to_float(row[j])));
  }
}

// ---------------------------------------------------------------- AdamW

__device__ __forceinline__ float adamw_element(float& p, float g, float& m, float& v, const AdamWScalars& k) {
  const float gj = g * k.grad_scale;
  m = k.beta1 * m + (1.f - k.beta1) * gj;
  v = k.beta2 * v + (1.f - k.beta2) * gj * gj;
  p = p * k.keep - k.step_size * m / (sqrtf(v) * k.inv_bc2_sqrt + k.eps);
  return p;
}

// The update is memory-bound (28-30 bytes a parameter): packs of 8 when every block is
// aligned to one and n is a multiple of 8, else one element a thread.
template <bool kPacked>
__global__ void adamw_kernel(float* p, float* g, float* m, float* v, int64_t n, AdamWScalars k, bool zero_grad,
                             bf16* p_bf16) {
  if constexpr (kPacked) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n / kPack; i += int64_t(gridDim.x) * blockDim.x) {
      Pack<float> pp = reinterpret_cast<Pack<float>*>(p)[i], mm = reinterpret_cast<Pack<float>*>(m)[i],
                  vv = reinterpret_cast<Pack<float>*>(v)[i];
      const Pack<float> gg = reinterpret_cast<const Pack<float>*>(g)[i];
      Pack<bf16> pb;
#pragma unroll
      for (int j = 0; j < kPack; ++j) pb.v[j] = __float2bfloat16_rn(adamw_element(pp.v[j], gg.v[j], mm.v[j], vv.v[j], k));
      reinterpret_cast<Pack<float>*>(p)[i] = pp;
      reinterpret_cast<Pack<float>*>(m)[i] = mm;
      reinterpret_cast<Pack<float>*>(v)[i] = vv;
      if (p_bf16) reinterpret_cast<Pack<bf16>*>(p_bf16)[i] = pb;
      if (zero_grad) reinterpret_cast<Pack<float>*>(g)[i] = Pack<float>{};
    }
  } else {
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < n; j += int64_t(gridDim.x) * blockDim.x) {
      const float pj = adamw_element(p[j], g[j], m[j], v[j], k);
      if (p_bf16) p_bf16[j] = __float2bfloat16_rn(pj);
      if (zero_grad) g[j] = 0.f;
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- host entries

void embedding_forward(cudaStream_t stream, const Tensor& out, const Tensor& weight, const Tensor& indices) {
  require_dense("embedding", {&out, &weight, &indices});
  TALLY_CHECK(weight.dtype() == DType::F32 && out.dtype() == DType::F32, "embedding on CUDA: expected float32, got ",
              weight.str(), " -> ", out.str());
  const int64_t N = indices.numel(), V = weight.shape()[0], C = weight.shape()[1];
  if (N == 0) return;
  check_indices_on_host(indices, V, "embedding: index ", false);
  dispatch_index(indices, "embedding", [&](auto idx) {
    using I = std::remove_cv_t<std::remove_pointer_t<decltype(idx)>>;
    embedding_forward_kernel<float, I><<<grid_for(N * C), 256, 0, stream>>>(ptr<float>(out), ptr<float>(weight), idx,
                                                                             N, C);
    TALLY_CUDA_LAUNCHED(embedding_forward_kernel);
  });
}

void embedding_backward(cudaStream_t stream, const Tensor& dweight, const Tensor& dout, const Tensor& indices) {
  require_dense("embedding backward", {&dweight, &dout, &indices});
  TALLY_CHECK(dweight.dtype() == DType::F32 && dout.dtype() == DType::F32,
              "embedding backward on CUDA: expected float32, got ", dout.str(), " -> ", dweight.str());
  const int64_t N = indices.numel(), C = dweight.shape()[1];
  if (N == 0) return;
  dispatch_index(indices, "embedding backward", [&](auto idx) {
    using I = std::remove_cv_t<std::remove_pointer_t<decltype(idx)>>;
    embedding_backward_kernel<I><<<grid_for(N * C), 256, 0, stream>>>(ptr<float>(dweight), ptr<float>(dout), idx, N, C);
    TALLY_CUDA_LAUNCHED(embedding_backward_kernel);
  });
}

void layernorm_forward(cudaStream_t stream, const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& w, const Tensor& b, double eps) {
  require_dense("layernorm", {&out, &mean, &rstd, &x, &w, &b});
  TALLY_CHECK(x.dtype() == DType::F32, "layernorm on CUDA: expected float32, got ", x.str());
  const int64_t C = x.shape().back(), N = x.numel() / C;
  if (N == 0) return;
  layernorm_forward_kernel<<<row_blocks(N), 32 * kRowWarps, 0, stream>>>(
      ptr<float>(out), ptr<float>(mean), ptr<float>(rstd), ptr<float>(x), ptr<float>(w), ptr<float>(b), N, C,
      static_cast<float>(eps));
  TALLY_CUDA_LAUNCHED(layernorm_forward_kernel);
}

void layernorm_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd) {
  require_dense("layernorm backward", {&dx, &dw, &db, &dout, &x, &w, &mean, &rstd});
  TALLY_CHECK(x.dtype() == DType::F32, "layernorm backward on CUDA: expected float32, got ", x.str());
  const int64_t C = x.shape().back(), N = x.numel() / C;
  if (N == 0) return;
  if (dx.defined()) {
    norm_backward_dx_kernel<<<row_blocks(N), 32 * kRowWarps, 0, stream>>>(
        ptr<float>(dx), ptr<float>(dout), ptr<float>(x), ptr<float>(w), ptr<float>(mean), ptr<float>(rstd), N, C);
    TALLY_CUDA_LAUNCHED(norm_backward_dx_kernel);
  }
  norm_weight_grads(stream, dw, db, dout, x, ptr<float>(mean), ptr<float>(rstd), N, C);
}

void rmsnorm_forward(cudaStream_t stream, const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     double eps) {
  require_dense("rmsnorm", {&out, &rstd, &x, &w});
  TALLY_CHECK(x.dtype() == DType::F32, "rmsnorm on CUDA: expected float32, got ", x.str());
  const int64_t C = x.shape().back(), N = x.numel() / C;
  if (N == 0) return;
  rmsnorm_forward_kernel<<<row_blocks(N), 32 * kRowWarps, 0, stream>>>(ptr<float>(out), ptr<float>(rstd),
                                                                       ptr<float>(x), ptr<float>(w), N, C,
                                                                       static_cast<float>(eps));
  TALLY_CUDA_LAUNCHED(rmsnorm_forward_kernel);
}

void rmsnorm_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                      const Tensor& w, const Tensor& rstd) {
  require_dense("rmsnorm backward", {&dx, &dw, &dout, &x, &w, &rstd});
  TALLY_CHECK(x.dtype() == DType::F32, "rmsnorm backward on CUDA: expected float32, got ", x.str());
  const int64_t C = x.shape().back(), N = x.numel() / C;
  if (N == 0) return;
  if (dx.defined()) {
    norm_backward_dx_kernel<<<row_blocks(N), 32 * kRowWarps, 0, stream>>>(ptr<float>(dx), ptr<float>(dout),
                                                                          ptr<float>(x), ptr<float>(w), nullptr,
                                                                          ptr<float>(rstd), N, C);
    TALLY_CUDA_LAUNCHED(norm_backward_dx_kernel);
  }
  norm_weight_grads(stream, dw, Tensor(), dout, x, nullptr, ptr<float>(rstd), N, C);
}

void gelu_forward(cudaStream_t stream, const Tensor& out, const Tensor& x) {
  require_dense("gelu", {&out, &x});
  TALLY_CHECK(out.dtype() == x.dtype(), "gelu: output ", out.str(), " and input ", x.str(), " differ in dtype");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_training_float(x.dtype(), "gelu", [&](auto tag) {
    using T = decltype(tag);
    if (packable<T>(n, {&out, &x})) gelu_forward_kernel<T, true><<<pack_grid(n / kPack), 256, 0, stream>>>(ptr<T>(out), ptr<T>(x), n);
    else gelu_forward_kernel<T, false><<<grid_for(n), 256, 0, stream>>>(ptr<T>(out), ptr<T>(x), n);
    TALLY_CUDA_LAUNCHED(gelu_forward_kernel);
  });
}

void gelu_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dout, const Tensor& x) {
  require_dense("gelu backward", {&dx, &dout, &x});
  TALLY_CHECK(dx.dtype() == x.dtype() && dout.dtype() == x.dtype(), "gelu backward: gradient ", dout.str(),
              " and input ", x.str(), " differ in dtype");
  const int64_t n = x.numel();
  if (n == 0) return;
  dispatch_training_float(x.dtype(), "gelu backward", [&](auto tag) {
    using T = decltype(tag);
    if (packable<T>(n, {&dx, &dout, &x}))
      gelu_backward_kernel<T, true><<<pack_grid(n / kPack), 256, 0, stream>>>(ptr<T>(dx), ptr<T>(dout), ptr<T>(x), n);
    else gelu_backward_kernel<T, false><<<grid_for(n), 256, 0, stream>>>(ptr<T>(dx), ptr<T>(dout), ptr<T>(x), n);
    TALLY_CUDA_LAUNCHED(gelu_backward_kernel);
  });
}

void swiglu_forward(cudaStream_t stream, const Tensor& out, const Tensor& gate, const Tensor& up) {
  require_dense("swiglu", {&out, &gate, &up});
  TALLY_CHECK(gate.dtype() == up.dtype() && gate.dtype() == out.dtype(), "swiglu: ", gate.str(), ", ", up.str(),
              " and ", out.str(), " differ in dtype");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_training_float(gate.dtype(), "swiglu", [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_kernel<T><<<grid_for(n), 256, 0, stream>>>(ptr<T>(out), ptr<T>(gate), ptr<T>(up), n);
    TALLY_CUDA_LAUNCHED(swiglu_forward_kernel);
  });
}

void swiglu_backward(cudaStream_t stream, const Tensor& dgate, const Tensor& dup, const Tensor& dout,
                     const Tensor& gate, const Tensor& up) {
  require_dense("swiglu backward", {&dgate, &dup, &dout, &gate, &up});
  for (const Tensor* t : {&dgate, &dup, &dout, &up})
    TALLY_CHECK(t->dtype() == gate.dtype(), "swiglu backward: ", t->str(), " and ", gate.str(), " differ in dtype");
  const int64_t n = gate.numel();
  if (n == 0) return;
  dispatch_training_float(gate.dtype(), "swiglu backward", [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_kernel<T><<<grid_for(n), 256, 0, stream>>>(ptr<T>(dgate), ptr<T>(dup), ptr<T>(dout), ptr<T>(gate),
                                                                ptr<T>(up), n);
    TALLY_CUDA_LAUNCHED(swiglu_backward_kernel);
  });
}

void rotary(cudaStream_t stream, const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset,
            bool inverse) {
  require_dense("rotary", {&out, &x, &inv_freq});
  TALLY_CHECK(x.dtype() == DType::F32 && inv_freq.dtype() == DType::F32, "rotary on CUDA: expected float32, got ",
              x.str(), " and ", inv_freq.str());
  const int64_t B = x.shape()[0], T = x.shape()[1], H = x.shape()[2], D = x.shape()[3];
  const int64_t n = B * T * H * (D / 2);
  if (n == 0) return;
  rotary_kernel<<<grid_for(n), 256, 0, stream>>>(ptr<float>(out), ptr<float>(x), ptr<float>(inv_freq), B, T, H, D,
                                                 offset, inverse ? -1.f : 1.f);
  TALLY_CUDA_LAUNCHED(rotary_kernel);
}

void cross_entropy_forward(cudaStream_t stream, const Tensor& losses, const Tensor& lse, const Tensor& logits,
                           const Tensor& targets, int64_t V) {
  require_dense("cross_entropy", {&losses, &lse, &logits, &targets});
  TALLY_CHECK(losses.dtype() == DType::F32 && lse.dtype() == DType::F32, "cross_entropy on CUDA: losses and lse ",
              "must be float32, got ", losses.str(), " and ", lse.str());
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  if (N == 0) return;
  check_indices_on_host(targets, V, "cross_entropy: target ", true);
  dispatch_training_float(logits.dtype(), "cross_entropy", [&](auto tag) {
    using In = decltype(tag);
    dispatch_index(targets, "cross_entropy", [&](auto tp) {
      using I = std::remove_cv_t<std::remove_pointer_t<decltype(tp)>>;
      if (Vp % kPack == 0 && pack_aligned<In>(logits.raw_data()))
        cross_entropy_forward_kernel<In, I, true><<<static_cast<unsigned>(N), kLossThreads, 0, stream>>>(
            ptr<float>(losses), ptr<float>(lse), ptr<In>(logits), tp, Vp, V);
      else
        cross_entropy_forward_kernel<In, I, false><<<static_cast<unsigned>(N), kLossThreads, 0, stream>>>(
            ptr<float>(losses), ptr<float>(lse), ptr<In>(logits), tp, Vp, V);
      TALLY_CUDA_LAUNCHED(cross_entropy_forward_kernel);
    });
  });
}

void cross_entropy_backward(cudaStream_t stream, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, int64_t V, double scale) {
  require_dense("cross_entropy backward", {&dlogits, &logits, &lse, &targets});
  TALLY_CHECK(dlogits.dtype() == logits.dtype(), "cross_entropy backward: the gradient ", dlogits.str(),
              " must have the logits' dtype (", dtype_name(logits.dtype()), ")");
  const int64_t N = logits.shape()[0], Vp = logits.shape()[1];
  if (N == 0) return;
  dispatch_training_float(logits.dtype(), "cross_entropy backward", [&](auto tag) {
    using In = decltype(tag);
    dispatch_index(targets, "cross_entropy backward", [&](auto tp) {
      using I = std::remove_cv_t<std::remove_pointer_t<decltype(tp)>>;
      if (Vp % kPack == 0 && pack_aligned<In>(logits.raw_data()) && pack_aligned<In>(dlogits.raw_data()))
        cross_entropy_backward_kernel<In, I, true><<<static_cast<unsigned>(N), kLossThreads, 0, stream>>>(
            ptr<In>(dlogits), ptr<In>(logits), ptr<float>(lse), tp, Vp, V, static_cast<float>(scale));
      else
        cross_entropy_backward_kernel<In, I, false><<<static_cast<unsigned>(N), kLossThreads, 0, stream>>>(
            ptr<In>(dlogits), ptr<In>(logits), ptr<float>(lse), tp, Vp, V, static_cast<float>(scale));
      TALLY_CUDA_LAUNCHED(cross_entropy_backward_kernel);
    });
  });
}

void adamw(cudaStream_t stream, const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
           const Tensor& p_compute, const AdamWScalars& k, bool zero_grad) {
  require_dense("adamw", {&p, &g, &m, &v, &p_compute});
  for (const Tensor* t : {&g, &m, &v})
    TALLY_CHECK(t->dtype() == DType::F32 && t->numel() == p.numel() && p.dtype() == DType::F32,
                "adamw on CUDA: expected float32 tensors of ", p.numel(), " values, got ", t->str());
  TALLY_CHECK(!p_compute.defined() || (p_compute.dtype() == DType::BF16 && p_compute.numel() == p.numel()),
              "adamw on CUDA: the compute copy ", p_compute.str(), " must be bfloat16 of ", p.numel(), " values");
  const int64_t n = p.numel();
  if (n == 0) return;
  if (packable<float>(n, {&p, &g, &m, &v}) && (!p_compute.defined() || pack_aligned<bf16>(p_compute.raw_data())))
    adamw_kernel<true><<<pack_grid(n / kPack), 256, 0, stream>>>(ptr<float>(p), ptr<float>(g), ptr<float>(m),
                                                                 ptr<float>(v), n, k, zero_grad, ptr<bf16>(p_compute));
  else
    adamw_kernel<false><<<grid_for(n), 256, 0, stream>>>(ptr<float>(p), ptr<float>(g), ptr<float>(m), ptr<float>(v), n,
                                                         k, zero_grad, ptr<bf16>(p_compute));
  TALLY_CUDA_LAUNCHED(adamw_kernel);
}

}  // namespace tally::runtime::cuda
