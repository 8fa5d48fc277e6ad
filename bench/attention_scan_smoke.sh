#!/usr/bin/env bash
# A ctest (Bench.AttentionScanTable): bench_attention's JSON line, at a tiny size in fp32
# and bf16, beside a peer run skipped as run_attention_scan.sh skips one, makes the table
# bench/attention_table.py writes between its markers.
#   attention_scan_smoke.sh BENCH_ATTENTION_BINARY
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
echo '{"system": "pytorch", "skipped": "needs ~1 GiB", "seq": 128, "dtype": "fp32", "round": 1}' > "$dir/runs.jsonl"
for dtype in fp32 bf16; do
  "$1" 1 --seq 128 --heads 2 --head-dim 16 --layers 1 --dtype "$dtype" | tail -1 >> "$dir/runs.jsonl"
done
printf '# results\n' > "$dir/RESULTS.md"
python3 "$here/attention_table.py" "$dir/runs.jsonl" "$dir/RESULTS.md" > /dev/null
grep -q '^| 128 | fp32 | [0-9]* ([0-9]*) | [0-9]* / [0-9]* | – | needs ~1 GiB | – |$' "$dir/RESULTS.md"
grep -q '^| 128 | bf16 | [0-9]* ([0-9]*) | [0-9]* / [0-9]* | – | not run | – |$' "$dir/RESULTS.md"
grep -q 'attention-scan:.*:end' "$dir/RESULTS.md"
