// Causal flash attention on CUDA, blocked as FlashAttention-2 is: a block owns a tile of
// queries (forward) or of keys (backward) and streams the other side through shared memory,
// so the (T,T) score matrix is never stored. The math is runtime/cpu/attention.cc's:
//
//   s_tj = scale * q_t . k_j  (j <= position of t),  p_tj = softmax_j(s_tj),  o_t = sum_j p_tj v_j
// Forward, per query tile, over the key tiles it sees: S = scale Q K^T, then per row the
// running max m and sum l: m' = max(m, max_j s_j), O <- O exp(m - m') + exp(S - m') V,
// l <- l exp(m - m') + sum_j exp(s_j - m'); at the end o = O / l and lse = m' + log l.
// Backward, with Delta_t = dO_t . o_t, recomputing P = exp(S - lse) per tile:
//   dV += P^T dO,  dP = dO V^T,  dS = P o (dP - Delta),  dQ += scale dS K,  dK += scale dS^T Q
//
// The exponentials run in base 2 (one ex2 instruction): with x = s * log2(e), exp(s - m) =
// 2^(x - m log2 e). The kernels keep m in those units and convert lse back to natural log.
//
// Positions: query row t is at t + Tk - Tq (its queries are the last Tq of Tk positions, as
// with a KV cache) and sees keys j <= t + Tk - Tq. Tiles are padded past Tq and Tk with zero
// rows; a padded key is always masked (its index exceeds every real query's position), and a
// padded query row is computed but never stored (forward) or gets P = 0 (backward, through
// an lse of +inf).
//
// bf16 inputs run on tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulation) as
// the CPU's bf16 tile GEMMs do: P and dS are rounded to bf16 for the products they feed, dO
// is rounded to bf16 once (a no-op when the output is bf16); the softmax statistics, Delta
// and every sum stay fp32, and the output is rounded once from its fp32 accumulator.
// fp32 inputs take an fp32 FMA path with the same tiling (exact fp32 products, no TF32).
//
// Forward: one block per (batch, head, query tile: 128 rows, 64 at D = 128 or under fp32);
// the last tiles (most keys) launch first. Backward: one block per (batch, kv head, 64-key
// tile), looping over the query heads that share the kv head (GQA) and over the query tiles
// that see its keys, so dK and dV accumulate in registers and are written once, without
// atomics; dQ, which every key tile contributes to, is added into global memory with fp32
// atomics (dq is zero on entry), so its last bits vary from run to run. Forward, dK and dV
// are deterministic. Delta comes from a small kernel first, into stream-ordered scratch.
#include "runtime/cuda/attention.h"

#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace tally::runtime::cuda {

namespace {

using bf16 = __nv_bfloat16;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------- kernel arguments

struct AttentionParams {
  const void* q;
  const void* k;
  const void* v;
  const void* out;   // forward: written (Out); backward: read by the Delta kernel only
  const void* dout;  // backward: (B,Tq,H,D) contiguous, Out
  void* out_w;       // forward's output
  float* lse;        // forward: written
  const float* lse_r;
  const float* delta;  // backward: (B,H,Tq), Delta_t = dO_t . o_t
  float* delta_w;      // the same buffer, for the kernel that fills it
  float* dq;
  float* dk;
  float* dv;
  int64_t qb, qt, qh, kb, kt, kh, vb, vt, vh;
  int B, Tq, Tk, H, KV;
  float scale;       // 1/sqrt(D)
  float scale_log2;  // scale * log2(e): scores straight into base-2 exponent units
  // Which operands may be copied 16 bytes at a time (pointer 16-byte aligned, every stride a
  // multiple of 8 elements): the rest go element by element.
  bool vec_q, vec_k, vec_v, vec_do;
};

// ---------------------------------------------------------------- element helpers

template <class T> __device__ __forceinline__ float to_f32(T x) {
  if constexpr (std::is_same_v<T, bf16>) return __bfloat162float(x);
  else return x;
}
template <class T> __device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, bf16>) return __float2bfloat16_rn(x);  // nearest even, as the CPU rounds
  else return x;
}
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// Two fp32 values as a bf16 pair, `lo` in the low half: the element order of mma fragments.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Stores a pair of adjacent fp32 results (columns d, d+1) into a row of Out.
template <class Out> __device__ __forceinline__ void store_pair(Out* dst, float a, float b) {
  if constexpr (std::is_same_v<Out, bf16>) *reinterpret_cast<uint32_t*>(dst) = pack_bf16(a, b);
  else *reinterpret_cast<float2*>(dst) = make_float2(a, b);
}

