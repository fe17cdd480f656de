"""Does straight-line code run slower than the same instructions in a loop, on a cold launch?

The v3 split kernel at one sequence is 1,024 one-warp programs that each run once through about
900 straight-line instructions (the query's transform), a 720-instruction loop 4 times, and an
epilogue. Its phase stamps (thirty-fourth session) put the transform at 3.1 us whether its
words come from L2 or, all heads reading one head's words, from L1, and whether or not its loads
wait for the sequence length's first: not the loads' round trips, it seems. The loop's first step
also takes 2.8 us where the later ones take 1.5-1.8. Both are code run for the first time. This
probe times code with no memory traffic: `N` unrolled rounds of 8 independent FMAs (8 N
instructions of straight-line code) against the same rounds as a loop of `U` unrolled rounds, on
a grid of one-warp programs (1,024 of them, 7-8 an SM as at one sequence, or one an SM). Each
program stamps %globaltimer before and after; each variant's kernel is launched cold (its first
launch after a flush of L2) and warm.

    python benchmarks/probe_instruction_fetch.py [--out DIR]
    python benchmarks/probe_instruction_fetch.py --sass --out DIR   # no GPU: each variant's FFMAs

If straight-line code takes far longer than its loop, instruction fetch bounds code run once, and
the cure is less straight-line code (loops over the transform's operands), not fewer loads. (At
7-8 programs an SM it did not: 1,024 FMAs took 1.28 us either way, 4,096 4.6-5.1 us straight and
4.35-4.6 as a loop, the issue rate's time. Alone on an SM, 4,096 straight-line FMAs took 5.1-5.4
us against the loop's 2.6: about 0.4 instructions a cycle fetched. The transform's words were the
cost after all: with constant operands in place of their loads it took 1.8 us instead of 3.1.
RESULTS.md, thirty-fourth session.)
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import triton
import triton.language as tl


@triton.jit
def _now(after):
    """%globaltimer (ns), read once `after` (a tensor) is computed."""
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer; // $1",
        "=l,r",
        [after.to(tl.int32, bitcast=True)],
        dtype=tl.int64,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _rounds(a0, a1, a2, a3, a4, a5, a6, a7, x, N: tl.constexpr):
    for _ in tl.static_range(N):  # 8 independent FMAs a round
        a0 = a0 * x + 1.0
        a1 = a1 * x + 2.0
        a2 = a2 * x + 3.0
        a3 = a3 * x + 4.0
        a4 = a4 * x + 5.0
        a5 = a5 * x + 6.0
        a6 = a6 * x + 7.0
        a7 = a7 * x + 8.0
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def fma_kernel(
    x_ptr,  # fp32 [32]: the multiplier (just below 1: the sums stay finite)
    out_ptr,  # fp32 [programs, 32]: the sums (kept live)
    clock_ptr,  # int64 [programs, 2]: start and end stamps of lane 0
    loops,  # runtime loop count (LOOPED)
    N: tl.constexpr,  # unrolled rounds: straight-line, or per loop iteration
    LOOPED: tl.constexpr,
):
    pid = tl.program_id(0)
    lane = tl.arange(0, 32)
    x = tl.load(x_ptr + lane)
    start = _now(x)
    a0 = x
    a1 = x + 1.0
    a2 = x + 2.0
    a3 = x + 3.0
    a4 = x + 4.0
    a5 = x + 5.0
    a6 = x + 6.0
    a7 = x + 7.0
    if LOOPED:
        for _ in range(loops):
            a0, a1, a2, a3, a4, a5, a6, a7 = _rounds(a0, a1, a2, a3, a4, a5, a6, a7, x, N)
    else:
        a0, a1, a2, a3, a4, a5, a6, a7 = _rounds(a0, a1, a2, a3, a4, a5, a6, a7, x, N)
    total = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    end = _now(total)
    tl.store(out_ptr + pid * 32 + lane, total)
    tl.store(clock_ptr + pid * 2 + lane * 0, start, mask=lane == 0)
    tl.store(clock_ptr + pid * 2 + 1 + lane * 0, end, mask=lane == 0)


def run(programs: int, rounds: int, unrolled: int, looped: bool, flush: torch.Tensor) -> dict:
    """Per-program durations (us) of `rounds` rounds of FMAs: straight-line (unrolled = rounds) or
    a loop of rounds / unrolled iterations. The kernel is compiled first, then launched cold (after
    an L2 flush; its code, new to this launch, comes from memory) and again warm."""
    x = torch.full((32,), 0.999, device="cuda")
    out = torch.empty(programs, 32, device="cuda")
    clocks = torch.zeros(programs, 2, dtype=torch.int64, device="cuda")
    args = dict(N=unrolled, LOOPED=looped, num_warps=1)
    loops = rounds // unrolled
    fma_kernel[(programs,)](x, out, clocks, loops, **args)  # compile
    torch.cuda.synchronize()
    result = {}
    for name in ("cold", "warm"):
        if name == "cold":
            flush.add_(1.0)  # evicts L2 (and so the kernel's code) of everything but this buffer
        torch.cuda.synchronize()
        fma_kernel[(programs,)](x, out, clocks, loops, **args)
        torch.cuda.synchronize()
        if not torch.isfinite(out).all():
            raise SystemExit("the FMA sums are not finite: the probe's multiplier is wrong")
        c = clocks.double()
        duration = (c[:, 1] - c[:, 0]) / 1e3
        finish = (c[:, 1] - c[:, 0].min()) / 1e3
        result[name] = {
            "median_us": round(duration.median().item(), 3),
            "max_us": round(duration.max().item(), 3),
            "last_end_us": round(finish.max().item(), 3),
        }
    return result


# (rounds, unrolled rounds, looped): 1,024 and 4,096 FMAs, straight-line or as a loop of 16 rounds
VARIANTS = ((128, 128, False), (128, 16, True), (512, 512, False), (512, 16, True))


def sass_counts(out: pathlib.Path) -> None:
    """Compile each variant for sm_90 (no GPU) and print its FFMAs and instructions: the straight
    variants must be 8 x rounds FMAs of straight-line code, the looped ones 8 x 16 in their loop."""
    from sass_attention_v3 import disassemble  # (beside this script)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = dict(x_ptr="*fp32", out_ptr="*fp32", clock_ptr="*i64", loops="i32")
    signature.update(N="constexpr", LOOPED="constexpr")
    for rounds, unrolled, looped in VARIANTS:
        constexprs = {(4,): unrolled, (5,): looped}
        source = ASTSource(fn=fma_kernel, signature=signature, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
        name = f"fma_{rounds}_{'loop' if looped else 'straight'}"
        _, sass = disassemble(kernel, out, name)
        instructions = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
        ffma = sum(" FFMA " in line for line in instructions)
        print(f"{name}: {ffma} FFMA, {len(instructions)} instructions", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument("--sass", action="store_true", help="compile each variant for sm_90 and count, no GPU")
    a = p.parse_args()
    if a.sass:
        sass_counts(pathlib.Path(a.out))
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flush = torch.zeros(64 << 20, device="cuda")  # 256 MB: several times L2
    rows = []
    for programs in (1024, sms):
        for rounds, unrolled, looped in VARIANTS:
            r = run(programs, rounds, unrolled, looped, flush)
            label = f"{8 * rounds} FMAs " + ("straight" if not looped else f"loop of {8 * unrolled}")
            rows.append(dict(programs=programs, variant=label, **r))
            print(
                f"{programs:5d} programs  {label:26s}  cold median {r['cold']['median_us']:7.2f} us "
                f"(max {r['cold']['max_us']:6.2f})  warm median {r['warm']['median_us']:7.2f} us "
                f"(max {r['warm']['max_us']:6.2f})",
                flush=True,
            )
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_instruction_fetch.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
