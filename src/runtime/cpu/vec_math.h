// exp and tanh that the compiler can vectorize. glibc's expf/tanhf are scalar calls
// (their SIMD variants are only declared under -ffast-math), and GELU/softmax/cross-entropy
// call them millions of times per step. fp32 uses the Cephes polynomial (max relative
// error ~2 ulp); fp64 keeps the libm functions, which gradient checks rely on.
#pragma once
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "core/dtype.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tally::runtime::cpu {

#if defined(__AVX512F__)
// The lanes of a loop's 16 values that lie before its end: all 16 while `remaining` (the
// values left from this vector on) is 16 or more, the first `remaining` in the last vector.
inline __mmask16 lanes_mask(int64_t remaining) {
  return static_cast<__mmask16>(remaining >= 16 ? 0xFFFFu : (1u << remaining) - 1u);
}
#endif
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The lanes of `mask` of 16 floats, rounded to bf16 nearest even (one vcvtneps2bf16), to p.
inline void store_bf16x16(BFloat16* p, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(static_cast<void*>(p), mask, std::bit_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}
#endif

// src[0..n) rounded to bf16 into dst, nearest even. With AVX512-BF16 (both machine kinds
// tally targets) one vcvtneps2bf16 per 16 values, as oneDNN rounds its bf16 outputs, the
// last partial 16 through the same instruction under a mask; elsewhere bf16_round_bits,
// which GCC vectorizes in ~6 integer operations a value. (The instruction also flushes
// fp32 denormals, below 1.2e-38, to zero: wherever a value sits in the row, since the
// tail takes the instruction too.)
inline void round_to_bf16(const float* src, BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  for (; i + 16 <= n; i += 16) {
    const __m256bh packed = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + i));
    std::memcpy(static_cast<void*>(dst + i), &packed, sizeof(packed));  // one 32-byte store
  }
  if (i < n) {
    const __mmask16 mask = lanes_mask(n - i);
    store_bf16x16(dst + i, mask, _mm512_maskz_loadu_ps(mask, src + i));
  }
#else
  for (; i < n; ++i) dst[i].bits = bf16_round_bits(src[i]);
#endif
}

// src[0..n) widened from bf16 to fp32 into dst: exact, a 16-bit shift per value, which GCC
// vectorizes (the inverse of round_to_bf16's rounding).
inline void widen_bf16(const BFloat16* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(src[i].bits) << 16);
}

// exp(x) = 2^n * exp(r), n = round(x / ln2), r = x - n ln2 in [-ln2/2, ln2/2];
// exp(r) by a degree-6 minimax polynomial; 2^n assembled in the exponent bits.
inline float vexp(float x_in) {
  // Clamped where 2^n stays a normal float: n = round(x / ln2) in [-126, 127], so the top
  // is 127.5 ln2 (exp = 2.4e38; at 88.7, n = 128 would make infinity). (std::fmin/fmax are libm
  // calls: no SIMD.) Below the bottom the result is 0: the true value is at most 1.2e-38
  // there, and exp(-inf), a masked score, must be exactly 0, not exp(-87.3).
  const float x = std::min(std::max(x_in, -87.3f), 88.37626f);
  // Round to nearest by truncating x/ln2 +- 0.5 (std::floor blocks GCC's vectorizer).
  const float t = x * 1.44269504088896341f;
  const int32_t ni = static_cast<int32_t>(t + std::copysign(0.5f, t));
  const float n = static_cast<float>(ni);
  float r = x - n * 0.693359375f;  // ln2 split in two for an exact first product
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n, or 0 below the clamp: a mask on its bits, not a branch or a select, which GCC does
  // not vectorize ("control flow in loop": exp_shifted would take 7.6 ns a value on AVX2,
  // not 0.9).
  const int32_t keep = -static_cast<int32_t>(x_in >= -87.3f);  // all ones, or 0 (NaN: p stays NaN)
  const int32_t bits = ((ni + 127) << 23) & keep;
  return p * std::bit_cast<float>(bits);
}
inline double vexp(double x) { return std::exp(x); }

