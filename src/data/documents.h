// Turning text files into training documents: splitting a file on separator lines (the
// fortune files separate entries with a line holding only "%"), shuffling documents
// deterministically, and cutting a validation split on document boundaries.
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
std::vector<std::string> split_documents(const std::string& text, const std::string& separator);

// Fisher-Yates with tally's portable generator: the same seed gives the same order on
// every machine.
void shuffle_documents(std::vector<std::string>& documents, uint64_t seed);

// How many documents at the end of `token_counts` make up at least `fraction` of all the
// tokens (at least one when fraction > 0 and there are two or more documents).
size_t validation_documents(const std::vector<size_t>& token_counts, double fraction);

}  // namespace tally::data
