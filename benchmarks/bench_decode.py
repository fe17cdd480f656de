"""End-to-end decode step on the GPU: eager bf16, torch.compile (Inductor), and backend="wmoe".

    python benchmarks/bench_decode.py [--layers 2] [--shapes 32x32768,8x131072] [--out DIR]

The reference model (wmoe_compile/models/mixtral.py) with Mixtral-8x7B shapes, random weights,
layers reduced to fit one GPU. For each (B, N) the KV cache holds N - 1 tokens of random history
and one decode step (B tokens at position N - 1) is timed:

  eager-routed    eager bf16, experts run only on their routed tokens (HF-style loop)
  eager-dense     eager bf16, the model's static-shape masked loop (every expert on every token)
  inductor        torch.compile default backend (best of dense and routed dispatch)
  wmoe            torch.compile(backend="wmoe"): compressed KV cache, fused wavelet attention,
                  tiled MoE

The history is written straight into the caches (random K/V; for wmoe compressed by the codec
op exactly as the cache-writing op would), since a 131k-token prefill would dominate the run.
The wmoe step is broken down by timing its attention and MoE ops alone at the same shapes,
layer count times; "rest" is the remainder. KV capacity: most tokens per GB of KV cache with bf16
and with the compressed cache, counted from the bytes the caches actually allocate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton.testing

from wmoe_compile.models import build_model

DEFAULT_SHAPES = "1x32768,8x32768,32x32768,8x131072"


def bench_ms(fn, rep_ms: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def fill_dense_history(model, n_hist: int) -> None:
    # Random history (never zeros): unit-variance K/V in every written slot.
    for layer in model.layers:
        for cache in (layer.attn.k_cache, layer.attn.v_cache):
            cache[:, :, :n_hist].normal_()


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        b, n = item.lower().split("x")
        shapes.append((int(b), int(n)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--codec", default="default", help="codec spec (WaveletKVConfig.from_spec)")
    parser.add_argument("--budget-gb", type=float, default=80.0, help="KV memory budget for the capacity row")
    parser.add_argument("--skip", default="", help="comma list of variants to skip")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))

    import wmoe_compile.ops  # noqa: F401
    from wmoe_compile.codec import WaveletKVCodec, WaveletKVConfig
    from wmoe_compile.lowering import compile_backend

    dev = "cuda"
    dtype = torch.bfloat16
    env = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "codec": args.codec,
    }
    print(json.dumps(env), flush=True)
    rows = []
    for B, N in parse_shapes(args.shapes):
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        row = {"B": B, "N": N}
        model = build_model("mixtral-8x7b", num_layers=args.layers, max_seq_len=N, dtype=dtype, device=dev)
        model.setup_cache(B, N)
        fill_dense_history(model, N - 1)
        tokens = torch.randint(0, model.cfg.vocab_size, (B, 1), device=dev)
        positions = torch.tensor([N - 1], device=dev)
        step = lambda fn: (lambda: fn(tokens, positions))  # noqa: E731
        try:
            for dispatch in ("routed", "dense"):
                name = f"eager-{dispatch}"
                if name in skip:
                    continue
                for layer in model.layers:
                    layer.moe.dispatch = dispatch
                with torch.no_grad():
                    row[f"{name}_ms"] = bench_ms(step(model))
                print(f"B={B} N={N} {name}: {row[f'{name}_ms']:.3f} ms", flush=True)
            if "inductor" not in skip:
                best = None
                for dispatch in ("dense", "routed"):
                    torch._dynamo.reset()
                    for layer in model.layers:
                        layer.moe.dispatch = dispatch
                    compiled = torch.compile(model)
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        compiled(tokens, positions)
                    torch.cuda.synchronize()
                    compile_s = time.perf_counter() - t0
                    with torch.no_grad():
                        ms = bench_ms(step(compiled))
                    row[f"inductor-{dispatch}_ms"] = ms
                    row[f"inductor-{dispatch}_compile_s"] = compile_s
                    print(f"B={B} N={N} inductor-{dispatch}: {ms:.3f} ms (compile {compile_s:.0f} s)", flush=True)
                    best = ms if best is None else min(best, ms)
                row["inductor_ms"] = best
            if "wmoe" not in skip:
                torch._dynamo.reset()
                for layer in model.layers:
                    layer.moe.dispatch = "dense"
                compiled = torch.compile(model, backend="wmoe", options={"codec": args.codec})
                t0 = time.perf_counter()
                with torch.no_grad():
                    compiled(tokens, positions)
                torch.cuda.synchronize()
                row["wmoe_compile_s"] = time.perf_counter() - t0
                codec = WaveletKVCodec(WaveletKVConfig.from_spec(args.codec), model.cfg.head_dim)
                compressed_bytes = fill_compressed_history(model, compile_backend, N - 1, codec)
                row["compressed_cache_bytes"] = compressed_bytes
                with torch.no_grad():
                    row["wmoe_ms"] = bench_ms(step(compiled))
                print(f"B={B} N={N} wmoe: {row['wmoe_ms']:.3f} ms", flush=True)
                row.update(breakdown(model, codec, B, N, args.codec, compile_backend))
        except torch.cuda.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc)[:120]}"
            print(f"B={B} N={N}: {row['error']}", flush=True)
        rows.append(row)
        del model
        with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)

    capacity = kv_capacity(args, dtype)
    table = render(env, rows, capacity)
    with open(os.path.join(args.out, "bench_decode.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump({"env": env, "rows": rows, "capacity": capacity}, f, indent=1)
    print(table)
    return 0


def fill_compressed_history(model, compile_backend, n_hist: int, codec) -> int:
    """Write n_hist random tokens of history into the compressed caches the wmoe graph reads.

    Returns the bytes the compressed caches (codes + scales + exact window/sinks) allocate."""
    total = 0
    for layer in model.layers:
        for dense in (layer.attn.k_cache, layer.attn.v_cache):
            parts = compile_backend.compressed_state(dense)
            codes, scales, exact = parts["codes"], parts["scales"], parts["exact"]
            B, Hkv, S, _ = codes.shape
            D = exact.shape[-1]
            chunk = max(1, (1 << 24) // (B * Hkv * D))
            for start in range(0, n_hist, chunk):
                stop = min(n_hist, start + chunk)
                x = torch.randn(B, Hkv, stop - start, D, device=codes.device, dtype=exact.dtype)
                c, s = torch.ops.wmoe.kv_compress(x, parts["channel_scale"], codec.config.to_spec())
                codes[:, :, start:stop] = c
                scales[:, :, start:stop] = s
            exact.normal_()
            total += sum(t.numel() * t.element_size() for t in (codes, scales, exact))
    return total


def breakdown(model, codec, B: int, N: int, spec: str, compile_backend) -> dict:
    """Time the wmoe attention and MoE ops alone at the step's shapes (x layers)."""
    cfg = model.cfg
    dev = "cuda"
    out = {}
    layer = model.layers[0]
    k = compile_backend.compressed_state(layer.attn.k_cache)
    v = compile_backend.compressed_state(layer.attn.v_cache)
    q = torch.randn(B, cfg.num_q_heads, 1, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    seq_lens = torch.full((B,), N, device=dev, dtype=torch.int32)
    attn = lambda: torch.ops.wmoe.wavelet_attention(  # noqa: E731
        q, k["codes"], k["scales"], v["codes"], v["scales"], k["exact"], v["exact"], seq_lens,
        k["channel_scale"], v["channel_scale"], spec, cfg.head_dim**-0.5,
    )
    out["wmoe_attention_ms"] = bench_ms(attn) * cfg.num_layers
    from wmoe_compile import pack_expert_weights

    experts = layer.moe.experts
    packed = pack_expert_weights(
        w1=[e.w1.weight for e in experts], w3=[e.w3.weight for e in experts], w2=[e.w2.weight for e in experts]
    )
    hidden = torch.randn(B, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    logits = torch.randn(B, cfg.num_experts, device=dev)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(cfg.experts_per_token, -1)
    topk_w = (topk_w / topk_w.sum(-1, keepdim=True)).to(torch.bfloat16)
    out["wmoe_moe_ms"] = bench_ms(lambda: packed(hidden, topk_ids, topk_w)) * cfg.num_layers
    return out


def kv_capacity(args, dtype) -> dict:
    """Context tokens per GB of KV cache (per layer stack of this benchmark) for bf16 and wmoe."""
    from wmoe_compile.codec import WaveletKVCodec, WaveletKVConfig
    from wmoe_compile.models import get_config

    cfg = get_config("mixtral-8x7b", num_layers=32)
    codec = WaveletKVCodec(WaveletKVConfig.from_spec(args.codec), cfg.head_dim)
    per_token_bf16 = 2 * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8 * cfg.num_layers
    per_token_wmoe = 2 * cfg.num_kv_heads * codec.bytes_per_vector * cfg.num_layers
    # The exact window and sinks are a fixed cost per sequence, in the model dtype.
    exact_per_seq = 2 * cfg.num_kv_heads * (codec.config.window + codec.config.sinks) * cfg.head_dim * 2 * cfg.num_layers
    budget = args.budget_gb * 1e9
    return {
        "model": "Mixtral-8x7B, 32 layers",
        "budget_GB": args.budget_gb,
        "bytes_per_token_bf16": per_token_bf16,
        "bytes_per_token_wmoe": per_token_wmoe,
        "bytes_per_vector": codec.bytes_per_vector,
        "exact_bytes_per_sequence": exact_per_seq,
        "tokens_bf16": int(budget // per_token_bf16),
        "tokens_wmoe_1_sequence": int((budget - exact_per_seq) // per_token_wmoe),
        "ratio": per_token_bf16 / per_token_wmoe,
    }


def render(env: dict, rows: list[dict], capacity: dict) -> str:
    lines = [
        f"Decode step, reference model with Mixtral-8x7B shapes, {env['layers']} layers, bf16; "
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; codec `{env['codec']}`",
        "",
        "| B | N | eager routed ms | eager dense ms | inductor ms | wmoe ms | vs eager | vs inductor "
        "| wmoe attn ms | wmoe MoE ms | wmoe rest ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    for r in rows:
        if "error" in r:
            lines.append(f"| {r['B']} | {r['N']} | {r['error']} |")
            continue
        eager = min(x for x in (r.get("eager-routed_ms"), r.get("eager-dense_ms")) if x is not None)
        w = r.get("wmoe_ms")
        rest = None
        if w is not None and "wmoe_attention_ms" in r:
            rest = w - r["wmoe_attention_ms"] - r["wmoe_moe_ms"]
        lines.append(
            f"| {r['B']} | {r['N']} | {f(r.get('eager-routed_ms'))} | {f(r.get('eager-dense_ms'))} | "
            f"{f(r.get('inductor_ms'))} | {f(w)} | {f(eager / w if w else None)}x | "
            f"{f(r['inductor_ms'] / w if w and r.get('inductor_ms') else None)}x | "
            f"{f(r.get('wmoe_attention_ms'))} | {f(r.get('wmoe_moe_ms'))} | {f(rest)} |"
        )
    c = capacity
    lines += [
        "",
        f"KV capacity in {c['budget_GB']:.0f} GB ({c['model']}): bf16 {c['tokens_bf16']:,} tokens "
        f"({c['bytes_per_token_bf16']:,} B/token); wmoe {c['tokens_wmoe_1_sequence']:,} tokens "
        f"({c['bytes_per_token_wmoe']:,} B/token, {c['bytes_per_vector']} B per vector, plus "
        f"{c['exact_bytes_per_sequence']:,} B exact window/sinks per sequence): {c['ratio']:.2f}x per GB.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
