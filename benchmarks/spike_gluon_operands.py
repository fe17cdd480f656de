"""Spike for the next attention kernel (not used by the package): MMA operands built from the
packed codes in Gluon (Triton's explicit-layout dialect, triton.experimental.gluon in Triton 3.6).
Compiled offline for sm_90 (no GPU needed); prints each loop's SASS instruction mix.

    python benchmarks/spike_gluon_operands.py [--out build/gluon]

Why: the Triton split kernels stage code tiles through shared memory and convert layouts before
their MMAs (v1: 184 PRMT + 96 byte loads per 64-token step; v2 pads its 2-bit value operands to 16
rows), see benchmarks/RESULTS.md. Two loops, per 64 tokens (measured 2026-11-30, Triton 3.6.0):

key_scores: token-major code rows already hold what an m16n8k16 A fragment wants (lane (g, t):
int16 elements 2t, 2t + 1, 2t + 8, 2t + 9 of tokens g and g + 8, i.e. 32-bit words of its own
rows). 16 global loads, 16 LOP3 (one per fp16 pair: mask a nibble field, OR the 1024 exponent),
4 HMMA; no shared memory, shuffles or layout conversions (+ address arithmetic).

value_fields: values put slots on M and tokens on K, so a register must pair two tokens: the tile
goes through shared memory (cp.async, 16 B) and comes back transposed (ldmatrix.trans). The 2-bit
band has 8 int16 elements per token, half an MMA's 16 rows; rows g and g + 8 of an A fragment sit
in the same lane, so the tile holds each element twice and rows 8-15 take the next bit field: two
fields per operand, no padding. 4 LDGSTS, 4 LDSM.T, 16 LOP3 (the per-row field choice folds away),
4 HMMA, 2 barriers. The Triton v2 kernel spends 128 LOP3 + 128 HADD2 + 32 HMMA on the same band
(padded to 16 rows, centred by subtraction).

A kernel would add the other fields, the 4-bit band, the online softmax (scores to p needs a
register transpose: ~40 shuffles in v2), centring of the value fields through the MMA's
accumulator input, and multi-stage cp.async pipelining.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import re
import subprocess

os.environ.pop("TRITON_INTERPRET", None)  # a real compile, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2  # noqa: E402

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_FRAGMENT = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_FRAGMENT = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
# two int16 code elements -> two fp16 (1024 + nibble field 0): (x & 0x000F000F) | 0x64006400
FIELD0 = gl.constexpr("lop3.b32 $0, $1, 0x000F000F, 0x64006400, 0xea;")


@gluon.jit
def key_scores(
    kc_ptr,  # uint8 [tokens, CODE_STRIDE]: code rows, the 4-bit band first
    q_ptr,  # fp16 [16 slots, 8 query rows]: the transformed query of field 0's slots
    out_ptr,  # fp32 [BLOCK_N, 8]: the last block's scores (keeps the loop alive)
    n_tokens,  # multiple of BLOCK_N
    CODE_STRIDE: gl.constexpr,  # bytes per code row
    BLOCK_N: gl.constexpr,  # tokens per step (the MMAs' M)
):
    token = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_FRAGMENT))
    element = gl.arange(0, 16, layout=gl.SliceLayout(0, A_FRAGMENT))
    slot = gl.arange(0, 16, layout=gl.SliceLayout(1, B_FRAGMENT))
    row = gl.arange(0, 8, layout=gl.SliceLayout(0, B_FRAGMENT))
    q = gl.load(q_ptr + slot[:, None] * 8 + row[None, :])
    scores = gl.zeros([BLOCK_N, 8], gl.float32, layout=MMA)
    codes = kc_ptr.to(gl.pointer_type(gl.int16), bitcast=True)
    for start in range(0, n_tokens, BLOCK_N):
        raw = gl.load(codes + (start + token)[:, None] * (CODE_STRIDE // 2) + element[None, :])
        field = gl.inline_asm_elementwise(FIELD0, "=r,r", [raw], dtype=gl.float16, is_pure=True, pack=2)
        scores = mma_v2(field, q, scores)
    token_out = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    row_out = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + token_out[:, None] * 8 + row_out[None, :], scores)


TOKEN_MAJOR = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0]))
TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
# 2-bit fields 0 and 1 of two int16 elements -> two fp16 (1024 + field << 2f)
FIELD0_2BIT = gl.constexpr("lop3.b32 $0, $1, 0x00030003, 0x64006400, 0xea;")
FIELD1_2BIT = gl.constexpr("lop3.b32 $0, $1, 0x000C000C, 0x64006400, 0xea;")


@gluon.jit
def value_fields(
    vc_ptr,  # uint8 [tokens, CODE_STRIDE]: code rows
    p_ptr,  # fp16 [BLOCK_N tokens, 8 rows]: stands in for the softmax weights
    out_ptr,  # fp32 [16 slots, 8 rows]: the accumulator (keeps the loop alive)
    n_tokens,  # multiple of BLOCK_N
    CODE_STRIDE: gl.constexpr,  # bytes per code row
    E0: gl.constexpr,  # first int16 element of the 2-bit band
    BLOCK_N: gl.constexpr,  # tokens per step (the MMAs' K)
):
    token = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, TOKEN_MAJOR))
    element = gl.arange(0, 16, layout=gl.SliceLayout(0, TOKEN_MAJOR)) % 8  # each element twice
    codes = vc_ptr.to(gl.pointer_type(gl.int16), bitcast=True)
    tile = gl.allocate_shared_memory(gl.int16, [BLOCK_N, 16], TILE)
    k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, B_FRAGMENT))
    row = gl.arange(0, 8, layout=gl.SliceLayout(0, B_FRAGMENT))
    p = gl.load(p_ptr + k[:, None] * 8 + row[None, :])
    acc = gl.zeros([16, 8], gl.float32, layout=MMA)
    slot = gl.arange(0, 16, layout=gl.SliceLayout(1, A_FRAGMENT))
    upper = (slot >= 8)[:, None]  # rows 8-15: the next field of the same elements
    for start in range(0, n_tokens, BLOCK_N):
        async_copy.async_copy_global_to_shared(
            tile, codes + (start + token)[:, None] * (CODE_STRIDE // 2) + E0 + element[None, :]
        )
        async_copy.commit_group()
        async_copy.wait_group(0)
        raw = tile.permute([1, 0]).load(A_FRAGMENT)  # [16 slots, BLOCK_N tokens]: ldmatrix.trans
        field0 = gl.inline_asm_elementwise(FIELD0_2BIT, "=r,r", [raw], dtype=gl.float16, is_pure=True, pack=2)
        field1 = gl.inline_asm_elementwise(FIELD1_2BIT, "=r,r", [raw], dtype=gl.float16, is_pure=True, pack=2)
        acc = mma_v2(gl.where(upper, field1, field0), p, acc)
    slot_out = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    row_out = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    gl.store(out_ptr + slot_out[:, None] * 8 + row_out[None, :], acc)


def loop_mix(sass: str) -> collections.Counter:
    """Instruction counts of the first backward-branch loop in nvdisasm output."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", line))}
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            mix = collections.Counter()
            for body in lines[labels[m.group(1)] : i + 1]:
                op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+(?:\.[A-Z0-9_]+)*)", body)
                if op:
                    mix[op.group(1)] += 1
            return mix
    return collections.Counter()


