#!/usr/bin/env bash
# The CUDA issue's checks in one call on a GPU machine. Builds nothing: build here with
# nvcc (bash scripts/build.sh) and carry build/ over. Writes its logs under $OUT (the device
# tool's folder) or bench/cuda_out, and prints the W2 table last.
#   1. the CUDA tests (build/test_cuda): the kernels of a training step against the CPU backend, training
#      against the CPU run, device memory flat across steps and microbatches
#   2. W2 = GPT-2 124M, T=1024, bf16, one step per microbatch: tally at each batch size in
#      W2_BATCHES (default "8 16 32"), then PyTorch eager and torch.compile (bench/w2_torch.py)
#   3. the flatness run: d2, 200 steps x 64 microbatches, live bytes identical after every step
#      (W2_FLAT=0 leaves it out)
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
final="${OUT:-$root/bench/cuda_out}"
out=/tmp/cuda_bench  # every log; $final gets the test log, the table and a tarball of the rest
rm -rf "$out"
mkdir -p "$out" "$final"
cd "$root"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader | tee "$out/gpu.txt"

echo "== CUDA tests"
timeout "${CUDA_TEST_TIMEOUT:-300}" ./build/test_cuda --gtest_brief=1 > "$out/test_cuda.log" 2>&1
echo "test_cuda exit $?"; grep -E "PASSED|FAILED|Failure|Expected|Which is|rel|error" "$out/test_cuda.log" | head -60

echo "== W2: tally"
python3 bench/random_shard.py /tmp/w2_train.bin 4000000
steps="${W2_STEPS:-20}"
tally_logs=()
for b in ${W2_BATCHES:-8 16 32}; do
  log="$out/w2_tally_b$b.jsonl"
  if timeout 150 ./build/tally train --device cuda --dtype bf16 --model gpt2 --train-data /tmp/w2_train.bin --batch-size "$b" \
      --seq-len 1024 --steps "$steps" --lr 3e-4 --sample-every -1 --sample-tokens 0 --out-dir /tmp/w2_out --overwrite \
      --log-json "$log" ${W2_FLAGS:-} > "$out/w2_tally_b$b.txt" 2>&1; then
    tally_logs+=("$b=$log")
  fi
  head -8 "$out/w2_tally_b$b.txt"; tail -3 "$out/w2_tally_b$b.txt"
done
peak=$(grep -o "measured bf16 GEMM peak [0-9.]* GFLOP/s" "$out"/w2_tally_b*.txt | head -1 | grep -o "[0-9.]*" | tail -1)

if [ "${W2_PROFILE:-0}" = 1 ]; then
  echo "== W2: tally, B=16, per-kernel times (--profile-ops: each kernel waited for)"
  timeout 120 ./build/tally train --device cuda --dtype bf16 --model gpt2 --train-data /tmp/w2_train.bin --batch-size 16 \
    --seq-len 1024 --steps 4 --sample-every -1 --sample-tokens 0 --out-dir /tmp/w2_out --overwrite --profile-ops \
    ${W2_FLAGS:-} > "$out/w2_profile.txt" 2>&1
  tail -6 "$out/w2_profile.txt"
fi

torch_json=()
if [ "${W2_TORCH:-1}" = 1 ]; then
  echo "== W2: PyTorch"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/w2_torch.py --mode both --batch "${W2_TORCH_BATCH:-16}" --steps "$steps" \
    --json "$out/w2_torch.json" 2>&1 | tail -6
  torch_json=(--torch "$out/w2_torch.json")
fi

flat=()
if [ "${W2_FLAT:-1}" = 1 ]; then
  echo "== flatness: d2, 200 steps x 64 microbatches"
  timeout 200 ./build/tally train --device cuda --dtype bf16 --model d2 --train-data /tmp/w2_train.bin --batch-size 4 \
    --seq-len 64 --grad-accum 64 --steps 200 --sample-every -1 --sample-tokens 0 --out-dir /tmp/flat_out \
    --overwrite --quiet --log-json "$out/flat.jsonl" > /dev/null 2>&1 && flat=(--flat "$out/flat.jsonl")
fi

echo "== W2 table"
python3 bench/cuda_summary.py --peak-tflops "$(python3 -c "print(${peak:-0} / 1000)")" --tally "${tally_logs[@]}" \
  "${torch_json[@]}" "${flat[@]}" | tee "$out/w2_table.md"
cp "$out/test_cuda.log" "$out/w2_table.md" "$final/" 2>/dev/null
tar czf "$final/cuda_logs.tgz" -C "$out" .
