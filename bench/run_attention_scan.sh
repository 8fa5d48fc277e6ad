#!/usr/bin/env bash
# Attention at long sequences, in one command: tally's blocked causal attention
# (build/bench/bench_attention) against PyTorch's eager attention (bench/attention_torch.py,
# the formulation of W3's peer, which materializes (B, H, T, T)), one GPT-2 124M layer at
# batch 1, fp32 and bf16, for each T, alternating the two in each round; then the table into
# bench/RESULTS.md (bench/attention_table.py). The peer is skipped at a T whose (T, T)
# tensors would not fit: it keeps about 13 bytes per score in fp32 and 7 under autocast
# (measured: its peak RSS growth at T = 2048 and 4096), against 80% of MemAvailable.
#   bench/run_attention_scan.sh [rounds=2] [threads=2]       (about 10 minutes on 2 cores)
# SCAN_SEQS="1024 4096" runs other lengths. Raw JSON lines: bench/attention_runs_KIND.jsonl.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-2}"
threads="${2:-2}"
seqs="${SCAN_SEQS:-1024 2048 4096 8192 16384}"
heads=12
source "$root/bench/common.sh"
prepare_peers bench/bench_attention
export OMP_NUM_THREADS="$threads"
final="$root/bench/attention_runs_$(python3 "$root/bench/cpu_table.py" --kind).jsonl"
out="$(begin_runs "$final")"
available_kib=$(awk '/^MemAvailable:/ {print $2}' /proc/meminfo)
for round in $(seq "$rounds"); do
  for T in $seqs; do
    for dtype in fp32 bf16; do
      record "$out" "{\"round\": $round, \"threads\": $threads}" "$root/build/bench/bench_attention" 3 --seq "$T" --layers 1 --dtype "$dtype"
      per_score=$([ "$dtype" = fp32 ] && echo 13 || echo 7)
      need=$((per_score * heads * T * T))
      if [ $((need >> 10)) -gt $((available_kib * 8 / 10)) ]; then
        echo "{\"system\": \"pytorch\", \"skipped\": \"needs ~$((need >> 30)) GiB\", \"seq\": $T, \"dtype\": \"$dtype\", \"round\": $round}" >> "$out"
        tail -1 "$out"
      else
        record "$out" "{\"round\": $round, \"threads\": $threads}" /usr/bin/python3 "$root/bench/attention_torch.py" 3 "$threads" --seq "$T" --layers 1 --dtype "$dtype"
      fi
    done
  done
done
python3 "$root/bench/attention_table.py" "$out" "$root/bench/RESULTS.md"
finish_runs "$final"
