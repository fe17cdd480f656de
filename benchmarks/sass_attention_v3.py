"""Compile the Gluon attention split kernel (v3) for sm_90 on any machine and count what one step
costs: registers, spills, shared memory, the SASS instruction mix of the full-step loop and how
far its global loads issue ahead of their first use.

    python benchmarks/sass_attention_v3.py [--stages 1] [--block-n 64] [--maxnreg 168]
        [--keys-via-smem] [--keys-ahead] [--no-cache-tiles] [--no-convert-p-once] [--lazy-rescale]
        [--copy-layout-tokens] [--value-scales-in-b] [--score-offset-in-mma] [--p-movmatrix]
        [--step-row-base] [--row-copies] [--block-m 4] [--pdl] [--out build/sass_v3]
    python benchmarks/sass_attention_v3.py --tuned    # the package's tuned decode config
    python benchmarks/sass_attention_v3.py --tuned --value-copies-l2-256b   # ... plus an option

No GPU needed (triton.compile builds for a named target, interpreter setting or not; the CUDA tools
Triton ships disassemble). Why: the
kernel's loop is bound by issue and memory latency, so instructions per 64-token step are the
first thing to measure before a change goes to the device (the session log in
benchmarks/RESULTS.md has the counts per variant). Triton 3.6 and 3.9 both compile it.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import pathlib
import re
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from wmoe_compile.kernels import fast_launch
from wmoe_compile.kernels import wavelet_attention_gluon as gluon_kernels


def loop_mix(sass: str) -> collections.Counter:
    """Instruction counts of the first backward-branch loop in nvdisasm output (v3: the full-step
    loop, which precedes the masked tail loop)."""
    return collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in loop_instructions(sass)
    )


def backward_branches(lines: list[str]) -> list[tuple[int, int]]:
    """(label line, branch line) of each branch in nvdisasm output to a label above it, in order."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", line))}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            found.append((labels[m.group(1)], i))
    return found


def line_instructions(lines: list[str]) -> list[str]:
    """The instructions (predicate, opcode and operands) on nvdisasm output lines."""
    body = (re.search(r"\*/\s+([^;]+);", b) for b in lines)
    return [b.group(1).strip() for b in body if b]


def loop_instructions(sass: str) -> list[str]:
    """The instructions (predicate, opcode and operands) of the first backward-branch loop."""
    lines = sass.splitlines()
    loops = backward_branches(lines)
    return line_instructions(lines[loops[0][0] : loops[0][1] + 1]) if loops else []


def kernel_instructions(sass: str) -> list[str]:
    """Every instruction of the kernel in nvdisasm output (the loop counted once)."""
    return re.findall(r"/\*[0-9a-f]{4,}\*/\s+([^;]+);", sass)


def load_to_use(loop: list[str]) -> list[int]:
    """For each global load (LDG) of the loop, how many instructions later the first instruction
    that reads its register issues, following the loop around its back edge (keys_ahead's words
    are read in the next step). A load whose register is overwritten unread counts as the loop's
    length. Why it matters: ptxas puts the first reader of a key word a few dozen instructions
    after its load unless the program order keeps it away, and the warp then waits there for DRAM
    (benchmarks/RESULTS.md, sixteenth and seventeenth sessions)."""
    distances = []
    for k, ins in enumerate(loop):
        m = re.match(r"(?:@!?U?P\w+\s+)?LDG\S*\s+(R\d+),", ins)
        if not m:
            continue
        reg = re.compile(rf"\b{m.group(1)}\b")
        distance = len(loop)
        for j in range(1, len(loop)):
            later = loop[(k + j) % len(loop)].split(None, 1)
            if later[0].startswith("@"):  # predicated: opcode and operands follow the guard
                later = later[1].split(None, 1)
            operands = [x.strip() for x in later[1].split(",")] if len(later) > 1 else []
            # sources: every operand after the first, and the first where it is an address
            sources = operands[1:] + [x for x in operands[:1] if x.startswith("[")]
            if any(reg.search(x) for x in sources):
                distance = j
                break
            if operands and reg.fullmatch(operands[0]):  # overwritten unread
                break
        distances.append(distance)
    return distances


def launch_config(args: argparse.Namespace):
    """The LaunchConfig the flags describe (every flag named after a LaunchConfig field sets it), so
    its validation refuses what the package would refuse, with the same message."""
    from wmoe_compile.kernels.wavelet_attention import LaunchConfig

    fields = {f.name for f in dataclasses.fields(LaunchConfig)} - {"pdl", "maxnreg"}
    options = {name: value for name, value in vars(args).items() if name in fields}
    try:
        return LaunchConfig(
            kernel="v3",
            num_stages=args.stages,
            cache_tiles=not args.no_cache_tiles,
            convert_p_once=not args.no_convert_p_once,
            **options,
        )
    except ValueError as exc:
        raise SystemExit(f"these flags make no valid LaunchConfig: {exc}") from exc


