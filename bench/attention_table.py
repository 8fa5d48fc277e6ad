#!/usr/bin/env python3
"""Turns bench/run_attention_scan.sh's runs (JSON lines of bench_attention and
bench/attention_torch.py) into the long-sequence table of bench/RESULTS.md, between the
lines "<!-- attention-scan:KIND:begin -->" and "<!-- attention-scan:KIND:end -->" (added at
the end the first time), one table per kind of machine as bench/cpu_table.py keeps them.
A peer run the script skipped (its (T, T) tensors would not fit) is a JSON line with
"skipped". Standard library only.
    usage: attention_table.py RUNS.jsonl RESULTS.md"""
import datetime
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_table import kind, machine, mib, write_block  # noqa: E402


def step(runs):
    """Forward + backward (ms): the best round over the runs, and the median of the runs' median
    rounds. A round's forward and backward are timed together ("step_*"): the best forward and
    the best backward may come from different rounds, and their sum from none. Runs written
    before those fields existed give that sum."""
    def best(r):
        return r["step_min_ms"] if "step_min_ms" in r else r["forward_min_ms"] + r["backward_min_ms"]

    def median(r):
        return r["step_median_ms"] if "step_median_ms" in r else r["forward_median_ms"] + r["backward_median_ms"]
    return min(best(r) for r in runs), statistics.median(median(r) for r in runs)


def main():
    this_kind = kind()
    begin, end = f"<!-- attention-scan:{this_kind}:begin -->", f"<!-- attention-scan:{this_kind}:end -->"
    runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
    rows, peaks = [], {"fp32": [], "bf16": []}
    for dtype in ("fp32", "bf16"):
        for T in sorted({r["seq"] for r in runs if r["dtype"] == dtype}):
            mine = [r for r in runs if r["dtype"] == dtype and r["seq"] == T and r["system"] == "tally"]
            peer = [r for r in runs if r["dtype"] == dtype and r["seq"] == T and r["system"] != "tally"]
            if not mine:
                continue
            peaks[dtype] += [r["gemm_peak_gflops"] for r in mine]
            t_min, t_med = step(mine)
            t_mem = f"{mib(max(r['ledger_peak_growth_bytes'] for r in mine))} / {mib(max(r['peak_growth_bytes'] for r in mine))}"
            timed = [r for r in peer if "skipped" not in r]
            if timed:
                p_min, p_med = step(timed)
                peer_cells = (f"{p_med:.0f} ({p_min:.0f}) | {mib(max(r['peak_growth_bytes'] for r in timed))} | "
                              f"**{p_med / t_med:.1f}x** ({p_min / t_min:.1f}x) |")
            else:
                reason = peer[0]["skipped"] if peer else "not run"
                peer_cells = f"– | {reason} | – |"
            rows.append(f"| {T} | {dtype} | {t_med:.0f} ({t_min:.0f}) | {t_mem} | " + peer_cells)
    first = next(r for r in runs if r["system"] == "tally")  # the shape and threads of the scan
    layers = first["layers"]
    rounds = max(r.get("round", 1) for r in runs)
    peak_text = ", ".join(f"{d} {min(g):.0f}-{max(g):.0f}" for d, g in peaks.items() if g)
    threads = first.get("threads", os.environ.get("OMP_NUM_THREADS", "?"))
    peer_name = next((r["system"].replace(" autocast(bfloat16)", "") for r in runs if r["system"] != "tally"), "PyTorch")
    block = [begin,
             f"**{datetime.date.today()}**, {machine()}, {threads} threads, `bench/run_attention_scan.sh {rounds} {threads}`: "
             f"causal attention alone, batch {first['batch']}, {first['heads']} heads of {first['head_dim']}, "
             f"{layers} layer{'s' if layers != 1 else ''}, forward and backward; {rounds} alternating "
             f"rounds of tally's blocked kernel (bench_attention) and {peer_name}'s eager attention "
             f"(bench/attention_torch.py, W3's peer formulation; autocast(bfloat16) for bf16). GEMM peak measured by "
             f"tally in the same runs (GFLOP/s, min-max): {peak_text}.",
             "",
             "| T | dtype | tally ms, median (min) | tally MiB above inputs (ledger / RSS) | peer ms, median (min) "
             "| peer MiB above inputs (RSS) | peer / tally |",
             "|---|---|---|---|---|---|---|"] + rows + [
             "",
             "ms: forward + backward of the layer(s), each run timing its rounds after one warm-up round (min: the "
             "best round; median: the median of the runs' medians). MiB above inputs: what the warm-up round added "
             "to the process's peak (outputs, saved tensors, gradients, workspace): tally's ledger counts its "
             "tensors to the byte, RSS adds its threads' tile buffers and oneDNN's. A peer run is skipped where its "
             "(T, T) tensors would not fit in the machine's available memory.",
             end]
    write_block(sys.argv[2], block, f"Long sequences: attention alone against PyTorch on the {this_kind} kind "
                "(issue 12, bench/run_attention_scan.sh)")


if __name__ == "__main__":
    main()
