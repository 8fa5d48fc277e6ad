#!/usr/bin/env bash
# The main job, from a fresh Debian machine: install dependencies, build tally, tokenize
# the default English corpus (Debian's fortune cookies) with GPT-2 BPE, train a small
# GPT-2 on the CPU for a few minutes, and print a sample from it.
#   STEPS=300 MODEL=d6 bash scripts/quickstart.sh     (overridable)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

bash scripts/setup.sh --corpus
bash scripts/build.sh

corpus=data/corpus
if [ ! -f "$corpus/fortunes_train.bin" ] || [ "$corpus/fortunes.txt" -nt "$corpus/fortunes_train.bin" ]; then
  build/tally tokenize --tokenizer "$corpus" --out "$corpus/fortunes" "$corpus/fortunes.txt"
fi

build/tally train \
  --model "${MODEL:-d6}" \
  --train-data "$corpus/fortunes_train.bin" --val-data "$corpus/fortunes_val.bin" \
  --tokenizer "$corpus" \
  --batch-size 8 --seq-len 64 --steps "${STEPS:-300}" \
  --lr 1e-3 --warmup-steps 20 --lr-schedule cosine --min-lr-frac 0.1 \
  --val-every 100 --sample-every 0 --sample-tokens 96 \
  --save-every "${STEPS:-300}" --out-dir out/quickstart \
  --log-json out/quickstart/log.jsonl --sanitize warn
