// Unicode code point classes needed by the GPT-2 pre-tokenizer. The range tables are
// generated (src/data/unicode_tables.cc, by scripts/gen_unicode_tables.js); the lookups here
// give ASCII a table-free fast path because almost all training text is ASCII.
#pragma once
#include <algorithm>
#include <cstddef>

namespace tally::data::unicode {

struct CodePointRange {
  char32_t lo, hi;  // inclusive
};

extern const CodePointRange kLetterRanges[];
extern const std::size_t kLetterRangeCount;
extern const CodePointRange kNumberRanges[];
extern const std::size_t kNumberRangeCount;
extern const CodePointRange kWhiteSpaceRanges[];
extern const std::size_t kWhiteSpaceRangeCount;

inline bool in_ranges(char32_t cp, const CodePointRange* ranges, std::size_t n) {
  // First range whose upper end is >= cp; cp is in the class iff that range starts <= cp.
  const CodePointRange* end = ranges + n;
  const CodePointRange* it =
      std::lower_bound(ranges, end, cp, [](const CodePointRange& r, char32_t c) { return r.hi < c; });
  return it != end && it->lo <= cp;
}

inline bool is_letter(char32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return in_ranges(cp, kLetterRanges, kLetterRangeCount);
}
inline bool is_number(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return in_ranges(cp, kNumberRanges, kNumberRangeCount);
}
inline bool is_white_space(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return in_ranges(cp, kWhiteSpaceRanges, kWhiteSpaceRangeCount);
}

}  // namespace tally::data::unicode
