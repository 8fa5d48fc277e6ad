// Documents for tokenizing: separator lines, a portable shuffle, and a validation split
// that never cuts a document.
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

TEST(Documents, ValidationTakesWholeDocumentsFromTheEnd) {
  EXPECT_EQ(data::validation_documents({10, 10, 10, 10, 10}, 0.1), 1u);   // 10 of 50 >= 5
  EXPECT_EQ(data::validation_documents({10, 10, 10, 10, 10}, 0.3), 2u);   // 20 of 50 >= 15
  EXPECT_EQ(data::validation_documents({100, 1, 1, 1}, 0.5), 3u);         // never all: training keeps one
  EXPECT_EQ(data::validation_documents({10, 10}, 0.0), 0u);
  EXPECT_EQ(data::validation_documents({10}, 0.5), 0u);
}
