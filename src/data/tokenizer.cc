#include "data/tokenizer.h"

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <queue>
#include <sstream>
#include <stdexcept>

#include "core/error.h"
#include "core/json_input.h"
#include "data/unicode_tables.h"
#include <utf8proc.h>

namespace tally::data {
namespace {

constexpr int32_t kLlmcTokenizerMagic = 20240328;
constexpr int kLlmcHeaderInts = 256;
constexpr int32_t kGpt2Eot = 50256;
constexpr const char* kEotString = "<|endoftext|>";

// Pieces longer than this are BPE'd on every call instead of cached: they are rare (long runs
// of punctuation or digits) and would only bloat the cache.
constexpr std::size_t kMaxCachedPieceBytes = 128;
// The cache is dropped when it reaches this many entries, bounding memory on endless streams
// of novel words (~100 MB worst case); English text needs far fewer.
constexpr std::size_t kMaxCacheEntries = 1 << 20;
// Pieces at least this long use the O(n log n) heap BPE; shorter ones the plain O(n^2) loop,
// which is faster for the short words that make up nearly all text.
constexpr std::size_t kHeapBpeMinBytes = 48;

std::string read_file(const std::string& path, const char* what) {
  std::error_code ec;
  TALLY_CHECK(!std::filesystem::is_directory(path, ec), what, " '", path, "': expected a file, found a directory");
  std::ifstream in(path, std::ios::binary);
  TALLY_CHECK(in.good(), "cannot open ", what, " '", path, "': ", std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  TALLY_CHECK(!in.bad(), "error reading ", what, " '", path, "'");
  return std::move(ss).str();
}

// Shortens arbitrary (possibly huge or binary-looking) file content for an error message.
std::string excerpt(std::string_view s) {
  constexpr std::size_t kMax = 60;
  if (s.size() <= kMax) return std::string(s);
  return std::string(s.substr(0, kMax)) + "...";
}

// ---------------------------------------------------------------------------------------------
// UTF-8

// Decodes one UTF-8 sequence at s[i]; returns its length, or 0 if it is not a valid, shortest
// form encoding of a non-surrogate code point (the caller then treats one byte as a character).
inline std::size_t decode_utf8(std::string_view s, std::size_t i, char32_t* cp) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  std::size_t len;
  char32_t c, min;
  if ((b0 & 0xE0) == 0xC0) {
    len = 2, c = b0 & 0x1F, min = 0x80;
  } else if ((b0 & 0xF0) == 0xE0) {
    len = 3, c = b0 & 0x0F, min = 0x800;
  } else if ((b0 & 0xF8) == 0xF0) {
    len = 4, c = b0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b & 0xC0) != 0x80) return 0;
    c = (c << 6) | (b & 0x3F);
  }
  if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
  *cp = c;
  return len;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenization: GPT-2's regex, by hand.
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+

enum class CharClass : uint8_t { kLetter, kNumber, kSpace, kOther };

struct CharInfo {
  std::size_t len;  // bytes
  CharClass cls;
};

constexpr std::array<CharClass, 128> make_ascii_classes() {
  std::array<CharClass, 128> t{};
  for (int c = 0; c < 128; ++c) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
      t[c] = CharClass::kLetter;
    else if (c >= '0' && c <= '9')
      t[c] = CharClass::kNumber;
    else if (c == ' ' || (c >= 0x09 && c <= 0x0D))
      t[c] = CharClass::kSpace;
    else
      t[c] = CharClass::kOther;
  }
  return t;
}
constexpr std::array<CharClass, 128> kAsciiClass = make_ascii_classes();

inline CharInfo char_at(std::string_view s, std::size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return {1, kAsciiClass[b0]};
  char32_t cp;
  const std::size_t len = decode_utf8(s, i, &cp);
  // Invalid UTF-8 has no GPT-2 reference (encoder.py works on decoded str). Each bad byte is
  // one character of the "other" class, as U+FFFD (a symbol) would be, and keeps its own bytes
  // so that decode(encode(s)) == s.
  if (len == 0) return {1, CharClass::kOther};
  if (unicode::is_letter(cp)) return {len, CharClass::kLetter};
  if (unicode::is_number(cp)) return {len, CharClass::kNumber};
  if (unicode::is_white_space(cp)) return {len, CharClass::kSpace};
  return {len, CharClass::kOther};
}

// Calls emit(piece) for each regex match, in order. The matches tile the whole text.
template <class Emit>
void split_gpt2(std::string_view text, Emit&& emit) {
  const std::size_t n = text.size();
  std::size_t i = 0;
  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d : tried first, so "'sup" splits as "'s" + "up" (as in GPT-2).
    if (text[i] == '\'' && i + 1 < n) {
      const char a = text[i + 1];
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        emit(text.substr(i, 2));
        i += 2;
        continue;
      }
      if (i + 2 < n) {
        const char b = text[i + 2];
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
          emit(text.substr(i, 3));
          i += 3;
          continue;
        }
      }
    }
    // " ?X+" for X in {letters, numbers, other}: an optional ASCII space, then a run of one
    // class. The class is decided by the character after the space (if there is a space).
    std::size_t j = (text[i] == ' ' && i + 1 < n) ? i + 1 : i;
    CharInfo c = char_at(text, j);
    if (c.cls != CharClass::kSpace) {
      const CharClass cls = c.cls;
      std::size_t k = j + c.len;
      while (k < n) {
        c = char_at(text, k);
        if (c.cls != cls) break;
        k += c.len;
      }
      emit(text.substr(i, k - i));
      i = k;
      continue;
    }
    // Whitespace at i (a ' ' followed by whitespace lands here too).
    //   \s+(?!\S): the longest run that is not followed by a non-space: the whole run at the
    //              end of the text, else the run minus its last character (which then becomes
    //              the optional ' ' of the next piece, or a piece of its own);
    //   \s+      : otherwise (a single whitespace character before a non-space).
    std::size_t last = i;  // start of the last whitespace character seen
    std::size_t k = i;
    while (k < n) {
      c = char_at(text, k);
      if (c.cls != CharClass::kSpace) break;
      last = k;
      k += c.len;
    }
    const std::size_t end = (k == n || last == i) ? k : last;
    emit(text.substr(i, end - i));
    i = end;
  }
}

