#!/usr/bin/python3
"""One sparse layer's MLP alone in PyTorch (Debian's python3-torch 1.13), the peer of
bench_experts: HuggingFace's Qwen3MoeSparseMoeBlock (modeling_qwen3_moe.py) as written, the
router linear, softmax in fp32, top-k, renormalized when norm_topk_prob, then a loop over
the experts that took tokens, each gathering its tokens' rows (torch.where over a one-hot
mask), running its SwiGLU MLP, weighting the outputs and adding them back with index_add_.
Forward and backward at the shape bench_experts prints in its JSON line, fp32, the weights
drawn as tally's init draws them (normal, std 0.02), h ~ N(0, 1) and its output gradient
~ 1e-2 N(0, 1), so the routing's statistics match (not its exact choices).

Prints one JSON line: min and median of forward, backward and their sum over `rounds` timed
rounds after one warm-up round, and the busiest expert's rows.
usage: experts_torch.py [rounds=5] [threads=2] --tokens N --width C --experts E --top-k K
                        --expert-width FE [--no-norm-topk-prob]"""
import argparse, json, time
import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, C, FE):
        super().__init__()
        self.gate_proj = nn.Linear(C, FE, bias=False)
        self.up_proj = nn.Linear(C, FE, bias=False)
        self.down_proj = nn.Linear(FE, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, C, E, K, FE, norm_topk_prob):
        super().__init__()
        self.E, self.K, self.norm_topk_prob = E, K, norm_topk_prob
        self.gate = nn.Linear(C, E, bias=False)
        self.experts = nn.ModuleList(Expert(C, FE) for _ in range(E))
        self.busiest = 0

    def forward(self, hidden_states):
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.K, dim=-1)
        if self.norm_topk_prob:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.E).permute(2, 1, 0)
        per_expert = expert_mask.sum(dim=(-1, -2))
        self.busiest = int(per_expert.max())
        for e in torch.greater(per_expert, 0).nonzero().flatten().tolist():
            idx, top_x = torch.where(expert_mask[e])
            current = hidden_states[top_x]
            out = self.experts[e](current) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, out.to(hidden_states.dtype))
        return final


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rounds", type=int, nargs="?", default=5)
    ap.add_argument("threads", type=int, nargs="?", default=2)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--width", type=int, required=True)
    ap.add_argument("--experts", type=int, required=True)
    ap.add_argument("--top-k", type=int, required=True)
    ap.add_argument("--expert-width", type=int, required=True)
    ap.add_argument("--no-norm-topk-prob", action="store_true")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("rounds must be at least 1")
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    N, C = a.tokens, a.width
    block = SparseMoeBlock(C, a.experts, a.top_k, a.expert_width, not a.no_norm_topk_prob)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    h = torch.randn(N, C, requires_grad=True)
    dout = 1e-2 * torch.randn(N, C)
    forward_ms, backward_ms, step_ms = [], [], []
    for r in range(a.rounds + 1):  # the first warms up
        t0 = time.perf_counter()
        out = block(h)
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        del out
        h.grad = None
        for p in block.parameters():
            p.grad = None
        if r == 0:
            continue
        forward_ms.append((t1 - t0) * 1e3)
        backward_ms.append((t2 - t1) * 1e3)
        step_ms.append((t2 - t0) * 1e3)

    def lo_mid(v):
        v = sorted(v)
        return round(v[0], 2), round(v[len(v) // 2], 2)

    (fmin, fmed), (bmin, bmed), (smin, smed) = lo_mid(forward_ms), lo_mid(backward_ms), lo_mid(step_ms)
    print(json.dumps({"system": "pytorch " + torch.__version__, "forward_min_ms": fmin, "forward_median_ms": fmed,
                      "backward_min_ms": bmin, "backward_median_ms": bmed, "step_min_ms": smin,
                      "step_median_ms": smed, "busiest_expert_rows": block.busiest, "tokens": N, "width": C,
                      "experts": a.experts, "top_k": a.top_k, "expert_width": a.expert_width,
                      "norm_topk_prob": not a.no_norm_topk_prob, "threads": a.threads}))


if __name__ == "__main__":
    main()
