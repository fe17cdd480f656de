"""Host time of an uncaptured wmoe decode step, and where it goes (GPU machine).

    python benchmarks/profile_host.py [--batch 8] [--context 8192] [--steps 30]

Times 30 uncaptured steps of the reference model (2 layers, Mixtral-8x7B shapes) compiled with
backend="wmoe", with Triton's ordinary launches and with the kept compiled kernels
(kernels/fast_launch.py) in turn, and splits the host time per step into our op wrappers and
every Triton JIT launch (wall-clock timers around them; no profiler, whose own overhead would
swamp the figures). The attention op's value checks (a host sync per call) are off, as in serving.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch
import triton

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_decode import random_channel_params  # noqa: E402
from wmoe_compile.kernels import fast_launch  # noqa: E402

import wmoe_compile.ops  # noqa: E402,F401  registers the ops
from wmoe_compile.models import build_model  # noqa: E402
from wmoe_compile.ops import attention as attention_op  # noqa: E402
from wmoe_compile.ops import kv_codec as kv_op  # noqa: E402
from wmoe_compile.ops import moe as moe_op  # noqa: E402

SECONDS: collections.defaultdict = collections.defaultdict(float)
CALLS: collections.Counter = collections.Counter()


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SECONDS[name] += time.perf_counter() - start
            CALLS[name] += 1

    return wrapper


def _instrument() -> None:
    """Timers around the op wrappers (looked up at call time) and JITFunction.run."""
    attention_op._k.wavelet_attention_triton = _timed(
        "attention wrapper (Python + 3 launches)", attention_op._k.wavelet_attention_triton
    )
    attention_op._k.check_attention_inputs = _timed(
        "attention input checks", attention_op._k.check_attention_inputs
    )
    kv_op._k.compress_into_cache_triton = _timed("KV-compress wrapper", kv_op._k.compress_into_cache_triton)
    moe_op.tiled_moe_triton = _timed("MoE wrapper", moe_op.tiled_moe_triton)
    jit = triton.runtime.jit.JITFunction
    jit.run = _timed("Triton JIT launches (JITFunction.run)", jit.run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    _instrument()
    attention_op.set_value_checks(False)
    batch, context = args.batch, args.context
    model = build_model(
        "mixtral-8x7b", num_layers=2, max_seq_len=context, dtype=torch.bfloat16, device="cuda"
    )
    model.setup_cache(batch, context)
    tokens = torch.randint(0, model.cfg.vocab_size, (batch, 1), device="cuda")
    positions = torch.tensor([context - 1], device="cuda")
    options = {
        "codec": "default",
        "channel_params": random_channel_params(model, torch.Generator("cuda").manual_seed(0)),
    }
    with torch.no_grad():
        compiled = torch.compile(model, backend="wmoe", options=options)
        for enabled in (False, True, False, True):  # twice each: the spread between repeats
            fast_launch.ENABLED = enabled
            for _ in range(5):
                compiled(tokens, positions)
            torch.cuda.synchronize()
            SECONDS.clear()
            CALLS.clear()
            start = time.perf_counter()
            for _ in range(args.steps):
                compiled(tokens, positions)
            host_ms = (time.perf_counter() - start) / args.steps * 1e3
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) / args.steps * 1e3
            label = "kept compiled kernels" if enabled else "Triton's ordinary launches"
            print(f"{label}: host {host_ms:.3f} ms per step (wall incl. the GPU {wall_ms:.3f} ms)")
            for name, seconds in SECONDS.items():
                per_step = seconds / args.steps * 1e3
                per_call = seconds / CALLS[name] * 1e6
                calls = CALLS[name] // args.steps
                print(f"    {name}: {per_step:.3f} ms per step, {calls} calls, {per_call:.1f} us each")


if __name__ == "__main__":
    main()
