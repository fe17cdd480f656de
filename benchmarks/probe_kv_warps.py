"""GPU probe: is the warp-specialized step (benchmarks/spike_kv_warps.py) faster per token than v3?

    python benchmarks/probe_kv_warps.py [--tokens 2688] [--programs 780] [--value-regs 96] [--maxnreg 84]

A go / no-go answer before anyone builds the real kernel.

- What runs: the spike's `specialized_kernel` (4 key warps and 4 value warps per program, 4
  streams of `--tokens` compressed tokens each) on random codes and scales.
- The defaults match (8, 131072): 3,120 streams of 2,688 tokens, as v3's 64 kv heads x 49 splits.
- The baseline: the tuned op's `split_kernel_v3` at (8, 131072), timed in the same process
  (torch.profiler). The ratio of their rates is the answer.
- What it does not check: numbers. The spike computes the v3 step's operations but has never been
  compared with it. It only has to finish, and write finite values, to be timed.

A deadlock (the halves' mbarrier protocol is untested) shows as a run past --limit seconds. Run it
under `timeout`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
import spike_kv_warps as spike  # noqa: E402
import torch  # noqa: E402
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2688, help="tokens per stream (a multiple of 64)")
    p.add_argument("--programs", type=int, default=780, help="programs of 4 streams")
    p.add_argument("--value-regs", type=int, default=96)
    p.add_argument("--maxnreg", type=int, default=84)
    a = p.parse_args()
    if a.tokens % 64:
        raise SystemExit(f"--tokens must be a multiple of 64 (the spike has no tail step), got {a.tokens}")
    dev = "cuda"
    streams = 4 * a.programs
    g = torch.Generator(dev).manual_seed(0)

    def codes() -> torch.Tensor:  # any bits are valid codes
        shape = (streams, a.tokens, 24)
        return torch.randint(-32768, 32767, shape, device=dev, dtype=torch.int16, generator=g)

    def scales() -> torch.Tensor:
        return (torch.rand(streams, a.tokens, 2, device=dev, generator=g) + 0.5).half()

    kc, ks, vc, vs = codes(), scales(), codes(), scales()
    qw = (torch.randn(4, 4, 128, device=dev, generator=g) * 0.01).half()
    qc = torch.zeros(4, 16, device=dev)
    m = torch.full((streams, 8), float("nan"), device=dev)
    acc = torch.full((streams, 11, 16, 8), float("nan"), device=dev)

    def run() -> None:
        spike.specialized_kernel[(a.programs,)](
            qw,
            qc,
            kc,
            ks,
            vc,
            vs,
            m,
            acc,
            a.tokens,
            a.tokens,
            BLOCK_N=64,
            VALUE_REGS=a.value_regs,
            num_warps=4,
            maxnreg=a.maxnreg,
        )

    t0 = time.time()
    run()
    torch.cuda.synchronize()
    print(f"first launch (compile + run) {time.time() - t0:.1f} s", flush=True)
    written = bool(torch.isfinite(m[:, :4]).all() and torch.isfinite(acc[:, :, :, :4]).all())
    print(f"every stream's max and sums written and finite: {written}", flush=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        run()
    start.record()
    for _ in range(20):
        run()
    end.record()
    torch.cuda.synchronize()
    spike_us = start.elapsed_time(end) / 20 * 1e3
    spike_rate = streams * a.tokens / spike_us

    setup = ba.Setup(8, 131072, ba.HQ, ba.HKV, dev, smoke=False)
    setup.use_codec(ba.CODECS["default"])
    setup.dense.clear()
    tuned = wa.tuned_config(setup.layout, ba.HEAD_DIM, 4)
    times = ba.kernel_breakdown(setup, tuned)
    v3_us = times["split_kernel_v3"]
    v3_rate = 8 * ba.HKV * (131072 - setup.layout.n_exact) / v3_us
    print(
        f"spike: {a.programs} programs x 4 streams x {a.tokens} tokens in {spike_us:.1f} us, "
        f"{spike_rate:.0f} token-streams/us\n"
        f"v3 split kernel at (8, 131072): {v3_us:.1f} us, {v3_rate:.0f} token-streams/us\n"
        f"spike / v3 rate: {spike_rate / v3_rate:.3f} (4x SDPA needs about 1.19)",
        flush=True,
    )


if __name__ == "__main__":
    main()
