// Overflow-checked size arithmetic. Every size computed from a file header or a flag goes
// through these before anything is allocated or read: a wrapped product would otherwise
// pass a size check (an llm.c header whose parameter count x 4 wraps to the file's size)
// and reach an allocation or a read past the end.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "core/error.h"

namespace tally {

// a * b, or a tally::Error naming `what` when the product leaves int64 or an operand is
// negative (sizes are never negative).
template <class... Context>
int64_t checked_mul(int64_t a, int64_t b, const Context&... what) {
  int64_t r = 0;
  TALLY_CHECK(a >= 0 && b >= 0 && !__builtin_mul_overflow(a, b, &r), what..., ": ", a, " x ", b,
              a < 0 || b < 0 ? " has a negative size" : " overflows a 64-bit size");
  return r;
}

template <class... Context>
int64_t checked_add(int64_t a, int64_t b, const Context&... what) {
  int64_t r = 0;
  TALLY_CHECK(a >= 0 && b >= 0 && !__builtin_add_overflow(a, b, &r), what..., ": ", a, " + ", b,
              a < 0 || b < 0 ? " has a negative size" : " overflows a 64-bit size");
  return r;
}

// The product of several sizes, checked at every step.
template <class... Context>
int64_t checked_product(std::initializer_list<int64_t> factors, const Context&... what) {
  int64_t r = 1;
  for (int64_t f : factors) r = checked_mul(r, f, what...);
  return r;
}

}  // namespace tally
