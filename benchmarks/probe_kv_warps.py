"""GPU probe: is the warp-specialized step (benchmarks/spike_kv_warps.py) faster per token than v3?

    python benchmarks/probe_kv_warps.py [--tokens 2688] [--programs 780] [--value-regs 88] [--maxnreg 80]

A go / no-go answer before anyone builds the real kernel.

- What runs: the spike's `specialized_kernel` (4 key warps and 4 value warps per program, 4
  streams of `--tokens` compressed tokens each) on random codes and scales.
- The defaults match (8, 131072): 3,120 streams of 2,688 tokens, as v3's 64 kv heads x 49 splits.
- The baseline: the tuned op's `split_kernel_v3` at (8, 131072), timed in the same process
  (torch.profiler). The ratio of their rates is the answer.
- First it checks numbers. The spike runs one split of a real cache at (8, 2820): 42 full steps, no
  tail. Its running max, denominator and coefficient sums, mapped to v3's partial format with v3's
  slot plan, are compared with v3's own partial for that split. Both runs get the same query
  transform from v3's prologue.

A deadlock (the halves' mbarrier protocol is untested) shows as a run past --limit seconds. Run it
under `timeout`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
import spike_kv_warps as spike  # noqa: E402
import torch  # noqa: E402
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402


def launch(grid: int, qw, qc, kc, ks, vc, vs, m, acc, stride: int, first: int, n_tokens: int, a) -> None:
    spike.specialized_kernel[(grid,)](
        qw,
        qc,
        kc,
        ks,
        vc,
        vs,
        m,
        acc,
        stride,
        first,
        n_tokens,
        BLOCK_N=64,
        VALUE_REGS=a.value_regs,
        num_warps=4,
        maxnreg=a.maxnreg,
    )


def check_against_v3(a) -> bool:
    """The spike's partials of one split against v3's partial of the same split, same inputs."""
    batch, seq_len = 8, 132 + 64 * 42  # sinks + window + 42 full steps
    setup = ba.Setup(batch, seq_len, ba.HQ, ba.HKV, "cuda", smoke=True)
    setup.use_codec(ba.CODECS["default"])
    layout = setup.layout
    captured = {}
    original = wa._launch_v3

    def spy(*args, **kwargs):  # keep v3's query transform, slot plan and partials
        original(*args, **kwargs)
        captured["plan"], captured["parts"] = args[7], args[8]

    wa._launch_v3 = spy
    try:
        config = dataclasses.replace(wa.tuned_config(layout, ba.HEAD_DIM, 4), overlap_exact=False)
        wa.wavelet_attention_triton(*setup.args(0), layout, setup.sm_scale, config=config, num_splits=1)
    finally:
        wa._launch_v3 = original
    torch.cuda.synchronize()
    if "parts" not in captured:
        print("v3 did not run here (no Gluon?): nothing to compare with", flush=True)
        return False
    qw, qc, m_part, l_part, acc_part = captured["parts"]
    plan = captured["plan"]
    streams = batch * ba.HKV
    q, kc, ks, vc, vs = setup.copies[0][:5]
    qc_sum = qc.sum(1)  # [streams, 4 rows, 4 bands]: the prologue's chunk shares added up
    qc_spike = torch.zeros(streams, 16, device="cuda")
    qc_spike[:, 0:4] = qc_sum[:, :, 0]
    qc_spike[:, 8:12] = qc_sum[:, :, 1]
    m = torch.full((streams, 8), float("nan"), device="cuda")
    acc = torch.full((streams, 11, 16, 8), float("nan"), device="cuda")
    n_tokens = seq_len - layout.sinks - layout.window
    kc16, vc16 = kc.view(torch.int16), vc.view(torch.int16)
    launch(streams // 4, qw, qc_spike, kc16, ks, vc16, vs, m, acc, seq_len, layout.sinks, n_tokens, a)
    torch.cuda.synchronize()
    # v3's partial format: coefficient sums (acc + shift x sum(p x scale)) x step, in coefficient
    # order (its _store_operand); the denominator is any row of ones @ p
    shift = plan.v_shift.view(8, 16)[None, :, :, None]
    step = plan.v_step.view(8, 16)[None, :, :, None]
    sums = torch.stack([acc[:, 9]] * 4 + [acc[:, 10]] * 4, dim=1)  # [streams, 8 operands, 16, 8]
    values = ((acc[:, :8] + shift * sums) * step).reshape(streams, 128, 8)
    got = torch.zeros(streams, 8, 128, device="cuda")
    ok = plan.slot_coef >= 0
    got[:, :, plan.slot_coef[ok].long()] = values[:, ok].transpose(1, 2)
    want_acc, want_m, want_l = acc_part[:, 0], m_part[:, 0], l_part[:, 0]
    m_diff = (m[:, :4] - want_m).abs().max().item()
    l_err = ((acc[:, 8].amax(dim=1)[:, :4] - want_l).norm() / want_l.norm()).item()
    acc_err = ((got[:, :4] - want_acc).norm() / want_acc.norm()).item()
    good = m_diff <= 1e-3 and l_err <= 1e-3 and acc_err <= 1e-3
    print(
        f"numbers against v3's partial ({streams} streams x {n_tokens} tokens): max |m diff| {m_diff:.2e}, "
        f"denominator rel err {l_err:.2e}, coefficient sums rel err {acc_err:.2e}: "
        f"{'agree' if good else 'DIFFER'}",
        flush=True,
    )
    return good


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2688, help="tokens per stream (a multiple of 64)")
    p.add_argument("--programs", type=int, default=780, help="programs of 4 streams")
    # 80: three programs per SM (at 84 registers only two fit: 0.645 of v3's rate against 0.785)
    p.add_argument("--value-regs", type=int, default=88)
    p.add_argument("--maxnreg", type=int, default=80)
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

    t0 = time.time()
    check_against_v3(a)
    print(f"check {time.time() - t0:.1f} s (compiles included)", flush=True)
    kc, ks, vc, vs = codes(), scales(), codes(), scales()
    qw = (torch.randn(streams, 4, 128, device=dev, generator=g) * 0.01).half()
    qc = torch.zeros(streams, 16, device=dev)
    m = torch.full((streams, 8), float("nan"), device=dev)
    acc = torch.full((streams, 11, 16, 8), float("nan"), device=dev)

    def run() -> None:
        launch(a.programs, qw, qc, kc, ks, vc, vs, m, acc, a.tokens, 0, a.tokens, a)

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
