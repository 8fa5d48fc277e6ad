#!/usr/bin/env bash
# A sparse layer's MLP alone, in one command: tally's (build/bench/bench_experts: routing,
# grouping by expert, one GEMM per expert and projection, combine) against HuggingFace's
# loop over the experts in PyTorch (bench/experts_torch.py) at the same shape, dropless,
# fp32, alternating the two in each round, for each case: qwen3-moe-d6's layer at the
# 256 tokens of bench/run_moe.sh's step and at 4096, and Qwen3-30B-A3B's (128 experts of
# 768, 8 a token, width 2048) at 1024 tokens, 64 rows an expert on average. Then a table
# of min and median per system, with tally's rate against the GEMM peak it measured.
#   bench/run_experts.sh [rounds=3] [threads=2]       (about 5 minutes on 2 cores)
# EXPERT_CASES="qwen3-moe-d6:4096" runs other cases (PRESET:TOKENS). Raw JSON lines:
# bench/experts_runs_KIND.jsonl.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}"
threads="${2:-2}"
cases="${EXPERT_CASES:-qwen3-moe-d6:256 qwen3-moe-d6:4096 qwen3-30b-a3b:1024}"
source "$root/bench/common.sh"
prepare_peers bench/bench_experts
export OMP_NUM_THREADS="$threads"
final="$root/bench/experts_runs_$(python3 "$root/bench/cpu_table.py" --kind).jsonl"
out="$(begin_runs "$final")"
for round in $(seq "$rounds"); do
  for case in $cases; do
    preset="${case%%:*}" tokens="${case##*:}"
    line="$(record "$out" "{\"round\": $round, \"threads\": $threads}" "$root/build/bench/bench_experts" 5 --model "$preset" --tokens "$tokens")"
    shape="$(python3 -c "import json, sys; r = json.loads(sys.argv[1]); print(r['tokens'], r['width'], r['experts'], r['top_k'], r['expert_width'], '' if r['norm_topk_prob'] else '--no-norm-topk-prob')" "$line")"
    read -r N C E K FE norm <<< "$shape"
    record "$out" "{\"round\": $round, \"threads\": $threads, \"model\": \"$preset\"}" /usr/bin/python3 "$root/bench/experts_torch.py" 5 "$threads" \
      --tokens "$N" --width "$C" --experts "$E" --top-k "$K" --expert-width "$FE" $norm
  done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n| case | system | step min ms | median of round medians | per-round medians | tally's rate: step, GEMMs (of the peak) |")
print("|---|---|---|---|---|---|")
for case in dict.fromkeys((r["model"], r["tokens"]) for r in rows):
    mine = [r for r in rows if (r["model"], r["tokens"]) == case]
    for system in dict.fromkeys(r["system"] for r in mine):
        runs = [r for r in mine if r["system"] == system]
        medians = [r["step_median_ms"] for r in runs]
        rate = ""
        if system == "tally":
            best = min(runs, key=lambda r: r["step_min_ms"])
            step = best["step_gflop"] / (best["step_min_ms"] * 1e-3) / best["gemm_peak_gflops"]
            gemm = best["step_gflop"] / ((best["forward_gemm_min_ms"] + best["backward_gemm_min_ms"]) * 1e-3) / best["gemm_peak_gflops"]
            rate = f"{100 * step:.0f}%, {100 * gemm:.0f}% (peak {best['gemm_peak_gflops']:.0f} GFLOP/s)"
        print(f"| {case[0]} N={case[1]} | {system} | {min(r['step_min_ms'] for r in runs):.1f} | "
              f"{statistics.median(medians):.1f} | {', '.join(f'{m:.1f}' for m in medians)} | {rate} |")
EOF
finish_runs "$final"
