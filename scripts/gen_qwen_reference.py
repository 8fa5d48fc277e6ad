#!/usr/bin/python3
"""Generate tiny Qwen2 (Qwen2.5), Qwen3 and Qwen3-MoE models plus PyTorch reference logits,
gradients and training losses for tally's Qwen tests.

Outputs (paths relative to the repo root), for FAMILY in qwen2, qwen3, qwen3_moe:
  tests/fixtures/FAMILY_tiny_hf/              the model as HuggingFace stores it: config.json
                                              and model.safetensors (qwen2), or two shards
                                              and model.safetensors.index.json (qwen3)
  tests/fixtures/FAMILY_tiny_ref.safetensors  batch, step-0 logits/loss, the gradient of every
                                              tensor under its HuggingFace name, two 10-step
                                              AdamW loss curves
Regenerate with
    /usr/bin/python3 scripts/gen_qwen_reference.py

The models are written out by hand in fp32 in HuggingFace's own formulation
(transformers' modeling_qwen2.py / modeling_qwen3.py): separate q, k and v projections
(with biases for Qwen2), Qwen3's RMSNorm over each head's head_dim channels of q and of k
(one weight shared by the heads) before the rotary embedding, rotary on rotate_half's
halves, grouped-query attention by repeat_kv, SwiGLU MLP, RMSNorm computed in fp32, the head
tied to the embedding (Qwen2) or not (Qwen3). The shapes are tiny but keep every feature
live: 2 kv heads for 4 query heads; a vocabulary (97) that is not a multiple of 128; for
Qwen3 a head_dim (16) that is not hidden_size / num_attention_heads (8), so the attention
is 64 wide in a 32-wide model; biases and norm weights drawn away from 0 and 1.

Qwen3-MoE is Qwen3 with modeling_qwen3_moe.py's sparse block: a router (mlp.gate, no bias),
softmax in fp32 over the experts, top-k, renormalized when norm_topk_prob, each expert a
SwiGLU MLP of moe_intermediate_size, outputs summed with the routing weights. Here 3 layers,
4 experts of width 16, 2 per token, and mlp_only_layers [1]: the middle layer is dense.
Its file also holds the same step-0 quantities and AdamW run with HuggingFace's
load-balancing loss added (output_router_logits, load_balancing_loss_func over both sparse
layers' router logits together, times AUX_COEF), and once more with each sparse layer's own
balance loss (Megatron-Core's switch_load_balancing_loss_func) and router z-loss (ST-MoE's)
added, times BALANCE_COEF and Z_COEF.
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

MAX_T, V, L, NH, NKV, C, FFN = 64, 97, 2, 4, 2, 32, 64
NORM_EPS = 1e-6
ROPE_THETA = 1000000.0
B, T = 4, 16
STEPS = 10
INIT_STD = 0.02
NOISE_STD = 0.02
RUN1 = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
AUX_COEF = 0.05  # router_aux_loss_coef of the aux_ quantities (large enough to move the gradients)
# The router_ quantities: each sparse layer's own balance loss (Megatron-Core's
# switch_load_balancing_loss_func) and router z-loss (ST-MoE's), times these.
BALANCE_COEF, Z_COEF = 0.05, 0.01
RUN2 = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, clip=1.0)

FAMILIES = {
    # family: (head_dim, q/k/v biases, q/k norms, tied head, seed, sharded)
    "qwen2": dict(head_dim=C // NH, bias=True, qk_norm=False, tied=True, seed=47, sharded=False),
    "qwen3": dict(head_dim=16, bias=False, qk_norm=True, tied=False, seed=53, sharded=True),
    "qwen3_moe": dict(head_dim=16, bias=False, qk_norm=True, tied=False, seed=59, sharded=True, layers=3,
                      moe=dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                               decoder_sparse_step=1, mlp_only_layers=[1])),
}

torch.set_default_dtype(torch.float32)
torch.set_num_threads(1)


class RMSNorm(nn.Module):
    """Qwen2RMSNorm / Qwen3RMSNorm: the mean of squares in fp32, then the weight."""

    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        return self.weight * x.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(t, head_dim):
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()  # (T, head_dim)


def repeat_kv(x, n_rep):
    """(B, KV, T, D) -> (B, KV * n_rep, T, D): query head h reads kv head h // n_rep."""
    b, kv, t, d = x.shape
    return x[:, :, None, :, :].expand(b, kv, n_rep, t, d).reshape(b, kv * n_rep, t, d)


