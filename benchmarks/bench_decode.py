"""End-to-end decode step on the GPU: eager bf16, torch.compile (Inductor), and backend="wmoe".

    python benchmarks/bench_decode.py [--layers 2] [--shapes 8x131072,32x32768] [--out DIR]

The reference model (wmoe_compile/models/mixtral.py) with Mixtral-8x7B layer shapes, random
weights, layers reduced to fit one GPU and the run's time. For each (B, N) the KV cache holds
N - 1 tokens of random history and one decode step (B tokens at position N - 1) is timed:

  eager-routed     eager bf16, experts run only on their routed tokens (HF-style loop)
  eager-dense      eager bf16, the model's static-shape masked loop (every expert, every token);
                   also replayed from a CUDA graph (its kernels' GPU time without eager's host
                   overhead: the "vs eager graph" column, a stricter baseline than eager as run)
  inductor         torch.compile default backend, dense dispatch (at B >= 8 nearly every expert is
                   hit anyway); at B = 1 also routed dispatch (graph breaks), and the best is kept
  wmoe             torch.compile(backend="wmoe"): compressed KV cache, fused wavelet attention,
                   tiled MoE

Eager variants are host-bound and their do_bench medians moved up to 2x between runs: each eager
figure is the median of three do_bench medians (all three in the JSON). Compiled variants are timed
two ways: calling the compiled module (launch overhead included) and replaying one CUDA graph of the
step (launch overhead removed); the table uses the faster of the two for every compiled variant
alike. Every CUDA graph is also replayed back to back, as a decode loop runs it (a second table):
do_bench flushes a 256 MB buffer before each timed call. The history is written straight into the
caches (a 131k token prefill would dominate the run): random dense K/V, and for wmoe the same K/V
compressed by the codec op, with the exact sinks and window filled as the cache-writing op would. So
the wmoe logits can be compared with the eager logits of the same step: that relative error is a
column. The wmoe step is broken down by timing its attention and MoE ops alone at the same shapes (x
layers); "rest" is the remainder (projections, norms, router, lm_head, KV writes).
A third table gives each shape's read floor: the bytes the wmoe step must read (the experts its
router picks, measured by hooks on an eager forward; every other weight; the compressed cache) at
the copy rate measured at the start of the run, and so the most any step could gain over the
baselines as measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import triton
import triton.testing

DEFAULT_SHAPES = "8x131072,32x32768,1x32768,8x32768"
EAGER_REPEATS = 3
# CompileConfig switches of passes that only change speed (the step computes the same function),
# so a run with one off times that pass.
PASS_SWITCHES = ("fuse_linears", "decompose_topk", "overlap_cache_writes")


def bench_ms(fn, rep_ms: int = 200) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


BACK_TO_BACK_REPLAYS = 20
BACK_TO_BACK_REPEATS = 7


def back_to_back_ms(
    replay, replays: int = BACK_TO_BACK_REPLAYS, repeats: int = BACK_TO_BACK_REPEATS
) -> float:
    """Median over `repeats` of the mean time per replay of `replays` back-to-back replays.

    How a decode loop runs the step: one step after another, nothing in between. do_bench (the
    table's main columns) instead zeroes a 256 MB buffer before every timed call, which could leave
    each call a dirty L2 to write back; on the H200 the two agreed within 0.3% (RESULTS.md)."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def graph_times(fn, back_to_back: bool = True) -> tuple[float | None, float | None]:
    """(do_bench median, back-to-back time) of replaying one CUDA graph of fn, in ms; the second is
    None unless asked for, both None if fn cannot be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench_ms(graph.replay), back_to_back_ms(graph.replay) if back_to_back else None
    except Exception as exc:  # noqa: BLE001 - report, don't abort the benchmark
        print(f"  (CUDA graph capture failed: {type(exc).__name__}: {str(exc)[:160]})", flush=True)
        return None, None


def graph_ms(fn) -> float | None:
    """Median time of replaying one CUDA graph of fn (do_bench); None if fn cannot be captured."""
    return graph_times(fn, back_to_back=False)[0]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for item in text.split(","):
        b, _, n = item.lower().partition("x")
        if not b.isdigit() or not n.isdigit():
            raise SystemExit(f"--shapes: expected BxN items like 8x131072, got {item!r}")
        shapes.append((int(b), int(n)))
    return shapes


def set_dispatch(model, dispatch: str) -> None:
    for layer in model.layers:
        layer.moe.dispatch = dispatch


def fill_compressed_history(model, compile_backend, spec_by_cache: dict, n_hist: int) -> int:
    """Compress the dense history [0, n_hist) into the caches the wmoe graph reads.

    Returns the bytes the compressed caches allocate (codes + scales + exact sinks/window)."""
    from wmoe_compile.codec import WaveletKVConfig

    total = 0
    for i, layer in enumerate(model.layers):
        for kind, dense in (("K", layer.attn.k_cache), ("V", layer.attn.v_cache)):
            parts = compile_backend.compressed_state(dense)
            if not parts:
                raise RuntimeError(f"layer {i} {kind}: the wmoe graph holds no compressed cache for it")
            spec = spec_by_cache[(i, kind)]
            cfg = WaveletKVConfig.from_spec(spec)
            codes, scales, exact = parts["codes"], parts["scales"], parts["exact"]
            B, Hkv, _, D = dense.shape
            chunk = max(1, (1 << 25) // (B * Hkv * D))
            for start in range(0, n_hist, chunk):
                stop = min(n_hist, start + chunk)
                c, s = torch.ops.wmoe.kv_compress(dense[:, :, start:stop], parts["channel_scale"], spec)
                codes[:, :, start:stop] = c
                scales[:, :, start:stop] = s
            sinks = min(cfg.sinks, n_hist)
            exact[:, :, :sinks] = dense[:, :, :sinks]
            if cfg.window:
                recent = torch.arange(max(0, n_hist - cfg.window), n_hist, device=dense.device)
                exact[:, :, cfg.sinks + recent % cfg.window] = dense[:, :, recent]
            total += sum(t.numel() * t.element_size() for t in (codes, scales, exact))
    return total


def router_choices(
    model, tokens: torch.Tensor, positions: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the experts its router picks for this step and their renormalised weights,
    ([tokens, k] ids, [tokens, k] weights in the model's dtype), Mixtral's routing applied to the
    router logits of an eager forward (hooks on the routers). The wmoe graph computes the same
    routing up to near-ties: its compressed attention moves the hidden states of later layers
    slightly."""
    choices: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module, inputs, logits):
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = probs.topk(model.cfg.experts_per_token, dim=-1)
        choices.append((ids, (weights / weights.sum(-1, keepdim=True)).to(inputs[0].dtype)))

    hooks = [layer.moe.gate.register_forward_hook(record) for layer in model.layers]
    try:
        model(tokens, positions)
    finally:
        for hook in hooks:
            hook.remove()
    return choices


