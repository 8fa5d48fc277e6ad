#!/usr/bin/python3
"""The data-parallel peer: PyTorch DistributedDataParallel (gloo, Debian's python3-torch)
on the W1 model (GPT-2 124M, B=4, T=64 per rank, fp32, AdamW with tally train's weight
decay and gradient clipping), one thread per rank.
Launch each rank with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set (bench/run_dp.sh does;
Debian's torchrun fails under Python 3.11):  bench/dp_torch.py [steps=4]
Rank 0 prints one JSON line: median/min ms per step, tokens/s over all ranks, and the
peak RSS of the largest rank."""
import json, os, resource, sys, time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import w1_torch as w1  # the same model and initialization

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 4
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(w1.init_gpt2(w1.GPT()), bucket_cap_mb=25)
# tally train's defaults: weight decay 0.1 on the 2-D weights only, gradients clipped to norm 1.0.
decayed = [p for p in model.parameters() if p.dim() >= 2]
kept = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": kept, "weight_decay": 0.0}], lr=1e-4)
g = torch.Generator().manual_seed(1 + rank)
x = torch.randint(0, w1.V, (w1.B, w1.T), generator=g)
y = torch.randint(0, w1.V, (w1.B, w1.T), generator=g)
times = []
for s in range(steps + 2):
    dist.barrier()
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()  # DDP all-reduces gradient buckets during backward
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)  # PyTorch 2's default; tally discards its gradients too
    if s >= 2:
        times.append((time.perf_counter() - t0) * 1e3)
times.sort()
median = times[len(times) // 2]
rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
dist.all_reduce(rss, op=dist.ReduceOp.MAX)
if rank == 0:
    print(json.dumps({"system": f"pytorch {torch.__version__} DDP gloo", "ranks": world, "threads_per_rank": 1,
                      "ms_per_step": round(median, 1), "min_ms": round(times[0], 1),
                      "tokens_per_s": round(world * w1.B * w1.T / (median / 1e3)), "peak_rss_bytes": int(rss.item())}))
dist.destroy_process_group()
