#!/usr/bin/python3
"""Generate tests/fixtures/ops.safetensors: float64 reference values for
tally's individual ops (forward output and autograd gradients).

For every case we store, under names "<case>.<tensor>":
  * the inputs,
  * a random upstream gradient  <case>.dout  (same shape as the output),
  * the output                  <case>.out,
  * for every floating input X  <case>.dX = d/dX sum(out * dout).
Integer index inputs (I64) get no gradient. Everything floating is F64 so the
C++ tests can compare with tight tolerances and use the fixture to check both
the double and (with looser tolerance) float code paths.

The fixture is committed so C++ tests never need torch. Regenerate with
    /usr/bin/python3 scripts/gen_op_fixtures.py
(run from anywhere; paths are relative to the repo root).
"""
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_PATH = os.path.join(REPO, "tests", "fixtures", "ops.safetensors")

torch.manual_seed(1234)
DT = torch.float64

tensors = {}   # name -> numpy array, insertion order = file order
metadata = {"generator": "scripts/gen_op_fixtures.py", "torch_seed": "1234",
            "grad_convention": "d<input> = grad of sum(out * dout)"}


def rnd(*shape):
    # tuple form so shape () (a scalar, e.g. dout of a full sum) works too
    return torch.randn(tuple(shape), dtype=DT)


def case(name, inputs, fn, out_names=("out",)):
    """Run fn(**inputs), draw a random dout per output, and record inputs,
    outputs, douts and input gradients. `fn` may return one tensor or a tuple
    (matched to out_names). Inputs are recorded before any gradient tracking,
    in the order given."""
    leaves = {}
    for k, v in inputs.items():
        tensors[f"{name}.{k}"] = v.numpy().copy()
        if v.is_floating_point():
            leaves[k] = v.clone().requires_grad_(True)
        else:
            leaves[k] = v
    outs = fn(**leaves)
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    assert len(outs) == len(out_names)
    # dout names mirror output names: out -> dout, out0 -> dout0, ...
    douts = [rnd(*o.shape) for o in outs]
    for o_name, o, d in zip(out_names, outs, douts):
        tensors[f"{name}.{o_name}"] = o.detach().contiguous().numpy().copy()
        tensors[f"{name}.d{o_name}"] = d.numpy().copy()
    grad_keys = [k for k, v in leaves.items() if v.is_floating_point()]
    if grad_keys:
        # autograd.grad with grad_outputs=dout is exactly grad of sum(out*dout).
        grads = torch.autograd.grad(outs, [leaves[k] for k in grad_keys], douts)
        for k, g in zip(grad_keys, grads):
            tensors[f"{name}.d{k}"] = g.numpy().copy()


# --- matmul family -----------------------------------------------------------
case("matmul", {"a": rnd(2, 3, 4, 5), "b": rnd(2, 3, 5, 6)}, lambda a, b: a @ b)
# b stored untransposed (6,5): exercises the "B transposed" GEMM path used by
# Linear layers, whose weights are (out, in).
case("matmul_bt", {"a": rnd(4, 5), "b": rnd(6, 5)}, lambda a, b: a @ b.T)
case("linear", {"x": rnd(2, 3, 8), "w": rnd(5, 8), "b": rnd(5)},
     lambda x, w, b: x @ w.T + b)

# --- broadcasting elementwise ------------------------------------------------
# Shapes chosen so broadcasting happens on different axes / ranks; gradients of
# the broadcast operand require a sum-reduction over the expanded axes.
case("add_bcast", {"a": rnd(2, 3, 4), "b": rnd(3, 1)}, lambda a, b: a + b)
case("sub_bcast", {"a": rnd(2, 3, 4), "b": rnd(4)}, lambda a, b: a - b)
# Both operands broadcast here: (2,1,4) * (3,1) -> (2,3,4).
case("mul_bcast", {"a": rnd(2, 1, 4), "b": rnd(3, 1)}, lambda a, b: a * b)
# Denominator kept in [0.5, 1.5) so the quotient and its gradient stay tame.
case("div_bcast", {"a": rnd(2, 3, 4), "b": 0.5 + torch.rand(1, 3, 4, dtype=DT)},
     lambda a, b: a / b)
SCALE = 2.5
metadata["scale.factor"] = str(SCALE)
case("scale", {"x": rnd(3, 4)}, lambda x: SCALE * x)

