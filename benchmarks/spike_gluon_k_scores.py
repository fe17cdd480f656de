"""Spike for the next attention kernel (not used by the package): the key-score loop written in
Gluon (Triton's explicit-layout dialect, triton.experimental.gluon in Triton 3.6), with each lane
loading its code words straight into the registers of its mma_v2 A fragment. Compiled offline for
sm_90 (no GPU needed); prints the loop's SASS instruction mix.

    python benchmarks/spike_gluon_k_scores.py [--out build/gluon]

Why: the Triton split kernels stage code tiles through shared memory and convert layouts before
their MMAs (v1: 184 PRMT + 96 byte loads per 64-token step), see benchmarks/RESULTS.md. Token-major
code rows already hold what an m16n8k16 A fragment wants: lane (g, t) needs int16 elements 2t and
2t + 1 (and 2t + 8, 2t + 9) of tokens g and g + 8, i.e. 32-bit words of its own rows. Measured on
2026-11-30 (Triton 3.6.0, offline): per 64 tokens and 16-element chunk, 16 32-bit global loads,
16 LOP3 (one per fp16 pair: mask a nibble field and OR the 1024 magic exponent) and 4 HMMA, with no
shared memory, shuffles or layout conversions; the rest of the 80-instruction loop is address
arithmetic. Only the 4-bit key field 0 is computed here; a kernel would add the other fields,
the values (which need tokens paired per register: ldmatrix.trans as in v2), the softmax, and
cp.async pipelining.
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
from triton.experimental.gluon.language.nvidia.ampere import mma_v2  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/gluon")
    out = pathlib.Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    signature = {
        "kc_ptr": "*u8",
        "q_ptr": "*fp16",
        "out_ptr": "*fp32",
        "n_tokens": "i32",
        "CODE_STRIDE": "constexpr",
        "BLOCK_N": "constexpr",
    }
    aligned = [["tt.divisibility", 16]]
    source = GluonASTSource(
        fn=key_scores,
        signature=signature,
        constexprs={(4,): 48, (5,): 64},
        attrs={(0,): aligned, (1,): aligned, (2,): aligned},
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    cubin = out / "key_scores.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    nvdisasm = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run(
        [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    (out / "key_scores.sass").write_text(sass)
    mix = loop_mix(sass)
    print(f"loop per 64 tokens: {sum(mix.values())} instructions")
    print(", ".join(f"{op} {n}" for op, n in mix.most_common()))


if __name__ == "__main__":
    main()
