"""The decode attention op's reduce done by the last program of each (sequence, kv head, row
block), instead of by kernels of its own (``LaunchConfig.reduce_in_last_program``).

Every program that writes one of a pair's ``n_parts`` partials (the split kernel's compressed
splits, the exact-token kernel's chunks) then counts itself in on the pair's arrival counter. The
one that arrives last merges the partials, maps the coefficient sums back to channels, adds the
exact part and the value offset and writes the output rows. The counters are the call's own
(``arrival_counters``), zeroed by its prologue kernel, which both partial writers wait for. This
is the single-pass pattern of CUB's decoupled reductions and of the CUDA programming guide's "last
block" sum: it removes the reduce's launches and their wait for the slowest program of the whole
launch; a pair's reduce runs as soon as its own partials are in.

Memory ordering: every thread's partial stores come before a CTA barrier, then one thread's
``atom.acq_rel.gpu`` (release of what the CTA wrote, acquire of what the other programs released),
then a barrier before anyone reads (as cooperative groups' grid sync orders a grid). The partial
reads bypass L1 (``.cg``) besides.

Two versions of the same epilogue, for the two kinds of kernel that write partials:

- ``arrive_and_reduce`` (Triton): the v1 split kernel and the exact-token kernel;
- ``arrive_and_reduce_gluon`` (Gluon, one warp, explicit layouts): the v3 split kernel.

The math is the per-row reduce's (kernels/attention_reduce.py): two softmax groups (compressed
splits in the coefficient domain, exact tokens in the channel domain) merged from the same loads;
the tests compare both paths on fresh inputs.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the reference runs anywhere.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

try:  # Gluon ships with Triton >= 3.5; without it the v3 kernel (its only user) is unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    # Triton 3.6 names the CTA barrier thread_barrier; 3.9 renamed it barrier
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAS_GLUON = True
except Exception:  # noqa: BLE001 - any import failure means "no Gluon here"
    HAS_GLUON = False


def arrival_counters(device: torch.device, programs: int) -> torch.Tensor:
    """One int32 arrival counter per program, for one call. Not zeroed here: the call's prologue
    kernel zeroes them before any split or exact-token program can arrive (both wait for it), so a
    call costs no memset, and each call (concurrent ones on other streams, CUDA graphs) has its own."""
    return torch.empty(max(programs, 1), dtype=torch.int32, device=device)


def parts_per_load(block_m: int, d: int) -> int:
    """Partials the epilogue merges per load: [parts, block_m, d] fp32 in about 64 registers a
    lane of one warp (a power of two, 1 .. 8)."""
    parts = max(1, min(8, 2048 // max(block_m * d, 1)))
    return 1 << (parts.bit_length() - 1)


if HAS_TRITON:
    _NEG_BIG = tl.constexpr(-1.0e30)  # the split kernels' "no score yet"

    @triton.jit
    def arrive_and_reduce(
        arrivals_ptr,  # int32 [programs]: partials of each program written so far (this call's)
        m_ptr,  # fp32 [programs, n_parts, BLOCK_M]: running max (log2 domain)
        l_ptr,  # fp32 [programs, n_parts, BLOCK_M]: softmax denominator
        acc_ptr,  # fp32 [programs, n_parts, BLOCK_M, D]: sums (coefficients, then exact channels)
        program,  # this (sequence, kv head, row block)
        n_row_blocks,
        n_kv_heads,
        group,
        n_new,
        num_splits,  # partials 0 .. num_splits - 1 are the compressed splits' ...
        n_parts,  # ... the rest the exact tokens'
        transform_ptr,  # fp32 [(Hkv,) D, D]: coefficient sums -> channels (W, or W R s)
        transform_stride_h,
        v_scale_ptr,  # [Hkv, D] value channel scale
        v_scale_stride_h,
        v_offset_ptr,  # [Hkv, D] value offset (read with OFFSET)
        v_offset_stride_h,
        out_ptr,  # [B, Hq, n_new, D] in the query's dtype
        out_stride_b,
        out_stride_h,
        out_stride_t,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        PARTS: tl.constexpr,  # partials merged per load (parts_per_load)
        OFFSET: tl.constexpr,
    ):
        """Count this program's partial in; if it was the pair's last, reduce the pair (see the
        module docstring). Call after the partial's stores, from every thread."""
        tl.debug_barrier()  # every thread's partial stores before the arrival (released by it)
        arrived = tl.atomic_add(arrivals_ptr + program, 1, sem="acq_rel", scope="gpu")
        if arrived == n_parts - 1:  # every partial is in
            tl.debug_barrier()  # the acquire before any thread's loads
            row_block = program % n_row_blocks
            kv_head = (program // n_row_blocks) % n_kv_heads
            batch = program // (n_row_blocks * n_kv_heads)
            r = tl.arange(0, BLOCK_M)
            rows = row_block * BLOCK_M + r
            row_ok = rows < group * n_new
            ch = tl.arange(0, D)
            base = program * n_parts
            m_c = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
            l_c = tl.zeros([BLOCK_M], tl.float32)
            acc_c = tl.zeros([BLOCK_M, D], tl.float32)
            m_e = m_c
            l_e = l_c
            acc_e = acc_c
            for first in range(0, n_parts, PARTS):
                p = first + tl.arange(0, PARTS)
                ok = (p < n_parts)[:, None] & row_ok[None, :]  # [PARTS, BLOCK_M]
                idx = (base + p)[:, None] * BLOCK_M + r[None, :]
                m_s = tl.load(m_ptr + idx, mask=ok, other=_NEG_BIG, cache_modifier=".cg")
                l_s = tl.load(l_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(
                    acc_ptr + idx[:, :, None] * D + ch[None, None, :],
                    mask=ok[:, :, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                exact = (p >= num_splits)[:, None]
                m_sc = tl.where(exact, _NEG_BIG, m_s)
                m_se = tl.where(exact, m_s, _NEG_BIG)
                new_c = tl.maximum(m_c, tl.max(m_sc, axis=0))
                new_e = tl.maximum(m_e, tl.max(m_se, axis=0))
                # each group's weights are zero on the other group's partials
                w_c = tl.where(exact, 0.0, tl.exp2(m_sc - new_c[None, :]))
                w_e = tl.where(exact, tl.exp2(m_se - new_e[None, :]), 0.0)
                alpha_c = tl.exp2(m_c - new_c)
                alpha_e = tl.exp2(m_e - new_e)
                acc_c = acc_c * alpha_c[:, None] + tl.sum(acc_s * w_c[:, :, None], axis=0)
                acc_e = acc_e * alpha_e[:, None] + tl.sum(acc_s * w_e[:, :, None], axis=0)
                l_c = l_c * alpha_c + tl.sum(l_s * w_c, axis=0)
                l_e = l_e * alpha_e + tl.sum(l_s * w_e, axis=0)
                m_c = new_c
                m_e = new_e
            m_f = tl.maximum(m_c, m_e)
            alpha = tl.exp2(m_c - m_f)
            beta = tl.exp2(m_e - m_f)
            denom = l_c * alpha + l_e * beta
            denom = tl.where(denom > 0, denom, 1.0)  # padding rows only
            # the normalised coefficient sums go through partial 0's rows (no one else reads them
            # now), so the transform can take them 8 coefficients at a time in every thread
            scratch = acc_ptr + (base * BLOCK_M + r)[:, None] * D
            tl.store(scratch + ch[None, :], acc_c * (alpha / denom)[:, None], mask=row_ok[:, None])
            tl.debug_barrier()
            values = tl.zeros([BLOCK_M, D], tl.float32)
            for c0 in tl.static_range(0, D, 8):
                c = c0 + tl.arange(0, 8)
                coef = tl.load(scratch + c[None, :], mask=row_ok[:, None], other=0.0)  # [BLOCK_M, 8]
                w = tl.load(
                    transform_ptr + kv_head * transform_stride_h + c[:, None] * D + ch[None, :]
                )  # [8 coefficients, D channels]
                values += tl.sum(coef[:, :, None] * w[None, :, :], axis=1)
            scale = tl.load(v_scale_ptr + kv_head * v_scale_stride_h + ch).to(tl.float32)
            o = values * scale[None, :] + acc_e * (beta / denom)[:, None]
            if OFFSET:
                o = o + tl.load(v_offset_ptr + kv_head * v_offset_stride_h + ch).to(tl.float32)[None, :]
            head = kv_head * group + rows // n_new
            token = rows % n_new
            out_rows = out_ptr + batch * out_stride_b + head * out_stride_h + token * out_stride_t
            tl.store(out_rows[:, None] + ch[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


if HAS_GLUON:
    # one warp: [parts, rows, channels] with 4 channels a lane (16-byte loads), rows and parts in
    # every lane; and [rows, 8 coefficients, channels] for the transform, the coefficients in
    # every lane so their sum needs no shuffle
    _PARTS3 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 1, 32], [1, 1, 1], [2, 1, 0]))
    _COEF3 = gl.constexpr(gl.BlockedLayout([1, 8, 4], [1, 1, 32], [1, 1, 1], [2, 1, 0]))
    _G_NEG_BIG = gl.constexpr(-1.0e30)

    @gluon.jit
    def _rows_of(vector, LAYOUT: gl.constexpr):
        """A [rows] vector in LAYOUT (a slice of a 2-D layout over rows): the same values."""
        return gl.convert_layout(vector, LAYOUT)

    @gluon.jit(noinline=True)
    def arrive_and_reduce_gluon(
        arrivals_ptr,
        m_ptr,
        l_ptr,
        acc_ptr,
        program,
        n_row_blocks,
        n_kv_heads,
        group,
        n_new,
        num_splits,
        n_parts,
        transform_ptr,
        transform_stride_h,
        v_scale_ptr,
        v_scale_stride_h,
        v_offset_ptr,
        v_offset_stride_h,
        out_ptr,
        out_stride_b,
        out_stride_h,
        out_stride_t,
        D: gl.constexpr,
        BLOCK_M: gl.constexpr,
        PARTS: gl.constexpr,
        OFFSET: gl.constexpr,
    ):
        """arrive_and_reduce (same arguments) for a one-warp Gluon kernel. The caller passes what
        its loop need not keep live (program ids re-read, kernel arguments): values held across the
        split kernel's loop for this would take its registers."""
        _cta_barrier()  # every lane's partial stores before the arrival (released by it)
        arrived = gl.atomic_add(arrivals_ptr + program, 1, sem="acq_rel", scope="gpu")
        if arrived == n_parts - 1:  # every partial is in
            _cta_barrier()
            row_block = program % n_row_blocks
            kv_head = (program // n_row_blocks) % n_kv_heads
            batch = program // (n_row_blocks * n_kv_heads)
            ROWS2: gl.constexpr = gl.SliceLayout(0, _PARTS3)  # [rows, channels]
            PR2: gl.constexpr = gl.SliceLayout(2, _PARTS3)  # [parts, rows]
            RV: gl.constexpr = gl.SliceLayout(1, ROWS2)  # [rows] beside [rows, channels]
            RP: gl.constexpr = gl.SliceLayout(0, PR2)  # [rows] beside [parts, rows]
            r = gl.arange(0, BLOCK_M, layout=RP)
            row_ok = (row_block * BLOCK_M + r) < group * n_new
            ch = gl.arange(0, D, layout=gl.SliceLayout(0, ROWS2))
            base = program * n_parts
            m_c = gl.full([BLOCK_M], _G_NEG_BIG, gl.float32, layout=RP)
            l_c = gl.zeros([BLOCK_M], gl.float32, layout=RP)
            acc_c = gl.zeros([BLOCK_M, D], gl.float32, layout=ROWS2)
            m_e = m_c
            l_e = l_c
            acc_e = acc_c
            for first in range(0, n_parts, PARTS):
                p = first + gl.arange(0, PARTS, layout=gl.SliceLayout(1, PR2))
                ok = gl.expand_dims(p < n_parts, 1) & gl.expand_dims(row_ok, 0)  # [PARTS, BLOCK_M]
                idx = gl.expand_dims(base + p, 1) * BLOCK_M + gl.expand_dims(r, 0)
                m_s = gl.load(m_ptr + idx, mask=ok, other=_G_NEG_BIG, cache_modifier=".cg")
                l_s = gl.load(l_ptr + idx, mask=ok, other=0.0, cache_modifier=".cg")
                idx3 = gl.expand_dims(idx, 2) * D + gl.expand_dims(gl.expand_dims(ch, 0), 0)
                acc_s = gl.load(acc_ptr + idx3, mask=gl.expand_dims(ok, 2), other=0.0, cache_modifier=".cg")
                exact = gl.expand_dims(p >= num_splits, 1)
                m_sc = gl.where(exact, _G_NEG_BIG, m_s)
                m_se = gl.where(exact, m_s, _G_NEG_BIG)
                new_c = gl.maximum(m_c, gl.max(m_sc, axis=0))
                new_e = gl.maximum(m_e, gl.max(m_se, axis=0))
                w_c = gl.where(exact, 0.0, gl.exp2(m_sc - gl.expand_dims(new_c, 0)))
                w_e = gl.where(exact, gl.exp2(m_se - gl.expand_dims(new_e, 0)), 0.0)
                alpha_c = gl.exp2(m_c - new_c)
                alpha_e = gl.exp2(m_e - new_e)
                acc_c = acc_c * gl.expand_dims(_rows_of(alpha_c, RV), 1) + gl.sum(
                    acc_s * gl.expand_dims(w_c, 2), axis=0
                )
                acc_e = acc_e * gl.expand_dims(_rows_of(alpha_e, RV), 1) + gl.sum(
                    acc_s * gl.expand_dims(w_e, 2), axis=0
                )
                l_c = l_c * alpha_c + gl.sum(l_s * w_c, axis=0)
                l_e = l_e * alpha_e + gl.sum(l_s * w_e, axis=0)
                m_c = new_c
                m_e = new_e
            m_f = gl.maximum(m_c, m_e)
            alpha = gl.exp2(m_c - m_f)
            beta = gl.exp2(m_e - m_f)
            denom = l_c * alpha + l_e * beta
            denom = gl.where(denom > 0, denom, 1.0)  # padding rows only
            r2 = gl.arange(0, BLOCK_M, layout=RV)
            ok2 = gl.expand_dims((row_block * BLOCK_M + r2) < group * n_new, 1)
            scratch = acc_ptr + gl.expand_dims((base * BLOCK_M + r2) * D, 1)
            gl.store(
                scratch + gl.expand_dims(ch, 0),
                acc_c * gl.expand_dims(_rows_of(alpha / denom, RV), 1),
                mask=ok2,
            )
            _cta_barrier()
            # the transform, 8 coefficients a step: [rows, 8] in every lane x [8, channels]
            CR: gl.constexpr = gl.SliceLayout(2, _COEF3)  # [rows, coefficients]
            CW: gl.constexpr = gl.SliceLayout(0, _COEF3)  # [coefficients, channels]
            OUT2: gl.constexpr = gl.SliceLayout(1, _COEF3)  # [rows, channels]
            rc = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, CR))
            c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, CR))
            cw = gl.arange(0, 8, layout=gl.SliceLayout(1, CW))
            chw = gl.arange(0, D, layout=gl.SliceLayout(0, CW))
            coef_rows = acc_ptr + gl.expand_dims((base * BLOCK_M + rc) * D, 1)
            coef_ok = gl.expand_dims((row_block * BLOCK_M + rc) < group * n_new, 1)
            w_rows = transform_ptr + kv_head * transform_stride_h + gl.expand_dims(cw, 1) * D
            values = gl.zeros([BLOCK_M, D], gl.float32, layout=OUT2)
            for c0 in gl.static_range(0, D, 8):
                coef = gl.load(coef_rows + gl.expand_dims(c0 + c8, 0), mask=coef_ok, other=0.0)
                w = gl.load(w_rows + c0 * D + gl.expand_dims(chw, 0))
                values += gl.sum(gl.expand_dims(coef, 2) * gl.expand_dims(w, 0), axis=1)
            OV: gl.constexpr = gl.SliceLayout(1, OUT2)
            ro = gl.arange(0, BLOCK_M, layout=OV)
            cho = gl.arange(0, D, layout=gl.SliceLayout(0, OUT2))
            scale = gl.load(v_scale_ptr + kv_head * v_scale_stride_h + cho).to(gl.float32)
            exact_part = gl.convert_layout(acc_e * gl.expand_dims(_rows_of(beta / denom, RV), 1), OUT2)
            o = values * gl.expand_dims(scale, 0) + exact_part
            if OFFSET:
                offset = gl.load(v_offset_ptr + kv_head * v_offset_stride_h + cho).to(gl.float32)
                o = o + gl.expand_dims(offset, 0)
            rows = row_block * BLOCK_M + ro
            head = kv_head * group + rows // n_new
            token = rows % n_new
            out_rows = out_ptr + batch * out_stride_b + head * out_stride_h + token * out_stride_t
            gl.store(
                gl.expand_dims(out_rows, 1) + gl.expand_dims(cho, 0),
                o.to(out_ptr.dtype.element_ty),
                mask=gl.expand_dims(rows < group * n_new, 1),
            )
