#!/usr/bin/env bash
# Context parallel and long steps, on this machine (one thread a rank):
#   long       qwen2.5-d4 (4 layers of width 256, 4 query and 2 kv heads, Qwen's 151,936-token
#              vocabulary, --chunked-loss), B=1, T = 8192 and 16384: one process against
#              --cp 2 and --cp 4 (4 ranks on 2 cores are oversubscribed: their time is not a
#              speed-up figure). Per run: the step time (median of the steps after the
#              first), tokens/s, every rank's peak, the bytes handed to the cp group's
#              collectives and the share of the step they ran (the all-gathers block: none
#              of it is hidden behind attention).
#   microbatches  the tests' tiny GPT-2 (tests/fixtures/gpt2_tiny.bin: 2 layers of width 32,
#              a 97-token vocabulary), B=1, T=32, --sanitize strict: a step of N = 64, 256,
#              1024 and 4096 microbatches; the time a microbatch takes must not grow with N.
# Prints one JSON line per run.   bench/run_cp.sh [long|microbatches|all]
# (TALLY=path times another build of tally.)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
what="${1:-all}"
source "$root/bench/common.sh"
tally_runs_here
python3 "$root/bench/random_shard.py" "$work/tiny.bin" 200000 --vocab 97

summarize() {  # summarize LABEL LOG.jsonl STDOUT [key=value ...]
  python3 - "$@" <<'PY'
import json, re, sys
label, log, out = sys.argv[1:4]
extra = dict(a.split("=", 1) for a in sys.argv[4:])
every = [json.loads(l) for l in open(log)]
rows = every[1:]  # after the first step
per_step = every[1]["tokens"] - every[0]["tokens"]
ms = sorted(r["ms"] for r in rows)
median = ms[len(ms) // 2]
res = {"run": label, **extra, "median_ms": round(median, 1), "min_ms": round(ms[0], 1),
       "tokens_per_s": round(per_step / (median / 1000), 1),
       "rank_peak_bytes": rows[-1]["rank_peak_bytes"]}
if "cp_payload_bytes" in rows[-1]:
    res["cp_payload_bytes"] = rows[-1]["cp_payload_bytes"]
    res["cp_comm_share"] = round(rows[-1]["cp_comm_s"] / (rows[-1]["ms"] / 1000), 3)
if "N" in extra:
    res["ms_per_microbatch"] = round(median / int(extra["N"]), 3)
m = re.search(r"GEMM peak (\d+) GFLOP/s", open(out).read())
res["gemm_peak_gflops"] = int(m.group(1)) if m else None
print(json.dumps(res))
PY
}

run() {  # run RANKS LABEL EXTRA... -- FLAGS...
  local ranks="$1" label="$2"; shift 2
  local extra=()
  while [ "$1" != "--" ]; do extra+=("$1"); shift; done
  shift
  rm -rf "$work/out" "$work/log.jsonl"
  local launch=()
  [ "$ranks" -gt 1 ] && launch=(mpirun --oversubscribe -np "$ranks")
  "${launch[@]}" "$tally" train --threads 1 --lr 1e-4 --sample-every -1 \
      --out-dir "$work/out" --log-json "$work/log.jsonl" "$@" > "$work/stdout"
  summarize "$label" "$work/log.jsonl" "$work/stdout" "${extra[@]}"
}

if [ "$what" = long ] || [ "$what" = all ]; then
  for T in 8192 16384; do
    for cp in 1 2 4; do
      run "$cp" "cp$cp T=$T" T="$T" cp="$cp" -- --train-data "$work/train.bin" --model qwen2.5-d4 --chunked-loss --batch-size 1 --seq-len "$T" --steps 2 --cp "$cp"
    done
  done
fi
if [ "$what" = microbatches ] || [ "$what" = all ]; then
  for N in 64 256 1024 4096; do
    run 1 "one process N=$N" N="$N" -- --train-data "$work/tiny.bin" --model-file "$root/tests/fixtures/gpt2_tiny.bin" \
        --batch-size 1 --seq-len 32 --grad-accum "$N" --steps 3 --sanitize strict
  done
fi
