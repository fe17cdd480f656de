"""KV codec compress kernel on the GPU: correctness at real shapes, cache bytes, timings.

Run on a CUDA machine:  python benchmarks/bench_kv_codec.py --out DIR
Prints a markdown table and writes kv_codec.json / kv_codec.md under --out.
On a machine without a GPU, `--compile-only` compiles every kernel variant for sm_90 offline
(`triton.compile` with GPUTarget("cuda", 90, 32)): the interpreter misses frontend errors.

Timed, all as CUDA-graph replays (launch overhead excluded, as in a captured decode loop; inputs
rotate through buffers past the 50 MB L2 where a call reads more than 1 MB):
  - wmoe::kv_compress_into_cache's Triton kernel (both grid families: the Lloyd `lloyd` preset
    and the affine `default`), and for the decode shape the same kernel forced onto its tile
    path (the old program layout: one program per 16-token block and b*h, 1 valid row of 16),
  - the floor: bytes moved (read x and the channel parameters, write codes + scales + exact
    copies) / 4.25 TB/s (measured device-to-device copy on the H200, docs/DESIGN.md),
  - peers in the same run: INT4 per token in plain PyTorch (absmax, fp16 scale, nibble packing,
    written to a cache by index_copy_), and the uncompressed bf16 cache write (index_copy_).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import torch

COPY_BW = 4.25e12  # bytes/s, measured D2D copy on the H200 (docs/DESIGN.md reference figures)
# (label, spec): the default (affine grids) and the Lloyd-grid preset, same bytes
SPECS = (("default", "default"), ("lloyd", "lloyd"))
CASES = (("decode", 8, 8, 1, 128, 32768), ("prefill", 1, 8, 2048, 128, 4096))
SMALL_CASES = (("decode", 1, 3, 1, 64, 8192), ("prefill", 1, 3, 2048, 64, 4096))


def _graph_time(fn, iters: int) -> float:
    """Seconds per call of fn replayed from a CUDA graph (fn captured `iters` times)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return sorted(times)[len(times) // 2]


def _int4_peer(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, pos: torch.Tensor) -> None:
    """INT4 per token in plain PyTorch: absmax / 7 in fp16, round, clamp, pack two per byte,
    index_copy_ into [B, Hkv, S, D/2] codes and [B, Hkv, S, 1] scales."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / 7.0).half()
    q = (xf / scale.float().clamp_min(1e-30)).round().clamp(-7, 7).to(torch.int16) + 8
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)
    codes.index_copy_(2, pos, packed)
    scales.index_copy_(2, pos, scale)


def _bench_case(case: tuple, rows: list[dict], checks: list[dict]) -> None:
    """Check and time one shape: every spec in SPECS, then the peers."""
    from wmoe_compile.kernels import kv_codec as K

    from wmoe_compile.codec import get_codec, pack_channel_params
    from wmoe_compile.ops import kv_codec as ops

    dev = "cuda"
    name, b, h, t, d, s = case
    rotation = torch.linalg.qr(torch.randn(h, d, d, dtype=torch.float64))[0].float()
    params = pack_channel_params(d, h, torch.rand(h, d) + 0.5, torch.randn(h, d), rotation).to(dev)
    x_bytes = b * h * t * d * 2
    n_rot = max(1, (64 << 20) // x_bytes) if x_bytes > (1 << 20) else 1
    xs = [torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16) * 2 for _ in range(n_rot)]
    pos = torch.arange(t, device=dev) + (s - t - 7)
    iters = 200 if t == 1 else 20
    shape = f"B={b} Hkv={h} T={t} D={d}"
    counter = iter(range(1 << 30))

    def next_x() -> torch.Tensor:
        return xs[next(counter) % len(xs)]

    timings: dict[str, float] = {}
    for label, spec in SPECS:
        codec = get_codec(spec, d)
        codes, scales, exact = ops.allocate_cache(spec, b, h, s, d, torch.bfloat16, dev)
        # correctness at this shape: the Triton cache write against the reference one
        ref_cache = ops.allocate_cache(spec, b, h, s, d, torch.bfloat16, dev)
        K.compress_into_cache_reference(codec, xs[0], *ref_cache, pos, params)
        K.compress_into_cache_triton(codec, xs[0], codes, scales, exact, pos, params)
        got_c, ref_c = codes[:, :, pos], ref_cache[0][:, :, pos]
        got_s, ref_s = scales[:, :, pos].float(), ref_cache[1][:, :, pos].float()
        same = float(((got_c == ref_c).all(-1) & (got_s == ref_s).all(-1)).float().mean())
        x_hat = K.decompress_reference(codec, got_c, scales[:, :, pos], params, torch.float32)
        x_ref = K.decompress_reference(codec, ref_c, ref_cache[1][:, :, pos], params, torch.float32)
        checks.append(
            {
                "what": f"{label} {name} {shape}",
                "identical_vectors": same,
                "decoded_rel_diff": float((x_hat - x_ref).norm() / x_ref.norm()),
                "exact_equal": bool(torch.equal(exact, ref_cache[2])),
            }
        )
        del ref_cache

        def triton_write(codec=codec, codes=codes, scales=scales, exact=exact) -> None:
            K.compress_into_cache_triton(codec, next_x(), codes, scales, exact, pos, params)

        timings[label] = _graph_time(triton_write, iters)
        if t == 1:  # the same kernel on its tile path (the old structure), for comparison
            saved, K.VEC_MAX_T = K.VEC_MAX_T, 0
            try:
                timings[f"{label}, tile path"] = _graph_time(triton_write, iters)
            finally:
                K.VEC_MAX_T = saved
    int4_codes = torch.zeros(b, h, s, d // 2, device=dev, dtype=torch.uint8)
    int4_scales = torch.zeros(b, h, s, 1, device=dev, dtype=torch.float16)
    dense = torch.zeros(b, h, s, d, device=dev, dtype=torch.bfloat16)
    timings["peer: INT4 per token, PyTorch"] = _graph_time(
        lambda: _int4_peer(next_x(), int4_codes, int4_scales, pos), iters
    )
    timings["peer: bf16 index_copy_"] = _graph_time(lambda: dense.index_copy_(2, pos, next_x()), iters)
    codec = get_codec(SPECS[0][1], d)
    moved = (
        b * h * t * (d * 2 + codec.bytes_per_vector)
        + min(t, codec.config.window) * b * h * d * 2
        + params.numel() * params.element_size()
    )
    floor = moved / COPY_BW
    for what, seconds in timings.items():
        rows.append(
            {
                "case": f"{name} {shape}",
                "what": what,
                "bytes_moved": moved,
                "floor_us": floor * 1e6,
                "us": seconds * 1e6,
                "x_floor": seconds / floor,
                "x_int4_peer": seconds / timings["peer: INT4 per token, PyTorch"],
            }
        )


def compile_variants(only: str | None = None) -> list[dict]:
    """Compile the kernel variants the ops launch (decode and prefill paths, every preset the
    tests use, fp32/fp16/bf16 inputs, with and without cache writes) for sm_90, on the CPU;
    `only`: just the variants whose spec starts with it."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from wmoe_compile.kernels import kv_codec as K

    from wmoe_compile.codec import get_codec, pack_channel_params

    variants = []
    for spec in ("default", "lloyd", "hq", "hq8", "lo", "seed", "wht"):
        for t in (1, 2048):
            variants.append((spec, t, 128, "bf16", True, "full"))
    variants += [
        ("default", 16, 128, "bf16", True, "full"),  # BLOCK_T = 16: the bench's forced tile path at T=1
        ("lloyd", 16, 128, "bf16", True, "full"),
        ("default", 1, 64, "fp32", False, "scale"),
        ("default", 40, 64, "fp16", True, "pair"),
        ("default;bands=1/2:4:uniform:mse-ub,1/2:2:lloyd:absmax-ub", 1, 64, "fp32", False, "none"),
        ("default;bands=1/2:4:uniform:mse-ub,1/2:2:lloyd:absmax-ub", 40, 64, "fp32", False, "none"),
        ("wavelet=db4;levels=2;bands=1/4:8:uniform:absmax,3/4:4:lloyd:mse", 1, 64, "bf16", True, "full"),
        ("wavelet=db4;levels=2;bands=1/4:8:uniform:absmax,3/4:4:lloyd:mse", 40, 64, "bf16", True, "full"),
        ("default", 1, 96, "bf16", True, "full"),
        ("default", 40, 96, "bf16", True, "full"),
    ]
    results = []
    for spec, t, d, dtype, cache, params in variants:
        if only is not None and not spec.startswith(only):
            continue
        codec = get_codec(spec, d)
        h = 2
        x = torch.empty(1, h, t, d)
        if params == "full":
            cs = pack_channel_params(d, h, torch.ones(h, d), torch.zeros(h, d), torch.eye(d).expand(h, d, d))
        elif params == "scale":
            cs = torch.ones(h, d)
        elif params == "pair":
            cs = torch.ones(2, h, d)
        else:
            cs = torch.empty(0)
        cfg = K.launch_config(codec, x, cs, cache, cache)
        fn = K._kv_compress_kernel
        cx = cfg["constexprs"]
        types = {n: "i32" for n in fn.arg_names}
        for n in ("cs_ptr", "off_ptr", "rot_ptr", "w_ptr", "grid_ptr", "mids_ptr", "frac_ptr"):
            types[n] = "*fp32"
        types.update(
            x_ptr="*" + dtype,
            codes_ptr="*u8",
            scales_ptr="*fp16",
            exact_ptr=("*" + dtype) if cache else "*u8",
            pos_ptr="*i64" if cache else "*u8",
        )
        sig = {n: ("constexpr" if n in cx else types[n]) for n in fn.arg_names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in cx.items()})
        start = time.time()
        kernel = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options={"num_warps": cfg["num_warps"]}
        )
        results.append(
            {
                "spec": spec,
                "path": "vector" if cx["VEC"] else "tile",
                "T": t,
                "D": d,
                "dtype": dtype,
                "cache_write": cache,
                "channel_params": params,
                "compile_s": round(time.time() - start, 1),
                "shared_bytes": kernel.metadata.shared,
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/out"))
    parser.add_argument("--small", action="store_true", help="also SmolLM2 shapes (Hkv=3, D=64)")
    parser.add_argument(
        "--compile-only", action="store_true", help="compile every variant for sm_90, then exit"
    )
    parser.add_argument("--compile-only-spec", default=None, help="with --compile-only: specs starting so")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.compile_only:
        results = compile_variants(args.compile_only_spec)
        (out_dir / "kv_codec_compile.json").write_text(json.dumps(results, indent=2))
        print(f"compiled {len(results)} variants for sm_90")
        return 0
    if not torch.cuda.is_available():
        print("bench_kv_codec: needs a CUDA GPU (or --compile-only)")
        return 2
    import triton

    import wmoe_compile.ops  # noqa: F401
    from wmoe_compile.codec import get_codec
    from wmoe_compile.ops import kv_codec as ops

    dev = "cuda"
    rows, checks = [], []

    # compressed cache allocation: the bytes the allocator sees
    codec128 = get_codec("default", 128)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    codes, scales, exact = ops.allocate_cache("default", 8, 8, 32768, 128, torch.bfloat16, dev)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() - before
    compressed = 8 * 8 * 32768 * codec128.bytes_per_vector
    exact_bytes = exact.numel() * exact.element_size()
    checks.append(
        {
            "what": "cache B=8 Hkv=8 S=32768 D=128",
            "allocated_bytes": allocated,
            "codes_scales_bytes": compressed,
            "exact_bytes": exact_bytes,
            "bf16_cache_bytes": 8 * 8 * 32768 * 128 * 2,
            "match": allocated == compressed + exact_bytes,
        }
    )
    del codes, scales, exact

    cases = CASES + (SMALL_CASES if args.small else ())
    for case in cases:
        _bench_case(case, rows, checks)
        torch.cuda.empty_cache()

    lines = [
        f"KV codec compress_into_cache: `default` ({codec128.bytes_per_vector} B per 128-d vector, "
        f"affine grids), `lloyd` (same bytes, Lloyd-Max grids); {torch.cuda.get_device_name()}, "
        f"torch {torch.__version__}, triton {triton.__version__}, {time.strftime('%Y-%m-%d')}; "
        "CUDA-graph replays",
        "",
        "| case | what | µs per call | floor µs | x floor | x INT4 peer |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['what']} | {r['us']:.2f} | {r['floor_us']:.2f} | {r['x_floor']:.1f} "
            f"| {r['x_int4_peer']:.2f} |"
        )
    lines += ["", "| check | result |", "|---|---|"]
    for c in checks:
        lines.append(f"| {c['what']} | {json.dumps({k: v for k, v in c.items() if k != 'what'})} |")
    table = "\n".join(lines)
    print(table)
    (out_dir / "kv_codec.md").write_text(table + "\n")
    (out_dir / "kv_codec.json").write_text(json.dumps({"rows": rows, "checks": checks}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