__device__ __forceinline__ void atomic_add_pair(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(a, b));  // one vector red on sm_90
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers; `valid` false zero-fills.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8x8 bf16 matrices from shared memory; lane l gives the address of row l % 8 of matrix
// l / 8, and register i receives matrix i's fragment (lane l: row l/4, columns 2(l%4), +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// The same, each matrix transposed (lane l receives column l/4, rows 2(l%4), +1).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// C (16x8 fp32) += A (16x16 bf16, row-major) B (16x8 bf16, column-major). Fragments, with
// g = lane / 4 and c = lane % 4: A {a0: (g, 2c..2c+1), a1: (g+8, 2c..), a2: (g, 2c+8..),
// a3: (g+8, 2c+8..)}; B {b0: (k 2c..2c+1, n g), b1: (k 2c+8.., n g)}; C {c0,c1: (g, 2c..2c+1),
// c2,c3: (g+8, 2c..2c+1)}. So an fp32 C tile pair (n-tiles 2i, 2i+1), packed to bf16, is
// the A fragment of the k-step i of a following product: P and dS never leave registers.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Address lane `lane` gives ldmatrix for the four 8x8 blocks of the 16x16 block at (r0, c0)
// of a row-major shared tile (row stride ld elements), ordered for each use:
//  - a_operand: {(r0,c0), (r0+8,c0), (r0,c0+8), (r0+8,c0+8)}: non-transposed, the A
//    fragment of rows r0.. x k c0..; transposed, the A fragment of the transposed tile.
//  - b_operand: {(r0,c0), (r0,c0+8), (r0+8,c0), (r0+8,c0+8)}: non-transposed on a tile stored
//    [n][k], the B fragments (b0, b1) of n-tiles r0 and r0+8.
//  - b_operand_trans = a_operand's order: transposed on a tile stored [k][n], the B fragments
//    (b0, b1) of n-tiles c0 and c0+8.
__device__ __forceinline__ int a_offset(int lane, int r0, int c0, int ld) {
  return (r0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + c0 + (lane >> 4) * 8;
}
__device__ __forceinline__ int b_offset(int lane, int r0, int c0, int ld) {
  return (r0 + (lane & 7) + (lane >> 4) * 8) * ld + c0 + ((lane >> 3) & 1) * 8;
}

// The A fragment of k-step i from an fp32 accumulator pair (n-tiles 2i, 2i+1), rounded.
__device__ __forceinline__ void a_from_accumulators(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16(lo[0], lo[1]);
  a[1] = pack_bf16(lo[2], lo[3]);
  a[2] = pack_bf16(hi[0], hi[1]);
  a[3] = pack_bf16(hi[2], hi[3]);
}

// ---------------------------------------------------------------- tile loads

// Copies ROWS rows (row r at src + (row0 + r) * stride, D contiguous elements) into a bf16
// shared tile of row stride ld, rows at or past `limit` zero. bf16 sources with `vec` go by
// cp.async (the caller commits and waits); anything else converts through registers.
template <int ROWS, int D, int THREADS, class Src>
__device__ __forceinline__ void load_tile_bf16(bf16* dst, int ld, const Src* src, int64_t stride, int row0, int limit,
                                               bool vec) {
  constexpr int kChunks = D / 8;  // 16-byte chunks of a bf16 row
  for (int i = threadIdx.x; i < ROWS * kChunks; i += THREADS) {
    const int r = i / kChunks, c = (i % kChunks) * 8;
    bf16* d = dst + r * ld + c;
    const bool valid = row0 + r < limit;
    const Src* s = src + static_cast<int64_t>(valid ? row0 + r : 0) * stride + c;
    if constexpr (std::is_same_v<Src, bf16>) {
      if (vec) {
        cp_async_16(d, s, valid);
        continue;
      }
    }
    uint4 packed = make_uint4(0, 0, 0, 0);
    if (valid) {
      packed.x = pack_bf16(to_f32(s[0]), to_f32(s[1]));
      packed.y = pack_bf16(to_f32(s[2]), to_f32(s[3]));
      packed.z = pack_bf16(to_f32(s[4]), to_f32(s[5]));
      packed.w = pack_bf16(to_f32(s[6]), to_f32(s[7]));
    }
    *reinterpret_cast<uint4*>(d) = packed;
  }
}

// fp32 path: ROWS rows into an fp32 shared tile of row stride ld (zero past `limit`).
template <int ROWS, int D, int THREADS, class Src>
__device__ __forceinline__ void load_tile_f32(float* dst, int ld, const Src* src, int64_t stride, int row0, int limit) {
  for (int i = threadIdx.x; i < ROWS * D; i += THREADS) {
    const int r = i / D, c = i % D;
    dst[r * ld + c] = row0 + r < limit ? to_f32(src[static_cast<int64_t>(row0 + r) * stride + c]) : 0.f;
  }
}

// ---------------------------------------------------------------- forward, bf16 tensor cores

// 8 warps, 128 query rows (16 per warp) x 64-key tiles; at D = 128, 4 warps and 64 rows (its
// 190 registers a thread would allow one 8-warp block per SM). Each K and V tile copied
// serves 128 queries: at B = 32, T = 1024, H = 12, D = 64 on H100 the forward takes 0.29 ms,
// against 0.33 with 64-row tiles (equal at B = 8 and 16). Shared memory: the Q tile and two
// K and V tiles (the next tile's copy overlaps this tile's math), rows padded by 8 elements
// (16 bytes) so the 8 rows an ldmatrix reads fall in distinct banks.
template <int D> struct ForwardBf16Tiles {
  static constexpr int kWarps = D <= 64 ? 8 : 4, kThreads = 32 * kWarps, kRows = 16 * kWarps, kKeys = 64, kLd = D + 8;
  static constexpr size_t kSmem = sizeof(bf16) * kLd * (kRows + 4 * kKeys);
};

template <int D, class Out>
__global__ void __launch_bounds__(ForwardBf16Tiles<D>::kThreads)
    attention_forward_bf16_kernel(const AttentionParams p) {
  using Tiles = ForwardBf16Tiles<D>;
  constexpr int kRows = Tiles::kRows, kKeys = Tiles::kKeys, kLd = Tiles::kLd, kThreads = Tiles::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + kRows * kLd;  // [2][kKeys][kLd]
  bf16* sV = sK + 2 * kKeys * kLd;

  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H, kvh = h / (p.H / p.KV);
  const int t0 = (gridDim.y - 1 - blockIdx.y) * kRows;  // longest tiles first
  const int offset = p.Tk - p.Tq;
  const int key_end = min(t0 + kRows, p.Tq) + offset;  // keys [0, key_end) are seen by some row
  const int key_tiles = (key_end + kKeys - 1) / kKeys;

  const bf16* q = static_cast<const bf16*>(p.q) + b * p.qb + h * p.qh;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.kb + kvh * p.kh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.vb + kvh * p.vh;
  load_tile_bf16<kRows, D, kThreads>(sQ, kLd, q, p.qt, t0, p.Tq, p.vec_q);
  load_tile_bf16<kKeys, D, kThreads>(sK, kLd, k, p.kt, 0, p.Tk, p.vec_k);
  load_tile_bf16<kKeys, D, kThreads>(sV, kLd, v, p.vt, 0, p.Tk, p.vec_v);
  cp_async_commit();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int row_base = t0 + warp * 16 + g;  // this thread's rows: row_base and row_base + 8
  float o[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY};  // running max, base-2 units
  float l[2] = {0.f, 0.f};              // this thread's share of the running sum (its 2 columns per n-tile)
  uint32_t qf[D / 16][4];               // the warp's Q rows as A fragments, loaded once

  for (int n = 0; n < key_tiles; ++n) {
    if (n + 1 < key_tiles) {
      const int buf = (n + 1) & 1;
      load_tile_bf16<kKeys, D, kThreads>(sK + buf * kKeys * kLd, kLd, k, p.kt, (n + 1) * kKeys, p.Tk, p.vec_k);
      load_tile_bf16<kKeys, D, kThreads>(sV + buf * kKeys * kLd, kLd, v, p.vt, (n + 1) * kKeys, p.Tk, p.vec_v);
      cp_async_commit();
      cp_async_wait<1>();  // tile n (and Q) landed; tile n+1 still in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    if (n == 0) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) ldmatrix_x4(qf[kk], sQ + a_offset(lane, warp * 16, kk * 16, kLd));
    }
    const bf16* kt = sK + (n & 1) * kKeys * kLd;
    const bf16* vt = sV + (n & 1) * kKeys * kLd;

    // S = Q K^T for the warp's 16 rows x 64 keys (unscaled; the scale folds into the exponent)
    float s[kKeys / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kKeys / 16; ++np) {
        uint32_t bfr[4];
        ldmatrix_x4(bfr, kt + b_offset(lane, np * 16, kk * 16, kLd));
        mma_bf16(s[2 * np], qf[kk], bfr[0], bfr[1]);
        mma_bf16(s[2 * np + 1], qf[kk], bfr[2], bfr[3]);
      }
    }
    // Causal mask, only on tiles that reach past the block's first position (the diagonal
    // tiles, and the last tile's padded keys, which lie past every real position).
    const int j0 = n * kKeys;
    if (j0 + kKeys - 1 > t0 + offset) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int row = row_base + (e >> 1) * 8, key = j0 + nt * 8 + 2 * c + (e & 1);
          if (key > row + offset) s[nt][e] = -INFINITY;
        }
    }
    // Online softmax per row (half 0: row g, half 1: row g+8). A row's 64 scores are spread
    // over the 4 lanes of a quad: the max is reduced across them; the sum stays per lane
    // (every lane rescales by the same factor) until the end.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float mx = -INFINITY;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * half], s[nt][2 * half + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[half], mx * p.scale_log2);
      // Every real row sees key 0 in tile 0, so m_new is finite; the guard keeps a row with
      // nothing seen yet at 0 instead of NaN (-inf - -inf).
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float rescale = exp2f(m[half] - m_use);  // 0 on the first tile (m = -inf)
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt)
#pragma unroll
        for (int e = 2 * half; e < 2 * half + 2; ++e) {
          s[nt][e] = exp2f(fmaf(s[nt][e], p.scale_log2, -m_use));  // masked: 2^-inf = 0
          sum += s[nt][e];
        }
      l[half] = l[half] * rescale + sum;
      m[half] = m_new;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        o[dn][2 * half] *= rescale;
        o[dn][2 * half + 1] *= rescale;
      }
    }
    // O += P V, P rounded to bf16 straight from the score registers
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; ++kc) {
      uint32_t a[4];
      a_from_accumulators(a, s[2 * kc], s[2 * kc + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bfr[4];
        ldmatrix_x4_trans(bfr, vt + a_offset(lane, kc * 16, dp * 16, kLd));
        mma_bf16(o[2 * dp], a, bfr[0], bfr[1]);
        mma_bf16(o[2 * dp + 1], a, bfr[2], bfr[3]);
      }
    }
    __syncthreads();  // the next iteration's copy overwrites this buffer pair
  }

  Out* out = static_cast<Out*>(p.out_w);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float sum = l[half];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int row = row_base + half * 8;
    if (row >= p.Tq) continue;
    const float inv = 1.f / sum;
    Out* orow = out + ((static_cast<int64_t>(b) * p.Tq + row) * p.H + h) * D;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn)
      store_pair(orow + dn * 8 + 2 * c, o[dn][2 * half] * inv, o[dn][2 * half + 1] * inv);
    if (c == 0) p.lse[(static_cast<int64_t>(b) * p.H + h) * p.Tq + row] = m[half] * kLn2 + logf(sum);
  }
}

