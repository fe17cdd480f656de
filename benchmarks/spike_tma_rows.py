"""Spike: a step's 64 code rows by one TMA copy into shared memory, its bands read by ldmatrix.

    python benchmarks/spike_tma_rows.py [--out build/spike_tma_rows]   # offline: SASS facts
    python benchmarks/spike_tma_rows.py --check                       # on a GPU: the tiles' values

Not a kernel of the op: one program copies one step's rows of one cache and writes what each read
returns, so that the copy and the reads can be checked before a split kernel is built on them.

Why (docs/ATTENTION.md, "One bulk copy per step and cache"): the v3 step reads its key words with
24 loads and its value tiles with 16 copies a step, each lane 4-8 bytes of a different 48-byte row,
with about 130 instructions of addresses, and L1 merges the requests (Nsight Compute, thirty-seventh
session: L1/TEX 67% busy, L2 88.5%, DRAM 79% at (8, 131072)). A step's rows are one contiguous 3 KB
range of the cache. Gluon's tensor descriptors need power-of-two block shapes, so a [64, 24] int16
box (48-byte rows) cannot be declared; this spike asks for a [64, 32] box over the cache viewed as
[tokens, 24] int16: the TMA unit reads each row's 48 bytes and fills columns 24-31 with zeros (out
of the view's bounds), one UTMALDG.2D per cache and step. The bands are slices of the tile:
columns 0-15 (the 4-bit band) and 16-23 (the 2-bit band). With the 64-byte swizzle, the slices
load as the MMAs' operands by LDSM (ldmatrix; .MT88, transposed, for the value operand, tokens on
K), bank-conflict free.

What it leaves open for a kernel: the 2-bit band's operand repeats its 8 elements in columns 8-15
(_band_operands' `upper` half), which a slice of the raw rows does not hold (columns 24-31 are
zeros); the tile takes 4 KB a cache and stage (two caches, two stages: 16 KB a program, 192 KB for
12 programs an SM, where the L1 the scale loads use is the rest); the scales would come by their
own copies.
"""

from __future__ import annotations

import argparse
import pathlib

import triton

# the v3 kernel's SASS tool, beside this script (run as a script, its folder is on sys.path)
from sass_attention_v3 import kernel_instructions
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from wmoe_compile.kernels import wavelet_attention_gluon as v3

_tma_load = v3._tma_load  # (async_copy_global_to_shared on Triton 3.6, async_load on 3.9)

# the split kernel's layouts: MMA operands, half an A operand's columns (the 2-bit band's 8
# elements), and the row tile (64-byte rows, 16-byte chunks XOR-swizzled so that ldmatrix's 8
# rows hit 8 bank groups)
_A = v3._A
_B = v3._B
_BAND2 = v3._HALF_A
_ROWS = v3._TMA_ROWS
STEP = 64  # tokens a step
ROW = 24  # int16 elements a code row (48 bytes)
READS = {"keys": 0, "values": 1, "band2": 2}  # what the program reads back from the tile


@gluon.jit
def tma_rows_kernel(
    codes,  # int16 [tokens, ROW]: one cache's code rows
    out,  # int16 [tokens, 16]: what each program's read returns, by token and column
    n_tokens,
    READ: gl.constexpr,  # 0: the 4-bit band as the key MMAs' A operand; 1: as the value MMAs' B
    # operand (transposed); 2: the 2-bit band's 8 elements
):
    desc = tma.make_tensor_descriptor(codes, [n_tokens, 24], [24, 1], [64, 32], _ROWS)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    tile = gl.allocate_shared_memory(gl.int16, [64, 32], _ROWS)
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, 64 * 32 * 2)  # the box's bytes: the zero-filled columns 24-31 count too
    first = gl.program_id(0) * 64
    _tma_load(desc, [first, 0], bar, tile)
    mbarrier.wait(bar, 0)
    if READ == 0:
        x = tile.slice(0, 16, dim=1).load(_A)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, _A))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, _A))
    elif READ == 1:
        x = tile.slice(0, 16, dim=1).load(_B)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, _B))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, _B))
    else:
        x = tile.slice(16, 8, dim=1).load(_BAND2)
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, _BAND2))
        cols = gl.arange(0, 8, layout=gl.SliceLayout(0, _BAND2))
    gl.store(out + (first + rows)[:, None] * 16 + cols[None, :], x)
    mbarrier.invalidate(bar)


def compile_sm90(read: int):
    """The spike compiled for sm_90, offline."""
    signature = {"codes": "*i16", "out": "*i16", "n_tokens": "i32", "READ": "constexpr"}
    source = GluonASTSource(
        fn=tma_rows_kernel,
        signature=signature,
        constexprs={(3,): read},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]},
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))


def sass_facts(kernel, out: pathlib.Path, name: str) -> dict:
    """The copy and read instructions of a compiled spike (writes its SASS under out)."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    disassembler = [str(tools / "nvdisasm"), "-c", str(cubin)]
    sass = subprocess.run(disassembler, capture_output=True, text=True, check=True).stdout
    (out / f"{name}.sass").write_text(sass)
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in kernel_instructions(sass)]
    return {
        "tma_copies": sum(o.startswith("UTMALDG") for o in ops),
        "ldmatrix": sum(o.startswith("LDSM") for o in ops),
        "ldmatrix_transposed": sum(o.startswith("LDSM.16.MT88") for o in ops),
        "global_loads": sum(o.startswith(("LDG", "LDGSTS")) for o in ops),
        "shared_bytes": kernel.metadata.shared,
    }


def check_on_gpu() -> None:
    """Run each read on random code rows (a length off the step) and compare with the rows."""
    import torch

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    tokens = 64 * 37
    codes = torch.randint(-(2**15), 2**15, (tokens, ROW), dtype=torch.int16, device="cuda")
    for name, read in READS.items():
        width = 8 if read == 2 else 16
        out = torch.full((tokens, 16), -1, dtype=torch.int16, device="cuda")
        tma_rows_kernel[(tokens // STEP,)](codes, out, tokens, read, num_warps=1)
        want = codes[:, 16:24] if read == 2 else codes[:, :16]
        ok = torch.equal(out[:, :width], want)
        print(f"{name}: {'equal' if ok else 'DIFFERENT'} to the rows' columns ({tokens} tokens)")
        if not ok:
            raise SystemExit(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/spike_tma_rows")
    p.add_argument("--check", action="store_true", help="run on the GPU and compare the reads")
    a = p.parse_args()
    if a.check:
        check_on_gpu()
        return
    for name, read in READS.items():
        facts = sass_facts(compile_sm90(read), pathlib.Path(a.out), name)
        print(name, facts)


if __name__ == "__main__":
    main()
