"""Work L1 in PyTorch (Debian's python3-torch): LLaMA-3 shape llama3-d6 (6 layers, width 384,
6 query heads and 3 kv heads of 64, SwiGLU width 1024, the 128,256-token vocabulary, tied
head), B=4, T=64, fp32, AdamW, one training step, timed over several steps after two warm-up
steps. Meta's reference formulation (RMSNorm, complex rotary with LLaMA-3.1 scaling,
grouped-query attention by repeating kv heads, SwiGLU), as tally's
scripts/gen_llama3_reference.py checks it. Prints one JSON line.
usage: llama_torch.py [steps=10] [threads=2]"""
import math, os, sys
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_training  # noqa: E402

V, L, H, KV, C, F_, B, T = 128256, 6, 6, 3, 384, 1024, 4, 64
HD = C // H
THETA, FACTOR, LOW, HIGH, ORIGINAL = 500000.0, 8.0, 1.0, 4.0, 8192


def inv_freq():
    freqs = 1.0 / (THETA ** (torch.arange(0, HD, 2).float() / HD))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < ORIGINAL / HIGH:
            out.append(f)
        elif wavelen > ORIGINAL / LOW:
            out.append(f / FACTOR)
        else:
            s = (ORIGINAL / wavelen - LOW) / (HIGH - LOW)
            out.append((1 - s) * f / FACTOR + s * f)
    return torch.tensor(out)


ANGLES = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq())
FREQS_CIS = torch.polar(torch.ones_like(ANGLES), ANGLES)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def rotary(x):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * FREQS_CIS[None, :, None, :]).flatten(3)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
        self.c_attn = nn.Linear(C, C + 2 * KV * HD, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)
        self.up, self.gate = nn.Linear(C, F_, bias=False), nn.Linear(C, F_, bias=False)
        self.down = nn.Linear(F_, C, bias=False)

    def forward(self, x):
        q, k, v = self.c_attn(rms(x, self.ln_1)).split([C, KV * HD, KV * HD], dim=-1)
        q, k, v = q.view(B, T, H, HD), k.view(B, T, KV, HD), v.view(B, T, KV, HD)
        q, k = rotary(q), rotary(k)
        k, v = k.repeat_interleave(H // KV, 2), v.repeat_interleave(H // KV, 2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # torch 1.13 has no fused SDPA; this is the standard eager formulation.
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HD)
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        x = x + self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))
        h = rms(x, self.ln_2)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def Llama():  # the tied head, as tally's presets of this shape
    return torch_training.TiedDecoder(Block, L, V, C, rms)


if __name__ == "__main__":
    torch_training.run(Llama, L, ("c_proj.weight", "down.weight"), "llama3-d6", V, B, T)
