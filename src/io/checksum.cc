#include "io/checksum.h"

#include <zlib.h>

#include <algorithm>

namespace tally::io {

void Crc32::update(const void* data, size_t bytes) {
  // zlib takes a uInt length: feed large buffers in 1 GiB pieces.
  const auto* p = static_cast<const unsigned char*>(data);
  while (bytes > 0) {
    const size_t n = std::min<size_t>(bytes, size_t{1} << 30);
    crc_ = static_cast<uint32_t>(crc32(crc_, p, static_cast<uInt>(n)));
    p += n;
    bytes -= n;
  }
}

}  // namespace tally::io
