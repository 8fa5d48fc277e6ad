#!/usr/bin/env bash
# Runs L1 (LLaMA-3 shape llama3-d6, B=4, T=64, fp32, AdamW) for tally and PyTorch in the same
# session, alternating rounds, and prints every JSON line (compare min and median per system).
#   bench/run_llama.sh [steps] [threads] [rounds]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-10}"
threads="${2:-2}"
rounds="${3:-4}"
source "$root/bench/common.sh"
prepare_peers bench/bench_w1
for round in $(seq "$rounds"); do
  OMP_NUM_THREADS="$threads" "$root/build/bench/bench_w1" "$steps" "$threads" llama3-d6
  OMP_NUM_THREADS="$threads" /usr/bin/python3 "$root/bench/llama_torch.py" "$steps" "$threads"
done
