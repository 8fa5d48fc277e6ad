#!/usr/bin/python3
"""Causal attention alone in PyTorch (Debian's python3-torch 1.13), the peer of
bench_attention: q, k, v sliced from one fused (B, T, 3C) projection, forward and backward
for `--layers` layers, in the eager formulation W1's and W3's peer (bench/w1_torch.py) uses,
since torch 1.13 has no fused attention on CPU: scores = q k^T / sqrt(D), masked, softmax,
times v, all (B, H, T, T) tensors materialized. --dtype bf16 runs the forward under
torch.autocast("cpu", dtype=torch.bfloat16), as W3-bf16's peer does.

Prints one JSON line: min and median of forward and backward over `rounds` timed rounds
(after one warm-up round), and the memory attention takes above its inputs: the growth of
the process's peak RSS during the warm-up round (VmHWM reset through /proc/self/clear_refs).
usage: attention_torch.py [rounds=3] [threads=2] [--batch B] [--seq T] [--heads H]
                          [--head-dim D] [--layers L] [--dtype fp32|bf16]"""
import argparse, contextlib, json, math, time
import torch


def peak_rss_bytes():
    """VmHWM: the process's peak RSS since the last reset, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux 4.0 on)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int, nargs="?", default=3)
    ap.add_argument("threads", type=int, nargs="?", default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("rounds must be at least 1")
    B, T, H, D, L = a.batch, a.seq, a.heads, a.head_dim, a.layers
    C = H * D
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.dtype == "bf16" else contextlib.nullcontext
    qkv = [torch.randn(B, T, 3 * C, requires_grad=True) for _ in range(L)]
    dout = [1e-2 * torch.randn(B, T, C) for _ in range(L)]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)

    def layer(x):
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in x.split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)

    forward_ms, backward_ms, step_ms, peak_growth = [], [], [], 0  # step: one round's forward + backward
    for r in range(a.rounds + 1):  # the first warms up, and its peak is the memory figure
        if r == 0:
            reset_peak_rss()
            before = peak_rss_bytes()  # the RSS the peak was reset to
        t0 = time.perf_counter()
        with autocast():
            outs = [layer(x) for x in qkv]
        t1 = time.perf_counter()
        torch.autograd.backward(outs, dout)
        t2 = time.perf_counter()
        del outs
        for x in qkv:
            x.grad = None
        if r == 0:
            peak_growth = peak_rss_bytes() - before
            continue
        forward_ms.append((t1 - t0) * 1e3)
        backward_ms.append((t2 - t1) * 1e3)
        step_ms.append((t2 - t0) * 1e3)
    forward_ms.sort()
    backward_ms.sort()
    step_ms.sort()
    print(json.dumps({"system": "pytorch " + torch.__version__ + (" autocast(bfloat16)" if a.dtype == "bf16" else ""),
                      "forward_min_ms": round(forward_ms[0], 2), "forward_median_ms": round(forward_ms[len(forward_ms) // 2], 2),
                      "backward_min_ms": round(backward_ms[0], 2),
                      "backward_median_ms": round(backward_ms[len(backward_ms) // 2], 2),
                      "step_min_ms": round(step_ms[0], 2), "step_median_ms": round(step_ms[len(step_ms) // 2], 2),
                      "peak_growth_bytes": peak_growth, "batch": B, "seq": T, "heads": H, "head_dim": D,
                      "layers": L, "dtype": a.dtype, "threads": a.threads}))


if __name__ == "__main__":
    main()
