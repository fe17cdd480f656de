"""Measured read floor of decode attention's compressed cache: how fast can the GPU read exactly the
bytes the split kernel reads, over the same launch grid, when nothing else happens?

The split kernel's "x floor" in bench_attention.py divides by a copy rate from the docs. This
script measures, in the same run as the tuned attention op, a pure read of the same codes and
scales (coalesced 16-byte loads, an XOR so the loads stay live) with one-warp programs on the
tuned launch's split grid, the same with four-warp programs, and four-warp programs over a quarter
of the splits (as many warps as the op). If the pure read is far faster than the op, the op's own
structure (latency, issue) is what is left to win; if it is close, only fewer bytes would help.

    python benchmarks/read_floor.py [--shapes "8,131072;32,32768"] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402


@triton.jit
def _read_split_kernel(
    k_words,  # int32 view of the key codes, [sequences x kv heads, tokens * ROW_WORDS]
    v_words,  # same for the values
    k_scale_words,  # int32 view of the key scales (one fp16 pair per token), [.., tokens]
    v_scale_words,
    out,  # int32 [programs]: the XOR of everything read (keeps the loads live)
    n_tokens,
    chunk,  # tokens per split
    ROW_WORDS: tl.constexpr,  # int32 words per code row (12 for 48 bytes)
    BLOCK: tl.constexpr,  # words per load per tensor
):
    split = tl.program_id(0)
    head = tl.program_id(1)  # (sequence, kv head), flattened
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_tokens)
    code_base = head.to(tl.int64) * n_tokens * ROW_WORDS
    scale_base = head.to(tl.int64) * n_tokens
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for w in range(lo * ROW_WORDS, hi * ROW_WORDS, BLOCK):
        offs = w + tl.arange(0, BLOCK)
        live = offs < hi * ROW_WORDS
        acc ^= tl.load(k_words + code_base + offs, mask=live, other=0)
        acc ^= tl.load(v_words + code_base + offs, mask=live, other=0)
    for t in range(lo, hi, BLOCK):
        offs = t + tl.arange(0, BLOCK)
        live = offs < hi
        acc ^= tl.load(k_scale_words + scale_base + offs, mask=live, other=0)
        acc ^= tl.load(v_scale_words + scale_base + offs, mask=live, other=0)
    tl.store(out + split * tl.num_programs(1) + head, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def read_calls(setup: ba.Setup, splits: int, num_warps: int, block: int) -> list:
    """One closure per cache copy of setup (the copies rotate, as the op's timing does, so a
    cache smaller than L2 is not read from L2), each reading its copy once over a (splits,
    sequences x kv heads) grid."""
    calls = []
    for _, k_codes, k_scales, v_codes, v_scales, *_ in setup.copies:
        b, h, n, row = k_codes.shape
        if row % 4 or k_scales.shape[-1] * k_scales.element_size() != 4:
            raise ValueError(
                f"read_floor reads 4-byte words: code rows of a multiple of 4 bytes and one fp16 pair "
                f"of scales per token, got {row}-byte rows and scales {tuple(k_scales.shape)}"
            )
        words = [x.reshape(b * h, -1).view(torch.int32) for x in (k_codes, v_codes, k_scales, v_scales)]
        out = torch.empty(splits * b * h, dtype=torch.int32, device=k_codes.device)
        chunk = math.ceil(n / splits)

        def call(words=words, out=out, n=n, chunk=chunk, row=row) -> None:
            _read_split_kernel[(splits, len(words[0]))](
                *words, out, n, chunk, ROW_WORDS=row // 4, BLOCK=block, num_warps=num_warps
            )

        calls.append(call)
    return calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8,131072;32,32768;8,32768;1,32768")
    p.add_argument("--out", default="benchmarks/out")
    a = p.parse_args()
    rows = []
    print("| B | N | variant | ms | TB/s (op's bytes) | op ms / variant ms |\n|---|---|---|---|---|---|")
    for shape in a.shapes.split(";"):
        b, n = map(int, shape.split(","))
        s = ba.Setup(b, n, ba.HQ, ba.HKV, "cuda", smoke=False)
        s.use_codec(ba.CODECS["default"])
        s.dense.clear()
        config = wa.tuned_config(s.layout, ba.HEAD_DIM, 4, programs=b * ba.HKV)
        splits = wa.choose_num_splits(b * ba.HKV, n, s.layout, config, torch.device("cuda"))
        op_ms = ba.time_ours(s, config, False)
        quarter = max(1, splits // 4)
        variants = {
            "op (tuned)": None,
            f"read, 1 warp, {splits} splits, 2 KB loads": read_calls(s, splits, 1, 512),
            f"read, 1 warp, {splits} splits, 4 KB loads": read_calls(s, splits, 1, 1024),
            f"read, 4 warps, {splits} splits, 8 KB loads": read_calls(s, splits, 4, 2048),
            f"read, 4 warps, {quarter} splits, 8 KB loads": read_calls(s, quarter, 4, 2048),
        }
        for name, calls in variants.items():
            ms = op_ms if calls is None else ba.time_calls(calls, False)
            tbps = s.bytes / ms / 1e9
            rows.append(dict(B=b, N=n, variant=name, ms=ms, tbps=tbps, vs_op=op_ms / ms))
            print(f"| {b} | {n} | {name} | {ms:.4f} | {tbps:.2f} | {op_ms / ms:.2f} |", flush=True)
        s.free()
        torch.cuda.empty_cache()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "read_floor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