// ---------------------------------------------------------------- backward, bf16 tensor cores

// 4 warps, 64 keys (16 per warp) x query tiles of 64 rows (32 at D = 128, whose dK and dV
// accumulators take 128 registers). Warp w computes the transposed score tile S^T (its 16
// keys x the query tile): then P^T and dS^T are, in registers, the A operands of
// dV += P^T dO and dK += dS^T Q. dQ = dS K sums over all 64 keys, so dS^T goes through
// shared memory and each warp takes a block of dQ.
// Shared memory: K and V (the block's, loaded once), two Q and dO tiles (the next step's
// copy overlaps this step's math), the dS^T tile, and two steps' lse and Delta.
template <int D> struct BackwardBf16Tiles {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps, kKeys = 16 * kWarps, kRows = D <= 64 ? 64 : 32;
  static constexpr int kLd = D + 8, kLdS = kRows + 8;
  // K and V as A fragments in registers (32 registers at D = 64) rather than re-read from
  // shared memory every step; at D = 128 they would not fit beside the accumulators.
  static constexpr bool kKVInRegisters = D <= 64;
  // The dQ product: query rows in kRows/16 groups of 16, D split among the remaining warps.
  static constexpr int kRowGroups = kRows / 16, kColGroups = kWarps / kRowGroups, kDqCols = D / kColGroups;
  static_assert(kRowGroups * kColGroups == kWarps && kDqCols % 16 == 0, "dQ blocks must cover the tile");
  static constexpr size_t kSmem = sizeof(bf16) * (2 * kKeys * kLd + 4 * kRows * kLd + kKeys * kLdS) +
                                  sizeof(float) * 4 * kRows;
};

