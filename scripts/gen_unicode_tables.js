#!/usr/bin/env node
// Generates src/data/unicode_tables.cc: the code point ranges of the Unicode classes used by
// the GPT-2 pre-tokenization regex (\p{L}, \p{N}, and \s = White_Space).
//
// The classes come from node's own regex engine (ICU), so they are exactly what the
// `gpt-3-encoder` npm package -- our reference for the BPE fixture -- sees, except that
// \s is taken as the Unicode White_Space property (what Python's `regex` module, used by
// OpenAI's GPT-2 encoder, means by \s) rather than JavaScript's \s, which differs in
// U+0085 (not in JS \s) and U+FEFF (in JS \s, not White_Space).
//
// Usage: node scripts/gen_unicode_tables.js > src/data/unicode_tables.cc
'use strict';

const classes = [
  ['kLetterRanges', /^\p{L}$/u, '\\p{L}: general category L (Lu, Ll, Lt, Lm, Lo)'],
  ['kNumberRanges', /^\p{N}$/u, '\\p{N}: general category N (Nd, Nl, No)'],
  ['kWhiteSpaceRanges', /^\p{White_Space}$/u, 'White_Space property (what \\s means in Python `regex`)'],
];

function ranges(re) {
  const out = [];
  let start = -1;
  for (let cp = 0; cp <= 0x110000; cp++) {
    // Surrogate code points can't appear in valid UTF-8; String.fromCodePoint on them gives
    // a lone surrogate that matches none of the classes anyway.
    const hit = cp <= 0x10ffff && re.test(String.fromCodePoint(cp));
    if (hit && start < 0) start = cp;
    if (!hit && start >= 0) {
      out.push([start, cp - 1]);
      start = -1;
    }
  }
  return out;
}

const hex = (x) => '0x' + x.toString(16).toUpperCase().padStart(4, '0');
let body = '';
for (const [name, re, what] of classes) {
  const rs = ranges(re);
  body += `// ${what}: ${rs.length} ranges.\n`;
  body += `const CodePointRange ${name}[] = {\n`;
  for (let i = 0; i < rs.length; i += 4) {
    body += '    ' + rs.slice(i, i + 4).map(([a, b]) => `{${hex(a)}, ${hex(b)}}`).join(', ') + ',\n';
  }
  body += '};\n';
  body += `const std::size_t ${name.replace('Ranges', 'RangeCount')} = sizeof(${name}) / sizeof(${name}[0]);\n\n`;
}

process.stdout.write(`// GENERATED FILE -- do not edit by hand.
// Produced by: node scripts/gen_unicode_tables.js > src/data/unicode_tables.cc
// Source: node ${process.version}, ICU ${process.versions.icu}, Unicode ${process.versions.unicode}.
// Sorted, disjoint, inclusive code point ranges for the GPT-2 pre-tokenizer (see tokenizer.cc).
#include "data/unicode_tables.h"

namespace tally::data::unicode {

${body}}  // namespace tally::data::unicode
`);
