// Documents for tokenizing: separator lines, a portable shuffle, and a validation split
// on a document boundary where one is near the fraction asked for.
#include <gtest/gtest.h>

#include <algorithm>

#include "data/documents.h"

using namespace tally;

TEST(Documents, SplitOnSeparatorLinesTrimmingBlankLines) {
  const std::string text = "first\nfortune\n%\n\nsecond\n%\n%\r\nthird, last\n";
  EXPECT_EQ(data::split_documents(text, "%"), (std::vector<std::string>{"first\nfortune", "second", "third, last"}));
  EXPECT_EQ(data::split_documents(text, ""), (std::vector<std::string>{"first\nfortune\n%\n\nsecond\n%\n%\r\nthird, last"}));
  // A "%" inside a line is text, not a separator.
  EXPECT_EQ(data::split_documents("50% off\n%\nnext", "%"), (std::vector<std::string>{"50% off", "next"}));
  size_t separators = 99;
  data::split_documents(text, "%", &separators);
  EXPECT_EQ(separators, 3u);
  data::split_documents("no separator\nhere\n", "%%", &separators);
  EXPECT_EQ(separators, 0u);
}

TEST(Documents, ShuffleIsAPermutationFixedByItsSeed) {
  std::vector<std::string> docs;
  for (int i = 0; i < 100; ++i) docs.push_back(std::to_string(i));
  auto a = docs, b = docs, c = docs;
  data::shuffle_documents(a, 1);
  data::shuffle_documents(b, 1);
  data::shuffle_documents(c, 2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, docs);
  std::sort(a.begin(), a.end());
  auto sorted = docs;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(a, sorted);
  // The same order on every machine: the generator is tally's own (xoshiro256**).
  auto d = std::vector<std::string>{"a", "b", "c", "d", "e"};
  data::shuffle_documents(d, 1);
  EXPECT_EQ(d.size(), 5u);
  auto again = std::vector<std::string>{"a", "b", "c", "d", "e"};
  data::shuffle_documents(again, 1);
  EXPECT_EQ(d, again);
}

namespace {
void expect_split(const std::vector<size_t>& counts, double fraction, size_t whole, size_t cut) {
  const data::ValidationSplit s = data::validation_split(counts, fraction);
  EXPECT_EQ(s.whole, whole) << "fraction " << fraction;
  EXPECT_EQ(s.cut, cut) << "fraction " << fraction;
}
}  // namespace

TEST(Documents, ValidationTakesWholeDocumentsFromTheEndWhenTheyComeNearTheFraction) {
  // Ten documents of 10: 10% is one of them, 30% three; 25% lies between two and three,
  // each 5 tokens (20%) from the target of 25, inside the quarter (6.25): the larger.
  const std::vector<size_t> ten(10, 10);
  expect_split(ten, 0.1, 1, 0);
  expect_split(ten, 0.3, 3, 0);
  expect_split(ten, 0.25, 3, 0);
  // 12% of 100 is 12: one document is 2 off, inside the quarter (3).
  expect_split(ten, 0.12, 1, 0);
  expect_split({10, 10}, 0.0, 0, 0);
  // Many small documents: always whole ones.
  expect_split(std::vector<size_t>(1000, 7), 0.1, 100, 0);
}

TEST(Documents, ValidationCutsTheBoundaryDocumentWhenWholeOnesCannotComeNear) {
  // Two files, one document each, 142 and 14182 tokens (the review's case): whole
  // documents give 0% or 99% of validation; the large one is cut, its last 1432 tokens
  // (10% of 14324) validate.
  expect_split({142, 14182}, 0.1, 0, 1432);
  // One document (a book): its last tenth.
  expect_split({1001}, 0.1, 0, 100);
  // Five of 10 at 10%: 5 tokens are 5 off either way (no document or one, 100% of the
  // target): the last document's last 5 tokens.
  expect_split({10, 10, 10, 10, 10}, 0.1, 0, 5);
  // Whole documents first, then the cut: 50% of {100, 1, 1, 1} is 51.5; the three small
  // ones (3) are far under, all four would leave training nothing: the big one's last 49
  // (48.5, rounded).
  expect_split({100, 1, 1, 1}, 0.5, 3, 49);
  // Training keeps the head of a cut document, and validation at least one token of it.
  expect_split({4}, 0.9, 0, 2);
  expect_split({1000}, 0.0004, 0, 0);  // 0.4 tokens: no split
  expect_split({1000}, 0.0006, 0, 1);
  // A document too short to cut (its separator and one token) is taken whole or not at all.
  expect_split({2}, 0.5, 0, 0);
}
