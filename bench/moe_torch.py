"""Work M1 in PyTorch (Debian's python3-torch): Qwen3-MoE shape qwen3-moe-d6 (6 layers, width
384, 6 query heads and 3 kv heads of 128, q/k norms, 8 experts of width 384 per layer, 2 a
token, renormalized, the 151,936-token vocabulary, tied head), B=4, T=64, fp32, AdamW, one
training step, timed over several steps after two warm-up steps. HuggingFace's formulation
(modeling_qwen3_moe.py: rotate_half rotary, repeat_kv, the sparse block's top-k and
index_add_), as tally's scripts/gen_qwen_reference.py checks it. Prints one JSON line with the
step's time and the experts' share of it.
usage: moe_torch.py [steps=10] [threads=2]"""
import math, os, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_training  # noqa: E402

V, L, H, KV, C, D, E, K, FE, B, T = 151936, 6, 6, 3, 384, 128, 8, 2, 384, 4, 64
THETA, EPS = 1e6, 1e-6

INV_FREQ = 1.0 / (THETA ** (torch.arange(0, D, 2).float() / D))
EMB = torch.cat([torch.outer(torch.arange(T, dtype=torch.float32), INV_FREQ)] * 2, dim=-1)
COS, SIN = EMB.cos(), EMB.sin()
EXPERT_SECONDS = [0.0]  # forward time inside the experts' MLPs (their backward is not separable in eager)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rotate_half(x):
    return torch.cat([-x[..., D // 2:], x[..., : D // 2]], dim=-1)


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(C, FE, bias=False), nn.Linear(C, FE, bias=False), nn.Linear(FE, C, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.Parameter(torch.ones(C)), nn.Parameter(torch.ones(C))
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))
        self.q, self.k, self.v = nn.Linear(C, H * D, bias=False), nn.Linear(C, KV * D, bias=False), nn.Linear(C, KV * D, bias=False)
        self.o = nn.Linear(H * D, C, bias=False)
        self.router = nn.Linear(C, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))

    def attention(self, h):
        q = rms(self.q(h).view(B, T, H, D), self.q_norm).transpose(1, 2)
        k = rms(self.k(h).view(B, T, KV, D), self.k_norm).transpose(1, 2)
        v = self.v(h).view(B, T, KV, D).transpose(1, 2)
        q, k = q * COS + rotate_half(q) * SIN, k * COS + rotate_half(k) * SIN
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(D)  # torch 1.13 has no fused SDPA
        att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf")).softmax(-1)
        return self.o((att @ v).transpose(1, 2).reshape(B, T, H * D))

    def sparse(self, h):
        x = h.reshape(-1, C)
        weights, chosen = torch.topk(F.softmax(self.router(x), dim=1, dtype=torch.float), K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, num_classes=E).permute(2, 1, 0)
        t0 = time.perf_counter()
        for e in range(E):
            slot, token = torch.where(mask[e])
            if token.numel():
                out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        EXPERT_SECONDS[0] += time.perf_counter() - t0
        return out.view(B, T, C)

    def forward(self, x):
        x = x + self.attention(rms(x, self.ln_1))
        return x + self.sparse(rms(x, self.ln_2))


def Model():  # the tied head, as tally's presets of this shape
    return torch_training.TiedDecoder(Block, L, V, C, rms)


def expert_forward_ms():
    ms = {"experts_forward_ms": round(EXPERT_SECONDS[0] * 1e3, 1)}
    EXPERT_SECONDS[0] = 0.0
    return ms


if __name__ == "__main__":
    EXPERT_SECONDS[0] = 0.0
    torch_training.run(Model, L, ("o.weight", "down.weight"), "qwen3-moe-d6", V, B, T, per_step=expert_forward_ms)