def compile_and_count(fn, signature: dict, constexprs: dict, out: pathlib.Path) -> collections.Counter:
    """Compile fn for sm_90 (pointer arguments 16-byte aligned), keep cubin and SASS, count its loop."""
    names = list(signature)
    aligned = [["tt.divisibility", 16]]
    source = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(names.index(k),): v for k, v in constexprs.items()},
        attrs={(i,): aligned for i, n in enumerate(names) if signature[n].startswith("*")},
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    cubin = out / f"{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    disasm = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True)
    (out / f"{fn.__name__}.sass").write_text(disasm.stdout)
    return loop_mix(disasm.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gluon")
    out = pathlib.Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    common = {"n_tokens": "i32", "CODE_STRIDE": "constexpr"}
    keys = compile_and_count(
        key_scores,
        {"kc_ptr": "*u8", "q_ptr": "*fp16", "out_ptr": "*fp32", **common, "BLOCK_N": "constexpr"},
        {"CODE_STRIDE": 48, "BLOCK_N": 64},
        out,
    )
    values = compile_and_count(
        value_fields,
        {
            "vc_ptr": "*u8",
            "p_ptr": "*fp16",
            "out_ptr": "*fp32",
            **common,
            "E0": "constexpr",
            "BLOCK_N": "constexpr",
        },
        {"CODE_STRIDE": 48, "E0": 16, "BLOCK_N": 64},
        out,
    )
    for name, mix in (("key_scores", keys), ("value_fields", values)):
        listing = ", ".join(f"{op} {n}" for op, n in mix.most_common())
        print(f"{name}: {sum(mix.values())} instructions per 64-token step: {listing}")


if __name__ == "__main__":
    main()
