"""Probe the attention split kernel on the GPU: one call pattern for a profiler, or a timing grid of
launch configs (CUDA-graph medians, the same method as bench_attention.py).

    python benchmarks/probe_attention.py once --config JSON [--shape B,N]      # for ncu
    python benchmarks/probe_attention.py grid --configs FILE.json --out DIR   # list of LaunchConfig dicts
    python benchmarks/probe_attention.py kernels --configs FILE.json           # per-kernel times
    python benchmarks/probe_attention.py timeline --configs FILE.json          # when each kernel runs
        [--carveouts _exact_kernel=44,...]   # with kernels' shared-memory carveouts set first
    python benchmarks/probe_attention.py phases --configs FILE.json --out DIR  # inside a program

grid: each config's ms at each shape, then (when the first config comes back) each config's
change against the first one measured in the same round (the i-th time a config appears is round
i): list the configs A, B, A, B, ... so that drift between rounds cancels.

timeline: a CUDA graph of back-to-back calls (the bench's method) replayed under torch.profiler;
per kernel of a call, the median start and end in us after the call's prologue starts (its split
kernel where no prologue runs), and the call's period (to the next call's start). It shows what
lies on the critical path besides the split kernel: the launch gaps, the exact-token kernel on its
side stream, the reduce.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
import torch  # noqa: E402
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402

UNIFORM = ba.CODECS["default"]  # affine grids


def _compile_worker(configs: list[dict], heads: tuple[int, int], head_dim: int, queue) -> None:
    try:
        setup = ba.Setup(1, 2048, *heads, "cuda", smoke=True, head_dim=head_dim)
        setup.use_codec(UNIFORM)
        for c in configs:
            for splits in (1, 3, 16):
                for rr in (0.0, 1e9):
                    cfg = wa.LaunchConfig(**{**c, "row_reduce_max_programs": rr})
                    try:
                        wa.wavelet_attention_triton(
                            *setup.args(0), setup.layout, setup.sm_scale, config=cfg, num_splits=splits
                        )
                    except Exception as exc:  # noqa: BLE001
                        print(f"compile failed {c}: {str(exc)[:200]}", flush=True)
        torch.cuda.synchronize()
    finally:
        queue.put(1)


def precompile(
    configs: list[dict], heads: tuple[int, int] = (ba.HQ, ba.HKV), head_dim: int = ba.HEAD_DIM
) -> None:
    t = time.time()
    workers = min(len(configs), 12)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_compile_worker, args=(configs[w::workers], heads, head_dim, queue))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        queue.get()
    for p in procs:
        p.join()
    print(f"precompiled {len(configs)} configs in {time.time() - t:.0f}s", flush=True)


def set_carveouts(spec: str) -> None:
    """Set the preferred shared-memory carveout (percent of the most shared memory) of the compiled
    kernels named in spec ("split_kernel_v3=44,_exact_kernel=44"), through the driver API
    (fast_launch.set_preferred_carveout): Triton sets none, so the driver picks one per kernel, and
    an SM may have to drain before it runs a kernel of another carveout (the question this probes)."""
    from wmoe_compile.kernels import fast_launch
    from wmoe_compile.kernels import wavelet_attention as attention
    from wmoe_compile.kernels import wavelet_attention_gluon as gluon_kernels

    for item in filter(None, spec.split(",")):
        name, percent = item.split("=")
        kernel = getattr(attention, name, None) or getattr(gluon_kernels, name)
        for compiled, _ in fast_launch.kernel_info(kernel).compiled.values():
            fast_launch.set_preferred_carveout(compiled, int(percent))
            print(f"  carveout {name} = {percent}%", flush=True)


def timeline(setup: ba.Setup, config: wa.LaunchConfig | None, calls: int = 12, carveouts: str = "") -> str:
    """Median start / end (us after the call's prologue, or split kernel, starts) of each kernel of
    a call, from a CUDA graph of `calls` back-to-back calls replayed under torch.profiler."""
    import statistics
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    fns = [lambda i=i: setup.call(i % len(setup.copies), config) for i in range(calls)]
    ba.warm_up(fns)
    if carveouts:
        set_carveouts(carveouts)
    graph = ba.capture(fns)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        trace = json.loads(pathlib.Path(tmp.name).read_text())
    kernels = sorted(
        (e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    # a call starts at its prologue, or where none runs (query_in_split) at its split kernel
    anchor = "prologue" if any("prologue" in e["name"] for e in kernels) else "split_kernel"
    starts = [e["ts"] for e in kernels if anchor in e["name"]]
    if len(starts) < 3:
        return f"  {len(kernels)} kernels, {len(starts)} calls ({anchor} kernels): no timeline"
    spans: dict[str, list[tuple[float, float]]] = {}
    streams: dict[str, int] = {}
    for i, t0 in enumerate(starts[1:-1], start=1):  # the first and last calls see the graph's edges
        for e in kernels:
            if t0 <= e["ts"] < starts[i + 1]:
                spans.setdefault(e["name"], []).append((e["ts"] - t0, e["ts"] + e["dur"] - t0))
                streams[e["name"]] = e.get("args", {}).get("stream", -1)
    period = statistics.median(b - a for a, b in zip(starts[1:-1], starts[2:], strict=False))
    lines = [f"  period {period:.1f} us ({anchor} to next {anchor})"]
    for name, s in sorted(spans.items(), key=lambda kv: statistics.median(x for x, _ in kv[1])):
        start = statistics.median(x for x, _ in s)
        end = statistics.median(y for _, y in s)
        where = f"stream {streams[name]:>3}  {start:8.1f} -> {end:8.1f} us"
        lines.append(f"  {name[:40]:40s} {where}  ({len(s)} calls)")
    return "\n".join(lines)


PHASE_NAMES = ("query", "step 0", "step 1", "step 2", "steps 3+", "masked steps", "epilogue")


def phases(setup: ba.Setup, config: wa.LaunchConfig, calls: int = 12) -> dict:
    """Where one call's split programs spend their time: the last call of a CUDA graph of
    `calls` back-to-back calls runs with config.phase_clocks (each v3 program stamps the
    globaltimer after the PDL wait, its query transform, each full step, its masked steps and its
    epilogue). Returns summarise_phases of the stamps, and the call's ms with and without them."""
    import dataclasses

    stamped = dataclasses.replace(config, phase_clocks=True)
    wa.phase_clock_buffer = torch.full((wa.PHASE_SLOTS << 17,), -1, dtype=torch.int64, device="cuda")
    fns = [lambda i=i: setup.call(i % len(setup.copies), stamped) for i in range(calls)]
    ba.warm_up(fns)
    graph = ba.capture(fns)
    wa.phase_clock_buffer.fill_(-1)
    graph.replay()
    torch.cuda.synchronize()
    rows = wa.phase_clock_buffer.view(-1, wa.PHASE_SLOTS).cpu()
    del graph
    result = summarise_phases(rows[rows[:, 0] >= 0])
    result.update(ms=ba.time_ours(setup, config, False), ms_stamped=ba.time_ours(setup, stamped, False))
    wa.phase_clock_buffer = None
    return result


def summarise_phases(rows: torch.Tensor) -> dict:
    """rows: int64 [programs, PHASE_SLOTS] stamps (ns; -1 where a program skipped a slot). Each
    phase's length in us (percentiles over the programs: from the last slot written before its
    own), each stamp against the launch's first wait, the programs per SM, the smallest nonzero gap
    between two of a program's stamps (the timer's resolution, or less), and the raw rows."""
    t = rows.double()
    first = t[:, 0].min()
    quantiles = torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64)

    def pct(x: torch.Tensor) -> dict:
        if x.numel() == 0:
            return {}
        values = (torch.quantile(x, quantiles) / 1e3).tolist()
        return dict(zip(("min", "p10", "p50", "p90", "max"), values, strict=True))

    lengths = {}
    for k, name in enumerate(PHASE_NAMES, start=1):
        end = t[:, k]
        start = t[:, :k].clone()
        start[start < 0] = float("-inf")
        start = start.max(dim=1).values
        ok = (end >= 0) & torch.isfinite(start)
        lengths[name] = pct(end[ok] - start[ok])
    names = ("wait done", *PHASE_NAMES)
    since = {name: pct(t[t[:, k] >= 0, k] - first) for k, name in enumerate(names)}
    per_sm = torch.bincount(rows[:, wa.PHASE_SM].clamp(min=0))
    times = t[:, : wa.PHASE_TIMES]
    gaps = (times[:, 1:] - times[:, :-1])[(times[:, 1:] >= 0) & (times[:, :-1] >= 0)]
    return dict(
        programs=int(rows.shape[0]),
        full_steps=sorted(set(rows[:, wa.PHASE_FULL_STEPS].tolist())),
        phase_us=lengths,
        since_first_wait_us=since,
        programs_per_sm=dict(
            min=int(per_sm[per_sm > 0].min()), max=int(per_sm.max()), sms=int((per_sm > 0).sum())
        ),
        smallest_stamp_step_ns=float(gaps[gaps > 0].min()) if (gaps > 0).any() else float("nan"),
        raw=rows.tolist(),
    )


