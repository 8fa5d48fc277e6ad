#!/usr/bin/env bash
# Runs W1 for tally and PyTorch in the same session, alternating, and prints both JSON
# lines (the ratio is what counts on a noisy machine).  bench/run_w1.sh [steps] [threads]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-10}"
threads="${2:-2}"
[ -x "$root/build/bench/bench_w1" ] || bash "$root/scripts/build.sh"
/usr/bin/python3 -c "import torch" 2>/dev/null || bash "$root/scripts/setup.sh" --torch
# Debian's OpenBLAS does not recognize every CPU (on a Sapphire Rapids VM it picks its
# generic "Prescott" kernels, ~25 GFLOP/s): give PyTorch its best by naming the AVX-512
# kernels unless the caller set a core type.
export OPENBLAS_CORETYPE="${OPENBLAS_CORETYPE:-SkylakeX}"
for round in 1 2; do
  OMP_NUM_THREADS="$threads" "$root/build/bench/bench_w1" "$steps" "$threads"
  OMP_NUM_THREADS="$threads" /usr/bin/python3 "$root/bench/w1_torch.py" "$steps" "$threads"
done
