// llm.c token shards: a 1024-byte header of 256 little-endian int32
//   [0] magic, [1] version, [2] number of tokens, [3..255] zero
// followed by the tokens, little-endian:
//   GPT-2    shards: magic 20240520, version 1, uint16 tokens
//   LLaMA-3  shards: magic 20240801, version 7, uint32 tokens
// The file is exactly 1024 + ntok * width bytes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tally::data {

enum class TokenWidth { U16, U32 };

// Writes a shard atomically: to `path + ".tmp"`, fsync, then rename over `path`, so readers
// never see a partial file. Throws std::runtime_error naming the first token that does not fit
// the width (index and value), or the file and the failing system call.
void write_token_shard(const std::string& path, const std::vector<int32_t>& tokens, TokenWidth width);

// A read-only, memory-mapped shard. Movable, not copyable.
class TokenShard {
 public:
  // Validates magic, version, token count and file length; throws std::runtime_error naming
  // the file and what was expected vs found.
  static TokenShard open(const std::string& path);

  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  int64_t size() const { return ntok_; }                   // number of tokens
  int32_t at(int64_t i) const;                             // throws std::out_of_range
  void read(int64_t start, int64_t count, int32_t* out) const;  // throws std::out_of_range
  const std::string& path() const { return path_; }
  TokenWidth width() const { return width_; }
  // What the loader checks of every shard before training, in one linear scan of the
  // mapping (a few GB/s): the position of the first token >= `limit` (a model's vocabulary
  // size) or -1, and a fingerprint of the tokens: the sum over positions of a hash of
  // (first_position + position, token), so that shards read one after another add up to
  // their concatenation's. Ranks compare it: a rank whose shards hold other tokens of the
  // same count would otherwise train on them without a word.
  struct Scan {
    int64_t first_at_or_above = -1;
    uint64_t fingerprint = 0;
  };
  Scan scan(int64_t limit, int64_t first_position = 0) const;
  int64_t find_token_at_or_above(int64_t limit) const { return scan(limit).first_at_or_above; }

 private:
  TokenShard() = default;
  void check_range(int64_t start, int64_t count) const;

  std::string path_;
  TokenWidth width_ = TokenWidth::U16;
  int64_t ntok_ = 0;
  void* map_ = nullptr;  // the whole file
  std::size_t map_bytes_ = 0;
  const unsigned char* tokens_ = nullptr;  // map_ + 1024
};

// Expands a glob(3) pattern (e.g. "data/fineweb_train_*.bin") to the matching paths, sorted
// bytewise. Throws naming `what` (the flag, e.g. "--train-data") and the pattern if nothing
// matches.
std::vector<std::string> expand_glob(const std::string& pattern, const std::string& what = "pattern");

}  // namespace tally::data
