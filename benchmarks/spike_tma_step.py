"""Compile-only spike: the v3 full step with both caches' rows by TMA copies (spike_tma_rows.py).

    python benchmarks/spike_tma_step.py [--stages 2] [--maxnreg 168] [--out build/spike_tma_step]

Not a kernel of the op: one program runs n_steps full steps of one (sequence, kv head) from its
first token (no split bounds, masked steps, exact tokens or epilogue; it stores the raw softmax
state) and it is never launched. It answers, offline, the question that decides whether the tuned
step should take its code rows this way: how many instructions and registers does the step need
when each stage's key and value rows arrive by one TMA copy a cache (a [64, 32] box over the cache
viewed as [tokens, 24] int16, columns 24-31 zero-filled) instead of 24 key-word loads carried a
step ahead and 16 value copies?

The step's arithmetic is v3's (`_scores`, `_accumulate_values`, the tuned options: value fields as
subnormals, packed p scaling, the value scales in the B layout). What differs:
- keys: the 4-bit band's [64, 16] A operand by ldmatrix from the tile; the 2-bit band's 8
  elements by ldmatrix into half of the A layout, repeated into columns 8-15 in registers
  (the split kernel's `_repeat_halves`: a join and a reshape that move no data; the copies and
  reads are its TMA_ROWS helpers `_issue_rows_tma` and `_tma_operands`);
- values: the same from the tile transposed (tokens on K), rows 8-15 repeating rows 0-7;
- STAGES tiles of each cache in flight (one mbarrier a stage); Triton puts a MEMBAR.CTA and a
  proxy fence before each TMA issue;
- the scale pairs as v3 loads them, a step ahead.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import triton

# the v3 kernel's SASS tool, beside this script (run as a script, its folder is on sys.path)
from sass_attention_v3 import disassemble, loop_instructions
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from wmoe_compile.kernels import wavelet_attention_gluon as v3

_A = v3._A
_B = v3._B
_MMA = v3._MMA


@gluon.jit
def tma_step_kernel(
    kc_ptr,  # int16 [tokens, 24]: one (sequence, kv head)'s key code rows
    vc_ptr,  # int16 [tokens, 24]: its value code rows
    ks_ptr,  # fp16 [tokens, 2]: the key rows' band scales
    vs_ptr,  # fp16 [tokens, 2]: the value rows' band scales
    qw_ptr,  # fp16 [8, 128]: the transformed query rows (the prologue's format)
    qc_ptr,  # fp32 [8, 4]: their score offsets
    out_ptr,  # fp32 [12, 16, 8]: the softmax state after the steps
    n_tokens,
    n_steps,  # each program's: program p runs the steps from token p * n_steps * 64
    STAGES: gl.constexpr,
):
    BLOCK_N: gl.constexpr = 64
    pid = gl.program_id(0)
    base = pid * n_steps * BLOCK_N
    ks_ptr += base * 2
    vs_ptr += base * 2
    out_ptr += pid * 12 * 128
    k_desc = tma.make_tensor_descriptor(kc_ptr, [n_tokens, 24], [24, 1], [64, 32], v3._TMA_ROWS)
    v_desc = tma.make_tensor_descriptor(vc_ptr, [n_tokens, 24], [24, 1], [64, 32], v3._TMA_ROWS)
    krows = gl.allocate_shared_memory(gl.int16, [STAGES, 64, 32], v3._TMA_ROWS)
    vrows = gl.allocate_shared_memory(gl.int16, [STAGES, 64, 32], v3._TMA_ROWS)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    ring = (k_desc, v_desc, krows, vrows, bars)  # (the split kernel's TMA_ROWS helpers take it)
    q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1 = v3._load_query(qw_ptr, qc_ptr, 0, 4, 4)
    ones = gl.full([16, BLOCK_N], 1.0, gl.float16, layout=_A)
    st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v3._SCALE_PAIRS))
    acc0 = gl.zeros([16, 8], gl.float32, layout=_MMA)
    m0 = gl.full([8], -1.0e30, gl.float32, layout=gl.SliceLayout(0, _MMA))
    state = (m0,) + (acc0,) * 11
    last = (n_steps - 1) * BLOCK_N
    for i in gl.static_range(STAGES - 1):
        first = base + gl.minimum(i * BLOCK_N, last)
        v3._issue_rows_tma(ring, i, first, first, True)
    k_pair = v3._load_scale_pairs(ks_ptr, st, 2)
    v_pair = v3._load_scale_pairs(vs_ptr, st, 2)
    for step in range(n_steps):
        start = step * BLOCK_N
        # refill the stage the previous step read: its ldmatrix results were consumed by that
        # step's MMAs, and Triton puts a proxy fence before every TMA issue
        ahead = base + gl.minimum(start + (STAGES - 1) * BLOCK_N, last)
        v3._issue_rows_tma(ring, (step + STAGES - 1) % STAGES, ahead, ahead, True)
        k0, k1 = v3._split_scales(k_pair)
        w0, w1 = v3._split_value_scales(v_pair)
        nxt = gl.minimum(start + BLOCK_N, last)
        k_pair = v3._load_scale_pairs(ks_ptr, nxt + st, 2)
        v_pair = v3._load_scale_pairs(vs_ptr, nxt + st, 2)
        raw4, raw2, r4, r2 = v3._tma_operands(ring, step % STAGES, (step // STAGES) & 1)
        s = v3._scores(raw4, raw2, k0, k1, q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1, BLOCK_N, True)
        state = v3._accumulate_values(
            s, state, w0, w1, r4, r2, ones, False, True, True, True, True, True, False, True
        )
    m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa, wsb = state
    rows = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))[:, None] * 8
    cols = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))[None, :]
    gl.store(out_ptr + 0 * 128 + rows + cols, a0)
    gl.store(out_ptr + 1 * 128 + rows + cols, a1)
    gl.store(out_ptr + 2 * 128 + rows + cols, a2)
    gl.store(out_ptr + 3 * 128 + rows + cols, a3)
    gl.store(out_ptr + 4 * 128 + rows + cols, a4)
    gl.store(out_ptr + 5 * 128 + rows + cols, a5)
    gl.store(out_ptr + 6 * 128 + rows + cols, a6)
    gl.store(out_ptr + 7 * 128 + rows + cols, a7)
    gl.store(out_ptr + 8 * 128 + rows + cols, l_acc)
    gl.store(out_ptr + 9 * 128 + rows + cols, wsa)
    gl.store(out_ptr + 10 * 128 + rows + cols, wsb)
    gl.store(out_ptr + 11 * 128 + gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA)), m_i)


def compile_sm90(stages: int, maxnreg: int):
    pointers = dict(kc_ptr="*i16", vc_ptr="*i16", ks_ptr="*fp16", vs_ptr="*fp16", qw_ptr="*fp16")
    pointers.update(qc_ptr="*fp32", out_ptr="*fp32")
    signature = {**pointers, "n_tokens": "i32", "n_steps": "i32", "STAGES": "constexpr"}
    names = list(signature)
    source = GluonASTSource(
        fn=tma_step_kernel,
        signature=signature,
        constexprs={(names.index("STAGES"),): stages},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(len(pointers))},
    )
    options = dict(num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def time_on_gpu(stages: int, maxnreg: int, programs: int = 1536, steps: int = 85) -> None:
    """Time the loop alone at (8, 131072)'s geometry: `programs` programs of `steps` full steps
    each over one flat cache of random codes (a program's range may cross a (sequence, kv head):
    timing only, no result is checked), the median of 20 launches by CUDA events, against the
    bytes it reads. Compare with the op's split kernel in the same run (probe_attention.py kernels:
    about 225 us there, of which about 6 us are its query transform and epilogue)."""
    import statistics

    import torch

    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    tokens = programs * steps * 64
    codes = [torch.randint(-(2**15), 2**15, (tokens, 24), dtype=torch.int16, device="cuda") for _ in range(2)]
    scales = [torch.rand(tokens, 2, device="cuda", dtype=torch.float16) * 0.01 for _ in range(2)]
    qw = torch.randn(8, 128, device="cuda", dtype=torch.float16)
    qc = torch.randn(8, 4, device="cuda")
    out = torch.full((programs, 12, 128), float("nan"), device="cuda")
    options = dict(num_warps=1, **({"maxnreg": maxnreg} if maxnreg else {}))

    def launch() -> None:
        tma_step_kernel[(programs,)](*codes, *scales, qw, qc, out, tokens, steps, stages, **options)

    launch()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        launch()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    us = statistics.median(times)
    read = tokens * (2 * 48 + 2 * 4)
    print(
        f"{programs} programs x {steps} steps: {us:.1f} us (min {min(times):.1f}), {read / us / 1e6:.2f} TB/s"
    )
    # every program stored its 11 accumulators, finite (the running max takes 8 of row 11)
    assert not out[:, :11].isnan().any(), "a program's state is missing or not finite"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--maxnreg", type=int, default=168, help="0: no cap")
    p.add_argument("--out", default="build/spike_tma_step")
    p.add_argument("--time", action="store_true", help="on a GPU: the loop alone at (8, 131072)'s size")
    a = p.parse_args()
    if a.time:
        time_on_gpu(a.stages, a.maxnreg)
        return
    kernel = compile_sm90(a.stages, a.maxnreg)
    usage, sass = disassemble(kernel, pathlib.Path(a.out), "tma_step_kernel")
    loop = loop_instructions(sass)
    print(usage)
    print(f"full-step loop: {len(loop)} instructions per 64-token step")
    spills = sum(bool(re.match(r"(?:@!?U?P\w+\s+)?(STL|LDL)", i)) for i in loop)
    print(f"loop spill instructions: {spills}")
    print(f"shared bytes: {kernel.metadata.shared}")
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in loop]
    for prefix in ("UTMALDG", "LDSM", "LDG", "LDGSTS", "HMMA", "LOP3", "SYNCS", "BAR"):
        print(f"  {prefix}: {sum(o.startswith(prefix) for o in ops)}")


if __name__ == "__main__":
    main()
