"""Profile one wmoe decode step: which kernels take the step's time (torch.profiler, CUDA time), and
where the host time of an uncaptured call goes (self CPU time per op).

python benchmarks/profile_decode.py [--batch 1] [--context 32768] [--layers 2] [--codec SPEC]
    [--graph [--trace-dir DIR]]

First it prints the step's GPU time by part (attention, MoE, dense GEMMs, KV compress, router
top-k, other), summed from the CUDA kernels by name (PARTS), with the largest kernels of "other"
named so nothing hides there; then the profiler's own tables.

--graph profiles replays of the step's CUDA graph instead (how it is timed and served) and adds
its timeline: per replay the span from the first kernel's start to the last one's end, the time
no kernel ran on any stream (the launch gaps a faster kernel chain could take back), and the
largest of those gaps with the kernels either side; then the same for replays back to back (the
gaps between steps included), beside their time from CUDA events.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from wmoe_compile.models import build_model

PROFILED_STEPS = 10

# (part, lower-case substrings of CUDA kernel names); the first part with a match takes the kernel
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "attention",
        ("split_kernel", "_exact_kernel", "_prologue_kernel", "_prologue_heads_kernel", "_reduce_kernel")
        + ("_reduce_rows_kernel", "_transform_heads_kernel", "_merge_channel_rows_kernel"),
    ),
    (
        "MoE",
        ("_gate_up_kernel", "_gate_up_direct_kernel", "_down_kernel", "_down_direct_kernel", "_align_kernel")
        + ("_block_histogram_kernel", "_block_scatter_kernel"),
    ),
    ("KV compress", ("_kv_compress_kernel",)),
    # cuBLAS's Hopper kernels as torch 2.11 (CUDA 13) names them: nvjet_sm90_tst_...
    ("dense GEMMs", ("gemm", "gemv", "splitkreduce", "cutlass", "xmma", "triton_tem", "nvjet")),
    ("router top-k", ("topk", "bitonicsort", "radix", "kth")),
)


def kernel_times(averages, device_type=None) -> dict[str, tuple[float, int]]:
    """{kernel name: (total us, calls)} of the profiler's averaged rows run on `device_type`
    (default: CUDA, i.e. the kernels themselves, not the ops that launched them)."""
    from torch.autograd import DeviceType

    wanted = DeviceType.CUDA if device_type is None else device_type
    return {
        row.key: (
            float(row.self_device_time_total if wanted != DeviceType.CPU else row.self_cpu_time_total),
            row.count,
        )
        for row in averages
        if row.device_type == wanted
    }


def part_of(kernel: str) -> str:
    name = kernel.lower()
    for part, patterns in PARTS:
        if any(p in name for p in patterns):
            return part
    return "other"


def breakdown(kernels: Mapping[str, tuple[float, int]], steps: int, top_other: int = 5) -> str:
    """A table of the step's GPU time by part: ms and launches per step, share of the total; then
    the largest kernels of "other"."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    parts = {part: [0.0, 0] for part, _ in PARTS} | {"other": [0.0, 0]}
    for name, (us, calls) in kernels.items():
        totals = parts[part_of(name)]
        totals[0] += us
        totals[1] += calls
    total_us = sum(us for us, _ in parts.values())
    if total_us <= 0:
        raise ValueError("the profile holds no kernel time to break down (no CUDA kernel rows)")
    lines = ["| part | ms per step | share | launches per step |", "|---|---|---|---|"]
    for part, (us, calls) in parts.items():
        lines.append(f"| {part} | {us / steps / 1e3:.3f} | {us / total_us:.1%} | {calls / steps:g} |")
    lines.append(
        f"| total | {total_us / steps / 1e3:.3f} | 100.0% | {sum(c for _, c in parts.values()) / steps:g} |"
    )
    other = sorted(
        ((us, name) for name, (us, _) in kernels.items() if part_of(name) == "other"), reverse=True
    )
    if other:
        lines.append("")
        lines.append(
            "largest in other: "
            + "; ".join(f"{name[:60]} {us / steps:.1f} us" for us, name in other[:top_other])
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class KernelSpan:
    """One kernel execution from a trace: start and end in microseconds, its stream."""

    name: str
    start_us: float
    end_us: float
    stream: int


def trace_kernels(trace: Mapping) -> list[KernelSpan]:
    """The CUDA kernels of a Chrome trace (torch.profiler's export_chrome_trace), by start time."""
    spans = [
        KernelSpan(
            e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]), int(e["args"].get("stream", -1))
        )
        for e in trace.get("traceEvents", [])
        if e.get("cat") == "kernel" and "dur" in e
    ]
    return sorted(spans, key=lambda k: k.start_us)