inline bool is_cr_lf(char c) { return c == '\r' || c == '\n'; }
inline char ascii_lower(char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; }

// The length of a case-insensitive contraction 's 't 're 've 'm 'll 'd at i (0: none).
// Case folding is Unicode's simple folding, as in tiktoken's and JavaScript's (?i): the long
// s (U+017F, bytes C5 BF) folds to 's'.
std::size_t contraction_at(std::string_view text, std::size_t i) {
  const std::size_t n = text.size();
  if (text[i] != '\'' || i + 1 >= n) return 0;
  if (i + 2 < n && text[i + 1] == '\xC5' && text[i + 2] == '\xBF') return 3;  // 'ſ
  const char a = ascii_lower(text[i + 1]);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (i + 2 < n) {
    const char b = ascii_lower(text[i + 2]);
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  }
  return 0;
}

// LLaMA-3's pre-tokenization (tokenizer.h), alternative by alternative, leftmost first;
// Qwen's is the same regex with \p{N} for \p{N}{1,3}: `max_digits` numbers a piece.
template <class Emit>
void split_llama3(std::string_view text, int max_digits, Emit&& emit) {
  const std::size_t n = text.size();
  std::size_t i = 0;
  auto run_of = [&](std::size_t k, CharClass cls) {
    while (k < n) {
      const CharInfo c = char_at(text, k);
      if (c.cls != cls) break;
      k += c.len;
    }
    return k;
  };
  while (i < n) {
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (const std::size_t len = contraction_at(text, i)) {
      emit(text.substr(i, len));
      i += len;
      continue;
    }
    const CharInfo c0 = char_at(text, i);
    // [^\r\n\p{L}\p{N}]?\p{L}+ : letters, after at most one character that is none of
    // CR, LF, letter or number (a space, a tab, punctuation).
    std::size_t letters = std::string_view::npos;
    if (c0.cls == CharClass::kLetter) letters = i;
    else if (c0.cls != CharClass::kNumber && !is_cr_lf(text[i]) && i + c0.len < n &&
             char_at(text, i + c0.len).cls == CharClass::kLetter)
      letters = i + c0.len;
    if (letters != std::string_view::npos) {
      const std::size_t k = run_of(letters, CharClass::kLetter);
      emit(text.substr(i, k - i));
      i = k;
      continue;
    }
    // \p{N}{1,3} (Qwen: \p{N})
    if (c0.cls == CharClass::kNumber) {
      std::size_t k = i;
      for (int count = 0; count < max_digits && k < n; ++count) {
        const CharInfo c = char_at(text, k);
        if (c.cls != CharClass::kNumber) break;
        k += c.len;
      }
      emit(text.substr(i, k - i));
      i = k;
      continue;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]* : punctuation and symbols, after at most one ASCII space,
    // with the line breaks right after them.
    const std::size_t j = (text[i] == ' ' && i + 1 < n) ? i + 1 : i;
    if (char_at(text, j).cls == CharClass::kOther) {
      std::size_t k = run_of(j, CharClass::kOther);
      while (k < n && is_cr_lf(text[k])) ++k;
      emit(text.substr(i, k - i));
      i = k;
      continue;
    }
    // Whitespace at i. The run [i, k), its last line break and its last character:
    //   \s*[\r\n]+ : up to and including the run's last CR or LF, when it has one;
    //   \s+(?!\S)  : else the run, minus its last character when a non-space follows;
    //   \s+        : else (one whitespace character before a non-space) that character.
    std::size_t k = i, last = i, last_break = std::string_view::npos;
    while (k < n) {
      const CharInfo c = char_at(text, k);
      if (c.cls != CharClass::kSpace) break;
      if (is_cr_lf(text[k])) last_break = k;
      last = k;
      k += c.len;
    }
    std::size_t end;
    if (last_break != std::string_view::npos) end = last_break + 1;
    else end = (k == n || last == i) ? k : last;
    emit(text.substr(i, end - i));
    i = end;
  }
}

// The expected length of a UTF-8 sequence from its lead byte, and the range its second byte
// must fall in (Unicode's table 3-7: no overlongs, surrogates or code points past U+10FFFF).
struct LeadByte {
  int length;
  unsigned char second_lo, second_hi;
};
LeadByte lead_of(unsigned char b) {
  if (b < 0x80) return {1, 0, 0};
  if (b >= 0xC2 && b <= 0xDF) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b >= 0xE1 && b <= 0xEF) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  if (b >= 0xF1 && b <= 0xF3) return {4, 0x80, 0xBF};
  return {0, 0, 0};  // a continuation byte or an invalid lead
}

// `text` with each maximal invalid subsequence replaced by U+FFFD (the WHATWG decoder's
// and Python's errors="replace" rule): a valid lead byte followed by some but not all of
// its continuation bytes is one replacement; any other bad byte is one each.
std::string replace_invalid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  const std::size_t n = text.size();
  for (std::size_t i = 0; i < n;) {
    const auto b = static_cast<unsigned char>(text[i]);
    const LeadByte lead = lead_of(b);
    if (lead.length == 1) {
      out.push_back(text[i++]);
      continue;
    }
    std::size_t k = i + 1;
    if (lead.length > 1) {
      for (int m = 1; m < lead.length && k < n; ++m, ++k) {
        const auto c = static_cast<unsigned char>(text[k]);
        const bool ok = m == 1 ? (c >= lead.second_lo && c <= lead.second_hi) : (c >= 0x80 && c <= 0xBF);
        if (!ok) break;
      }
      if (k - i == static_cast<std::size_t>(lead.length)) {
        out.append(text.substr(i, k - i));
        i = k;
        continue;
      }
    }
    out += "\xEF\xBF\xBD";
    i = k;
  }
  return out;
}

