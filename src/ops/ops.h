// tally's differentiable ops. Each records its backward through the Function API
// (autograd/function.h) when an input requires grad; its kernels run on the backend of
// its tensors' device (runtime/backend.h), which dispatches on dtype.
//
// Dtypes: fp32 and fp64 everywhere; bf16 for matmul/linear (oneDNN) and conversions.
#pragma once
#include <vector>

#include "core/tensor.h"

namespace tally::ops {

// ---- elementwise, with NumPy broadcasting
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor scale(const Tensor& x, double factor);
Tensor add_scalar(const Tensor& x, double value);
Tensor neg(const Tensor& x);
// In place, no graph (accumulating gradients, optimizer updates): dst += src.
void add_(const Tensor& dst, const Tensor& src);

// ---- reductions
Tensor sum(const Tensor& x);                                      // all elements -> shape []
Tensor sum(const Tensor& x, std::vector<int64_t> dims, bool keepdim = false);
Tensor mean(const Tensor& x);
Tensor mean(const Tensor& x, std::vector<int64_t> dims, bool keepdim = false);
Tensor max(const Tensor& x, int64_t dim, bool keepdim = false);  // values; gradient to the (first) argmax
// Sums `x` over broadcast dimensions down to `shape` (the gradient of broadcasting).
Tensor sum_to(const Tensor& x, const Shape& shape);

// ---- linear algebra
// a (..., M, K) @ b (..., K, N), batch dims equal or b 2-D; transposes read in place.
Tensor matmul(const Tensor& a, const Tensor& b, bool transpose_a = false, bool transpose_b = false);
// x (..., in) @ weight(out, in)^T + bias(out); bias may be undefined.
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = Tensor());
// Mixed precision (bf16 autocast): y = x W^T + b with the GEMM's operands in bf16 and its
// products accumulated, and y returned, in fp32. An fp32 x is rounded to bf16, and saved so
// for backward (half of fp32's bytes); a bf16 x (the MLP's GELU or SwiGLU output, the
// attention output) is the operand as it is, and its gradient is bf16. `weight_bf16` is
// the caller's bf16 copy of `weight` (ParameterStore::compute_copy keeps it current).
// Backward rounds an fp32 dy to bf16 for the two GEMMs (dx = dy W, dW += dy^T x, fp32
// accumulation) and sums db in fp32. Gradients flow to `weight`, the fp32 master weights,
// never to its copy. `out` bf16 returns y (the bias added first) rounded to bf16, as
// autocast's linear does: the head's logits and the MLP's first projections, where half
// the bytes is worth it; backward then takes dy in bf16 as it comes.
Tensor linear_bf16(const Tensor& x, const Tensor& weight, const Tensor& weight_bf16, const Tensor& bias = Tensor(),
                   DType out = DType::F32);

// ---- neural-network ops
Tensor embedding(const Tensor& weight, const Tensor& indices);  // weight (V, C), indices int
Tensor layernorm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
// RMSNorm over the last dimension (LLaMA): x / sqrt(mean(x^2) + eps) * weight.
Tensor rmsnorm(const Tensor& x, const Tensor& weight, double eps = 1e-5);
// GELU, tanh approximation, as GPT-2. bf16: fp32 math on the values, rounded once (and so
// the gradient), as autocast runs it.
Tensor gelu(const Tensor& x);
// silu(gate) * up, LLaMA's gated MLP activation (gate and up have one shape).
Tensor swiglu(const Tensor& gate, const Tensor& up);
// Rotary position embedding of x (B,T,heads,D), D even, at positions offset..offset+T-1:
// pairs (x[2i], x[2i+1]) rotate by pos * inv_freq[i] (Meta's interleaved convention).
// inv_freq (D/2) is a constant: it gets no gradient.
Tensor rotary(const Tensor& x, const Tensor& inv_freq, int64_t offset = 0);
Tensor softmax(const Tensor& x);  // over the last dimension
// Causal scaled-dot-product attention. q (B,T,H,D), k and v (B,T,KV,D) with H % KV == 0
// (grouped-query attention when KV < H); the last dimension must be contiguous, other
// strides are free (q, k, v are usually slices of one fused qkv projection).
// k and v may be longer than q (Tk >= Tq, decoding with a KV cache): query row t is then
// position t + Tk - Tq and sees the keys up to it.
// Returns (B,Tq,H,D). Keeps q, k, v, the output and a (B,H,T) log-sum-exp for backward,
// never the (B,H,T,T) probabilities; with `recompute` (selective recomputation) only q,
// k, v, and backward runs the forward again for the output and log-sum-exp.
// q, k, v are fp32 (or fp64, for gradient checks).
Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute = false);
// Mixed precision: causal_attention of fp32 q, k, v with its tile products in bf16 (fp32
// accumulation), as PyTorch's autocast runs attention's matmuls. q, k and v are rounded
// to bf16 and saved so (half of fp32's bytes); P and dS are rounded per tile for the
// products they feed. The output is bf16, rounded once from fp32 accumulation (as
// autocast's P V product writes it), and so is its gradient; the softmax statistics and
// the gradients of q, k, v stay fp32.
Tensor causal_attention_bf16(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute = false);
// Mean cross-entropy of logits (N, Vp) against targets (N) over the first `valid_vocab`
// columns (the rest are padding and get zero gradient). Targets < 0 are ignored.
// The (N, Vp) probabilities are never stored: backward recomputes them row by row.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, int64_t valid_vocab = -1);
// The LM head and its loss in one op, in chunks of rows: the mean cross-entropy of the
// logits x W^T (N, Vp) against targets (N), as cross_entropy(linear(x, W), targets, V),
// but the logits are made `chunk_rows` rows at a time, reduced to their log-sum-exp and
// dropped; backward makes each chunk again and turns it into its part of dx and dW. So
// the (N, Vp) logits and their gradient are never all live, only one chunk's: the price is
// one more x W^T GEMM. x (N, C) and W (Vp, C) fp32; with `weight_bf16` (W's bf16 copy) the
// GEMMs run as linear_bf16's do.
Tensor linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets, int64_t valid_vocab,
                            int64_t chunk_rows, const Tensor& weight_bf16 = Tensor());

// ---- shape and indexing
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor view(const Tensor& x, const Shape& shape);
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor contiguous(const Tensor& x);
Tensor to_dtype(const Tensor& x, DType dtype);
Tensor to_device(const Tensor& x, Device device);  // differentiable host <-> device copy
Tensor clone(const Tensor& x);                     // a differentiable copy into new storage

// ---- non-differentiable helpers
Tensor argmax(const Tensor& x);            // over the last dimension, int64
double global_norm(const std::vector<Tensor>& tensors);  // sqrt(sum of squares), fp64 accumulation

}  // namespace tally::ops

namespace tally {
inline Tensor operator+(const Tensor& a, const Tensor& b) { return ops::add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return ops::sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return ops::mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return ops::div(a, b); }
inline Tensor operator*(const Tensor& a, double s) { return ops::scale(a, s); }
inline Tensor operator*(double s, const Tensor& a) { return ops::scale(a, s); }
inline Tensor operator-(const Tensor& a) { return ops::neg(a); }
}  // namespace tally
