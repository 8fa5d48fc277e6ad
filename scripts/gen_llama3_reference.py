#!/usr/bin/python3
"""Generate a tiny LLaMA-3 model plus PyTorch reference activations, gradients and
training losses for tally's end-to-end LLaMA tests.

Outputs (paths relative to the repo root):
  tests/fixtures/llama3_tiny.bin              the model in llm.c's LLaMA-3 format, exactly as
                                              llm.c's train_llama3.py writes it (magic
                                              20240803, float fields truncated into int32 slots)
  tests/fixtures/llama3_tiny_hf/              the same model as HuggingFace stores it:
                                              config.json, two safetensors shards and
                                              model.safetensors.index.json, q/k rows permuted
  tests/fixtures/llama3_tiny_ref.safetensors  batch, step-0 logits/loss/grads, two 10-step
                                              AdamW loss curves, the rotary frequencies
Regenerate with
    /usr/bin/python3 scripts/gen_llama3_reference.py

The model is Meta's LLaMA-3 reference (llama-models' model.py, as llm.c's train_llama3.py
copies it), written out by hand in fp32: RMSNorm, rotary embeddings on interleaved pairs
with LLaMA-3.1's frequency scaling, grouped-query attention, SwiGLU MLP of Meta's width,
no biases, untied LM head. The shape is tiny but keeps every feature live: 2 kv heads for 4
query heads, theta 500000 so the head's 4 frequencies fall in all three scaling bands, a
vocabulary (97) that is not a multiple of 128, an FFN width (128) that llm.c's truncated
header fields (ffn_dim_multiplier 1.3 -> 1) cannot reproduce, so a reader must recover it.
"""
import json
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
BIN_PATH = os.path.join(FIX, "llama3_tiny.bin")
HF_DIR = os.path.join(FIX, "llama3_tiny_hf")
REF_PATH = os.path.join(FIX, "llama3_tiny_ref.safetensors")

# ---- configuration ---------------------------------------------------------
MAX_T, V, L, NH, NKV, C = 32, 97, 2, 4, 2, 32
HD = C // NH
MULTIPLE_OF, FFN_MULT = 32, 1.3
NORM_EPS = 1e-5
ROPE_THETA = 500000.0
# LLaMA-3.1's scaling, the values llm.c's apply_scaling hard-codes.
ROPE_FACTOR, LOW_FREQ, HIGH_FREQ, ORIGINAL_CTX = 8.0, 1.0, 4.0, 8192
B, T = 4, 16
STEPS = 10
INIT_STD = 0.02
NOISE_STD = 0.02  # norm weights perturbed away from 1
SEED = 43
RUN1 = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
RUN2 = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)

LLAMA_MAGIC = 20240803

torch.manual_seed(SEED)
torch.set_default_dtype(torch.float32)
torch.set_num_threads(1)


def ffn_hidden(dim, multiple_of, multiplier):
    hidden = int(2 * (4 * dim) / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


FFN = ffn_hidden(C, MULTIPLE_OF, FFN_MULT)


# ---- Meta's rotary embedding ----------------------------------------------
def apply_scaling(freqs):
    low_wavelen, high_wavelen = ORIGINAL_CTX / LOW_FREQ, ORIGINAL_CTX / HIGH_FREQ
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / ROPE_FACTOR)
        else:
            smooth = (ORIGINAL_CTX / wavelen - LOW_FREQ) / (HIGH_FREQ - LOW_FREQ)
            out.append((1 - smooth) * f / ROPE_FACTOR + smooth * f)
    return torch.tensor(out, dtype=freqs.dtype)