def split_replays(kernels: Sequence[KernelSpan], min_gap_us: float) -> list[list[KernelSpan]]:
    """Kernels grouped into replays: a new replay starts after min_gap_us with no kernel running
    (the profiled replays are separated by host syncs and sleeps far longer than any gap inside a
    step)."""
    replays: list[list[KernelSpan]] = []
    busy_until = float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.start_us - busy_until > min_gap_us or not replays:
            replays.append([])
        replays[-1].append(k)
        busy_until = max(busy_until, k.end_us)
    return replays


@dataclass(frozen=True)
class ReplayTimeline:
    span_us: float  # first kernel start to last kernel end
    busy_us: float  # union of every stream's kernel time
    kernel_us: float  # sum of kernel durations (more than busy_us where streams overlap)
    kernels: int
    gaps: tuple[tuple[float, str, str], ...]  # (idle us, kernel before, kernel after), largest first

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def replay_timeline(kernels: Sequence[KernelSpan]) -> ReplayTimeline:
    """Span, busy time and idle gaps of one replay: a gap is time in which no kernel runs on any
    stream; it is named by the kernel that ended last before it and the one that starts after."""
    if not kernels:
        raise ValueError("a replay needs at least one kernel")
    ordered = sorted(kernels, key=lambda k: k.start_us)
    if all(k.end_us <= k.start_us for k in ordered):
        raise ValueError(
            f"none of the {len(ordered)} kernels has a duration: the trace holds no timing (a trace "
            "exported after another profiler session started has its kernels at time 0)"
        )
    busy = 0.0
    gaps = []
    cur_start, cur_end, cur_last = ordered[0].start_us, ordered[0].end_us, ordered[0].name
    for k in ordered[1:]:
        if k.start_us > cur_end:
            busy += cur_end - cur_start
            gaps.append((k.start_us - cur_end, cur_last, k.name))
            cur_start, cur_end, cur_last = k.start_us, k.end_us, k.name
        elif k.end_us > cur_end:
            cur_end, cur_last = k.end_us, k.name
    busy += cur_end - cur_start
    return ReplayTimeline(
        span_us=max(k.end_us for k in ordered) - ordered[0].start_us,
        busy_us=busy,
        kernel_us=sum(k.end_us - k.start_us for k in ordered),
        kernels=len(ordered),
        gaps=tuple(sorted(gaps, reverse=True)),
    )


