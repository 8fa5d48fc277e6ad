#!/usr/bin/env python3
"""Work W2 in PyTorch: GPT-2 124M training step on one GPU, bf16 autocast over fp32 master
weights, AdamW, grad clipping at 1.0, one optimizer step per microbatch, in eager mode and
under torch.compile. This is the reference a tally W2 run is compared with, written the way
nanoGPT / llm.c's train_gpt2.py write it (SDPA with is_causal, full-vocab cross-entropy on
the padded logits, fused AdamW), so "what PyTorch gets" means what a typical user gets.

The data is one fixed batch of random tokens (like llm.c's overfit test): the step cost does
not depend on the token values, and overfitting a single batch makes "loss goes down" a
visible sanity check within 40 steps.

usage: w2_torch.py [--mode eager|compile|both] [--batch B] [--seq T] [--steps S]
                   [--warmup W] [--device cuda|cpu] [--model gpt2|tiny] [--json out.json]
                   [--find-batch] [--seed N]
CPU smoke test (torch 1.13 works): --device cpu --model tiny --mode eager --steps 3 --warmup 1 --batch 2
"""
import argparse, gc, inspect, json, math, statistics, time
import torch
import torch.nn as nn
import torch.nn.functional as F

GPT2_VOCAB = 50257    # tokens are drawn from the real vocabulary...
PADDED_VOCAB = 50304  # ...the model's vocab is padded to a multiple of 128 so LM-head GEMMs tile well
H100_SXM_BF16_DENSE = 989e12  # datasheet dense bf16 (no sparsity), H100 SXM
CONFIGS = {"gpt2": dict(n_layer=12, n_head=12, n_embd=768, seq=1024),
           "tiny": dict(n_layer=2, n_head=2, n_embd=64, seq=64)}
HAVE_SDPA = hasattr(F, "scaled_dot_product_attention")  # torch >= 2.0
FIND_BATCH_CANDIDATES = (64, 48, 32, 24, 16, 8)


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1, self.ln_2 = nn.LayerNorm(C, eps=1e-5), nn.LayerNorm(C, eps=1e-5)
        self.c_attn, self.attn_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.gelu = nn.GELU(approximate="tanh")

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2)
                   for t in self.c_attn(x).split(C, dim=2))
        if HAVE_SDPA:  # flash / memory-efficient kernel on the GPU
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch 1.13 (CPU smoke test only): materialized (B, H, T, T) scores
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            y = att.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.attn_proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(self.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, n_layer, n_head, n_embd, seq):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(PADDED_VOCAB, n_embd), nn.Embedding(seq, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.lm_head = nn.Linear(n_embd, PADDED_VOCAB, bias=False)  # GPT-2's head has no bias
        self.lm_head.weight = self.wte.weight  # tied: one tensor, counted and updated once
        # GPT-2 init. LayerNorm's defaults (ones/zeros) already match.
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        # Residual-stream projections scaled so the residual variance does not grow with depth.
        for b in self.h:
            for proj in (b.attn_proj, b.mlp_proj):
                nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        # Full padded vocab, unchunked, as nanoGPT / llm.c; autocast computes the loss in fp32.
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def is_oom(e):
    oom_type = getattr(torch.cuda, "OutOfMemoryError", ())  # torch >= 1.13
    return isinstance(e, oom_type) or "out of memory" in str(e).lower()


def free_memory(device):
    if hasattr(torch, "_dynamo"):
        torch._dynamo.reset()  # drop compiled graphs (and anything they cache) from the last try
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def measure_peak_flops(device):
    """Best-of-10 bf16 matmul throughput: what this GPU (at its current clocks / power cap)
    actually delivers, a fairer MFU denominator than the datasheet."""
    n = 8192 if device == "cuda" else 1024  # CPU: small, only so the smoke test covers the path
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(10):
        if device == "cuda":  # events: no host-side launch/sync overhead in a ~1.5 ms kernel
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); torch.matmul(a, b); end.record(); end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter(); torch.matmul(a, b); best = min(best, time.perf_counter() - t0)
    del a, b
    free_memory(device)  # so the matmul's cached blocks do not count in the model's reserved memory
    return n, 2 * n ** 3 / best


def build(args, cfg, mode, B):
    """Fresh model, optimizer, data and step function. Seeded on the CPU before moving to the
    device, so every mode (and every find-batch try) starts from bit-identical weights."""
    torch.manual_seed(args.seed)
    model = GPT(cfg["n_layer"], cfg["n_head"], cfg["n_embd"], args.seq).to(args.device)
    params = list(model.parameters())  # deduplicated: the tied wte/lm_head appears once
    opt_kw = {}
    if args.device == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters:
        opt_kw["fused"] = True
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # biases, LN
    opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, **opt_kw)
    fwd = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator(device=args.device)
    gen.manual_seed(args.seed)
    data = torch.randint(0, GPT2_VOCAB, (B, args.seq + 1), device=args.device, generator=gen)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    def step():
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()  # no .item() here: that would add a sync inside the timed region

    return model, step, opt_kw.get("fused", False)


def find_batch(args, cfg, mode):
    for B in FIND_BATCH_CANDIDATES:
        free_memory(args.device)
        try:
            model, step, _ = build(args, cfg, mode, B)
            step()
            sync(args.device)
            ok = True
        except Exception as e:  # compiled code can surface an OOM wrapped, hence the message test
            if not is_oom(e):
                raise
            ok = False
        model = step = None  # release the try's model and optimizer state before the next one
        free_memory(args.device)
        print(f"  find-batch {mode}: B={B} {'fits' if ok else 'OOM'}", flush=True)
        if ok:
            return B
    raise SystemExit(f"{mode}: even B={FIND_BATCH_CANDIDATES[-1]} does not fit")