#if defined(__AVX512F__)
// vexp of 16 floats in explicit AVX-512: the same clamp, reduction and polynomial, with
// n = round(x log2 e) by one vrndscaleps and 2^n p by one vscalefps instead of the integer
// assembly of 2^n (copysign, add, two conversions, shift, multiply). 15 vector
// instructions against ~21; the clamp still keeps 2^n p a normal float, as vexp's does (a
// denormal P would send the GEMMs it feeds into microcode assists). Values equal vexp's
// but where x log2 e sits at a half-integer (round-half-even here, half-away there), and
// there both are within vexp's error. A NaN stays NaN: vmaxps/vminps return their second
// operand, x, when either is NaN.
inline __m512 vexp16(__m512 x) {
  // 0 below the clamp, as vexp (a NaN compares false: it stays NaN).
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  // (The masked forms of max, min, roundscale and scalef: GCC 12 warns inside the
  // unmasked ones, which pass an undefined vector through.)
  x = _mm512_mask_max_ps(x, 0xFFFF, _mm512_set1_ps(-87.3f), x);
  x = _mm512_mask_min_ps(x, 0xFFFF, _mm512_set1_ps(88.37626f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_mask_roundscale_ps(t, 0xFFFF, t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~below), p, n);
}
#endif

// Softmax's numerators: e_c = scale exp(x[c] - shift) for c < n, written to `out` (may be
// x itself) and/or, rounded to bf16, to `rounded` (either may be null); returns the sum of
// the e_c in fp32, before any rounding. One pass: the exponential, the sum and the
// rounding of each 16 values in registers, not two passes (exp and sum, then a rounding
// pass reading them back). A scale of 1 multiplies exactly.
inline float exp_shifted(const float* x, float shift, int64_t n, float* out, BFloat16* rounded, float scale = 1.0f) {
  int64_t c = 0;
  float sum = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(shift), k = _mm512_set1_ps(scale);
  __m512 acc = _mm512_setzero_ps();
  for (; c < n; c += 16) {
    const __mmask16 mask = lanes_mask(n - c);
    const __m512 e = _mm512_maskz_mul_ps(mask, k, vexp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, x + c), s)));
    acc = _mm512_add_ps(acc, e);
    if (out) _mm512_mask_storeu_ps(out + c, mask, e);
    if (rounded) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      store_bf16x16(rounded + c, mask, e);
#else
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, e);
      for (int64_t k = 0; k < std::min<int64_t>(16, n - c); ++k) rounded[c + k].bits = bf16_round_bits(lanes[k]);
#endif
    }
  }
  alignas(64) float lanes[16];  // (not _mm512_reduce_add_ps: GCC 12 warns inside it)
  _mm512_store_ps(lanes, acc);
  for (float lane : lanes) sum += lane;
#else
  // Sixteen running sums, one per lane, combined in order at the end, as the AVX-512 loop
  // above keeps them: the sum is the same whichever outputs are written, and the loop is
  // a SIMD one (with the null checks inside and one scalar `sum +=`, which GCC may not
  // reassociate, it would stay scalar, and on an AVX2 CPU the bf16 cross-entropy backward
  // and attention's softmax would spend most of their time here). out[c] may be x[c]: each lane
  // reads its element before writing it.
  constexpr int64_t kLanes = 16;
  float lane_sums[kLanes] = {};
  auto block = [&](auto writes_out, auto writes_rounded, int64_t start, int64_t count) {
#pragma omp simd
    for (int64_t k = 0; k < count; ++k) {
      const float e = scale * vexp(x[start + k] - shift);
      lane_sums[k] += e;
      if constexpr (decltype(writes_out)::value) out[start + k] = e;
      if constexpr (decltype(writes_rounded)::value) rounded[start + k].bits = bf16_round_bits(e);
    }
  };
  auto run = [&](auto writes_out, auto writes_rounded) {
    for (; c + kLanes <= n; c += kLanes) block(writes_out, writes_rounded, c, kLanes);
    if (c < n) block(writes_out, writes_rounded, c, n - c);
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (out && rounded) run(Yes{}, Yes{});
  else if (out) run(Yes{}, No{});
  else if (rounded) run(No{}, Yes{});
  else run(No{}, No{});
  for (float lane : lane_sums) sum += lane;
#endif
  return sum;
}

