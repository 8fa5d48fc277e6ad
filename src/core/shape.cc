#include "core/shape.h"

namespace tally {

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(shape[i]);
  }
  s += ']';
  return s;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    // Shapes can come from files (safetensors headers): a wrapped count must not reach an
    // allocation. The check is one flag test per dimension.
    TALLY_CHECK(d >= 0, "shape ", shape_str(shape), " has a negative dimension");
    TALLY_CHECK(!__builtin_mul_overflow(n, d, &n), "shape ", shape_str(shape), " has more than 2^63 elements");
  }
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    TALLY_CHECK(da == db || da == 1 || db == 1, op, ": shapes ", shape_str(a), " and ", shape_str(b),
                " cannot be broadcast together");
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace tally
