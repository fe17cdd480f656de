"""Compile-only spike: the v3 split step cut into a key half and a value half, one warp each.

    python benchmarks/spike_kv_warps.py [--out build/spike_kv_warps]

Not a kernel: each half is compiled on its own (no `warp_specialize` region yet), never launched,
and checked numerically by nothing. It answers the question a warp-specialized v3 depends on, offline:
how many registers and SASS instructions per 64-token step does each half need?

- The key half: key words, scores, the online softmax. It hands p (fp16, [tokens, rows]) and the
  step's rescale factors to the value half through a two-stage shared-memory ring guarded by
  mbarriers.
- The value half: value tiles, the token sums and the value MMAs.

docs/ATTENTION.md says why: the one-warp step (969 instructions, 167 registers, 12 warps per SM)
issues 0.51 instructions per scheduler cycle. Register caps that would allow more warps made ptxas
schedule worse. Two halves of about half the work each might run at far fewer registers without a
cap. Registers are allocated per warpgroup, so a real kernel would pair 4 key warps with 4 value
warps. Both halves reuse v3's own helpers (kernels/wavelet_attention_gluon.py), so their code is
the v3 step's.
"""

from __future__ import annotations

import argparse
import pathlib

import triton

# the v3 kernel's SASS tool, beside this script (run as a script, its folder is on sys.path)
from sass_attention_v3 import disassemble, loop_mix
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from wmoe_compile.kernels import wavelet_attention_gluon as v3

_P_RING = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
_ALPHA_RING = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
_ROWS = gl.constexpr(gl.SliceLayout(0, v3._MMA))  # [8] per query row, as the scores' columns


@gluon.jit
def _exchange():
    """The two-stage ring the halves share: p [2, tokens, 8] fp16, the rescale factors [2, 8], and a
    full and an empty mbarrier per stage."""
    p_ring = gl.allocate_shared_memory(gl.float16, [2, 64, 8], _P_RING)
    alpha_ring = gl.allocate_shared_memory(gl.float32, [2, 8], _ALPHA_RING)
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return p_ring, alpha_ring, full, empty


