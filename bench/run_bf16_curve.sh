#!/usr/bin/env bash
# bf16 mixed precision against fp32 over a whole training run: the quickstart's recipe
# (GPT-2 d4 on the fortunes corpus, batch 16 x 64, AdamW at 3e-3 with 30 warm-up steps and
# cosine decay) for `steps` steps, once with --dtype fp32 and once with --dtype bf16, from
# the same seed on the same batches; then each curve's loss averaged over windows of 20
# steps, their largest relative difference, and the validation losses; for each seed given.
#   bench/run_bf16_curve.sh [steps=300] [threads=2] [seed=1337 ...]   (about 4 minutes a seed on 2 cores)
#   WITH_PEER=1 bench/run_bf16_curve.sh ...   also PyTorch, fp32 and autocast(bfloat16)
#     (bench/curve_torch.py, from tally's initial weights, same batches and recipe): the
#     peer's own bf16-against-fp32 difference beside tally's, and tally's fp32 curve
#     against PyTorch's (about 20 minutes more a seed on 2 cores)
#   CURVE_LR=3e-4 bench/run_bf16_curve.sh ...   another peak learning rate (3e-3 by default, the
#     quickstart's): at 3e-4 the runs stay out of the recipe's chaos, so what differs
#     between two of them is their arithmetic, not its amplification
#   CURVE_LOGS=dir bench/run_bf16_curve.sh ...   keep the runs' --log-json files in dir
#     (SEED.fp32.jsonl, SEED.bf16.jsonl, SEED.torch_fp32.jsonl, SEED.torch_bf16.jsonl);
#     PyTorch logs already there are compared too, so tally's side can be re-run alone
# bf16 rounds every weight to 8 mantissa bits for the GEMMs each step, which makes its
# trajectory sensitive to the last bits of anything upstream: a change in the gradient
# norm's summation order moved seed 1337's largest window 0.66% -> 1.24%, where fp32's
# validation loss moved 0.04%. One seed is not enough to read the 1% goal; give several,
# and WITH_PEER=1 for the noise the recipe leaves between two correct runs (PyTorch's fp32
# and tally's fp32 ended up to 2.4% apart, PyTorch's autocast and its fp32 up to 1.2%).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-300}"
threads="${2:-2}"
seeds=("${@:3}")
[ ${#seeds[@]} -gt 0 ] || seeds=(1337)
with_peer="${WITH_PEER:-0}"
lr="${CURVE_LR:-3e-3}"
corpus="$root/data/corpus"
[ -x "$root/build/tally" ] || bash "$root/scripts/build.sh"
[ -f "$corpus/fortunes_train.bin" ] || { echo "run scripts/quickstart.sh first (it builds the corpus)" >&2; exit 2; }
if [ -n "${CURVE_LOGS:-}" ]; then
  out="$CURVE_LOGS"
  mkdir -p "$out"
else
  out="$(mktemp -d)"
  trap 'rm -rf "$out"' EXIT
fi
recipe=(--model d4 --train-data "$corpus/fortunes_train.bin" --val-data "$corpus/fortunes_val.bin"
        --batch-size 16 --seq-len 64 --warmup-steps 30 --lr-schedule cosine --min-lr-frac 0.1
        --val-every 100 --val-batches 16 --sample-every -1 --threads "$threads" --quiet)
for seed in "${seeds[@]}"; do
  echo "seed $seed:"
  for dtype in fp32 bf16; do
    rm -f "$out/$seed.$dtype.jsonl"
    "$root/build/tally" train "${recipe[@]}" --steps "$steps" --lr "$lr" --save-every 0 --dtype "$dtype" --seed "$seed" \
      --out-dir "$out/$seed.$dtype" --log-json "$out/$seed.$dtype.jsonl"
  done
  if [ "$with_peer" = 1 ]; then
    # The seed's initial weights as an llm.c model file: one step at a learning rate of
    # 1e-30 moves no weight by a representable amount (GPT-2's are ~0.02, their ulp ~2e-9),
    # only the zero biases, by 1e-30, which no activation can see.
    "$root/build/tally" train "${recipe[@]}" --steps 1 --lr 1e-30 --save-every 1 --seed "$seed" --out-dir "$out/$seed.init" --overwrite
    for dtype in fp32 bf16; do
      /usr/bin/python3 "$root/bench/curve_torch.py" "$out/$seed.init/step_00000001/model.bin" "$corpus/fortunes_train.bin" \
        "$corpus/fortunes_val.bin" "$out/$seed.torch_$dtype.jsonl" --dtype "$dtype" --steps "$steps" --lr "$lr" --threads "$threads"
    done
  fi
  python3 - "$out/$seed" <<'PY'
import json, os, sys
prefix = sys.argv[1]
def rows(name):
    path = f"{prefix}.{name}.jsonl"
    return [json.loads(l) for l in open(path) if l.strip()] if os.path.exists(path) else None
w = 20
def compare(label, a, b):
    """b against a: the largest relative difference of w-step mean losses, of single steps,
    and the validation losses."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    worst = (0.0, 0)
    for i in range(0, len(a) - w + 1, w):
        la = sum(r["loss"] for r in a[i:i + w]) / w
        lb = sum(r["loss"] for r in b[i:i + w]) / w
        d = abs(lb - la) / la
        if d > worst[0]: worst = (d, a[i]["step"])
    step_worst = max(abs(y["loss"] - x["loss"]) / x["loss"] for x, y in zip(a, b))
    vals = [(x["step"], x["val_loss"], y["val_loss"]) for x, y in zip(a, b) if "val_loss" in x]
    print(f"{label}: largest relative difference of {w}-step means {100 * worst[0]:.3f}% (window from step "
          f"{worst[1]}); of single steps {100 * step_worst:.3f}%; validation (step: first, second, difference) " +
          "; ".join(f"{s}: {x:.4f}, {y:.4f}, {100 * (y - x) / x:+.3f}%" for s, x, y in vals))
fp32, bf16 = rows("fp32"), rows("bf16")
mean = lambda rs: sum(r["loss"] for r in rs) / len(rs)
median_ms = lambda rs: sorted(r["ms"] for r in rs)[len(rs) // 2]
print(f"steps: {len(fp32)}; loss, first/last {w}-step mean: fp32 {mean(fp32[:w]):.4f} -> {mean(fp32[-w:]):.4f}, "
      f"bf16 {mean(bf16[:w]):.4f} -> {mean(bf16[-w:]):.4f}")
compare("tally bf16 against tally fp32", fp32, bf16)
torch_fp32, torch_bf16 = rows("torch_fp32"), rows("torch_bf16")
if torch_fp32 and torch_bf16:
    compare("PyTorch autocast against PyTorch fp32", torch_fp32, torch_bf16)
    compare("PyTorch fp32 against tally fp32", fp32, torch_fp32)
    compare("PyTorch autocast against tally bf16", bf16, torch_bf16)
    print(f"first step's loss: tally fp32 {fp32[0]['loss']:.7f}, PyTorch fp32 {torch_fp32[0]['loss']:.7f}; "
          f"gradient norm {fp32[0]['grad_norm']:.6f}, {torch_fp32[0]['grad_norm']:.6f}")
    print(f"median step: PyTorch fp32 {median_ms(torch_fp32):.0f} ms, autocast {median_ms(torch_bf16):.0f} ms")
print(f"median step: tally fp32 {median_ms(fp32):.0f} ms, bf16 {median_ms(bf16):.0f} ms")
PY
done
