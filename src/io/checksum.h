// CRC-32 (zlib's) over the bytes tally writes, so bit rot in a checkpoint is a clear error
// at load rather than silently wrong weights or moments.
#pragma once
#include <cstddef>
#include <cstdint>

namespace tally::io {

class Crc32 {
 public:
  void update(const void* data, size_t bytes);
  uint32_t value() const { return crc_; }

 private:
  uint32_t crc_ = 0;
};

}  // namespace tally::io