// Valid UTF-8 in Unicode's normalization form C (utf8proc's composition, as HuggingFace's
// NFC normalizer). ASCII is its own NFC: it passes untouched.
std::string nfc(const std::string& valid_utf8) {
  if (std::all_of(valid_utf8.begin(), valid_utf8.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; }))
    return valid_utf8;
  utf8proc_uint8_t* composed = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(valid_utf8.data()), static_cast<utf8proc_ssize_t>(valid_utf8.size()),
                   &composed, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  TALLY_CHECK(n >= 0, "tokenizer: Unicode normalization (NFC) failed: ", utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(composed), static_cast<std::size_t>(n));
  std::free(composed);
  return out;
}

// ---------------------------------------------------------------------------------------------
// OpenAI's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes
// to U+0100.. in byte order, so every token string in encoder.json / vocab.bpe is printable.

struct ByteAlphabet {
  std::array<char32_t, 256> byte_to_cp{};
  std::array<int16_t, 512> cp_to_byte{};  // -1 if the code point encodes no byte
  ByteAlphabet() {
    cp_to_byte.fill(-1);
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      byte_to_cp[b] = printable ? b : 256 + next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// Token string as written in encoder.json / vocab.bpe -> raw bytes. Returns false (and the
// offending code point) if it uses a character outside the byte alphabet.
bool unmap_token(std::string_view s, std::string* out, char32_t* bad) {
  const ByteAlphabet& a = byte_alphabet();
  out->clear();
  for (std::size_t i = 0; i < s.size();) {
    char32_t cp;
    const std::size_t len = decode_utf8(s, i, &cp);
    if (len == 0) {
      *bad = static_cast<unsigned char>(s[i]);
      return false;
    }
    if (cp >= a.cp_to_byte.size() || a.cp_to_byte[cp] < 0) {
      *bad = cp;
      return false;
    }
    out->push_back(static_cast<char>(a.cp_to_byte[cp]));
    i += len;
  }
  return true;
}

std::string code_point_name(char32_t cp) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "U+%04X", static_cast<unsigned>(cp));
  return buf;
}

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Heterogeneous lookup so the cache can be probed with a string_view without allocating.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};

}  // namespace