class Attention(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.d = f["head_dim"]
        self.q_proj = nn.Linear(C, NH * self.d, bias=f["bias"])
        self.k_proj = nn.Linear(C, NKV * self.d, bias=f["bias"])
        self.v_proj = nn.Linear(C, NKV * self.d, bias=f["bias"])
        self.o_proj = nn.Linear(NH * self.d, C, bias=False)
        self.qk_norm = f["qk_norm"]
        if self.qk_norm:
            self.q_norm = RMSNorm(self.d)
            self.k_norm = RMSNorm(self.d)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, NH, self.d)
        k = self.k_proj(x).view(b, t, NKV, self.d)
        v = self.v_proj(x).view(b, t, NKV, self.d)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k, v = repeat_kv(k, NH // NKV), repeat_kv(v, NH // NKV)
        att = (q @ k.transpose(-2, -1)) * self.d ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, NH * self.d)
        return self.o_proj(y)


class MLP(nn.Module):
    def __init__(self, width=FFN):
        super().__init__()
        self.gate_proj = nn.Linear(C, width, bias=False)
        self.up_proj = nn.Linear(C, width, bias=False)
        self.down_proj = nn.Linear(width, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Qwen3MoeSparseMoeBlock: route each token to its top-k experts."""

    def __init__(self, moe):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (moe["num_experts"], moe["num_experts_per_tok"],
                                                             moe["norm_topk_prob"])
        self.gate = nn.Linear(C, self.num_experts, bias=False)
        self.router_logits = None  # the last forward's, for the load-balancing loss
        self.experts = nn.ModuleList([MLP(moe["moe_intermediate_size"]) for _ in range(self.num_experts)])

    def forward(self, x):
        b, t, c = x.shape
        h = x.reshape(-1, c)
        router_logits = self.gate(h)
        self.router_logits = router_logits
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(h.dtype)
        final = torch.zeros_like(h)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)  # (E, k, N)
        for e in range(self.num_experts):
            idx, top_x = torch.where(expert_mask[e])
            if top_x.numel() == 0:
                continue
            out = self.experts[e](h[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(h.dtype))
        return final.reshape(b, t, c)


def sparse_layer(f, layer_idx):
    moe = f.get("moe")
    return (moe is not None and layer_idx not in moe["mlp_only_layers"] and moe["num_experts"] > 0
            and (layer_idx + 1) % moe["decoder_sparse_step"] == 0)


class DecoderLayer(nn.Module):
    def __init__(self, f, layer_idx):
        super().__init__()
        self.input_layernorm = RMSNorm(C)
        self.self_attn = Attention(f)
        self.post_attention_layernorm = RMSNorm(C)
        self.mlp = SparseMoeBlock(f["moe"]) if sparse_layer(f, layer_idx) else MLP()

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.embed_tokens = nn.Embedding(V, C)
        self.layers = nn.ModuleList([DecoderLayer(f, l) for l in range(f.get("layers", L))])
        self.norm = RMSNorm(C)


class QwenForCausalLM(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f
        self.model = Body(f)
        self.tied = f["tied"]
        if not self.tied:
            self.lm_head = nn.Linear(C, V, bias=False)

    def forward(self, idx, targets=None, aux_coef=0.0, balance_coef=0.0, z_coef=0.0):
        x = self.model.embed_tokens(idx)
        cos, sin = rotary_cos_sin(idx.shape[1], self.f["head_dim"])
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        h = self.model.norm(x)
        logits = h @ (self.model.embed_tokens.weight if self.tied else self.lm_head.weight).T
        loss = None if targets is None else F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))
        self.aux_loss = None
        if aux_coef > 0:
            gate_logits = [l.mlp.router_logits for l in self.model.layers if isinstance(l.mlp, SparseMoeBlock)]
            self.aux_loss = load_balancing_loss(gate_logits, self.f["moe"]["num_experts"], self.f["moe"]["num_experts_per_tok"])
            loss = loss + aux_coef * self.aux_loss
        if balance_coef > 0 or z_coef > 0:
            moe = self.f["moe"]
            gate_logits = [l.mlp.router_logits for l in self.model.layers if isinstance(l.mlp, SparseMoeBlock)]
            self.balance_loss = sum(switch_balance_loss(g, moe["num_experts"], moe["num_experts_per_tok"]) for g in gate_logits)
            self.z_loss = sum(router_z_loss(g) for g in gate_logits)
            loss = loss + balance_coef * self.balance_loss + z_coef * self.z_loss
        return logits, loss


def switch_balance_loss(logits, num_experts, top_k):
    """One layer's: Megatron-Core's switch_load_balancing_loss_func (the counts take no gradient)."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    _, selected = torch.topk(probs, top_k, dim=-1)
    tokens_per_expert = F.one_hot(selected, num_experts).sum(dim=(0, 1)).float()
    n = logits.shape[0]
    return torch.sum(probs.sum(dim=0) * tokens_per_expert) * num_experts / (n * n * top_k)


def router_z_loss(logits):
    """One layer's: ST-MoE's z-loss, the mean over tokens of logsumexp(logits)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1)))


def load_balancing_loss(gate_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func without an attention mask."""
    concatenated = torch.cat(gate_logits, dim=0)
    routing_weights = F.softmax(concatenated, dim=-1)
    _, selected_experts = torch.topk(routing_weights, top_k, dim=-1)
    expert_mask = F.one_hot(selected_experts, num_experts)
    tokens_per_expert = torch.mean(expert_mask.float(), dim=0)
    router_prob_per_expert = torch.mean(routing_weights, dim=0)
    return torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0)) * num_experts