// (Minimum one block per SM stated: without it ptxas caps D = 32 at 168 registers and
// spills; D = 64 takes 233 either way, two blocks per SM.)
template <int D, class Out>
__global__ void __launch_bounds__(BackwardBf16Tiles<D>::kThreads, 1)
    attention_backward_bf16_kernel(const AttentionParams p) {
  using Tiles = BackwardBf16Tiles<D>;
  constexpr int kRows = Tiles::kRows, kKeys = Tiles::kKeys, kLd = Tiles::kLd, kLdS = Tiles::kLdS;
  constexpr int kThreads = Tiles::kThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);
  bf16* sV = sK + kKeys * kLd;
  bf16* sQ = sV + kKeys * kLd;      // [2][kRows][kLd]
  bf16* sdO = sQ + 2 * kRows * kLd;  // [2][kRows][kLd]
  bf16* sdS = sdO + 2 * kRows * kLd;  // dS^T: [kKeys][kLdS]
  float* s_lse = reinterpret_cast<float*>(sdS + kKeys * kLdS);  // [2][kRows], base-2 units, +inf past Tq
  float* s_delta = s_lse + 2 * kRows;                            // [2][kRows], 0 past Tq

  const int group = p.H / p.KV;
  // Key tiles vary fastest over the grid: the blocks running at once cover few (b, kv head)
  // pairs, so the dq rows they add into stay in L2 (launching key tile 0 of every head first
  // would spread the atomics over more than L2 holds: 1.21 vs 0.83 ms at B = 32, T = 1024,
  // H = 12).
  const int b = blockIdx.y / p.KV, kvh = blockIdx.y % p.KV;
  const int j0 = blockIdx.x * kKeys;
  const int offset = p.Tk - p.Tq;
  // Query rows that see key j0 or later: t + offset >= j0.
  const int first_tile = max(0, j0 - offset) / kRows;
  const int tiles_per_head = (p.Tq + kRows - 1) / kRows - first_tile;
  const int steps = group * tiles_per_head;

  const bf16* qbase = static_cast<const bf16*>(p.q) + b * p.qb;
  const Out* dobase = static_cast<const Out*>(p.dout) + static_cast<int64_t>(b) * p.Tq * p.H * D;
  const int64_t ld_rows = static_cast<int64_t>(p.H) * D;  // row stride of dO and dq

  // Step i: query head kvh * group + i / tiles_per_head, query tile first_tile + i % tiles_per_head.
  auto step_head = [&](int i) { return kvh * group + i / tiles_per_head; };
  auto step_row0 = [&](int i) { return (first_tile + i % tiles_per_head) * kRows; };
  auto load_step = [&](int i, int buf) {
    const int h = step_head(i), t0 = step_row0(i);
    load_tile_bf16<kRows, D, kThreads>(sQ + buf * kRows * kLd, kLd, qbase + h * p.qh, p.qt, t0, p.Tq, p.vec_q);
    load_tile_bf16<kRows, D, kThreads>(sdO + buf * kRows * kLd, kLd, dobase + h * D, ld_rows, t0, p.Tq, p.vec_do);
  };
  // lse and Delta of a step's rows, read into registers when its tiles are requested and
  // stored to shared memory after this step's math, so the loads' latency hides behind it.
  // (x: lse in base-2 units, +inf past Tq so that P = 2^(s - inf) = 0; y: Delta, 0 past Tq)
  auto read_stats = [&](int i) {
    const int row = step_row0(i) + threadIdx.x;
    float2 stats = make_float2(INFINITY, 0.f);
    if (threadIdx.x < kRows && row < p.Tq) {
      const int64_t at = (static_cast<int64_t>(b) * p.H + step_head(i)) * p.Tq + row;
      stats = make_float2(p.lse_r[at] * kLog2e, p.delta[at]);
    }
    return stats;
  };
  auto store_stats = [&](int buf, float2 stats) {
    if (threadIdx.x < kRows) {
      s_lse[buf * kRows + threadIdx.x] = stats.x;
      s_delta[buf * kRows + threadIdx.x] = stats.y;
    }
  };

  load_tile_bf16<kKeys, D, kThreads>(sK, kLd, static_cast<const bf16*>(p.k) + b * p.kb + kvh * p.kh, p.kt, j0, p.Tk,
                                     p.vec_k);
  load_tile_bf16<kKeys, D, kThreads>(sV, kLd, static_cast<const bf16*>(p.v) + b * p.vb + kvh * p.vh, p.vt, j0, p.Tk,
                                     p.vec_v);
  load_step(0, 0);
  cp_async_commit();
  store_stats(0, read_stats(0));

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int key_base = j0 + warp * 16 + g;  // this thread's keys: key_base and key_base + 8
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  uint32_t kf[Tiles::kKVInRegisters ? D / 16 : 1][4], vf[Tiles::kKVInRegisters ? D / 16 : 1][4];

  for (int i = 0; i < steps; ++i) {
    const int buf = i & 1;
    cp_async_wait<0>();
    __syncthreads();  // step i's tiles and stats are in; every warp is done with step i - 1
    if constexpr (Tiles::kKVInRegisters) {
      if (i == 0) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          ldmatrix_x4(kf[kk], sK + a_offset(lane, warp * 16, kk * 16, kLd));
          ldmatrix_x4(vf[kk], sV + a_offset(lane, warp * 16, kk * 16, kLd));
        }
      }
    }
    const bool prefetch = i + 1 < steps;
    float2 next_stats = make_float2(0.f, 0.f);
    if (prefetch) {
      load_step(i + 1, buf ^ 1);  // buffer of step i - 1, free since the barrier above
      cp_async_commit();
      next_stats = read_stats(i + 1);
    }
    const int h = step_head(i), t0 = step_row0(i);
    const bf16* qt = sQ + buf * kRows * kLd;
    const bf16* dot = sdO + buf * kRows * kLd;
    const float* lse2 = s_lse + buf * kRows;
    const float* delta = s_delta + buf * kRows;

    // S^T = K Q^T and dP^T = V dO^T: the warp's 16 keys x kRows queries
    float st[kRows / 8][4] = {}, dpt[kRows / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t ka[4], va[4];
      if constexpr (Tiles::kKVInRegisters) {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          ka[r] = kf[kk][r];
          va[r] = vf[kk][r];
        }
      } else {
        ldmatrix_x4(ka, sK + a_offset(lane, warp * 16, kk * 16, kLd));
        ldmatrix_x4(va, sV + a_offset(lane, warp * 16, kk * 16, kLd));
      }
#pragma unroll
      for (int np = 0; np < kRows / 16; ++np) {
        uint32_t bq[4], bo[4];
        ldmatrix_x4(bq, qt + b_offset(lane, np * 16, kk * 16, kLd));
        ldmatrix_x4(bo, dot + b_offset(lane, np * 16, kk * 16, kLd));
        mma_bf16(st[2 * np], ka, bq[0], bq[1]);
        mma_bf16(st[2 * np + 1], ka, bq[2], bq[3]);
        mma_bf16(dpt[2 * np], va, bo[0], bo[1]);
        mma_bf16(dpt[2 * np + 1], va, bo[2], bo[3]);
      }
    }
    // P^T = exp(S^T - lse) (masked to 0), then dS^T = P^T o (dP^T - Delta), both in place
    const bool need_mask = j0 + kKeys - 1 > t0 + offset;
