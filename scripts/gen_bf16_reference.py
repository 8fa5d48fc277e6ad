#!/usr/bin/python3
"""PyTorch CPU autocast (bfloat16) on the tiny GPT-2 fixture: the reference tally's
--dtype bf16 (mixed precision) is compared against.

Reads tests/fixtures/gpt2_tiny.bin and the batch of gpt2_tiny_ref.safetensors (both written
by gen_gpt2_reference.py, whose model this reuses) and writes
  tests/fixtures/gpt2_tiny_bf16_ref.safetensors
    loss               step-0 loss under torch.autocast("cpu", dtype=torch.bfloat16)
    grad.<llm.c name>  step-0 gradients of the fp32 parameters under autocast
    losses             10 AdamW steps (run 1 of gen_gpt2_reference.py) under autocast
Regenerate with
    /usr/bin/python3 scripts/gen_bf16_reference.py

Autocast runs every linear and matmul (the attention's too) with bf16 operands and bf16
outputs; LayerNorm, softmax and the loss in fp32. tally rounds the same operands (its
attention's q, k, v, P, dS and dO too) but keeps fp32 outputs and accumulates its blocked
attention in fp32, so the two agree to bf16 rounding, not bit for bit:
the test states its tolerance per quantity.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_gpt2_reference as g  # noqa: E402
import safetensors_io  # noqa: E402

OUT_PATH = os.path.join(g.FIX, "gpt2_tiny_bf16_ref.safetensors")


def write_autocast_reference(make_model, init_state, x, y, run, steps, llmc_tensors, ref, out_path, generator,
                             optimizer_note):
    """The step-0 loss and gradients and `steps` AdamW steps (`run`'s settings) of the model
    make_model() builds, loaded with init_state, under CPU autocast; written to out_path
    beside the fp32 reference `ref` they are printed against. gen_llama3_bf16_reference.py
    calls it too."""
    model = make_model()
    model.load_state_dict(init_state)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(x, y)
    assert logits.dtype == torch.bfloat16, logits.dtype  # autocast did run the head in bf16
    loss.backward()
    grads = llmc_tensors(model, use_grad=True)

    model = make_model()
    model.load_state_dict(init_state)
    opt = torch.optim.AdamW(model.parameters(), lr=run["lr"], betas=run["betas"], eps=run["eps"],
                            weight_decay=run["weight_decay"])
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, step_loss = model(x, y)
        step_loss.backward()
        losses.append(step_loss.item())
        opt.step()

    tensors = {"loss": np.array(loss.item(), dtype=np.float32), "losses": np.array(losses, dtype=np.float32)}
    for name, gr in grads:
        tensors["grad." + name] = gr
    metadata = {
        "generator": generator, "torch_version": torch.__version__,
        "autocast": "torch.autocast('cpu', dtype=torch.bfloat16) around the forward",
        "losses.optimizer": optimizer_note,
    }
    safetensors_io.save(out_path, tensors, metadata)
    safetensors_io.roundtrip_check(out_path, tensors, metadata)
    print(f"{out_path}: {os.path.getsize(out_path)} bytes")
    print("loss: autocast", loss.item(), "fp32", float(ref["loss"]))
    print("losses autocast:", np.array(losses))
    print("losses fp32    :", ref["losses"])
    for name, gr in grads:
        r = ref["grad." + name]
        print(f"  grad.{name:9s} rel L2 vs fp32 {np.linalg.norm(gr - r) / max(np.linalg.norm(r), 1e-30):.2e}")


def main():
    ref, _ = safetensors_io.load(g.REF_PATH)
    x = torch.from_numpy(ref["x"].astype(np.int64))
    y = torch.from_numpy(ref["y"].astype(np.int64))
    init_state = {k: v.detach().clone() for k, v in g.read_llmc_checkpoint(g.BIN_PATH).state_dict().items()}
    write_autocast_reference(lambda: g.read_llmc_checkpoint(g.BIN_PATH), init_state, x, y, g.RUN1, g.STEPS,
                             g.llmc_tensors, ref, OUT_PATH, "scripts/gen_bf16_reference.py",
                             "torch.optim.AdamW, run 1 of gen_gpt2_reference.py (fp32 master weights)")


if __name__ == "__main__":
    main()
