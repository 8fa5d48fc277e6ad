#!/usr/bin/env node
// Generates tests/fixtures/bpe_cases.json: [{"text": ..., "ids": [...]}, ...], the GPT-2 token
// ids of a varied set of strings, for tests/test_tokenizer.cc.
//
// Reference: the npm package gpt-3-encoder (a port of OpenAI's encoder.py), installed by
// scripts/fetch_corpus.sh under data/corpus/npm. Its regex differs from OpenAI's: its \s is
// JavaScript's \s, which lacks U+0085 (NEL) and has U+FEFF (BOM), whereas Python's `regex`
// module (used by encoder.py) and tiktoken use the Unicode White_Space property. So every case
// is also encoded with `openaiEncode` below -- the same files and algorithm with \s as
// White_Space -- and where the two disagree the fixture keeps OpenAI's ids, stores the
// package's as "gpt3_encoder_ids", and says why in "note". Any other disagreement fails.
//
// (gpt-3-encoder also keys merge ranks by String([a, b]) == "a,b", so e.g. ['),', '"'] would
// get the rank of [')', ',"']. A search of 300k random punctuation strings found no text where
// this changes the output -- the colliding pairs join to the same token, reached anyway -- so
// it is not treated as an explanation here.)
//
// Usage: scripts/fetch_corpus.sh && node scripts/gen_bpe_fixture.js > tests/fixtures/bpe_cases.json
'use strict';
const fs = require('fs');
const path = require('path');

const root = path.join(__dirname, '..');
const corpus = process.env.TALLY_CORPUS_DIR || path.join(root, 'data', 'corpus');
const pkgDir = path.join(corpus, 'npm', 'node_modules', 'gpt-3-encoder');
if (!fs.existsSync(pkgDir)) {
  console.error(`gen_bpe_fixture: ${pkgDir} not found; run scripts/fetch_corpus.sh first`);
  process.exit(1);
}
const gpt3 = require(pkgDir);

// ---- OpenAI's encoder.py, transcribed (pair ranks keyed unambiguously; \s = White_Space).
const encoder = JSON.parse(fs.readFileSync(path.join(pkgDir, 'encoder.json'), 'utf-8'));
const bpeLines = fs.readFileSync(path.join(pkgDir, 'vocab.bpe'), 'utf-8').split('\n');
const ranks = new Map();
bpeLines.slice(1, bpeLines.length - 1).forEach((l, i) => {
  const [a, b] = l.split(' ');
  ranks.set(a + ' ' + b, i);  // tokens never contain ' ' (it is mapped to U+0120)
});
const byteToChar = (() => {
  const m = new Array(256);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    const printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    m[b] = String.fromCharCode(printable ? b : 256 + n++);
  }
  return m;
})();
const pat = /'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\p{White_Space}\p{L}\p{N}]+|\p{White_Space}+(?!\P{White_Space})|\p{White_Space}+/gu;

function bpe(token) {
  let word = Array.from(token);
  while (word.length > 1) {
    let best = null;
    let bestRank = Infinity;
    for (let i = 0; i + 1 < word.length; i++) {
      const r = ranks.get(word[i] + ' ' + word[i + 1]);
      if (r !== undefined && r < bestRank) {
        bestRank = r;
        best = [word[i], word[i + 1]];
      }
    }
    if (best === null) break;
    const next = [];
    for (let i = 0; i < word.length;) {
      if (i + 1 < word.length && word[i] === best[0] && word[i + 1] === best[1]) {
        next.push(best[0] + best[1]);
        i += 2;
      } else {
        next.push(word[i]);
        i += 1;
      }
    }
    word = next;
  }
  return word;
}

function openaiEncode(text) {
  const ids = [];
  for (const m of text.matchAll(pat)) {
    const mapped = Array.from(Buffer.from(m[0], 'utf-8'), (b) => byteToChar[b]).join('');
    for (const t of bpe(mapped)) {
      if (!(t in encoder)) throw new Error(`token ${JSON.stringify(t)} not in encoder.json`);
      ids.push(encoder[t]);
    }
  }
  return ids;
}

const decoder = new Map(Object.entries(encoder).map(([t, id]) => [id, t]));
const charToByte = new Map(byteToChar.map((c, b) => [c, b]));
function openaiDecode(ids) {
  const bytes = [];
  for (const id of ids) for (const c of decoder.get(id)) bytes.push(charToByte.get(c));
  return Buffer.from(bytes).toString('utf-8');
}

// ---- The cases.
function fortunes(file, count) {
  const p = path.join('/usr/share/games/fortunes', file);
  if (!fs.existsSync(p)) {
    console.error(`gen_bpe_fixture: ${p} not found; run scripts/setup.sh --corpus first`);
    process.exit(1);
  }
  return fs.readFileSync(p, 'utf-8').split(/^%\n/m).slice(0, count);
}

