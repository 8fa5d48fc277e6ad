#!/usr/bin/python3
"""The peer's side of bench/run_bf16_curve.sh: PyTorch (Debian's python3-torch) trains the
same GPT-2 as `tally train` from the same initial weights on the same batches with the
same recipe, in fp32 or under torch.autocast("cpu", dtype=torch.bfloat16) (PyTorch's CPU
mixed precision: bf16 GEMMs, fp32 master weights and AdamW), and writes one JSON line per
step as tally's --log-json does (step, loss, lr, grad_norm, ms; val_loss where tally
validates). So the size of bf16's departure from fp32 can be read beside the peer's own.
--dtype fp64 trains the model in double precision, a reference for both fp32 runs (its
first steps show which of two fp32 runs strays, and by how much).

What it mirrors, from src/train/trainer.cc and src/data/loader.cc:
  - weights: an llm.c model file (tally writes one with every checkpoint); the tied head,
    the padded vocabulary (loss over the first V columns), pre-LN blocks, tanh GELU;
  - batches: step k reads the B*T+1 tokens from token k*B*T of the train shard, wrapping;
    validation reads batches 0..n-1 of the validation shard, mean of their losses;
  - AdamW (betas, eps, decoupled weight decay on 2-D weights only), the global gradient
    norm clipped to max/(norm+1e-6), linear warm-up lr*(k+1)/warmup then cosine to
    lr*min_lr_frac, reached on the last step.

usage: curve_torch.py MODEL_BIN TRAIN_BIN VAL_BIN OUT_JSONL [--dtype fp32|bf16|fp64] [--steps 300]
       [--batch 16] [--seq 64] [--lr 3e-3] [--warmup 30] [--min-lr-frac 0.1] [--weight-decay 0.1]
       [--grad-clip 1] [--val-every 100] [--val-batches 16] [--threads 2]"""
import argparse, contextlib, json, math, time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

LLMC_MAGIC, LLMC_FP32 = 20240326, 3
SHARD_MAGIC = 20240520


def read_llmc(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != LLMC_MAGIC or header[1] != LLMC_FP32:
        raise SystemExit(f"{path}: not an llm.c fp32 model file (magic {header[0]}, version {header[1]})")
    max_t, v, layers, heads, c, vp = (int(x) for x in header[2:8])
    flat = np.fromfile(path, dtype="<f4", offset=256 * 4)
    return (max_t, v, layers, heads, c, vp), flat


def read_shard(path):
    header = np.fromfile(path, dtype="<i4", count=256)
    if header[0] != SHARD_MAGIC:
        raise SystemExit(f"{path}: not an llm.c token shard (magic {header[0]})")
    version, n = int(header[1]), int(header[2])
    dtype = "<u2" if version == 1 else "<u4"
    tokens = np.fromfile(path, dtype=dtype, offset=256 * 4)
    if tokens.size != n:
        raise SystemExit(f"{path}: header says {n} tokens, file holds {tokens.size}")
    return tokens.astype(np.int64)


class Block(nn.Module):
    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.c_attn, self.c_proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.c_fc, self.mlp_proj = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, dims):
        super().__init__()
        max_t, self.v, layers, heads, c, vp = dims
        self.wte, self.wpe = nn.Embedding(vp, c), nn.Embedding(max_t, c)
        self.h = nn.ModuleList(Block(c, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(c)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = (self.ln_f(x) @ self.wte.weight.t())[..., :self.v].reshape(-1, self.v)
        if logits.dtype != torch.float64:
            logits = logits.float()  # (autocast's bf16 logits: the loss in fp32, as tally's)
        return F.cross_entropy(logits, targets.reshape(-1))

    def load_llmc(self, flat):
        """llm.c's order: wte, wpe, then each per-layer tensor stacked over the layers."""
        layers = len(self.h)
        order = [("wte.weight", False), ("wpe.weight", False)] + [(f"h.{{}}.{n}", True) for n in (
            "ln_1.weight", "ln_1.bias", "c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias",
            "ln_2.weight", "ln_2.bias", "c_fc.weight", "c_fc.bias", "mlp_proj.weight", "mlp_proj.bias")] + [
            ("ln_f.weight", False), ("ln_f.bias", False)]
        params = dict(self.named_parameters())
        pos = 0
        with torch.no_grad():
            for pattern, per_layer in order:
                for layer in range(layers if per_layer else 1):
                    p = params[pattern.format(layer)]
                    n = p.numel()
                    p.copy_(torch.from_numpy(flat[pos:pos + n].copy()).view_as(p))
                    pos += n
        if pos != flat.size:
            raise SystemExit(f"model file holds {flat.size} values, the model takes {pos}")


def batch_at(tokens, first, b, t):
    idx = (first + np.arange(b * t + 1)) % tokens.size
    window = torch.from_numpy(tokens[idx])
    return window[:-1].view(b, t), window[1:].view(b, t)


def learning_rate(a, step):
    if a.warmup > 0 and step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    min_lr = a.lr * a.min_lr_frac
    decay = a.steps - 1 - a.warmup  # min_lr on the last step, as tally's learning_rate()
    progress = 0.0 if decay <= 0 else min(1.0, (step - a.warmup) / decay)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (a.lr - min_lr)


def main():
    ap = argparse.ArgumentParser()
    for name in ("model", "train", "val", "out"):
        ap.add_argument(name)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp64"], default="fp32")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dims, flat = read_llmc(a.model)
    model = GPT(dims)
    model.load_llmc(flat)
    if a.dtype == "fp64":
        model.double()
    train, val = read_shard(a.train), read_shard(a.val)
    params = list(model.parameters())  # wte once: the head is tied to it
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if a.dtype == "bf16" else contextlib.nullcontext
    bt = a.batch * a.seq
    with open(a.out, "w") as out:
        for step in range(a.steps):
            t0 = time.perf_counter()
            lr = learning_rate(a, step)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = batch_at(train, step * bt, a.batch, a.seq)
            opt.zero_grad(set_to_none=True)
            with autocast():
                loss = model(x, y)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(params, a.grad_clip)) if a.grad_clip > 0 else float("nan")
            opt.step()
            row = {"step": step + 1, "loss": loss.item(), "lr": lr, "grad_norm": norm,
                   "ms": 1e3 * (time.perf_counter() - t0), "tokens": (step + 1) * bt}
            if a.val_every > 0 and ((step + 1) % a.val_every == 0 or step + 1 == a.steps):
                with torch.no_grad(), autocast():
                    row["val_loss"] = sum(model(*batch_at(val, i * bt, a.batch, a.seq)).item()
                                          for i in range(a.val_batches)) / a.val_batches
            out.write(json.dumps(row) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
