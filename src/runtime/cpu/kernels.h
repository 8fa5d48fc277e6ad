// The CPU kernels: plain functions behind the CPU backend's typed entries
// (runtime/backend.h documents each). They write into preallocated outputs and know
// nothing of autograd. OpenMP threads them; oneDNN runs the GEMMs.
#pragma once
#include <vector>

#include "core/tensor.h"
#include "runtime/backend.h"

namespace tally::runtime::cpu {

// ---- elementwise (elementwise.cc)
void copy(const Tensor& dst, const Tensor& src);  // broadcasts src to dst's shape, converts dtype
// `t` itself when contiguous (or undefined), else a contiguous copy. Records no graph.
Tensor dense(const Tensor& t);
void fill(const Tensor& dst, double value);
void binary(BinaryOp op, const Tensor& out, const Tensor& a, const Tensor& b);  // out contiguous
void affine(const Tensor& out, const Tensor& x, double alpha, double beta);     // out = alpha*x + beta
void add_inplace(const Tensor& dst, const Tensor& src, double alpha = 1.0);     // dst += alpha*src
// Reduces x into out, where out.shape has x's rank with 1 on every reduced dimension.
void sum_into(const Tensor& out, const Tensor& x);
void max_dim(const Tensor& values, const Tensor& indices, const Tensor& x, int64_t dim);
void argmax_last(const Tensor& out, const Tensor& x);
double sum_squares(const Tensor& x);

// ---- GEMM (matmul.cc). C = alpha * op(A) @ op(B) + beta * C (+ bias in every row) for
// 2-D strided views; fp32 and bf16 through oneDNN, fp64 with a plain loop. A bias needs
// alpha 1, beta 0 and gemm_adds_bias.
void gemm(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c, float alpha = 1.f,
          float beta = 0.f, const Tensor& bias = Tensor());
// Whether gemm() adds this bias inside the GEMM: oneDNN's matmul primitive runs it and the
// bias is a contiguous vector in C's dtype (or fp32, for bf16 operands). Elsewhere (sgemm, the fp64 loop, a bias to
// convert) the caller writes the bias into C first and accumulates onto it.
bool gemm_adds_bias(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, const Tensor& c,
                    const Tensor& bias);
// The operands gemm() copies dense before it multiplies (each a gemm_copy the size of the
// operand, alive until it returns): a strided view, or one oneDNN's inner product does not
// take. What a dry run on the meta device allocates in their place.
std::vector<Tensor> gemm_dense_copies(const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                                      const Tensor& c, float alpha, float beta, const Tensor& bias);
// C (m x n, row-major, fp32) = alpha op(A) op(B) + beta C for row-major bf16 tiles, on
// one thread: for kernels that thread themselves (attention's tiles, from inside their
// OpenMP regions). Pass dense tiles (lda, ldb, ldc equal to their row widths): oneDNN 2.6
// runs its AMX / AVX512-BF16 kernels only on those, and any other stride falls back to a
// jit gemm 10-20x slower (bench/RESULTS.md, "Dense bf16 attention tiles").
void tile_gemm_bf16(bool transpose_a, bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const BFloat16* a, int64_t lda, const BFloat16* b, int64_t ldb, float beta, float* c, int64_t ldc);
// Whether bf16 GEMMs run as fp32 GEMMs of their operands widened to fp32: where oneDNN has
// no bf16 kernel for this CPU (oneDNN 2.6 needs AVX-512), or where the environment says
// TALLY_BF16_GEMM=widened. The same products and fp32 sums, on fp32 GEMMs.
bool bf16_gemm_widened();
// Whether oneDNN has no bf16 GEMM kernel for this CPU (oneDNN 2.6 needs AVX-512).
bool bf16_gemm_has_no_kernel();
// Measured fp32 GEMM throughput of this machine in FLOP/s (cached after the first call).
double measured_gemm_peak_flops(DType dtype, bool probe_again);

// ---- neural-network kernels (nn.cc)
void embedding_forward(const Tensor& out, const Tensor& weight, const Tensor& indices);
void embedding_backward(const Tensor& dweight, const Tensor& dout, const Tensor& indices);  // accumulates
void layernorm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x, const Tensor& w,
                       const Tensor& b, double eps);
void layernorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& db, const Tensor& dout, const Tensor& x,
                        const Tensor& w, const Tensor& mean, const Tensor& rstd);
void gelu_forward(const Tensor& out, const Tensor& x);
void gelu_backward(const Tensor& dx, const Tensor& dout, const Tensor& x);
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& w, double eps);
void rmsnorm_backward(const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd);
void rotary(const Tensor& out, const Tensor& x, const Tensor& inv_freq, int64_t offset, bool inverse);
void swiglu_forward(const Tensor& out, const Tensor& gate, const Tensor& up);
void swiglu_backward(const Tensor& dgate, const Tensor& dup, const Tensor& dout, const Tensor& gate, const Tensor& up);
void softmax_forward(const Tensor& out, const Tensor& x);
void softmax_backward(const Tensor& dx, const Tensor& dout, const Tensor& y);

// ---- attention (attention.cc)
// Query rows per tile: each tile of queries multiplies every key it sees, so the masked
// part of the diagonal tiles is work too (bench_attention counts it). attention.cc
// explains the tile sizes.
inline constexpr int64_t kAttentionQueryTile = 128;
void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v);
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse);

// ---- loss (cross_entropy.cc)
// losses[n] = logsumexp(logits[n, :V]) - logits[n, target[n]]; lse[n] saved for backward.
// Logits fp32 or fp64 (losses and lse alike), or bf16 (mixed precision: read as fp32,
// losses and lse fp32); dlogits has the logits' dtype and may be the logits themselves.
void cross_entropy_forward(const Tensor& losses, const Tensor& lse, const Tensor& logits, const Tensor& targets,
                           int64_t valid_vocab);
// dlogits[n, j] = scale * (softmax_j - [j == target]) for j < V, 0 for padding columns.
void cross_entropy_backward(const Tensor& dlogits, const Tensor& logits, const Tensor& lse, const Tensor& targets,
                            int64_t valid_vocab, double scale);

// ---- indexing (elementwise.cc)
void gather(const Tensor& out, const Tensor& x, int64_t dim, const Tensor& index);
void scatter_add(const Tensor& dx, int64_t dim, const Tensor& index, const Tensor& src);

}  // namespace tally::runtime::cpu
