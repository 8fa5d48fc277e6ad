#!/usr/bin/env bash
# Two builds of `tally` timed against each other in one session, alternating rounds: is a
# change (a refactor, a new part of the step) any slower? Each round runs, with each
# binary in turn,
#   W1   tally train --model gpt2 --batch-size 4 --seq-len 64, one process, 2 threads
#   dp2  mpirun -np 2 tally train --model d12 --batch-size 4 --seq-len 64, 1 thread a rank
# and prints one JSON line per run: the median and min step (after 2 warm-up steps) and
# the GEMM peak the run measured at start-up.
#   bench/compare_builds.sh BEFORE_TALLY AFTER_TALLY [steps=8] [rounds=3]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
before="$1"
after="$2"
steps="${3:-8}"
rounds="${4:-3}"
data="$root/data/corpus/fortunes_train.bin"
if [ ! -f "$data" ]; then
  bash "$root/scripts/setup.sh" --corpus
  "$after" tokenize --tokenizer "$root/data/corpus" --out "$root/data/corpus/fortunes" --separator % "$root/data/corpus/fortunes.txt"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
common=(--train-data "$data" --batch-size 4 --seq-len 64 --steps "$steps" --lr 1e-4 --sample-every -1)

summarize() {  # summarize LABEL LOG.jsonl STDOUT
  /usr/bin/python3 - "$@" <<'PY'
import json, re, sys
label, log, out = sys.argv[1:4]
rows = [json.loads(l) for l in open(log)][2:]  # after 2 warm-up steps
ms = sorted(r["ms"] for r in rows)
m = re.search(r"GEMM peak (\d+) GFLOP/s", open(out).read())
print(json.dumps({"run": label, "median_ms": round(ms[len(ms) // 2], 1), "min_ms": round(ms[0], 1),
                  "gemm_peak_gflops": int(m.group(1)) if m else None}))
PY
}

for round in $(seq 1 "$rounds"); do
  echo "# round $round"
  for which in before after; do
    bin="${!which}"
    OMP_NUM_THREADS=2 "$bin" train --model gpt2 "${common[@]}" --threads 2 --out-dir "$work/w1" \
      --log-json "$work/w1.jsonl" > "$work/w1.txt"
    summarize "W1 $which" "$work/w1.jsonl" "$work/w1.txt"
    OMP_NUM_THREADS=1 mpirun --oversubscribe -np 2 "$bin" train --model d12 "${common[@]}" --dp 2 --threads 1 \
      --out-dir "$work/dp2" --log-json "$work/dp2.jsonl" > "$work/dp2.txt"
    summarize "dp2 $which" "$work/dp2.jsonl" "$work/dp2.txt"
  done
done