def config_label(config: dict, base: dict) -> str:
    """What sets ``config`` apart from ``base`` ("base" when nothing does), to name a grid row."""
    changed = [f"{k}={v}" for k, v in config.items() if base.get(k, "default") != v]
    changed += [f"{k}=default" for k in base if k not in config]
    return ", ".join(changed) or "base"


def same_round_summary(rows: list[dict], shapes: list[tuple[int, ...]]) -> str:
    """A markdown table of each config's change against the grid's first config measured in the same
    round (the i-th time a config appears is round i): the median and the range of its per-round
    ratios, per shape. Ratios within a round cancel what drifts between rounds (this machine's
    clock is not pinned; one launch moved 8% between rounds of one call)."""
    import statistics

    base = rows[0]["config"]
    by_label: dict[str, list[list[float]]] = {}
    for row in rows:
        by_label.setdefault(config_label(row["config"], base), []).append(row["ms"])
    base_runs = by_label.pop("base")
    header = " | ".join("(" + ", ".join(map(str, shape)) + ")" for shape in shapes)
    lines = [f"| against base, same round | {header} |", "|---|" + "---|" * len(shapes)]
    for label, runs in by_label.items():
        cells = []
        for j in range(len(shapes)):
            ratios = [r[j] / b[j] - 1 for r, b in zip(runs, base_runs, strict=False)]
            if not ratios:
                cells.append("no round with base")
                continue
            low, mid, high = (100 * f(ratios) for f in (min, statistics.median, max))
            cells.append(f"{mid:+.1f}% ({low:+.1f} .. {high:+.1f}, {len(ratios)} rounds)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["once", "grid", "kernels", "timeline", "phases"])
    p.add_argument("--config", default="{}")
    p.add_argument("--configs", default="")
    p.add_argument("--shape", default="8,131072")
    p.add_argument("--shapes", default="8,131072;32,32768;1,32768")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--carveouts", default="", help="timeline: name=percent,... set before capture")
    p.add_argument("--heads", type=ba._heads, default=(ba.HQ, ba.HKV), help="query heads,kv heads (32,8)")
    p.add_argument(
        "--head-dim",
        type=int,
        choices=ba.HEAD_DIMS,
        default=ba.HEAD_DIM,
        help=f"grid only: head_dim ({ba.HEAD_DIM}; 64 / 256 time the Triton kernels' configs there)",
    )
    a = p.parse_args()
    if a.head_dim != ba.HEAD_DIM and a.mode != "grid":
        p.error(f"--head-dim is a grid option; {a.mode} runs head_dim {ba.HEAD_DIM}")
    hq, hkv = a.heads
    if a.mode == "once":
        b, n = map(int, a.shape.split(","))
        ba.ROTATE_BYTES = 1  # one copy
        s = ba.Setup(b, n, hq, hkv, "cuda", smoke=False)
        s.use_codec(UNIFORM)
        cfg = wa.LaunchConfig(**json.loads(a.config))
        for _ in range(3):
            s.call(0, cfg)
        torch.cuda.synchronize()
        print("ok", cfg, flush=True)
        return
    configs = json.loads(pathlib.Path(a.configs).read_text())
    parsed = [tuple(map(int, x.split(","))) for x in a.shapes.split(";")]
    if any(len(t) not in (2, 3, 4) for t in parsed) or (a.mode != "grid" and any(len(t) > 2 for t in parsed)):
        raise SystemExit(
            "--shapes takes B,N pairs (grid: also B,N,CAPACITY, a cache longer than N, and "
            f"B,N,CAPACITY,ROWS, caches allocated in rows of ROWS positions), got {a.shapes!r}"
        )
    shapes = [t[:2] for t in parsed]
    if a.mode == "kernels":  # torch.profiler: mean us per call of each kernel, per shape and config
        for b, n in shapes:
            s = ba.Setup(b, n, hq, hkv, "cuda", smoke=False)
            s.use_codec(UNIFORM)
            for c in configs:
                times = ba.kernel_breakdown(s, wa.LaunchConfig(**c))
                listing = ", ".join(f"{k.strip('_')[:24]} {v}" for k, v in times.items())
                print(f"({b}, {n}) {c}: {listing}", flush=True)
            s.free()
        return
    if a.mode == "phases":  # "auto": the package's config for the shape
        out = pathlib.Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        for b, n in shapes:
            s = ba.Setup(b, n, hq, hkv, "cuda", smoke=False)
            s.use_codec(UNIFORM)
            s.dense.clear()
            programs = b * hkv  # one row block of the GQA group's rows
            auto = wa.tuned_config(s.layout, ba.HEAD_DIM, wa._block_m(hq // hkv), programs)
            for i, c in enumerate(configs):
                cfg = auto if c == "auto" else wa.LaunchConfig(**c)
                result = phases(s, cfg)
                result.update(shape=[b, n], config=c)
                (out / f"phases_{b}x{n}_{i}.json").write_text(json.dumps(result))
                print(
                    f"({b}, {n}) {c}: {result['programs']} programs, full steps {result['full_steps']}, "
                    f"{result['ms']:.4f} ms ({result['ms_stamped']:.4f} stamped), per SM "
                    f"{result['programs_per_sm']}, timer step {result['smallest_stamp_step_ns']} ns",
                    flush=True,
                )
                for name, q in result["phase_us"].items():
                    print(f"  {name:14s} " + " ".join(f"{k} {v:6.2f}" for k, v in q.items()), flush=True)
                print("  since the first program's wait (us):", flush=True)
                for name, q in result["since_first_wait_us"].items():
                    print(f"  {name:14s} " + " ".join(f"{k} {v:6.2f}" for k, v in q.items()), flush=True)
            s.free()
        return
    if a.mode == "timeline":
        for b, n in shapes:
            s = ba.Setup(b, n, hq, hkv, "cuda", smoke=False)
            s.use_codec(UNIFORM)
            s.dense.clear()
            for c in configs:  # "auto": the package's choice for the shape
                print(f"({b}, {n}) {c}:", flush=True)
                print(
                    timeline(s, None if c == "auto" else wa.LaunchConfig(**c), carveouts=a.carveouts),
                    flush=True,
                )
            s.free()
        return
    precompile(configs, a.heads, a.head_dim)
    setups = []
    for b, n, *more in parsed:  # the caches' capacity, past the length; the positions of their rows
        capacity, rows = (more + [None, None])[:2]
        s = ba.Setup(
            b, n, hq, hkv, "cuda", smoke=False, capacity=capacity, row_positions=rows, head_dim=a.head_dim
        )
        s.use_codec(UNIFORM)
        s.dense.clear()
        setups.append(s)
    rows = []
    for c in configs:
        cfg = wa.LaunchConfig(**c)
        try:
            err = ba.rel_error(setups[0], cfg)
            # one timing discarded: right after the error check (its fp32 reference runs on the GPU)
            # the first shape timed ran about 9% slow at (8, 131072), whatever its cache layout
            # (thirty-first session); earlier grids' first shapes carry that bias
            ba.time_ours(setups[0], cfg, False)
            ms = [ba.time_ours(s, cfg, False) for s in setups]
        except Exception as exc:  # noqa: BLE001
            print(f"{c}: failed {str(exc)[:200]}", flush=True)
            continue
        floor = [s.bytes / ba.COPY_TBPS / 1e9 for s in setups]
        x_floor = [m / f for m, f in zip(ms, floor, strict=True)]
        rows.append(dict(config=c, ms=ms, x_floor=x_floor, err=err))
        times = " ".join(f"{m:.4f}" for m in ms)
        ratios = " ".join(f"{x:.2f}" for x in x_floor)
        print(f"[{config_label(c, configs[0])}]: {times}  x floor {ratios}  err {err:.1e}", flush=True)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    grid = dict(shapes=parsed, heads=[hq, hkv], head_dim=a.head_dim, rows=rows)
    (out / "probe_grid.json").write_text(json.dumps(grid, indent=1))
    if len(rows) > 1 and rows[0]["config"] == configs[0]:
        print(same_round_summary(rows, parsed), flush=True)


if __name__ == "__main__":
    main()