def init_weights(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0).add_(torch.randn_like(p) * NOISE_STD)
            elif name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                p.normal_(0.0, INIT_STD / math.sqrt(2 * L))
            else:  # weights and the q/k/v biases
                p.normal_(0.0, INIT_STD)


def state_numpy(model, use_grad=False):
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if use_grad else p
        out[name] = t.detach().numpy().astype(np.float32, copy=True)
    return out


def write_hf(family, f, state, directory):
    os.makedirs(directory, exist_ok=True)
    for old in os.listdir(directory):
        os.remove(os.path.join(directory, old))
    names = list(state)
    if f["sharded"]:
        half = len(names) // 2
        shards = [names[:half], names[half:]]
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            safetensors_io.save(os.path.join(directory, fname), {n: state[n] for n in shard}, {"format": "pt"})
            for n in shard:
                weight_map[n] = fname
                total += state[n].nbytes
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as out:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, out, indent=2)
    else:
        safetensors_io.save(os.path.join(directory, "model.safetensors"), state, {"format": "pt"})
    architecture = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    config = {
        "architectures": [architecture[family]],
        "model_type": family, "hidden_act": "silu", "hidden_size": C, "intermediate_size": FFN,
        "num_attention_heads": NH, "num_key_value_heads": NKV, "num_hidden_layers": f.get("layers", L),
        "vocab_size": V, "max_position_embeddings": MAX_T, "rms_norm_eps": NORM_EPS, "rope_theta": ROPE_THETA,
        "rope_scaling": None, "tie_word_embeddings": f["tied"], "torch_dtype": "float32",
        "use_sliding_window": False, "sliding_window": MAX_T, "max_window_layers": L,
        "attention_dropout": 0.0, "initializer_range": INIT_STD, "use_cache": True,
        "bos_token_id": 0, "eos_token_id": 1,
    }
    if family != "qwen2":
        config.update({"head_dim": f["head_dim"], "attention_bias": False})
    if "moe" in f:
        config.update(f["moe"])
        config.update({"output_router_logits": False, "router_aux_loss_coef": 0.001})
    with open(os.path.join(directory, "config.json"), "w") as out:
        json.dump(config, out, indent=2)


def train(f, init_state, x, y, cfg, decay_2d_only, clip, aux_coef=0.0, balance_coef=0.0, z_coef=0.0):
    model = QwenForCausalLM(f)
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
        _, loss = model(x, y, aux_coef, balance_coef, z_coef)
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        else:
            norms.append(float(torch.norm(torch.stack([p.grad.norm() for p in params]))))
        opt.step()
    return np.array(losses, dtype=np.float32), np.array(norms, dtype=np.float32)


