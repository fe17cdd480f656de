"""The decode attention's Triton kernels: the query prologue, the v1 and v2 split kernels and the
exact-token kernel (kernels/wavelet_attention.py launches them and says how they fit; v3's split
kernel is Gluon, in kernels/wavelet_attention_gluon.py; the reduce is kernels/attention_reduce.py).

Every kernel here takes the cache as raw code bytes and fp16 scales and builds its MMA operands
from the code fields in registers (kernels/attention_fields.py: the encodings and their PTX); what
the host folds into constexprs and small tables is wavelet_attention's plans (_plan, _plan_v2).
"""

from __future__ import annotations

from .attention_fields import (
    BYTE_FIELD_ASMS,
    FIELD_ASMS,
    MAGIC_OFFSET,
    STACKED_BYTE_FIELD_ASMS,
    STACKED_FIELD_ASMS,
    magic_asm,
)

try:  # Triton is optional: without it the package runs the reference
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False


if HAS_TRITON:
    # finite "no score yet": exp2(_NEG_BIG - _NEG_BIG) stays 1 and never makes a NaN
    _NEG_BIG = tl.constexpr(-1.0e30)
    _MAGIC = tl.constexpr(MAGIC_OFFSET)
    _ASM_0x0F = tl.constexpr(magic_asm(0x0F))
    _ASM_0xF0 = tl.constexpr(magic_asm(0xF0))
    _ASM_0x03 = tl.constexpr(magic_asm(0x03))
    _ASM_0x0C = tl.constexpr(magic_asm(0x0C))
    _ASM_0x30 = tl.constexpr(magic_asm(0x30))
    _ASM_0xC0 = tl.constexpr(magic_asm(0xC0))
    _ASM_0xFF = tl.constexpr(magic_asm(0xFF))

    @triton.jit
    def _query_slots(
        q_rows,  # [rows] pointers to query rows (D channels each)
        row_ok,  # [rows] rows to read (others count as zero)
        k_channel_scale,  # [D] this kv head's key channel scale
        transform,  # [S, D] fp32 M of this kv head
        col_step_ptr,
        col_shift_ptr,
        col_band_ptr,
        cols,  # [D_CHUNK] kernel slots of this chunk
        qk_scale,
        D: tl.constexpr,
        PRECISION: tl.constexpr,  # the dot's input_precision (LaunchConfig.prologue_precision)
    ):
        """q_w = M (q * s_k) * qk_scale * step in fp16 for the slots `cols` of every row, and each
        band's share of the score offset sum_s q_w[s] * shift[s] in this chunk (4 [rows] sums)."""
        d = tl.arange(0, D)
        q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q = q * tl.load(k_channel_scale + d).to(tl.float32)[None, :]
        m = tl.load(transform + cols[:, None] * D + d[None, :])
        qw = tl.dot(q, tl.trans(m), input_precision=PRECISION)  # [rows, D_CHUNK]
        qw16 = (qw * (tl.load(col_step_ptr + cols) * qk_scale)[None, :]).to(tl.float16)
        band = tl.load(col_band_ptr + cols)[None, :]
        # the offset uses the fp16-rounded query, exactly what the MMA multiplies
        shifted = qw16.to(tl.float32) * tl.load(col_shift_ptr + cols)[None, :]
        return (
            qw16,
            tl.sum(tl.where(band == 0, shifted, 0.0), axis=1),
            tl.sum(tl.where(band == 1, shifted, 0.0), axis=1),
            tl.sum(tl.where(band == 2, shifted, 0.0), axis=1),
            tl.sum(tl.where(band == 3, shifted, 0.0), axis=1),
        )

    @triton.jit
    def _prologue_kernel(
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        k_channel_scale_ptr,
        k_scale_stride_h,
        transform_ptr,  # [S, D] or [Hkv, S, D] fp32: M = W_slots R (see query_transform)
        transform_stride_h,  # 0 when all kv heads share M (no rotation)
        col_step_ptr,
        col_shift_ptr,
        col_band_ptr,
        qw_ptr,
        qc_ptr,
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        qk_scale,
        D: tl.constexpr,
        S: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D_CHUNK: tl.constexpr,
        PRECISION: tl.constexpr = "tf32x3",  # LaunchConfig.prologue_precision
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
        WAIT: tl.constexpr = False,  # itself a programmatic dependent (LaunchConfig.prologue_waits)
    ):
        """q_w = M_h (q * s_k) * qk_scale * step in fp16 for D_CHUNK of the S kernel slots (D for
        v1, padded field planes for v2) per program, and that chunk's share of each band's score
        offset sum_s q_w[s] * shift[s]; grid (sequence x kv head x row block, S / D_CHUNK), so a
        short batch still spreads over many programs. The split kernels add the chunk shares."""
        if PDL:  # the split kernel may launch now: it waits for this kernel before reading qw/qc
            tl.extra.cuda.gdc_launch_dependents()
        if WAIT:  # the kernel before this one (it may write q, or read qw/qc) has finished
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        chunk = tl.program_id(1)
        row_block = pid % n_row_blocks
        kv_head = (pid // n_row_blocks) % n_kv_heads
        batch = pid // (n_row_blocks * n_kv_heads)
        local = tl.arange(0, BLOCK_M)
        rows = row_block * BLOCK_M + local
        row_ok = rows < group * n_new
        head = kv_head * group + rows // n_new
        token = rows % n_new
        q_rows = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
        cols = chunk * D_CHUNK + tl.arange(0, D_CHUNK)
        qw16, qc0, qc1, qc2, qc3 = _query_slots(
            q_rows,
            row_ok,
            k_channel_scale_ptr + kv_head * k_scale_stride_h,
            transform_ptr + kv_head * transform_stride_h,
            col_step_ptr,
            col_shift_ptr,
            col_band_ptr,
            cols,
            qk_scale,
            D,
            PRECISION,
        )
        tl.store(qw_ptr + pid * BLOCK_M * S + local[:, None] * S + cols[None, :], qw16)
        qc = qc_ptr + (pid * (S // D_CHUNK) + chunk) * BLOCK_M * 4 + local * 4
        tl.store(qc + 0, qc0)
        tl.store(qc + 1, qc1)
        tl.store(qc + 2, qc2)
        tl.store(qc + 3, qc3)

    @triton.jit
    def _prologue_heads_kernel(
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        k_channel_scale_ptr,
        k_scale_stride_h,
        transform_ptr,  # [S, D] or [Hkv, S, D] fp32: M = W_slots R (see query_transform)
        transform_stride_h,  # 0 when all kv heads share M (no rotation)
        col_step_ptr,
        col_shift_ptr,
        col_band_ptr,
        qw_ptr,
        qc_ptr,
        batch,
        n_kv_heads,
        group,
        n_new,
        qk_scale,
        D: tl.constexpr,
        S: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D_CHUNK: tl.constexpr,
        ROWS: tl.constexpr,
        PRECISION: tl.constexpr = "tf32x3",  # LaunchConfig.prologue_precision
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
        WAIT: tl.constexpr = False,  # itself a programmatic dependent (LaunchConfig.prologue_waits)
    ):
        """_prologue_kernel for one row block per (sequence, kv head) (decode): the query rows of
        ROWS / BLOCK_M sequences that share a kv head's M go through one [ROWS, D] x [D, D_CHUNK]
        dot; grid (kv head, row tile, S / D_CHUNK). Why: one program per (sequence, kv head) padded
        its BLOCK_M rows to the dot's 16 and ran about 1,100 SASS instructions per warp for 16K
        multiply-adds; at B = 32 that was 13 us of issue (ncu, H200) for a kernel that reads 1 MB."""
        if PDL:  # the split kernel may launch now: it waits for this kernel before reading qw/qc
            tl.extra.cuda.gdc_launch_dependents()
        if WAIT:  # the kernel before this one (it may write q, or read qw/qc) has finished
            tl.extra.cuda.gdc_wait()
        kv_head = tl.program_id(0)
        tile = tl.program_id(1)
        chunk = tl.program_id(2)
        r = tile * ROWS + tl.arange(0, ROWS)  # sequence * BLOCK_M + local row
        seq = r // BLOCK_M
        local = r % BLOCK_M
        row_ok = (seq < batch) & (local < group * n_new)
        head = kv_head * group + local // n_new
        token = local % n_new
        q_rows = q_ptr + seq * q_stride_b + head * q_stride_h + token * q_stride_t
        cols = chunk * D_CHUNK + tl.arange(0, D_CHUNK)
        qw16, qc0, qc1, qc2, qc3 = _query_slots(
            q_rows,
            row_ok,
            k_channel_scale_ptr + kv_head * k_scale_stride_h,
            transform_ptr + kv_head * transform_stride_h,
            col_step_ptr,
            col_shift_ptr,
            col_band_ptr,
            cols,
            qk_scale,
            D,
            PRECISION,
        )
        # program (seq, kv head, row block 0) of the split kernels owns these rows
        program = seq * n_kv_heads + kv_head
        ok = seq < batch
        tl.store(qw_ptr + (program * BLOCK_M + local)[:, None] * S + cols[None, :], qw16, mask=ok[:, None])
        qc = qc_ptr + ((program * (S // D_CHUNK) + chunk) * BLOCK_M + local) * 4
        tl.store(qc + 0, qc0, mask=ok)
        tl.store(qc + 1, qc1, mask=ok)
        tl.store(qc + 2, qc2, mask=ok)
        tl.store(qc + 3, qc3, mask=ok)

    @triton.jit
    def _load_qc(qc_ptr, pid, local, BAND: tl.constexpr, BLOCK_M: tl.constexpr, N_QC: tl.constexpr):
        """Band BAND's score offset per query row: the sum of the prologue's N_QC chunk shares."""
        base = qc_ptr + pid * N_QC * BLOCK_M * 4 + local * 4 + BAND
        total = tl.load(base)
        for k in tl.static_range(1, N_QC):
            total += tl.load(base + k * BLOCK_M * 4)
        return total

    @triton.jit
    def _magic_plane(raw, MASK: tl.constexpr, USE_ASM: tl.constexpr):
        """fp16 1024 + (raw & MASK): the bit field stays in place, its power of two folds into step."""
        if USE_ASM:
            if MASK == 0x0F:
                asm: tl.constexpr = _ASM_0x0F
            elif MASK == 0xF0:
                asm: tl.constexpr = _ASM_0xF0
            elif MASK == 0x03:
                asm: tl.constexpr = _ASM_0x03
            elif MASK == 0x0C:
                asm: tl.constexpr = _ASM_0x0C
            elif MASK == 0x30:
                asm: tl.constexpr = _ASM_0x30
            elif MASK == 0xC0:
                asm: tl.constexpr = _ASM_0xC0
            else:
                asm: tl.constexpr = _ASM_0xFF
            vals = tl.inline_asm_elementwise(
                asm=asm, constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=True, pack=4
            )
        else:
            vals = ((raw & MASK).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
        return vals

    @triton.jit
    def _plane(
        raw,
        lut_ptr,
        J: tl.constexpr,
        BITS: tl.constexpr,
        AFFINE: tl.constexpr,
        LUT_BASE: tl.constexpr,
        USE_ASM: tl.constexpr,
        CENTER: tl.constexpr,
    ):
        """fp16 MMA operand of bit plane J of a band's code bytes.

        Affine bands: 1024 + field, or with CENTER the exact small integer field - mid (mid = half the
        field's range). Values accumulate over thousands of tokens (V), and a 1024 offset in every
        term would cost the fp32 tensor-core accumulator most of its precision; keys are one fresh
        dot per token and keep the offset (one instruction less per pair)."""
        FIELD: tl.constexpr = (1 << BITS) - 1
        if AFFINE:
            vals = _magic_plane(raw, FIELD << (BITS * J), USE_ASM)
            if CENTER:
                MID: tl.constexpr = 1 << (BITS * (J + 1) - 1)
                vals = vals - (_MAGIC + MID)  # exact: both sides are integers below 2048
        else:
            codes = (raw >> (BITS * J)) & FIELD
            vals = tl.load(lut_ptr + LUT_BASE + codes.to(tl.int32))
        return vals

    @triton.jit
    def _band_init(
        qw_rows, START: tl.constexpr, SIZE: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """Per bit plane: the loop-invariant transposed query slice [n_bytes, BLOCK_M] (zero past the
        plane's bytes) and a zero accumulator; 16-row dummies for planes the band does not have."""
        PER_BYTE: tl.constexpr = 8 // BITS
        NB: tl.constexpr = SIZE // PER_BYTE
        NBP: tl.constexpr = max(NB, 16)
        cols = tl.arange(0, NBP)[:, None]
        in_plane = cols < NB
        q0 = tl.load(qw_rows + START + cols, mask=in_plane, other=0.0)
        a0 = tl.zeros([NBP, BLOCK_M], tl.float32)
        if PER_BYTE > 1:
            q1 = tl.load(qw_rows + START + NB + cols, mask=in_plane, other=0.0)
            a1 = tl.zeros([NBP, BLOCK_M], tl.float32)
        else:
            q1 = tl.zeros([16, BLOCK_M], tl.float16)
            a1 = tl.zeros([16, BLOCK_M], tl.float32)
        if PER_BYTE > 2:
            q2 = tl.load(qw_rows + START + 2 * NB + cols, mask=in_plane, other=0.0)
            q3 = tl.load(qw_rows + START + 3 * NB + cols, mask=in_plane, other=0.0)
            a2 = tl.zeros([NBP, BLOCK_M], tl.float32)
            a3 = tl.zeros([NBP, BLOCK_M], tl.float32)
        else:
            q2 = tl.zeros([16, BLOCK_M], tl.float16)
            q3 = tl.zeros([16, BLOCK_M], tl.float16)
            a2 = tl.zeros([16, BLOCK_M], tl.float32)
            a3 = tl.zeros([16, BLOCK_M], tl.float32)
        return q0, q1, q2, q3, a0, a1, a2, a3

    @triton.jit
    def _load_band_bytes(rows_ptr, n_ok, BYTE: tl.constexpr, SIZE: tl.constexpr, BITS: tl.constexpr):
        """Code bytes [BLOCK_N, max(n_bytes, 16)] of one band chunk (zeros past its bytes)."""
        NB: tl.constexpr = SIZE // (8 // BITS)
        if NB >= 16:
            raw = tl.load(rows_ptr[:, None] + BYTE + tl.arange(0, NB)[None, :], mask=n_ok[:, None], other=0)
        else:
            cols = tl.arange(0, 16)[None, :]
            raw = tl.load(rows_ptr[:, None] + BYTE + cols, mask=n_ok[:, None] & (cols < NB), other=0)
        return raw

    @triton.jit
    def _load_band_bytes_t(rows_ptr, n_ok, BYTE: tl.constexpr, SIZE: tl.constexpr, BITS: tl.constexpr):
        """The same bytes transposed, [max(n_bytes, 16), BLOCK_N] (the values' MMA operand)."""
        NB: tl.constexpr = SIZE // (8 // BITS)
        if NB >= 16:
            raw = tl.load(rows_ptr[None, :] + BYTE + tl.arange(0, NB)[:, None], mask=n_ok[None, :], other=0)
        else:
            cols = tl.arange(0, 16)[:, None]
            raw = tl.load(rows_ptr[None, :] + BYTE + cols, mask=n_ok[None, :] & (cols < NB), other=0)
        return raw

    @triton.jit
    def _load_scales(rows_ptr, n_ok, N_SCALES: tl.constexpr, BLOCK_N: tl.constexpr):
        """The fp16 band scales of BLOCK_N tokens as fp32 vectors (one load of the whole rows)."""
        if N_SCALES == 1:
            s0 = tl.load(rows_ptr, mask=n_ok, other=0.0).to(tl.float32)
            s1 = s0
            s2 = s0
            s3 = s0
        elif N_SCALES == 2:
            tile = tl.load(rows_ptr[:, None] + tl.arange(0, 2)[None, :], mask=n_ok[:, None], other=0.0)
            s0, s1 = tl.split(tile.to(tl.float32))
            s2 = s0
            s3 = s0
        else:
            cols = tl.arange(0, 4)
            tile = tl.load(
                rows_ptr[:, None] + cols[None, :], mask=n_ok[:, None] & (cols < N_SCALES)[None, :], other=0.0
            )
            even, odd = tl.split(tl.reshape(tile.to(tl.float32), [BLOCK_N, 2, 2]))
            s0, s2 = tl.split(even)
            s1, s3 = tl.split(odd)
        return s0, s1, s2, s3

    @triton.jit
    def _pick(s0, s1, s2, s3, INDEX: tl.constexpr):
        if INDEX == 0:
            s = s0
        elif INDEX == 1:
            s = s1
        elif INDEX == 2:
            s = s2
        else:
            s = s3
        return s

    @triton.jit
    def _band_scores(
        q0,
        q1,
        q2,
        q3,
        qc,
        raw,
        scale,
        lut_ptr,
        BITS: tl.constexpr,
        AFFINE: tl.constexpr,
        LUT_BASE: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """Transposed scores [BLOCK_N, BLOCK_M] of one band: tokens are the MMA's M dimension (the
        few query rows only pad N to 8), one MMA per bit plane, then scale (and offset)."""
        PER_BYTE: tl.constexpr = 8 // BITS
        dots = tl.dot(_plane(raw, lut_ptr, 0, BITS, AFFINE, LUT_BASE, USE_ASM, False), q0)
        if PER_BYTE > 1:
            dots = tl.dot(_plane(raw, lut_ptr, 1, BITS, AFFINE, LUT_BASE, USE_ASM, False), q1, dots)
        if PER_BYTE > 2:
            dots = tl.dot(_plane(raw, lut_ptr, 2, BITS, AFFINE, LUT_BASE, USE_ASM, False), q2, dots)
            dots = tl.dot(_plane(raw, lut_ptr, 3, BITS, AFFINE, LUT_BASE, USE_ASM, False), q3, dots)
        if AFFINE:
            dots = dots + qc[None, :]
        return dots * scale[:, None]

    @triton.jit
    def _band_values(
        a0,
        a1,
        a2,
        a3,
        offset_sum,
        p,
        alpha,
        raw_t,
        scale,
        lut_ptr,
        BITS: tl.constexpr,
        AFFINE: tl.constexpr,
        LUT_BASE: tl.constexpr,
        USE_ASM: tl.constexpr,
        CENTRE_IN_MMA: tl.constexpr = False,
    ):
        """acc_j[slot, row] += plane_j[slot, token] @ (p * scale)[token, row] for each bit plane j.

        Affine planes enter the sums centred, as field - mid. CENTRE_IN_MMA: the operands stay
        1024 + field and the accumulator input carries -(1024 + mid) * sum_n ps instead, one FFMA
        per accumulator element (it replaces the rescale's FMUL) for one HADD2 per operand pair; the
        accumulator itself never holds the 1024 offset, so its precision is the centred one."""
        PER_BYTE: tl.constexpr = 8 // BITS
        ps = (p * scale[:, None]).to(tl.float16)
        keep = alpha[None, :]
        if AFFINE:
            step_sum = tl.sum(ps.to(tl.float32), axis=0)
        if AFFINE and CENTRE_IN_MMA:
            a0 = tl.dot(
                _plane(raw_t, lut_ptr, 0, BITS, True, LUT_BASE, USE_ASM, False),
                ps,
                a0 * keep - (_MAGIC + (1 << (BITS - 1))) * step_sum[None, :],
            )
            if PER_BYTE > 1:
                a1 = tl.dot(
                    _plane(raw_t, lut_ptr, 1, BITS, True, LUT_BASE, USE_ASM, False),
                    ps,
                    a1 * keep - (_MAGIC + (1 << (2 * BITS - 1))) * step_sum[None, :],
                )
            if PER_BYTE > 2:
                a2 = tl.dot(
                    _plane(raw_t, lut_ptr, 2, BITS, True, LUT_BASE, USE_ASM, False),
                    ps,
                    a2 * keep - (_MAGIC + (1 << (3 * BITS - 1))) * step_sum[None, :],
                )
                a3 = tl.dot(
                    _plane(raw_t, lut_ptr, 3, BITS, True, LUT_BASE, USE_ASM, False),
                    ps,
                    a3 * keep - (_MAGIC + (1 << (4 * BITS - 1))) * step_sum[None, :],
                )
        else:
            a0 = tl.dot(_plane(raw_t, lut_ptr, 0, BITS, AFFINE, LUT_BASE, USE_ASM, True), ps, a0 * keep)
            if PER_BYTE > 1:
                a1 = tl.dot(_plane(raw_t, lut_ptr, 1, BITS, AFFINE, LUT_BASE, USE_ASM, True), ps, a1 * keep)
            if PER_BYTE > 2:
                a2 = tl.dot(_plane(raw_t, lut_ptr, 2, BITS, AFFINE, LUT_BASE, USE_ASM, True), ps, a2 * keep)
                a3 = tl.dot(_plane(raw_t, lut_ptr, 3, BITS, AFFINE, LUT_BASE, USE_ASM, True), ps, a3 * keep)
        if AFFINE:
            # sum_n p * scale, times each slot's shift at the end: the (offset - 1024) part
            offset_sum = offset_sum * alpha + step_sum
        return a0, a1, a2, a3, offset_sum

    @triton.jit
    def _store_plane(
        acc_out,
        acc,
        offset_sum,
        col_step_ptr,
        shift_ptr,
        row_ok,
        COL0: tl.constexpr,
        NB: tl.constexpr,
        AFFINE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D: tl.constexpr,
    ):
        """acc [n_bytes (padded), BLOCK_M] of one plane -> partial rows [BLOCK_M, D] at its slots."""
        NBP: tl.constexpr = max(NB, 16)
        in_plane = tl.arange(0, NBP) < NB
        cols = COL0 + tl.arange(0, NBP)
        if AFFINE:
            shift = tl.load(shift_ptr + cols, mask=in_plane, other=0.0)[:, None]
            acc = (acc + offset_sum[None, :] * shift) * tl.load(
                col_step_ptr + cols, mask=in_plane, other=0.0
            )[:, None]
        tl.store(
            acc_out + tl.arange(0, BLOCK_M)[None, :] * D + cols[:, None],
            acc,
            mask=row_ok[None, :] & in_plane[:, None],
        )

    @triton.jit
    def _store_band(
        acc_out,
        a0,
        a1,
        a2,
        a3,
        offset_sum,
        col_step_ptr,
        shift_ptr,
        row_ok,
        START: tl.constexpr,
        SIZE: tl.constexpr,
        BITS: tl.constexpr,
        AFFINE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D: tl.constexpr,
    ):
        """Coefficient sums sum_n p_n c_n of one band into the partial buffer (kernel slot order)."""
        PER_BYTE: tl.constexpr = 8 // BITS
        NB: tl.constexpr = SIZE // PER_BYTE
        _store_plane(acc_out, a0, offset_sum, col_step_ptr, shift_ptr, row_ok, START, NB, AFFINE, BLOCK_M, D)
        if PER_BYTE > 1:
            _store_plane(
                acc_out,
                a1,
                offset_sum,
                col_step_ptr,
                shift_ptr,
                row_ok,
                START + NB,
                NB,
                AFFINE,
                BLOCK_M,
                D,
            )
        if PER_BYTE > 2:
            _store_plane(
                acc_out,
                a2,
                offset_sum,
                col_step_ptr,
                shift_ptr,
                row_ok,
                START + 2 * NB,
                NB,
                AFFINE,
                BLOCK_M,
                D,
            )
            _store_plane(
                acc_out,
                a3,
                offset_sum,
                col_step_ptr,
                shift_ptr,
                row_ok,
                START + 3 * NB,
                NB,
                AFFINE,
                BLOCK_M,
                D,
            )

    @triton.jit
    def _exact_part(
        q_rows,
        ke_base,
        ve_base,
        ke_stride_s,
        ve_stride_s,
        seq_len,
        limit,
        row_ok,
        qk_scale,
        m_out,
        l_out,
        acc_out,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        EXACT_BLOCK: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
    ):
        """Softmax state over the exact sink and window tokens, in the original domain."""
        d = tl.arange(0, D)
        q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        ring_base = seq_len - WINDOW
        ring_lo = tl.maximum(ring_base, SINKS)
        for start in range(0, SINKS + WINDOW, EXACT_BLOCK):
            slot = start + tl.arange(0, EXACT_BLOCK)
            in_sinks = slot < SINKS
            if WINDOW > 0:
                # ring slot r holds the position p in [seq_len - window, seq_len) with p % window == r
                ring_pos = ring_base + (((slot - SINKS - ring_base) % WINDOW) + WINDOW) % WINDOW
            else:
                ring_pos = slot * 0 - 1
            pos = tl.where(in_sinks, slot, ring_pos)
            valid = (slot < SINKS + WINDOW) & (in_sinks | (pos >= ring_lo)) & (pos >= 0)
            k = tl.load(ke_base + slot[:, None] * ke_stride_s + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(tl.float32)))
            s = tl.where(valid[None, :] & (pos[None, :] < limit[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(ve_base + slot[:, None] * ve_stride_s + d[None, :], mask=valid[:, None], other=0.0)
            acc = tl.dot(p, v.to(tl.float32), acc * alpha[:, None])
            m_i = m_new
        local = tl.arange(0, BLOCK_M)
        tl.store(m_out + local, m_i, mask=row_ok)
        tl.store(l_out + local, l_i, mask=row_ok)
        tl.store(acc_out + local[:, None] * D + d[None, :], acc, mask=row_ok[:, None])

    @triton.jit
    def _split_dot(a, b, acc, SPLIT_B: tl.constexpr):
        """a @ b + acc; b is fp32. SPLIT_B: a is 16-bit, b enters as hi + lo parts of a's dtype
        (two MMAs, ~fp32 accuracy); else fp32 operands through 3xTF32."""
        if SPLIT_B:
            hi = b.to(a.dtype)
            lo = (b - hi.to(tl.float32)).to(a.dtype)
            out = tl.dot(a, lo, tl.dot(a, hi, acc))
        else:
            out = tl.dot(a.to(tl.float32), b, acc, input_precision="tf32x3")
        return out

    @triton.jit
    def _exact_part_t(
        q_rows,
        ke_base,
        ve_base,
        ke_stride_s,
        ve_stride_s,
        seq_len,
        limit,
        row_ok,
        qk_scale,
        m_out,
        l_out,
        acc_out,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        EXACT_BLOCK: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
        SPLIT_B: tl.constexpr,
        slot_lo,
        slot_hi,
    ):
        """_exact_part with tokens on the MMA's M (scores^T, acc^T) and head_dim cut into 32-wide
        pieces, like the compressed loop: the few query rows only pad N and the exact tokens stay
        in their 16-bit dtype (query and p split hi + lo), so this path needs fewer registers than
        the compressed loop and does not raise the kernel's register budget. slot_lo / slot_hi:
        the exact slots (sinks, then the window's ring) this call covers; slot_lo a multiple of
        EXACT_BLOCK."""
        DC: tl.constexpr = 32
        dc = tl.arange(0, DC)
        local = tl.arange(0, BLOCK_M)
        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_t = ()
        for _c in tl.static_range(D // DC):
            acc_t = acc_t + (tl.zeros([DC, BLOCK_M], tl.float32),)
        ring_base = seq_len - WINDOW
        ring_lo = tl.maximum(ring_base, SINKS)
        for start in range(slot_lo, slot_hi, EXACT_BLOCK):
            slot = start + tl.arange(0, EXACT_BLOCK)
            in_sinks = slot < SINKS
            if WINDOW > 0:
                # ring slot r holds the position p in [seq_len - window, seq_len) with p % window == r
                ring_pos = ring_base + (((slot - SINKS - ring_base) % WINDOW) + WINDOW) % WINDOW
            else:
                ring_pos = slot * 0 - 1
            pos = tl.where(in_sinks, slot, ring_pos)
            valid = (slot < slot_hi) & (in_sinks | (pos >= ring_lo)) & (pos >= 0)
            s = tl.zeros([EXACT_BLOCK, BLOCK_M], tl.float32)
            for c in tl.static_range(D // DC):
                cols = c * DC + dc
                k = tl.load(
                    ke_base + slot[:, None] * ke_stride_s + cols[None, :], mask=valid[:, None], other=0.0
                )
                q_t = tl.load(q_rows[None, :] + cols[:, None], mask=row_ok[None, :], other=0.0).to(tl.float32)
                s = _split_dot(k, q_t * qk_scale, s, SPLIT_B)
            s = tl.where(valid[:, None] & (pos[:, None] < limit[None, :]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, axis=0)
            new_acc = ()
            for c in tl.static_range(D // DC):
                cols = c * DC + dc
                v_t = tl.load(
                    ve_base + slot[None, :] * ve_stride_s + cols[:, None], mask=valid[None, :], other=0.0
                )
                new_acc = new_acc + (_split_dot(v_t, p, acc_t[c] * alpha[None, :], SPLIT_B),)
            acc_t = new_acc
            m_i = m_new
        tl.store(m_out + local, m_i, mask=row_ok)
        tl.store(l_out + local, l_i, mask=row_ok)
        for c in tl.static_range(D // DC):
            cols = c * DC + dc
            tl.store(acc_out + local[None, :] * D + cols[:, None], acc_t[c], mask=row_ok[None, :])

    @triton.jit
    def _split_kernel(
        qw_ptr,
        qc_ptr,
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        kc_ptr,
        kc_stride_b,
        kc_stride_h,
        ks_ptr,
        ks_stride_b,
        ks_stride_h,
        vc_ptr,
        vc_stride_b,
        vc_stride_h,
        vs_ptr,
        vs_stride_b,
        vs_stride_h,
        ke_ptr,
        ke_stride_b,
        ke_stride_h,
        ke_stride_s,
        ve_ptr,
        ve_stride_b,
        ve_stride_h,
        ve_stride_s,
        seq_lens_ptr,
        lut_ptr,
        col_step_ptr,
        col_vshift_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        num_splits,
        split_num,  # each split's share of the compressed span: split_num / split_den (SplitPlan)
        split_den,
        qk_scale,
        CODE_STRIDE: tl.constexpr,
        SCALE_STRIDE: tl.constexpr,
        N_SCALES: tl.constexpr,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        N_QC: tl.constexpr,  # prologue chunks whose score-offset shares add up (see _load_qc)
        BLOCK_N: tl.constexpr,
        EXACT_BLOCK: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
        USE_ASM: tl.constexpr,
        KB0_START: tl.constexpr,
        KB0_SIZE: tl.constexpr,
        KB0_BITS: tl.constexpr,
        KB0_BYTE: tl.constexpr,
        KB0_SCALE: tl.constexpr,
        KB0_AFFINE: tl.constexpr,
        KB1_START: tl.constexpr,
        KB1_SIZE: tl.constexpr,
        KB1_BITS: tl.constexpr,
        KB1_BYTE: tl.constexpr,
        KB1_SCALE: tl.constexpr,
        KB1_AFFINE: tl.constexpr,
        KB2_START: tl.constexpr,
        KB2_SIZE: tl.constexpr,
        KB2_BITS: tl.constexpr,
        KB2_BYTE: tl.constexpr,
        KB2_SCALE: tl.constexpr,
        KB2_AFFINE: tl.constexpr,
        KB3_START: tl.constexpr,
        KB3_SIZE: tl.constexpr,
        KB3_BITS: tl.constexpr,
        KB3_BYTE: tl.constexpr,
        KB3_SCALE: tl.constexpr,
        KB3_AFFINE: tl.constexpr,
        CENTRE_IN_MMA: tl.constexpr = False,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
    ):
        """One (split, sequence, kv head, row block): online softmax over a range of compressed
        tokens in the coefficient domain, or (last split) over the exact tokens."""
        if PDL:  # the previous kernel's writes are visible after this, none before it
            tl.extra.cuda.gdc_wait()
        split = tl.program_id(0)
        pid = tl.program_id(1)
        row_block = pid % n_row_blocks
        kv_head = (pid // n_row_blocks) % n_kv_heads
        batch = pid // (n_row_blocks * n_kv_heads)
        local = tl.arange(0, BLOCK_M)
        rows = row_block * BLOCK_M + local
        row_ok = rows < group * n_new
        token = rows % n_new
        seq_len = tl.load(seq_lens_ptr + batch).to(tl.int32)
        # causal: new token t sees positions < seq_len - n_new + t + 1
        limit = tl.where(row_ok, seq_len - n_new + token + 1, 0)
        part = pid * (num_splits + 1) + split
        m_out = m_ptr + part * BLOCK_M
        l_out = l_ptr + part * BLOCK_M
        acc_out = acc_ptr + part * BLOCK_M * D
        if split == num_splits:
            head = kv_head * group + rows // n_new
            q_rows = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
            _exact_part(
                q_rows,
                ke_ptr + batch * ke_stride_b + kv_head * ke_stride_h,
                ve_ptr + batch * ve_stride_b + kv_head * ve_stride_h,
                ke_stride_s,
                ve_stride_s,
                seq_len,
                limit,
                row_ok,
                qk_scale,
                m_out,
                l_out,
                acc_out,
                D,
                BLOCK_M,
                EXACT_BLOCK,
                SINKS,
                WINDOW,
            )
        else:
            # compressed positions [sinks, seq_len - window), cut into num_splits block-aligned ranges
            comp_hi = tl.minimum(tl.maximum(seq_len - WINDOW, SINKS), tl.max(limit, axis=0))
            span = tl.maximum(comp_hi - SINKS, 0).to(tl.int64)  # (x split_num may pass 2^31)
            chunk = tl.cdiv(tl.cdiv(span * split_num, split_den).to(tl.int32), BLOCK_N) * BLOCK_N
            lo = SINKS + split * chunk
            hi = tl.minimum(lo + chunk, comp_hi)
            row_hi = tl.minimum(limit, hi)
            qw_rows = qw_ptr + pid * BLOCK_M * D + local[None, :] * D
            kc_base = kc_ptr + batch * kc_stride_b + kv_head * kc_stride_h
            ks_base = ks_ptr + batch * ks_stride_b + kv_head * ks_stride_h
            vc_base = vc_ptr + batch * vc_stride_b + kv_head * vc_stride_h
            vs_base = vs_ptr + batch * vs_stride_b + kv_head * vs_stride_h
            q00, q01, q02, q03, a00, a01, a02, a03 = _band_init(
                qw_rows, KB0_START, KB0_SIZE, KB0_BITS, BLOCK_M
            )
            qc0 = _load_qc(qc_ptr, pid, local, 0, BLOCK_M, N_QC)
            off0 = tl.zeros([BLOCK_M], tl.float32)
            if KB1_SIZE > 0:
                q10, q11, q12, q13, a10, a11, a12, a13 = _band_init(
                    qw_rows, KB1_START, KB1_SIZE, KB1_BITS, BLOCK_M
                )
                qc1 = _load_qc(qc_ptr, pid, local, 1, BLOCK_M, N_QC)
                off1 = tl.zeros([BLOCK_M], tl.float32)
            if KB2_SIZE > 0:
                q20, q21, q22, q23, a20, a21, a22, a23 = _band_init(
                    qw_rows, KB2_START, KB2_SIZE, KB2_BITS, BLOCK_M
                )
                qc2 = _load_qc(qc_ptr, pid, local, 2, BLOCK_M, N_QC)
                off2 = tl.zeros([BLOCK_M], tl.float32)
            if KB3_SIZE > 0:
                q30, q31, q32, q33, a30, a31, a32, a33 = _band_init(
                    qw_rows, KB3_START, KB3_SIZE, KB3_BITS, BLOCK_M
                )
                qc3 = _load_qc(qc_ptr, pid, local, 3, BLOCK_M, N_QC)
                off3 = tl.zeros([BLOCK_M], tl.float32)
            m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_ok = offs_n < hi
                kc_rows = kc_base + offs_n * CODE_STRIDE
                ks0, ks1, ks2, ks3 = _load_scales(ks_base + offs_n * SCALE_STRIDE, n_ok, N_SCALES, BLOCK_N)
                raw = _load_band_bytes(kc_rows, n_ok, KB0_BYTE, KB0_SIZE, KB0_BITS)
                s = _band_scores(
                    q00,
                    q01,
                    q02,
                    q03,
                    qc0,
                    raw,
                    _pick(ks0, ks1, ks2, ks3, KB0_SCALE),
                    lut_ptr,
                    KB0_BITS,
                    KB0_AFFINE,
                    0,
                    USE_ASM,
                )
                if KB1_SIZE > 0:
                    raw = _load_band_bytes(kc_rows, n_ok, KB1_BYTE, KB1_SIZE, KB1_BITS)
                    s += _band_scores(
                        q10,
                        q11,
                        q12,
                        q13,
                        qc1,
                        raw,
                        _pick(ks0, ks1, ks2, ks3, KB1_SCALE),
                        lut_ptr,
                        KB1_BITS,
                        KB1_AFFINE,
                        256,
                        USE_ASM,
                    )
                if KB2_SIZE > 0:
                    raw = _load_band_bytes(kc_rows, n_ok, KB2_BYTE, KB2_SIZE, KB2_BITS)
                    s += _band_scores(
                        q20,
                        q21,
                        q22,
                        q23,
                        qc2,
                        raw,
                        _pick(ks0, ks1, ks2, ks3, KB2_SCALE),
                        lut_ptr,
                        KB2_BITS,
                        KB2_AFFINE,
                        512,
                        USE_ASM,
                    )
                if KB3_SIZE > 0:
                    raw = _load_band_bytes(kc_rows, n_ok, KB3_BYTE, KB3_SIZE, KB3_BITS)
                    s += _band_scores(
                        q30,
                        q31,
                        q32,
                        q33,
                        qc3,
                        raw,
                        _pick(ks0, ks1, ks2, ks3, KB3_SCALE),
                        lut_ptr,
                        KB3_BITS,
                        KB3_AFFINE,
                        768,
                        USE_ASM,
                    )
                s = tl.where(offs_n[:, None] < row_hi[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[None, :])
                l_i = l_i * alpha + tl.sum(p, axis=0)
                m_i = m_new
                vc_rows = vc_base + offs_n * CODE_STRIDE
                vs0, vs1, vs2, vs3 = _load_scales(vs_base + offs_n * SCALE_STRIDE, n_ok, N_SCALES, BLOCK_N)
                raw = _load_band_bytes_t(vc_rows, n_ok, KB0_BYTE, KB0_SIZE, KB0_BITS)
                a00, a01, a02, a03, off0 = _band_values(
                    a00,
                    a01,
                    a02,
                    a03,
                    off0,
                    p,
                    alpha,
                    raw,
                    _pick(vs0, vs1, vs2, vs3, KB0_SCALE),
                    lut_ptr,
                    KB0_BITS,
                    KB0_AFFINE,
                    0,
                    USE_ASM,
                    CENTRE_IN_MMA,
                )
                if KB1_SIZE > 0:
                    raw = _load_band_bytes_t(vc_rows, n_ok, KB1_BYTE, KB1_SIZE, KB1_BITS)
                    a10, a11, a12, a13, off1 = _band_values(
                        a10,
                        a11,
                        a12,
                        a13,
                        off1,
                        p,
                        alpha,
                        raw,
                        _pick(vs0, vs1, vs2, vs3, KB1_SCALE),
                        lut_ptr,
                        KB1_BITS,
                        KB1_AFFINE,
                        256,
                        USE_ASM,
                        CENTRE_IN_MMA,
                    )
                if KB2_SIZE > 0:
                    raw = _load_band_bytes_t(vc_rows, n_ok, KB2_BYTE, KB2_SIZE, KB2_BITS)
                    a20, a21, a22, a23, off2 = _band_values(
                        a20,
                        a21,
                        a22,
                        a23,
                        off2,
                        p,
                        alpha,
                        raw,
                        _pick(vs0, vs1, vs2, vs3, KB2_SCALE),
                        lut_ptr,
                        KB2_BITS,
                        KB2_AFFINE,
                        512,
                        USE_ASM,
                        CENTRE_IN_MMA,
                    )
                if KB3_SIZE > 0:
                    raw = _load_band_bytes_t(vc_rows, n_ok, KB3_BYTE, KB3_SIZE, KB3_BITS)
                    a30, a31, a32, a33, off3 = _band_values(
                        a30,
                        a31,
                        a32,
                        a33,
                        off3,
                        p,
                        alpha,
                        raw,
                        _pick(vs0, vs1, vs2, vs3, KB3_SCALE),
                        lut_ptr,
                        KB3_BITS,
                        KB3_AFFINE,
                        768,
                        USE_ASM,
                        CENTRE_IN_MMA,
                    )
            tl.store(m_out + local, m_i, mask=row_ok)
            tl.store(l_out + local, l_i, mask=row_ok)
            _store_band(
                acc_out,
                a00,
                a01,
                a02,
                a03,
                off0,
                col_step_ptr,
                col_vshift_ptr,
                row_ok,
                KB0_START,
                KB0_SIZE,
                KB0_BITS,
                KB0_AFFINE,
                BLOCK_M,
                D,
            )
            if KB1_SIZE > 0:
                _store_band(
                    acc_out,
                    a10,
                    a11,
                    a12,
                    a13,
                    off1,
                    col_step_ptr,
                    col_vshift_ptr,
                    row_ok,
                    KB1_START,
                    KB1_SIZE,
                    KB1_BITS,
                    KB1_AFFINE,
                    BLOCK_M,
                    D,
                )
            if KB2_SIZE > 0:
                _store_band(
                    acc_out,
                    a20,
                    a21,
                    a22,
                    a23,
                    off2,
                    col_step_ptr,
                    col_vshift_ptr,
                    row_ok,
                    KB2_START,
                    KB2_SIZE,
                    KB2_BITS,
                    KB2_AFFINE,
                    BLOCK_M,
                    D,
                )
            if KB3_SIZE > 0:
                _store_band(
                    acc_out,
                    a30,
                    a31,
                    a32,
                    a33,
                    off3,
                    col_step_ptr,
                    col_vshift_ptr,
                    row_ok,
                    KB3_START,
                    KB3_SIZE,
                    KB3_BITS,
                    KB3_AFFINE,
                    BLOCK_M,
                    D,
                )

    _FIELD_ASM_TABLE = tl.constexpr(FIELD_ASMS)
    _BYTE_FIELD_ASM_TABLE = tl.constexpr(BYTE_FIELD_ASMS)

    @triton.jit
    def _byte_field_operand(
        raw, BITS: tl.constexpr, F: tl.constexpr, MODE: tl.constexpr, USE_ASM: tl.constexpr
    ):
        """fp16 MMA operand of bit field F (in place) of every code byte in raw (keys, narrow chunks)."""
        MASK: tl.constexpr = ((1 << BITS) - 1) << (F * BITS)
        if USE_ASM:
            if BITS == 2:
                BASE: tl.constexpr = 0
            elif BITS == 4:
                BASE: tl.constexpr = 4
            else:
                BASE: tl.constexpr = 6
            ASM: tl.constexpr = _BYTE_FIELD_ASM_TABLE[MODE * 7 + BASE + F]
            vals = tl.inline_asm_elementwise(
                asm=ASM, constraints="=r,=r,r", args=[raw], dtype=tl.float16, is_pure=True, pack=4
            )
        else:
            x = (raw & MASK).to(tl.int16)
            if MODE == 0:
                vals = x.to(tl.float16, bitcast=True)
            else:
                vals = (x | 0x6400).to(tl.float16, bitcast=True)
        return vals

    @triton.jit
    def _fp16_of_field(x, MODE: tl.constexpr, centre):
        """The fp16 operand of masked int16 fields x (attention_fields: subnormal, magic, or magic
        minus `centre`) where no PTX builds it (the interpreter, use_asm=False)."""
        if MODE == 0:
            vals = x.to(tl.float16, bitcast=True)
        elif MODE == 1:
            vals = (x | 0x6400).to(tl.float16, bitcast=True)
        else:
            vals = (x | 0x6400).to(tl.float16, bitcast=True) - centre
        return vals

    @triton.jit
    def _field_operand(R, BITS: tl.constexpr, F: tl.constexpr, MODE: tl.constexpr, USE_ASM: tl.constexpr):
        """fp16 MMA operand of bit field F of every int16 code element in R (see field_layout)."""
        OFFSET: tl.constexpr = F * BITS
        if OFFSET + BITS <= 10:
            SHIFT: tl.constexpr = 0
        else:
            SHIFT: tl.constexpr = 8
        POS: tl.constexpr = OFFSET - SHIFT
        MASK: tl.constexpr = ((1 << BITS) - 1) << POS
        if USE_ASM:
            if BITS == 2:
                BASE: tl.constexpr = 0
            elif BITS == 4:
                BASE: tl.constexpr = 8
            else:
                BASE: tl.constexpr = 12
            ASM: tl.constexpr = _FIELD_ASM_TABLE[MODE * 14 + BASE + F]
            vals = tl.inline_asm_elementwise(
                asm=ASM, constraints="=r,r", args=[R], dtype=tl.float16, is_pure=True, pack=2
            )
        else:
            MID: tl.constexpr = 1 << (POS + BITS - 1)
            vals = _fp16_of_field((R >> SHIFT) & MASK, MODE, _MAGIC + MID)
        return vals

    @triton.jit
    def _chunk_init(
        qw_rows,
        K_SLOT0: tl.constexpr,
        K_FIELDS: tl.constexpr,
        KNP: tl.constexpr,
        V_FIELDS: tl.constexpr,
        NEP: tl.constexpr,
        BLOCK_M: tl.constexpr,
    ):
        """Loop invariants of one chunk: per key field its query slice [KNP, BLOCK_M] (transposed:
        slots x query rows); per value field a zero accumulator [NEP, BLOCK_M]."""
        e = tl.arange(0, KNP)[:, None]
        q_fields = ()
        for f in tl.static_range(K_FIELDS):
            q_fields = q_fields + (tl.load(qw_rows + K_SLOT0 + f * KNP + e),)
        acc_fields = ()
        for _f in tl.static_range(V_FIELDS):
            acc_fields = acc_fields + (tl.zeros([NEP, BLOCK_M], tl.float32),)
        return q_fields, acc_fields

    _STACKED_ASM_TABLE = tl.constexpr(STACKED_FIELD_ASMS)
    _STACKED_BYTE_ASM_TABLE = tl.constexpr(STACKED_BYTE_FIELD_ASMS)

    @triton.jit
    def _stacked_positions(
        N: tl.constexpr, NW: tl.constexpr, G: tl.constexpr, OP: tl.constexpr, BITS: tl.constexpr
    ):
        """Bit offset in its code word of the field each of the N rows (or columns) of stacked
        operand OP holds: field OP * G + r // NW of word r % NW (rows past NW * G are padding and
        repeat the group's first field; their slots are zero in the plan)."""
        r = tl.arange(0, N)
        return (OP * G + tl.where(r < NW * G, r // NW, 0)) * BITS

    @triton.jit
    def _stacked_centres(
        N: tl.constexpr, NE: tl.constexpr, G: tl.constexpr, OP: tl.constexpr, BITS: tl.constexpr
    ):
        """[N, 1] fp32: 1024 + mid of each row's field of stacked value operand OP (what
        _stacked_value_operand's centred mode subtracts)."""
        if (OP * G + G) * BITS <= 10:
            SHIFT: tl.constexpr = 0
        else:
            SHIFT: tl.constexpr = 8
        pos = _stacked_positions(N, NE, G, OP, BITS) - SHIFT
        mid = tl.full(pos.shape, 1, tl.int32) << (pos + BITS - 1)
        return (mid.to(tl.float32) + _MAGIC)[:, None]

    @triton.jit
    def _stacked_value_operand(
        raw,
        NE: tl.constexpr,
        G: tl.constexpr,
        OP: tl.constexpr,
        BITS: tl.constexpr,
        MODE: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """fp16 MMA operand OP of a stacked value chunk (attention_plans._FieldChunk.v_slots): raw
        [NEP, tokens] int16 words, row r word r % NE; one shift for the operand's group of G fields
        (stacked_shift), a mask and (centred) a centre per row."""
        if (OP * G + G) * BITS <= 10:
            SHIFT: tl.constexpr = 0
        else:
            SHIFT: tl.constexpr = 8
        pos = _stacked_positions(raw.shape[0], NE, G, OP, BITS) - SHIFT
        # (shifts of a tensor: a constexpr on the left would stay a constexpr)
        mask = tl.full(pos.shape, (1 << BITS) - 1, tl.int32) << pos
        mask = tl.broadcast_to(mask.to(tl.int16)[:, None], raw.shape)
        centre = tl.broadcast_to(_stacked_centres(raw.shape[0], NE, G, OP, BITS).to(tl.float16), raw.shape)
        if USE_ASM:
            ASM: tl.constexpr = _STACKED_ASM_TABLE[MODE * 2 + SHIFT // 8]
            if MODE == 2:
                vals = tl.inline_asm_elementwise(
                    asm=ASM,
                    constraints="=r,r,r,r",
                    args=[raw, mask, centre],
                    dtype=tl.float16,
                    is_pure=True,
                    pack=2,
                )
            else:
                vals = tl.inline_asm_elementwise(
                    asm=ASM, constraints="=r,r,r", args=[raw, mask], dtype=tl.float16, is_pure=True, pack=2
                )
        else:
            vals = _fp16_of_field((raw >> SHIFT) & mask, MODE, centre)
        return vals

    @triton.jit
    def _stacked_key_operand(
        raw,
        NB: tl.constexpr,
        G: tl.constexpr,
        OP: tl.constexpr,
        BITS: tl.constexpr,
        MODE: tl.constexpr,
        USE_ASM: tl.constexpr,
    ):
        """fp16 MMA operand OP of a stacked narrow key chunk (attention_plans._FieldChunk.k_slots):
        raw [tokens, KNP] code bytes, column c byte c % NB; a mask per column (byte fields need no
        shift)."""
        pos = _stacked_positions(raw.shape[1], NB, G, OP, BITS)
        mask = tl.full(pos.shape, (1 << BITS) - 1, tl.int32) << pos
        if USE_ASM:
            ASM: tl.constexpr = _STACKED_BYTE_ASM_TABLE[MODE]
            vals = tl.inline_asm_elementwise(
                asm=ASM,
                constraints="=r,=r,r,r,r",
                args=[raw, tl.broadcast_to(mask.to(tl.int16)[None, :], raw.shape)],
                dtype=tl.float16,
                is_pure=True,
                pack=4,
            )
        else:
            x = (raw & mask.to(tl.uint8)[None, :]).to(tl.int16)
            if MODE == 0:
                vals = x.to(tl.float16, bitcast=True)
            else:
                vals = (x | 0x6400).to(tl.float16, bitcast=True)
        return vals

    @triton.jit
    def _chunk_scores(
        rows_ptr,
        n_ok,
        q_fields,
        E0: tl.constexpr,
        NE: tl.constexpr,
        BITS: tl.constexpr,
        K_BYTES: tl.constexpr,
        KNP: tl.constexpr,
        MODE: tl.constexpr,
        USE_ASM: tl.constexpr,
        STACK: tl.constexpr = 1,
    ):
        """sum over operands of operand[token, slot] @ q[slot, row]: [BLOCK_N, BLOCK_M] (tokens on
        M). rows_ptr: uint8 pointers to the tokens' code rows. STACK > 1: narrow byte chunks stack
        that many fields in each operand's KNP columns."""
        e = tl.arange(0, KNP)[None, :]
        if K_BYTES and STACK > 1:
            ptrs = rows_ptr[:, None] + 2 * E0 + e % (2 * NE)
            if KNP == 2 * NE * STACK:
                raw = tl.load(ptrs, mask=n_ok[:, None], other=0)
            else:
                raw = tl.load(ptrs, mask=n_ok[:, None] & (e < 2 * NE * STACK), other=0)
            dots = tl.dot(_stacked_key_operand(raw, 2 * NE, STACK, 0, BITS, MODE, USE_ASM), q_fields[0])
            for o in tl.static_range(1, 8 // BITS // STACK):
                dots = tl.dot(
                    _stacked_key_operand(raw, 2 * NE, STACK, o, BITS, MODE, USE_ASM), q_fields[o], dots
                )
        elif K_BYTES:
            ptrs = rows_ptr[:, None] + 2 * E0 + e
            if KNP == 2 * NE:
                raw = tl.load(ptrs, mask=n_ok[:, None], other=0)
            else:
                raw = tl.load(ptrs, mask=n_ok[:, None] & (e < 2 * NE), other=0)
            dots = tl.dot(_byte_field_operand(raw, BITS, 0, MODE, USE_ASM), q_fields[0])
            for f in tl.static_range(1, 8 // BITS):
                dots = tl.dot(_byte_field_operand(raw, BITS, f, MODE, USE_ASM), q_fields[f], dots)
        else:
            ptrs = rows_ptr.to(tl.pointer_type(tl.int16), bitcast=True)[:, None] + E0 + e
            raw = tl.load(ptrs, mask=n_ok[:, None], other=0)
            dots = tl.dot(_field_operand(raw, BITS, 0, MODE, USE_ASM), q_fields[0])
            for f in tl.static_range(1, 16 // BITS):
                dots = tl.dot(_field_operand(raw, BITS, f, MODE, USE_ASM), q_fields[f], dots)
        return dots

    @triton.jit
    def _chunk_values(
        rows_ptr,
        n_ok,
        ps,
        acc_fields,
        E0: tl.constexpr,
        NE: tl.constexpr,
        NEP: tl.constexpr,
        BITS: tl.constexpr,
        MODE: tl.constexpr,
        USE_ASM: tl.constexpr,
        STACK: tl.constexpr = 1,
        WORDS_ONCE: tl.constexpr = False,
    ):
        """acc_o[slot, row] += operand_o[slot, token] @ ps[token, row] (slots on M, tokens on K).
        rows_ptr: uint8 pointers to the tokens' code rows, read as int16 elements. STACK > 1: a
        narrow chunk's operands stack that many fields (row r: element r % NE); WORDS_ONCE: its
        words loaded once and repeated (LaunchConfig.value_words_once)."""
        e = tl.arange(0, NEP)[:, None]
        if STACK > 1:
            words = rows_ptr.to(tl.pointer_type(tl.int16), bitcast=True)[None, :] + E0
            if WORDS_ONCE and NE * STACK == NEP:  # each word loaded once, repeated per field group
                small = tl.load(words + tl.arange(0, NE)[:, None], mask=n_ok[None, :], other=0)
                tokens: tl.constexpr = small.shape[1]
                raw = tl.reshape(tl.broadcast_to(small[None, :, :], (STACK, NE, tokens)), (NEP, tokens))
            elif NE * STACK >= NEP:
                raw = tl.load(words + e % NE, mask=n_ok[None, :], other=0)
            else:
                raw = tl.load(words + e % NE, mask=n_ok[None, :] & (e < NE * STACK), other=0)
            out = ()
            for o in tl.static_range(16 // BITS // STACK):
                operand = _stacked_value_operand(raw, NE, STACK, o, BITS, MODE, USE_ASM)
                out = out + (tl.dot(operand, ps, acc_fields[o]),)
        else:  # (no early return: Triton compiles the code after a constexpr branch's return)
            ptrs = rows_ptr.to(tl.pointer_type(tl.int16), bitcast=True)[None, :] + E0 + e
            if NE >= 16:
                raw = tl.load(ptrs, mask=n_ok[None, :], other=0)
            else:
                raw = tl.load(ptrs, mask=n_ok[None, :] & (e < NE), other=0)
            out = ()
            for f in tl.static_range(16 // BITS):
                out = out + (tl.dot(_field_operand(raw, BITS, f, MODE, USE_ASM), ps, acc_fields[f]),)
        return out

    @triton.jit
    def _field_centre(BITS: tl.constexpr, F: tl.constexpr):
        """1024 + mid of field F at its fp16 position (field_layout): what MODE 2 subtracts."""
        OFFSET: tl.constexpr = F * BITS
        if OFFSET + BITS <= 10:
            POS: tl.constexpr = OFFSET
        else:
            POS: tl.constexpr = OFFSET - 8
        return _MAGIC + (1 << (POS + BITS - 1))

    @triton.jit
    def _centre_inputs(
        acc_fields, step_sum, BITS: tl.constexpr, NE: tl.constexpr = 16, STACK: tl.constexpr = 1
    ):
        """Accumulator inputs that centre magic value fields inside the MMA: acc - (1024 + mid_f) *
        sum_n ps per field f (mid_f: half the field's range at its fp16 position, as _field_operand's
        MODE 2 subtracts; per row for stacked operands), so the operands need no per-pair subtract.
        step_sum: the step's token sums of ps in the accumulators' layout."""
        out = ()
        for f in tl.static_range(len(acc_fields)):
            if STACK > 1:
                centre = _stacked_centres(acc_fields[f].shape[0], NE, STACK, f, BITS)
            else:
                centre = _field_centre(BITS, f)
            out = out + (acc_fields[f] - centre * step_sum,)
        return out

    @triton.jit
    def _chunk_rescale(acc_fields, alpha):
        out = ()
        for f in tl.static_range(len(acc_fields)):
            out = out + (acc_fields[f] * alpha[None, :],)
        return out

    @triton.jit
    def _chunk_store(
        acc_out,
        acc_fields,
        psum,
        v_step_ptr,
        v_shift_ptr,
        slot_coef_ptr,
        row_ok,
        SLOT0: tl.constexpr,
        NEP: tl.constexpr,
        BITS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D: tl.constexpr,
    ):
        """Coefficient sums of one chunk, scattered from kernel slots to coefficient order."""
        local = tl.arange(0, BLOCK_M)
        for f in tl.static_range(len(acc_fields)):
            slots = SLOT0 + f * NEP + tl.arange(0, NEP)
            coef = tl.load(slot_coef_ptr + slots)
            step = tl.load(v_step_ptr + slots)
            shift = tl.load(v_shift_ptr + slots)
            values = (acc_fields[f] + shift[:, None] * psum[None, :]) * step[:, None]
            tl.store(
                acc_out + local[None, :] * D + coef[:, None],
                values,
                mask=(coef >= 0)[:, None] & row_ok[None, :],
            )

    @triton.jit
    def _split_kernel_v2(
        qw_ptr,
        qc_ptr,
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        kc_ptr,
        kc_stride_b,
        kc_stride_h,
        ks_ptr,
        ks_stride_b,
        ks_stride_h,
        vc_ptr,
        vc_stride_b,
        vc_stride_h,
        vs_ptr,
        vs_stride_b,
        vs_stride_h,
        ke_ptr,
        ke_stride_b,
        ke_stride_h,
        ke_stride_s,
        ve_ptr,
        ve_stride_b,
        ve_stride_h,
        ve_stride_s,
        seq_lens_ptr,
        v_step_ptr,
        v_shift_ptr,
        slot_coef_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        num_splits,
        split_num,  # each split's share of the compressed span: split_num / split_den (SplitPlan)
        split_den,
        qk_scale,
        CODE_STRIDE: tl.constexpr,
        SCALE_STRIDE: tl.constexpr,
        N_SCALES: tl.constexpr,
        D: tl.constexpr,
        S: tl.constexpr,
        BLOCK_M: tl.constexpr,
        N_QC: tl.constexpr,  # prologue chunks whose score-offset shares add up (see _load_qc)
        BLOCK_N: tl.constexpr,
        EXACT_BLOCK: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
        USE_ASM: tl.constexpr,
        SUBNORMAL: tl.constexpr,
        LAZY_RESCALE: tl.constexpr,
        CHUNKS: tl.constexpr,
        EXACT_SPLIT: tl.constexpr,
        CENTRE_IN_MMA: tl.constexpr = False,  # magic value fields centred via the MMA's C input
        VALUE_WORDS_ONCE: tl.constexpr = False,  # LaunchConfig.value_words_once
    ):
        """One (split, sequence, kv head, row block) of the v2 kernel: code rows read as int16
        elements (narrow key chunks as bytes), one MMA per bit field; keys put tokens on the MMA's
        M, values put slots on M and tokens on K (int16 elements let ldmatrix.trans deliver token
        pairs, no byte gathers). S: key slots. Last split: the exact tokens."""
        split = tl.program_id(0)
        pid = tl.program_id(1)
        row_block = pid % n_row_blocks
        kv_head = (pid // n_row_blocks) % n_kv_heads
        batch = pid // (n_row_blocks * n_kv_heads)
        local = tl.arange(0, BLOCK_M)
        rows = row_block * BLOCK_M + local
        row_ok = rows < group * n_new
        token = rows % n_new
        seq_len = tl.load(seq_lens_ptr + batch).to(tl.int32)
        limit = tl.where(row_ok, seq_len - n_new + token + 1, 0)
        part = pid * (num_splits + 1) + split
        m_out = m_ptr + part * BLOCK_M
        l_out = l_ptr + part * BLOCK_M
        acc_out = acc_ptr + part * BLOCK_M * D
        if split == num_splits:
            head = kv_head * group + rows // n_new
            q_rows = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
            _exact_part_t(
                q_rows,
                ke_ptr + batch * ke_stride_b + kv_head * ke_stride_h,
                ve_ptr + batch * ve_stride_b + kv_head * ve_stride_h,
                ke_stride_s,
                ve_stride_s,
                seq_len,
                limit,
                row_ok,
                qk_scale,
                m_out,
                l_out,
                acc_out,
                D,
                BLOCK_M,
                EXACT_BLOCK,
                SINKS,
                WINDOW,
                EXACT_SPLIT,
                0,
                SINKS + WINDOW,
            )
        else:
            if SUBNORMAL:
                K_MODE: tl.constexpr = 0
                V_MODE: tl.constexpr = 0
                K_MUL: tl.constexpr = 16777216.0  # 1 / SUBNORMAL_UNIT
            else:
                K_MODE: tl.constexpr = 1
                if CENTRE_IN_MMA:  # magic value fields, centred through the accumulator input
                    V_MODE: tl.constexpr = 1
                else:
                    V_MODE: tl.constexpr = 2
                K_MUL: tl.constexpr = 1.0
            comp_hi = tl.minimum(tl.maximum(seq_len - WINDOW, SINKS), tl.max(limit, axis=0))
            span = tl.maximum(comp_hi - SINKS, 0).to(tl.int64)  # (x split_num may pass 2^31)
            chunk = tl.cdiv(tl.cdiv(span * split_num, split_den).to(tl.int32), BLOCK_N) * BLOCK_N
            lo = SINKS + split * chunk
            hi = tl.minimum(lo + chunk, comp_hi)
            row_hi = tl.minimum(limit, hi)
            qw_rows = qw_ptr + pid * BLOCK_M * S + local[None, :] * S
            kc_base = kc_ptr + batch * kc_stride_b + kv_head * kc_stride_h
            ks_base = ks_ptr + batch * ks_stride_b + kv_head * ks_stride_h
            vc_base = vc_ptr + batch * vc_stride_b + kv_head * vc_stride_h
            vs_base = vs_ptr + batch * vs_stride_b + kv_head * vs_stride_h
            # CHUNKS[c] = (E0, NE, BITS, SCALE, K_SLOT0, V_SLOT0, NEP, K_BYTES, KNP, V_STACK,
            # K_STACK): first int16 element, int16 elements, bits, scale index, first key / value
            # slot, value slots per operand, keys read as bytes, key slots per operand, bit fields
            # per value / key operand (attention_plans._FieldChunk).
            qs = ()
            accs = ()
            qcs = ()
            psum_accs = ()
            for c in tl.static_range(len(CHUNKS)):
                q_fields, acc_fields = _chunk_init(
                    qw_rows,
                    CHUNKS[c][4],
                    (8 if CHUNKS[c][7] else 16) // CHUNKS[c][2] // CHUNKS[c][10],
                    CHUNKS[c][8],
                    16 // CHUNKS[c][2] // CHUNKS[c][9],
                    CHUNKS[c][6],
                    BLOCK_M,
                )
                qs = qs + (q_fields,)
                accs = accs + (acc_fields,)
                qcs = qcs + (_load_qc(qc_ptr, pid, local, c, BLOCK_M, N_QC),)
                psum_accs = psum_accs + (tl.zeros([16, BLOCK_M], tl.float32),)
            # sums over tokens come out of the tensor cores: ones[16, tokens] @ p (every row alike)
            ones = tl.full([16, BLOCK_N], 1.0, tl.float16)
            l_acc = tl.zeros([16, BLOCK_M], tl.float32)
            m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
            for start in range(lo, hi, BLOCK_N):
                offs_n = start + tl.arange(0, BLOCK_N)
                n_ok = offs_n < hi
                kc_rows = kc_base + offs_n * CODE_STRIDE
                # the scales as whole rows (4-byte cp.async for two bands; 2-byte loads per band
                # would not pipeline and stall every step on global-memory latency)
                ks0, ks1, ks2, ks3 = _load_scales(ks_base + offs_n * SCALE_STRIDE, n_ok, N_SCALES, BLOCK_N)
                s = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                for c in tl.static_range(len(CHUNKS)):
                    dots = _chunk_scores(
                        kc_rows,
                        n_ok,
                        qs[c],
                        CHUNKS[c][0],
                        CHUNKS[c][1],
                        CHUNKS[c][2],
                        CHUNKS[c][7],
                        CHUNKS[c][8],
                        K_MODE,
                        USE_ASM,
                        CHUNKS[c][10],
                    )
                    scale = _pick(ks0, ks1, ks2, ks3, CHUNKS[c][3]) * K_MUL
                    s += (dots + qcs[c][None, :]) * scale[:, None]
                s = tl.where(offs_n[:, None] < row_hi[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=0))
                # LAZY_RESCALE: touch the accumulators only when some row's running max grew
                if (not LAZY_RESCALE) or tl.max(m_new - m_i, axis=0) > 0:
                    alpha = tl.exp2(m_i - m_new)
                    l_acc = l_acc * alpha[None, :]
                    new_accs = ()
                    new_psums = ()
                    for c in tl.static_range(len(CHUNKS)):
                        new_accs = new_accs + (_chunk_rescale(accs[c], alpha),)
                        new_psums = new_psums + (psum_accs[c] * alpha[None, :],)
                    accs = new_accs
                    psum_accs = new_psums
                    m_i = m_new
                p = tl.exp2(s - m_i[None, :]).to(tl.float16)
                l_acc = tl.dot(ones, p, l_acc)
                vc_rows = vc_base + offs_n * CODE_STRIDE
                vs0, vs1, vs2, vs3 = _load_scales(vs_base + offs_n * SCALE_STRIDE, n_ok, N_SCALES, BLOCK_N)
                new_accs = ()
                new_psums = ()
                for c in tl.static_range(len(CHUNKS)):
                    ps = p * _pick(vs0, vs1, vs2, vs3, CHUNKS[c][3]).to(tl.float16)[:, None]
                    if CENTRE_IN_MMA:
                        # sum_n ps from the tensor cores, already in the accumulators' layout
                        step_sum = tl.dot(ones, ps)
                        if CHUNKS[c][6] == 16:
                            step_wide = step_sum
                        else:  # wider value operands (head_dim 256): the sums in their shape
                            step_wide = tl.dot(tl.full([CHUNKS[c][6], BLOCK_N], 1.0, tl.float16), ps)
                        acc_in = _centre_inputs(accs[c], step_wide, CHUNKS[c][2], CHUNKS[c][1], CHUNKS[c][9])
                    else:
                        acc_in = accs[c]
                    new_accs = new_accs + (
                        _chunk_values(
                            vc_rows,
                            n_ok,
                            ps,
                            acc_in,
                            CHUNKS[c][0],
                            CHUNKS[c][1],
                            CHUNKS[c][6],
                            CHUNKS[c][2],
                            V_MODE,
                            USE_ASM,
                            CHUNKS[c][9],
                            VALUE_WORDS_ONCE,
                        ),
                    )
                    if CENTRE_IN_MMA:
                        new_psums = new_psums + (psum_accs[c] + step_sum,)
                    else:
                        new_psums = new_psums + (tl.dot(ones, ps, psum_accs[c]),)
                accs = new_accs
                psum_accs = new_psums
            l_i = tl.max(l_acc, axis=0)
            tl.store(m_out + local, m_i, mask=row_ok)
            tl.store(l_out + local, l_i, mask=row_ok)
            for c in tl.static_range(len(CHUNKS)):
                _chunk_store(
                    acc_out,
                    accs[c],
                    tl.max(psum_accs[c], axis=0),
                    v_step_ptr,
                    v_shift_ptr,
                    slot_coef_ptr,
                    row_ok,
                    CHUNKS[c][5],
                    CHUNKS[c][6],
                    CHUNKS[c][2],
                    BLOCK_M,
                    D,
                )

    @triton.jit
    def _exact_kernel(
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        ke_ptr,
        ke_stride_b,
        ke_stride_h,
        ke_stride_s,
        ve_ptr,
        ve_stride_b,
        ve_stride_h,
        ve_stride_s,
        seq_lens_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        num_splits,
        n_parts,  # partials per program: num_splits compressed ranges, then the exact chunks
        qk_scale,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        EXACT_BLOCK: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
        EXACT_SPLIT: tl.constexpr,
        CHUNK_SLOTS: tl.constexpr,  # exact slots per program (a multiple of EXACT_BLOCK)
        # launched with PDL after the split kernel it does not read (LaunchConfig.exact_in_chain):
        # the reduce may launch at once; this kernel's inputs were written before the attention
        # call, so it runs without waiting, and it waits for the split kernel only before it ends,
        # so that the reduce's own wait (for this kernel) also covers the split kernel
        PDL_CHAIN: tl.constexpr = False,
        # >= 0: the preferred shared-memory carveout (percent) that launch() sets on this compiled
        # variant (LaunchConfig.exact_carveout; the body does not read it)
        CARVEOUT: tl.constexpr = -1,
    ):
        """The exact sink/window tokens of one (sequence, kv head, row block) as partials num_splits
        onwards, one per chunk of CHUNK_SLOTS slots (grid (programs, chunks)), for split kernels that
        handle only the compressed ranges (v3, which Gluon writes and which cannot call Triton
        functions)."""
        if PDL_CHAIN:
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        chunk = tl.program_id(1)
        row_block = pid % n_row_blocks
        kv_head = (pid // n_row_blocks) % n_kv_heads
        batch = pid // (n_row_blocks * n_kv_heads)
        rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < group * n_new
        token = rows % n_new
        seq_len = tl.load(seq_lens_ptr + batch).to(tl.int32)
        limit = tl.where(row_ok, seq_len - n_new + token + 1, 0)
        part = pid * n_parts + num_splits + chunk
        head = kv_head * group + rows // n_new
        _exact_part_t(
            q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t,
            ke_ptr + batch * ke_stride_b + kv_head * ke_stride_h,
            ve_ptr + batch * ve_stride_b + kv_head * ve_stride_h,
            ke_stride_s,
            ve_stride_s,
            seq_len,
            limit,
            row_ok,
            qk_scale,
            m_ptr + part * BLOCK_M,
            l_ptr + part * BLOCK_M,
            acc_ptr + part * BLOCK_M * D,
            D,
            BLOCK_M,
            EXACT_BLOCK,
            SINKS,
            WINDOW,
            EXACT_SPLIT,
            chunk * CHUNK_SLOTS,
            tl.minimum(chunk * CHUNK_SLOTS + CHUNK_SLOTS, SINKS + WINDOW),
        )
        if PDL_CHAIN:
            tl.extra.cuda.gdc_wait()
