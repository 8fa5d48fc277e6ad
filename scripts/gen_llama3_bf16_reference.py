#!/usr/bin/python3
"""PyTorch CPU autocast (bfloat16) on the tiny LLaMA-3 fixture: the reference tally's
--dtype bf16 (mixed precision) is compared against for LLaMA, as gen_bf16_reference.py is
for GPT-2.

Reads tests/fixtures/llama3_tiny.bin (the weights, in llm.c's order) and the batch of
llama3_tiny_ref.safetensors (both written by gen_llama3_reference.py, whose model this
reuses) and writes
  tests/fixtures/llama3_tiny_bf16_ref.safetensors
    loss               step-0 loss under torch.autocast("cpu", dtype=torch.bfloat16)
    grad.<llm.c name>  step-0 gradients of the fp32 parameters under autocast
    losses             10 AdamW steps (run 1 of gen_llama3_reference.py) under autocast
Regenerate with
    /usr/bin/python3 scripts/gen_llama3_bf16_reference.py

Autocast runs every linear and matmul (the attention's too) with bf16 operands and bf16
outputs, so the SwiGLU's gate and up, q, k, v and the attention output are bf16; RMSNorm
and the residual stream stay fp32 (the norm's inputs are), the rotary embedding is
computed in fp32 and rounded back to bf16 (Meta's apply_rotary_emb), the loss is fp32.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_bf16_reference as bf16_ref  # noqa: E402
import gen_llama3_reference as g  # noqa: E402
import safetensors_io  # noqa: E402

OUT_PATH = os.path.join(g.FIX, "llama3_tiny_bf16_ref.safetensors")


def read_llmc(path):
    """The model of gen_llama3_reference.py with the weights of its llm.c file."""
    model = g.Llama()
    params = dict(model.named_parameters())
    data = np.fromfile(path, dtype="<f4", offset=1024)
    at = 0
    with torch.no_grad():
        for name, pat in g.LLMC_LAYOUT:
            for p in ([params[pat.format(l)] for l in range(g.L)] if "{}" in pat else [params[pat]]):
                n = p.numel()
                p.copy_(torch.from_numpy(data[at:at + n].copy()).view_as(p))
                at += n
    assert at == data.size, (at, data.size)
    return model


def main():
    ref, _ = safetensors_io.load(g.REF_PATH)
    x = torch.from_numpy(ref["x"].astype(np.int64))
    y = torch.from_numpy(ref["y"].astype(np.int64))
    model = read_llmc(g.BIN_PATH)
    with torch.no_grad():  # the weights read back are the fixture's: its fp32 loss again
        _, fp32_loss = model(x, y)
    assert abs(fp32_loss.item() - float(ref["loss"])) < 1e-6, (fp32_loss.item(), float(ref["loss"]))
    init_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bf16_ref.write_autocast_reference(g.Llama, init_state, x, y, g.RUN1, g.STEPS, g.llmc_tensors, ref, OUT_PATH,
                                      "scripts/gen_llama3_bf16_reference.py",
                                      "torch.optim.AdamW, run 1 of gen_llama3_reference.py (fp32 master weights)")


if __name__ == "__main__":
    main()
