// Turning text files into training documents: splitting a file on separator lines (the
// fortune files separate entries with a line holding only "%"), shuffling documents
// deterministically, and cutting a validation split, on a document boundary where one is
// near the fraction asked for.
//
// Why shuffle: corpora made of many files come in file order, and the last files are
// not like the rest (the fortunes end with the Zippy-the-Pinhead file, all capitals). A
// validation split cut from the tail then measures something the model never saw, and
// training walks through one genre after another. Shuffled documents make the training
// stream and the validation split samples of the same text.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tally::data {

// Splits `text` into documents at lines equal to `separator` (kept out of the documents);
// an empty separator makes the whole text one document. Blank lines around a document are
// trimmed and empty documents dropped.
// `separator_lines`, when given, is set to how many lines were the separator (none: the
// text was one document, which a caller that gave a separator may want to say).
std::vector<std::string> split_documents(const std::string& text, const std::string& separator,
                                         size_t* separator_lines = nullptr);

// Fisher-Yates with tally's portable generator: the same seed gives the same order on
// every machine.
void shuffle_documents(std::vector<std::string>& documents, uint64_t seed);

// Where the validation split begins: the last `whole` documents, and before them the last
// `cut` tokens of the document before those (0: no document is cut).
struct ValidationSplit {
  size_t whole = 0;
  size_t cut = 0;
};

// The tail of the documents (`token_counts`: each one's tokens, its separator included)
// that holds `fraction` of all the tokens. Whole documents where they can come within a
// quarter of the target (10% asked: 7.5% to 12.5%), the closer of the two counts around
// it; otherwise the document at the boundary is cut, so that one large document (a book,
// or each input file of a few) cannot send most of the data to validation or leave none.
// Training keeps at least one document, or the head of one; a target under half a token
// is no split.
ValidationSplit validation_split(const std::vector<size_t>& token_counts, double fraction);

}  // namespace tally::data