def compile_v3(args: argparse.Namespace) -> tuple[str, str, int, str]:
    """(ptxas resource line, SASS, shared bytes, PTX) of the kernel for the codec default's layout
    (48-byte code rows, two scales per row, 4 sinks + 128-token window), with the constexprs the
    launcher derives from the same LaunchConfig (wavelet_attention.v3_option_constexprs)."""
    from wmoe_compile.kernels.wavelet_attention import v3_option_constexprs

    fn = gluon_kernels.split_kernel_v3
    constexprs = dict(
        CODE_ROW=24,
        SCALE_ROW=2,
        E4=0,
        E2=16,
        D=128,
        BLOCK_M=args.block_m,
        N_QC=4,
        BLOCK_N=args.block_n,
        SINKS=4,
        WINDOW=128,
        PDL=args.pdl,
        TRIGGER_DEPENDENTS=False,
        **v3_option_constexprs(launch_config(args), args.split_major),
    )
    options = dict(num_warps=1, **({"maxnreg": args.maxnreg} if args.maxnreg else {}))
    kernel = compile_sm90(fn, constexprs, options)
    usage, sass = disassemble(kernel, pathlib.Path(args.out), "split_kernel_v3")
    return usage, sass, kernel.metadata.shared, kernel.asm["ptx"]


# the split kernels' pointer arguments (the rest are fp32)
POINTER_TYPES = dict(qw_ptr="*fp16", kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp16", vs_ptr="*fp16")
POINTER_TYPES.update(seq_lens_ptr="*i32", slot_coef_ptr="*i32", vt_ptr="*i32", qt_ptr="*i32")
POINTER_TYPES.update(q_ptr="*bf16", clock_ptr="*i64")


def compile_sm90(fn, constexprs: dict, options: dict):
    """A Gluon split kernel compiled for sm_90 with these constexprs, its other arguments typed as
    the launcher passes them (POINTER_TYPES, fp32 qk_scale, int32 the rest; with TMA_ROWS the row
    descriptors, else int32 pointers) and 16-byte aligned as the JIT specialises aligned tensors
    and strides. Constexprs not given take their defaults, as in a launch."""
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr}
    constexprs = {
        **{name: value for name, value in defaults.items() if value is not inspect.Parameter.empty},
        **constexprs,
    }
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_rows_desc"):
            signature[name] = (
                f"tensordesc<i16[64, 32],{gluon_kernels.TMA_ROWS_LAYOUT!r}>"
                if constexprs.get("TMA_ROWS")
                else "*i32"
            )
        elif name.endswith("_ptr"):
            signature[name] = POINTER_TYPES.get(name, "*fp32")
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name] != "constexpr" and (signature[name].startswith("*") or "stride" in name)
    }
    source = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=aligned,
    )
    options = {**fast_launch.COMPILE_OPTIONS, **options}  # as the package's launches compile it
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def loads_before_pdl_wait(ptx: str) -> int:
    """Global loads the PTX issues before `griddepcontrol.wait` (-1: no wait). With PDL the kernel
    starts before the kernels ahead of it in the stream have finished, so every load of data they
    may write must come after the wait; the hinted key loads are inline asm marked pure, which
    LLVM would be free to move."""
    wait = ptx.find("griddepcontrol.wait")
    return -1 if wait < 0 else len(re.findall(r"\bld\.global", ptx[:wait]))


def disassemble(kernel, out: pathlib.Path, name: str) -> tuple[str, str]:
    """Write a compiled kernel's cubin, TTGIR, PTX and SASS under `out` as name.*; return (ptxas resource
    line, SASS), with the CUDA tools Triton ships."""
    out.mkdir(parents=True, exist_ok=True)
    cubin = out / f"{name}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    (out / f"{name}.ttgir").write_text(kernel.asm["ttgir"])
    (out / f"{name}.ptx").write_text(kernel.asm["ptx"])
    tools = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    run = dict(capture_output=True, text=True, check=True)
    sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], **run).stdout
    (out / f"{name}.sass").write_text(sass)
    usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], **run).stdout
    return usage.strip().splitlines()[-1].strip(), sass


