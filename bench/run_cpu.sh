#!/usr/bin/env bash
# The CPU benchmark of issue 12, in one command: every work against its peer in the same
# session, alternating rounds, then the table into bench/RESULTS.md (bench/cpu_table.py).
#   W1       GPT-2 124M, batch 4 x 64 tokens, fp32       tally  vs PyTorch fp32
#   W1-bf16  the same in mixed precision                 tally --dtype bf16 vs PyTorch autocast(bfloat16)
#   W3       GPT-2 124M, batch 1 x 1024 tokens, fp32      tally  vs PyTorch fp32
#   W3-bf16  the same in mixed precision                 tally --dtype bf16 vs PyTorch autocast(bfloat16)
# Each run times `steps` training steps (AdamW included) after two warm-up steps. Each round
# first measures the memory bandwidth (bench_memory: a STREAM triad), which the table gives
# beside the GEMM peak.
#   bench/run_cpu.sh [rounds=3] [steps=3] [threads=2]     (about 4 minutes a round on 2 cores)
# The raw JSON lines go to bench/cpu_runs_KIND.jsonl (one per run; KIND is amd or intel, the
# two kinds of machine issue 12 names); RESULTS.md gets the table between that kind's
# "cpu-bench" markers, so each kind keeps its latest table. BENCH_WORKS="W1 W3" runs a subset.
# Then the long-sequence scan of attention alone (bench/run_attention_scan.sh, two rounds,
# about 11 minutes more; its own table in RESULTS.md); BENCH_SCAN=0 leaves it out.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
steps="${2:-3}"
threads="${3:-2}"
works="${BENCH_WORKS:-W1 W1-bf16 W3 W3-bf16}"
source "$root/bench/common.sh"
prepare_peers bench/bench_w1 bench/bench_memory
export OMP_NUM_THREADS="$threads"
case "$rounds$steps$threads" in *[!0-9]*) echo "bench/run_cpu.sh: rounds, steps and threads must be whole numbers" >&2; exit 2 ;; esac
[ "$rounds" -ge 1 ] && [ "$steps" -ge 1 ] && [ "$threads" -ge 1 ] || { echo "bench/run_cpu.sh: rounds, steps and threads must be at least 1" >&2; exit 2; }
final="$root/bench/cpu_runs_$(python3 "$root/bench/cpu_table.py" --kind).jsonl"
out="$(begin_runs "$final")"
shape() {  # the flags of a work's shape and precision
  case "$1" in
    W1) echo "--batch 4 --seq 64 --dtype fp32" ;;
    W1-bf16) echo "--batch 4 --seq 64 --dtype bf16" ;;
    W3) echo "--batch 1 --seq 1024 --dtype fp32" ;;
    W3-bf16) echo "--batch 1 --seq 1024 --dtype bf16" ;;
    *) echo "bench/run_cpu.sh: unknown work '$1' (W1, W1-bf16, W3, W3-bf16)" >&2; exit 2 ;;
  esac
}
for round in $(seq "$rounds"); do
  # The memory bandwidth beside the GEMM peak: the table reports it per round and says so
  # when it was erratic (bench/memory_bandwidth.cc).
  record "$out" "{\"work\": \"memory\", \"round\": $round}" "$root/build/bench/bench_memory" 20
  for work in $works; do
    flags="$(shape "$work")"
    # shellcheck disable=SC2086
    record "$out" "{\"work\": \"$work\", \"round\": $round}" "$root/build/bench/bench_w1" "$steps" "$threads" gpt2 $flags
    # shellcheck disable=SC2086
    record "$out" "{\"work\": \"$work\", \"round\": $round}" /usr/bin/python3 "$root/bench/w1_torch.py" "$steps" "$threads" $flags
  done
done
BENCH_COMMAND="$(printf 'BENCH_WORKS="%s" BENCH_SCAN=%s bench/run_cpu.sh %s %s %s' "$works" "${BENCH_SCAN:-1}" "$rounds" "$steps" "$threads")" \
  python3 "$root/bench/cpu_table.py" "$out" "$root/bench/RESULTS.md"
finish_runs "$final"
if [ "${BENCH_SCAN:-1}" != 0 ]; then
  bash "$root/bench/run_attention_scan.sh" 2 "$threads"
fi
