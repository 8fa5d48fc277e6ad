// Byte-level BPE tokenizers: GPT-2's, byte-exact with OpenAI's encoder.py; LLaMA-3's,
// read from HuggingFace's tokenizer.json (128,000 merge-ranked tokens, 256 special tokens),
// byte-exact with Meta's tiktoken tokenizer; and Qwen's (Qwen2.5's and Qwen3's
// tokenizer.json: 151,643 tokens, 26 added ones). All share the byte alphabet and the BPE;
// they differ in the pre-tokenization regex, and LLaMA-3 looks a whole piece up before
// merging (tokenizer.json's ignore_merges, tiktoken's behaviour). LLaMA-3's regex:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// also implemented by hand over UTF-8; Qwen's is the same with \p{N} for \p{N}{1,3} (a
// number is a piece per digit), after the text is put in Unicode's normalization form C
// (utf8proc). Text that is not valid UTF-8 is, for both, first decoded as Python's
// errors="replace" and JavaScript's TextDecoder do: each maximal invalid subsequence becomes
// U+FFFD (HuggingFace's and Meta's tokenizers take a str, so the bytes are gone).
//
// GPT-2's pipeline of encode():
// Pipeline of encode():
//   1. split the text with GPT-2's pre-tokenization regex
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      (implemented by hand over UTF-8; \s is the Unicode White_Space property),
//   2. apply the BPE merges, in rank order, to the raw bytes of each piece,
//   3. map the resulting byte strings to ids.
// Tokens are kept as raw bytes internally: OpenAI's byte -> printable-unicode mapping is only
// undone once, when encoder.json / vocab.bpe are read.
//
// Special and added tokens ("<|endoftext|>", "<|begin_of_text|>", Qwen's "<think>") inside
// the text are NOT special:
// like GPT-2's encode() and tiktoken's encode_ordinary() they are tokenized as ordinary
// text. Insert document_separator_id() yourself where a document boundary is wanted.
//
// GPT-2: input that is not valid UTF-8 is still encoded losslessly: each invalid byte is
// treated as one "other" (punctuation-like) character, so decode(encode(s)) == s for any
// byte string.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace tally::data {

// LLaMA-3's tokenizer: its vocabulary's size and the ids of the special tokens that begin
// and end a text (what `tally tokenize` writes, and what a LLaMA export's config names).
constexpr int64_t kLlama3VocabSize = 128256;
constexpr int32_t kLlama3BeginOfText = 128000, kLlama3EndOfText = 128001;
// Qwen's: <|endoftext|> separates (and begins and ends) documents, <|im_end|> ends a chat
// turn. The models round the vocabulary up past the tokenizer's 151,669 tokens: 151,936
// rows, 152,064 for Qwen2.5-7B.
constexpr int32_t kQwenEndOfText = 151643, kQwenImEnd = 151645;
constexpr int64_t kQwenVocabSize = 151936, kQwen25LargeVocabSize = 152064;

class Tokenizer {
 public:
  // Loads OpenAI's GPT-2 files: encoder.json (token string -> id) and vocab.bpe ("#version"
  // line, then one merge "a b" per line in rank order). Throws std::runtime_error naming the
  // file and what was expected vs found.
  static Tokenizer load(const std::string& encoder_json_path, const std::string& vocab_bpe_path);

  // Loads llm.c's tokenizer.bin (decode only: it has no merges). Layout: 256 x int32 header
  // {20240328, version, vocab_size, eot_id (version 2 only)}, then per token a uint8 length
  // and that many raw bytes. Version 1 has no eot field; eot is then 50256.
  static Tokenizer load_llmc(const std::string& tokenizer_bin_path);

  // Loads LLaMA-3's or Qwen's tokenizer.json (HuggingFace's format: model.vocab,
  // model.merges as "a b" strings or [a, b] pairs, added_tokens), telling them apart by their
  // pre-tokenizer and checking the rest of the pipeline is that family's.
  static Tokenizer load_tokenizer_json(const std::string& tokenizer_json_path);

  // Whatever `path` holds: a directory with tokenizer.json (LLaMA-3, Qwen) or encoder.json +
  // vocab.bpe (GPT-2), a tokenizer.json file, or an llm.c tokenizer .bin.
  static Tokenizer load_path(const std::string& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Text (UTF-8 bytes) -> token ids. Safe to call from several threads at once.
  // Throws std::logic_error on a tokenizer loaded with load_llmc (it has no merges).
  std::vector<int32_t> encode(std::string_view text) const;

  // Ids -> raw bytes (not necessarily valid UTF-8 for an arbitrary slice of ids).
  // Throws std::invalid_argument for an id outside [0, vocab_size()).
  std::string decode(const std::vector<int32_t>& ids) const;
  std::string decode_token(int32_t id) const;

  int vocab_size() const;
  int eot_id() const;  // GPT-2's and Qwen's <|endoftext|>, LLaMA-3's <|end_of_text|>
  // The token tally writes before each document: GPT-2's and Qwen's <|endoftext|> (llm.c's
  // convention), LLaMA-3's <|begin_of_text|>.
  int document_separator_id() const;
  // Tokens that end a generated sample: the end of text and the document separator (Qwen:
  // <|endoftext|> and <|im_end|>, a chat turn's end).
  std::vector<int32_t> stop_ids() const;
  bool is_llama3() const;
  bool is_qwen() const;
  bool can_encode() const;  // false for load_llmc tokenizers

 private:
  static Tokenizer load_tokenizer_json_unchecked(const std::string& tokenizer_json_path);
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tally::data
