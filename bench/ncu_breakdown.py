#!/usr/bin/env python3
"""Per-kernel GPU time of a tally run, from Nsight Compute's CSV of gpu__time_duration:
what each kernel really takes on the device, with none of --profile-ops' waits.
    ncu --metrics gpu__time_duration.sum --csv build/tally train ... > ncu.csv
    ncu_breakdown.py ncu.csv [--steps N]   (the time per step, over N profiled steps)
    ncu_breakdown.py run3.csv --minus run1.csv --steps 2
        (a 3-step run less a 1-step run: two steady steps, without the start's GEMM-peak
        probe and first-step work)"""
import argparse
import collections
import csv
import io
import re

p = argparse.ArgumentParser()
p.add_argument("csv")
p.add_argument("--steps", type=int, default=1)
p.add_argument("--top", type=int, default=25)
p.add_argument("--minus")
a = p.parse_args()


def kernel_times(path):
    text = open(path, errors="replace").read()
    rows = csv.DictReader(io.StringIO(text[text.find('"ID"'):]))
    total, calls = collections.Counter(), collections.Counter()
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
        name = re.sub(r"[<(].*", "", name)                 # template arguments, parameters
        name = name.split("::")[-1].split(" ")[-1]         # namespaces, return type
        value = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "ns")
        scale = {"ns": 1e-6, "nsecond": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}.get(unit, 1e-6)
        total[name] += value * scale
        calls[name] += 1
    return total, calls


total, calls = kernel_times(a.csv)
if a.minus:
    less, less_calls = kernel_times(a.minus)
    total.subtract(less)
    calls.subtract(less_calls)
all_ms = sum(total.values()) or 1e-30
print(f"{all_ms / a.steps:.2f} ms of kernels per step ({a.steps} step(s) profiled)")
for name, ms in total.most_common(a.top):
    print(f"  {ms / a.steps:8.3f} ms  {100 * ms / all_ms:5.1f}%  {calls[name] // a.steps:5d} calls  {name}")
