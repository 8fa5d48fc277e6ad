// Element types a tensor can hold, and the bfloat16 storage type.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace tally {

enum class DType : uint8_t { F32, BF16, F64, I32, I64, U16 };

// bfloat16: the top 16 bits of an IEEE float. Conversion rounds to nearest even,
// which is what oneDNN, CUDA's __float2bfloat16 and PyTorch do.
// The bits of f rounded to bfloat16: nearest even, a NaN kept a quiet NaN. Branch-free,
// so loops over it vectorize (vcvtneps2bf16's rounding on AVX512-BF16).
inline uint16_t bf16_round_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float f) : bits(bf16_round_bits(f)) {}
  explicit operator float() const {
    uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F64: return 8;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U16: return 2;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::U16: return "uint16";
  }
  return "?";
}

inline bool is_floating(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F64; }

// Maps a C++ element type to its DType; used by typed accessors (Tensor::data<T>()).
template <class T> struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::F32; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::BF16; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::F64; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::I32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::I64; };
template <> struct DTypeOf<uint16_t> { static constexpr DType value = DType::U16; };

}  // namespace tally