def compile_gluon_sm90(fn, pointers: dict[str, str], constexprs: dict[str, object], options: dict):
    """A Gluon kernel compiled for sm_90: pointer arguments typed by `pointers` (else fp32) and
    16-byte aligned as the launches specialise them, other runtime arguments i32."""
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "*fp32" if n.endswith("_ptr") else "i32")
        for n in fn.arg_names
    }
    aligned = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if signature[n].startswith("*")
    }
    source = GluonASTSource(
        fn=fn,
        signature=signature,
        constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()},
        attrs=aligned,
    )
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def spike_main(fn, pointers: dict[str, str], num_warps: int, name: str, description: str) -> None:
    """The command line of a compile-only spike (--maxnreg, --out): compile `fn` with BLOCK_N 64
    on `num_warps` warps, write its files under build/<name>, print its resources and loop mix."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--maxnreg", type=int, default=0, help="0: no cap")
    p.add_argument("--out", default=f"build/{name}")
    args = p.parse_args()
    options = dict(num_warps=num_warps, **({"maxnreg": args.maxnreg} if args.maxnreg else {}))
    kernel = compile_gluon_sm90(fn, pointers, {"BLOCK_N": 64}, options)
    usage, sass = disassemble(kernel, pathlib.Path(args.out), name)
    mix = loop_mix(sass)
    print(f"triton {triton.__version__}, sm_90, {num_warps} warp(s): {usage}")
    print(f"loop: {sum(mix.values())} instructions per warp per 64-token step")
    for op, n in mix.most_common():
        print(f"  {n:5d}  {op}")


def apply_tuned(args: argparse.Namespace) -> None:
    """Set the kernel flags from TUNED_CONFIGS' decode entry, so this count cannot drift from what
    the package launches."""
    from wmoe_compile.kernels import wavelet_attention as wa

    config = wa.TUNED_CONFIGS[(128, 4, "affine")]
    assert config.kernel == "v3", config
    args.stages = config.num_stages if args.stages is None else args.stages
    args.block_n = config.block_n
    args.maxnreg = (config.maxnreg or 0) if args.maxnreg is None else args.maxnreg
    # (--no-cache-tiles / --no-convert-p-once, or --without cache_tiles, turn the tuned ones off)
    args.no_cache_tiles = args.no_cache_tiles or not config.cache_tiles or "cache_tiles" in args.without
    args.no_convert_p_once = (
        args.no_convert_p_once or not config.convert_p_once or "convert_p_once" in args.without
    )
    # every flag named after a LaunchConfig field (PDL stays the --pdl flag's: a launch property)
    fields = {f.name for f in dataclasses.fields(config)} - {"pdl", "maxnreg"}
    unknown = set(args.without) - fields
    if unknown:
        raise SystemExit(f"--without takes LaunchConfig option names, got {sorted(unknown)}")
    for name in vars(args):
        if name in fields:  # an option flag given as well adds that option to the tuned ones
            tuned = getattr(config, name) and name not in args.without
            setattr(args, name, getattr(args, name) or tuned)  # (a flag given beats --without)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=None, help="ring stages (1; with --tuned: the config's)")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--block-m", type=int, default=4)
    p.add_argument("--maxnreg", type=int, default=None, help="0: no cap (168; with --tuned: the config's)")
    p.add_argument("--keys-via-smem", action="store_true")
    p.add_argument("--keys-ahead", action="store_true")
    p.add_argument("--no-cache-tiles", action="store_true")
    p.add_argument("--no-convert-p-once", action="store_true")
    p.add_argument(
        "--lazy-rescale", action="store_true", help="rescale only when a max grows (a branch in the loop)"
    )
    p.add_argument(
        "--copy-layout-tokens", action="store_true", help="value-tile token indices in the copies' layout"
    )
    p.add_argument(
        "--value-scales-in-b", action="store_true", help="value scales split straight into the B layout"
    )
    p.add_argument(
        "--score-offset-in-mma",
        action="store_true",
        help="band score offsets as the key MMAs' accumulator input",
    )
    p.add_argument("--p-movmatrix", action="store_true", help="p to the B layout by movmatrix.trans")
    p.add_argument("--step-row-base", action="store_true", help="code rows from a scalar per-step pointer")
    p.add_argument("--row-copies", action="store_true", help="code rows by 16-byte copies (keys via smem)")
    p.add_argument("--pdl", action="store_true", help="wait for the previous kernel in-kernel (PDL)")
    p.add_argument("--key-loads-l2-256b", action="store_true", help="key-word loads with the L2::256B hint")
    p.add_argument(
        "--key-word-pairs", action="store_true", help="a lane's two 4-bit key words by one 8-byte load"
    )
    p.add_argument("--tma-rows", action="store_true", help="code rows by TMA copies (needs --stages >= 2)")
    p.add_argument(
        "--tma-rows-unfenced", action="store_true", help="with --tma-rows: no proxy fence before the copies"
    )
    p.add_argument(
        "--tma-rows-early",
        action="store_true",
        help="with --tma-rows: a stage's next copy right after its operands are read (fenced)",
    )
    p.add_argument(
        "--scale-pairs-two-ahead", action="store_true", help="with --tma-rows-early: scales two steps ahead"
    )
    p.add_argument(
        "--value-copies-16b-l1",
        action="store_true",
        help="with --no-cache-tiles: the 16-byte tile copies through L1 (cp.async.ca, PTX patch)",
    )
    p.add_argument(
        "--value-band2-half",
        action="store_true",
        help="the 2-bit value band's tiles [64, 8], its operand's repeat in registers",
    )
    p.add_argument(
        "--token-sums-rows",
        action="store_true",
        help="the token sums from one MMA whose operand rows are 1 and the value scales",
    )
    p.add_argument(
        "--warp-barriers", action="store_true", help="the CTA barriers as warp barriers (PTX patch)"
    )
    p.add_argument("--zero-padding-p", action="store_true", help="p = 0 in the MMAs' padding rows")
    p.add_argument(
        "--band-columns", action="store_true", help="the MMAs' columns 4-7 serve the 2-bit band (GQA 4)"
    )
    p.add_argument(
        "--counted-steps", action="store_true", help="the full-step loop over step numbers, not positions"
    )
    p.add_argument(
        "--value-scales-staged",
        action="store_true",
        help="the value scales staged in shared memory in the B layout's lane order",
    )
    p.add_argument(
        "--packed-p-scaling", action="store_true", help="p times the value scales by packed fp16 multiplies"
    )
    p.add_argument(
        "--value-subnormals", action="store_true", help="value fields as subnormals, centred at the store"
    )
    p.add_argument("--prefetch-value-rows", action="store_true", help="the next step's value rows into L2")
    p.add_argument(
        "--fill-value-rows-l2", action="store_true", help="hinted loads fill the next value rows' L2 blocks"
    )
    p.add_argument(
        "--value-copies-l2-256b", action="store_true", help="the code tiles' cp.async with the L2::256B hint"
    )
    p.add_argument(
        "--plain-loads-l2-256b", action="store_true", help="plain global loads (scales) with the hint too"
    )
    p.add_argument(
        "--loads-before-pdl-wait", type=int, default=0, help="steps of cache reads issued before the PDL wait"
    )
    p.add_argument(
        "--split-major", action="store_true", help="grid (programs, splits): a remainder split plan's launch"
    )
    p.add_argument(
        "--transform-in-split",
        action="store_true",
        help="the partial's sums mapped to channels in the split kernel (one more epilogue)",
    )
    p.add_argument(
        "--query-in-split",
        action="store_true",
        help="the query's transform in the split kernel (no prologue); needs --loads-before-pdl-wait 0",
    )
    p.add_argument(
        "--phase-clocks",
        action="store_true",
        help="the probe's globaltimer stamps (LaunchConfig.phase_clocks): what they add to the step",
    )
    p.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="OPTION",
        help="with --tuned: leave this LaunchConfig option of the tuned config off (repeatable)",
    )
    p.add_argument("--out", default="build/sass_v3")
    p.add_argument(
        "--tuned",
        action="store_true",
        help="the package's tuned config for decode (TUNED_CONFIGS), plus any option flag given",
    )
    args = p.parse_args()
    if args.tuned:
        apply_tuned(args)
    args.stages = 1 if args.stages is None else args.stages
    args.maxnreg = 168 if args.maxnreg is None else args.maxnreg
    if launch_config(args).needs_ptx_patches:
        from wmoe_compile.kernels import ptx_patches

        ptx_patches.install()  # as the launcher does before a marked kernel compiles
    reason = gluon_kernels.gluon_reason()
    if reason is not None:  # e.g. Triton 3.5: its Gluon has no mma_v2
        raise SystemExit(f"v3 cannot be built with triton {triton.__version__}: {reason}")
    usage, sass, shared, ptx = compile_v3(args)
    mix = loop_mix(sass)
    loop = loop_instructions(sass)
    spills = sum(1 for ins in loop if re.match(r"(?:@!?U?P\w+\s+)?(LDL|STL)", ins))
    distances = sorted(load_to_use(loop))
    print(f"triton {triton.__version__}, sm_90: {usage}; shared {shared} B per program")
    print(f"full-step loop: {sum(mix.values())} instructions per {args.block_n}-token step")
    print(f"kernel: {len(kernel_instructions(sass))} instructions")
    print(f"loop spill instructions: {spills}")
    if args.pdl:
        print(f"global loads before the PDL wait: {loads_before_pdl_wait(ptx)}")
    if distances:
        median = distances[len(distances) // 2]
        print(f"global loads' load-to-use distance: median {median}, min {distances[0]} instructions")
    for op, n in mix.most_common():  # all of them: the tests look for the load counts
        print(f"  {n:5d}  {op}")


if __name__ == "__main__":
    main()
