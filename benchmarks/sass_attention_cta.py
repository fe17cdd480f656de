"""Compile the CTA split kernel (kernels/wavelet_attention_cta.py: four splits a CTA, a warp each)
for sm_90 on any machine, with its warp-barrier PTX patch, and count what one step and the CTA's
meetings cost: registers, spills, shared memory, the full-step loop's instructions, and the
barriers left (the named barriers where the warps exchange the transforms; every other barrier a
warp barrier).

    python benchmarks/sass_attention_cta.py [--out build/sass_cta] [--phase-clocks]

No GPU needed (as benchmarks/sass_attention_v3.py, whose SASS helpers this uses). Why: the CTA
kernel runs the one-warp kernel's step per warp, so its loop should cost what that one costs
(`sass_attention_v3.py --tuned --pdl --band-columns --without key_word_pairs --split-major`), and a
CTA-wide barrier left in the loop would make the four warps wait for each other every step.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import triton
from sass_attention_v3 import (
    backward_branches,
    compile_sm90,
    disassemble,
    kernel_instructions,
    line_instructions,
    loop_instructions,
)
from wmoe_compile.kernels import ptx_patches
from wmoe_compile.kernels.attention_config import SMALL_LAUNCH_CONFIGS


def compile_cta(out: pathlib.Path, phase_clocks: bool) -> tuple[str, str, int, str]:
    """(ptxas resource line, SASS, shared bytes, patched PTX) of split_kernel_cta with the
    small-launch config's constexprs (the default codec's 48-byte code rows)."""
    ptx_patches.install()  # the launcher installs it before the kernel's first launch
    from wmoe_compile.kernels.wavelet_attention_cta import WARPS, split_kernel_cta

    fn = split_kernel_cta
    config = SMALL_LAUNCH_CONFIGS[(128, 4, "affine")]
    constexprs = dict(
        CODE_ROW=24,
        E4=0,
        E2=16,
        D=128,
        BLOCK_N=config.block_n,
        SINKS=4,
        WINDOW=128,
        PDL=True,
        TRIGGER_DEPENDENTS=config.exact_in_chain,
        VALUE_SUBNORMALS=config.value_subnormals,
        PHASE_CLOCKS=phase_clocks,
    )
    kernel = compile_sm90(fn, constexprs, dict(num_warps=WARPS, maxnreg=config.maxnreg))
    usage, sass = disassemble(kernel, out, "split_kernel_cta")
    return usage, sass, kernel.metadata.shared, kernel.asm["ptx"]


def epilogue_instructions(sass: str) -> list[str]:
    """The instructions after the kernel's last loop (backward branch; not the trailing `BRA` to
    itself that ends nvdisasm's listing): the epilogue."""
    lines = sass.splitlines()
    last = max((branch for label, branch in backward_branches(lines) if label < branch - 1), default=0)
    return line_instructions(lines[last + 1 :])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/sass_cta")
    p.add_argument("--phase-clocks", action="store_true", help="with the probe's phase stamps")
    a = p.parse_args()
    usage, sass, shared, ptx = compile_cta(pathlib.Path(a.out), a.phase_clocks)
    loop = loop_instructions(sass)
    spills = [i for i in loop if re.match(r"(STL|LDL)\b", i)]
    print(f"triton {triton.__version__}, sm_90: {usage}; shared {shared} B per CTA")
    print(f"full-step loop: {len(loop)} instructions per 64-token step")
    print(f"kernel: {len(kernel_instructions(sass))} instructions")
    print(f"loop spill instructions: {len(spills)}")
    cta_barriers = len(re.findall(r"bar\.sync\s+0;", ptx))
    named = len(re.findall(r"bar\.sync\s+1,\s*128;", ptx))
    print(f"CTA barriers (bar.sync 0) in the PTX: {cta_barriers}")
    print(f"named barriers (bar.sync 1, 128) in the PTX: {named}")
    print(f"loop barriers: {sum(1 for i in loop if i.startswith('BAR.'))}")
    # after the loops the T words (16-byte loads) and the channel scales are the only global reads:
    # the value slots' step and shift come from shared memory (each 4-byte load batch there was an
    # L2 round trip the epilogue waited for)
    loads = [i for i in epilogue_instructions(sass) if re.match(r"(?:@!?P\w+\s+)?LDG\b", i)]
    wide = sum(1 for i in loads if ".128" in i.split()[0] or ".128" in i.split()[-1])
    print(f"epilogue global loads: {len(loads)} ({wide} of 16 bytes)")
    # step 0's reads go out before the query's transform runs, and after its word loads (which a
    # fence keeps above the split ranges' arithmetic)
    prologue = kernel_instructions(sass)
    prologue = prologue[: next(i for i, ins in enumerate(prologue) if "HMMA" in ins.split()[0])]
    copies = [i for i, ins in enumerate(prologue) if ins.startswith("LDGSTS")]
    words = [i for i, ins in enumerate(prologue) if ins.startswith("LDG") and ".128" in ins.split()[0]]
    print(f"before the first MMA: {len(copies)} value copies, {len(words)} 16-byte loads")
    in_order = bool(words and copies and words[-1] < copies[0])
    print(f"the transform's word loads before step 0's copies: {in_order}")


if __name__ == "__main__":
    main()
