#!/usr/bin/env bash
# Runs M1 (Qwen3-MoE shape qwen3-moe-d6, B=4, T=64, fp32, AdamW) for tally and PyTorch in the
# same session, alternating rounds, and prints every JSON line (compare min and median per
# system, with tally's measured GEMM peak beside them).
#   bench/run_moe.sh [steps] [threads] [rounds]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
source "$root/bench/common.sh"
alternate_with_torch qwen3-moe-d6 moe_torch.py "${1:-10}" "${2:-2}" "${3:-4}"