// ---------------------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::vector<std::string> id_to_bytes;
  int32_t eot = kGpt2Eot;
  int32_t separator = kGpt2Eot;  // written before each document
  int32_t turn_end = -1;          // Qwen's <|im_end|>: a chat turn's end, where a sample stops
  bool can_encode = false;
  bool llama3 = false;
  bool qwen = false;  // Qwen2.5's / Qwen3's tokenizer.json: NFC first, digits one by one
  bool from_tokenizer_json() const { return llama3 || qwen; }
  // LLaMA-3: every token's bytes, for the whole-piece lookup done before merging when the
  // file's BPE sets ignore_merges (LLaMA-3's does; HuggingFace's default is off).
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> whole;
  bool ignore_merges = false;
  std::string llmc_path;  // set by load_llmc, for the message of encode()

  // Encoding tables (load() only).
  std::array<int32_t, 256> byte_id{};
  struct Merge {
    int32_t rank;
    int32_t id;  // id of the merged token
  };
  std::unordered_map<uint64_t, Merge> merges;

  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;

  // True when every merge's operands are single bytes or made only by lower-ranked merges (as
  // BPE training guarantees; checked at load). Then no merge can create a pair that outranks
  // the merge that created it, which makes bpe_heap() give the same result as bpe_simple()
  // (GPT-2's files are; LLaMA-3's are not, and it uses bpe_heap() always).
  bool ranks_well_ordered = false;

  // byte_id from the vocabulary: every byte must be a token of its own.
  void set_byte_ids(const std::unordered_map<std::string, int32_t>& bytes_to_id, const std::string& what) {
    for (int b = 0; b < 256; ++b) {
      const auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
      TALLY_CHECK(it != bytes_to_id.end(), what, ": expected a token for every byte, found none for byte ", b, " (",
                  code_point_name(byte_alphabet().byte_to_cp[b]), ")");
      byte_id[b] = it->second;
    }
  }

  // Every token but the byte tokens and `unmerged` (special tokens) must be made by some
  // merge: a token no merge makes could never be produced (the merges are truncated or from
  // another vocabulary, and encoding would silently differ). Also settles ranks_well_ordered.
  void check_merges(const std::string& what, const std::string& vocab_name, int32_t merge_count,
                    const std::vector<int32_t>& unmerged) {
    const std::size_t n = id_to_bytes.size();
    std::vector<int32_t> last_made(n, -1);  // highest rank of a merge producing each token
    for (const auto& [key, merge] : merges) last_made[merge.id] = std::max(last_made[merge.id], merge.rank);
    std::vector<bool> exempt(n, false);
    for (int b = 0; b < 256; ++b) exempt[byte_id[b]] = true;
    for (int32_t id : unmerged) exempt[id] = true;
    int64_t unmade = 0, first_unmade = -1, exempt_count = 0;
    for (std::size_t id = 0; id < n; ++id) {
      exempt_count += exempt[id];
      if (last_made[id] < 0 && !exempt[id] && unmade++ == 0) first_unmade = static_cast<int64_t>(id);
    }
    const int64_t merged = static_cast<int64_t>(n) - exempt_count;
    TALLY_CHECK(unmade == 0, what, ": ", merge_count, " merges make ", merged - unmade, " of ", vocab_name, "'s ",
                merged, " merged tokens; ", unmade, " (the first: id ", first_unmade, " \"",
                unmade ? excerpt(id_to_bytes[static_cast<std::size_t>(first_unmade)]) : std::string(),
                "\") are made by no merge: are the merges truncated or from another vocabulary?");
    ranks_well_ordered = true;
    for (const auto& [key, merge] : merges) {
      const auto a = static_cast<int32_t>(key >> 32), b = static_cast<int32_t>(key & 0xFFFFFFFFu);
      if (last_made[a] >= merge.rank || last_made[b] >= merge.rank) ranks_well_ordered = false;
    }
  }

  // Two rules for the order of merges. LLaMA-3's tokenizer (HuggingFace's BPE, tiktoken's)
  // merges the leftmost pair of lowest rank, one at a time: bpe_heap, at any length. GPT-2's
  // encoder.py merges every occurrence of the lowest-ranked pair before looking again:
  // bpe_simple, or bpe_heap for long pieces when the ranks are well ordered and the rules agree.
  // (LLaMA-3's ranks are not: its rank 1 joins "Ġ" and "ĠĠĠ", which a later merge makes.)
  void bpe(std::string_view piece, std::vector<int32_t>& out) const {
    if (from_tokenizer_json() || (piece.size() >= kHeapBpeMinBytes && ranks_well_ordered))
      bpe_heap(piece, out);
    else
      bpe_simple(piece, out);
  }

  // BPE exactly as OpenAI's encoder.py: repeatedly take the adjacent pair with the lowest merge
  // rank and merge every occurrence of it, left to right, until no adjacent pair has a rank.
  // O(n^2) in the piece length.
  void bpe_simple(std::string_view piece, std::vector<int32_t>& out) const {
    std::vector<int32_t> word;
    word.reserve(piece.size());
    for (unsigned char b : piece) word.push_back(byte_id[b]);
    std::vector<int32_t> next;
    next.reserve(word.size());
    while (word.size() > 1) {
      int32_t best_rank = INT32_MAX, best_id = -1, first = -1, second = -1;
      for (std::size_t i = 0; i + 1 < word.size(); ++i) {
        const auto it = merges.find(pair_key(word[i], word[i + 1]));
        if (it != merges.end() && it->second.rank < best_rank) {
          best_rank = it->second.rank;
          best_id = it->second.id;
          first = word[i];
          second = word[i + 1];
        }
      }
      if (best_id < 0) break;
      next.clear();
      for (std::size_t i = 0; i < word.size();) {
        if (i + 1 < word.size() && word[i] == first && word[i + 1] == second) {
          next.push_back(best_id);
          i += 2;
        } else {
          next.push_back(word[i]);
          i += 1;
        }
      }
      word.swap(next);
    }
    out.insert(out.end(), word.begin(), word.end());
  }

  // HuggingFace's rule in O(n log n): the leftmost lowest-ranked pair, one merge at a time (with
  // bpe_simple a 100 KB run of letters, e.g. base64, takes seconds, LLaMA-3's tens of seconds).
  // Symbols form a linked list; a min-heap holds candidate pairs keyed by (rank, position of the
  // left symbol). Entries made stale by an earlier merge are recognised when popped and skipped.
  // With well-ordered ranks no merge makes a pair that outranks it, so all occurrences of the
  // lowest-ranked pair are merged left to right before any higher-ranked pair, as in bpe_simple.
  void bpe_heap(std::string_view piece, std::vector<int32_t>& out) const {
    const auto n = static_cast<int32_t>(piece.size());
    struct Sym {
      int32_t id, prev, next;  // prev/next: neighbour indices, -1 at the ends; id -1: merged away
    };
    std::vector<Sym> sym(n);
    for (int32_t i = 0; i < n; ++i) sym[i] = {byte_id[static_cast<unsigned char>(piece[i])], i - 1, i + 1 < n ? i + 1 : -1};
    struct Cand {
      int32_t rank, left, right;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
    };
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    const auto push = [&](int32_t left) {
      if (left < 0) return;
      const int32_t right = sym[left].next;
      if (right < 0) return;
      const auto it = merges.find(pair_key(sym[left].id, sym[right].id));
      if (it != merges.end()) heap.push({it->second.rank, left, right});
    };
    for (int32_t i = 0; i + 1 < n; ++i) push(i);
    while (!heap.empty()) {
      const Cand c = heap.top();
      heap.pop();
      if (sym[c.left].id < 0 || sym[c.left].next != c.right) continue;  // a neighbour changed
      const auto it = merges.find(pair_key(sym[c.left].id, sym[c.right].id));
      if (it == merges.end() || it->second.rank != c.rank) continue;    // a symbol changed
      Sym& l = sym[c.left];
      l.id = it->second.id;
      l.next = sym[c.right].next;
      if (l.next >= 0) sym[l.next].prev = c.left;
      sym[c.right].id = -1;
      push(l.prev);
      push(c.left);
    }
    for (int32_t i = 0; i >= 0; i = sym[i].next) out.push_back(sym[i].id);
  }

  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
    if (piece.size() == 1) {  // single byte: no merge can apply
      out.push_back(byte_id[static_cast<unsigned char>(piece[0])]);
      return;
    }
    const bool cacheable = piece.size() <= kMaxCachedPieceBytes;
    if (cacheable) {
      std::lock_guard<std::mutex> lock(cache_mu);
      const auto it = cache.find(piece);
      if (it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const std::size_t start = out.size();
    bpe(piece, out);
    if (cacheable) {
      std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
      std::lock_guard<std::mutex> lock(cache_mu);
      if (cache.size() >= kMaxCacheEntries) cache.clear();
      cache.emplace(std::string(piece), std::move(ids));
    }
  }
};

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& encoder_json_path, const std::string& vocab_bpe_path) {
  Tokenizer tok;
  Impl& m = *tok.impl_;

  // --- encoder.json: {"token string": id, ...}, ids dense in [0, N).
  const std::string json_text = read_file(encoder_json_path, "GPT-2 encoder.json");
  const nlohmann::json j = parse_json(json_text, "GPT-2 encoder.json '" + encoder_json_path + "'");
  TALLY_CHECK(j.is_object(), "GPT-2 encoder.json '", encoder_json_path,
              "': expected a JSON object mapping token strings to ids, found a JSON ", j.type_name());
  TALLY_CHECK(!j.empty(), "GPT-2 encoder.json '", encoder_json_path, "': expected token entries, found an empty object");
  const std::size_t n = j.size();
  m.id_to_bytes.assign(n, std::string());
  std::vector<bool> seen(n, false);
  std::unordered_map<std::string, int32_t> bytes_to_id;
  bytes_to_id.reserve(n);
  std::string bytes;
  for (const auto& [key, value] : j.items()) {
    TALLY_CHECK(value.is_number_integer(), "GPT-2 encoder.json '", encoder_json_path, "': token \"", excerpt(key),
                "\" has value ", excerpt(value.dump()), ", expected an integer id");
    const int64_t id = value.get<int64_t>();
    TALLY_CHECK(id >= 0 && id < static_cast<int64_t>(n), "GPT-2 encoder.json '", encoder_json_path, "': token \"",
                excerpt(key), "\" has id ", id, ", expected 0 <= id < ", n, " (the number of entries)");
    TALLY_CHECK(!seen[id], "GPT-2 encoder.json '", encoder_json_path, "': id ", id,
                " is used twice, expected each id in [0, ", n, ") exactly once");
    seen[id] = true;
    char32_t bad = 0;
    TALLY_CHECK(unmap_token(key, &bytes, &bad), "GPT-2 encoder.json '", encoder_json_path, "': token \"", excerpt(key),
                "\" contains ", code_point_name(bad), ", which is not in GPT-2's byte-to-unicode alphabet");
    m.id_to_bytes[id] = bytes;
    bytes_to_id.emplace(bytes, static_cast<int32_t>(id));
  }
  m.set_byte_ids(bytes_to_id, "GPT-2 encoder.json '" + encoder_json_path + "'");
  const auto eot = bytes_to_id.find(kEotString);
  TALLY_CHECK(eot != bytes_to_id.end(), "GPT-2 encoder.json '", encoder_json_path, "': expected a \"", kEotString,
              "\" token, found none");
  m.eot = eot->second;

  // --- vocab.bpe: "#version: 0.2" then "a b" per line; the line order is the merge rank.
  const std::string bpe_text = read_file(vocab_bpe_path, "GPT-2 vocab.bpe");
  std::string_view rest(bpe_text);
  int line_no = 0;
  int32_t rank = 0;
  std::unordered_map<uint64_t, int> merge_line;  // for duplicate-merge messages
  std::string a_bytes, b_bytes;
  while (!rest.empty()) {
    const std::size_t eol = rest.find('\n');
    const std::string_view line = rest.substr(0, eol);
    rest = eol == std::string_view::npos ? std::string_view() : rest.substr(eol + 1);
    ++line_no;
    if (line_no == 1) {
      TALLY_CHECK(line.substr(0, 8) == "#version", "GPT-2 vocab.bpe '", vocab_bpe_path,
                  "': line 1: expected a '#version: ...' header, found '", excerpt(line), "'");
      continue;
    }
    if (line.empty() && rest.empty()) break;  // the file's final newline
    const std::size_t sp = line.find(' ');
    TALLY_CHECK(sp != std::string_view::npos && sp > 0 && sp + 1 < line.size() &&
                    line.find(' ', sp + 1) == std::string_view::npos,
                "GPT-2 vocab.bpe '", vocab_bpe_path, "': line ", line_no,
                ": expected a merge 'a b' (two tokens separated by one space), found '", excerpt(line), "'");
    const std::string_view a = line.substr(0, sp), b = line.substr(sp + 1);
    char32_t bad = 0;
    TALLY_CHECK(unmap_token(a, &a_bytes, &bad) && unmap_token(b, &b_bytes, &bad), "GPT-2 vocab.bpe '", vocab_bpe_path,
                "': line ", line_no, ": merge '", excerpt(line), "' contains ", code_point_name(bad),
                ", which is not in GPT-2's byte-to-unicode alphabet");
    const auto ia = bytes_to_id.find(a_bytes), ib = bytes_to_id.find(b_bytes), iab = bytes_to_id.find(a_bytes + b_bytes);
    if (ia == bytes_to_id.end() || ib == bytes_to_id.end() || iab == bytes_to_id.end()) {
      const std::string missing = ia == bytes_to_id.end()   ? std::string(a)
                                  : ib == bytes_to_id.end() ? std::string(b)
                                                            : std::string(a) + std::string(b);
      TALLY_FAIL("GPT-2 vocab.bpe '", vocab_bpe_path, "': line ", line_no, ": merge '", excerpt(line), "': expected '",
                 excerpt(missing), "' to be a token of encoder.json '", encoder_json_path, "', found it missing");
    }
    const uint64_t key = pair_key(ia->second, ib->second);
    const auto [it, inserted] = merge_line.emplace(key, line_no);
    TALLY_CHECK(inserted, "GPT-2 vocab.bpe '", vocab_bpe_path, "': line ", line_no, ": merge '", excerpt(line),
                "' duplicates line ", it->second, ", expected each merge once");
    m.merges.emplace(key, Impl::Merge{rank++, iab->second});
  }
  TALLY_CHECK(line_no >= 1, "GPT-2 vocab.bpe '", vocab_bpe_path, "': expected a '#version: ...' header, found an empty file");
  m.check_merges("GPT-2 vocab.bpe '" + vocab_bpe_path + "'", "encoder.json", rank, {m.eot});
  m.can_encode = true;
  return tok;
}

