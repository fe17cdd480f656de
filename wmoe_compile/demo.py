"""`wmoe-compile demo`: build the reference model, generate tokens, report speed.

Later capabilities (passes, compressed cache, tiled MoE) extend this report as they land.
"""

from __future__ import annotations

import argparse
import time

import torch

from .models import build_model


def run_demo(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(args.model, dtype=dtype, device=device)
    cfg = model.cfg
    prompt = torch.randint(
        0, cfg.vocab_size, (args.batch, 8), device=device, generator=torch.Generator(device).manual_seed(0)
    )
    model.generate(prompt, 2)  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = model.generate(prompt, args.new_tokens)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    n = tokens.numel()
    print(
        f"model {args.model}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts top-{cfg.experts_per_token}, {device} {dtype}"
    )
    print(
        f"generated {n} tokens ({args.batch} x {args.new_tokens}) in {seconds:.3f} s "
        f"= {n / seconds:.1f} tokens/s"
    )
    print("first sequence:", tokens[0].tolist())
    return 0
