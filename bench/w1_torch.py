#!/usr/bin/python3
"""Work W1 in PyTorch (Debian's python3-torch): GPT-2 124M, B=4, T=64, fp32, AdamW, one
training step, timed over several steps after two warm-up steps. Same model as tally's
(pre-LN, tanh GELU, tied head, padded vocab 50304, loss over the first 50257 columns).
--batch/--seq give other shapes (W3: --batch 1 --seq 1024); --dtype bf16 runs the forward
under torch.autocast("cpu", dtype=torch.bfloat16), PyTorch's CPU mixed precision, with
fp32 master weights and AdamW. The gradients are clipped to norm 1.0 before AdamW, as
bench_w1 does. Prints one JSON line.
usage: w1_torch.py [steps=10] [threads=2] [--batch B] [--seq T] [--dtype fp32|bf16]"""
import argparse, contextlib, json, math, resource, time
import torch
import torch.nn as nn
import torch.nn.functional as F

V, Vp, L, H, C, maxT, B, T = 50257, 50304, 12, 12, 768, 1024, 4, 64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        # torch 1.13 has no fused SDPA; this is the standard eager formulation.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // H)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(Vp, C), nn.Embedding(maxT, C)
        self.h = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(C)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for b in self.h:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1))


def init_gpt2(model):
    """GPT-2 initialization, as tally's (keeps the loss in the same range)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "ln_" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 / math.sqrt(2 * L) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02)
        model.wte.weight[V:].zero_()
    return model


def main():
    global B, T
    ap = argparse.ArgumentParser()
    ap.add_argument("steps", type=int, nargs="?", default=10)
    ap.add_argument("threads", type=int, nargs="?", default=2)
    ap.add_argument("--batch", type=int, default=B)
    ap.add_argument("--seq", type=int, default=T)
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    a = ap.parse_args()
    if a.steps < 1:
        ap.error("steps must be at least 1")
    steps, threads, B, T = a.steps, a.threads, a.batch, a.seq
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.dtype == "bf16" else contextlib.nullcontext
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = init_gpt2(GPT())
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    x = torch.randint(0, V, (B, T))
    y = torch.randint(0, V, (B, T))
    times = []
    for s in range(steps + 2):
        t0 = time.perf_counter()
        with autocast():
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # bench_w1 clips at 1.0 too
        opt.step()
        opt.zero_grad(set_to_none=True)  # PyTorch 2's default; tally discards its gradients too
        dt = (time.perf_counter() - t0) * 1e3
        if s >= 2:
            times.append(dt)
    times.sort()
    median = times[len(times) // 2]
    print(json.dumps({"system": "pytorch " + torch.__version__, "ms_per_step": round(median, 1), "min_ms": round(times[0], 1),
                      "tokens_per_s": round(B * T / (median / 1e3)),
                      "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "params": params, "loss": round(loss.item(), 4), "threads": threads,
                      "batch": B, "seq": T, "dtype": a.dtype, "steps": steps}))


if __name__ == "__main__":
    main()