Tokenizer Tokenizer::load_tokenizer_json(const std::string& path) {
  try {
    return load_tokenizer_json_unchecked(path);
  } catch (const nlohmann::json::exception& e) {  // a value of another JSON type than the one read
    TALLY_FAIL("tokenizer.json '", path, "': ", e.what());
  }
}

Tokenizer Tokenizer::load_tokenizer_json_unchecked(const std::string& path) {
  Tokenizer tok;
  Impl& m = *tok.impl_;
  const std::string what = "tokenizer.json '" + path + "'";
  nlohmann::json j = parse_json(read_file(path, "tokenizer.json"), what);
  // GPT-2's encoder.json (token -> id) is JSON too: named alone, it is named as such.
  TALLY_CHECK(!(j.is_object() && !j.contains("model") && !j.empty() && j.begin()->is_number_integer()), "tokenizer '",
              path, "' is GPT-2's encoder.json (token -> id), not a HuggingFace tokenizer.json: pass the directory that "
              "holds it and vocab.bpe");
  TALLY_CHECK(j.is_object() && j.contains("model") && j["model"].is_object(), what, ": expected a HuggingFace tokenizer "
              "with a \"model\" object");
  const auto& model = j["model"];
  TALLY_CHECK(model.contains("type") && model["type"] == "BPE" && model.contains("vocab") && model["vocab"].is_object() &&
                  model.contains("merges") && model["merges"].is_array(),
              what, ": expected a BPE model with \"vocab\" and \"merges\"");
  // Options of HuggingFace's BPE that LLaMA-3's and Qwen's files leave off and tally does not implement.
  for (const char* option : {"byte_fallback", "continuing_subword_prefix", "end_of_word_suffix", "dropout"}) {
    const nlohmann::json& v = model.contains(option) ? model[option] : nlohmann::json();
    TALLY_CHECK(v.is_null() || v == false || v == "" || v == 0, what, ": its BPE model sets ", option, " to ",
                excerpt(v.dump()), "; LLaMA-3's and Qwen's do not, and tally implements no such option");
  }
  // ignore_merges: a piece that is a token is that token, before any merge (true in
  // LLaMA-3's file); off, or absent as in files made before tokenizers 0.19, merges alone.
  if (model.contains("ignore_merges")) {
    const nlohmann::json& ignore = model["ignore_merges"];
    TALLY_CHECK(ignore.is_boolean(), what, ": its BPE model's ignore_merges must be true or false, found ",
                excerpt(ignore.dump()));
    m.ignore_merges = ignore.get<bool>();
  }
  // The pre-tokenizer must be LLaMA-3's or Qwen's: this class implements those regexes and
  // no other. Qwen's numbers a piece digit by digit.
  const auto regex = [](const char* digits) {
    return std::string("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|") + digits +
           "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  };
  const auto field = [](const nlohmann::json& o, const char* key) {
    return o.is_object() && o.contains(key) ? o[key] : nlohmann::json();
  };
  const nlohmann::json pre = field(j, "pre_tokenizer");
  const std::string dump = pre.dump();
  const nlohmann::json steps = field(pre, "pretokenizers");
  const nlohmann::json split = steps.is_array() && !steps.empty() ? steps[0] : nlohmann::json();
  m.llama3 = field(split, "pattern") == nlohmann::json{{"Regex", regex("\\p{N}{1,3}")}};
  m.qwen = field(split, "pattern") == nlohmann::json{{"Regex", regex("\\p{N}")}};
  TALLY_CHECK(m.llama3 || m.qwen, what,
              ": its pre-tokenizer does not split on LLaMA-3's regex or Qwen's: expected a first step whose pattern "
              "is {\"Regex\": <LLaMA-3's regex>} or Qwen's (\\p{N} for \\p{N}{1,3}); found ", excerpt(dump));
  const char* family = m.llama3 ? "LLaMA-3" : "Qwen";
  // ... and the rest of what happens to text before BPE must be LLaMA-3's too: no normalizer,
  // the regex's pieces kept whole ("Isolated"), then bytes mapped without a prefix space or a
  // second (GPT-2) regex. A file that differs encodes differently from what it describes.
  const bool llama3_pre = field(pre, "type") == "Sequence" && steps.is_array() && steps.size() == 2 &&
                          field(steps[0], "type") == "Split" && field(steps[0], "behavior") == "Isolated" &&
                          field(steps[0], "invert") == false && field(steps[1], "type") == "ByteLevel" &&
                          field(steps[1], "add_prefix_space") == false && field(steps[1], "use_regex") == false;
  TALLY_CHECK(llama3_pre, what, ": its pre-tokenizer is not ", family, "'s: expected a Sequence of a Split on its regex "
              "(behavior Isolated, not inverted) and a ByteLevel with add_prefix_space and use_regex false; found ",
              excerpt(dump));
  // LLaMA-3 normalizes nothing; Qwen composes the text (NFC) first.
  const nlohmann::json normalizer = field(j, "normalizer");
  if (m.llama3)
    TALLY_CHECK(normalizer.is_null(), what, ": it has a normalizer (", excerpt(normalizer.dump()),
                "); LLaMA-3's has none, and tally applies none");
  const bool nfc_normalizer = normalizer == nlohmann::json{{"type", "NFC"}};
  if (m.qwen)
    TALLY_CHECK(nfc_normalizer, what, ": its normalizer is ", excerpt(normalizer.dump()),
                "; Qwen's is {\"type\": \"NFC\"}, the one tally applies");
  // Ids: the vocabulary's, then the added (special) tokens, dense from 0.
  const auto& vocab = model["vocab"];
  const auto& added = j.value("added_tokens", nlohmann::json::array());
  const std::size_t n = vocab.size() + added.size();
  m.id_to_bytes.assign(n, std::string());
  std::vector<bool> seen(n, false);
  std::unordered_map<std::string, int32_t> bytes_to_id;
  bytes_to_id.reserve(n);
  std::string bytes;
  auto set_id = [&](const nlohmann::json& value, const std::string& name) {
    TALLY_CHECK(value.is_number_integer(), what, ": token \"", excerpt(name), "\" has id ", excerpt(value.dump()),
                ", expected an integer");
    const int64_t id = value.get<int64_t>();
    TALLY_CHECK(id >= 0 && id < static_cast<int64_t>(n) && !seen[id], what, ": token \"", excerpt(name), "\" has id ",
                id, ", expected each id in [0, ", n, ") exactly once");
    seen[id] = true;
    return static_cast<int32_t>(id);
  };
  for (const auto& [key, value] : vocab.items()) {
    const int32_t id = set_id(value, key);
    char32_t bad = 0;
    TALLY_CHECK(unmap_token(key, &bytes, &bad), what, ": token \"", excerpt(key), "\" contains ", code_point_name(bad),
                ", which is not in the byte-level alphabet");
    m.id_to_bytes[id] = bytes;
    bytes_to_id.emplace(bytes, id);
  }
  std::vector<int32_t> specials;
  m.eot = m.separator = m.turn_end = -1;
  for (const auto& t : added) {
    TALLY_CHECK(t.is_object() && t.contains("content") && t["content"].is_string() && t.contains("id"), what,
                ": an added token is not {\"id\", \"content\"}: ", excerpt(t.dump()));
    const std::string content = t["content"].get<std::string>();
    const int32_t id = set_id(t["id"], content);
    m.id_to_bytes[id] = content;  // decoded as its text
    specials.push_back(id);
    if (m.llama3 && content == "<|begin_of_text|>") m.separator = id;
    if (m.llama3 && content == "<|end_of_text|>") m.eot = id;
    if (m.qwen && content == "<|endoftext|>") m.eot = m.separator = id;
    if (m.qwen && content == "<|im_end|>") m.turn_end = id;
  }
  if (m.llama3)
    TALLY_CHECK(m.separator >= 0 && m.eot >= 0, what, ": expected the special tokens <|begin_of_text|> and <|end_of_text|>");
  else
    TALLY_CHECK(m.eot >= 0 && m.turn_end >= 0, what, ": expected the special tokens <|endoftext|> and <|im_end|>");
  for (std::size_t id = 0; id < n; ++id) TALLY_CHECK(seen[id], what, ": no token has id ", id, " (ids must be dense)");
  m.set_byte_ids(bytes_to_id, what);
  // Merges in rank order: "a b" strings (older files) or ["a", "b"] pairs (newer ones).
  int32_t rank = 0;
  std::string a_bytes, b_bytes;
  for (const auto& merge : model["merges"]) {
    std::string a, b;
    if (merge.is_string()) {
      const std::string line = merge.get<std::string>();
      const std::size_t sp = line.find(' ');
      TALLY_CHECK(sp != std::string::npos && sp > 0 && sp + 1 < line.size() && line.find(' ', sp + 1) == std::string::npos,
                  what, ": merge ", rank, " is '", excerpt(line), "', expected 'a b'");
      a = line.substr(0, sp);
      b = line.substr(sp + 1);
    } else {
      TALLY_CHECK(merge.is_array() && merge.size() == 2 && merge[0].is_string() && merge[1].is_string(), what, ": merge ",
                  rank, " is ", excerpt(merge.dump()), ", expected \"a b\" or [\"a\", \"b\"]");
      a = merge[0].get<std::string>();
      b = merge[1].get<std::string>();
    }
    char32_t bad = 0;
    TALLY_CHECK(unmap_token(a, &a_bytes, &bad) && unmap_token(b, &b_bytes, &bad), what, ": merge ", rank,
                " contains ", code_point_name(bad), ", which is not in the byte-level alphabet");
    const auto ia = bytes_to_id.find(a_bytes), ib = bytes_to_id.find(b_bytes), iab = bytes_to_id.find(a_bytes + b_bytes);
    TALLY_CHECK(ia != bytes_to_id.end() && ib != bytes_to_id.end() && iab != bytes_to_id.end(), what, ": merge ", rank,
                " '", excerpt(a), " ", excerpt(b), "' joins tokens that are not in the vocabulary");
    // A pair listed twice keeps its first (lowest) rank, as HuggingFace's BPE does.
    m.merges.emplace(pair_key(ia->second, ib->second), Impl::Merge{rank, iab->second});
    ++rank;
  }
  m.check_merges(what, "the vocabulary", rank, specials);
  for (const auto& [b, id] : bytes_to_id) m.whole.emplace(b, id);
  m.can_encode = true;
  return tok;
}

Tokenizer Tokenizer::load_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "tokenizer.json")) return load_tokenizer_json((dir / "tokenizer.json").string());
    TALLY_CHECK(fs::exists(dir / "encoder.json") && fs::exists(dir / "vocab.bpe"), "tokenizer directory '", path,
                "' holds neither tokenizer.json (LLaMA-3, Qwen) nor encoder.json + vocab.bpe (GPT-2)");
    return load((dir / "encoder.json").string(), (dir / "vocab.bpe").string());
  }
  if (fs::path(path).extension() == ".json") return load_tokenizer_json(path);
  return load_llmc(path);
}