// A deterministic string of `n` characters drawn from `alphabet`.
function pseudoRandom(alphabet, n, seed) {
  let x = seed;
  let s = '';
  for (let i = 0; i < n; i++) {
    x = (x * 1103515245 + 12345) % 2147483648;
    s += alphabet[Math.floor((x / 2147483648) * alphabet.length)];
  }
  return s;
}

const cases = [
  '',
  'Hello world',
  'Hello, world! How are you today?',
  'The quick brown fox jumps over the lazy dog.',
  "I'm sure you'll see they're right: we've said he'd go, it's fine, don't worry.",
  "DON'T SHOUT. IT'S LOUD. I'M HERE. Y'ALL'D 'VE",
  "'sup? 'tis 'twas rock 'n' roll ''quoted'' it''s o'clock '",
  "The year 1999 had 365 days; pi is 3.14159 and 1,000,000 > 2**20. Call 555-0100 on 2024-01-01.",
  '1234567890 12345678901234567890 007 42nd 3rd x86_64 v1.2.3',
  'a  b   c    d\t\te\t \tf',
  '   leading spaces',
  'trailing spaces   ',
  ' ',
  '  ',
  '\n',
  'line1\nline2\r\nline3\n\n\nline4\n',
  '\n\n\n   \n\t\n',
  'word \n next',
  'Hello!!! What?!... (yes) [no] {maybe} <tag> @user #hash $100 %50 ^_^ &amp; *bold* ~tilde~ `code` a|b \\ /',
  '---------- ========== .......... ********** __________',
  'def f(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n',
  '{"a": [1, 2.5, -3e10], "b": "c\\n", "d": null}',
  'https://example.com/path?query=1&other=two#frag mailto:someone@example.org',
  'café naïve résumé Zürich São Paulo Ångström façade coöperate',
  'Καλημέρα κόσμε. Привет, мир! Здравствуй, товарищ.',
  '你好，世界！日本語のテキスト。한국어 텍스트입니다.',
  'I ❤️ 🍕 and 👨‍👩‍👧‍👦 family 🎉🎉🎉 👍🏽',
  'مرحبا بالعالم नमस्ते दुनिया สวัสดีชาวโลก שלום עולם',
  'e\u0301 vs \u00e9, a\u0308 ñ vs n\u0303',
  'Digits: ٣٤٥ ० १ २ ½ ⅓ Ⅻ x² + y³ ①②',
  'nbsp\u00a0here, ideographic\u3000space, em\u2003space, thin\u2009space, line\u2028sep\u2029para',
  'control \u0007 bell \u0000 nul \u007f del',
  '<|endoftext|>',
  'First document.<|endoftext|>Second document.',
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
  'supercalifragilisticexpialidocious antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis',
  'CamelCaseIdentifier snake_case_name kebab-case-name SCREAMING_SNAKE',
  // Characters where JavaScript's \s and White_Space disagree (see the header comment).
  'next \u0085line and \u0085\u0085 runs',
  '\ufeffBOM at start, and a \ufeffb',
  // Not White_Space (though Python's str.isspace() says they are): no divergence.
  'file\u001cgroup\u001drecord\u001e \u001funit',
  '["a"],"b"',
  '{"x": [1, 2]},"y": "z"',
  "x = ['a',',b'],['c']",
  '"Hello," "world," she said.',
  // Long pieces (the C++ tokenizer switches to a heap-based BPE above 48 bytes).
  pseudoRandom('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/', 400, 1) + '==',
  pseudoRandom('ab', 300, 2),
  pseudoRandom('=-_*#.,;:!?"\'()[]{}<>/\\|', 300, 3),
  pseudoRandom('0123456789', 200, 4),
  ...fortunes('fortunes', 4),
  ...fortunes('literature', 3),
  ...fortunes('riddles', 3),
];

const out = [];
let divergent = 0;
for (const text of cases) {
  const ids = openaiEncode(text);
  const pkgIds = gpt3.encode(text);
  const entry = { text, ids };
  if (JSON.stringify(ids) !== JSON.stringify(pkgIds)) {
    const reasons = [];
    if (/[\u0085\ufeff]/.test(text)) reasons.push('JavaScript \\s differs from White_Space');
    if (reasons.length === 0) {
      console.error(`gen_bpe_fixture: unexplained difference for ${JSON.stringify(text)}:\n  openai ${ids}\n  gpt3   ${pkgIds}`);
      process.exit(1);
    }
    entry.gpt3_encoder_ids = pkgIds;
    entry.note = 'gpt-3-encoder differs from OpenAI encoder.py here: ' + reasons.join('; ');
    divergent++;
  }
  // (Not gpt3.decode: its TextDecoder drops a leading U+FEFF.)
  if (openaiDecode(ids) !== text) {
    console.error(`gen_bpe_fixture: ids do not decode back to ${JSON.stringify(text)}`);
    process.exit(1);
  }
  out.push(entry);
}
console.error(`gen_bpe_fixture: ${out.length} cases, ${divergent} where gpt-3-encoder differs from OpenAI's encoder`);
process.stdout.write('[\n' + out.map((e) => '  ' + JSON.stringify(e)).join(',\n') + '\n]\n');
