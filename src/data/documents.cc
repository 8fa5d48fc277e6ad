#include "data/documents.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/random.h"

namespace tally::data {

namespace {
std::string trim_blank_lines(const std::string& s) {
  size_t begin = 0, end = s.size();
  while (begin < end && (s[begin] == '\n' || s[begin] == '\r')) ++begin;
  while (end > begin && (s[end - 1] == '\n' || s[end - 1] == '\r' || s[end - 1] == ' ' || s[end - 1] == '\t')) --end;
  return s.substr(begin, end - begin);
}
}  // namespace

std::vector<std::string> split_documents(const std::string& text, const std::string& separator,
                                         size_t* separator_lines) {
  std::vector<std::string> docs;
  size_t found = 0;
  if (separator_lines) *separator_lines = 0;
  auto keep = [&](const std::string& d) {
    std::string t = trim_blank_lines(d);
    if (!t.empty()) docs.push_back(std::move(t));
  };
  if (separator.empty()) {
    keep(text);
    return docs;
  }
  std::string current;
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line == separator) {
      ++found;
      keep(current);
      current.clear();
    } else {
      current.append(text, start, end - start);
      if (end < text.size()) current += '\n';
    }
    start = end + 1;
  }
  keep(current);
  if (separator_lines) *separator_lines = found;
  return docs;
}

void shuffle_documents(std::vector<std::string>& documents, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = documents.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng.next_u64() % i);
    std::swap(documents[i - 1], documents[j]);
  }
}

ValidationSplit validation_split(const std::vector<size_t>& token_counts, double fraction) {
  const size_t n = token_counts.size();
  size_t total = 0;
  for (size_t c : token_counts) total += c;
  const double target = fraction * static_cast<double>(total);
  if (n == 0 || target < 0.5) return {};
  // The most whole documents from the end that stay within the target (never all of them).
  size_t whole = 0, taken = 0;
  while (whole + 1 < n && static_cast<double>(taken + token_counts[n - 1 - whole]) <= target) {
    taken += token_counts[n - 1 - whole];
    ++whole;
  }
  const double under = target - static_cast<double>(taken);  // `whole` documents
  const bool can_add = whole + 1 < n;                          // one more, and training keeps one
  const double over = can_add ? static_cast<double>(taken + token_counts[n - 1 - whole]) - target : 1e300;
  const double tolerance = 0.25 * target;
  const size_t boundary = token_counts[n - 1 - whole];  // the document a cut would split
  // Cutting needs a token for each side, the separator aside.
  const bool can_cut = boundary >= 3;
  if (std::min(under, over) <= tolerance || !can_cut) {
    if (over <= under) return {whole + 1, 0};
    return {whole, 0};
  }
  const auto cut = static_cast<size_t>(std::llround(under));
  return {whole, std::clamp<size_t>(cut, 1, boundary - 2)};
}

}  // namespace tally::data
