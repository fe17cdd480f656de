"""Profile one wmoe decode step: which kernels take the step's time (torch.profiler, CUDA time), and
where the host time of an uncaptured call goes (self CPU time per op).

python benchmarks/profile_decode.py [--batch 1] [--context 32768] [--layers 2] [--codec SPEC]

First it prints the step's GPU time by part (attention, MoE, dense GEMMs, KV compress, router
top-k, other), summed from the CUDA kernels by name (PARTS), with the largest kernels of "other"
named so nothing hides there; then the profiler's own tables.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
from collections.abc import Mapping

import torch
from torch.profiler import ProfilerActivity, profile

from wmoe_compile.models import build_model

PROFILED_STEPS = 10

# (part, lower-case substrings of CUDA kernel names); the first part with a match takes the kernel
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "attention",
        ("split_kernel", "_exact_kernel", "_prologue_kernel", "_prologue_heads_kernel", "_reduce_kernel")
        + ("_reduce_rows_kernel", "_transform_heads_kernel"),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--codec", default="default")
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args()
    import wmoe_compile.ops  # noqa: F401
    from wmoe_compile.ops import attention as attention_op

    attention_op.set_value_checks(False)
    B, N = args.batch, args.context
    model = build_model(
        "mixtral-8x7b", num_layers=args.layers, max_seq_len=N, dtype=torch.bfloat16, device="cuda"
    )
    model.setup_cache(B, N)
    tokens = torch.randint(0, model.cfg.vocab_size, (B, 1), device="cuda")
    positions = torch.tensor([N - 1], device="cuda")
    with torch.no_grad():
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
        from bench_decode import random_channel_params

        gen = torch.Generator("cuda").manual_seed(0)
        options = {"codec": args.codec, "channel_params": random_channel_params(model, gen)}
        compiled = torch.compile(model, backend="wmoe", options=options)
        for _ in range(5):
            compiled(tokens, positions)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(PROFILED_STEPS):
                compiled(tokens, positions)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            compiled(tokens, positions)
        host_ms = (time.perf_counter() - t0) / 20 * 1e3  # enqueue time per call (no sync inside)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        print(breakdown(kernel_times(averages), steps=PROFILED_STEPS))
    except ValueError as exc:  # said, not a table of zeros
        print(f"no breakdown: {exc}")
    print()
    print(averages.table(sort_by="device_time_total", row_limit=args.rows, max_name_column_width=70))
    print(f"host time to enqueue one uncaptured step: {host_ms:.3f} ms")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
