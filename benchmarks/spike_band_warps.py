"""Compile-only spike: a two-warp split step where each warp owns one band of the codes.

    python benchmarks/spike_band_warps.py [--maxnreg 0] [--out build/spike_band_warps]

Not a kernel: no tail masks, exact tokens, partial outputs or numeric check, and it is never
launched. It answers one question before a kernel is built, offline: how many registers and SASS
instructions per 64-token step does a warp need when the band is a batch dimension spread over two
warps? Each warp then holds half the accumulators, query operands and code words. What the warps
share (the scores) meets through shared memory once a step, and both warps run the softmax. The v3
kernel (kernels/wavelet_attention_gluon.py) is the one-warp baseline: 167 registers, 969 loop
instructions per step (Triton 3.6). benchmarks/RESULTS.md, eleventh session, says why this is
the next thing to measure.

Layout facts it relies on (offline, Triton 3.6 and 3.9): mma_v2 takes rank-3 operands, and an
NVMMADistributedLayout with warps_per_cta [2, 1, 1] gives warp w batch w. The two bands' fields sit
at different bit positions. The 4-bit band's operand o is field o (bits 4o..4o+3) of 16 elements.
The 2-bit band's operand o holds fields 2o (rows 0-7) and 2o + 1 (rows 8-15) of 8 elements, twice.
Both read their bits after the same shift (0 for o < 2, 8 after), so one LOP3 per pair with a
per-(band, row half) mask in a register serves both warps.
"""

from __future__ import annotations

# the v3 kernel's SASS tool, beside this script (run as a script, its folder is on sys.path)
from sass_attention_v3 import spike_main
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.9 renamed thread_barrier

_MMA = gl.constexpr(
    gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 1, 1], instr_shape=[1, 16, 8])
)
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
_S = gl.constexpr(gl.SliceLayout(0, _MMA.value))  # [tokens, rows], the same in both warps
# [band, tokens, 16 int16] value tiles, 8-byte copies, warp w copies band w
_COPY = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 8, 4], [2, 1, 1], [2, 1, 0]))
_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
# [band, tokens, rows] partial scores read back whole by each warp: the accumulator layout of one
# warp's [64, 8] tile (reg 0 -> row 2t + 1, reg 1 -> token + 8, regs 2-3 -> token + 16 / + 32;
# lanes 0-1 -> rows 2t, lanes 2-4 -> token g), the band in a register, the warps a broadcast
_BOTH = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 8, 0], [0, 16, 0], [0, 32, 0], [1, 0, 0]],
        lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
        warp_bases=[[0, 0, 0]],
        block_bases=[],
        shape=[2, 64, 8],
    )
)
_XS = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
_MOVM = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
# (x >> shift) & mask | 0x6400 on two packed int16 elements, mask from a register
_FIELD = gl.constexpr("lop3.b32 $0, $1, $2, 0x64006400, 0xEA;")
_FIELD_HI = gl.constexpr("{ .reg .b32 s; shr.u32 s, $1, 8; lop3.b32 $0, s, $2, 0x64006400, 0xEA; }")