INV_FREQ = apply_scaling(1.0 / (ROPE_THETA ** (torch.arange(0, HD, 2)[: HD // 2].float() / HD)))


def freqs_cis(t):
    angles = torch.outer(torch.arange(t, dtype=torch.float32), INV_FREQ)
    return torch.polar(torch.ones_like(angles), angles)  # (T, HD/2) complex64


def apply_rotary(x, fc):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * fc[None, :, None, :]).flatten(3).type_as(x)


# ---- model -----------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(C, (NH + 2 * NKV) * HD, bias=False)  # rows [q | k | v]
        self.c_proj = nn.Linear(C, C, bias=False)

    def forward(self, x, fc):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split([NH * HD, NKV * HD, NKV * HD], dim=-1)
        q, k, v = q.view(b, t, NH, HD), k.view(b, t, NKV, HD), v.view(b, t, NKV, HD)
        q, k = apply_rotary(q, fc), apply_rotary(k, fc)
        rep = NH // NKV  # query head h reads kv head h // rep
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(C, FFN, bias=False)   # up (Meta's w3)
        self.c_fc2 = nn.Linear(C, FFN, bias=False)  # gate (Meta's w1)
        self.c_proj = nn.Linear(FFN, C, bias=False)  # down (w2)

    def forward(self, x):
        return self.c_proj(F.silu(self.c_fc2(x)) * self.c_fc(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = RMSNorm()
        self.attn = Attention()
        self.ln_2 = RMSNorm()
        self.mlp = MLP()

    def forward(self, x, fc):
        x = x + self.attn(self.ln_1(x), fc)
        return x + self.mlp(self.ln_2(x))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, C)
        self.h = nn.ModuleList([Block() for _ in range(L)])
        self.ln_f = RMSNorm()
        self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, idx, targets=None):
        x = self.wte(idx)
        fc = freqs_cis(idx.shape[1])
        for block in self.h:
            x = block(x, fc)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        return logits, loss


def init_weights(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, INIT_STD / math.sqrt(2 * L))
            elif "ln_" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * NOISE_STD)
            else:
                p.normal_(0.0, INIT_STD)


# ---- llm.c's LLaMA-3 file (train_llama3.py's write_model) --------------------
LLMC_LAYOUT = [
    ("wte", "wte.weight"), ("ln1w", "h.{}.ln_1.weight"), ("qkvw", "h.{}.attn.c_attn.weight"),
    ("attprojw", "h.{}.attn.c_proj.weight"), ("ln2w", "h.{}.ln_2.weight"), ("fcw", "h.{}.mlp.c_fc.weight"),
    ("fcw2", "h.{}.mlp.c_fc2.weight"), ("fcprojw", "h.{}.mlp.c_proj.weight"), ("lnfw", "ln_f.weight"),
    ("lm_head", "lm_head.weight"),
]


def llmc_tensors(model, use_grad=False):
    params = dict(model.named_parameters())
    get = (lambda n: params[n].grad) if use_grad else (lambda n: params[n])
    out = []
    for name, pat in LLMC_LAYOUT:
        arr = torch.stack([get(pat.format(l)).detach() for l in range(L)]) if "{}" in pat else get(pat).detach()
        out.append((name, arr.numpy().astype(np.float32, copy=True)))
    return out


def write_llmc(model, path):
    # Exactly train_llama3.py's header: an int32 array, so ffn_dim_multiplier (1.3) becomes 1
    # and norm_eps (1e-5) becomes 0. llm.c's version string "3.1" goes into slots 14, 15.
    header = np.zeros(256, dtype="<i4")
    header[:16] = [LLAMA_MAGIC, 3, MAX_T, V, L, NH, NKV, C, int(FFN_MULT), MULTIPLE_OF, int(NORM_EPS),
                   int(ROPE_THETA), 1, 4, 3, 1]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for _, arr in llmc_tensors(model):
            f.write(arr.astype("<f4").tobytes())


# ---- HuggingFace layout ----------------------------------------------------
def hf_permute(w, n_heads):
    """convert_llama_weights_to_hf.py's permute: Meta's interleaved rotary pairs to HF's
    rotate_half halves, per head."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def hf_state(model):
    p = dict(model.named_parameters())
    out = {"model.embed_tokens.weight": p["wte.weight"]}
    for l in range(L):
        q, k, v = p[f"h.{l}.attn.c_attn.weight"].split([NH * HD, NKV * HD, NKV * HD], dim=0)
        pre = f"model.layers.{l}."
        out[pre + "input_layernorm.weight"] = p[f"h.{l}.ln_1.weight"]
        out[pre + "self_attn.q_proj.weight"] = hf_permute(q, NH)
        out[pre + "self_attn.k_proj.weight"] = hf_permute(k, NKV)
        out[pre + "self_attn.v_proj.weight"] = v
        out[pre + "self_attn.o_proj.weight"] = p[f"h.{l}.attn.c_proj.weight"]
        out[pre + "post_attention_layernorm.weight"] = p[f"h.{l}.ln_2.weight"]
        out[pre + "mlp.gate_proj.weight"] = p[f"h.{l}.mlp.c_fc2.weight"]
        out[pre + "mlp.up_proj.weight"] = p[f"h.{l}.mlp.c_fc.weight"]
        out[pre + "mlp.down_proj.weight"] = p[f"h.{l}.mlp.c_proj.weight"]
    out["model.norm.weight"] = p["ln_f.weight"]
    out["lm_head.weight"] = p["lm_head.weight"]
    return {k: v.detach().numpy().astype(np.float32, copy=True) for k, v in out.items()}


def hf_forward_check(state, x, expected_logits):
    """HF's LlamaForCausalLM math (rotate_half on the permuted q/k rows) on the exported
    state must give Meta's logits: proves the permutation's direction."""
    s = {k: torch.from_numpy(v) for k, v in state.items()}
    t = x.shape[1]
    angles = torch.outer(torch.arange(t, dtype=torch.float32), INV_FREQ)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]

    def rotate_half(z):
        return torch.cat([-z[..., HD // 2:], z[..., : HD // 2]], dim=-1)

    def rms(z, w):
        return z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + NORM_EPS) * w

    h = s["model.embed_tokens.weight"][x]
    for l in range(L):
        pre = f"model.layers.{l}."
        a = rms(h, s[pre + "input_layernorm.weight"])
        q = (a @ s[pre + "self_attn.q_proj.weight"].T).view(*x.shape, NH, HD)
        k = (a @ s[pre + "self_attn.k_proj.weight"].T).view(*x.shape, NKV, HD)
        v = (a @ s[pre + "self_attn.v_proj.weight"].T).view(*x.shape, NKV, HD)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(NH // NKV, 2), v.repeat_interleave(NH // NKV, 2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(dim=-1)
        y = att @ v
        h = h + y.transpose(1, 2).reshape(*x.shape, C) @ s[pre + "self_attn.o_proj.weight"].T
        m = rms(h, s[pre + "post_attention_layernorm.weight"])
        g = F.silu(m @ s[pre + "mlp.gate_proj.weight"].T) * (m @ s[pre + "mlp.up_proj.weight"].T)
        h = h + g @ s[pre + "mlp.down_proj.weight"].T
    logits = rms(h, s["model.norm.weight"]) @ s["lm_head.weight"].T
    err = float((logits - expected_logits).abs().max())
    assert err < 1e-5, f"HF-layout forward differs from Meta's by {err}"
    return err


def write_hf(state, directory):
    os.makedirs(directory, exist_ok=True)
    names = list(state)
    half = len(names) // 2
    shards = [names[:half], names[half:]]
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors_io.save(os.path.join(directory, fname), {n: state[n] for n in shard}, {"format": "pt"})
        for n in shard:
            weight_map[n] = fname
            total += state[n].nbytes
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": C, "intermediate_size": FFN, "num_attention_heads": NH, "num_key_value_heads": NKV,
        "num_hidden_layers": L, "head_dim": HD, "vocab_size": V, "max_position_embeddings": MAX_T,
        "rms_norm_eps": NORM_EPS, "rope_theta": ROPE_THETA,
        "rope_scaling": {"factor": ROPE_FACTOR, "low_freq_factor": LOW_FREQ, "high_freq_factor": HIGH_FREQ,
                         "original_max_position_embeddings": ORIGINAL_CTX, "rope_type": "llama3"},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1,
    }
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


# ---- training --------------------------------------------------------------
def train(init_state, x, y, cfg, decay_2d_only, clip):
    model = Llama()
    model.load_state_dict(init_state)
    params = list(model.parameters())
    if decay_2d_only:
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
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
    return np.array(losses, dtype=np.float32), np.array(norms, dtype=np.float32)


def main():
    os.makedirs(FIX, exist_ok=True)
    model = Llama()
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    seq = torch.randint(0, V, (B, T + 1), dtype=torch.int64)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    grads = llmc_tensors(model, use_grad=True)

    write_llmc(model, BIN_PATH)
    assert os.path.getsize(BIN_PATH) == 1024 + 4 * n_params
    state = hf_state(model)
    hf_err = hf_forward_check(state, x, logits.detach())
    write_hf(state, HF_DIR)

    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, _ = train(init_state, x, y, RUN1, decay_2d_only=False, clip=None)
    assert losses[0] == np.float32(loss.item())
    losses_wd2d, norms2 = train(init_state, x, y, RUN2, decay_2d_only=True, clip=RUN2["clip"])

    tensors = {
        "x": x.numpy().astype(np.int32), "y": y.numpy().astype(np.int32),
        "logits": logits.detach().numpy().astype(np.float32),
        "loss": np.array(loss.item(), dtype=np.float32),
        "inv_freq": INV_FREQ.numpy().astype(np.float32),
    }
    for name, g in grads:
        tensors["grad." + name] = g
    tensors["losses"] = losses
    tensors["losses_wd2d"] = losses_wd2d
    tensors["grad_norms_wd2d"] = norms2
    metadata = {
        "generator": "scripts/gen_llama3_reference.py", "torch_version": torch.__version__, "torch_seed": str(SEED),
        "max_seq_len": str(MAX_T), "vocab_size": str(V), "num_layers": str(L), "num_heads": str(NH),
        "num_kv_heads": str(NKV), "channels": str(C), "ffn_hidden": str(FFN), "multiple_of": str(MULTIPLE_OF),
        "ffn_dim_multiplier": str(FFN_MULT), "norm_eps": str(NORM_EPS), "rope_theta": str(ROPE_THETA),
        "rope_scaling": f"factor={ROPE_FACTOR},low={LOW_FREQ},high={HIGH_FREQ},original={ORIGINAL_CTX}",
        "batch_size": str(B), "seq_len": str(T), "num_params": str(n_params), "tied_lm_head": "false",
        "loss": "mean cross-entropy over the V logit columns", "steps": str(STEPS),
        "losses.optimizer": "torch.optim.AdamW, wd on all parameters, no clipping",
        "losses.lr": str(RUN1["lr"]), "losses.weight_decay": str(RUN1["weight_decay"]),
        "losses_wd2d.optimizer": "torch.optim.AdamW, wd on 2-D weights, clip_grad_norm_ 1.0",
        "losses_wd2d.lr": str(RUN2["lr"]), "losses_wd2d.weight_decay": str(RUN2["weight_decay"]),
        "losses_wd2d.betas": "0.9,0.95",
    }
    safetensors_io.save(REF_PATH, tensors, metadata)
    safetensors_io.roundtrip_check(REF_PATH, tensors, metadata)
    print(f"params {n_params}, ffn {FFN}, inv_freq {INV_FREQ.tolist()}")
    print(f"loss {loss.item():.6f} (ln V = {math.log(V):.6f}); HF-layout forward check max diff {hf_err:.2e}")
    print("losses      :", losses)
    print("losses_wd2d :", losses_wd2d)
    for p in (BIN_PATH, REF_PATH):
        print(f"{p}: {os.path.getsize(p)} bytes")


if __name__ == "__main__":
    main()