#pragma unroll
    for (int nt = 0; nt < kRows / 8; ++nt) {
      const int col = nt * 8 + 2 * c;  // query index in the tile for e = 0 and 2; +1 for e = 1 and 3
      const float2 l2 = *reinterpret_cast<const float2*>(lse2 + col);
      const float2 dl = *reinterpret_cast<const float2*>(delta + col);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_base + (e >> 1) * 8, row = t0 + col + (e & 1);
        float pe = exp2f(fmaf(st[nt][e], p.scale_log2, -((e & 1) ? l2.y : l2.x)));
        if (need_mask && key > row + offset) pe = 0.f;
        st[nt][e] = pe;
        dpt[nt][e] = pe * (dpt[nt][e] - ((e & 1) ? dl.y : dl.x));
      }
    }
    // dV += P^T dO and dK += dS^T Q (scale applied once at the end); A from registers
#pragma unroll
    for (int kq = 0; kq < kRows / 16; ++kq) {
      uint32_t pa[4], dsa[4];
      a_from_accumulators(pa, st[2 * kq], st[2 * kq + 1]);
      a_from_accumulators(dsa, dpt[2 * kq], dpt[2 * kq + 1]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bo[4], bq[4];
        ldmatrix_x4_trans(bo, dot + a_offset(lane, kq * 16, dp * 16, kLd));
        ldmatrix_x4_trans(bq, qt + a_offset(lane, kq * 16, dp * 16, kLd));
        mma_bf16(dv[2 * dp], pa, bo[0], bo[1]);
        mma_bf16(dv[2 * dp + 1], pa, bo[2], bo[3]);
        mma_bf16(dk[2 * dp], dsa, bq[0], bq[1]);
        mma_bf16(dk[2 * dp + 1], dsa, bq[2], bq[3]);
      }
      // dS^T (rounded, as the product takes it) for the dQ product
      bf16* srow = sdS + (warp * 16 + g) * kLdS + kq * 16 + 2 * c;
      *reinterpret_cast<uint32_t*>(srow) = dsa[0];
      *reinterpret_cast<uint32_t*>(srow + 8 * kLdS) = dsa[1];
      *reinterpret_cast<uint32_t*>(srow + 8) = dsa[2];
      *reinterpret_cast<uint32_t*>(srow + 8 * kLdS + 8) = dsa[3];
    }
    __syncthreads();  // dS^T complete

    // dQ (kRows x D) += scale dS K over the block's 64 keys: warp w takes query rows
    // 16 (w % kRowGroups).. and columns kDqCols (w / kRowGroups)..; A = dS from the stored dS^T
    // (transposed load), B = K [key][d] (transposed load).
    {
      const int rg = warp % Tiles::kRowGroups, cg = warp / Tiles::kRowGroups;
      float dq[Tiles::kDqCols / 8][4] = {};
#pragma unroll
      for (int kc = 0; kc < kKeys / 16; ++kc) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, sdS + b_offset(lane, kc * 16, rg * 16, kLdS));
#pragma unroll
        for (int dp = 0; dp < Tiles::kDqCols / 16; ++dp) {
          uint32_t bk[4];
          ldmatrix_x4_trans(bk, sK + a_offset(lane, kc * 16, cg * Tiles::kDqCols + dp * 16, kLd));
          mma_bf16(dq[2 * dp], a, bk[0], bk[1]);
          mma_bf16(dq[2 * dp + 1], a, bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = t0 + rg * 16 + g + half * 8;
        if (row >= p.Tq) continue;
        float* dqrow = p.dq + (static_cast<int64_t>(b) * p.Tq + row) * ld_rows + h * D + cg * Tiles::kDqCols + 2 * c;
#pragma unroll
        for (int dn = 0; dn < Tiles::kDqCols / 8; ++dn)
          atomic_add_pair(dqrow + dn * 8, p.scale * dq[dn][2 * half], p.scale * dq[dn][2 * half + 1]);
      }
    }
    if (prefetch) store_stats(buf ^ 1, next_stats);
  }

  // dK and dV rows of the block's keys: written, not added (no other block has them)
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key_base + half * 8;
    if (key >= p.Tk) continue;
    const int64_t at = ((static_cast<int64_t>(b) * p.Tk + key) * p.KV + kvh) * D + 2 * c;
#pragma unroll
    for (int dn = 0; dn < D / 8; ++dn) {
      *reinterpret_cast<float2*>(p.dk + at + dn * 8) = make_float2(p.scale * dk[dn][2 * half], p.scale * dk[dn][2 * half + 1]);
      *reinterpret_cast<float2*>(p.dv + at + dn * 8) = make_float2(dv[dn][2 * half], dv[dn][2 * half + 1]);
    }
  }
}

// ---------------------------------------------------------------- fp32 FMA path

// 256 threads as a 16 x 16 grid (tx = tid % 16, ty = tid / 16) over 64 x 64 tiles: thread
// (ty, tx) owns rows ty + 16i and columns tx + 16j (i, j < 4) of a score tile, and rows
// ty + 16i, columns tx + 16j (j < D/16) of an output tile. Rows are padded by one float so
// the 16 rows a half-warp walks fall in distinct banks. A row's 64 scores live in the 16
// lanes of one half-warp, so its max and sum reduce with xor shuffles of 1..8 (each lane
// ends with the same value: x + y == y + x exactly).
struct F32Tiles {
  static constexpr int kThreads = 256, kRows = 64, kKeys = 64;
};