def timeline_report(replays: Sequence[ReplayTimeline], top_gaps: int = 12) -> str:
    """Medians over the replays, then the largest gaps of the median-span replay."""
    if not replays:
        raise ValueError("no replay to report (the trace held no kernels)")
    med = sorted(replays, key=lambda r: r.span_us)[len(replays) // 2]

    def median(attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in replays)

    lines = [
        f"replays: {len(replays)}; kernels per replay: {med.kernels}",
        f"span {median('span_us'):.1f} us, busy (any stream) {median('busy_us'):.1f} us, "
        f"idle {median('idle_us'):.1f} us in {len(med.gaps)} gaps, kernel time summed "
        f"{median('kernel_us'):.1f} us (medians over replays)",
        f"largest gaps of the median replay (span {med.span_us:.1f} us):",
    ]
    for gap, before, after in med.gaps[:top_gaps]:
        lines.append(f"  {gap:6.2f} us  {before[:50]}  ->  {after[:50]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--codec", default="default")
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--graph", action="store_true", help="profile CUDA-graph replays, add the timeline")
    parser.add_argument("--trace-dir", default="build/profile_decode", help="where --graph writes its trace")
    args = parser.parse_args()
    import wmoe_compile.ops  # noqa: F401
    from wmoe_compile.ops import attention as attention_op

    attention_op.set_value_checks(False)
    B, N = args.batch, args.context
    # seeded: the weights and tokens decide the routing, so how many experts the MoE reads (an
    # unseeded run's MoE part moved 1.03 -> 1.26 ms a step between two runs of the same code)
    torch.manual_seed(B * N)
    model = build_model(
        "mixtral-8x7b", num_layers=args.layers, max_seq_len=N, dtype=torch.bfloat16, device="cuda"
    )
    model.setup_cache(B, N)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, 1), device="cuda")
    positions = torch.tensor([N - 1], device="cuda")
    with torch.no_grad():
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from bench_decode import back_to_back_ms, random_channel_params

        gen = torch.Generator("cuda").manual_seed(0)
        options = {"codec": args.codec, "channel_params": random_channel_params(model, gen)}
        compiled = torch.compile(model, backend="wmoe", options=options)
        for _ in range(5):
            compiled(tokens, positions)
        torch.cuda.synchronize()
        if args.graph:  # as bench_decode.graph_times captures it: warmed on a side stream first
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    compiled(tokens, positions)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                compiled(tokens, positions)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_STEPS):
                if args.graph:
                    graph.replay()
                    torch.cuda.synchronize()
                    time.sleep(0.002)  # replays apart in the trace (split_replays)
                else:
                    compiled(tokens, positions)
            torch.cuda.synchronize()
        if args.graph:
            # exported before the next profiler session starts (which clears this one's kernels)
            trace_dir = pathlib.Path(args.trace_dir)
            trace_dir.mkdir(parents=True, exist_ok=True)
            trace_path = trace_dir / f"graph_trace_B{B}_N{N}.json"
            prof.export_chrome_trace(str(trace_path))
            averages = prof.key_averages()
            # the same graph replayed back to back, as a decode loop runs it
            with profile(activities=[ProfilerActivity.CUDA]) as back_to_back:
                for _ in range(PROFILED_STEPS):
                    graph.replay()
                torch.cuda.synchronize()
            events_ms = back_to_back_ms(graph.replay, replays=20, repeats=1)
        t0 = time.perf_counter()
        for _ in range(20):
            compiled(tokens, positions)
        host_ms = (time.perf_counter() - t0) / 20 * 1e3  # enqueue time per call (no sync inside)
        torch.cuda.synchronize()
    if not args.graph:
        averages = prof.key_averages()
    try:
        print(breakdown(kernel_times(averages), steps=PROFILED_STEPS))
    except ValueError as exc:  # said, not a table of zeros
        print(f"no breakdown: {exc}")
    print()
    print(averages.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(f"host time to enqueue one uncaptured step: {host_ms:.3f} ms")
    if not args.graph:  # (a graph replay's host time is one launch: nothing to break down)
        print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    else:  # last, so a caller's `tail` keeps it
        print(f"\nCUDA-graph replay timeline ({trace_path}):")
        try:
            kernels = trace_kernels(json.loads(trace_path.read_text()))
            replays = [replay_timeline(r) for r in split_replays(kernels, min_gap_us=500.0)]
            print(timeline_report(replays))
        except ValueError as exc:
            print(f"no timeline: {exc}")
        # back to back: the gaps now include those between one replay's last kernel and the next
        # one's first
        b2b_path = trace_dir / f"graph_trace_back_to_back_B{B}_N{N}.json"
        back_to_back.export_chrome_trace(str(b2b_path))
        print(
            f"\n{PROFILED_STEPS} replays back to back ({b2b_path}); CUDA events around 20 replays: "
            f"{events_ms * 1e3:.1f} us per replay"
        )
        try:
            run = replay_timeline(trace_kernels(json.loads(b2b_path.read_text())))
            print(
                f"{run.span_us / PROFILED_STEPS:.1f} us per replay from the first kernel's start to the "
                f"last one's end, idle {run.idle_us / PROFILED_STEPS:.1f} us per replay"
            )
            print(timeline_report([run], top_gaps=2 * PROFILED_STEPS).split("\n", 2)[2])
        except ValueError as exc:
            print(f"no timeline: {exc}")


if __name__ == "__main__":
    main()
