#!/usr/bin/env bash
# Expert parallel on this machine (one thread a rank, 2 or 4 ranks): qwen3-moe-d4 (4 sparse
# layers of width 256, 8 experts of 256, 2 a token; Qwen's 151,936-token vocabulary,
# --chunked-loss), B=4, T=64, 2 microbatches a rank, AdamW, fp32:
#   dp2          every rank holds all 8 experts
#   dp2 ep2      each rank holds 4; tokens dispatched and combined by MPI_Alltoallv
#   dp2 ep2 cap  the same at --moe-capacity-factor 1.25 (every expert padded to 80 rows)
#   dp4 ep4 cap  4 ranks, each holding 2 experts, at the same capacity
#   dp4 ep2 cap  4 ranks in 2 expert-parallel groups, at the same capacity, with ZeRO-1
#   dp2 tp2 ep2 cap  4 ranks: each expert split over 2 tensor-parallel ranks as well
#                (the vocabulary-parallel loss instead of --chunked-loss)
# (4 ranks on 2 cores share them: their times are not comparable with 2 ranks'; their
# all-to-all bytes are.)
# Per run: the step time (median and min of the steps after the first), tokens/s, every
# rank's peak, the bytes rank 0 handed to the all-to-alls in a step against the formula
#   microbatches x sparse layers x (8 E + 4 x rows x C x 4 bytes)
# (rows: E x capacity at a capacity, exact; dropless N k, the balanced figure, since the
# combine hands back the rows the rank received; dispatch and combine, forward and
# backward; the count exchange first), the share of the step the all-to-alls ran, and the
# pairs dropped. Prints one JSON line per run.   bench/run_ep.sh [steps]
# (TALLY=path times another build of tally.)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-6}"
source "$root/bench/common.sh"
tally_runs_here

run() {  # run LABEL THEORY_ROWS RANKS -- FLAGS...
  local label="$1" rows="$2" ranks="$3"; shift 4
  rm -rf "$work/out" "$work/log.jsonl"
  local chunked=--chunked-loss  # not under --tp: its loss is vocabulary-parallel already
  [[ " $* " == *" --tp "* ]] && chunked=
  mpirun --oversubscribe -np "$ranks" "$tally" train --threads 1 --model qwen3-moe-d4 --batch-size 4 --seq-len 64 \
      --grad-accum 2 $chunked --steps "$steps" --lr 1e-4 --sample-every -1 --train-data "$work/train.bin" \
      --out-dir "$work/out" --log-json "$work/log.jsonl" "$@" > "$work/stdout"
  python3 - "$label" "$rows" "$work/log.jsonl" "$work/stdout" <<'PY'
import json, re, sys
label, rows, log, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
every = [json.loads(l) for l in open(log)]
steady = every[1:]
ms = sorted(r["ms"] for r in steady)
median = ms[len(ms) // 2]
per_step = every[1]["tokens"] - every[0]["tokens"]
E, C, layers, microbatches = 8, 256, 4, 2
res = {"run": label, "median_ms": round(median, 1), "min_ms": round(ms[0], 1),
       "tokens_per_s": round(per_step / (median / 1000), 1), "rank_peak_bytes": steady[-1]["rank_peak_bytes"]}
last = steady[-1]
if "ep_payload_bytes" in last:
    theory = microbatches * layers * (8 * E + 4 * rows * C * 4)
    res.update(ep_payload_bytes=last["ep_payload_bytes"], theory_bytes=theory,
               ep_comm_share=round(last["ep_comm_s"] / (last["ms"] / 1000), 3))
if "expert_load" in last:
    res["expert_load"] = last["expert_load"]
m = re.search(r"GEMM peak (\d+) GFLOP/s", open(out).read())
res["gemm_peak_gflops"] = int(m.group(1)) if m else None
print(json.dumps(res))
PY
}

N=$((4 * 64)) k=2 E=8
cap=$(( (5 * N * k + 4 * E - 1) / (4 * E) ))  # ceil(1.25 N k / E)
run "dp2" 0 2 -- --dp 2
run "dp2 ep2" $((N * k)) 2 -- --dp 2 --ep 2
run "dp2 ep2 capacity 1.25" $((E * cap)) 2 -- --dp 2 --ep 2 --moe-capacity-factor 1.25
run "dp4 ep4 capacity 1.25" $((E * cap)) 4 -- --dp 4 --ep 4 --moe-capacity-factor 1.25
run "dp4 ep2 zero1 capacity 1.25" $((E * cap)) 4 -- --dp 4 --ep 2 --zero 1 --moe-capacity-factor 1.25
run "dp2 tp2 ep2 capacity 1.25" $((E * cap)) 4 -- --dp 2 --tp 2 --ep 2 --moe-capacity-factor 1.25