def distinct_experts(routing: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """Per layer, how many distinct experts a routing (router_choices) sends tokens to."""
    return [int(ids.unique().numel()) for ids, _ in routing]


def experts_hit(model, tokens: torch.Tensor, positions: torch.Tensor) -> list[int]:
    """Distinct experts each layer's router picks for this step (see router_choices)."""
    return distinct_experts(router_choices(model, tokens, positions))


def step_read_bytes(model, batch: int, experts_hit_per_layer: list[int], kv_bytes: int) -> dict:
    """Bytes one decode step must read at least: every weight it multiplies by (the routed experts
    only), the embedding rows of its tokens, and the KV cache it attends over (kv_bytes). Activations
    are left out (B x hidden-sized, under 0.1% here)."""
    if len(experts_hit_per_layer) != len(model.layers):
        raise ValueError(
            f"experts_hit_per_layer has {len(experts_hit_per_layer)} entries for {len(model.layers)} layers"
        )
    expert_bytes = 0
    for layer, n_hit in zip(model.layers, experts_hit_per_layer, strict=True):
        one = sum(p.numel() * p.element_size() for p in layer.moe.experts[0].parameters())
        expert_bytes += n_hit * one
    embed = model.embed.weight
    embed_bytes = batch * embed.shape[1] * embed.element_size()
    expert_params = {id(p) for layer in model.layers for p in layer.moe.experts.parameters()}
    other_bytes = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if id(p) not in expert_params and p is not embed
    )
    return {
        "experts": expert_bytes,
        "other_weights": other_bytes + embed_bytes,
        "kv": kv_bytes,
        "total": expert_bytes + other_bytes + embed_bytes + kv_bytes,
    }


