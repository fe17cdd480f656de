"""benchmarks/read_floor.py reads exactly the bytes the attention split kernel reads: its kernel's
XOR per program must equal the XOR of that program's slice of codes and scales (a read that skipped
or repeated words, or used the wrong head or split bounds, would change it)."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load_read_floor():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("read_floor", BENCH / "read_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _xor(words: torch.Tensor) -> int:
    return functools.reduce(lambda a, b: a ^ b, words.tolist(), 0)


def test_read_kernel_reads_each_split_exactly():
    read_floor = _load_read_floor()
    sequences, heads, tokens, splits = 2, 3, 100, 3  # 100 tokens: the last split is short
    chunk = -(-tokens // splits)
    k_codes, v_codes = (
        torch.randint(0, 256, (sequences, heads, tokens, 48), dtype=torch.uint8) for _ in "kv"
    )
    k_scales, v_scales = (torch.rand(sequences, heads, tokens, 2).half() for _ in "kv")
    words = [
        x.reshape(sequences * heads, -1).view(torch.int32) for x in (k_codes, v_codes, k_scales, v_scales)
    ]
    out = torch.zeros(splits * sequences * heads, dtype=torch.int32)
    read_floor._read_split_kernel[(splits, sequences * heads)](
        *words, out, tokens, chunk, ROW_WORDS=12, BLOCK=64, num_warps=1
    )
    for split in range(splits):
        lo, hi = split * chunk, min(split * chunk + chunk, tokens)
        for head in range(sequences * heads):
            want = _xor(words[0][head, lo * 12 : hi * 12]) ^ _xor(words[1][head, lo * 12 : hi * 12])
            want ^= _xor(words[2][head, lo:hi]) ^ _xor(words[3][head, lo:hi])
            got = out[split * sequences * heads + head].item() & 0xFFFFFFFF
            assert got == want & 0xFFFFFFFF, (split, head)