# --- reductions --------------------------------------------------------------
case("sum_dim", {"x": rnd(2, 3, 4)}, lambda x: x.sum(dim=1, keepdim=False))
case("sum_all", {"x": rnd(2, 3, 4)}, lambda x: x.sum())  # out shape []
case("mean_dim", {"x": rnd(2, 3, 4)}, lambda x: x.mean(dim=-1, keepdim=True))
# Distinct values guarantee a unique argmax per row, so the max gradient
# (routed to the argmax only) is unambiguous: a shuffled arange plus jitter
# smaller than the spacing.
xmax = (torch.randperm(24).to(DT) + 0.4 * torch.rand(24, dtype=DT) - 12.0) / 4.0
case("max_dim", {"x": xmax.reshape(2, 3, 4)}, lambda x: x.max(dim=2).values)

# --- embedding ---------------------------------------------------------------
idx = torch.randint(0, 10, (2, 5), dtype=torch.int64)
# Force repeated indices (within a row and across rows) so the backward has to
# accumulate several rows of dout into the same weight row.
idx[0, 3] = idx[0, 0]
idx[1, 2] = idx[0, 0]
idx[1, 4] = idx[1, 1]
case("embedding", {"weight": rnd(10, 6), "idx": idx}, lambda weight, idx: weight[idx])

# --- normalisation / activations --------------------------------------------
LN_EPS = 1e-5
metadata["layernorm.eps"] = str(LN_EPS)
# Non-trivial weight/bias so dw/db and the affine path are exercised.
case("layernorm", {"x": rnd(2, 3, 16), "w": 1.0 + 0.5 * rnd(16), "b": 0.5 * rnd(16)},
     lambda x, w, b: F.layer_norm(x, (16,), w, b, LN_EPS))
metadata["gelu.approximate"] = "tanh"
case("gelu", {"x": 2.0 * rnd(3, 7)}, lambda x: F.gelu(x, approximate="tanh"))
case("softmax", {"x": 2.0 * rnd(2, 3, 9)}, lambda x: torch.softmax(x, dim=-1))


# --- causal self-attention ---------------------------------------------------
def causal_attention(q, k, v):
    """GPT-2 style attention on (B,T,H,hd) tensors. k/v may have fewer heads
    (GQA): query head h reads kv head h // (H / Hkv)."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    group = H // Hkv
    qh = q.permute(0, 2, 1, 3)                                   # (B,H,T,hd)
    kh = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)   # (B,H,T,hd)
    vh = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    att = (qh @ kh.transpose(-2, -1)) / math.sqrt(hd)            # (B,H,T,T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()             # key <= query
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = att @ vh                                                  # (B,H,T,hd)
    return y.permute(0, 2, 1, 3).contiguous()                    # (B,T,H,hd)


metadata["attention.layout"] = "q,k,v,out are (B,T,H,hd); causal; scale 1/sqrt(hd)"
case("attention", {"q": rnd(2, 5, 3, 4), "k": rnd(2, 5, 3, 4), "v": rnd(2, 5, 3, 4)},
     causal_attention)
metadata["attention_gqa.kv_head"] = "query head h uses kv head h // (Hq/Hkv)"
case("attention_gqa", {"q": rnd(2, 5, 4, 4), "k": rnd(2, 5, 2, 4), "v": rnd(2, 5, 2, 4)},
     causal_attention)

# --- cross entropy over a padded vocabulary ---------------------------------
VALID_V = 9
targets = torch.randint(0, VALID_V, (6,), dtype=torch.int64)
# Large-ish values in the padded columns: a correct implementation must ignore
# them entirely (they would dominate the logsumexp otherwise).
logits = rnd(6, 11)
logits[:, VALID_V:] += 5.0


def padded_ce(logits, targets, valid_vocab):
    real = logits[:, :int(valid_vocab.item())]
    per_row = torch.logsumexp(real, dim=-1) - real.gather(1, targets[:, None])[:, 0]
    return per_row.mean()   # shape []


case("cross_entropy",
     {"logits": logits, "targets": targets,
      "valid_vocab": torch.tensor([VALID_V], dtype=torch.int64)},
     padded_ce)
assert np.all(tensors["cross_entropy.dlogits"][:, VALID_V:] == 0.0)

# --- shape ops ---------------------------------------------------------------
case("cat", {"a": rnd(2, 3), "b": rnd(2, 5)}, lambda a, b: torch.cat([a, b], dim=1))
SPLIT_SIZES = [2, 3, 4]
metadata["split.sizes"] = ",".join(map(str, SPLIT_SIZES))
metadata["split.dim"] = "1"
case("split", {"x": rnd(2, 9)},
     lambda x: tuple(t.contiguous() for t in torch.split(x, SPLIT_SIZES, dim=1)),
     out_names=("out0", "out1", "out2"))
metadata["slice.spec"] = "x[1:3, 2:5]"
case("slice", {"x": rnd(4, 6)}, lambda x: x[1:3, 2:5].contiguous())
gidx = torch.randint(0, 5, (3, 2), dtype=torch.int64)
gidx[1, 1] = gidx[1, 0]   # a repeated index within a row: backward must accumulate
metadata["gather.dim"] = "1"
case("gather", {"x": rnd(3, 5), "index": gidx},
     lambda x, index: torch.gather(x, 1, index))
metadata["permute.dims"] = "2,0,1"
case("permute", {"x": rnd(2, 3, 4)}, lambda x: x.permute(2, 0, 1).contiguous())

# --- LLaMA-3 ops (appended last so the cases above keep their random draws) ----
RMS_EPS = 1e-5
metadata["rmsnorm.eps"] = str(RMS_EPS)
# Meta's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight.
case("rmsnorm", {"x": rnd(2, 3, 16), "w": 1.0 + 0.5 * rnd(16)},
     lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w)
case("swiglu", {"gate": 2.0 * rnd(3, 7), "up": rnd(3, 7)}, lambda gate, up: F.silu(gate) * up)


def llama31_inv_freq(head_dim, theta, factor, low, high, original):
    """Meta's precompute_freqs_cis frequencies with LLaMA-3.1's apply_scaling."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=DT)[: head_dim // 2] / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out, dtype=DT)


