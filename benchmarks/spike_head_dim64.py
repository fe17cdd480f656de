"""Compile-only spike: one warp's 64-token step of a Gluon split kernel at head_dim 64 (gpt-oss).

    python benchmarks/spike_head_dim64.py [--maxnreg 0] [--out build/spike_head_dim64]

Not a kernel: no tail masks, exact tokens, sink logits, partial outputs or numeric check, and it is
never launched. It answers, offline, the question docs/ATTENTION.md ("Where a next gain would have
to come from") asks before a head_dim-64 version of the v3 kernel is built: how many registers and
SASS instructions does its step take? v2 runs head_dim 64 today at 185 registers and 3.1x the
compressed floor (forty-sixth session); v3 at head_dim 128 takes 168 registers and about 728 loop
instructions a step for twice the bytes.

The default codec at head_dim 64: a code row is 12 int16 elements, 0-7 the 4-bit band (32
coefficients), 8-11 the 2-bit band (32). Each band fills two 16-slot MMA operands with no padding,
the same way for keys (A: [tokens, slots], loaded from global memory straight into the fragment)
and values (A: [slots, tokens], through a shared-memory tile read back transposed):

- 4-bit band, operand o: slots 0-7 are field 2o of elements 0-7, slots 8-15 field 2o + 1 (the v3
  kernel's 2-bit band at head_dim 128 has this shape); one shift for the operand (0, then 8);
- 2-bit band, operand o: slot j is field 4o + j // 4 of element j % 4, so the field varies across
  a fragment's lanes: the mask is a register per (slot), one LOP3 per fp16 pair as before.

Values are centred through the MMA's accumulator input with a centre per slot row (1024 + mid of
the row's field), and the token sums come from ones-operand MMAs, as in v3. Key words and scale
pairs are loaded as 4-byte words.

Found (forty-sixth session, Triton 3.6): 673 loop instructions a step at 128 registers (651 at 150
with --maxnreg 168), against v3's 728 at head_dim 128 for twice the bytes: the field work halves
(130 LOP3, 44 HMMA), the per-(token, query row) work (scales, max, exp2, rescales, p's conversion,
loads and addresses) does not, so such a kernel would be issue-bound at about v3's speed per token
(docs/ATTENTION.md, "Where a next gain would have to come from").
"""

from __future__ import annotations

# the v3 kernel's SASS tool, beside this script (run as a script, its folder is on sys.path)
from sass_attention_v3 import spike_main
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from wmoe_compile.kernels.attention_fields import MODE_MAGIC, stacked_field_asm

_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

ROW = gl.constexpr(12)  # int16 elements a code row: 8 of the 4-bit band, 4 of the 2-bit band

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
# [tokens, 16 int16] value tiles, 8-byte copies (4 elements a lane)
_COPY = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))
_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
_MOVM = gl.constexpr("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;")
# (x >> shift) & mask | 0x6400 on two packed int16 elements, the mask a register: the package's
# stacked-operand PTX (v2's)
_FIELDS = gl.constexpr((stacked_field_asm(MODE_MAGIC, 0), stacked_field_asm(MODE_MAGIC, 8)))


