#!/usr/bin/env python3
"""Turns bench/run_cpu.sh's runs (JSON lines) into the table of bench/RESULTS.md for this
machine's kind ("amd" or "intel", the two kinds of machine the issue names, or
"amd-avx2" for one without AVX-512), between the
lines "<!-- cpu-bench:KIND:begin -->" and "<!-- cpu-bench:KIND:end -->" (added at the end
the first time): each kind keeps its own latest table. Standard library only.
    usage: cpu_table.py RUNS.jsonl RESULTS.md         prints the kind with --kind"""
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

WORKS = {
    "W1": "GPT-2 124M, batch 4 x 64, fp32",
    "W1-bf16": "GPT-2 124M, batch 4 x 64, bf16 mixed precision",
    "W3": "GPT-2 124M, batch 1 x 1024, fp32",
    "W3-bf16": "GPT-2 124M, batch 1 x 1024, bf16 mixed precision",
}


def cpuinfo():
    """(model name, vendor, flags line) of the first CPU in /proc/cpuinfo."""
    model, vendor, flags = platform.processor() or "?", "", ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("?", "", platform.machine()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("vendor_id") and not vendor:
                vendor = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    except OSError:
        pass
    return model, vendor, flags


def machine():
    model, _, flags = cpuinfo()
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in flags]
    return f"{model} ({', '.join(isa) or 'no AVX-512'})"


# The kinds issue 12 names, by the features that make them that kind: each keeps its own
# table, and a machine with fewer features must not replace it.
NAMED_KINDS = {"AuthenticAMD": ("amd", "avx512_bf16"),  # Zen 4: AVX-512 with BF16, no AMX
               "GenuineIntel": ("intel", "amx_bf16")}   # Sapphire Rapids: AVX-512 with BF16 and AMX


def kind(info=None):
    """"amd" or "intel" for the machines the issue names (AVX-512 with BF16; Intel's with AMX
    too). Any other CPU is a kind of its own, named by its widest vectors: "amd-avx2" for an
    AVX2-only EPYC VM (where oneDNN has no bf16 kernel), "intel-avx512" for an Ice Lake
    without BF16 or AMX, so that its table does not replace the named machine's."""
    _, vendor, flags = info or cpuinfo()
    name, needs = NAMED_KINDS.get(vendor, (vendor.lower() or "unknown", None))
    has = set(flags.split(":", 1)[-1].split())
    if "avx512f" not in has:
        return name + "-avx2"
    return name if needs in has else name + "-avx512"


def flops_per_step(run):
    """The model's training FLOPs in one step of a tally run: its own field, or (runs from
    before 2026-11-29) what its % of GEMM peak was computed from, to the rounding of its
    printed figures (about 0.2%)."""
    if "flops_per_step" in run:
        return run["flops_per_step"]
    return run["pct_gemm_peak"] / 100 * run["gemm_peak_gflops"] * 1e9 * run["ms_per_step"] / 1e3


def mib(b):
    return f"{b / 2**20:.0f}"


def write_block(results_path, block, heading):
    """Puts the lines `block` (its first and last lines the begin and end markers) in place of
    the text between those markers in results_path, or the first time under `heading` at the
    end of its "Current results" (before "## History"), or at its end; prints the block."""
    begin, end = block[0], block[-1]
    text = open(results_path).read()
    if begin in text and end in text:
        text = text[:text.index(begin)] + "\n".join(block) + text[text.index(end) + len(end):]
    elif "\n## History" in text:
        at = text.index("\n## History")
        text = text[:at].rstrip("\n") + f"\n\n### {heading}\n\n" + "\n".join(block) + "\n" + text[at:]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + "\n".join(block) + "\n"
    open(results_path, "w").write(text)
    print("\n".join(block))


def memory_text(runs):
    """The sentence on the memory probes of the runs (bench_memory, one a round), and a warning
    when they were erratic: a repetition's median below half the best seen in the session
    means the memory-bound part of every step (AdamW, the elementwise passes) ran at an
    unknown fraction of the machine's bandwidth, whatever the GEMM peak says."""
    probes = sorted((r for r in runs if r.get("system") == "memory"), key=lambda r: r["round"])
    if not probes:
        return ""
    best = max(p["best_gbps"] for p in probes)
    each = ", ".join(f"{p['best_gbps']:.1f} / {p['median_gbps']:.1f}" for p in probes)
    text = (f" Memory bandwidth measured in the same session (bench_memory: a STREAM triad over 3 x "
            f"{probes[0]['mib_per_array']} MiB, {probes[0]['threads']} threads; GB/s, best / median of "
            f"{probes[0]['repetitions']} repetitions, one probe a round): {each}.")
    if any(p["median_gbps"] < 0.5 * best for p in probes):
        text += (f" **The memory was erratic in this session** (a round's median below half the best, "
                 f"{best:.1f} GB/s): the memory-bound part of each step ran at an unknown share of the machine's "
                 f"bandwidth, so this table does not stand for the kind.")
    return text


