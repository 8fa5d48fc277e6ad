#include "data/token_shard.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "core/atomic_file.h"
#include "core/error.h"

namespace tally::data {
namespace {

// The format is little-endian and we read it with memcpy.
static_assert(std::endian::native == std::endian::little, "token shards assume a little-endian host");

constexpr int kHeaderInts = 256;
constexpr std::size_t kHeaderBytes = kHeaderInts * sizeof(int32_t);
constexpr int32_t kGpt2Magic = 20240520, kGpt2Version = 1;
constexpr int32_t kLlama3Magic = 20240801, kLlama3Version = 7;

std::size_t width_bytes(TokenWidth w) { return w == TokenWidth::U16 ? 2 : 4; }

std::string errno_text() { return std::strerror(errno); }

}  // namespace

// ---------------------------------------------------------------------------------------------

void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens, TokenWidth width) {
  const int64_t max_token = width == TokenWidth::U16 ? 0xFFFF : INT32_MAX;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    TALLY_CHECK(tokens[i] >= 0 && tokens[i] <= max_token, "token shard '", path, "': token ", i, " is ", tokens[i],
                ", which does not fit ", width == TokenWidth::U16 ? "uint16" : "uint32", " (expected 0..", max_token,
                ")");
  }
  TALLY_CHECK(tokens.size() <= static_cast<std::size_t>(INT32_MAX), "token shard '", path, "': ", tokens.size(),
              " tokens, expected at most ", INT32_MAX, " (the header stores the count as int32)");

  int32_t header[kHeaderInts] = {};
  header[0] = width == TokenWidth::U16 ? kGpt2Magic : kLlama3Magic;
  header[1] = width == TokenWidth::U16 ? kGpt2Version : kLlama3Version;
  header[2] = static_cast<int32_t>(tokens.size());

  std::vector<unsigned char> body(tokens.size() * width_bytes(width));
  if (width == TokenWidth::U16) {
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const auto v = static_cast<uint16_t>(tokens[i]);
      std::memcpy(body.data() + 2 * i, &v, 2);
    }
  } else if (!tokens.empty()) {
    std::memcpy(body.data(), tokens.data(), body.size());
  }

  AtomicFile out(path, "token shard");
  out.write(header, sizeof header);
  out.write(body.data(), body.size());
  out.commit();
}

// ---------------------------------------------------------------------------------------------

