#!/usr/bin/env bash
# Pipeline and tensor parallel, and activation recomputation, measured against their
# theory on one machine (GPT-2 d12, 124M, fp32, AdamW, batch 1 x 64 tokens per microbatch):
#   pipeline   2 ranks x 1 thread: gpipe, 1f1b and interleaved (V=2) at N = 4 and 8
#              microbatches: the measured idle share of each stage (time blocked on a
#              neighbour) against (P-1)/(N+P-1) (gpipe, 1f1b) and (P-1)/(V*N+P-1)
#              (interleaved), and each stage's peak memory
#   tensor     2 ranks x 1 thread: tp2 and tp2+sp: bytes handed to the tp group's
#              collectives per step against the formula, and what a ring puts on the wire
#   recompute  1 process x 2 threads, batch 4: none, selective, full: peak and time
# Prints one JSON line per run.   bench/run_parallel.sh [steps=6]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-6}"
[ -x "$root/build/tally" ] || bash "$root/scripts/build.sh"
data="$root/data/corpus/fortunes_train.bin"
if [ ! -f "$data" ]; then
  bash "$root/scripts/setup.sh" --corpus
  "$root/build/tally" tokenize --tokenizer "$root/data/corpus" --out "$root/data/corpus/fortunes" "$root/data/corpus/fortunes.txt"
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
common=(--model d12 --train-data "$data" --seq-len 64 --steps "$steps" --lr 1e-4 --sample-every -1 --sample-tokens 0
        --out-dir "$work/out")

summarize() {  # summarize LABEL LOG.jsonl STDOUT [key=value ...]
  python3 - "$@" <<'PY'
import json, re, sys
label, log, out = sys.argv[1:4]
extra = dict(a.split("=", 1) for a in sys.argv[4:])
rows = [json.loads(l) for l in open(log)][2:]  # after 2 warm-up steps
ms = sorted(r["ms"] for r in rows)
res = {"run": label, "median_ms": round(ms[len(ms) // 2], 1), "min_ms": round(ms[0], 1),
       "rank_peak_bytes": rows[-1]["rank_peak_bytes"]}
m = re.search(r"GEMM peak (\d+) GFLOP/s", open(out).read())
res["gemm_peak_gflops"] = int(m.group(1)) if m else None
if "bubble_frac" in rows[0]:
    b = sorted(r["bubble_frac"] for r in rows)
    res["idle_share_mean_over_stages"] = {"median": round(b[len(b) // 2], 3), "min": round(b[0], 3)}
    P, N, V = int(extra["P"]), int(extra["N"]), int(extra.get("V", 1))
    res["idle_share_per_stage"] = [round(f, 3) for f in rows[-1]["rank_idle_frac"]]
    res["bubble_theory"] = round((P - 1) / (V * N + P - 1), 3)
    res["max_in_flight"] = rows[-1]["max_in_flight"]
if "tp_payload_bytes" in rows[0]:
    L, C, T, n, N = (int(extra[k]) for k in ("L", "C", "T", "tp", "N"))
    act = N * T * C * 4  # one (B=1, T, C) fp32 activation per microbatch
    if extra.get("sp") == "1":
        # all-gather (payload: the gathered tensor) and reduce-scatter (its input) at both
        # ends of every column/row pair, embedding and head: 4L + 2 per pass, both passes.
        payload, wire = (8 * L + 4) * act, (8 * L + 4) * act * (n - 1) / n
    else:
        # all-reduce out of each row-parallel pair and of the embedding in forward, and into
        # each column-parallel pair and the head in backward: 2L + 1 per pass.
        payload, wire = (4 * L + 2) * act, (4 * L + 2) * act * 2 * (n - 1) / n
    res["tp_payload_bytes_measured"] = rows[-1]["tp_payload_bytes"]
    res["tp_payload_bytes_activations_formula"] = payload
    res["tp_wire_bytes_per_rank_ring"] = int(wire)
print(json.dumps(res))
PY
}

run() {  # run LABEL RANKS THREADS [summary keys] -- ARGS...
  local label="$1" ranks="$2" threads="$3"; shift 3
  local keys=()
  while [ "$1" != "--" ]; do keys+=("$1"); shift; done; shift
  local launcher=()
  [ "$ranks" -gt 1 ] && launcher=(mpirun --oversubscribe -np "$ranks")
  OMP_NUM_THREADS="$threads" "${launcher[@]}" "$root/build/tally" train "${common[@]}" --threads "$threads" \
    --log-json "$work/$label.jsonl" "$@" > "$work/$label.out" 2>&1 || { cat "$work/$label.out"; exit 1; }
  summarize "$label" "$work/$label.jsonl" "$work/$label.out" "${keys[@]}"
}

# GPT-2's head costs about 5.5 layers (V / 12C): the last stage gets 3 of the 12 layers
# (1 of them with 4 interleaved stages), so the stages do about the same work.
for N in 4 8; do
  run "pp2-gpipe-N$N" 2 1 P=2 N=$N -- --batch-size 1 --pp 2 --pp-schedule gpipe --grad-accum $N --pp-last-stage-layers 3
  run "pp2-1f1b-N$N" 2 1 P=2 N=$N -- --batch-size 1 --pp 2 --pp-schedule 1f1b --grad-accum $N --pp-last-stage-layers 3
  run "pp2-interleaved-V2-N$N" 2 1 P=2 N=$N V=2 -- --batch-size 1 --pp 2 --pp-schedule interleaved --virtual-stages 2 \
    --grad-accum $N --pp-last-stage-layers 1
done
run "tp2" 2 1 L=12 C=768 T=64 tp=2 N=4 -- --batch-size 1 --tp 2 --grad-accum 4
run "tp2-sp" 2 1 L=12 C=768 T=64 tp=2 N=4 sp=1 -- --batch-size 1 --tp 2 --sp --grad-accum 4
for r in none selective full; do
  run "recompute-$r" 1 2 -- --batch-size 4 --recompute $r
done