__device__ __forceinline__ float half_warp_max(float x) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float half_warp_sum(float x) {
#pragma unroll
  for (int o = 1; o < 16; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <int D> constexpr size_t forward_f32_smem() {
  return sizeof(float) * ((F32Tiles::kRows + 2 * F32Tiles::kKeys) * (D + 1) + F32Tiles::kRows * (F32Tiles::kKeys + 1));
}

template <int D, class Out>
__global__ void __launch_bounds__(F32Tiles::kThreads) attention_forward_f32_kernel(const AttentionParams p) {
  constexpr int kRows = F32Tiles::kRows, kKeys = F32Tiles::kKeys, kThreads = F32Tiles::kThreads;
  constexpr int kLd = D + 1, kLdP = kKeys + 1, kCols = D / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);
  float* sK = sQ + kRows * kLd;
  float* sV = sK + kKeys * kLd;
  float* sP = sV + kKeys * kLd;  // [kRows][kLdP]

  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H, kvh = h / (p.H / p.KV);
  const int t0 = (gridDim.y - 1 - blockIdx.y) * kRows;
  const int offset = p.Tk - p.Tq;
  const int key_end = min(t0 + kRows, p.Tq) + offset;
  const int key_tiles = (key_end + kKeys - 1) / kKeys;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;

  const float* q = static_cast<const float*>(p.q) + b * p.qb + h * p.qh;
  const float* k = static_cast<const float*>(p.k) + b * p.kb + kvh * p.kh;
  const float* v = static_cast<const float*>(p.v) + b * p.vb + kvh * p.vh;
  load_tile_f32<kRows, D, kThreads>(sQ, kLd, q, p.qt, t0, p.Tq);

  float o[4][kCols] = {}, m[4], l[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = -INFINITY, l[i] = 0.f;

  for (int n = 0; n < key_tiles; ++n) {
    const int j0 = n * kKeys;
    __syncthreads();  // the previous tile's K, V and P are no longer read
    load_tile_f32<kKeys, D, kThreads>(sK, kLd, k, p.kt, j0, p.Tk);
    load_tile_f32<kKeys, D, kThreads>(sV, kLd, v, p.vt, j0, p.Tk);
    __syncthreads();
    float s[4][4] = {};
    for (int d = 0; d < D; ++d) {
      float qv[4], kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = sQ[(ty + 16 * i) * kLd + d], kv[i] = sK[(tx + 16 * i) * kLd + d];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = t0 + ty + 16 * i;
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = j0 + tx + 16 * j;
        s[i][j] = key > row + offset ? -INFINITY : s[i][j] * p.scale_log2;
        mx = fmaxf(mx, s[i][j]);
      }
      const float m_new = fmaxf(m[i], half_warp_max(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float rescale = exp2f(m[i] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float pe = exp2f(s[i][j] - m_use);
        sum += pe;
        sP[(ty + 16 * i) * kLdP + tx + 16 * j] = pe;
      }
      l[i] = l[i] * rescale + half_warp_sum(sum);
      m[i] = m_new;
#pragma unroll
      for (int j = 0; j < kCols; ++j) o[i][j] *= rescale;
    }
    __syncthreads();
    for (int kc = 0; kc < kKeys; ++kc) {
      float pv[4], vv[kCols];
#pragma unroll
      for (int i = 0; i < 4; ++i) pv[i] = sP[(ty + 16 * i) * kLdP + kc];
#pragma unroll
      for (int j = 0; j < kCols; ++j) vv[j] = sV[kc * kLd + tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) o[i][j] = fmaf(pv[i], vv[j], o[i][j]);
    }
  }

  Out* out = static_cast<Out*>(p.out_w);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = t0 + ty + 16 * i;
    if (row >= p.Tq) continue;
    const float inv = 1.f / l[i];
    Out* orow = out + ((static_cast<int64_t>(b) * p.Tq + row) * p.H + h) * D;
#pragma unroll
    for (int j = 0; j < kCols; ++j) orow[tx + 16 * j] = from_f32<Out>(o[i][j] * inv);
    if (tx == 0) p.lse[(static_cast<int64_t>(b) * p.H + h) * p.Tq + row] = m[i] * kLn2 + logf(l[i]);
  }
}

template <int D> constexpr size_t backward_f32_smem() {
  return sizeof(float) * (2 * (F32Tiles::kKeys + F32Tiles::kRows) * (D + 1) +
                          2 * F32Tiles::kKeys * (F32Tiles::kRows + 1) + 2 * F32Tiles::kRows);
}

// One block per (batch, kv head, 64-key tile), as the bf16 kernel: thread (ty, tx) owns keys
// ty + 16i x queries tx + 16j of the transposed tiles S^T, P^T, dS^T, and keys ty + 16i x
// columns tx + 16j of dK and dV, accumulated in registers over the whole loop; then rows
// ty + 16i x columns tx + 16j of the step's dQ, added into dq with atomics.
template <int D, class Out>
__global__ void __launch_bounds__(F32Tiles::kThreads) attention_backward_f32_kernel(const AttentionParams p) {
  constexpr int kRows = F32Tiles::kRows, kKeys = F32Tiles::kKeys, kThreads = F32Tiles::kThreads;
  constexpr int kLd = D + 1, kLdT = kRows + 1, kCols = D / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sK = reinterpret_cast<float*>(smem_raw);
  float* sV = sK + kKeys * kLd;
  float* sQ = sV + kKeys * kLd;
  float* sdO = sQ + kRows * kLd;
  float* sP = sdO + kRows * kLd;   // P^T [kKeys][kLdT]
  float* sdS = sP + kKeys * kLdT;  // dS^T [kKeys][kLdT]
  float* s_lse = sdS + kKeys * kLdT;
  float* s_delta = s_lse + kRows;

  const int group = p.H / p.KV;
  const int b = blockIdx.y / p.KV, kvh = blockIdx.y % p.KV;  // key tiles fastest, as the bf16 kernel
  const int j0 = blockIdx.x * kKeys;
  const int offset = p.Tk - p.Tq;
  const int first_tile = max(0, j0 - offset) / kRows;
  const int tiles_per_head = (p.Tq + kRows - 1) / kRows - first_tile;
  const int steps = group * tiles_per_head;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t ld_rows = static_cast<int64_t>(p.H) * D;

  load_tile_f32<kKeys, D, kThreads>(sK, kLd, static_cast<const float*>(p.k) + b * p.kb + kvh * p.kh, p.kt, j0, p.Tk);
  load_tile_f32<kKeys, D, kThreads>(sV, kLd, static_cast<const float*>(p.v) + b * p.vb + kvh * p.vh, p.vt, j0, p.Tk);

  float dk[4][kCols] = {}, dv[4][kCols] = {};
  for (int i = 0; i < steps; ++i) {
    const int h = kvh * group + i / tiles_per_head, t0 = (first_tile + i % tiles_per_head) * kRows;
    __syncthreads();  // the previous step's tiles are no longer read
    load_tile_f32<kRows, D, kThreads>(sQ, kLd, static_cast<const float*>(p.q) + b * p.qb + h * p.qh, p.qt, t0, p.Tq);
    load_tile_f32<kRows, D, kThreads>(
        sdO, kLd, static_cast<const Out*>(p.dout) + static_cast<int64_t>(b) * p.Tq * ld_rows + h * D, ld_rows, t0, p.Tq);
    if (threadIdx.x < kRows) {
      const int row = t0 + threadIdx.x;
      const int64_t at = (static_cast<int64_t>(b) * p.H + h) * p.Tq + row;
      s_lse[threadIdx.x] = row < p.Tq ? p.lse_r[at] * kLog2e : INFINITY;
      s_delta[threadIdx.x] = row < p.Tq ? p.delta[at] : 0.f;
    }
    __syncthreads();
    float st[4][4] = {}, dpt[4][4] = {};
    for (int d = 0; d < D; ++d) {
      float kv[4], vv[4], qv[4], ov[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        kv[r] = sK[(ty + 16 * r) * kLd + d];
        vv[r] = sV[(ty + 16 * r) * kLd + d];
        qv[r] = sQ[(tx + 16 * r) * kLd + d];
        ov[r] = sdO[(tx + 16 * r) * kLd + d];
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          st[r][j] = fmaf(kv[r], qv[j], st[r][j]);
          dpt[r][j] = fmaf(vv[r], ov[j], dpt[r][j]);
        }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int key = j0 + ty + 16 * r, qi = tx + 16 * j;
        float pe = exp2f(fmaf(st[r][j], p.scale_log2, -s_lse[qi]));
        if (key > t0 + qi + offset) pe = 0.f;
        sP[(ty + 16 * r) * kLdT + qi] = pe;
        sdS[(ty + 16 * r) * kLdT + qi] = pe * (dpt[r][j] - s_delta[qi]);
      }
    __syncthreads();
    // dV += P^T dO, dK += dS^T Q over the step's queries
    for (int qi = 0; qi < kRows; ++qi) {
      float pv[4], dsv[4], ov[kCols], qv[kCols];
#pragma unroll
      for (int r = 0; r < 4; ++r) pv[r] = sP[(ty + 16 * r) * kLdT + qi], dsv[r] = sdS[(ty + 16 * r) * kLdT + qi];
#pragma unroll
      for (int j = 0; j < kCols; ++j) ov[j] = sdO[qi * kLd + tx + 16 * j], qv[j] = sQ[qi * kLd + tx + 16 * j];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          dv[r][j] = fmaf(pv[r], ov[j], dv[r][j]);
          dk[r][j] = fmaf(dsv[r], qv[j], dk[r][j]);
        }
    }
    // dQ rows ty + 16r += scale sum_key dS[row][key] K[key]
    float dq[4][kCols] = {};
    for (int kc = 0; kc < kKeys; ++kc) {
      float dsv[4], kv[kCols];
#pragma unroll
      for (int r = 0; r < 4; ++r) dsv[r] = sdS[kc * kLdT + ty + 16 * r];
#pragma unroll
      for (int j = 0; j < kCols; ++j) kv[j] = sK[kc * kLd + tx + 16 * j];
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int j = 0; j < kCols; ++j) dq[r][j] = fmaf(dsv[r], kv[j], dq[r][j]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = t0 + ty + 16 * r;
      if (row >= p.Tq) continue;
      float* dqrow = p.dq + (static_cast<int64_t>(b) * p.Tq + row) * ld_rows + h * D;
#pragma unroll
      for (int j = 0; j < kCols; ++j) atomicAdd(dqrow + tx + 16 * j, p.scale * dq[r][j]);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int key = j0 + ty + 16 * r;
    if (key >= p.Tk) continue;
    const int64_t at = ((static_cast<int64_t>(b) * p.Tk + key) * p.KV + kvh) * D;
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      p.dk[at + tx + 16 * j] = p.scale * dk[r][j];
      p.dv[at + tx + 16 * j] = dv[r][j];
    }
  }
}

// ---------------------------------------------------------------- Delta = dO . o

// D/8 lanes per row, 8 elements each, reduced with xor shuffles inside the lane group.
// Under bf16 inputs dO is rounded to bf16 first: the dO that dP = dO V^T takes, so the rows
// of dS sum to zero as softmax's shift invariance says (the CPU does the same).
template <int D, class Out, bool kRoundDO>
__global__ void __launch_bounds__(256) attention_delta_kernel(const AttentionParams p) {
  constexpr int kLanes = D / 8;
  const int64_t rows = static_cast<int64_t>(p.B) * p.Tq * p.H;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t row = i / kLanes;
  const int part = static_cast<int>(i % kLanes) * 8;
  float sum = 0.f;
  if (row < rows) {
    const Out* o = static_cast<const Out*>(p.out) + row * D + part;
    const Out* d = static_cast<const Out*>(p.dout) + row * D + part;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float de = to_f32(d[e]);
      if constexpr (kRoundDO) de = round_bf16(de);
      sum = fmaf(de, to_f32(o[e]), sum);
    }
  }
#pragma unroll
  for (int s = kLanes / 2; s > 0; s >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, s);
  if (row < rows && part == 0) {
    const int64_t t = (row / p.H) % p.Tq, h = row % p.H, b = row / (static_cast<int64_t>(p.H) * p.Tq);
    p.delta_w[(b * p.H + h) * p.Tq + t] = sum;
  }
}