TokenShard TokenShard::open(const std::string& path) {
  TokenShard s;
  s.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TALLY_CHECK(fd >= 0, "token shard '", path, "': cannot open: ", errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const std::string err = errno_text();
    ::close(fd);
    TALLY_FAIL("token shard '", path, "': cannot stat: ", err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    TALLY_FAIL("token shard '", path, "': expected a regular file, found ",
               S_ISDIR(st.st_mode) ? "a directory" : "a special file");
  }
  const auto file_bytes = static_cast<std::size_t>(st.st_size);
  if (file_bytes < kHeaderBytes) {
    ::close(fd);
    TALLY_FAIL("token shard '", path, "': file is ", file_bytes, " bytes, expected at least ", kHeaderBytes,
               " (the 256 x int32 header)");
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const std::string map_err = map == MAP_FAILED ? errno_text() : "";
  ::close(fd);  // the mapping keeps the file open
  TALLY_CHECK(map != MAP_FAILED, "token shard '", path, "': mmap of ", file_bytes, " bytes failed: ", map_err);
  // From here on `s` owns the mapping, so a failed check below unmaps it.
  s.map_ = map;
  s.map_bytes_ = file_bytes;

  int32_t header[3];
  std::memcpy(header, map, sizeof header);
  const int32_t magic = header[0], version = header[1], ntok = header[2];
  if (magic == kGpt2Magic) {
    TALLY_CHECK(version == kGpt2Version, "token shard '", path, "': version ", version, ", expected ", kGpt2Version,
                " for magic ", kGpt2Magic, " (GPT-2, uint16 tokens)");
    s.width_ = TokenWidth::U16;
  } else if (magic == kLlama3Magic) {
    TALLY_CHECK(version == kLlama3Version, "token shard '", path, "': version ", version, ", expected ",
                kLlama3Version, " for magic ", kLlama3Magic, " (LLaMA-3, uint32 tokens)");
    s.width_ = TokenWidth::U32;
  } else {
    TALLY_FAIL("token shard '", path, "': bad magic ", magic, ", expected ", kGpt2Magic, " (GPT-2, uint16 tokens) or ",
               kLlama3Magic, " (LLaMA-3, uint32 tokens)");
  }
  TALLY_CHECK(ntok >= 0, "token shard '", path, "': header says ", ntok, " tokens, expected a count >= 0");
  const std::size_t expected = kHeaderBytes + static_cast<std::size_t>(ntok) * width_bytes(s.width_);
  TALLY_CHECK(file_bytes == expected, "token shard '", path, "': file is ", file_bytes, " bytes but header says ",
              ntok, " tokens (expected ", expected, " bytes)");
  s.ntok_ = ntok;
  s.tokens_ = static_cast<const unsigned char*>(map) + kHeaderBytes;
  return s;
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      width_(other.width_),
      ntok_(std::exchange(other.ntok_, 0)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      tokens_(std::exchange(other.tokens_, nullptr)) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    width_ = other.width_;
    ntok_ = std::exchange(other.ntok_, 0);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tokens_ = std::exchange(other.tokens_, nullptr);
  }
  return *this;
}

TokenShard::~TokenShard() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void TokenShard::check_range(int64_t start, int64_t count) const {
  if (start < 0 || count < 0 || start > ntok_ || count > ntok_ - start)
    throw std::out_of_range("tally: token shard '" + path_ + "': tokens [" + std::to_string(start) + ", " +
                            std::to_string(start) + "+" + std::to_string(count) + ") are outside [0, " +
                            std::to_string(ntok_) + ")");
}

int32_t TokenShard::at(int64_t i) const {
  check_range(i, 1);
  int32_t v;
  read(i, 1, &v);
  return v;
}

void TokenShard::read(int64_t start, int64_t count, int32_t* out) const {
  check_range(start, count);
  if (width_ == TokenWidth::U16) {
    const unsigned char* p = tokens_ + 2 * start;
    for (int64_t i = 0; i < count; ++i) {
      uint16_t v;
      std::memcpy(&v, p + 2 * i, 2);
      out[i] = v;
    }
  } else if (count > 0) {
    // Values above INT32_MAX can't be produced by write_token_shard; a foreign file with such
    // a token would read back negative, which every consumer rejects as an invalid id.
    std::memcpy(out, tokens_ + 4 * start, static_cast<std::size_t>(count) * 4);
  }
}

namespace {
// SplitMix64's finalizer: every bit of (position, token) moves every bit of the hash.
inline uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

TokenShard::Scan TokenShard::scan(int64_t limit, int64_t first_position) const {
  // Chunks scanned in parallel; the first offending chunk in order gives the position, and
  // the fingerprint is a sum, so the chunks' add up in any order.
  constexpr int64_t kChunk = 1 << 20;
  const int64_t chunks = (ntok_ + kChunk - 1) / kChunk;
  int64_t first_bad_chunk = chunks;
  uint64_t fingerprint = 0;
  auto hash = [&](int64_t i, uint32_t v) {
    return mix((static_cast<uint64_t>(first_position + i) << 32) ^ v ^ 0x9e3779b97f4a7c15ULL);
  };
#pragma omp parallel for schedule(static) reduction(min : first_bad_chunk) reduction(+ : fingerprint)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(ntok_, begin + kChunk);
    bool bad = false;
    uint64_t sum = 0;
    if (width_ == TokenWidth::U16) {
      for (int64_t i = begin; i < end; ++i) {
        uint16_t v;
        std::memcpy(&v, tokens_ + 2 * i, 2);
        bad |= v >= limit;
        sum += hash(i, v);
      }
    } else {
      for (int64_t i = begin; i < end; ++i) {
        uint32_t v;
        std::memcpy(&v, tokens_ + 4 * i, 4);
        bad |= v >= limit;
        sum += hash(i, v);
      }
    }
    fingerprint += sum;
    if (bad) first_bad_chunk = std::min(first_bad_chunk, c);
  }
  Scan result;
  result.fingerprint = fingerprint;
  if (first_bad_chunk == chunks) return result;
  for (int64_t i = first_bad_chunk * kChunk;; ++i) {
    uint32_t v = 0;
    if (width_ == TokenWidth::U16) {
      uint16_t h;
      std::memcpy(&h, tokens_ + 2 * i, 2);
      v = h;
    } else {
      std::memcpy(&v, tokens_ + 4 * i, 4);
    }
    if (v >= limit) {
      result.first_at_or_above = i;
      return result;
    }
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what) {
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> paths;
  if (rc == 0) paths.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  TALLY_CHECK(rc != GLOB_NOMATCH, what, " '", pattern, "': no files match");
  TALLY_CHECK(rc == 0, what, " '", pattern, "': expanding the pattern failed (",
              rc == GLOB_ABORTED ? "a directory could not be read" : rc == GLOB_NOSPACE ? "out of memory" : "glob error",
              ")");
  // glob(3) sorts by the locale's collation; bytewise order is the same on every machine.
  std::sort(paths.begin(), paths.end());
  return paths;
}

}  // namespace tally::data
