#!/usr/bin/env python3
"""The W2 table: tally's runs (--log-json files) beside PyTorch's (bench/w2_torch.py --json),
one line each: step time min and median after warm-up, tokens/s at the median, MFU against the
GEMM peak measured in the same run and against the datasheet's dense bf16 peak, peak memory.
    cuda_summary.py --peak-tflops MEASURED [--tally B=FILE ...] [--torch FILE ...] [--flat FILE]"""
import argparse
import json
import statistics

DATASHEET_TFLOPS = 989.0  # H100 SXM dense bf16
L, C, T, N_PARAMS = 12, 768, 1024, 124475904  # GPT-2 124M at T=1024 (vocab padded to 50304)
FLOPS_PER_TOKEN = 6 * N_PARAMS + 6 * L * C * T  # 6N + 6LCT, as the issue counts MFU

p = argparse.ArgumentParser()
p.add_argument("--peak-tflops", type=float, required=True)
p.add_argument("--tally", nargs="*", default=[], help="B=log.jsonl")
p.add_argument("--torch", nargs="*", default=[])
p.add_argument("--flat", help="a --log-json of the flatness run")
p.add_argument("--warmup", type=int, default=3)
a = p.parse_args()

rows = []
for spec in a.tally:
    b, path = spec.split("=", 1)
    steps = [json.loads(l) for l in open(path) if l.strip()]
    timed = steps[a.warmup:] or steps
    ms = [s["ms"] for s in timed]
    rows.append(dict(system="tally", batch=int(b), min_ms=min(ms), median_ms=statistics.median(ms),
                     alloc=max(s["peak_bytes"] for s in timed), reserved=max(s["reserved_bytes"] for s in timed),
                     loss=f'{steps[0]["loss"]:.3f} -> {steps[-1]["loss"]:.3f}'))
for path in a.torch:
    for r in json.load(open(path)):
        rows.append(dict(system=r["name"], batch=r["batch"], min_ms=r["step_ms_min"], median_ms=r["step_ms_median"],
                         alloc=r["mem_alloc_mib"] * 2**20, reserved=r["mem_reserved_mib"] * 2**20,
                         loss=f'{r["loss_first"]:.3f} -> {r["loss_last"]:.3f}'))

print(f"W2: GPT-2 124M, T={T}, bf16, one step per microbatch; MFU = (6N + 6LCT) tokens/s over the peak; "
      f"measured bf16 GEMM peak {a.peak_tflops:.0f} TFLOP/s, datasheet {DATASHEET_TFLOPS:.0f}")
print(f"| system | B | step min ms | step median ms | tokens/s | MFU (measured peak) | MFU (datasheet) | peak allocated MiB | peak reserved MiB | loss |")
print("|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    tps = r["batch"] * T / (r["median_ms"] / 1e3)
    mfu = FLOPS_PER_TOKEN * tps / 1e12
    print(f'| {r["system"]} | {r["batch"]} | {r["min_ms"]:.1f} | {r["median_ms"]:.1f} | {tps:,.0f} | '
          f'{100 * mfu / a.peak_tflops:.1f}% | {100 * mfu / DATASHEET_TFLOPS:.1f}% | {r["alloc"] / 2**20:,.0f} | '
          f'{r["reserved"] / 2**20:,.0f} | {r["loss"]} |')
if a.flat:
    steps = [json.loads(l) for l in open(a.flat) if l.strip()]
    live = {s["live_bytes"] for s in steps[1:]}
    peak = {s["peak_bytes"] for s in steps[1:]}
    print(f"flatness: {len(steps)} steps; live bytes after steps 2..{len(steps)}: {sorted(live)} "
          f"({'identical' if len(live) == 1 else 'NOT identical'}); step peaks: {sorted(peak)} "
          f"({'identical' if len(peak) == 1 else 'NOT identical'})")