// ---------------------------------------------------------------- host side

void check_launch(const char* kernel) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("attention: launch of ") + kernel + " failed: " + cudaGetErrorString(e));
}

template <class Kernel>
void launch(const char* name, Kernel kernel, dim3 grid, int threads, size_t smem, cudaStream_t stream,
            const AttentionParams& p) {
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess)
      throw std::runtime_error(std::string("attention: ") + name + " needs " + std::to_string(smem) +
                               " bytes of shared memory: " + cudaGetErrorString(e));
  }
  kernel<<<grid, threads, smem, stream>>>(p);
  check_launch(name);
}

void validate(const AttentionGeometry& g, const char* op) {
  const std::string what = op;
  if (g.D != 16 && g.D != 32 && g.D != 64 && g.D != 128)
    throw std::runtime_error(what + ": head dimension D=" + std::to_string(g.D) +
                             " is not supported on CUDA (supported: 16, 32, 64, 128)");
  if (g.B < 0 || g.Tq < 0 || g.Tk < 0 || g.H <= 0 || g.KV <= 0 || g.H % g.KV != 0)
    throw std::runtime_error(what + ": bad geometry B=" + std::to_string(g.B) + " H=" + std::to_string(g.H) +
                             " KV=" + std::to_string(g.KV) + " (H must be a positive multiple of KV)");
  if (g.Tq > g.Tk)
    throw std::runtime_error(what + ": " + std::to_string(g.Tq) + " queries but only " + std::to_string(g.Tk) +
                             " keys (Tq must be <= Tk)");
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (g.Tk > kIntMax / 2 || g.B * g.H > kIntMax || g.B * g.KV > kIntMax)
    throw std::runtime_error(what + ": sizes too large for the CUDA kernels' grid");
  // The forward's grid is (B*H, query tiles of at least 64 rows), the backward's (key tiles,
  // B*KV): CUDA allows 65535 blocks along y.
  if ((g.Tq + 63) / 64 > 65535)
    throw std::runtime_error(what + ": sequence of " + std::to_string(g.Tq) + " queries too long for the CUDA kernels' grid");
  if (g.B * g.KV > 65535)
    throw std::runtime_error(what + ": batch " + std::to_string(g.B) + " x " + std::to_string(g.KV) +
                             " key/value heads = " + std::to_string(g.B * g.KV) +
                             " exceeds the 65535 blocks the backward kernels' grid allows (use a smaller batch or "
                             "more gradient accumulation)");
}