Tokenizer Tokenizer::load_llmc(const std::string& path) {
  Tokenizer tok;
  Impl& m = *tok.impl_;
  m.llmc_path = path;
  const std::string data = read_file(path, "llm.c tokenizer");
  constexpr std::size_t kHeaderBytes = kLlmcHeaderInts * sizeof(int32_t);
  TALLY_CHECK(data.size() >= kHeaderBytes, "llm.c tokenizer '", path, "': file is ", data.size(),
              " bytes, expected at least ", kHeaderBytes, " (the 256 x int32 header)");
  int32_t header[4];
  std::memcpy(header, data.data(), sizeof header);
  TALLY_CHECK(header[0] == kLlmcTokenizerMagic, "llm.c tokenizer '", path, "': bad magic ", header[0], ", expected ",
              kLlmcTokenizerMagic);
  TALLY_CHECK(header[1] == 1 || header[1] == 2, "llm.c tokenizer '", path, "': unsupported version ", header[1],
              ", expected 1 or 2");
  const int32_t vocab = header[2];
  TALLY_CHECK(vocab > 0, "llm.c tokenizer '", path, "': vocab size ", vocab, ", expected > 0");
  m.eot = header[1] == 1 ? kGpt2Eot : header[3];
  TALLY_CHECK(m.eot >= 0 && m.eot < vocab, "llm.c tokenizer '", path, "': end-of-text id ", m.eot,
              " is outside the vocabulary, expected 0 <= id < ", vocab);
  // Each token takes at least two bytes (length, then 1..255 bytes): bound the vocabulary by
  // the file before allocating a slot per token.
  TALLY_CHECK(static_cast<std::size_t>(vocab) <= (data.size() - kHeaderBytes) / 2, "llm.c tokenizer '", path,
              "': header says ", vocab, " tokens but the file's ", data.size() - kHeaderBytes,
              " bytes after the header hold at most ", (data.size() - kHeaderBytes) / 2);
  m.id_to_bytes.resize(vocab);
  std::size_t pos = kHeaderBytes;
  for (int32_t id = 0; id < vocab; ++id) {
    TALLY_CHECK(pos < data.size(), "llm.c tokenizer '", path, "': truncated: file is ", data.size(),
                " bytes but header says ", vocab, " tokens; token ", id, " would start at byte ", pos);
    const auto len = static_cast<unsigned char>(data[pos]);
    TALLY_CHECK(len > 0, "llm.c tokenizer '", path, "': token ", id, " at byte ", pos, " has length 0, expected 1..255");
    TALLY_CHECK(pos + 1 + len <= data.size(), "llm.c tokenizer '", path, "': truncated: token ", id, " needs bytes ",
                pos + 1, "..", pos + len, " but the file is ", data.size(), " bytes");
    m.id_to_bytes[id].assign(data, pos + 1, len);
    pos += 1 + len;
  }
  TALLY_CHECK(pos == data.size(), "llm.c tokenizer '", path, "': file is ", data.size(), " bytes, expected ", pos,
              " for ", vocab, " tokens (", data.size() - pos, " trailing bytes)");
  m.can_encode = false;
  return tok;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const Impl& m = *impl_;
  if (!m.can_encode)
    throw std::logic_error("tally: a tokenizer loaded from llm.c tokenizer '" + m.llmc_path +
                           "' has no BPE merges and can only decode; load encoder.json + vocab.bpe to encode");
  std::vector<int32_t> out;
  out.reserve(text.size() / 3);
  if (!m.from_tokenizer_json()) {
    split_gpt2(text, [&](std::string_view piece) { m.encode_piece(piece, out); });
    return out;
  }
  std::string valid = replace_invalid_utf8(text);
  if (m.qwen) valid = nfc(valid);
  split_llama3(valid, m.qwen ? 1 : 3, [&](std::string_view piece) {
    if (m.ignore_merges) {  // a piece that is a token is that token
      const auto it = m.whole.find(piece);
      if (it != m.whole.end()) return out.push_back(it->second);
    }
    m.encode_piece(piece, out);
  });
  return out;
}

