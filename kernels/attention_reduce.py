"""The reduce of the decode attention op (`wmoe::wavelet_attention`): the kernels that merge each
(sequence, kv head, row block)'s partials and write the output.

A call's split kernel leaves, per program, ``n_parts`` partials (running max, softmax denominator,
sums): the compressed splits' sums in the coefficient domain, then the exact tokens' in the
channel domain. The reduce merges both groups under one softmax from the same loads, maps the
coefficient sums back to channels once (``W R s``, one folded matrix per kv head), adds the value
offset and writes the output in the query's dtype. Three shapes of it, chosen by the launcher in
kernels/wavelet_attention.py:

- ``_reduce_kernel``: one program per row block (prefill chunks, many rows a program);
- ``_reduce_rows_kernel``: one program per query row (decode launches with few pairs);
- its ``MERGE_ONLY`` mode, then ``_transform_heads_kernel``: the merge per row, then the transform as
  one dot per kv head over 16 rows (decode launches of at least ``reduce_gemm_min_rows`` rows);
- ``_merge_channel_rows_kernel``: where the split kernel already mapped its sums to channels
  (``LaunchConfig.transform_in_split``), every partial is in the channel domain: one softmax over
  all of them, a slice of a row's channels per program, and no transform.

Each also applies learned sink logits (gpt-oss; ``SINK_LOGITS``): the row's output times the share
of the softmax mass its positions keep next to the sink (``kept_mass``).

The math is ``wavelet_attention_reference``'s (kernels/wavelet_attention.py); the tests compare every
mode with it and with fp32 SDPA. Measurements that chose between them: benchmarks/RESULTS.md.
"""

from __future__ import annotations

from .attention_config import LaunchConfig

try:  # Triton is optional: the reference runs anywhere.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False


REDUCE_GEMM_TILE = 16  # rows per _transform_heads_kernel program (the dot's M)


def reduce_split_chunk(config: LaunchConfig, n_parts: int) -> int:
    """Partials the per-row reduce merges per load: the config's chunk, or the next power of two at
    or above the program's n_parts (compressed splits and exact partials) when that is smaller.
    Twelfth session (H200, (32, 32768), 12 splits): 16 per load 0.2904 / 0.2888 ms against 64's
    0.2916 / 0.2916; at B = 8 (49 splits) 16 was 1-2.5% slower than 64, and this keeps 64 there."""
    return min(config.reduce_split_chunk, 1 << max(n_parts - 1, 0).bit_length())


def uses_reduce_gemm(config: LaunchConfig, rows: int, n_row_blocks: int) -> bool:
    """Whether a launch of `rows` query rows (sequences x kv heads x row block) ends in the merge
    and the per-kv-head transform (LaunchConfig.reduce_gemm_min_rows): decode launches (one row
    block per sequence and kv head, the transform kernel's row mapping) with enough rows."""
    return n_row_blocks == 1 and 0 < config.reduce_gemm_min_rows <= rows