// Whether an operand can move 16 bytes (8 bf16) at a time: aligned base, strides in whole chunks.
bool chunked(const void* ptr, int64_t sb, int64_t st, int64_t sh) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && sb % 8 == 0 && st % 8 == 0 && sh % 8 == 0;
}

AttentionParams make_params(const AttentionGeometry& g, const void* q, const void* k, const void* v) {
  AttentionParams p{};
  p.q = q, p.k = k, p.v = v;
  p.qb = g.qb, p.qt = g.qt, p.qh = g.qh, p.kb = g.kb, p.kt = g.kt, p.kh = g.kh, p.vb = g.vb, p.vt = g.vt, p.vh = g.vh;
  p.B = static_cast<int>(g.B), p.Tq = static_cast<int>(g.Tq), p.Tk = static_cast<int>(g.Tk);
  p.H = static_cast<int>(g.H), p.KV = static_cast<int>(g.KV);
  p.scale = g.scale > 0 ? g.scale : 1.f / std::sqrt(static_cast<float>(g.D));
  p.scale_log2 = p.scale * kLog2e;
  p.vec_q = chunked(q, g.qb, g.qt, g.qh);
  p.vec_k = chunked(k, g.kb, g.kt, g.kh);
  p.vec_v = chunked(v, g.vb, g.vt, g.vh);
  return p;
}

// Calls f(std::integral_constant<int, D>{}) for a supported D (validate has checked it).
template <class F> void dispatch_head_dim(int64_t d, F&& f) {
  switch (d) {
    case 16: return f(std::integral_constant<int, 16>{});
    case 32: return f(std::integral_constant<int, 32>{});
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
  }
  throw std::runtime_error("attention: head dimension D=" + std::to_string(d) + " is not supported (supported: 16, 32, 64, 128)");
}
template <class F> void dispatch_out(AttnType t, F&& f) {
  if (t == AttnType::BF16) f(bf16{});
  else f(float{});
}

}  // namespace

void attention_forward(cudaStream_t stream, const AttentionGeometry& g, AttnType in, const void* q, const void* k,
                       const void* v, AttnType out_type, void* out, float* lse) {
  validate(g, "attention_forward");
  if (g.B == 0 || g.Tq == 0) return;
  AttentionParams p = make_params(g, q, k, v);
  p.out_w = out;
  p.lse = lse;
  dispatch_head_dim(g.D, [&](auto d_tag) {
    constexpr int D = decltype(d_tag)::value;
    dispatch_out(out_type, [&](auto out_tag) {
      using Out = decltype(out_tag);
      if (in == AttnType::BF16) {
        using Tiles = ForwardBf16Tiles<D>;
        const dim3 grid(static_cast<unsigned>(g.B * g.H), static_cast<unsigned>((g.Tq + Tiles::kRows - 1) / Tiles::kRows));
        launch("attention_forward_bf16_kernel", attention_forward_bf16_kernel<D, Out>, grid, Tiles::kThreads,
               Tiles::kSmem, stream, p);
      } else {
        const dim3 grid(static_cast<unsigned>(g.B * g.H),
                        static_cast<unsigned>((g.Tq + F32Tiles::kRows - 1) / F32Tiles::kRows));
        launch("attention_forward_f32_kernel", attention_forward_f32_kernel<D, Out>, grid, F32Tiles::kThreads,
               forward_f32_smem<D>(), stream, p);
      }
    });
  });
}

void attention_backward(cudaStream_t stream, const AttentionGeometry& g, AttnType in, const void* q, const void* k,
                        const void* v, AttnType out_type, const void* out, const void* dout, const float* lse,
                        float* dq, float* dk, float* dv, float* delta) {
  validate(g, "attention_backward");
  if (g.B == 0 || g.Tq == 0) return;  // no query sees a key: the zero gradients stand
  AttentionParams p = make_params(g, q, k, v);
  p.out = out;
  p.dout = dout;
  p.lse_r = lse;
  p.dq = dq, p.dk = dk, p.dv = dv;
  p.vec_do = out_type == AttnType::BF16 && chunked(dout, 8, g.H * g.D, g.D);
  p.delta_w = delta;
  p.delta = p.delta_w;
  dispatch_head_dim(g.D, [&](auto d_tag) {
    constexpr int D = decltype(d_tag)::value;
    dispatch_out(out_type, [&](auto out_tag) {
      using Out = decltype(out_tag);
      const int64_t delta_threads = g.B * g.Tq * g.H * (D / 8);
      const dim3 delta_grid(static_cast<unsigned>((delta_threads + 255) / 256));
      if (in == AttnType::BF16) {
        launch("attention_delta_kernel", attention_delta_kernel<D, Out, std::is_same_v<Out, float>>, delta_grid, 256, 0,
               stream, p);
        using Tiles = BackwardBf16Tiles<D>;
        const dim3 grid(static_cast<unsigned>((g.Tk + Tiles::kKeys - 1) / Tiles::kKeys), static_cast<unsigned>(g.B * g.KV));
        launch("attention_backward_bf16_kernel", attention_backward_bf16_kernel<D, Out>, grid, Tiles::kThreads,
               Tiles::kSmem, stream, p);
      } else {
        launch("attention_delta_kernel", attention_delta_kernel<D, Out, false>, delta_grid, 256, 0, stream, p);
        const dim3 grid(static_cast<unsigned>((g.Tk + F32Tiles::kKeys - 1) / F32Tiles::kKeys),
                        static_cast<unsigned>(g.B * g.KV));
        launch("attention_backward_f32_kernel", attention_backward_f32_kernel<D, Out>, grid, F32Tiles::kThreads,
               backward_f32_smem<D>(), stream, p);
      }
    });
  });
}

}  // namespace tally::runtime::cuda
