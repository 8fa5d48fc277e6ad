#!/usr/bin/env bash
# A ctest (Bench.CpuTableWithMemoryProbe): bench_memory's JSON line at a tiny size, and the
# table bench/cpu_table.py writes from runs with memory probes: the probes' sentence beside
# the GEMM peak, and the warning only where a round's median fell below half the best.
#   cpu_table_smoke.sh BENCH_MEMORY_BINARY
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
line="$("$1" 3 --mib 4 | tail -1)"
python3 -c "import json, sys; r = json.loads(sys.argv[1]); assert r['system'] == 'memory' and r['mib_per_array'] == 4 \
  and r['repetitions'] == 3 and 0 < r['worst_gbps'] <= r['median_gbps'] <= r['best_gbps'], r" "$line"
table() {  # table PROBE_MEDIAN_ROUND_2: a W1 pair of runs and two rounds' probes -> the table's text
  {
    echo '{"system": "memory", "kernel": "triad", "mib_per_array": 256, "threads": 2, "repetitions": 20, "best_gbps": 30.0, "median_gbps": 28.0, "worst_gbps": 20.0, "work": "memory", "round": 1}'
    echo "{\"system\": \"memory\", \"kernel\": \"triad\", \"mib_per_array\": 256, \"threads\": 2, \"repetitions\": 20, \"best_gbps\": 29.0, \"median_gbps\": $1, \"worst_gbps\": 0.1, \"work\": \"memory\", \"round\": 2}"
    for round in 1 2; do
      # Round 1 as runs before 2026-11-29 (no flops_per_step: the table derives it from the
      # % of GEMM peak), round 2 with it; both are 0.73 x 330 GFLOP/s x 0.8 s.
      flops=""; [ "$round" = 2 ] && flops=', "flops_per_step": 1.9272e11'
      echo "{\"system\": \"tally\", \"ms_per_step\": 800, \"min_ms\": 790, \"tokens_per_s\": 320, \"gemm_peak_gflops\": 330, \"pct_gemm_peak\": 73, \"peak_rss_bytes\": 2000000000, \"peak_allocated_bytes\": 1900000000, \"threads\": 2, \"dtype\": \"fp32\", \"work\": \"W1\", \"round\": $round$flops}"
      echo "{\"system\": \"pytorch 1.13\", \"ms_per_step\": 2400, \"min_ms\": 2000, \"tokens_per_s\": 107, \"peak_rss_bytes\": 3000000000, \"work\": \"W1\", \"round\": $round}"
    done
  } > "$dir/runs.jsonl"
  printf '# results\n' > "$dir/RESULTS.md"
  python3 "$here/cpu_table.py" "$dir/runs.jsonl" "$dir/RESULTS.md" > /dev/null
  cat "$dir/RESULTS.md"
}
steady="$(table 27.5)"
grep -q 'Memory bandwidth measured in the same session (.*): 30.0 / 28.0, 29.0 / 27.5\.' <<< "$steady"
# (not `! grep`: set -e ignores a negated command's status, so that line could never fail)
if grep -q 'erratic' <<< "$steady"; then echo "a steady session's table warns that memory was erratic" >&2; exit 1; fi
# The ceiling: 1.9272e11 FLOPs at 330 GFLOP/s is a 584 ms step, and 2400 / 584 = 4.11.
grep -q '^| W1 | tally | 790 | 800 | 320 | 1812 / 1907 | 73% | \*\*3.00x\*\* (2.53x on min) | 584 ms: 4.11x |$' <<< "$steady"
erratic="$(table 9.0)"
grep -q '29.0 / 9.0\. \*\*The memory was erratic in this session\*\*' <<< "$erratic"
