#!/usr/bin/env bash
# Runs W1 for tally and PyTorch in the same session, alternating, and prints both JSON
# lines (the ratio is what counts on a noisy machine).  bench/run_w1.sh [steps] [threads]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-10}"
threads="${2:-2}"
source "$root/bench/common.sh"
prepare_peers bench/bench_w1
for round in 1 2; do
  OMP_NUM_THREADS="$threads" "$root/build/bench/bench_w1" "$steps" "$threads"
  OMP_NUM_THREADS="$threads" /usr/bin/python3 "$root/bench/w1_torch.py" "$steps" "$threads"
done