def copy_rate_tbps() -> float:
    """Device-to-device copy rate of this GPU now, TB/s counting read + write (2 GiB each way), the
    measure bench_attention prints beside its documented 4.25 TB/s."""
    src = torch.empty(1024**3, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * 2 * 1024**3 / ms / 1e9


def random_channel_params(model, gen: torch.Generator) -> dict:
    """Per layer, K and V channel parameters in the full form [Hkv, D + 2, D] (docs/CONTRACTS.md):
    a random orthonormal rotation, scales in [0.5, 1.5), offsets ~ N(0, 0.1)."""
    cfg = model.cfg
    hkv, d = cfg.num_kv_heads, cfg.head_dim

    def one() -> torch.Tensor:
        g = torch.randn(hkv, d, d, device="cuda", generator=gen, dtype=torch.float64)
        rotation = torch.linalg.qr(g)[0].float()
        scale = torch.rand(hkv, 1, d, device="cuda", generator=gen) + 0.5
        offset = torch.randn(hkv, 1, d, device="cuda", generator=gen) * 0.1
        return torch.cat([rotation, scale, offset], dim=1).contiguous()

    return {i: {"k": one(), "v": one()} for i in range(len(model.layers))}


def breakdown(model, compile_backend, spec: str, B: int, N: int, routing: list | None = None) -> dict:
    """Time each layer's wmoe attention and MoE op alone at the step's shapes, summed over the
    layers. routing: per layer (ids, weights) as router_choices gives them, so each layer's MoE
    reads as many experts as in the step (random routing when None)."""
    from wmoe_compile import pack_expert_weights

    cfg = model.cfg
    q = torch.randn(B, cfg.num_q_heads, 1, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((B,), N, device="cuda", dtype=torch.int64)
    hidden = torch.randn(B, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    out = {"wmoe_attention_ms": 0.0, "wmoe_moe_ms": 0.0}
    for index, layer in enumerate(model.layers):
        k = compile_backend.compressed_state(layer.attn.k_cache)
        v = compile_backend.compressed_state(layer.attn.v_cache)

        def attention(k=k, v=v):
            return torch.ops.wmoe.wavelet_attention(
                q,
                k["codes"],
                k["scales"],
                v["codes"],
                v["scales"],
                k["exact"],
                v["exact"],
                seq_lens,
                k["channel_scale"],
                v["channel_scale"],
                spec,
                cfg.head_dim**-0.5,
            )

        if routing is not None:
            topk_ids, topk_w = (t.reshape(B, -1) for t in routing[index])
        else:
            probs = torch.softmax(torch.randn(B, cfg.num_experts, device="cuda"), -1)
            topk_w, topk_ids = probs.topk(cfg.experts_per_token, -1)
            topk_w = (topk_w / topk_w.sum(-1, keepdim=True)).to(torch.bfloat16)
        packed = pack_expert_weights(list(layer.moe.experts))

        def moe(packed=packed, ids=topk_ids, weights=topk_w):
            return packed(hidden, ids, weights)

        for name, fn in (("attention", attention), ("moe", moe)):
            ms = graph_ms(fn)
            out[f"wmoe_{name}_ms"] += ms if ms is not None else bench_ms(fn)
    return out


def kv_capacity(codec_spec: str, budget_gb: float) -> dict:
    """Context tokens that fit in a KV budget, Mixtral-8x7B (32 layers), bf16 vs compressed."""
    from wmoe_compile.codec import WaveletKVCodec, WaveletKVConfig
    from wmoe_compile.models import get_config

    cfg = get_config("mixtral-8x7b")
    codec = WaveletKVCodec(WaveletKVConfig.from_spec(codec_spec), cfg.head_dim)
    per_token_bf16 = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    per_token_wmoe = 2 * cfg.num_layers * cfg.num_kv_heads * codec.bytes_per_vector
    exact_per_sequence = (
        2 * cfg.num_layers * cfg.num_kv_heads * (codec.config.window + codec.config.sinks) * cfg.head_dim * 2
    )
    budget = budget_gb * 1e9
    tokens_wmoe = int((budget - exact_per_sequence) // per_token_wmoe)
    return {
        "budget_GB": budget_gb,
        "bytes_per_vector": codec.bytes_per_vector,
        "bytes_per_token_bf16": per_token_bf16,
        "bytes_per_token_wmoe": per_token_wmoe,
        "exact_bytes_per_sequence": exact_per_sequence,
        "tokens_bf16": int(budget // per_token_bf16),
        "tokens_wmoe_one_sequence": tokens_wmoe,
        "ratio": tokens_wmoe / int(budget // per_token_bf16),
    }


def run_shape(args, B: int, N: int, row: dict) -> None:
    from wmoe_compile.lowering import compile_backend
    from wmoe_compile.models import build_model
    from wmoe_compile.ops import attention as attention_op

    attention_op.set_value_checks(False)  # its seq_lens check is a host sync per layer
    # seeded per shape: the random weights and history decide how close router scores come to
    # ties, and a flipped expert choice moves the logits error (measured 0.016-0.098 at (8, 131072)
    # across unseeded runs of the same code), so runs must draw the same model to compare
    torch.manual_seed(B * N)
    model = build_model(
        "mixtral-8x7b", num_layers=args.layers, max_seq_len=N, dtype=torch.bfloat16, device="cuda"
    )
    model.setup_cache(B, N)
    for layer in model.layers:
        layer.attn.k_cache[:, :, : N - 1].normal_()
        layer.attn.v_cache[:, :, : N - 1].normal_()
    gen = torch.Generator("cuda").manual_seed(B * N)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, 1), device="cuda", generator=gen)
    positions = torch.tensor([N - 1], device="cuda")
    # The step rewrites slot N - 1 each time; every variant computes the same function.

    def step(fn):
        return lambda: fn(tokens, positions)

    with torch.no_grad():
        for dispatch in ("routed", "dense") if "eager" not in args.skip else ():
            set_dispatch(model, dispatch)
            # eager is host-bound and its medians moved up to 2x between runs: the median of
            # EAGER_REPEATS medians, all kept in the JSON
            runs = [bench_ms(step(model)) for _ in range(EAGER_REPEATS)]
            row[f"eager-{dispatch}_ms"] = statistics.median(runs)
            row[f"eager-{dispatch}_runs_ms"] = runs
            listing = ", ".join(f"{r:.3f}" for r in runs)
            median = row[f"eager-{dispatch}_ms"]
            print(f"B={B} N={N} eager-{dispatch}: {median:.3f} ms ({listing})", flush=True)
        set_dispatch(model, "dense")
        if "eager" not in args.skip:
            # the eager kernels' own GPU time (the dense loop has static shapes, so it can be
            # captured): eager as users run it above is also host-bound, and its timing varied up
            # to 2x between runs
            row["eager-dense-graph_ms"], row["eager-dense-graph_b2b_ms"] = graph_times(step(model))
            print(
                f"B={B} N={N} eager-dense in a CUDA graph: {row['eager-dense-graph_ms']} ms, "
                f"back to back {row['eager-dense-graph_b2b_ms']} ms",
                flush=True,
            )
        reference_logits = model(tokens, positions).float()
        routing = router_choices(model, tokens, positions)
        row["experts_hit"] = distinct_experts(routing)

        if "inductor" not in args.skip:
            best = None
            for dispatch in ("dense", "routed") if B == 1 else ("dense",):
                torch._dynamo.reset()
                set_dispatch(model, dispatch)
                compiled = torch.compile(model)
                t0 = time.perf_counter()
                compiled(tokens, positions)
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - t0
                call = bench_ms(step(compiled))
                replay, replay_b2b = graph_times(step(compiled))
                row[f"inductor-{dispatch}"] = {
                    "call_ms": call,
                    "graph_ms": replay,
                    "graph_b2b_ms": replay_b2b,
                    "compile_s": compile_s,
                }
                ms = min(x for x in (call, replay) if x is not None)
                print(
                    f"B={B} N={N} inductor-{dispatch}: call {call:.3f} ms, graph {replay} ms, "
                    f"compile {compile_s:.0f} s",
                    flush=True,
                )
                best = ms if best is None else min(best, ms)
            row["inductor_ms"] = best
            set_dispatch(model, "dense")

        if "wmoe" not in args.skip:
            torch._dynamo.reset()
            # The step is a single decode token: too few vectors to calibrate the codec's channel
            # parameters on, so give each layer a full set (random rotation, scale, offset; timing
            # does not depend on their values, and the history below is compressed with them).
            compiled = torch.compile(
                model,
                backend="wmoe",
                options={
                    "codec": args.codec,
                    "channel_params": random_channel_params(model, gen),
                    "inductor_config": args.wmoe_inductor_config,
                    **{switch: False for switch in args.wmoe_off},
                },
            )
            t0 = time.perf_counter()
            compiled(tokens, positions)
            torch.cuda.synchronize()
            row["wmoe_compile_s"] = time.perf_counter() - t0
            report = compile_backend.compile_reports()[-1]
            row["wmoe_sites"] = report.counts()
            spec_by_cache = {
                (s.layer, "K" if s.detail.startswith("K") else "V"): s.nodes["codec"]
                for s in report.sites
                if s.kind == "kv_write" and s.status == "rewritten"
            }
            if len(spec_by_cache) != 2 * args.layers:
                raise RuntimeError(
                    f"wmoe rewrote {len(spec_by_cache)} of {2 * args.layers} KV writes:\n{report}"
                )
            row["compressed_cache_bytes"] = fill_compressed_history(
                model, compile_backend, spec_by_cache, N - 1
            )
            row["dense_cache_bytes"] = sum(
                c.numel() * c.element_size()
                for layer in model.layers
                for c in (layer.attn.k_cache, layer.attn.v_cache)
            )
            read = step_read_bytes(model, B, row["experts_hit"], row["compressed_cache_bytes"])
            row["wmoe_step_read_bytes"] = read
            row["wmoe_floor_ms"] = read["total"] / (row["copy_TBps"] * 1e12) * 1e3
            logits = compiled(tokens, positions).float()
            row["wmoe_logits_rel_err"] = ((logits - reference_logits).norm() / reference_logits.norm()).item()
            row["wmoe_top1_agreement"] = (
                (logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item()
            )
            call = bench_ms(step(compiled))
            replay, replay_b2b = graph_times(step(compiled))
            row["wmoe"] = {"call_ms": call, "graph_ms": replay, "graph_b2b_ms": replay_b2b}
            row["wmoe_ms"] = min(x for x in (call, replay) if x is not None)
            print(
                f"B={B} N={N} wmoe: call {call:.3f} ms, graph {replay} ms, "
                f"compile {row['wmoe_compile_s']:.0f} s, logits rel err {row['wmoe_logits_rel_err']:.3e}",
                flush=True,
            )
            spec = next(iter(spec_by_cache.values()))
            row.update(breakdown(model, compile_backend, spec, B, N, routing))
    del model
    torch._dynamo.reset()
    torch.cuda.empty_cache()


def render(env: dict, rows: list[dict], capacity: dict) -> str:
    def f(x, digits=3):
        return "-" if x is None else f"{x:.{digits}f}"

    lines = [
        f"Decode step, reference model with Mixtral-8x7B shapes, {env['layers']} layers, bf16, "
        f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, {env['date']}; codec `{env['codec']}`"
        + (f"; wmoe with {', '.join(env['wmoe_off'])} off" if env.get("wmoe_off") else "")
        + (f"; wmoe inductor_config {env['wmoe_inductor_config']}" if env.get("wmoe_inductor_config") else "")
        + ".",
        "",
        "| B | N | eager routed ms | eager dense ms | eager dense graph ms | inductor ms | wmoe ms "
        "| wmoe call ms (no graph) | vs best eager | vs eager graph | vs inductor "
        "| wmoe attn ms | wmoe MoE ms | wmoe rest ms | logits rel err vs eager | KV bytes dense / wmoe |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['B']} | {r['N']} | {r['error']} |")
            continue
        eager_runs = [r[k] for k in ("eager-routed_ms", "eager-dense_ms") if k in r]
        eager = min(eager_runs) if eager_runs else None
        w, ind = r.get("wmoe_ms"), r.get("inductor_ms")
        rest = None
        if w is not None and "wmoe_attention_ms" in r:
            rest = w - r["wmoe_attention_ms"] - r["wmoe_moe_ms"]
        kv = "-"
        if "compressed_cache_bytes" in r:
            kv = f"{r['dense_cache_bytes'] / 1e9:.2f} GB / {r['compressed_cache_bytes'] / 1e9:.2f} GB"
        eager_graph = r.get("eager-dense-graph_ms")
        call = r.get("wmoe", {}).get("call_ms")
        lines.append(
            f"| {r['B']} | {r['N']} | {f(r.get('eager-routed_ms'))} | {f(r.get('eager-dense_ms'))} | "
            f"{f(eager_graph)} | {f(ind)} | {f(w)} | {f(call)} | "
            f"{f(eager / w if w and eager else None, 2)}x | "
            f"{f(eager_graph / w if w and eager_graph else None, 2)}x | "
            f"{f(ind / w if w and ind else None, 2)}x | "
            f"{f(r.get('wmoe_attention_ms'))} | {f(r.get('wmoe_moe_ms'))} | {f(rest)} | "
            f"{f(r.get('wmoe_logits_rel_err'), 4)} | {kv} |"
        )
    lines += render_back_to_back(rows)
    lines += render_floor(rows)
    c = capacity
    lines += [
        "",
        f"KV capacity in {c['budget_GB']:.0f} GB, Mixtral-8x7B (32 layers, 8 kv heads, head_dim 128): bf16 "
        f"{c['tokens_bf16']:,} tokens ({c['bytes_per_token_bf16']:,} B/token); "
        f"wmoe {c['tokens_wmoe_one_sequence']:,} tokens ({c['bytes_per_token_wmoe']:,} B/token at "
        f"{c['bytes_per_vector']} B per vector, plus "
        f"{c['exact_bytes_per_sequence']:,} B of exact window and sinks per sequence): {c['ratio']:.2f}x.",
        "",
    ]
    return "\n".join(lines)


def render_back_to_back(rows: list[dict]) -> list[str]:
    """Every CUDA graph replayed back to back, as a decode loop runs it (back_to_back_ms), beside
    the same graph's do_bench time."""
    rows = [r for r in rows if (r.get("wmoe") or {}).get("graph_b2b_ms")]
    if not rows:
        return []

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    def ratio(base, w):
        return "-" if base is None or not w else f"{base / w:.2f}x"

    lines = [
        "",
        f"CUDA graphs replayed back to back ({BACK_TO_BACK_REPLAYS} replays, median of "
        f"{BACK_TO_BACK_REPEATS}; no cache flush between steps, as in a decode loop), beside the same "
        "graphs' do_bench medians (a 256 MB flush before each call):",
        "",
        "| B | N | eager graph ms | inductor graph ms | wmoe graph ms | vs eager graph "
        "| vs inductor | do_bench: eager graph / inductor graph / wmoe graph ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ind = r.get("inductor-dense") or {}
        eg, ig, wg = r.get("eager-dense-graph_b2b_ms"), ind.get("graph_b2b_ms"), r["wmoe"]["graph_b2b_ms"]
        flushed = (r.get("eager-dense-graph_ms"), ind.get("graph_ms"), r["wmoe"].get("graph_ms"))
        lines.append(
            f"| {r['B']} | {r['N']} | {f(eg)} | {f(ig)} | {f(wg)} | {ratio(eg, wg)} | {ratio(ig, wg)} | "
            f"{' / '.join(f(x) for x in flushed)} |"
        )
    return lines


def _per(ms: float | None, floor_ms: float, unit: str = "") -> str:
    return "-" if ms is None else f"{ms / floor_ms:.2f}{unit}"


def render_floor(rows: list[dict]) -> list[str]:
    """The step's read floor per shape and the most any variant could gain over the baselines as
    measured: a wmoe step cannot take less than its bytes at the copy rate."""
    rows = [r for r in rows if "wmoe_floor_ms" in r]
    if not rows:
        return []
    lines = [
        "",
        f"Step read floor: the bytes a wmoe step must read (routed experts' weights, every other weight, "
        f"the embedding rows, the compressed KV cache) at this run's copy rate, "
        f"{rows[0]['copy_TBps']:.2f} TB/s. 'most vs' = baseline ms / floor ms: no wmoe step can beat a "
        "baseline by more.",
        "",
        "| B | N | experts hit per layer | GB: experts / other weights / KV | floor ms | wmoe ms "
        "| wmoe x floor | most vs inductor | most vs eager graph |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        floor, read = r["wmoe_floor_ms"], r["wmoe_step_read_bytes"]
        gb = " / ".join(f"{read[k] / 1e9:.2f}" for k in ("experts", "other_weights", "kv"))
        w, ind, eg = r.get("wmoe_ms"), r.get("inductor_ms"), r.get("eager-dense-graph_ms")
        lines.append(
            f"| {r['B']} | {r['N']} | {', '.join(map(str, r['experts_hit']))} | {gb} | {floor:.3f} | "
            f"{'-' if w is None else f'{w:.3f}'} | {_per(w, floor)} | "
            f"{_per(ind, floor, 'x')} | {_per(eg, floor, 'x')} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of BxN")
    parser.add_argument("--codec", default="default", help="codec spec or preset")
    parser.add_argument("--budget-gb", type=float, default=80.0, help="KV budget for the capacity line")
    parser.add_argument("--skip", default="", help="comma list of variants to skip: eager, inductor, wmoe")
    parser.add_argument(
        "--wmoe-inductor-config",
        type=json.loads,
        default={},
        help='Inductor config patches (JSON) for the wmoe backend, e.g. {"max_autotune_gemm": true}',
    )
    parser.add_argument(
        "--wmoe-off",
        default="",
        help=f"comma list of wmoe pass switches to turn off (to time a pass): {', '.join(PASS_SWITCHES)}",
    )
    parser.add_argument("--no-fuse-linears", action="store_true", help="same as --wmoe-off fuse_linears")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    args = parser.parse_args(argv)
    args.skip = set(filter(None, args.skip.split(",")))
    if args.skip - {"eager", "inductor", "wmoe"}:
        parser.error(f"--skip takes eager, inductor, wmoe; got {sorted(args.skip)}")
    args.wmoe_off = set(filter(None, args.wmoe_off.split(","))) | (
        {"fuse_linears"} if args.no_fuse_linears else set()
    )
    if args.wmoe_off - set(PASS_SWITCHES):
        parser.error(f"--wmoe-off takes {', '.join(PASS_SWITCHES)}; got {sorted(args.wmoe_off)}")
    if not isinstance(args.wmoe_inductor_config, dict):
        parser.error("--wmoe-inductor-config must be a JSON object")
    shapes = parse_shapes(args.shapes)
    capacity = kv_capacity(args.codec, args.budget_gb)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    import wmoe_compile.ops  # noqa: F401  (registers the wmoe ops)

    if "wmoe" not in torch._dynamo.list_backends(exclude_tags=()):
        # Not pip-installed (no entry point): register the backend by hand.
        from wmoe_compile.lowering.compile_backend import wmoe_backend

        torch._dynamo.register_backend(wmoe_backend, name="wmoe")

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "codec": args.codec,
        "wmoe_off": sorted(args.wmoe_off),
        "wmoe_inductor_config": args.wmoe_inductor_config,
    }
    env["copy_TBps"] = copy_rate_tbps()
    torch.cuda.empty_cache()  # the copy's 4 GiB back before the models
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    for B, N in shapes:
        row: dict = {"B": B, "N": N, "copy_TBps": env["copy_TBps"]}
        rows.append(row)
        try:
            run_shape(args, B, N, row)
        except torch.cuda.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc)[:120]}"
            print(f"B={B} N={N}: {row['error']}", flush=True)
            torch.cuda.empty_cache()
        with open(os.path.join(args.out, "bench_decode.json"), "w") as fh:
            json.dump({"env": env, "rows": rows, "capacity": capacity}, fh, indent=1, default=str)
    table = render(env, rows, capacity)
    with open(os.path.join(args.out, "bench_decode.md"), "w") as fh:
        fh.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