@gluon.jit
def key_half(
    qw_ptr,  # fp16 [programs, 4, 128] (v3 slot order)
    qc_ptr,  # fp32 [programs, 8]: the two bands' score offsets per row
    kc_ptr,  # int16 code rows [tokens, CODE_ROW]
    ks_ptr,  # fp16 [tokens, 2]
    m_ptr,  # fp32 [programs, 8]
    n_tokens,
    CODE_ROW: gl.constexpr,
    E4: gl.constexpr,
    E2: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    pid = gl.program_id(0)
    qs = gl.arange(0, 16, layout=gl.SliceLayout(1, v3._B))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, v3._B))
    q_rows = qw_ptr + pid * 512 + qr[None, :] * 128 + qs[:, None]
    q_ok = (qr < 4)[None, :]
    q0 = gl.load(q_rows + 0 * 16, mask=q_ok, other=0.0)
    q1 = gl.load(q_rows + 1 * 16, mask=q_ok, other=0.0)
    q2 = gl.load(q_rows + 2 * 16, mask=q_ok, other=0.0)
    q3 = gl.load(q_rows + 3 * 16, mask=q_ok, other=0.0)
    q4 = gl.load(q_rows + 4 * 16, mask=q_ok, other=0.0)
    q5 = gl.load(q_rows + 5 * 16, mask=q_ok, other=0.0)
    q6 = gl.load(q_rows + 6 * 16, mask=q_ok, other=0.0)
    q7 = gl.load(q_rows + 7 * 16, mask=q_ok, other=0.0)
    rows = gl.arange(0, 8, layout=_ROWS)
    qc0 = gl.load(qc_ptr + pid * 16 + rows)
    qc1 = gl.load(qc_ptr + pid * 16 + 8 + rows)
    kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v3._A))
    st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v3._SCALE_PAIRS))
    p_ring, alpha_ring, full, empty = _exchange()
    m_i = gl.full([8], -1.0e30, gl.float32, layout=_ROWS)
    for start in range(0, n_tokens, BLOCK_N):
        step = start // BLOCK_N
        stage = step % 2
        k0, k1 = v3._split_scales(v3._load_scale_pairs(ks_ptr, start + st, 2))
        raw4, raw2 = v3._load_keys(kc_ptr, start + kt, CODE_ROW, E4, E2)
        s = v3._scores(raw4, raw2, k0, k1, q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1, BLOCK_N)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        m_i = m_new
        p = gl.exp2(s - m_i[None, :]).to(gl.float16)
        mbarrier.wait(empty.index(stage), (step // 2 & 1) ^ 1)  # the value half has read this stage
        p_ring.index(stage).store(p)
        alpha_ring.index(stage).store(alpha)
        mbarrier.arrive(full.index(stage), count=1)
    gl.store(m_ptr + pid * 8 + rows, m_i)


@gluon.jit
def value_half(
    vc_ptr,  # int16 code rows [tokens, CODE_ROW]
    vs_ptr,  # fp16 [tokens, 2]
    acc_ptr,  # fp32 [programs, 11, 16, 8]: 8 field accumulators and the 3 token sums
    n_tokens,
    CODE_ROW: gl.constexpr,
    E4: gl.constexpr,
    E2: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    pid = gl.program_id(0)
    vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v3._TOKEN_ROWS))
    st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v3._SCALE_PAIRS))
    v4s = gl.allocate_shared_memory(gl.int16, [1, BLOCK_N, 16], v3._TILE)
    v2s = gl.allocate_shared_memory(gl.int16, [1, BLOCK_N, 16], v3._TILE)
    ring = (v4s, v2s, v4s, v2s)  # no key tiles: KEYS=False leaves the first two unused
    p_ring, alpha_ring, full, empty = _exchange()
    ones = gl.full([16, BLOCK_N], 1.0, gl.float16, layout=v3._A)
    zero = gl.zeros([16, 8], gl.float32, layout=v3._MMA)
    a0 = zero
    a1 = zero
    a2 = zero
    a3 = zero
    a4 = zero
    a5 = zero
    a6 = zero
    a7 = zero
    l_acc = zero
    wsa = zero
    wsb = zero
    slot = gl.arange(0, 16, layout=gl.SliceLayout(1, v3._A))
    upper = (slot >= 8)[:, None]
    upper_rows = (gl.arange(0, 16, layout=gl.SliceLayout(1, v3._MMA)) >= 8)[:, None]
    for start in range(0, n_tokens, BLOCK_N):
        step = start // BLOCK_N
        stage = step % 2
        v3._issue_stage(ring, 0, vc_ptr, vc_ptr, start + vt, CODE_ROW, E4, E2, False, True)
        w0, w1 = v3._split_scales(v3._load_scale_pairs(vs_ptr, start + st, 2))
        mbarrier.wait(full.index(stage), step // 2 & 1)
        p16 = p_ring.index(stage).load(v3._B)
        alpha = alpha_ring.index(stage).load(_ROWS)
        mbarrier.arrive(empty.index(stage), count=1)
        if gl.min(alpha, axis=0) < 1.0:  # a running max grew: rescale (lazy, as v3)
            a0 = a0 * alpha[None, :]
            a1 = a1 * alpha[None, :]
            a2 = a2 * alpha[None, :]
            a3 = a3 * alpha[None, :]
            a4 = a4 * alpha[None, :]
            a5 = a5 * alpha[None, :]
            a6 = a6 * alpha[None, :]
            a7 = a7 * alpha[None, :]
            l_acc = l_acc * alpha[None, :]
            wsa = wsa * alpha[None, :]
            wsb = wsb * alpha[None, :]
        pa = p16 * gl.convert_layout(w0.to(gl.float16), gl.SliceLayout(1, v3._B))[:, None]
        pb = p16 * gl.convert_layout(w1.to(gl.float16), gl.SliceLayout(1, v3._B))[:, None]
        l_acc = mma_v2(ones, p16, l_acc)
        step_a = mma_v2(ones, pa, zero)
        step_b = mma_v2(ones, pb, zero)
        wsa = wsa + step_a
        wsb = wsb + step_b
        async_copy.wait_group(0)
        r4 = v4s.index(0).permute([1, 0]).load(v3._A)
        r2 = v2s.index(0).permute([1, 0]).load(v3._A)
        o0, o1, o2, o3, o4, o5, o6, o7 = v3._band_operands(r4, r2, upper)
        a0 = mma_v2(o0, pa, a0 - v3._C4_0 * step_a)
        a1 = mma_v2(o1, pa, a1 - v3._C4_1 * step_a)
        a2 = mma_v2(o2, pa, a2 - v3._C4_2 * step_a)
        a3 = mma_v2(o3, pa, a3 - v3._C4_3 * step_a)
        a4 = mma_v2(o4, pb, a4 - v3._centre(upper_rows, v3._C2_0, v3._C2_1) * step_b)
        a5 = mma_v2(o5, pb, a5 - v3._centre(upper_rows, v3._C2_2, v3._C2_3) * step_b)
        a6 = mma_v2(o6, pb, a6 - v3._centre(upper_rows, v3._C2_4, v3._C2_5) * step_b)
        a7 = mma_v2(o7, pb, a7 - v3._centre(upper_rows, v3._C2_6, v3._C2_7) * step_b)
    os = gl.arange(0, 16, layout=gl.SliceLayout(1, v3._MMA))
    orow = gl.arange(0, 8, layout=gl.SliceLayout(0, v3._MMA))
    out = acc_ptr + pid * 11 * 128 + os[:, None] * 8 + orow[None, :]
    gl.store(out + 0 * 128, a0)
    gl.store(out + 1 * 128, a1)
    gl.store(out + 2 * 128, a2)
    gl.store(out + 3 * 128, a3)
    gl.store(out + 4 * 128, a4)
    gl.store(out + 5 * 128, a5)
    gl.store(out + 6 * 128, a6)
    gl.store(out + 7 * 128, a7)
    gl.store(out + 8 * 128, l_acc)
    gl.store(out + 9 * 128, wsa)
    gl.store(out + 10 * 128, wsb)


def compile_half(fn, out: pathlib.Path, name: str) -> tuple[str, int, object]:
    """(ptxas resource line, loop instructions, opcode mix) of one half for sm_90, one warp, the
    default codec's code rows (24 int16: the 4-bit band's 16, then the 2-bit band's 8)."""
    constexprs = dict(CODE_ROW=24, E4=0, E2=16, BLOCK_N=64)
    pointers = dict(qw_ptr="*fp16", kc_ptr="*i16", vc_ptr="*i16", ks_ptr="*fp16", vs_ptr="*fp16")
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
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=aligned,
    )
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    usage, sass = disassemble(kernel, out, name)
    mix = loop_mix(sass)
    return usage, sum(mix.values()), mix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/spike_kv_warps")
    args = p.parse_args()
    reason = v3.gluon_reason()
    if reason is not None:
        raise SystemExit(f"v3's helpers cannot be built with triton {triton.__version__}: {reason}")
    out = pathlib.Path(args.out)
    print(f"triton {triton.__version__}, sm_90, one warp each, per 64-token step:")
    for name, fn in (("key_half", key_half), ("value_half", value_half)):
        usage, count, mix = compile_half(fn, out, name)
        top = ", ".join(f"{op} {n}" for op, n in mix.most_common(8))
        print(f"{name}: {usage}\n  loop {count} instructions: {top}")


if __name__ == "__main__":
    main()
