#!/usr/bin/python3
"""Generate a tiny GPT-2 checkpoint plus PyTorch reference activations,
gradients and training losses for tally's end-to-end tests.

Outputs (paths relative to the repo root):
  tests/fixtures/gpt2_tiny.bin             llm.c-format fp32 GPT-2 checkpoint
  tests/fixtures/gpt2_tiny_ref.safetensors batch, step-0 logits/loss/grads,
                                           and two 10-step AdamW loss curves
Regenerate with
    /usr/bin/python3 scripts/gen_gpt2_reference.py

The model is written out by hand, mirroring GPT-2 exactly (learned position
embeddings, pre-LN blocks, LayerNorm eps 1e-5, causal attention scaled by
1/sqrt(hd), tanh-GELU MLP, LM head tied to wte, no dropout), in fp32, so the
fixture pins down the same math tally's C++ GPT-2 must implement.
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures")
BIN_PATH = os.path.join(FIX, "gpt2_tiny.bin")
REF_PATH = os.path.join(FIX, "gpt2_tiny_ref.safetensors")

# ---- configuration ---------------------------------------------------------
MAX_T, V, VP, L, NH, C = 32, 97, 128, 2, 4, 32
B, T = 4, 16
STEPS = 10
LN_EPS = 1e-5
INIT_STD = 0.02
NOISE_STD = 0.02      # perturbation of LN params and biases away from 1/0
SEED = 42
# Run 1: llm.c's CPU test_gpt2 style AdamW, weight decay on every parameter.
RUN1 = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
# Run 2: typical GPT-2 training recipe: decay only 2-D weights, grad clipping.
RUN2 = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)

# llm.c checkpoint header constants.
LLMC_MAGIC = 20240326
LLMC_VERSION_FP32 = 3

torch.manual_seed(SEED)
torch.set_default_dtype(torch.float32)
# Single thread: makes the CPU reductions (and hence the reference numbers)
# reproducible regardless of the machine's core count.
torch.set_num_threads(1)


# ---- model -----------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(C, 3 * C)   # output rows ordered [q | k | v]
        self.c_proj = nn.Linear(C, C)

    def forward(self, x):
        b, t, _ = x.shape
        hd = C // NH
        q, k, v = self.c_attn(x).split(C, dim=2)
        # Heads are consecutive hd-sized chunks of each C-wide block.
        q = q.view(b, t, NH, hd).transpose(1, 2)   # (B,NH,T,hd)
        k = k.view(b, t, NH, hd).transpose(1, 2)
        v = v.view(b, t, NH, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(C, 4 * C)
        self.c_proj = nn.Linear(4 * C, C)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(C, eps=LN_EPS)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(C, eps=LN_EPS)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))   # pre-LN residual blocks
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT2(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VP, C)   # padded vocab; rows V..VP-1 stay zero
        self.wpe = nn.Embedding(MAX_T, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = nn.LayerNorm(C, eps=LN_EPS)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        # Tied LM head: logits over the padded vocab. Pad columns are x.0 = 0.
        logits = x @ self.wte.weight.T          # (B,T,VP)
        loss = None
        if targets is not None:
            # Only the first V columns are real classes (as in llm.c, whose
            # softmax/crossentropy ignore the padded columns).
            loss = F.cross_entropy(logits[..., :V].reshape(-1, V), targets.reshape(-1))
        return logits, loss


def init_weights(model):
    """GPT-2 init, then perturb LN params and biases so that a wrong
    weight/bias handling in tally cannot hide behind 1s and 0s."""
    proj_std = INIT_STD / math.sqrt(2 * L)   # residual projections
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight"):
                p.normal_(0.0, proj_std)
            elif name.startswith("ln") or ".ln_" in name:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            else:   # wte, wpe, c_attn.weight, c_fc.weight
                p.normal_(0.0, INIT_STD)
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.startswith("ln") or ".ln_" in name:
                p.add_(torch.randn_like(p) * NOISE_STD)
        model.wte.weight[V:].zero_()


# ---- llm.c tensor layout ---------------------------------------------------
# (llm.c name, per-layer torch parameter name or None for global tensors)
LLMC_LAYOUT = [
    ("wte", "wte.weight"), ("wpe", "wpe.weight"),
    ("ln1w", "h.{}.ln_1.weight"), ("ln1b", "h.{}.ln_1.bias"),
    ("qkvw", "h.{}.attn.c_attn.weight"), ("qkvb", "h.{}.attn.c_attn.bias"),
    ("attprojw", "h.{}.attn.c_proj.weight"), ("attprojb", "h.{}.attn.c_proj.bias"),
    ("ln2w", "h.{}.ln_2.weight"), ("ln2b", "h.{}.ln_2.bias"),
    ("fcw", "h.{}.mlp.c_fc.weight"), ("fcb", "h.{}.mlp.c_fc.bias"),
    ("fcprojw", "h.{}.mlp.c_proj.weight"), ("fcprojb", "h.{}.mlp.c_proj.bias"),
    ("lnfw", "ln_f.weight"), ("lnfb", "ln_f.bias"),
]


def llmc_tensors(model, use_grad=False):
    """Return [(llm.c name, fp32 numpy array)] in checkpoint order; per-layer
    tensors are stacked along a new leading L axis."""
    params = dict(model.named_parameters())
    get = (lambda n: params[n].grad) if use_grad else (lambda n: params[n])
    out = []
    for name, pat in LLMC_LAYOUT:
        if "{}" in pat:
            arr = torch.stack([get(pat.format(l)).detach() for l in range(L)])
        else:
            arr = get(pat).detach()
        out.append((name, arr.numpy().astype(np.float32, copy=True)))
    return out


def write_llmc_checkpoint(model, path):
    header = np.zeros(256, dtype="<i4")
    header[:8] = [LLMC_MAGIC, LLMC_VERSION_FP32, MAX_T, V, L, NH, C, VP]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for _, arr in llmc_tensors(model):
            f.write(arr.astype("<f4").tobytes())


def read_llmc_checkpoint(path):
    """Independent reader: parse header, slice the flat fp32 buffer by the
    expected shapes, and load into a fresh model."""
    raw = np.fromfile(path, dtype="<i4", count=256)
    assert raw[0] == LLMC_MAGIC and raw[1] == LLMC_VERSION_FP32
    max_t, v, l, nh, c, vp = (int(x) for x in raw[2:8])
    assert (max_t, v, l, nh, c, vp) == (MAX_T, V, L, NH, C, VP)
    flat = np.fromfile(path, dtype="<f4", offset=256 * 4)
    shapes = {
        "wte": (vp, c), "wpe": (max_t, c), "ln1w": (l, c), "ln1b": (l, c),
        "qkvw": (l, 3 * c, c), "qkvb": (l, 3 * c), "attprojw": (l, c, c),
        "attprojb": (l, c), "ln2w": (l, c), "ln2b": (l, c),
        "fcw": (l, 4 * c, c), "fcb": (l, 4 * c), "fcprojw": (l, c, 4 * c),
        "fcprojb": (l, c), "lnfw": (c,), "lnfb": (c,),
    }
    model = GPT2()
    params = dict(model.named_parameters())
    pos = 0
    with torch.no_grad():
        for name, pat in LLMC_LAYOUT:
            n = int(np.prod(shapes[name]))
            arr = torch.from_numpy(flat[pos:pos + n].reshape(shapes[name]).copy())
            pos += n
            if "{}" in pat:
                for layer in range(L):
                    params[pat.format(layer)].copy_(arr[layer])
            else:
                params[pat].copy_(arr)
    assert pos == flat.size, "trailing data in checkpoint"
    return model


# ---- training --------------------------------------------------------------
def train(init_state, x, y, cfg, decay_2d_only, clip):
    """Run STEPS AdamW steps from init_state; return per-step losses (measured
    at the forward of each step, i.e. before that step's update) and the
    pre-clip global grad norms."""
    model = GPT2()
    model.load_state_dict(init_state)
    params = list(model.parameters())   # wte appears once: tied head shares it
    if decay_2d_only:
        # "2-D" in the per-layer sense: Linear/Embedding weights, not biases or
        # LayerNorm params. (After stacking in llm.c layout ln1w is (L,C), so
        # the rule must be applied per unstacked tensor.)
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
    else:
        groups = [{"params": params, "weight_decay": cfg["weight_decay"]}]
    opt = torch.optim.AdamW(groups, lr=cfg["lr"], betas=cfg["betas"], eps=cfg["eps"])
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        else:
            norms.append(float(torch.norm(torch.stack([p.grad.norm() for p in params]))))
        opt.step()
    assert torch.all(model.wte.weight[V:] == 0), "padded wte rows must stay zero"
    return np.array(losses, dtype=np.float32), np.array(norms, dtype=np.float32)


def llmc_adamw_losses(init_state, x, y, cfg):
    """Cross-check for run 1: the update rule exactly as llm.c's CPU AdamW
    writes it, m/v with bias correction and
        p -= lr * (mhat / (sqrt(vhat) + eps) + wd * p).
    Must agree with torch.optim.AdamW (decoupled weight decay)."""
    model = GPT2()
    model.load_state_dict(init_state)
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = cfg["betas"]
    losses = []
    for step in range(1, STEPS + 1):
        for p in params:
            p.grad = None
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for p, mi, vi in zip(params, m, v):
                g = p.grad
                mi.mul_(b1).add_((1 - b1) * g)
                vi.mul_(b2).add_((1 - b2) * g * g)
                mhat = mi / (1 - b1 ** step)
                vhat = vi / (1 - b2 ** step)
                p.sub_(cfg["lr"] * (mhat / (vhat.sqrt() + cfg["eps"]) + cfg["weight_decay"] * p))
    return np.array(losses, dtype=np.float32)


def main():
    os.makedirs(FIX, exist_ok=True)
    model = GPT2()
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())

    # Per-row random sequences of length T+1; y is x shifted by one.
    seq = torch.randint(0, V, (B, T + 1), dtype=torch.int64)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    # Step 0 forward/backward on the initial weights.
    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    assert torch.all(logits[..., V:] == 0), "padded logits must be exactly 0"
    grads = llmc_tensors(model, use_grad=True)
    assert np.all(dict(grads)["wte"][V:] == 0), "padded wte grad rows must be 0"

    # Checkpoint + self check: an independent reader reproduces the logits.
    write_llmc_checkpoint(model, BIN_PATH)
    reloaded = read_llmc_checkpoint(BIN_PATH)
    with torch.no_grad():
        logits2, loss2 = reloaded(x, y)
    assert torch.equal(logits2, logits.detach()), "reloaded checkpoint differs"
    assert loss2.item() == loss.item()

    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, _ = train(init_state, x, y, RUN1, decay_2d_only=False, clip=None)
    assert losses[0] == np.float32(loss.item()), (losses[0], loss.item())
    ref_losses = llmc_adamw_losses(init_state, x, y, RUN1)
    assert np.allclose(losses, ref_losses, rtol=0, atol=1e-5), (losses, ref_losses)
    losses_wd2d, norms2 = train(init_state, x, y, RUN2, decay_2d_only=True, clip=RUN2["clip"])

    tensors = {
        "x": x.numpy().astype(np.int32),
        "y": y.numpy().astype(np.int32),
        "logits": logits.detach().numpy().astype(np.float32),
        "loss": np.array(loss.item(), dtype=np.float32),   # shape []
    }
    for name, g in grads:
        tensors["grad." + name] = g
    tensors["losses"] = losses
    tensors["losses_wd2d"] = losses_wd2d
    # Pre-clip global grad norms of run 2 (helps debug a clipping mismatch).
    tensors["grad_norms_wd2d"] = norms2

    metadata = {
        "generator": "scripts/gen_gpt2_reference.py",
        "torch_version": torch.__version__, "torch_seed": str(SEED),
        "max_seq_len": str(MAX_T), "vocab_size": str(V), "padded_vocab_size": str(VP),
        "num_layers": str(L), "num_heads": str(NH), "channels": str(C),
        "batch_size": str(B), "seq_len": str(T), "num_params": str(n_params),
        "ln_eps": str(LN_EPS), "gelu": "tanh", "tied_lm_head": "true",
        "init": f"N(0,{INIT_STD}); c_proj N(0,{INIT_STD}/sqrt(2L)); then LN params and "
                f"biases += N(0,{NOISE_STD}); wte rows >= V zeroed",
        "loss": "mean cross-entropy over the first V logit columns",
        "steps": str(STEPS),
        "losses.optimizer": "AdamW (torch.optim.AdamW, decoupled wd), no clipping",
        "losses.lr": str(RUN1["lr"]), "losses.beta1": str(RUN1["betas"][0]),
        "losses.beta2": str(RUN1["betas"][1]), "losses.eps": str(RUN1["eps"]),
        "losses.weight_decay": str(RUN1["weight_decay"]),
        "losses.weight_decay_applies_to": "all parameters",
        "losses_wd2d.optimizer": "AdamW (torch.optim.AdamW, decoupled wd), "
                                 "clip_grad_norm_ before step",
        "losses_wd2d.lr": str(RUN2["lr"]), "losses_wd2d.beta1": str(RUN2["betas"][0]),
        "losses_wd2d.beta2": str(RUN2["betas"][1]), "losses_wd2d.eps": str(RUN2["eps"]),
        "losses_wd2d.weight_decay": str(RUN2["weight_decay"]),
        "losses_wd2d.weight_decay_applies_to":
            "2-D weights only: wte, wpe, qkvw, attprojw, fcw, fcprojw",
        "losses_wd2d.grad_clip_norm": str(RUN2["clip"]),
        "losses_semantics": "losses[i] = loss at forward of step i, before its update",
    }
    safetensors_io.save(REF_PATH, tensors, metadata)
    safetensors_io.roundtrip_check(REF_PATH, tensors, metadata)

    bin_size, ref_size = os.path.getsize(BIN_PATH), os.path.getsize(REF_PATH)
    assert bin_size == 256 * 4 + 4 * n_params, (bin_size, n_params)
    assert ref_size < 1024 * 1024, ref_size

    np.set_printoptions(precision=6, linewidth=120)
    print(f"params: {n_params}")
    print(f"{BIN_PATH}: {bin_size} bytes")
    print(f"{REF_PATH}: {ref_size} bytes")
    for k, v in tensors.items():
        print(f"  {k:18s} {str(v.dtype):8s} {list(v.shape)}")
    print(f"max |logit|: {float(logits.abs().max()):.6f}")
    print(f"loss (step 0): {loss.item():.6f}   (ln V = {math.log(V):.6f})")
    print("losses      :", losses)
    print("losses_wd2d :", losses_wd2d)
    print("run2 pre-clip grad norms:", norms2)
    print("llm.c-style AdamW cross-check max |diff|:", float(np.abs(losses - ref_losses).max()))


if __name__ == "__main__":
    main()
