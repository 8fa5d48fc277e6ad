// Shapes and strides: a small vector of int64 held inline.
//
// Every tensor, view and autograd edge carries one or two of these, so a heap-backed
// vector would put two or three malloc/free pairs into every op; that allocation cost,
// not arithmetic, is the floor of a small op. Eight dimensions are held inline and more
// are refused with a clear error (a transformer needs at most five).
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "core/error.h"

namespace tally {

class Shape {
 public:
  static constexpr size_t kMaxDims = 8;
  using value_type = int64_t;
  using iterator = int64_t*;
  using const_iterator = const int64_t*;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(size_t n, int64_t value = 0) {
    check_capacity(n);
    size_ = static_cast<uint8_t>(n);
    std::fill(dims_, dims_ + n, value);
  }
  template <std::input_iterator It> Shape(It first, It last) { assign(first, last); }
  Shape(const std::vector<int64_t>& v) { assign(v.begin(), v.end()); }  // NOLINT: implicit by design

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t& operator[](size_t i) { return dims_[i]; }
  const int64_t& operator[](size_t i) const { return dims_[i]; }
  iterator begin() { return dims_; }
  iterator end() { return dims_ + size_; }
  const_iterator begin() const { return dims_; }
  const_iterator end() const { return dims_ + size_; }
  const int64_t* data() const { return dims_; }
  int64_t& back() { return dims_[size_ - 1]; }
  const int64_t& back() const { return dims_[size_ - 1]; }
  int64_t& front() { return dims_[0]; }
  const int64_t& front() const { return dims_[0]; }

  void push_back(int64_t v) {
    check_capacity(size_ + 1u);
    dims_[size_++] = v;
  }
  void pop_back() { --size_; }
  void clear() { size_ = 0; }
  void resize(size_t n, int64_t value = 0) {
    check_capacity(n);
    for (size_t i = size_; i < n; ++i) dims_[i] = value;
    size_ = static_cast<uint8_t>(n);
  }
  iterator insert(const_iterator pos, int64_t v) {
    check_capacity(size_ + 1u);
    const auto at = static_cast<size_t>(pos - dims_);
    std::copy_backward(dims_ + at, dims_ + size_, dims_ + size_ + 1);
    dims_[at] = v;
    ++size_;
    return dims_ + at;
  }
  iterator erase(const_iterator pos) {
    const auto at = static_cast<size_t>(pos - dims_);
    std::copy(dims_ + at + 1, dims_ + size_, dims_ + at);
    --size_;
    return dims_ + at;
  }

  bool operator==(const Shape& o) const { return size_ == o.size_ && std::equal(begin(), end(), o.begin()); }
  bool operator!=(const Shape& o) const { return !(*this == o); }
  std::vector<int64_t> to_vector() const { return {begin(), end()}; }

 private:
  template <class It> void assign(It first, It last) {
    size_t n = 0;
    for (; first != last; ++first) {
      check_capacity(n + 1);
      dims_[n++] = static_cast<int64_t>(*first);
    }
    size_ = static_cast<uint8_t>(n);
  }
  static void check_capacity(size_t n) {
    TALLY_CHECK(n <= kMaxDims, "tensors have at most ", kMaxDims, " dimensions; a shape of ", n, " was requested");
  }

  uint8_t size_ = 0;
  int64_t dims_[kMaxDims] = {};  // zeroed: copies of a Shape never read indeterminate values
};

std::string shape_str(const Shape& shape);  // "[2,3]"
int64_t shape_numel(const Shape& shape);
Shape contiguous_strides(const Shape& shape);
// The NumPy broadcast of two shapes; throws naming `op` and both shapes when incompatible.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace tally
