"""Spike: the v3 split step cut into a key half and a value half.

    python benchmarks/spike_kv_warps.py [--value-regs 88] [--maxnreg 80] [--out build/spike_kv_warps]

Not a kernel: checked numerically by nothing. This script compiles, offline, and answers the
questions a warp-specialized v3 depends on:

- how many registers and SASS instructions per 64-token step each half needs (each half compiled
  alone, one warp);
- whether Gluon builds both halves as the partitions of one kernel (`specialized_kernel`).

`specialized_kernel` runs 4 streams per partition inside `gl.warp_specialize`, the stream a batch
dimension on the warps. Its cache layout is artificial (each stream's tokens contiguous, `stride`
apart) and it has no tail step. `benchmarks/probe_kv_warps.py` times it on a GPU.

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
from sass_attention_v3 import compile_gluon_sm90, disassemble, loop_mix
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from wmoe_compile.kernels import wavelet_attention_gluon as v3

_async_load = v3._async_load

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


# ---- the two halves as partitions of one kernel: 4 streams side by side, the stream a batch
# dimension on the warps (registers are allocated per warpgroup, so partitions come in 4 warps)
STREAMS = gl.constexpr(4)
_MMA3 = gl.constexpr(
    gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[STREAMS.value, 1, 1], instr_shape=[1, 16, 8])
)
_A3 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA3.value, k_width=2))
_B3 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA3.value, k_width=2))
_ROWS3 = gl.constexpr(gl.SliceLayout(1, _MMA3.value))  # [streams, 8 rows]
_TOKENS3 = gl.constexpr(gl.SliceLayout(2, _MMA3.value))  # [streams, tokens]
_COPY3 = gl.constexpr(
    gl.BlockedLayout([1, 1, 4], [1, 8, 4], [STREAMS.value, 1, 1], [2, 1, 0])
)  # 8-byte copies
_PAIRS3 = gl.constexpr(gl.BlockedLayout([1, 1, 2], [1, 32, 1], [STREAMS.value, 1, 1], [2, 1, 0]))
_TILE3 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))


@gluon.jit
def _arange3(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along `dim` of a rank-3 `layout`, expanded to rank 3 (size 1 elsewhere)."""
    if dim == 0:
        return gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))[:, None, None]
    elif dim == 1:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))[None, :, None]
    else:
        return gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))[None, None, :]


@gluon.jit
def _scale_pair3(scales_ptr, stride, start, BLOCK_N: gl.constexpr):
    """The band scales of every stream's BLOCK_N tokens, as two [streams, tokens] fp32 tensors in the
    scores' token layout (program p's stream s is stream 4 p + s, `stride` tokens each)."""
    s3 = gl.program_id(0) * STREAMS + _arange3(STREAMS, 0, _PAIRS3)
    t3 = _arange3(BLOCK_N, 1, _PAIRS3)
    b3 = _arange3(2, 2, _PAIRS3)
    pair = gl.load(scales_ptr + (s3 * stride + start + t3) * 2 + b3).to(gl.float32)
    lo, hi = gl.split(pair)
    return gl.convert_layout(lo, _TOKENS3), gl.convert_layout(hi, _TOKENS3)


