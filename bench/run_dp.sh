#!/usr/bin/env bash
# Data parallel on one machine, GPT-2 d12 (124M), fp32, AdamW, global batch 2 x 4 x 64
# tokens per step, alternating rounds in one session:
#   tally   1 rank  x 2 threads, grad-accum 2
#   tally   2 ranks x 1 thread (mpirun), grad-accum 1, for --zero 0, 1, 2 and 3
#   PyTorch DistributedDataParallel (gloo), 2 ranks x 1 thread
# Prints one JSON line per run: median and min ms per step (after 2 warm-up steps),
# tokens/s, peak allocated per rank, peak RSS, and tally's own report of the all-reduce
# (bytes, overlap) and of model-state memory against its formula.
#   bench/run_dp.sh [steps=6] [rounds=2]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-6}"
rounds="${2:-2}"
source "$root/bench/common.sh"
prepare_peers tally  # and PyTorch's OpenBLAS kernels by name (bench/common.sh)
data="$root/data/corpus/fortunes_train.bin"
if [ ! -f "$data" ]; then
  bash "$root/scripts/setup.sh" --corpus
  "$root/build/tally" tokenize --tokenizer "$root/data/corpus" --out "$root/data/corpus/fortunes" "$root/data/corpus/fortunes.txt"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
common=(--model d12 --train-data "$data" --batch-size 4 --seq-len 64 --steps "$steps" --lr 1e-4 --sample-every -1 --sample-tokens 0)

summarize() {  # summarize LABEL LOG.jsonl STDOUT
  /usr/bin/python3 - "$@" <<'PY'
import json, re, sys
label, log, out = sys.argv[1:4]
rows = [json.loads(l) for l in open(log)][2:]  # after 2 warm-up steps
ms = sorted(r["ms"] for r in rows)
text = open(out).read()
res = {"system": label, "ms_per_step": round(ms[len(ms) // 2], 1), "min_ms": round(ms[0], 1),
       "tokens_per_s": round(sorted(r["tokens_per_s"] for r in rows)[len(rows) // 2]),
       "peak_allocated_per_rank": rows[-1]["rank_peak_bytes"], "peak_rss_bytes": rows[-1]["peak_rss_bytes"]}
for key, pattern in [("gemm_peak", r"GEMM peak (\d+) GFLOP/s"), ("all_reduce", r"all-reduce per step: (.*)"),
                     ("model_states", r"memory per rank: (.*)")]:
    m = re.search(pattern, text)
    if m: res[key] = m.group(1)
print(json.dumps(res))
PY
}

for round in $(seq 1 "$rounds"); do
  echo "# round $round"
  OMP_NUM_THREADS=2 "$root/build/tally" train "${common[@]}" --grad-accum 2 --threads 2 \
    --log-json "$work/one.jsonl" > "$work/one.txt"
  summarize "tally 1 rank x 2 threads" "$work/one.jsonl" "$work/one.txt"
  for zero in 0 1 2 3; do
    OMP_NUM_THREADS=1 mpirun --oversubscribe -np 2 "$root/build/tally" train "${common[@]}" --dp 2 --grad-accum 1 \
      --threads 1 --zero "$zero" --log-json "$work/dp.jsonl" > "$work/dp.txt"
    summarize "tally 2 ranks x 1 thread, zero $zero" "$work/dp.jsonl" "$work/dp.txt"
  done
  pids=()
  for rank in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 RANK=$rank WORLD_SIZE=2 OMP_NUM_THREADS=1 \
      /usr/bin/python3 "$root/bench/dp_torch.py" "$((steps - 2))" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
done
