"""Profile one wmoe decode step: which kernels take the step's time (torch.profiler, CUDA time), and
where the host time of an uncaptured call goes (self CPU time per op).

python benchmarks/profile_decode.py [--batch 1] [--context 32768] [--layers 2] [--codec SPEC]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from wmoe_compile.models import build_model


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
            for _ in range(10):
                compiled(tokens, positions)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            compiled(tokens, positions)
        host_ms = (time.perf_counter() - t0) / 20 * 1e3  # enqueue time per call (no sync inside)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    print(f"host time to enqueue one uncaptured step: {host_ms:.3f} ms")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))


if __name__ == "__main__":
    main()
