// The CUDA kernels behind the CUDA backend's typed entries (runtime/backend.h documents
// each entry's math). Each host function checks its tensors, launches on `stream` and
// returns without waiting; only the ones that return a number to the host synchronize.
// Tensors are device tensors of the backend's device, except where a comment says.
#pragma once
#include <cuda_runtime.h>

#include "core/tensor.h"
#include "runtime/backend.h"

namespace tally::runtime::cuda {

// ---- elementwise (elementwise.cu)
void copy(cudaStream_t stream, const Tensor& dst, const Tensor& src);  // both on the device: broadcast, convert
void fill(cudaStream_t stream, const Tensor& dst, double value);
void binary(cudaStream_t stream, BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);
void affine(cudaStream_t stream, const Tensor& out, const Tensor& x, double alpha, double beta);
void add_inplace(cudaStream_t stream, const Tensor& dst, const Tensor& src, double alpha);
void sum_into(cudaStream_t stream, const Tensor& out, const Tensor& x);
double sum_squares(cudaStream_t stream, const Tensor& x);  // synchronizes: the host gets the number
void max_dim(cudaStream_t stream, const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);
void argmax_last(cudaStream_t stream, const Tensor& out, const Tensor& x);

// ---- neural-network kernels (nn.cu)
void embedding_forward(cudaStream_t stream, const Tensor& out, const Tensor& weight, const Tensor& indices);
void embedding_backward(cudaStream_t stream, const Tensor& dweight, const Tensor& dout, const Tensor& indices);
void layernorm_forward(cudaStream_t stream, const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                       const Tensor& w, const Tensor& b, double eps);
void layernorm_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout,
                        const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd);
void gelu_forward(cudaStream_t stream, const Tensor& out, const Tensor& x);
void gelu_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dout, const Tensor& x);
void rmsnorm_forward(cudaStream_t stream, const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w,
                     double eps);
void rmsnorm_backward(cudaStream_t stream, const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x,
                      const Tensor& w, const Tensor& rstd);
void rotary(cudaStream_t stream, const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset,
            bool inverse);
void swiglu_forward(cudaStream_t stream, const Tensor& out, const Tensor& gate, const Tensor& up);
void swiglu_backward(cudaStream_t stream, const Tensor& dgate, const Tensor& dup, const Tensor& dout,
                     const Tensor& gate, const Tensor& up);
void cross_entropy_forward(cudaStream_t stream, const Tensor& losses, const Tensor& lse, const Tensor& logits,
                           const Tensor& targets, int64_t valid_vocab);
void cross_entropy_backward(cudaStream_t stream, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                            const Tensor& targets, int64_t valid_vocab, double scale);

// ---- the optimizer (nn.cu): AdamW over contiguous fp32 p, g, m, v (runtime/backend.h).
void adamw(cudaStream_t stream, const Tensor& p, const Tensor& g, const Tensor& m, const Tensor& v,
           const Tensor& p_compute, const AdamWScalars& k, bool zero_grad);

}  // namespace tally::runtime::cuda
