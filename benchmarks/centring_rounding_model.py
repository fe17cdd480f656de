"""A CPU model of what LaunchConfig.token_sums_rows changes in the value sums' centring.

    python benchmarks/centring_rounding_model.py [--trials 5] [--tokens 5504]

The v3 split kernel sums uncentred value fields against p * scale rounded to fp16 (the value MMAs'
B operand), and the store takes each field's mid off with the split's sum of p * scale. The tuned
kernel sums the same rounded products (ones @ (p * scale)), so the mid cancels exactly; with
token_sums_rows the sum comes from the scales' rows times p, exact products, and the rounding of
p * scale leaves mid * sum(fp16(p * s) - p * s) in every slot of the band. This model draws one
split of random scores (at three spreads), fp16 p, scales in [0.5, 1.5) and random
codes, and prints each way's relative error of a band's 64 centred slot sums against fp64. It is a
model of the arithmetic, not the kernel: the GPU tests bound the op itself.
"""

from __future__ import annotations

import argparse

import torch


def slot_errors(tokens: int, bits: int, spread: float, generator: torch.Generator) -> tuple[float, float]:
    """(rounded sums' error, exact sums' error) of one split's centred slot sums, relative."""
    scores = torch.randn(tokens, dtype=torch.float64, generator=generator) * spread
    p = torch.exp(scores - scores.max()).half().double()  # p as the value MMAs see it
    scale = (torch.rand(tokens, dtype=torch.float64, generator=generator) * 0.5 + 0.5).half().double()
    mid = (2**bits - 1) / 2
    fields = torch.randint(0, 2**bits, (tokens, 64), generator=generator).double()
    rounded = (p * scale).half().double()  # the B operand p * scale in fp16
    exact = ((p * scale)[:, None] * (fields - mid)).sum(0)
    uncentred = (rounded[:, None] * fields).sum(0)
    tuned = uncentred - mid * rounded.sum()  # ones @ (p * scale): the rounded products
    rows = uncentred - mid * (p * scale).sum()  # scale rows @ p: exact products

    def err(x: torch.Tensor) -> float:
        return float((x - exact).norm() / exact.norm())

    return err(tuned), err(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--tokens", type=int, default=5504, help="a split's tokens (the tuned 86 steps)")
    args = p.parse_args()
    generator = torch.Generator().manual_seed(0)
    print("| band | score spread | rounded sums (tuned) | exact sums (token_sums_rows) |")
    print("|---|---|---|---|")
    for bits in (4, 2):
        for spread in (1.0, 3.0, 9.0):
            errs = [slot_errors(args.tokens, bits, spread, generator) for _ in range(args.trials)]
            tuned = ", ".join(f"{e[0]:.1e}" for e in errs)
            rows = ", ".join(f"{e[1]:.1e}" for e in errs)
            print(f"| {bits}-bit | {spread:g} | {tuned} | {rows} |")


if __name__ == "__main__":
    main()
