#!/usr/bin/env bash
# The main job, from a fresh Debian machine: install dependencies, build the `tally`
# program, tokenize the default English corpus (Debian's fortune cookies) with GPT-2's BPE,
# print the run's memory plan, train a small GPT-2 on the CPU for about seven minutes with
# the memory sanitizer in strict mode (any growth of live memory is an error), and print
# the measured peak beside the plan, the memory report's path and a sample.
#
# The recipe below was chosen for a 2-core machine: it is the lowest validation loss we
# reached within a 10-minute budget (README, "Getting started"). Every knob can be
# overridden, e.g.  STEPS=2000 MODEL=d6 bash scripts/quickstart.sh
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

MODEL="${MODEL:-d4}"           # 4 layers, 4 heads, width 256: 16.3M parameters (12.9M of them the tied embedding)
BATCH="${BATCH:-16}"           # sequences per step
SEQ_LEN="${SEQ_LEN:-64}"       # a fortune is 46 tokens on average
STEPS="${STEPS:-540}"          # 553k tokens: about one pass over the 631k training tokens
LR="${LR:-3e-3}"               # peak AdamW learning rate (small models take a high one)
WARMUP="${WARMUP:-30}"
VAL_EVERY="${VAL_EVERY:-100}"
OUT="${OUT:-out/quickstart}"

bash scripts/setup.sh --corpus
TARGET=tally_cli bash scripts/build.sh

# Tokenize once, and again whenever the text or the way it is split changes: each fortune
# (the lines between two `%`) is a document; the documents are shuffled with a fixed seed
# and the last 10% of them held out for validation.
corpus=data/corpus
tokenize=(build/tally tokenize --tokenizer "$corpus" --out "$corpus/fortunes" --separator % --shuffle-seed 1
          --val-fraction 0.1 "$corpus/fortunes.txt")
stamp="$corpus/fortunes.tokenized-with"
if [ ! -f "$corpus/fortunes_train.bin" ] || [ "$corpus/fortunes.txt" -nt "$corpus/fortunes_train.bin" ] ||
   [ "$(cat "$stamp" 2>/dev/null)" != "${tokenize[*]}" ]; then
  "${tokenize[@]}"
  echo "${tokenize[*]}" > "$stamp"
fi

mkdir -p "$OUT"
rm -f "$OUT/log.jsonl"   # a fresh run: its log and plot start empty, and --overwrite replaces
                         # the checkpoints an earlier quickstart left in $OUT
run=(--model "$MODEL"
     --train-data "$corpus/fortunes_train.bin" --val-data "$corpus/fortunes_val.bin"
     --tokenizer "$corpus"
     --batch-size "$BATCH" --seq-len "$SEQ_LEN" --steps "$STEPS"
     --lr "$LR" --warmup-steps "$WARMUP" --lr-schedule cosine --min-lr-frac 0.1
     --val-every "$VAL_EVERY" --val-batches 16 --sample-every -1
     --save-every "$STEPS" --out-dir "$OUT" --overwrite
     --log-json "$OUT/log.jsonl" --sanitize strict --mem-trace "$OUT/memory.html")

# The peak this run will need, before it starts: `tally plan` takes the same command line.
echo "plan: build/tally plan <the train command's flags>"
build/tally plan "${run[@]}" | sed -n '1,2p'
echo
build/tally train "${run[@]}"

# The sample, from the checkpoint just written (the same command works on any checkpoint).
echo
echo "sample: build/tally sample --model-file $OUT --tokenizer $corpus --count 4 --temperature 0.8 --tokens 96"
build/tally sample --model-file "$OUT" --tokenizer "$corpus" --count 4 --temperature 0.8 --tokens 96