@gluon.jit
def _key_partition(
    qw_ptr, qc_ptr, kc_ptr, ks_ptr, m_ptr, exchange, stride, first, n_tokens, BLOCK_N: gl.constexpr
):
    """Default partition, 4 warps: warp s runs stream s's keys, scores and online softmax, and hands p
    and the rescale factors to the value partition stage by stage."""
    p_ring, alpha_ring, full, empty = exchange
    qs = _arange3(16, 1, _B3)
    qr = _arange3(8, 2, _B3)
    qst = gl.program_id(0) * STREAMS + _arange3(STREAMS, 0, _B3)
    q_rows = qw_ptr + qst * 512 + qr * 128 + qs
    q_ok = qr < 4
    q0 = gl.load(q_rows + 0 * 16, mask=q_ok, other=0.0)
    q1 = gl.load(q_rows + 1 * 16, mask=q_ok, other=0.0)
    q2 = gl.load(q_rows + 2 * 16, mask=q_ok, other=0.0)
    q3 = gl.load(q_rows + 3 * 16, mask=q_ok, other=0.0)
    q4 = gl.load(q_rows + 4 * 16, mask=q_ok, other=0.0)
    q5 = gl.load(q_rows + 5 * 16, mask=q_ok, other=0.0)
    q6 = gl.load(q_rows + 6 * 16, mask=q_ok, other=0.0)
    q7 = gl.load(q_rows + 7 * 16, mask=q_ok, other=0.0)
    rs = gl.arange(0, STREAMS, layout=gl.SliceLayout(1, _ROWS3))[:, None]
    rr = gl.arange(0, 8, layout=gl.SliceLayout(0, _ROWS3))[None, :]
    qc0 = gl.load(qc_ptr + (gl.program_id(0) * STREAMS + rs) * 16 + rr)
    qc1 = gl.load(qc_ptr + (gl.program_id(0) * STREAMS + rs) * 16 + 8 + rr)
    ks3 = gl.program_id(0) * STREAMS + _arange3(STREAMS, 0, _A3)
    kt3 = _arange3(BLOCK_N, 1, _A3)
    kj3 = _arange3(16, 2, _A3)
    upper = (kj3 >= 8) & (ks3 >= 0)
    zero = gl.zeros([STREAMS, BLOCK_N, 8], gl.float32, layout=_MMA3)
    m_i = gl.full([STREAMS, 8], -1.0e30, gl.float32, layout=_ROWS3)
    for start in range(0, n_tokens, BLOCK_N):
        step = start // BLOCK_N
        stage = step % 2
        k0, k1 = _scale_pair3(ks_ptr, stride, first + start, BLOCK_N)
        rows = kc_ptr + (ks3 * stride + first + start + kt3) * 24
        raw4 = gl.load(rows + kj3)
        raw2 = gl.load(rows + 16 + kj3 % 8)
        o0, o1, o2, o3, o4, o5, o6, o7 = v3._band_operands(raw4, raw2, upper)
        sa = mma_v2(o0, q0, zero)
        sa = mma_v2(o1, q1, sa)
        sa = mma_v2(o2, q2, sa)
        sa = mma_v2(o3, q3, sa)
        sb = mma_v2(o4, q4, zero)
        sb = mma_v2(o5, q5, sb)
        sb = mma_v2(o6, q6, sb)
        sb = mma_v2(o7, q7, sb)
        s = (sa + qc0[:, None, :]) * k0[:, :, None] + (sb + qc1[:, None, :]) * k1[:, :, None]
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        m_i = m_new
        p = gl.exp2(s - m_i[:, None, :]).to(gl.float16)
        mbarrier.wait(empty.index(stage), (step // 2 & 1) ^ 1)
        p_ring.index(stage).store(p)
        alpha_ring.index(stage).store(alpha)
        mbarrier.arrive(full.index(stage), count=1)
    gl.store(m_ptr + (gl.program_id(0) * STREAMS + rs) * 8 + rr, m_i)


@gluon.jit
def _value_partition(vc_ptr, vs_ptr, acc_ptr, exchange, stride, first, n_tokens, BLOCK_N: gl.constexpr):
    """Worker partition, 4 warps: warp s runs stream s's value tiles, token sums and value MMAs."""
    p_ring, alpha_ring, full, empty, v4s, v2s = exchange
    cs3 = gl.program_id(0) * STREAMS + _arange3(STREAMS, 0, _COPY3)
    ct3 = _arange3(BLOCK_N, 1, _COPY3)
    ce3 = _arange3(16, 2, _COPY3)
    ones = gl.full([STREAMS, 16, BLOCK_N], 1.0, gl.float16, layout=_A3)
    zero = gl.zeros([STREAMS, 16, 8], gl.float32, layout=_MMA3)
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
    upper = (_arange3(16, 1, _A3) >= 8) & (_arange3(STREAMS, 0, _A3) >= 0)
    upper_rows = (_arange3(16, 1, _MMA3) >= 8) & (_arange3(STREAMS, 0, _MMA3) >= 0)
    for start in range(0, n_tokens, BLOCK_N):
        step = start // BLOCK_N
        stage = step % 2
        rows = vc_ptr + (cs3 * stride + first + start + ct3) * 24
        _async_load(v4s, rows + ce3, cache_modifier=".ca")
        _async_load(v2s, rows + 16 + ce3 % 8, cache_modifier=".ca")
        async_copy.commit_group()
        w0, w1 = _scale_pair3(vs_ptr, stride, first + start, BLOCK_N)
        mbarrier.wait(full.index(stage), step // 2 & 1)
        p16 = p_ring.index(stage).load(_B3)
        alpha = alpha_ring.index(stage).load(_ROWS3)
        mbarrier.arrive(empty.index(stage), count=1)
        if gl.min(gl.min(alpha, axis=1), axis=0) < 1.0:  # a running max grew: rescale (lazy, as v3)
            a0 = a0 * alpha[:, None, :]
            a1 = a1 * alpha[:, None, :]
            a2 = a2 * alpha[:, None, :]
            a3 = a3 * alpha[:, None, :]
            a4 = a4 * alpha[:, None, :]
            a5 = a5 * alpha[:, None, :]
            a6 = a6 * alpha[:, None, :]
            a7 = a7 * alpha[:, None, :]
            l_acc = l_acc * alpha[:, None, :]
            wsa = wsa * alpha[:, None, :]
            wsb = wsb * alpha[:, None, :]
        pa = p16 * gl.convert_layout(w0.to(gl.float16), gl.SliceLayout(2, _B3))[:, :, None]
        pb = p16 * gl.convert_layout(w1.to(gl.float16), gl.SliceLayout(2, _B3))[:, :, None]
        l_acc = mma_v2(ones, p16, l_acc)
        step_a = mma_v2(ones, pa, zero)
        step_b = mma_v2(ones, pb, zero)
        wsa = wsa + step_a
        wsb = wsb + step_b
        async_copy.wait_group(0)
        r4 = v4s.permute([0, 2, 1]).load(_A3)
        r2 = v2s.permute([0, 2, 1]).load(_A3)
        o0, o1, o2, o3, o4, o5, o6, o7 = v3._band_operands(r4, r2, upper)
        a0 = mma_v2(o0, pa, a0 - v3._C4_0 * step_a)
        a1 = mma_v2(o1, pa, a1 - v3._C4_1 * step_a)
        a2 = mma_v2(o2, pa, a2 - v3._C4_2 * step_a)
        a3 = mma_v2(o3, pa, a3 - v3._C4_3 * step_a)
        a4 = mma_v2(o4, pb, a4 - v3._centre(upper_rows, v3._C2_0, v3._C2_1) * step_b)
        a5 = mma_v2(o5, pb, a5 - v3._centre(upper_rows, v3._C2_2, v3._C2_3) * step_b)
        a6 = mma_v2(o6, pb, a6 - v3._centre(upper_rows, v3._C2_4, v3._C2_5) * step_b)
        a7 = mma_v2(o7, pb, a7 - v3._centre(upper_rows, v3._C2_6, v3._C2_7) * step_b)
    stream = gl.program_id(0) * STREAMS + _arange3(STREAMS, 0, _MMA3)
    out = acc_ptr + stream * 11 * 128 + _arange3(16, 1, _MMA3) * 8 + _arange3(8, 2, _MMA3)
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


@gluon.jit
def specialized_kernel(
    qw_ptr,  # fp16 [streams, 4 rows, 128]: the prologue's query in v3 slot order
    qc_ptr,  # fp32 [streams, 16]: per row, the 4-bit band's score offset (0-7), the 2-bit band's (8-15)
    kc_ptr,  # int16 code rows [streams, stride tokens, 24]: program p runs streams 4 p .. 4 p + 3
    ks_ptr,  # fp16 [streams, stride tokens, 2]
    vc_ptr,
    vs_ptr,
    m_ptr,  # fp32 [streams, 8]
    acc_ptr,  # fp32 [streams, 11, 16, 8]
    stride,  # tokens per stream in the buffers (a cache's capacity)
    first,  # each stream's first token
    n_tokens,  # tokens each stream runs from `first` (a multiple of BLOCK_N: no tail step)
    BLOCK_N: gl.constexpr,
    VALUE_REGS: gl.constexpr,
):
    """One program = 4 streams: the key partition (the kernel's own 4 warps) and the value
    partition (4 more warps, VALUE_REGS registers each), meeting in a two-stage ring."""
    p_ring = gl.allocate_shared_memory(gl.float16, [2, STREAMS, BLOCK_N, 8], _TILE3)
    alpha_ring = gl.allocate_shared_memory(
        gl.float32, [2, STREAMS, 8], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    )
    full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(full.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    v4s = gl.allocate_shared_memory(gl.int16, [STREAMS, BLOCK_N, 16], _TILE3)
    v2s = gl.allocate_shared_memory(gl.int16, [STREAMS, BLOCK_N, 16], _TILE3)
    gl.warp_specialize(
        [
            (
                _key_partition,
                (
                    qw_ptr,
                    qc_ptr,
                    kc_ptr,
                    ks_ptr,
                    m_ptr,
                    (p_ring, alpha_ring, full, empty),
                    stride,
                    first,
                    n_tokens,
                    BLOCK_N,
                ),
            ),
            (
                _value_partition,
                (
                    vc_ptr,
                    vs_ptr,
                    acc_ptr,
                    (p_ring, alpha_ring, full, empty, v4s, v2s),
                    stride,
                    first,
                    n_tokens,
                    BLOCK_N,
                ),
            ),
        ],
        [STREAMS],
        [VALUE_REGS],
    )


def _compile_sm90(fn, constexprs: dict, options: dict):
    """fn compiled for sm_90: its pointers typed by name (int16 code rows, fp16 queries and scales,
    fp32 otherwise), 16-byte aligned as the JIT specialises them, other arguments i32."""
    pointers = dict(qw_ptr="*fp16", kc_ptr="*i16", vc_ptr="*i16", ks_ptr="*fp16", vs_ptr="*fp16")
    return compile_gluon_sm90(fn, pointers, constexprs, options)


def compile_specialized(out: pathlib.Path, value_regs: int, maxnreg: int) -> tuple[str, int, int]:
    """(ptxas resource line, warps, shared bytes) of the warp-specialized kernel for sm_90."""
    kernel = _compile_sm90(
        specialized_kernel,
        dict(BLOCK_N=64, VALUE_REGS=value_regs),
        dict(num_warps=STREAMS.value, maxnreg=maxnreg),
    )
    usage, _ = disassemble(kernel, out, "specialized_kernel")
    return usage, kernel.metadata.num_warps, kernel.metadata.shared


def compile_half(fn, out: pathlib.Path, name: str) -> tuple[str, int, object]:
    """(ptxas resource line, loop instructions, opcode mix) of one half for sm_90, one warp, the
    default codec's code rows (24 int16: the 4-bit band's 16, then the 2-bit band's 8)."""
    kernel = _compile_sm90(fn, dict(CODE_ROW=24, E4=0, E2=16, BLOCK_N=64), dict(num_warps=1))
    usage, sass = disassemble(kernel, out, name)
    mix = loop_mix(sass)
    return usage, sum(mix.values()), mix


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--value-regs", type=int, default=88, help="the value partition's setmaxnreg")
    p.add_argument("--maxnreg", type=int, default=80, help="the kernel's register budget per thread")
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
    # both halves in one kernel, 4 streams each. Registers are allocated per warp in units of 256:
    # at 80 a program takes 8 x 2,560 = 20K, so three (12 streams, 24 warps) fit an SM's 64K; at 84
    # (2,816 a warp) only two did (Nsight, fifteenth session)
    usage, warps, shared = compile_specialized(out, args.value_regs, args.maxnreg)
    print(
        f"specialized_kernel ({warps} warps: 4 key, 4 value at {args.value_regs} registers; maxnreg "
        f"{args.maxnreg}): {usage}; shared {shared} B"
    )


if __name__ == "__main__":
    main()