@gluon.jit
def _field(raw, mask, HI: gl.constexpr):
    if HI:
        return gl.inline_asm_elementwise(
            _FIELD_HI, "=r,r,r", [raw, mask], dtype=gl.float16, is_pure=True, pack=2
        )
    return gl.inline_asm_elementwise(_FIELD, "=r,r,r", [raw, mask], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _masks(band, upper, o: gl.constexpr):
    """Operand o's field mask per (band, row half): 4-bit band 0xF << 4 (o % 2); 2-bit band
    0x3 << (4 (o % 2) + 2 upper)."""
    four = gl.full(band.shape, 0xF << (4 * (o % 2)), gl.int16, layout=band.type.layout)
    two = gl.where(upper, 0xC << (4 * (o % 2)), 0x3 << (4 * (o % 2))).to(gl.int16)
    return gl.where(band == 0, four, two)


@gluon.jit
def _to_operand(p3):
    """[band, tokens, rows] fp16 in the accumulator layout -> the value MMAs' B operand: one
    movmatrix per 8 x 8 block, then reshapes and a permute that only restate the registers."""
    moved = gl.inline_asm_elementwise(_MOVM, "=r,r", [p3], dtype=gl.float16, is_pure=True, pack=2)
    blocks = gl.permute(gl.reshape(moved, [2, 8, 8, 8]), [0, 1, 3, 2])
    return gl.convert_layout(gl.reshape(blocks, [2, 64, 8]), _B, assert_trivial=True)


@gluon.jit
def _operands(raw, band, upper):
    o0 = _field(raw, _masks(band, upper, 0), False)
    o1 = _field(raw, _masks(band, upper, 1), False)
    o2 = _field(raw, _masks(band, upper, 2), True)
    o3 = _field(raw, _masks(band, upper, 3), True)
    return o0, o1, o2, o3


@gluon.jit
def spike_kernel(
    qw_ptr,  # fp16 [programs, 2 bands, 4 operands, 16, 8]
    qc_ptr,  # fp32 [programs, 2, 8]
    kc_ptr,  # int16 code rows [tokens, 24]: elements 0-15 the 4-bit band, 16-23 the 2-bit band
    vc_ptr,
    ks_ptr,  # fp16 [tokens, 2] band scales
    vs_ptr,
    acc_ptr,  # fp32 [programs, 2, 4, 16, 8]
    m_ptr,
    n_tokens,
    BLOCK_N: gl.constexpr,
):
    pid = gl.program_id(0)
    # ---- loop invariants: each warp's band, its query operands and score offset
    kb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A)))
    kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A)))
    kj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A)))
    k_band = kb[:, None, None] + 0 * kt[None, :, None] + 0 * kj[None, None, :]
    k_upper = (kj >= 8)[None, None, :] & (k_band >= 0)
    k_elem = gl.where(kb[:, None, None] == 0, kj[None, None, :], 16 + kj[None, None, :] % 8)
    qb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _B)))
    qs = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _B)))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _B)))
    q_base = qw_ptr + pid * 1024 + qb[:, None, None] * 512 + qs[None, :, None] * 8 + qr[None, None, :]
    q0 = gl.load(q_base + 0 * 128)
    q1 = gl.load(q_base + 1 * 128)
    q2 = gl.load(q_base + 2 * 128)
    q3 = gl.load(q_base + 3 * 128)
    mb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MMA)))
    mt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA)))
    mr = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MMA)))
    qc = gl.load(qc_ptr + pid * 16 + mb[:, None, None] * 8 + mr[None, None, :]) + gl.zeros(
        [2, BLOCK_N, 8], gl.float32, layout=_MMA
    )
    # value tiles: smem [band, tokens, 16], read back as [band, 16 elements, tokens]
    cb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _COPY)))
    ct = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, _COPY)))
    ce = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _COPY)))
    c_elem = gl.where(cb[:, None, None] == 0, ce[None, None, :], 16 + ce[None, None, :] % 8)
    c_offs = ct[None, :, None] * 24 + c_elem
    tiles = gl.allocate_shared_memory(gl.int16, [2, BLOCK_N, 16], _TILE)
    exchange = gl.allocate_shared_memory(gl.float32, [2, 2, BLOCK_N, 8], _XS)
    vb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _A)))
    vj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A)))
    vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A)))
    v_band = vb[:, None, None] + 0 * vj[None, :, None] + 0 * vt[None, None, :]
    v_upper = (vj >= 8)[None, :, None] & (v_band >= 0)
    ones = gl.full([2, 16, BLOCK_N], 1.0, gl.float16, layout=_A)
    sb = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MMA)))
    acc_zero = gl.zeros([2, 16, 8], gl.float32, layout=_MMA)
    a0 = acc_zero
    a1 = acc_zero
    a2 = acc_zero
    a3 = acc_zero
    sums = acc_zero
    l_acc = acc_zero
    m_i = gl.full([8], -1.0e30, gl.float32, layout=gl.SliceLayout(0, _S))
    for start in range(0, n_tokens, BLOCK_N):
        krow = kc_ptr + start * 24
        _async_load(tiles, vc_ptr + start * 24 + c_offs)
        async_copy.commit_group()
        raw = gl.load(krow + kt[None, :, None] * 24 + k_elem)  # [2, tokens, 16]: warp w, band w
        k0, k1, k2, k3 = _operands(raw, k_band, k_upper)
        part = mma_v2(k0, q0, qc)
        part = mma_v2(k1, q1, part)
        part = mma_v2(k2, q2, part)
        part = mma_v2(k3, q3, part)
        kscale = gl.load(ks_ptr + start * 2 + mt[None, :, None] * 2 + sb[:, None, None]).to(gl.float32)
        # the bands' partial scores meet in shared memory: one store, one barrier, one load (two
        # buffers, so the next step's store needs no barrier of its own)
        xs = exchange.index(start // BLOCK_N % 2)
        xs.store(part * kscale)
        _barrier()
        s = gl.convert_layout(gl.sum(xs.load(_BOTH), axis=0), _S, assert_trivial=True)  # [tokens, rows]
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        if gl.max(m_new - m_i, axis=0) > 0:
            alpha = gl.convert_layout(gl.exp2(m_i - m_new), gl.SliceLayout(0, gl.SliceLayout(1, _MMA)))
            alpha = alpha[None, None, :]
            a0 = a0 * alpha
            a1 = a1 * alpha
            a2 = a2 * alpha
            a3 = a3 * alpha
            sums = sums * alpha
            l_acc = l_acc * alpha
            m_i = m_new
        p = gl.exp2(s - m_i[None, :])
        p3 = gl.expand_dims(p, 0) + gl.zeros([2, BLOCK_N, 8], gl.float32, layout=_MMA)  # each warp's copy
        vscale = gl.load(vs_ptr + start * 2 + mt[None, :, None] * 2 + sb[:, None, None]).to(gl.float32)
        pw = _to_operand((p3 * vscale).to(gl.float16))
        step = mma_v2(ones, pw, acc_zero)
        sums = sums + step
        l_acc = mma_v2(ones, _to_operand(p3.to(gl.float16)), l_acc)
        async_copy.wait_group(0)
        rv = tiles.permute([0, 2, 1]).load(_A)  # [2, 16 elements, tokens]
        v0, v1, v2, v3 = _operands(rv, v_band, v_upper)
        a0 = mma_v2(v0, pw, a0 - 1030.0 * step)
        a1 = mma_v2(v1, pw, a1 - 1100.0 * step)
        a2 = mma_v2(v2, pw, a2 - 1030.0 * step)
        a3 = mma_v2(v3, pw, a3 - 1100.0 * step)
    ob = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, _MMA)))
    os = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA)))
    orow = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MMA)))
    out = acc_ptr + pid * 1024 + ob[:, None, None] * 512 + os[None, :, None] * 8 + orow[None, None, :]
    gl.store(out + 0 * 128, a0 + sums)
    gl.store(out + 1 * 128, a1 + l_acc)
    gl.store(out + 2 * 128, a2)
    gl.store(out + 3 * 128, a3)
    gl.store(m_ptr + pid * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, _S)), m_i)


def main() -> None:
    pointers = dict(
        qw_ptr="*fp16", qc_ptr="*fp32", kc_ptr="*i16", vc_ptr="*i16", ks_ptr="*fp16", vs_ptr="*fp16"
    )
    spike_main(spike_kernel, pointers, 2, "spike_band_warps", __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