def run_mode(args, cfg, mode, B, peaks):
    free_memory(args.device)
    model, step, fused = build(args, cfg, mode, B)
    n_params = sum(p.numel() for p in model.parameters())
    sync(args.device)
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.warmup)]  # compile mode: compilation happens in here
    sync(args.device)
    warmup_s = time.perf_counter() - t0
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        sync(args.device)
        t = time.perf_counter()
        losses.append(step())
        sync(args.device)
        times.append(time.perf_counter() - t)
    T, L, C = args.seq, cfg["n_layer"], cfg["n_embd"]
    # 6N for the parameter GEMMs (fwd + bwd); 6LCT for attention's QK^T and AV counting only the
    # causal (unmasked) half. nanoGPT / PaLM count the full square, 12LCT, so they read higher.
    flops_per_token = 6 * n_params + 6 * L * C * T
    median = statistics.median(times)
    tokens_per_s = B * T / median
    r = dict(name=f"torch-{mode}", mode=mode, device=args.device, model=args.model,
             gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
             torch=torch.__version__, batch=B, seq=T, steps=args.steps, warmup=args.warmup,
             attention="sdpa" if HAVE_SDPA else "manual", fused_adamw=fused,
             n_params=n_params, flops_per_token=flops_per_token,
             step_ms_min=min(times) * 1e3, step_ms_median=median * 1e3, step_ms_all=[t * 1e3 for t in times],
             tokens_per_s=tokens_per_s, warmup_s=warmup_s,
             peak_matmul_n=peaks[0], peak_flops_measured=peaks[1], peak_flops_datasheet=peaks[2],
             mfu_measured=flops_per_token * tokens_per_s / peaks[1],
             mfu_datasheet=flops_per_token * tokens_per_s / peaks[2] if peaks[2] else None,
             mem_alloc_mib=torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else None,
             mem_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if args.device == "cuda" else None,
             loss_first=losses[0].item(), loss_last=losses[-1].item())
    del model, step, losses
    return r


def table_line(r):
    mfu_d = f"{100 * r['mfu_datasheet']:.1f}%" if r["mfu_datasheet"] is not None else "n/a"
    mem = (f"peak alloc {r['mem_alloc_mib']:.0f} MiB reserved {r['mem_reserved_mib']:.0f} MiB"
           if r["mem_alloc_mib"] is not None else "peak alloc n/a (cpu)")
    return (f"{r['name']:<13s}B={r['batch']} T={r['seq']}  step min {r['step_ms_min']:.1f} ms "
            f"median {r['step_ms_median']:.1f} ms  tokens/s {r['tokens_per_s']:.0f}  "
            f"MFU {100 * r['mfu_measured']:.1f}% (measured peak {r['peak_flops_measured'] / 1e12:.3g} TFLOP/s) "
            f"/ {mfu_d} (989)  {mem}  loss {r['loss_first']:.2f} -> {r['loss_last']:.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["eager", "compile", "both"], default="both")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=None, help="default: 1024 (gpt2), 64 (tiny)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--model", choices=list(CONFIGS), default="gpt2")
    ap.add_argument("--json", default=None)
    ap.add_argument("--find-batch", action="store_true",
                    help=f"per mode, the largest B in {FIND_BATCH_CANDIDATES} that runs a step")
    ap.add_argument("--seed", type=int, default=1337)
    args = ap.parse_args()
    cfg = CONFIGS[args.model]
    args.seq = args.seq or cfg["seq"]
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    modes = ["eager", "compile"] if args.mode == "both" else [args.mode]
    if "compile" in modes and not hasattr(torch, "compile"):
        ap.error(f"torch.compile needs torch >= 2.0 (this is {torch.__version__})")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT; only fp32 matmuls outside autocast
        torch.backends.cudnn.allow_tf32 = True
    else:
        torch.set_num_threads(min(4, torch.get_num_threads()))  # smoke test: stay light on a shared box

    n, peak = measure_peak_flops(args.device)
    peaks = (n, peak, H100_SXM_BF16_DENSE if args.device == "cuda" else None)
    print(f"torch {torch.__version__}  device {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}"
          f"  attention {'sdpa' if HAVE_SDPA else 'manual masked softmax'}")
    print(f"peak bf16 matmul {n}^3: measured {peak / 1e12:.1f} TFLOP/s"
          + (f", datasheet H100 SXM {H100_SXM_BF16_DENSE / 1e12:.0f} TFLOP/s" if peaks[2] else ""), flush=True)

    results = []
    for mode in modes:
        B = find_batch(args, cfg, mode) if args.find_batch else args.batch
        r = run_mode(args, cfg, mode, B, peaks)
        results.append(r)
        print(f"{r['name']}: N = {r['n_params']:,} params (all, tied wte/lm_head once, incl. wpe and "
              f"vocab padding); FLOPs/token = 6N + 6*L*C*T = {r['flops_per_token']:.4g}; "
              f"compile+warmup ({args.warmup} steps) {r['warmup_s']:.1f} s; fused AdamW {r['fused_adamw']}",
              flush=True)
        if args.json:  # rewritten after every mode so a later crash keeps the earlier results
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print()
    for r in results:
        print(table_line(r))


if __name__ == "__main__":
    main()
