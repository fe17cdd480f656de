"""How the v3 split kernel's error grows with the split's length, centred against uncentred value sums.

    python benchmarks/probe_value_precision.py [--out DIR] [--splits 1,2,4,8,16,64]

The worst case of tests/test_wavelet_attention.py's long-split test: random codes (every bit
pattern a valid code), diffuse attention (a random query against random keys), one sequence of
32768 positions, 8 kv heads; the reference is the decompressed cache through attention in fp64.
For each split count, the relative error of the tuned config (value fields centred through every
step's accumulator inputs) and of the same with ``value_subnormals`` (fields summed uncentred as
fp16 subnormals, centred once at the store), the bound ignored so that every split count runs the
uncentred step. Why: the tensor cores' fp32 accumulation truncates, so uncentred sums lose
precision with the split's length, and ``value_subnormals_max_split_tokens`` has to sit where the
error is still well inside the issue's 1e-2 (GPU only). A third column: ``value_subnormals`` with
``token_sums_rows``, whose centring takes the exact sums of p * scale while the value sums take
p * scale rounded to fp16 (an offset common to a band's slots; benchmarks/centring_rounding_model.py
models it on the CPU: mostly 1-3x the per-slot error of the rounded sums).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib

import torch
from wmoe_compile.kernels import wavelet_attention as K

from wmoe_compile.codec import get_codec
from wmoe_compile.ops import attention as ops


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--splits", default="1,2,4,8,16,64")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_value_precision needs a CUDA GPU (the v3 kernel is GPU only)")
    torch.manual_seed(0)
    codec = get_codec("default", 128)
    layout = ops.compressed_layout(codec.spec, 128)
    n, hkv = args.tokens, 8
    shape = (1, hkv, n, layout.n_code_bytes)
    kc, vc = (torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda") for _ in range(2))
    ks, vs = ((torch.rand(1, hkv, n, 2, device="cuda") + 0.5).half() for _ in range(2))
    ke, ve = (torch.randn(1, hkv, layout.n_exact, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(1, 4 * hkv, 1, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    cs = torch.rand(hkv, 128, device="cuda") + 0.5
    inputs = (q, kc, ks, vc, vs, ke, ve, lens, cs, cs)
    want = K.wavelet_attention_reference(*inputs, layout, 128**-0.5).double()
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    variants = {
        "centred": dataclasses.replace(tuned, value_subnormals=False),
        "value_subnormals": dataclasses.replace(
            tuned, value_subnormals=True, value_subnormals_max_split_tokens=1 << 30
        ),
        "token_sums_rows": dataclasses.replace(
            tuned, value_subnormals=True, value_subnormals_max_split_tokens=1 << 30, token_sums_rows=True
        ),
    }
    rows = []
    print("| splits | split tokens | centred rel err | value_subnormals rel err | + token_sums_rows |")
    print("|---|---|---|---|---|")
    for splits in (int(s) for s in args.splits.split(",")):
        errs = {}
        for name, config in variants.items():
            got = K.wavelet_attention_triton(*inputs, layout, 128**-0.5, config=config, num_splits=splits)
            if not torch.isfinite(got).all():
                raise SystemExit(f"{name} at {splits} splits wrote a non-finite output")
            errs[name] = rel_err(got, want)
        tokens = -(-(n - layout.n_exact) // splits)
        rows.append({"splits": splits, "split_tokens": tokens, **errs})
        cells = " | ".join(f"{errs[name]:.2e}" for name in variants)
        print(f"| {splits} | {tokens} | {cells} |", flush=True)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "value_precision.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
