"""`wmoe-compile demo`: the whole tool on the reference model, end to end, in under two minutes.

1. build the reference Mixtral-style model (random weights): `tiny` on the CPU, Mixtral-8x7B
   layer shapes with a few layers on a GPU;
2. greedy-generate with the eager model (the baseline);
3. torch.compile(model, backend="wmoe") with per-pass dumps, and generate again;
4. report what the passes rewrote, the KV bytes per vector and in total, tokens generated, speed
   of both, token agreement, and where the dumps are.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from .models import build_model


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_generate(model, prompt, new_tokens: int, step_fn, device: str) -> tuple[torch.Tensor, float]:
    _sync(device)
    start = time.perf_counter()
    tokens = model.generate(prompt, new_tokens, step_fn=step_fn)
    _sync(device)
    return tokens, time.perf_counter() - start


def _cache_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def run_demo(args: argparse.Namespace) -> int:
    from .codec import WaveletKVCodec, WaveletKVConfig
    from .lowering import compile_backend
    from .lowering.cuda_graphs import GraphedDecodeStep

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("wmoe-compile demo: --device cuda asked for, but no CUDA GPU is visible")
        return 2
    name = args.model or ("tiny" if device == "cpu" else "mixtral-8x7b")
    overrides = {}
    if name == "mixtral-8x7b":
        overrides = dict(num_layers=args.layers, max_seq_len=4096)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    codec_spec = args.codec or ("default;window=16;sinks=4" if name == "tiny" else "default")
    # Long enough that most of the cache lies outside the exact window and sinks, so attention
    # really reads compressed K/V (the tiny model's default codec keeps a 16-token window).
    prompt_len = 64 if name == "tiny" else 1024
    model = build_model(name, dtype=dtype, device=device, **overrides)
    cfg = model.cfg
    gen = torch.Generator(device).manual_seed(0)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, prompt_len), device=device, generator=gen)
    print(
        f"model {name}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} experts "
        f"top-{cfg.experts_per_token}, {cfg.num_q_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim}; "
        f"{device} {dtype}; codec {codec_spec!r}"
    )

    # One cache for every run below: a new cache (other capacity) would be a new graph to compile.
    model.setup_cache(args.batch, prompt_len + args.new_tokens)

    # 1. eager baseline (routed experts: the fair eager path)
    for layer in model.layers:
        layer.moe.dispatch = "routed"
    model.generate(prompt, 2)  # warm-up
    eager_tokens, eager_s = _timed_generate(model, prompt, args.new_tokens, None, device)
    for layer in model.layers:
        layer.moe.dispatch = "dense"  # the capturable form the passes rewrite

    # 2. compile with the wmoe backend; the first calls compile the prefill and decode graphs
    dump_dir = os.path.abspath(args.dump_dir)
    compiled = torch.compile(model, backend="wmoe", options={"codec": codec_spec, "dump_dir": dump_dir})
    start = time.perf_counter()
    model.generate(prompt, 2, step_fn=compiled)
    _sync(device)
    compile_s = time.perf_counter() - start
    wmoe_tokens, wmoe_s = _timed_generate(model, prompt, args.new_tokens, compiled, device)
    graphed_s = None
    if device == "cuda":
        # serving setup: each decode step replayed from one CUDA graph (the uncaptured step is
        # bound by the host's Python launch path at this size)
        graphed = GraphedDecodeStep(compiled)
        model.generate(prompt, 2, step_fn=graphed)  # captures the decode step
        graphed_tokens, graphed_s = _timed_generate(model, prompt, args.new_tokens, graphed, device)
        if not torch.equal(graphed_tokens, wmoe_tokens):
            print("warning: the CUDA-graph replay generated other tokens than the uncaptured calls")

    # 3. report
    reports = compile_backend.compile_reports()
    print(f"\ncompiled {len(reports)} graphs (prefill + decode) in {compile_s:.1f} s; the decode graph:")
    if reports:
        print(reports[-1])
    codec = WaveletKVCodec(WaveletKVConfig.from_spec(codec_spec), cfg.head_dim)
    dense_vector = cfg.head_dim * torch.finfo(dtype).bits // 8
    dense_total = compressed_total = 0
    for layer in model.layers:
        for cache in (layer.attn.k_cache, layer.attn.v_cache):
            dense_total += _cache_bytes([cache])
            compressed_total += _cache_bytes(compile_backend.compressed_state(cache).values())
    print(
        f"\nKV cache: {codec.bytes_per_vector} B per vector vs {dense_vector} B dense "
        f"({100 * (1 - codec.bytes_per_vector / dense_vector):.1f}% smaller per vector); "
        f"allocated {compressed_total / 1e6:.2f} MB compressed (codes, scales, exact sinks + window) "
        f"vs {dense_total / 1e6:.2f} MB dense for {model.cache_capacity} slots x {args.batch} sequences"
    )
    n = wmoe_tokens.numel()
    agree = (wmoe_tokens == eager_tokens).float().mean().item()
    speeds = f"eager {n / eager_s:.1f} tokens/s, wmoe {n / wmoe_s:.1f} tokens/s"
    if graphed_s is not None:
        speeds += f" (uncaptured), wmoe {n / graphed_s:.1f} tokens/s (decode replayed from a CUDA graph)"
    print(
        f"generated {n} tokens ({args.batch} x {args.new_tokens}): {speeds}; greedy tokens identical "
        f"to eager: {100 * agree:.0f}% (random weights: near-tied logits flip easily)"
    )
    if device == "cpu":
        print(
            "on the CPU the wmoe ops run their PyTorch reference code: speed is a GPU claim "
            "(benchmarks/RESULTS.md)"
        )
    print("first sequence (wmoe):", wmoe_tokens[0].tolist())
    print(f"per-pass dumps: {dump_dir} (open */index.html in a browser)")
    return 0