def main():
    if sys.argv[1:] == ["--kind"]:
        print(kind())
        return
    this_kind = kind()
    begin, end = f"<!-- cpu-bench:{this_kind}:begin -->", f"<!-- cpu-bench:{this_kind}:end -->"
    runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    rows, peaks = [], {}
    for work in [w for w in WORKS if any(r["work"] == w for r in runs)]:
        by = {"tally": [r for r in runs if r["work"] == work and r["system"] == "tally"],
              "peer": [r for r in runs if r["work"] == work and r["system"] != "tally"]}
        if not by["tally"] or not by["peer"]:
            continue
        stats = {}
        for side, rs in by.items():
            meds = [r["ms_per_step"] for r in rs]
            mins = [r["min_ms"] for r in rs]
            stats[side] = dict(min=min(mins), median=statistics.median(meds), tokens=statistics.median(r["tokens_per_s"] for r in rs),
                               rss=max(r["peak_rss_bytes"] for r in rs), name=rs[0]["system"], rounds=len(rs))
        t = stats["tally"]
        t["alloc"] = max(r["peak_allocated_bytes"] for r in by["tally"])
        t["pct"] = statistics.median(r["pct_gemm_peak"] for r in by["tally"])
        g = [r["gemm_peak_gflops"] for r in by["tally"]]
        peaks[work] = (min(g), max(g), by["tally"][0].get("dtype", "fp32"))
        p = stats["peer"]
        peer = p["name"] + (" autocast(bfloat16)" if work.endswith("bf16") else "")
        # The ceiling: the shortest step the machine allows, every FLOP of the model at the
        # session's best GEMM peak and nothing else taking time, against the peer's median.
        floor_ms = 1e3 * statistics.median(flops_per_step(r) for r in by["tally"]) / (max(g) * 1e9)
        rows.append(f"| {work} | tally | {t['min']:.0f} | {t['median']:.0f} | {t['tokens']:.0f} | {mib(t['alloc'])} / {mib(t['rss'])} "
                    f"| {t['pct']:.0f}% | **{p['median'] / t['median']:.2f}x** ({p['min'] / t['min']:.2f}x on min) "
                    f"| {floor_ms:.0f} ms: {p['median'] / floor_ms:.2f}x |")
        rows.append(f"| {work} | {peer} | {p['min']:.0f} | {p['median']:.0f} | {p['tokens']:.0f} | – / {mib(p['rss'])} | | | |")
    if not rows:
        sys.exit(f"cpu_table.py: {sys.argv[1]} has no work with both a tally run and a peer run")
    rounds = max(r["round"] for r in runs)
    threads = runs[0].get("threads", "?")
    steps = sorted({r["steps"] for r in runs if "steps" in r})
    command = os.environ.get("BENCH_COMMAND") or (
        f"bench/run_cpu.sh {rounds}" + (f" {steps[0]}" if len(steps) == 1 else ""))
    done = [w for w in WORKS if any(row.startswith(f"| {w} |") for row in rows)]
    peak_text = "; ".join(f"{w} ({d}): {lo:.0f}-{hi:.0f}" for w, (lo, hi, d) in peaks.items())
    block = [begin,
             f"**{datetime.date.today()}**, {machine()}, {threads} threads, `{command}`: "
             f"{rounds} alternating rounds, tally then the peer for each work, each run timing its steps after "
             f"two warm-up steps. GEMM peak measured by tally in the same runs (GFLOP/s, min-max over rounds; "
             f"bf16 = bf16 operands, fp32 accumulation): {peak_text}." + memory_text(runs),
             "",
             "| work | system | min ms | median ms | tokens/s | peak MiB (ledger / RSS) | % of GEMM peak | peer / tally "
             "| ceiling: FLOPs at peak, peer / that |",
             "|---|---|---|---|---|---|---|---|---|"] + rows + [
             "",
             "Works: " + "; ".join(f"{w} = {WORKS[w]}" for w in done) + ". Min and median are over every "
             "timed step of every round (min: the best step; median: the median of the rounds' median steps). "
             "% of GEMM peak: the model's training FLOPs (6N + 6LCT per token) per second over the peak of the "
             "run's precision. Ceiling: the step's FLOPs at the best GEMM peak of the session, the shortest step "
             "this machine allows (every GEMM at its peak, nothing else taking time), and the peer's median over "
             "it, the largest ratio any implementation could reach in this run.",
             end]
    write_block(sys.argv[2], block, f"CPU training against PyTorch on the {this_kind} kind of machine (issue 12, bench/run_cpu.sh)")


if __name__ == "__main__":
    main()
