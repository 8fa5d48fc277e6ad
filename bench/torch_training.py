"""What the PyTorch peers of bench/run_llama.sh and bench/run_moe.sh share: the
initialization (norms 1, weights N(0, 0.02), residual projections scaled by 1/sqrt(2L)) and
the timed AdamW training steps, measured as tally's bench_w1 measures its own."""
import json, math, resource, sys, time
import torch
import torch.nn as nn
import torch.nn.functional as F


class TiedDecoder(nn.Module):
    """The token embedding, `layers` blocks, the final norm and the head tied to the
    embedding, with the mean cross-entropy over `vocab` logits."""

    def __init__(self, make_block, layers, vocab, width, norm):
        super().__init__()
        self.vocab, self.norm = vocab, norm
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.ModuleList(make_block() for _ in range(layers))
        self.ln_f = nn.Parameter(torch.ones(width))

    def forward(self, idx, targets):
        x = self.wte(idx)
        for b in self.h:
            x = b(x)
        logits = self.norm(x, self.ln_f) @ self.wte.weight.t()
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def init(model, layers, residual_suffixes):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02 / math.sqrt(2 * layers) if name.endswith(residual_suffixes) else 0.02)
    return model


def run(make_model, layers, residual_suffixes, name, vocab, batch, seq, per_step=None):
    """Times `steps` training steps (argv[1], after two warm-up steps) on `threads` threads
    (argv[2]) and prints one JSON line; `per_step()`, when given, is read after each step
    and reported at the median step as {key: value}."""
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = init(make_model(), layers, residual_suffixes)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    x = torch.randint(0, vocab, (batch, seq))
    y = torch.randint(0, vocab, (batch, seq))
    times, extras = [], []
    for s in range(steps + 2):
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # tally's step clips too
        opt.step()
        opt.zero_grad(set_to_none=True)  # PyTorch 2's default; tally discards its gradients too
        dt = (time.perf_counter() - t0) * 1e3
        extra = per_step() if per_step else {}
        if s >= 2:
            times.append(dt)
            extras.append(extra)
    order = sorted(range(len(times)), key=lambda i: times[i])
    median = order[len(order) // 2]
    row = {"system": "pytorch " + torch.__version__, "model": name, "ms_per_step": round(times[median], 1),
           "min_ms": round(times[order[0]], 1), "tokens_per_s": round(batch * seq / (times[median] / 1e3)),
           "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "params": params, "loss": round(loss.item(), 4), "threads": threads}
    row.update(extras[median])
    print(json.dumps(row))