@gluon.jit
def _field(raw, mask, HI: gl.constexpr):
    asm: gl.constexpr = _FIELDS[1 if HI else 0]
    return gl.inline_asm_elementwise(asm, "=r,r,r", [raw, mask], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _positions(slot, BAND: gl.constexpr):
    """Bit position of each slot's field after its operand's shift: 4-bit band 4 * (slot >= 8),
    2-bit band 2 * (slot // 4) (the same for both of a band's operands)."""
    if BAND == 0:
        return gl.where(slot >= 8, 4, 0)
    return (slot // 4) * 2


@gluon.jit
def _mask(slot, BAND: gl.constexpr):
    bits = 0xF if BAND == 0 else 0x3
    return (gl.full(slot.shape, bits, gl.int32, layout=slot.type.layout) << _positions(slot, BAND)).to(
        gl.int16
    )


@gluon.jit
def _centre(slot, BAND: gl.constexpr):
    """1024 + mid of each slot row's field (what the MMA's accumulator input takes off)."""
    bits = 4 if BAND == 0 else 2
    mid = gl.full(slot.shape, 1, gl.int32, layout=slot.type.layout) << (_positions(slot, BAND) + bits - 1)
    return mid.to(gl.float32) + 1024.0


@gluon.jit
def _key_words(pointers):
    """[tokens, 16] int16 of A-fragment pointers whose column pairs (2t, 2t + 1) are adjacent
    elements: loaded as one int32 word a pair, then split back into the fragment's registers
    (assert_trivial proves no data moves), as the v3 kernel's _load_key_words / _key_elements."""
    BLOCK_N: gl.constexpr = pointers.shape[0]
    first, _ = gl.split(gl.reshape(pointers, [BLOCK_N, 8, 2]))
    words = gl.load(first.to(gl.pointer_type(gl.int32), bitcast=True))
    pairs = gl.join(words.to(gl.int16), (words >> 16).to(gl.int16))
    return gl.convert_layout(gl.reshape(pairs, [BLOCK_N, 16]), _A, assert_trivial=True)


@gluon.jit
def _scale_pair(pointers):
    """A token's two band scales (fp16, adjacent) by one 4-byte load, as fp32."""
    word = gl.load(pointers.to(gl.pointer_type(gl.int32), bitcast=True))
    low = (word & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
    high = (word >> 16).to(gl.int16).to(gl.float16, bitcast=True)
    return low.to(gl.float32), high.to(gl.float32)


@gluon.jit
def _to_operand(p):
    """[tokens, rows] fp16 in the accumulator layout -> the value MMAs' B operand: one movmatrix
    per 8 x 8 block, then reshapes and a permute that only restate the registers."""
    moved = gl.inline_asm_elementwise(_MOVM, "=r,r", [p], dtype=gl.float16, is_pure=True, pack=2)
    blocks = gl.permute(gl.reshape(moved, [8, 8, 8]), [0, 2, 1])
    return gl.convert_layout(gl.reshape(blocks, [64, 8]), _B, assert_trivial=True)


@gluon.jit
def spike_kernel(
    qw_ptr,  # fp16 [programs, 4 operands, 16, 8]: the query in key-slot order
    qc_ptr,  # fp32 [programs, 2 bands, 8]: the score offsets
    kc_ptr,  # int16 code rows [tokens, 12]
    vc_ptr,
    ks_ptr,  # fp16 [tokens, 2] band scales
    vs_ptr,
    acc_ptr,  # fp32 [programs, 6, 16, 8]: 4 value operands, the two bands' token sums
    m_ptr,
    n_tokens,
    BLOCK_N: gl.constexpr,
):
    pid = gl.program_id(0)
    # ---- loop invariants: key element and field mask per fragment column, query operands
    kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _A))
    kj = gl.arange(0, 16, layout=gl.SliceLayout(0, _A))
    k4 = kt[:, None] * ROW + (kj % 8)[None, :]
    k2 = kt[:, None] * ROW + (8 + kj % 4)[None, :]
    zero_k = gl.zeros([BLOCK_N, 16], gl.int16, layout=_A)
    k_mask4 = _mask(kj, 0)[None, :] + zero_k
    k_mask2 = _mask(kj, 1)[None, :] + zero_k
    qs = gl.arange(0, 16, layout=gl.SliceLayout(1, _B))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, _B))
    q_base = qw_ptr + pid * 512 + qs[:, None] * 8 + qr[None, :]
    q0 = gl.load(q_base + 0 * 128)
    q1 = gl.load(q_base + 1 * 128)
    q2 = gl.load(q_base + 2 * 128)
    q3 = gl.load(q_base + 3 * 128)
    mt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _MMA))
    mr = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))
    zero_s = gl.zeros([BLOCK_N, 8], gl.float32, layout=_MMA)
    qc4 = gl.load(qc_ptr + pid * 16 + mr)[None, :] + zero_s
    qc2 = gl.load(qc_ptr + pid * 16 + 8 + mr)[None, :] + zero_s
    # value tiles: smem [tokens, 16] per band, read back as [16 slots, tokens]
    ct = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _COPY))
    ce = gl.arange(0, 16, layout=gl.SliceLayout(0, _COPY))
    c4 = ct[:, None] * ROW + (ce % 8)[None, :]
    c2 = ct[:, None] * ROW + (8 + ce % 4)[None, :]
    tile4 = gl.allocate_shared_memory(gl.int16, [BLOCK_N, 16], _TILE)
    tile2 = gl.allocate_shared_memory(gl.int16, [BLOCK_N, 16], _TILE)
    vj = gl.arange(0, 16, layout=gl.SliceLayout(1, _A))
    zero_v = gl.zeros([16, BLOCK_N], gl.int16, layout=_A)
    v_mask4 = _mask(vj, 0)[:, None] + zero_v
    v_mask2 = _mask(vj, 1)[:, None] + zero_v
    aj = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
    centre4 = _centre(aj, 0)[:, None]
    centre2 = _centre(aj, 1)[:, None]
    ones = gl.full([16, BLOCK_N], 1.0, gl.float16, layout=_A)
    acc_zero = gl.zeros([16, 8], gl.float32, layout=_MMA)
    a0 = acc_zero
    a1 = acc_zero
    a2 = acc_zero
    a3 = acc_zero
    sums4 = acc_zero
    sums2 = acc_zero
    l_acc = acc_zero
    m_i = gl.full([8], -1.0e30, gl.float32, layout=gl.SliceLayout(0, _MMA))
    for start in range(0, n_tokens, BLOCK_N):
        _async_load(tile4, vc_ptr + start * ROW + c4)
        _async_load(tile2, vc_ptr + start * ROW + c2)
        async_copy.commit_group()
        raw4 = _key_words(kc_ptr + start * ROW + k4)
        raw2 = _key_words(kc_ptr + start * ROW + k2)
        s4 = mma_v2(_field(raw4, k_mask4, False), q0, qc4)
        s4 = mma_v2(_field(raw4, k_mask4, True), q1, s4)
        s2 = mma_v2(_field(raw2, k_mask2, False), q2, qc2)
        s2 = mma_v2(_field(raw2, k_mask2, True), q3, s2)
        ks4, ks2 = _scale_pair(ks_ptr + start * 2 + mt * 2)
        s = s4 * ks4[:, None] + s2 * ks2[:, None]
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)[None, :]  # every step (the tuned v3's rescale)
        a0 = a0 * alpha
        a1 = a1 * alpha
        a2 = a2 * alpha
        a3 = a3 * alpha
        sums4 = sums4 * alpha
        sums2 = sums2 * alpha
        l_acc = l_acc * alpha
        m_i = m_new
        p = gl.exp2(s - m_i[None, :])
        vs4, vs2 = _scale_pair(vs_ptr + start * 2 + mt * 2)
        pw4 = _to_operand((p * vs4[:, None]).to(gl.float16))
        pw2 = _to_operand((p * vs2[:, None]).to(gl.float16))
        step4 = mma_v2(ones, pw4, acc_zero)
        step2 = mma_v2(ones, pw2, acc_zero)
        sums4 = sums4 + step4
        sums2 = sums2 + step2
        l_acc = mma_v2(ones, _to_operand(p.to(gl.float16)), l_acc)
        async_copy.wait_group(0)
        rv4 = tile4.permute([1, 0]).load(_A)  # [16 slots, tokens]
        rv2 = tile2.permute([1, 0]).load(_A)
        a0 = mma_v2(_field(rv4, v_mask4, False), pw4, a0 - centre4 * step4)
        a1 = mma_v2(_field(rv4, v_mask4, True), pw4, a1 - centre4 * step4)
        a2 = mma_v2(_field(rv2, v_mask2, False), pw2, a2 - centre2 * step2)
        a3 = mma_v2(_field(rv2, v_mask2, True), pw2, a3 - centre2 * step2)
    os = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
    orow = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))
    out = acc_ptr + pid * 768 + os[:, None] * 8 + orow[None, :]
    gl.store(out + 0 * 128, a0)
    gl.store(out + 1 * 128, a1)
    gl.store(out + 2 * 128, a2)
    gl.store(out + 3 * 128, a3)
    gl.store(out + 4 * 128, sums4 + l_acc)
    gl.store(out + 5 * 128, sums2)
    gl.store(m_ptr + pid * 8 + orow, m_i)


def main() -> None:
    pointers = dict(
        qw_ptr="*fp16", qc_ptr="*fp32", kc_ptr="*i16", vc_ptr="*i16", ks_ptr="*fp16", vs_ptr="*fp16"
    )
    spike_main(spike_kernel, pointers, 1, "spike_head_dim64", __doc__.splitlines()[0])


if __name__ == "__main__":
    main()