if HAS_TRITON:
    # finite "no score yet", as in the split kernels: exp2(_NEG_BIG - _NEG_BIG) stays 1, never a NaN
    _NEG_BIG = tl.constexpr(-1.0e30)
    _LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def kept_mass(denom, m_f, sink):
        """The share of softmax mass the positions keep next to a learned sink logit (gpt-oss):
        L / (L + e^s), with L = denom * 2^m_f and `sink` = s log2(e) in the split kernels' base-2
        units. Multiplying the sink-free output (value offset included: its weights summed to 1)
        by it is the softmax over cat(scores, s) with the sink's column dropped. denom >= 1 on real
        rows, so a sink far above the scores gives 0, far below gives 1, never a NaN."""
        return denom / (denom + tl.exp2(sink - m_f))

    @triton.jit
    def _sink_logit_row(
        sink_ptr,
        q_row,
        k_offset_ptr,
        k_offset_stride_h,
        qk_scale,
        kv_head,
        head,
        D: tl.constexpr,
        KEY_OFFSET: tl.constexpr,
    ):
        """One query row's sink logit in base-2 units. KEY_OFFSET: the keys were stored centred, so
        the kernels' scores lack qk_scale * q . m_k (a shift softmax over the positions ignores);
        the sink's logit moves by as much instead. q_row: the row's query pointer."""
        sink = tl.load(sink_ptr + head).to(tl.float32) * _LOG2E
        if KEY_OFFSET:
            d = tl.arange(0, D)
            q = tl.load(q_row + d).to(tl.float32)
            m_k = tl.load(k_offset_ptr + kv_head * k_offset_stride_h + d).to(tl.float32)
            sink -= qk_scale * tl.sum(q * m_k, axis=0)
        return sink

    @triton.jit
    def sink_logits_of_rows(
        sink_ptr,
        head,
        row_ok,
        q_rows,
        k_offset_ptr,
        k_offset_stride_h,
        qk_scale,
        kv_head,
        D: tl.constexpr,
        KEY_OFFSET: tl.constexpr,
    ):
        """_sink_logit_row for a block of query rows: `head` their query heads, `q_rows` pointers
        to their queries (read with KEY_OFFSET), `row_ok` the real ones. [BLOCK_M] fp32."""
        sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E
        if KEY_OFFSET:
            d = tl.arange(0, D)
            q = tl.load(q_rows[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            m_k = tl.load(k_offset_ptr + kv_head * k_offset_stride_h + d).to(tl.float32)
            sink -= qk_scale * tl.sum(q * m_k[None, :], axis=1)
        return sink

    @triton.jit
    def _reduce_store(
        values,
        cols,
        acc_ptr,
        exact,
        v_channel_scale_ptr,
        v_scale_stride_h,
        v_offset_ptr,
        v_offset_stride_h,
        kv_head,
        alpha,
        beta,
        denom,
        kept,
        out_rows,
        row_ok,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        OFFSET: tl.constexpr,
    ):
        """Columns `cols` of the output: compressed part (channel domain, before s) merged with the
        exact part under one softmax, plus the value offset, times `kept` (the mass a learned sink
        logit leaves the positions: 1 without one)."""
        local = tl.arange(0, BLOCK_M)
        values = (
            values * tl.load(v_channel_scale_ptr + kv_head * v_scale_stride_h + cols).to(tl.float32)[None, :]
        )
        acc_e = tl.load(
            acc_ptr + exact * BLOCK_M * D + local[:, None] * D + cols[None, :],
            mask=row_ok[:, None],
            other=0.0,
        )
        o = (values * alpha[:, None] + acc_e * beta[:, None]) / denom[:, None]
        if OFFSET:
            o = o + tl.load(v_offset_ptr + kv_head * v_offset_stride_h + cols).to(tl.float32)[None, :]
        o = o * kept[:, None]
        tl.store(out_rows[:, None] + cols[None, :], o.to(out_rows.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _merge_exact_in_place(
        m_ptr, l_ptr, acc_ptr, first, n_exact, row_ok, D: tl.constexpr, BLOCK_M: tl.constexpr
    ):
        """Merge exact-token partials first + 1 .. first + n_exact - 1 (LaunchConfig.exact_chunks)
        into partial `first`, in place, for the block reduce, which then reads `first` as the one
        exact part. Only this program reads these partials."""
        if n_exact > 1:
            local = tl.arange(0, BLOCK_M)
            d = tl.arange(0, D)
            rows = first * BLOCK_M + local
            m_e = tl.load(m_ptr + rows, mask=row_ok, other=_NEG_BIG)
            l_e = tl.load(l_ptr + rows, mask=row_ok, other=0.0)
            acc_e = tl.load(acc_ptr + rows[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
            for e in range(1, n_exact):
                other = (first + e) * BLOCK_M + local
                m_o = tl.load(m_ptr + other, mask=row_ok, other=_NEG_BIG)
                m_new = tl.maximum(m_e, m_o)
                a = tl.exp2(m_e - m_new)
                b = tl.exp2(m_o - m_new)
                l_e = l_e * a + tl.load(l_ptr + other, mask=row_ok, other=0.0) * b
                acc_o = tl.load(acc_ptr + other[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0)
                acc_e = acc_e * a[:, None] + acc_o * b[:, None]
                m_e = m_new
            tl.debug_barrier()  # every thread has read `first` before any overwrites it
            tl.store(m_ptr + rows, m_e, mask=row_ok)
            tl.store(l_ptr + rows, l_e, mask=row_ok)
            tl.store(acc_ptr + rows[:, None] * D + d[None, :], acc_e, mask=row_ok[:, None])
            tl.debug_barrier()  # and the caller's loads see the merged partial

    @triton.jit
    def _merge_parts_row(
        m_ptr,
        l_ptr,
        acc_ptr,
        base,
        num_splits,
        n_parts,
        row_local,
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        CHUNK: tl.constexpr,
        first_channel=0,
        CHANNELS: tl.constexpr = 0,
    ):
        """One query row's partials of program `base`, CHUNK per wide load (a serial chain of one
        small load per split waited on memory latency each time: 36.6 us for 66 splits at B = 8),
        merged under one softmax in two groups: the compressed splits (0 .. num_splits - 1,
        coefficient sums) and the exact tokens' (num_splits .. n_parts - 1, channel sums). One
        load serves both, so several exact partials (exact_chunks) cost no second round trip.
        CHANNELS > 0: only sums first_channel .. first_channel + CHANNELS - 1 (the maxima and
        denominators are whole either way). Returns (max, denominator, sums) of each group."""
        if CHANNELS > 0:
            d = first_channel + tl.arange(0, CHANNELS)
        else:
            d = tl.arange(0, D)
        m_c = tl.max(tl.full([CHUNK], _NEG_BIG, tl.float32), axis=0)
        l_c = tl.sum(tl.zeros([CHUNK], tl.float32), axis=0)
        acc_c = tl.zeros(d.shape, tl.float32)
        m_e = m_c
        l_e = l_c
        acc_e = tl.zeros(d.shape, tl.float32)
        for first in range(0, n_parts, CHUNK):
            split = first + tl.arange(0, CHUNK)
            ok = split < n_parts
            exact = split >= num_splits
            part = (base + split) * BLOCK_M + row_local
            m_s = tl.load(m_ptr + part, mask=ok, other=_NEG_BIG)
            l_s = tl.load(l_ptr + part, mask=ok, other=0.0)
            acc_s = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            m_sc = tl.where(exact, _NEG_BIG, m_s)
            m_se = tl.where(exact, m_s, _NEG_BIG)
            new_c = tl.maximum(m_c, tl.max(m_sc, axis=0))
            new_e = tl.maximum(m_e, tl.max(m_se, axis=0))
            # each group's weights are zero on the other group's partials
            w_c = tl.where(exact, 0.0, tl.exp2(m_sc - new_c))
            w_e = tl.where(exact, tl.exp2(m_se - new_e), 0.0)
            alpha_c = tl.exp2(m_c - new_c)
            alpha_e = tl.exp2(m_e - new_e)
            acc_c = acc_c * alpha_c + tl.sum(acc_s * w_c[:, None], axis=0)
            acc_e = acc_e * alpha_e + tl.sum(acc_s * w_e[:, None], axis=0)
            l_c = l_c * alpha_c + tl.sum(l_s * w_c, axis=0)
            l_e = l_e * alpha_e + tl.sum(l_s * w_e, axis=0)
            m_c = new_c
            m_e = new_e
        return m_c, l_c, acc_c, m_e, l_e, acc_e

    @triton.jit
    def _reduce_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        transform_ptr,
        transform_stride_h,
        v_channel_scale_ptr,
        v_scale_stride_h,
        v_offset_ptr,
        v_offset_stride_h,
        out_ptr,
        out_stride_b,
        out_stride_h,
        out_stride_t,
        sink_ptr,  # learned sink logits [Hq] (natural units), read with SINK_LOGITS
        q_ptr,  # the query, for q . m_k with SINK_KEY_OFFSET
        q_stride_b,
        q_stride_h,
        q_stride_t,
        k_offset_ptr,  # the keys' offset m_k [Hkv, D] rows, with SINK_KEY_OFFSET
        k_offset_stride_h,
        qk_scale,  # sm_scale * log2(e): the split kernels' score scale
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        num_splits,  # compressed splits: partials 0 .. num_splits - 1 of each program
        n_parts,  # partials per program: then the exact tokens' (one, or exact_chunks for v3)
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        D_CHUNK: tl.constexpr,
        OFFSET: tl.constexpr,
        SPLIT_CHUNK: tl.constexpr = 8,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
        SINK_LOGITS: tl.constexpr = False,  # scale each row by kept_mass (a sink logit per query head)
        SINK_KEY_OFFSET: tl.constexpr = False,  # the keys are stored centred: see _sink_logit_row
    ):
        """Merge the compressed splits, inverse-transform once (x - m = (R^T W^T c) * s), merge the
        exact part (stored centred), add the value offset m, write out. transform_ptr: [D, D], or
        per kv head (transform_stride_h) the composite of W, R and s (value_transform)."""
        if PDL:  # the previous kernel's writes are visible after this, none before it
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        row_block = pid % n_row_blocks
        kv_head = (pid // n_row_blocks) % n_kv_heads
        batch = pid // (n_row_blocks * n_kv_heads)
        local = tl.arange(0, BLOCK_M)
        rows = row_block * BLOCK_M + local
        row_ok = rows < group * n_new
        d = tl.arange(0, D)
        m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        base = pid * n_parts
        _merge_exact_in_place(
            m_ptr, l_ptr, acc_ptr, base + num_splits, n_parts - num_splits, row_ok, D, BLOCK_M
        )
        # SPLIT_CHUNK partials per step in one wide load: a serial chain of one small load per
        # split waited on memory latency each time (measured 36.6 us for 66 splits at B = 8)
        for first in range(0, num_splits, SPLIT_CHUNK):
            split = first + tl.arange(0, SPLIT_CHUNK)
            ok = (split < num_splits)[:, None] & row_ok[None, :]  # [SPLIT_CHUNK, BLOCK_M]
            part = base + split
            m_s = tl.load(m_ptr + part[:, None] * BLOCK_M + local[None, :], mask=ok, other=_NEG_BIG)
            l_s = tl.load(l_ptr + part[:, None] * BLOCK_M + local[None, :], mask=ok, other=0.0)
            acc_s = tl.load(
                acc_ptr + part[:, None, None] * BLOCK_M * D + local[None, :, None] * D + d[None, None, :],
                mask=ok[:, :, None],
                other=0.0,
            )
            m_new = tl.maximum(m_i, tl.max(m_s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            w = tl.exp2(m_s - m_new[None, :])
            acc = acc * alpha[:, None] + tl.sum(acc_s * w[:, :, None], axis=0)
            l_i = l_i * alpha + tl.sum(l_s * w, axis=0)
            m_i = m_new
        exact = base + num_splits
        m_e = tl.load(m_ptr + exact * BLOCK_M + local, mask=row_ok, other=_NEG_BIG)
        l_e = tl.load(l_ptr + exact * BLOCK_M + local, mask=row_ok, other=0.0)
        m_f = tl.maximum(m_i, m_e)
        alpha = tl.exp2(m_i - m_f)
        beta = tl.exp2(m_e - m_f)
        denom = l_i * alpha + l_e * beta
        denom = tl.where(denom > 0, denom, 1.0)  # padding rows only; every real row sees >= 1 position
        head = kv_head * group + rows // n_new
        token = rows % n_new
        if SINK_LOGITS:  # the sink's share scales every term the store adds up
            q_rows = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
            sink = sink_logits_of_rows(
                sink_ptr,
                head,
                row_ok,
                q_rows,
                k_offset_ptr,
                k_offset_stride_h,
                qk_scale,
                kv_head,
                D,
                SINK_KEY_OFFSET,
            )
            kept = kept_mass(denom, m_f, sink)
        else:
            kept = tl.full([BLOCK_M], 1.0, tl.float32)
        out_rows = out_ptr + batch * out_stride_b + head * out_stride_h + token * out_stride_t
        # the composite W R s (or W) maps coefficient sums to channels, D_CHUNK channels at a time
        for chunk in tl.static_range(D // D_CHUNK):
            cols = chunk * D_CHUNK + tl.arange(0, D_CHUNK)
            w = tl.load(
                transform_ptr + kv_head * transform_stride_h + d[:, None] * D + cols[None, :]
            )  # [D slots, D_CHUNK channels]
            values = tl.dot(acc, w, input_precision="tf32x3")
            _reduce_store(
                values,
                cols,
                acc_ptr,
                exact,
                v_channel_scale_ptr,
                v_scale_stride_h,
                v_offset_ptr,
                v_offset_stride_h,
                kv_head,
                alpha,
                beta,
                denom,
                kept,
                out_rows,
                row_ok,
                D,
                BLOCK_M,
                OFFSET,
            )

    @triton.jit
    def _reduce_rows_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        transform_ptr,
        transform_stride_h,
        v_channel_scale_ptr,
        v_scale_stride_h,
        v_offset_ptr,
        v_offset_stride_h,
        out_ptr,
        out_stride_b,
        out_stride_h,
        out_stride_t,
        sink_ptr,  # learned sink logits [Hq] (natural units), read with SINK_LOGITS
        q_ptr,  # the query, for q . m_k with SINK_KEY_OFFSET
        q_stride_b,
        q_stride_h,
        q_stride_t,
        k_offset_ptr,  # the keys' offset m_k [Hkv, D] rows, with SINK_KEY_OFFSET
        k_offset_stride_h,
        qk_scale,  # sm_scale * log2(e): the split kernels' score scale
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        num_splits,  # compressed splits: partials 0 .. num_splits - 1 of each program
        n_parts,  # partials per program: then the exact tokens' (one, or exact_chunks for v3)
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SPLIT_CHUNK: tl.constexpr,
        OFFSET: tl.constexpr,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
        SINK_LOGITS: tl.constexpr = False,  # scale each row by kept_mass (a sink logit per query head)
        SINK_KEY_OFFSET: tl.constexpr = False,  # the keys are stored centred: see _sink_logit_row
        MERGE_ONLY: tl.constexpr = False,  # leave the transform to _transform_heads_kernel
        # load the transform before merging (it depends on nothing the merge computes), so the
        # two loads' latencies overlap instead of adding up
        TRANSFORM_FIRST: tl.constexpr = False,
        # MERGE_ONLY: each program merges this many of the row's D sums (grid (rows, D / CHANNELS));
        # 0: all of them. The maxima and denominators are merged whole by each of the row's programs.
        CHANNELS: tl.constexpr = 0,
    ):
        """_reduce_kernel with one program per query row, for launches with few (sequence, kv head)
        pairs: SPLIT_CHUNK splits merged per step (one wide load, not a serial chain of small
        ones), then the inverse transform as a [D] x [D, D] product. MERGE_ONLY: no transform; the
        row's merged coefficient sums, divided by the softmax denominator, replace its split-0
        partial, and its exact part, weighted likewise, replaces the exact partial (only this
        program reads either; with CHANNELS, only its own channels of them)."""
        if PDL:  # the previous kernel's writes are visible after this, none before it
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        row_local = pid % BLOCK_M
        program = pid // BLOCK_M
        row_block = program % n_row_blocks
        kv_head = (program // n_row_blocks) % n_kv_heads
        batch = program // (n_row_blocks * n_kv_heads)
        row = row_block * BLOCK_M + row_local
        if row < group * n_new:
            first_channel = 0
            if CHANNELS > 0:
                tl.static_assert(MERGE_ONLY, "CHANNELS splits the merge only (MERGE_ONLY)")
                first_channel = tl.program_id(1) * CHANNELS
                d = first_channel + tl.arange(0, CHANNELS)
            else:
                d = tl.arange(0, D)
            c = tl.arange(0, D)
            base = program * n_parts
            if TRANSFORM_FIRST and not MERGE_ONLY:
                w_t = tl.load(
                    transform_ptr + kv_head * transform_stride_h + c[:, None] * D + d[None, :]
                )  # [coef, channel]
            # the compressed splits (coefficient domain) and the exact tokens' (channel domain)
            m_i, l_i, acc, m_e, l_e, acc_e = _merge_parts_row(
                m_ptr,
                l_ptr,
                acc_ptr,
                base,
                num_splits,
                n_parts,
                row_local,
                D,
                BLOCK_M,
                SPLIT_CHUNK,
                first_channel,
                CHANNELS,
            )
            exact = (base + num_splits) * BLOCK_M + row_local
            m_f = tl.maximum(m_i, m_e)
            alpha = tl.exp2(m_i - m_f)
            beta = tl.exp2(m_e - m_f)
            denom = l_i * alpha + l_e * beta
            head = kv_head * group + row // n_new
            token = row % n_new
            kept = 1.0
            if SINK_LOGITS:
                q_row = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
                sink = _sink_logit_row(
                    sink_ptr,
                    q_row,
                    k_offset_ptr,
                    k_offset_stride_h,
                    qk_scale,
                    kv_head,
                    head,
                    D,
                    SINK_KEY_OFFSET,
                )
                kept = kept_mass(denom, m_f, sink)
            if MERGE_ONLY:
                tl.store(acc_ptr + (base * BLOCK_M + row_local) * D + d, acc * (alpha / denom * kept))
                exact_part = acc_e * (beta / denom * kept)
                if SINK_LOGITS and OFFSET:
                    # the offset's weight is `kept`, not 1, which _transform_heads_kernel (launched
                    # without OFFSET here) does not know: it goes in with the exact part
                    offset = tl.load(v_offset_ptr + kv_head * v_offset_stride_h + d).to(tl.float32)
                    exact_part += kept * offset
                tl.store(acc_ptr + exact * D + d, exact_part)
            else:  # (not after a return: Triton would still compile this, with d a slice of D)
                if not TRANSFORM_FIRST:
                    w_t = tl.load(
                        transform_ptr + kv_head * transform_stride_h + c[:, None] * D + d[None, :]
                    )  # [coef, channel]
                values = tl.sum(acc[:, None] * w_t, axis=0)
                values = values * tl.load(v_channel_scale_ptr + kv_head * v_scale_stride_h + d).to(tl.float32)
                o = (values * alpha + acc_e * beta) / denom
                if OFFSET:
                    o = o + tl.load(v_offset_ptr + kv_head * v_offset_stride_h + d).to(tl.float32)
                o = o * kept
                out_row = out_ptr + batch * out_stride_b + head * out_stride_h + token * out_stride_t
                tl.store(out_row + d, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _transform_heads_kernel(
        acc_ptr,
        transform_ptr,
        transform_stride_h,
        v_channel_scale_ptr,
        v_scale_stride_h,
        v_offset_ptr,
        v_offset_stride_h,
        out_ptr,
        out_stride_b,
        out_stride_h,
        out_stride_t,
        n_kv_heads,
        group,
        n_new,
        n_seqs,
        num_splits,  # compressed splits (the merged exact part sits at partial num_splits)
        n_parts,  # partials per (sequence, kv head)
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,  # query rows of one (sequence, kv head): one row block (decode)
        TILE: tl.constexpr,  # rows per program, all of one kv head (sequences side by side)
        D_CHUNK: tl.constexpr,  # output channels per program
        OFFSET: tl.constexpr,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
    ):
        """The inverse transform after _reduce_rows_kernel(MERGE_ONLY): TILE rows of one kv head,
        from all sequences, times the head's [D, D_CHUNK] slice of W R s in one dot, so a program
        reads the transform once for TILE rows (the per-row reduce read it for each row: 162
        registers, 3 programs per SM and 15 us at (32, 32768) on the H200, latency-bound). Adds
        the weighted exact part and the value offset, writes out. grid: (n_kv_heads * row tiles,
        D // D_CHUNK)."""
        if PDL:  # the merge's writes are visible after this, none before it
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        kv_head = pid % n_kv_heads
        r = (pid // n_kv_heads) * TILE + tl.arange(0, TILE)
        seq = r // BLOCK_M
        local = r % BLOCK_M
        row_ok = (seq < n_seqs) & (local < group * n_new)
        base = (seq * n_kv_heads + kv_head) * n_parts
        d = tl.arange(0, D)
        cols = tl.program_id(1) * D_CHUNK + tl.arange(0, D_CHUNK)
        merged = tl.load(
            acc_ptr + (base * BLOCK_M + local)[:, None] * D + d[None, :], mask=row_ok[:, None], other=0.0
        )
        w_t = tl.load(
            transform_ptr + kv_head * transform_stride_h + d[:, None] * D + cols[None, :]
        )  # [D slots, D_CHUNK channels]
        values = tl.dot(merged, w_t, input_precision="tf32x3")
        values = (
            values * tl.load(v_channel_scale_ptr + kv_head * v_scale_stride_h + cols).to(tl.float32)[None, :]
        )
        exact = ((base + num_splits) * BLOCK_M + local) * D
        o = values + tl.load(acc_ptr + exact[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
        if OFFSET:
            o = o + tl.load(v_offset_ptr + kv_head * v_offset_stride_h + cols).to(tl.float32)[None, :]
        head = kv_head * group + local // n_new
        token = local % n_new
        out_rows = out_ptr + seq * out_stride_b + head * out_stride_h + token * out_stride_t
        tl.store(out_rows[:, None] + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _merge_channel_rows_kernel(
        m_ptr,
        l_ptr,
        acc_ptr,
        v_offset_ptr,
        v_offset_stride_h,
        out_ptr,
        out_stride_b,
        out_stride_h,
        out_stride_t,
        sink_ptr,  # learned sink logits [Hq] (natural units), read with SINK_LOGITS
        q_ptr,  # the query, for q . m_k with SINK_KEY_OFFSET
        q_stride_b,
        q_stride_h,
        q_stride_t,
        k_offset_ptr,  # the keys' offset m_k [Hkv, D] rows, with SINK_KEY_OFFSET
        k_offset_stride_h,
        qk_scale,  # sm_scale * log2(e): the split kernels' score scale
        n_kv_heads,
        group,
        n_new,
        n_row_blocks,
        n_parts,  # partials per program, all in the channel domain (centred: x - m)
        D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SPLIT_CHUNK: tl.constexpr,  # partials merged per wide load
        CHANNELS: tl.constexpr,  # a row's channels per program: grid (query rows, D / CHANNELS)
        OFFSET: tl.constexpr,
        PDL: tl.constexpr = False,  # launched with programmatic dependent launch (see _pdl)
        SINK_LOGITS: tl.constexpr = False,  # scale each row by kept_mass (a sink logit per query head)
        SINK_KEY_OFFSET: tl.constexpr = False,  # the keys are stored centred: see _sink_logit_row
    ):
        """The reduce after a split kernel that wrote channel-domain partials
        (LaunchConfig.transform_in_split): each program merges CHANNELS of one query row's sums
        over all n_parts partials (compressed splits and exact chunks alike) under one softmax,
        SPLIT_CHUNK partials a load, adds the value offset and writes the output."""
        if PDL:  # the previous kernel's writes are visible after this, none before it
            tl.extra.cuda.gdc_wait()
        pid = tl.program_id(0)
        row_local = pid % BLOCK_M
        program = pid // BLOCK_M
        row_block = program % n_row_blocks
        kv_head = (program // n_row_blocks) % n_kv_heads
        batch = program // (n_row_blocks * n_kv_heads)
        row = row_block * BLOCK_M + row_local
        if row < group * n_new:
            d = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
            base = program * n_parts
            m_i = tl.max(tl.full([SPLIT_CHUNK], _NEG_BIG, tl.float32), axis=0)
            l_i = tl.sum(tl.zeros([SPLIT_CHUNK], tl.float32), axis=0)
            acc = tl.zeros([CHANNELS], tl.float32)
            for first in range(0, n_parts, SPLIT_CHUNK):
                split = first + tl.arange(0, SPLIT_CHUNK)
                ok = split < n_parts
                part = (base + split) * BLOCK_M + row_local
                m_s = tl.load(m_ptr + part, mask=ok, other=_NEG_BIG)
                l_s = tl.load(l_ptr + part, mask=ok, other=0.0)
                acc_s = tl.load(acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                m_new = tl.maximum(m_i, tl.max(m_s, axis=0))
                w = tl.where(ok, tl.exp2(m_s - m_new), 0.0)
                alpha = tl.exp2(m_i - m_new)
                acc = acc * alpha + tl.sum(acc_s * w[:, None], axis=0)
                l_i = l_i * alpha + tl.sum(l_s * w, axis=0)
                m_i = m_new
            o = acc / tl.where(l_i > 0, l_i, 1.0)  # every real row sees >= 1 position: l_i > 0
            if OFFSET:
                o = o + tl.load(v_offset_ptr + kv_head * v_offset_stride_h + d).to(tl.float32)
            head = kv_head * group + row // n_new
            token = row % n_new
            if SINK_LOGITS:
                q_row = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
                sink = _sink_logit_row(
                    sink_ptr,
                    q_row,
                    k_offset_ptr,
                    k_offset_stride_h,
                    qk_scale,
                    kv_head,
                    head,
                    D,
                    SINK_KEY_OFFSET,
                )
                o = o * kept_mass(l_i, m_i, sink)
            out_row = out_ptr + batch * out_stride_b + head * out_stride_h + token * out_stride_t
            tl.store(out_row + d, o.to(out_ptr.dtype.element_ty))