def generate(family):
    f = FAMILIES[family]
    torch.manual_seed(f["seed"])
    model = QwenForCausalLM(f)
    init_weights(model)
    n_params = sum(p.numel() for p in model.parameters())
    seq = torch.randint(0, V, (B, T + 1), dtype=torch.int64)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    model.zero_grad(set_to_none=True)
    logits, loss = model(x, y)
    loss.backward()
    grads = state_numpy(model, use_grad=True)
    state = state_numpy(model)
    hf_dir = os.path.join(FIX, f"{family}_tiny_hf")
    write_hf(family, f, state, hf_dir)

    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses, _ = train(f, init_state, x, y, RUN1, decay_2d_only=False, clip=None)
    assert losses[0] == np.float32(loss.item())
    losses_wd2d, norms2 = train(f, init_state, x, y, RUN2, decay_2d_only=True, clip=RUN2["clip"])

    tensors = {
        "x": x.numpy().astype(np.int32), "y": y.numpy().astype(np.int32),
        "logits": logits.detach().numpy().astype(np.float32),
        "loss": np.array(loss.item(), dtype=np.float32),
        "losses": losses, "losses_wd2d": losses_wd2d, "grad_norms_wd2d": norms2,
    }
    for name, g in grads.items():
        tensors["grad." + name] = g
    if "moe" in f:
        model.zero_grad(set_to_none=True)
        _, aux_total = model(x, y, AUX_COEF)
        aux_total.backward()
        tensors["aux_loss"] = np.array(model.aux_loss.item(), dtype=np.float32)
        tensors["aux_total_loss"] = np.array(aux_total.item(), dtype=np.float32)
        for name, g in state_numpy(model, use_grad=True).items():
            tensors["aux_grad." + name] = g
        tensors["aux_losses"], _ = train(f, init_state, x, y, RUN1, decay_2d_only=False, clip=None, aux_coef=AUX_COEF)
        model.zero_grad(set_to_none=True)
        _, router_total = model(x, y, 0.0, BALANCE_COEF, Z_COEF)
        router_total.backward()
        tensors["balance_loss"] = np.array(model.balance_loss.item(), dtype=np.float32)
        tensors["z_loss"] = np.array(model.z_loss.item(), dtype=np.float32)
        tensors["router_total_loss"] = np.array(router_total.item(), dtype=np.float32)
        for name, g in state_numpy(model, use_grad=True).items():
            tensors["router_grad." + name] = g
        tensors["router_losses"], _ = train(f, init_state, x, y, RUN1, decay_2d_only=False, clip=None,
                                            balance_coef=BALANCE_COEF, z_coef=Z_COEF)
    metadata = {
        "generator": "scripts/gen_qwen_reference.py", "family": family, "torch_version": torch.__version__,
        "torch_seed": str(f["seed"]), "max_seq_len": str(MAX_T), "vocab_size": str(V), "num_layers": str(f.get("layers", L)),
        "num_heads": str(NH), "num_kv_heads": str(NKV), "head_dim": str(f["head_dim"]), "channels": str(C),
        "ffn_hidden": str(FFN), "norm_eps": str(NORM_EPS), "rope_theta": str(ROPE_THETA),
        "batch_size": str(B), "seq_len": str(T), "num_params": str(n_params), "tied_lm_head": str(f["tied"]).lower(),
        "grad names": "HuggingFace's (a tied head's gradient is in model.embed_tokens.weight)",
        "losses.optimizer": "torch.optim.AdamW, wd on all parameters, no clipping",
        "losses.lr": str(RUN1["lr"]), "losses.weight_decay": str(RUN1["weight_decay"]),
        "losses_wd2d.optimizer": "torch.optim.AdamW, wd on 2-D weights, clip_grad_norm_ 1.0",
        "losses_wd2d.lr": str(RUN2["lr"]), "losses_wd2d.weight_decay": str(RUN2["weight_decay"]),
        "losses_wd2d.betas": "0.9,0.95",
    }
    if "moe" in f:
        metadata.update({"aux_coef": str(AUX_COEF), "aux_losses.optimizer": "as losses, with the load-balancing loss",
                         "balance_coef": str(BALANCE_COEF), "z_coef": str(Z_COEF),
                         "router_losses.optimizer": "as losses, with each layer's balance and z-losses"})
    ref_path = os.path.join(FIX, f"{family}_tiny_ref.safetensors")
    safetensors_io.save(ref_path, tensors, metadata)
    safetensors_io.roundtrip_check(ref_path, tensors, metadata)
    print(f"{family}: params {n_params}, loss {loss.item():.6f} (ln V = {math.log(V):.6f})")
    print("  losses      :", losses)
    print("  losses_wd2d :", losses_wd2d, "pre-clip norms", norms2)


def main():
    os.makedirs(FIX, exist_ok=True)
    for family in FAMILIES:
        generate(family)


if __name__ == "__main__":
    main()