std::string Tokenizer::decode_token(int32_t id) const {
  const auto n = static_cast<int64_t>(impl_->id_to_bytes.size());
  if (id < 0 || id >= n)
    throw std::invalid_argument("tally: token id " + std::to_string(id) + " is out of range for a vocabulary of " +
                                std::to_string(n) + " tokens (expected 0 <= id < " + std::to_string(n) + ")");
  return impl_->id_to_bytes[id];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  out.reserve(ids.size() * 4);
  const auto n = static_cast<int64_t>(impl_->id_to_bytes.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= n) decode_token(id);  // throws with the message
    out += impl_->id_to_bytes[id];
  }
  return out;
}

int Tokenizer::vocab_size() const { return static_cast<int>(impl_->id_to_bytes.size()); }
int Tokenizer::eot_id() const { return impl_->eot; }
int Tokenizer::document_separator_id() const { return impl_->llama3 ? impl_->separator : impl_->eot; }
std::vector<int32_t> Tokenizer::stop_ids() const {
  if (impl_->llama3) return {impl_->eot, impl_->separator};
  if (impl_->qwen) return {impl_->eot, impl_->turn_end};
  return {impl_->eot};
}
bool Tokenizer::is_llama3() const { return impl_->llama3; }
bool Tokenizer::is_qwen() const { return impl_->qwen; }
bool Tokenizer::can_encode() const { return impl_->can_encode; }

}  // namespace tally::data