// tanh(x) = sign(x) (1 - 2 / (exp(2|x|) + 1)): absolute error ~1e-7, which is what GELU
// needs (it uses tanh inside 0.5 x (1 + tanh(.))).
inline float vtanh(float x) {
  const float e = vexp(2.0f * std::fabs(x));
  const float t = 1.0f - 2.0f / (e + 1.0f);
  return std::copysign(t, x);
}
inline double vtanh(double x) { return std::tanh(x); }

// The first x of SiLU's x sigmoid(x), held at -88.38 below it: there vexp(-x) stops at
// 2.4e38 (its clamp), so sigmoid(x) stays 4e-39 and x sigmoid(x) would grow with |x|
// (silu(-1e38) would read -0.42) where the true value is 0; held, it is at most 3.7e-37 (the
// true |x| e^x is below 2e-37 from x = -89 on). A max keeps the callers' loops vectorized (a
// conditional around the sigmoid does not: SwiGLU's forward on llama3-d6 would take 4.4 ms,
// not 0.5).
// fp64's exp has no clamp: x as it is.
inline float silu_arg(float x) { return std::max(x, -88.37626f); }
inline double silu_arg(double x) { return x; }

// max(init, x[0], ..., x[n-1]), vectorized. A running `m = std::max(m, x[j])` stays scalar
// without -ffast-math (GCC may not reassociate a max that has to honour NaN and signed
// zeros), and it is a chain of dependent 3-4 cycle max instructions: over a 50k-entry
// logits row that would be most of the cross-entropy forward. fp32 with AVX-512 (both machine
// kinds) runs one vmaxps per 16 values, the last partial 16 under a mask. Elsewhere
// sixteen independent lanes, combined at the end: GCC may keep them in 16 scalar
// registers (16 vmaxss per 16 values), still free of the dependency chain.
// A NaN in x is skipped, as std::max(m, NaN) skips it.
template <class T> inline T row_max(const T* x, int64_t n, T init) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float>) {
    // vmaxps(x, m) returns its second operand when either is NaN: a NaN in x is skipped.
    __m512 m16 = _mm512_set1_ps(init);
    int64_t j = 0;
    // (The masked form throughout: GCC 12 warns inside _mm512_max_ps, whose unmasked
    // form passes an undefined vector through.)
    for (; j + 16 <= n; j += 16) m16 = _mm512_mask_max_ps(m16, 0xFFFF, _mm512_loadu_ps(x + j), m16);
    if (j < n) {
      const __mmask16 mask = lanes_mask(n - j);
      m16 = _mm512_mask_max_ps(m16, mask, _mm512_maskz_loadu_ps(mask, x + j), m16);
    }
    alignas(64) float lanes[16];  // (not _mm512_reduce_max_ps, for the same warning)
    _mm512_store_ps(lanes, m16);
    float m = lanes[0];
    for (int k = 1; k < 16; ++k) m = lanes[k] > m ? lanes[k] : m;
    return m;
  }
#endif
  constexpr int64_t kLanes = 16;
  T lane[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) lane[k] = init;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lane[k] = x[j + k] > lane[k] ? x[j + k] : lane[k];
  T m = init;
  for (int64_t k = 0; k < kLanes; ++k) m = lane[k] > m ? lane[k] : m;
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

}  // namespace tally::runtime::cpu
