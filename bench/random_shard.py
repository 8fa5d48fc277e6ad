#!/usr/bin/env python3
"""Writes an llm.c GPT-2 token shard of random tokens: the W2 benchmark's data on a machine
that has no corpus (the GPU machine). Step time does not depend on which tokens they are.
    random_shard.py OUT.bin NTOKENS [--vocab 50257] [--seed 1]"""
import argparse
import random
import struct

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("ntokens", type=int)
p.add_argument("--vocab", type=int, default=50257)
p.add_argument("--seed", type=int, default=1)
a = p.parse_args()
rng = random.Random(a.seed)
header = [20240520, 1, a.ntokens] + [0] * 253  # llm.c: magic, version, token count
with open(a.out, "wb") as f:
    f.write(struct.pack("<256i", *header))
    f.write(struct.pack(f"<{a.ntokens}H", *(rng.randrange(a.vocab) for _ in range(a.ntokens))))
