// GPT-2 byte-level BPE tokenizer, byte-exact with OpenAI's GPT-2 encoder (encoder.py).
//
// Pipeline of encode():
//   1. split the text with GPT-2's pre-tokenization regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (implemented by hand over UTF-8; \s is the Unicode White_Space property),
//   2. apply the BPE merges, in rank order, to the raw bytes of each piece,
//   3. map the resulting byte strings to ids.
// Tokens are kept as raw bytes internally: OpenAI's byte -> printable-unicode mapping is only
// undone once, when encoder.json / vocab.bpe are read.
//
// "<|endoftext|>" inside the text is NOT special: like GPT-2's encode() it is tokenized as
// ordinary text. Append eot_id() yourself where a document boundary is wanted.
//
// Input that is not valid UTF-8 is still encoded losslessly: each invalid byte is treated as
// one "other" (punctuation-like) character, so decode(encode(s)) == s for any byte string.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tally::data {

class Gpt2Tokenizer {
 public:
  // Loads OpenAI's GPT-2 files: encoder.json (token string -> id) and vocab.bpe ("#version"
  // line, then one merge "a b" per line in rank order). Throws std::runtime_error naming the
  // file and what was expected vs found.
  static Gpt2Tokenizer load(const std::string& encoder_json_path, const std::string& vocab_bpe_path);

  // Loads llm.c's tokenizer.bin (decode only: it has no merges). Layout: 256 x int32 header
  // {20240328, version, vocab_size, eot_id (version 2 only)}, then per token a uint8 length
  // and that many raw bytes. Version 1 has no eot field; eot is then 50256.
  static Gpt2Tokenizer load_llmc(const std::string& tokenizer_bin_path);

  Gpt2Tokenizer(Gpt2Tokenizer&&) noexcept;
  Gpt2Tokenizer& operator=(Gpt2Tokenizer&&) noexcept;
  ~Gpt2Tokenizer();

  // Text (UTF-8 bytes) -> token ids. Safe to call from several threads at once.
  // Throws std::logic_error on a tokenizer loaded with load_llmc (it has no merges).
  std::vector<int32_t> encode(std::string_view text) const;

  // Ids -> raw bytes (not necessarily valid UTF-8 for an arbitrary slice of ids).
  // Throws std::invalid_argument for an id outside [0, vocab_size()).
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode_token(int32_t id) const;

  int vocab_size() const;
  int eot_id() const;
  bool can_encode() const;  // false for load_llmc tokenizers

 private:
  Gpt2Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tally::data
