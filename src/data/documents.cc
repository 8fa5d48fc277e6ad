#include "data/documents.h"

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

std::vector<std::string> split_documents(const std::string& text, const std::string& separator) {
  std::vector<std::string> docs;
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
      keep(current);
      current.clear();
    } else {
      current.append(text, start, end - start);
      if (end < text.size()) current += '\n';
    }
    start = end + 1;
  }
  keep(current);
  return docs;
}

void shuffle_documents(std::vector<std::string>& documents, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = documents.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(rng.next_u64() % i);
    std::swap(documents[i - 1], documents[j]);
  }
}

size_t validation_documents(const std::vector<size_t>& token_counts, double fraction) {
  if (fraction <= 0 || token_counts.size() < 2) return 0;
  size_t total = 0;
  for (size_t c : token_counts) total += c;
  size_t taken = 0, n = 0;
  while (n + 1 < token_counts.size() && static_cast<double>(taken) < fraction * static_cast<double>(total)) {
    taken += token_counts[token_counts.size() - 1 - n];
    ++n;
  }
  return n;
}

}  // namespace tally::data