def rotary(x, inv_freq, offset):
    """Meta's apply_rotary_emb: (x[2i], x[2i+1]) as a complex number times
    exp(i * pos * inv_freq[i]), positions offset..offset+T-1."""
    T = x.shape[1]
    pos = torch.arange(offset, offset + T, dtype=DT)
    angles = torch.outer(pos, inv_freq)                       # (T, D/2)
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(3)


# head_dim 16, theta 10000 and an original context of 64 put frequencies in all three
# bands of the 3.1 scaling (kept, divided by the factor, and smoothly interpolated).
ROPE = dict(head_dim=16, theta=10000.0, factor=8.0, low=1.0, high=4.0, original=64)
metadata["rotary.scaling"] = ",".join(f"{k}={v}" for k, v in ROPE.items())
INV_FREQ = llama31_inv_freq(**ROPE)
tensors["rotary.inv_freq"] = INV_FREQ.numpy().copy()
case("rotary", {"x": rnd(2, 5, 3, 16)}, lambda x: rotary(x, INV_FREQ, 0))
metadata["rotary_offset.offset"] = "7"
case("rotary_offset", {"x": rnd(1, 3, 2, 16)}, lambda x: rotary(x, INV_FREQ, 7))


def causal_attention_offset(q, k, v):
    """Attention of the last Tq of Tk positions (decoding with a KV cache): query t sits
    at position t + Tk - Tq and sees keys j <= that."""
    B, Tq, H, hd = q.shape
    Tk, group = k.shape[1], H // k.shape[2]
    qh = q.permute(0, 2, 1, 3)
    kh = k.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    vh = v.permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    att = (qh @ kh.transpose(-2, -1)) / math.sqrt(hd)            # (B,H,Tq,Tk)
    mask = torch.arange(Tk)[None, :] <= (torch.arange(Tq)[:, None] + Tk - Tq)
    att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return (att @ vh).permute(0, 2, 1, 3).contiguous()


case("attention_kv_offset", {"q": rnd(2, 2, 4, 4), "k": rnd(2, 5, 2, 4), "v": rnd(2, 5, 2, 4)},
     causal_attention_offset)

# --- write + verify ----------------------------------------------------------
for k, v in tensors.items():
    assert v.dtype in (np.float64, np.int64), (k, v.dtype)
os.makedirs(os.path.dirname(OUT_PATH), exist_ok=True)
safetensors_io.save(OUT_PATH, tensors, metadata)
safetensors_io.roundtrip_check(OUT_PATH, tensors, metadata)
size = os.path.getsize(OUT_PATH)
assert size < 300 * 1024, size
print(f"wrote {OUT_PATH}: {len(tensors)} tensors, {size} bytes")
for k, v in tensors.items():
    print(f"  {k:28s} {str(v.dtype):8s} {list(v.shape)}")
