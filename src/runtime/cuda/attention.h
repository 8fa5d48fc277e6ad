// Causal flash attention on CUDA (FlashAttention-2's scheme: tiles in shared memory, an
// online softmax, the (T,T) score matrix never stored), forward and backward. bf16 inputs
// run on tensor cores with fp32 accumulation; fp32 inputs on an fp32 FMA path. The math
// and the mixed-precision rounding follow runtime/cpu/attention.cc.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace tally::runtime::cuda {

enum class AttnType { F32, BF16 };

// Element strides of q, k, v along (batch, time, head); the head dimension (last) is contiguous.
struct AttentionGeometry {
  int64_t B, Tq, Tk, H, KV, D;
  int64_t qb, qt, qh, kb, kt, kh, vb, vt, vh;
  float scale = 0;  // the scores' scale; 0 means 1/sqrt(D) (a caller that pads D passes the real one)
};

// q: (B,Tq,H,D), k and v: (B,Tk,KV,D), all of dtype `in` (fp32 or bf16), strided as above.
// H is a multiple of KV (grouped-query attention: query head h reads kv head h / (H/KV)).
// Tq <= Tk: query row t sits at position t + Tk - Tq and sees keys j <= that position (causal).
// scale = 1/sqrt(D). D must be 16, 32, 64 or 128 (anything else throws std::runtime_error).
// out: (B,Tq,H,D) contiguous, dtype `out_type`; lse: (B,H,Tq) contiguous fp32, lse = m + log(l) (natural log)
void attention_forward(cudaStream_t stream, const AttentionGeometry& g, AttnType in, const void* q, const void* k,
                       const void* v, AttnType out_type, void* out, float* lse);

// dout: (B,Tq,H,D) contiguous of dtype out_type; out and lse as the forward wrote them.
// dq: (B,Tq,H,D), dk and dv: (B,Tk,KV,D), contiguous fp32, zero on entry: dq is added into
// (fp32 atomics, so its low bits depend on the order blocks finish), dk and dv are written.
// `delta` is the caller's scratch of B*H*Tq floats for the rows' dO . o (the caller owns
// every byte: the ledger names it).
void attention_backward(cudaStream_t stream, const AttentionGeometry& g, AttnType in, const void* q, const void* k,
                        const void* v, AttnType out_type, const void* out, const void* dout, const float* lse,
                        float* dq, float* dk, float* dv, float* delta);

}  // namespace tally::runtime::cuda
