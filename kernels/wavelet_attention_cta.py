"""v3's split kernel with four splits of one (sequence, kv head) in a CTA (LaunchConfig.cta_splits).

Why: at one sequence the tuned launch runs 1,024 one-warp split programs, 7-8 to an SM, and each
of them reads its kv head's 32 KB of query-transform words before its loop and 32 KB of T words
after it. Those reads cost their SM's L1 data path about 1.3 us per transform (thirty-fourth and
thirty-fifth sessions, benchmarks/RESULTS.md: not their latency, not L2). Here a CTA's four warps
are four consecutive splits; each warp runs the tuned kernel's step on its own split (its own
running max, accumulators and ring), and the two transforms are computed once per CTA, a quarter
by each warp:

- the query's slots: warp v computes slot tiles v and v + 4 of M_h s_k q (8 KB of words), the CTA
  shares them through shared memory, and every warp takes the 8 key operands from there. Each
  warp's step 0 reads (key words, scale words, value tiles) go out between the transform's loads
  and its MMAs, so they arrive while it runs;
- the epilogue: each warp's coefficient means (its sums over its l, in fp16), running max and
  denominator go to shared memory; after one meeting every warp weights the four means into the
  CTA's (exp2(m_w - m) l_w / l) and warp v maps channel tiles v and v + 4 of them through T (8 KB
  of words). One partial a CTA: the merge kernel after it reads a quarter as many.

Every tensor of the step has the warp as its leading dimension (rank 3, warps_per_cta [4, 1, 1]),
so a warp's reductions stay inside it; the transforms use rank-2 layouts with the warps along M.
The warps meet only at named barriers of their own (`_all_warps`): Triton's barrier-0 barriers,
which here guard each warp's own shared memory, become warp barriers through a PTX patch
(kernels/ptx_patches.py), so no warp waits for another inside the loop. The step is the one-warp
kernel's arithmetic in the same order; only the means' rounding to fp16 moves (once a CTA instead
of once a split), so the outputs are within fp16 rounding of split_kernel_v3's (a GPU test checks
it). Supported: the small-launch config's path only (kernels/attention_config.py
SMALL_LAUNCH_CONFIGS: BAND_COLUMNS with a GQA group of 4 rows and one new token, query and T in the
split, keys a step ahead with the L2::256B hint, value tiles by 8-byte copies through L1 in a
one-stage ring, equal splits); elsewhere the launcher runs one split a program
(wavelet_attention.cta_splits_reason says why).
"""

from __future__ import annotations

from .wavelet_attention import PHASE_SLOTS
from .wavelet_attention_gluon import HAS_GLUON

WARPS = 4  # splits (warps) per CTA

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from . import ptx_patches
    from .wavelet_attention_gluon import (
        _C2_0,
        _C2_1,
        _C2_2,
        _C2_3,
        _C2_4,
        _C2_5,
        _C2_6,
        _C2_7,
        _C4_0,
        _C4_1,
        _C4_2,
        _C4_3,
        _INV_SUBNORMAL_UNIT,
        _NEG_BIG,
        MAGIC,
        _async_load,
        _band_operands,
        _cta_barrier,
        _wait_for_prologue,
    )

    _W = gl.constexpr(WARPS)
    _SLOTS = gl.constexpr(PHASE_SLOTS)
    # the step: [warps, rows, columns], one split per warp, m16n8 tiles as in the one-warp kernel
    _MMA3 = gl.constexpr(
        gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1, 1], instr_shape=[1, 16, 8])
    )
    _A3 = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA3.value, k_width=2))
    _B3 = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA3.value, k_width=2))
    # [warps, tokens, 16 int16] value tiles by 8-byte copies (4 elements a lane), as _TOKEN_ROWS_8B
    _COPY3 = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 8, 4], [WARPS, 1, 1], [2, 1, 0]))
    _TILE3 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0]))
    # the transforms: [rows, columns] with the warps along M (tile m to warp m % 4)
    _MMA_T = gl.constexpr(
        gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8])
    )
    _A_T = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA_T.value, k_width=2))
    _B_T = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA_T.value, k_width=2))
    # [row tiles, 32 lanes, 4 words] fragment-ordered words, row tile t held by warp t % 4
    _T_WORDS_W = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0]))
    # [warps, tokens] per-token scale words: two tokens a lane (t and t + 32), as _SCALE_PAIRS
    _SCALE3 = gl.constexpr(gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0]))
    _PLAIN2 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
    _PLAIN1 = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
    _SLOT_VECTOR = gl.constexpr(gl.BlockedLayout([1], [32], [WARPS], [0]))  # [128]: a slot a thread
    _MARK_WARP_BARRIERS = gl.constexpr(ptx_patches.marker_asm("warp_barriers"))

    @gluon.jit
    def _all_warps():
        """A barrier of the CTA's 4 warps (named barrier 1: Triton's own are barrier 0, which this
        kernel's PTX patch turns into warp barriers)."""
        gl.inline_asm_elementwise("bar.sync 1, 128; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _warps(parent: gl.constexpr):
        """The warp index [W] of a rank-3 layout, for [W, tokens] tensors (w[:, None])."""
        return gl.arange(0, _W, layout=gl.SliceLayout(1, gl.SliceLayout(2, parent)))

    @gluon.jit
    def _stamp3(clock_ptr, first_row, slot, after, rows_left):
        """PHASE_CLOCKS: each warp's globaltimer (ns) into its split's row of clock_ptr (PHASE_SLOTS
        int64 a row, from first_row: the CTA's first split), read once `after` ([W], any layout:
        the stamp is taken in it) is computed; warps past the last split (rows_left) write none."""
        warp = gl.arange(0, _W, layout=after.type.layout)
        dep = after.to(gl.int32)
        now = gl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=gl.int64, is_pure=False, pack=1
        )
        gl.store(clock_ptr + (first_row + warp) * _SLOTS + slot, now, mask=warp < rows_left)

    @gluon.jit
    def _fragment_tiles_w(words_ptr):
        """8 stacked [16, 16] fp16 A fragments of fragment-ordered words ([8 tiles, 32 lanes, 4
        words], see fragment_words) for the rank-2 transforms: tile t in warp t % 4."""
        tile = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, _T_WORDS_W)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _T_WORDS_W)))
        word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _T_WORDS_W)))
        offsets = (tile[:, None, None] * 32 + lane[None, :, None]) * 4 + word[None, None, :]
        words = gl.load(words_ptr + offsets)
        halves = gl.join(words.to(gl.int16), (words >> 16).to(gl.int16))  # [8, 32, 4, 2]
        parts = gl.reshape(halves, [8, 8, 4, 2, 2, 2])
        rows_cols = gl.reshape(gl.permute(parts, [0, 4, 1, 3, 2, 5]), [128, 16])
        return gl.convert_layout(rows_cols, _A_T, assert_trivial=True).to(gl.float16, bitcast=True)

    @gluon.jit
    def _query_operands(q_ptr, q_stride_h, qt_words, kv_head):
        """The loads of _query_slots' 8 products (channel block c = 0..7): this warp's M_h s_k
        word tiles (fragment-ordered, tiles v and v + 4) and the GQA group's query channels as B
        operands ([16 channels, 8 columns], columns 4-7 repeating the 4 rows)."""
        channel = gl.arange(0, 16, layout=gl.SliceLayout(1, _B_T))
        local = gl.arange(0, 8, layout=gl.SliceLayout(0, _B_T)) % 4
        q_rows = (q_ptr + (kv_head * 4 + local) * q_stride_h)[None, :] + channel[:, None]
        tiles = (
            _fragment_tiles_w(qt_words + 0 * 1024),
            _fragment_tiles_w(qt_words + 1 * 1024),
            _fragment_tiles_w(qt_words + 2 * 1024),
            _fragment_tiles_w(qt_words + 3 * 1024),
            _fragment_tiles_w(qt_words + 4 * 1024),
            _fragment_tiles_w(qt_words + 5 * 1024),
            _fragment_tiles_w(qt_words + 6 * 1024),
            _fragment_tiles_w(qt_words + 7 * 1024),
        )
        xs = (
            gl.load(q_rows + 0 * 16),
            gl.load(q_rows + 1 * 16),
            gl.load(q_rows + 2 * 16),
            gl.load(q_rows + 3 * 16),
            gl.load(q_rows + 4 * 16),
            gl.load(q_rows + 5 * 16),
            gl.load(q_rows + 6 * 16),
            gl.load(q_rows + 7 * 16),
        )
        return tiles, xs

    @gluon.jit
    def _query_slots(tiles, xs, k_factor_ptr, k_shift_ptr, qk_scale, q_smem, s_smem):
        """The query's 128 slots for the CTA, [128 slots, 8 columns] (columns 4-7 repeat the GQA
        group's 4 rows), from _query_operands' loads, computed as _query_in_split's 8 operands are
        (channel block c = 0..7 into each slot tile in order) but a quarter of the slot tiles per
        warp: to q_smem [128, 8] in fp16, and their score-offset terms q_slot * k_shift to s_smem
        [128, 8] in fp32."""
        acc = gl.zeros([128, 8], gl.float32, layout=_MMA_T)
        for c in gl.static_range(8):
            acc = mma_v2(tiles[c], xs[c].to(gl.float32).to(gl.float16), acc)
        slots = gl.arange(0, 128, layout=gl.SliceLayout(1, _MMA_T))
        qw16 = (acc * (gl.load(k_factor_ptr + slots) * qk_scale)[:, None]).to(gl.float16)
        q_smem.store(qw16)
        s_smem.store(qw16.to(gl.float32) * gl.load(k_shift_ptr + slots)[:, None])

    @gluon.jit
    def _score_offsets(s_smem):
        """Each band's score offset per column from the shared terms, summed as _query_in_split sums
        them ((s0 + s1) + (s2 + s3) over operands, then over a warp's 16 rows): [8] for _scores3."""
        layout: gl.constexpr = gl.SliceLayout(0, _MMA3)
        s0 = s_smem.slice(0, 16, 0).load(layout)
        s1 = s_smem.slice(16, 16, 0).load(layout)
        s2 = s_smem.slice(32, 16, 0).load(layout)
        s3 = s_smem.slice(48, 16, 0).load(layout)
        s4 = s_smem.slice(64, 16, 0).load(layout)
        s5 = s_smem.slice(80, 16, 0).load(layout)
        s6 = s_smem.slice(96, 16, 0).load(layout)
        s7 = s_smem.slice(112, 16, 0).load(layout)
        return gl.sum((s0 + s1) + (s2 + s3), axis=0), gl.sum((s4 + s5) + (s6 + s7), axis=0)

    @gluon.jit
    def _key_operand(q_smem, J: gl.constexpr):
        """Key operand J's query slots (16J ..) for every warp's MMAs: [W, 16, 8] fp16 in _B3."""
        one = gl.expand_dims(q_smem.slice(16 * J, 16, 0).load(gl.SliceLayout(0, _B3)), 0)
        every, _ = gl.broadcast(one, gl.zeros([_W, 16, 8], gl.float16, layout=_B3))
        return every

    @gluon.jit
    def _row_offsets3(first, tok, ROW: gl.constexpr):
        """(first + tok) * ROW as int64 [W, tokens] from a per-warp first row [W, 1] and a step's
        token arange [1, tokens], written so that LLVM folds (tok & -8) * ROW into a constant per
        register and keeps the rest in one register a lane (see _row_offsets)."""
        return (first.to(gl.int64) + (tok & 7).to(gl.int64)) * ROW + (tok & -8).to(gl.int64) * ROW

    @gluon.jit
    def _issue_values(v4s, v2s, rows, E4: gl.constexpr, E2: gl.constexpr):
        """cp.async.ca (8 bytes) the value code tiles of one step: rows [W, tokens] int16 pointers
        in SliceLayout(2, _COPY3), both bands' [W, tokens, 16] elements (the 2-bit band's 8
        twice), one commit group."""
        ve = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _COPY3)))
        _async_load(v4s, rows[:, :, None] + E4 + ve[None, None, :], cache_modifier=".ca")
        _async_load(v2s, rows[:, :, None] + E2 + (ve % 8)[None, None, :], cache_modifier=".ca")
        async_copy.commit_group()

    @gluon.jit
    def _load_key_words3(rows, E4: gl.constexpr, E2: gl.constexpr, L2_256B: gl.constexpr):
        """_load_key_words for [W, tokens] int16 row pointers in SliceLayout(2, _A3): int32 words
        [W, tokens, 8] per band (the element pairs a lane's A fragment registers hold)."""
        BLOCK_N: gl.constexpr = rows.shape[1]
        kj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A3)))
        word = gl.pointer_type(gl.int32)
        w2, _ = gl.split(gl.reshape(rows[:, :, None] + E2 + (kj % 8)[None, None, :], [_W, BLOCK_N, 8, 2]))
        w4, _ = gl.split(gl.reshape(rows[:, :, None] + E4 + kj[None, None, :], [_W, BLOCK_N, 8, 2]))
        w2 = w2.to(word, bitcast=True)
        w4 = w4.to(word, bitcast=True)
        if L2_256B:
            asm: gl.constexpr = "ld.global.L2::256B.b32 $0, [$1];"
            k4 = gl.inline_asm_elementwise(asm, "=r,l", [w4], dtype=gl.int32, is_pure=True, pack=1)
            k2 = gl.inline_asm_elementwise(asm, "=r,l", [w2], dtype=gl.int32, is_pure=True, pack=1)
        else:
            k4 = gl.load(w4)
            k2 = gl.load(w2)
        return k4, k2

    @gluon.jit
    def _key_elements3(words):
        """int32 words [W, tokens, 8] -> the int16 elements [W, tokens, 16] in the A fragments."""
        BLOCK_N: gl.constexpr = words.shape[1]
        pairs = gl.join(words.to(gl.int16), (words >> 16).to(gl.int16))
        return gl.convert_layout(gl.reshape(pairs, [_W, BLOCK_N, 16]), _A3, assert_trivial=True)

    @gluon.jit
    def _scores3(raw4, raw2, scale_words, q, qc0, qc1):
        """Scores^T [W, tokens, 8] (log2 domain), as _scores with OFFSET_IN_MMA: the band's offset
        enters its first MMA, then times each token's band scale (scale_words [W, tokens] int32 in
        SliceLayout(2, _MMA3): band 0 in the low half)."""
        BLOCK_N: gl.constexpr = raw4.shape[1]
        q0, q1, q2, q3, q4, q5, q6, q7 = q
        kj = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, _A3)))
        upper = (kj >= 8)[None, None, :]
        zero = gl.zeros([_W, BLOCK_N, 8], gl.float32, layout=_MMA3)
        o0, o1, o2, o3, o4, o5, o6, o7 = _band_operands(raw4, raw2, upper)
        sa = mma_v2(o0, q0, zero + gl.expand_dims(gl.expand_dims(qc0, 0), 0))
        sa = mma_v2(o1, q1, sa)
        sa = mma_v2(o2, q2, sa)
        sa = mma_v2(o3, q3, sa)
        sb = mma_v2(o4, q4, zero + gl.expand_dims(gl.expand_dims(qc1, 0), 0))
        sb = mma_v2(o5, q5, sb)
        sb = mma_v2(o6, q6, sb)
        sb = mma_v2(o7, q7, sb)
        k0 = (scale_words & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        k1 = (scale_words >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
        return sa * k0[:, :, None] + sb * k1[:, :, None]

    @gluon.jit
    def _p_to_b3(p16):
        """p [W, tokens, 8] fp16 from the accumulator layout to _B3 by one movmatrix.trans per 8 x 8
        block (as _p_to_b_by_movmatrix, per warp)."""
        BLOCK_N: gl.constexpr = p16.shape[1]
        moved = gl.inline_asm_elementwise(
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
            "=r,r",
            [p16],
            dtype=gl.float16,
            is_pure=True,
            pack=2,
        )
        blocks = gl.permute(gl.reshape(moved, [_W, BLOCK_N // 8, 8, 8]), [0, 1, 3, 2])
        return gl.convert_layout(gl.reshape(blocks, [_W, BLOCK_N, 8]), _B3, assert_trivial=True)

    @gluon.jit
    def _scale_p3(p16, words, select):
        """_scale_p_by_column_band per warp: p [W, tokens, 8] in _B3 times each token's scale of its
        column's band (words [W, tokens] in SliceLayout(2, _B3), select [8] PRMT selectors)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 w; prmt.b32 w, $2, $3, $4; mul.rn.f16x2 $0, $1, w; }",
            "=r,r,r,r,r,r",
            [p16, words[:, :, None], select[None, None, :]],
            dtype=gl.float16,
            is_pure=True,
            pack=2,
        )

    @gluon.jit
    def _step_values(s, state, value_words, select, v4s, v2s, ones, SUBNORMALS: gl.constexpr):
        """_accumulate_values of the one-sequence path (rescale every step, p by movmatrix, one B
        operand for both bands) per warp. state: (m [W, 8], a0 .. a7, l, ws [W, 16, 8])."""
        m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa = state
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)[:, None, :]
        a0 = a0 * alpha
        a1 = a1 * alpha
        a2 = a2 * alpha
        a3 = a3 * alpha
        a4 = a4 * alpha
        a5 = a5 * alpha
        a6 = a6 * alpha
        a7 = a7 * alpha
        l_acc = l_acc * alpha
        wsa = wsa * alpha
        m_i = m_new
        p = gl.exp2(s - m_i[:, None, :])
        p16 = _p_to_b3(p.to(gl.float16))
        pa = _scale_p3(p16, value_words, select)
        l_acc = mma_v2(ones, p16, l_acc)
        slot = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A3)))
        upper = (slot >= 8)[None, :, None]
        r4 = v4s.permute([0, 2, 1]).load(_A3)  # [W, 16 elements, tokens]
        r2 = v2s.permute([0, 2, 1]).load(_A3)
        o0, o1, o2, o3, o4, o5, o6, o7 = _band_operands(r4, r2, upper, SUBNORMALS)
        if SUBNORMALS:
            wsa = mma_v2(ones, pa, wsa)
            a0 = mma_v2(o0, pa, a0)
            a1 = mma_v2(o1, pa, a1)
            a2 = mma_v2(o2, pa, a2)
            a3 = mma_v2(o3, pa, a3)
            a4 = mma_v2(o4, pa, a4)
            a5 = mma_v2(o5, pa, a5)
            a6 = mma_v2(o6, pa, a6)
            a7 = mma_v2(o7, pa, a7)
        else:
            zero = gl.zeros_like(a0)
            step_a = mma_v2(ones, pa, zero)
            wsa = wsa + step_a
            upper_rows = (gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA3))) >= 8)[
                None, :, None
            ]
            a0 = mma_v2(o0, pa, a0 - _C4_0 * step_a)
            a1 = mma_v2(o1, pa, a1 - _C4_1 * step_a)
            a2 = mma_v2(o2, pa, a2 - _C4_2 * step_a)
            a3 = mma_v2(o3, pa, a3 - _C4_3 * step_a)
            a4 = mma_v2(o4, pa, a4 - gl.where(upper_rows, _C2_1, _C2_0) * step_a)
            a5 = mma_v2(o5, pa, a5 - gl.where(upper_rows, _C2_3, _C2_2) * step_a)
            a6 = mma_v2(o6, pa, a6 - gl.where(upper_rows, _C2_5, _C2_4) * step_a)
            a7 = mma_v2(o7, pa, a7 - gl.where(upper_rows, _C2_7, _C2_6) * step_a)
        return (m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa)

    @gluon.jit
    def _means_to_smem(
        means_smem,
        acc,
        sums,
        weight,
        keep,
        step_smem,
        shift_smem,
        SLOT0: gl.constexpr,
        SUBNORMALS: gl.constexpr,
        C_LO: gl.constexpr,
        C_HI: gl.constexpr,
    ):
        """One operand's coefficient means per warp ([W, 16 slots, 8]: _operand_values times
        `weight`, 1 / l per column), the columns of the other band zeroed, into means_smem [128
        slots, W, 8] fp16 at rows SLOT0 ... (the slots' step and shift from step_smem and
        shift_smem, [128] fp32)"""
        slot_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, _MMA3))
        step = step_smem.slice(SLOT0, 16).load(slot_layout)[None, :, None]
        shift = shift_smem.slice(SLOT0, 16).load(slot_layout)[None, :, None]
        if SUBNORMALS:
            rows = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA3)))
            mid = gl.where((rows >= 8)[None, :, None], C_HI - MAGIC, C_LO - MAGIC)
            values = (acc * _INV_SUBNORMAL_UNIT + (shift - mid) * sums) * step
        else:
            values = (acc + shift * sums) * step
        means = gl.where(keep[:, None, :], values * weight[:, None, :], 0.0)
        means_smem.slice(SLOT0, 16, 0).permute([1, 0, 2]).store(means.to(gl.float16))

    @gluon.jit
    def _merge_stats(m_smem, l_smem, layout: gl.constexpr):
        """The CTA's running max m and denominator l per column ([8] in `layout`) from its warps'
        ([W, 8] in shared memory)."""
        m_flat = m_smem.reshape([_W * 8])
        l_flat = l_smem.reshape([_W * 8])
        m = m_flat.slice(0, 8, 0).load(layout)
        for w in gl.static_range(1, _W):
            m = gl.maximum(m, m_flat.slice(8 * w, 8, 0).load(layout))
        total = gl.zeros_like(m)
        for w in gl.static_range(_W):
            total += gl.exp2(m_flat.slice(8 * w, 8, 0).load(layout) - m) * l_flat.slice(8 * w, 8, 0).load(
                layout
            )
        return m, total

    @gluon.jit
    def _merge_weights(m_smem, l_smem, layout: gl.constexpr):
        """Each warp's weight in the CTA's means, exp2(m_w - m) l_w / l per column: a tuple of W
        [8] in `layout` (zeros where the CTA saw no token)."""
        m, total = _merge_stats(m_smem, l_smem, layout)
        inv = gl.where(total > 0, 1.0 / total, 0.0)
        m_flat = m_smem.reshape([_W * 8])
        l_flat = l_smem.reshape([_W * 8])
        u0 = gl.exp2(m_flat.slice(0, 8, 0).load(layout) - m) * l_flat.slice(0, 8, 0).load(layout) * inv
        u1 = gl.exp2(m_flat.slice(8, 8, 0).load(layout) - m) * l_flat.slice(8, 8, 0).load(layout) * inv
        u2 = gl.exp2(m_flat.slice(16, 8, 0).load(layout) - m) * l_flat.slice(16, 8, 0).load(layout) * inv
        u3 = gl.exp2(m_flat.slice(24, 8, 0).load(layout) - m) * l_flat.slice(24, 8, 0).load(layout) * inv
        return u0, u1, u2, u3

    @gluon.jit
    def _transform_means(out, means_smem, tile, weights, J: gl.constexpr):
        """out [128 channels, 8] += T[:, slots 16J ..] (tile: its A fragments, channel tiles v and
        v + 4 in warp v) x the CTA's means of those slots: the warps' means weighted in fp32, then
        fp16 as the one-warp kernel's B operand."""
        gl.static_assert(_W == 4, "four weights")
        u0, u1, u2, u3 = weights
        rows = means_smem.reshape([128, _W * 8]).slice(16 * J, 16, 0)
        b = rows.slice(0, 8, 1).load(_B_T).to(gl.float32) * u0[None, :]
        b += rows.slice(8, 8, 1).load(_B_T).to(gl.float32) * u1[None, :]
        b += rows.slice(16, 8, 1).load(_B_T).to(gl.float32) * u2[None, :]
        b += rows.slice(24, 8, 1).load(_B_T).to(gl.float32) * u3[None, :]
        return mma_v2(tile, b.to(gl.float16), out)

    @gluon.jit
    def split_kernel_cta(
        kc_ptr,  # uint8 codes [B, Hkv, capacity, CODE_ROW bytes]
        kc_stride_b,
        kc_stride_h,
        ks_ptr,  # fp16 scales [B, Hkv, capacity, 2]
        ks_stride_b,
        ks_stride_h,
        vc_ptr,
        vc_stride_b,
        vc_stride_h,
        vs_ptr,
        vs_stride_b,
        vs_stride_h,
        seq_lens_ptr,
        v_step_ptr,  # fp32 [128] per value slot
        v_shift_ptr,
        vt_ptr,  # T words per kv head (value_slot_transform_words)
        vt_stride_h,
        v_scale_ptr,  # fp32 [Hkv, 128] value channel scale
        v_scale_stride_h,
        q_ptr,  # the query [B, Hq, 1, 128]
        q_stride_b,
        q_stride_h,
        qt_ptr,  # M_h s_k words per kv head (query_slot_transform_words)
        qt_stride_h,
        k_factor_ptr,
        k_shift_ptr,
        qk_scale,
        m_ptr,  # fp32 [programs, n_parts, 4]
        l_ptr,
        acc_ptr,  # fp32 [programs, n_parts, 4, D]: channel sums
        n_kv_heads,
        num_splits,
        n_parts,
        clock_ptr,  # PHASE_CLOCKS: int64 [programs * num_splits, PHASE_SLOTS]
        CODE_ROW: gl.constexpr,  # int16 elements per code row
        E4: gl.constexpr,
        E2: gl.constexpr,
        D: gl.constexpr,
        BLOCK_N: gl.constexpr,
        SINKS: gl.constexpr,
        WINDOW: gl.constexpr,
        PDL: gl.constexpr = False,
        TRIGGER_DEPENDENTS: gl.constexpr = False,
        VALUE_SUBNORMALS: gl.constexpr = False,
        # a probe: each warp stamps its split's phases into clock_ptr (LaunchConfig.phase_clocks;
        # the slots of wavelet_attention.PHASE_SLOTS)
        PHASE_CLOCKS: gl.constexpr = False,
    ):
        """Grid (sequences x kv heads, CTAs of W splits); split cta * W + v in warp v, equal splits
        of num_splits over the (sequence, kv head)'s compressed span; one partial a CTA, at index
        cta of the program's n_parts (in the channel domain, as split_kernel_v3's). One new token,
        a GQA group of 4 rows (columns 4-7 repeat them: BAND_COLUMNS)."""
        gl.static_assert(D == 128, "the CTA kernel is written for head_dim 128")
        gl.static_assert(BLOCK_N == 64, "the CTA kernel is written for 64-token steps")
        if PDL:
            _wait_for_prologue()
        if TRIGGER_DEPENDENTS:
            gl.inline_asm_elementwise(
                "griddepcontrol.launch_dependents; // dummy $0",
                "=r",
                [],
                dtype=gl.int32,
                is_pure=False,
                pack=1,
            )
        # Triton's barrier-0 barriers become warp barriers (kernels/ptx_patches.py: the launcher
        # installs the hook); the warps meet only at _all_warps
        gl.inline_asm_elementwise(_MARK_WARP_BARRIERS, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        pid = gl.program_id(0)  # (sequence, kv head)
        cta = gl.program_id(1)
        first_row = pid * num_splits + cta * _W  # the CTA's first split's stamp row
        rows_left = num_splits - cta * _W
        if PHASE_CLOCKS:
            w_stamp = _warps(_MMA3)
            _stamp3(clock_ptr, first_row, 0, w_stamp + cta, rows_left)
            smid = gl.inline_asm_elementwise(
                "mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )
            sm_row = clock_ptr + (first_row + w_stamp) * _SLOTS
            gl.store(sm_row + 8, (smid + w_stamp * 0).to(gl.int64), mask=w_stamp < rows_left)
        kv_head = pid % n_kv_heads
        batch = pid // n_kv_heads
        q_smem = gl.allocate_shared_memory(gl.float16, [128, 8], _PLAIN2)
        s_smem = gl.allocate_shared_memory(gl.float32, [128, 8], _PLAIN2)
        # the value slots' step and shift, staged in shared memory for the epilogue: loaded there
        # from global memory they were 3-4 serial L2 round trips after the loop (thirty-sixth session)
        every_slot = gl.arange(0, 128, layout=_SLOT_VECTOR)
        step_all = gl.load(v_step_ptr + every_slot)
        shift_all = gl.load(v_shift_ptr + every_slot)
        # ---- the query transform's loads, then each warp's split range and step 0's reads, then
        # the transform: step 0's key words and value tiles arrive while it runs (thirty-sixth
        # session: -3.2% / -5.2% at one sequence; keys or values alone -1.2% / -1.9%)
        seq_len = gl.load(seq_lens_ptr + batch).to(gl.int32)
        query_operands = _query_operands(
            q_ptr + batch * q_stride_b, q_stride_h, qt_ptr + kv_head * qt_stride_h, kv_head
        )
        # a fence for ptxas, which otherwise sinks those loads below the ranges' arithmetic (and
        # so behind the wait for seq_len)
        gl.inline_asm_elementwise("bar.warp.sync -1; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        # equal splits in whole steps, the last what is left
        comp_hi = gl.minimum(gl.maximum(seq_len - WINDOW, SINKS), seq_len)
        span = gl.maximum(comp_hi - SINKS, 0)
        chunk = gl.cdiv(gl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        cta_lo = SINKS + cta * _W * chunk
        # per-warp ranges in the layouts that use them: lo, hi as [W] (expanded where needed)
        w_copy = _warps(_COPY3)
        w_a = _warps(_A3)
        w_mma = _warps(_MMA3)
        lo_m = cta_lo + w_mma * chunk
        hi_m = gl.minimum(lo_m + chunk, comp_hi)
        # steps every warp has whole (the last warp has the fewest), and the most any warp has (the
        # first): scalars, with no exchange between the warps
        n_full = gl.maximum(gl.minimum(cta_lo + _W * chunk, comp_hi) - (cta_lo + (_W - 1) * chunk), 0)
        n_full = gl.minimum(n_full, chunk) // BLOCK_N
        n_all = gl.cdiv(gl.maximum(gl.minimum(cta_lo + chunk, comp_hi) - cta_lo, 0), BLOCK_N)
        kcodes = (kc_ptr + batch * kc_stride_b + kv_head * kc_stride_h).to(
            gl.pointer_type(gl.int16), bitcast=True
        )
        vcodes = (vc_ptr + batch * vc_stride_b + kv_head * vc_stride_h).to(
            gl.pointer_type(gl.int16), bitcast=True
        )
        kwords = (ks_ptr + batch * ks_stride_b + kv_head * ks_stride_h).to(
            gl.pointer_type(gl.int32), bitcast=True
        )
        vwords = (vs_ptr + batch * vs_stride_b + kv_head * vs_stride_h).to(
            gl.pointer_type(gl.int32), bitcast=True
        )
        # token aranges of a step, per layout, and each warp's first row
        vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, _COPY3)))
        kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, _A3)))
        mt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, _MMA3)))
        st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, _SCALE3))
        w_s = gl.arange(0, _W, layout=gl.SliceLayout(1, _SCALE3))
        v_off = _row_offsets3((cta_lo + w_copy * chunk)[:, None], vt[None, :], CODE_ROW)
        k_off = _row_offsets3((cta_lo + w_a * chunk)[:, None], kt[None, :], CODE_ROW)
        s_tok = (cta_lo + w_s * chunk)[:, None] + st[None, :]  # scale words: one int32 a token
        # step 0's reads: key and scale words into registers, value tiles into the ring (where no
        # warp has a full step, the head's row 0, unused)
        v4s = gl.allocate_shared_memory(gl.int16, [_W, BLOCK_N, 16], _TILE3)
        v2s = gl.allocate_shared_memory(gl.int16, [_W, BLOCK_N, 16], _TILE3)
        lo0 = gl.where(n_full > 0, cta_lo, 0)  # (rows from a scalar: the copies' 8-byte alignment)
        chunk0 = gl.where(n_full > 0, chunk, 0)
        v_off0 = _row_offsets3((lo0 + w_copy * chunk0)[:, None], vt[None, :], CODE_ROW)
        _issue_values(v4s, v2s, vcodes + v_off0, E4, E2)
        k_off0 = _row_offsets3((lo0 + w_a * chunk0)[:, None], kt[None, :], CODE_ROW)
        first4, first2 = _load_key_words3(kcodes + k_off0, E4, E2, True)
        s_tok0 = (lo0 + w_s * chunk0)[:, None] + st[None, :]
        first_k_words = gl.load(kwords + s_tok0)
        first_v_words = gl.load(vwords + s_tok0)
        _query_slots(*query_operands, k_factor_ptr, k_shift_ptr, qk_scale, q_smem, s_smem)
        column = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _B3)))
        select = gl.where(column < 4, 0x5410, 0x7632)
        ones = gl.full([_W, 16, BLOCK_N], 1.0, gl.float16, layout=_A3)
        # the epilogue's exchange, allocated here so that no buffer of the loop shares its memory:
        # the warps then need not meet between their loops and their stores to it
        means_smem = gl.allocate_shared_memory(gl.float16, [128, _W, 8], _TILE3)
        m_smem = gl.allocate_shared_memory(gl.float32, [_W, 8], _PLAIN2)
        l_smem = gl.allocate_shared_memory(gl.float32, [_W, 8], _PLAIN2)
        step_smem = gl.allocate_shared_memory(gl.float32, [128], _PLAIN1, step_all)
        shift_smem = gl.allocate_shared_memory(gl.float32, [128], _PLAIN1, shift_all)
        _all_warps()  # the query's slots in q_smem and s_smem, the value slots' step and shift in theirs
        q = (
            _key_operand(q_smem, 0),
            _key_operand(q_smem, 1),
            _key_operand(q_smem, 2),
            _key_operand(q_smem, 3),
            _key_operand(q_smem, 4),
            _key_operand(q_smem, 5),
            _key_operand(q_smem, 6),
            _key_operand(q_smem, 7),
        )
        qc0, qc1 = _score_offsets(s_smem)
        acc0 = gl.zeros([_W, 16, 8], gl.float32, layout=_MMA3)
        m0 = gl.full([_W, 8], _NEG_BIG, gl.float32, layout=gl.SliceLayout(1, _MMA3))
        state = (m0,) + (acc0,) * 10
        _all_warps()  # every warp has read them (the loop's conversion scratch may reuse that memory)
        if PHASE_CLOCKS:
            _stamp3(clock_ptr, first_row, 1, w_stamp * 0 + gl.max(qc0 + qc1, axis=0).to(gl.int32), rows_left)
            gl.store(sm_row + 9, (n_full + w_stamp * 0).to(gl.int64), mask=w_stamp < rows_left)
        # ---- full steps: every warp's tokens all in range (one new token: no row limit inside)
        if n_full > 0:
            next4, next2, k_words, v_words = first4, first2, first_k_words, first_v_words
            for i in range(0, n_full):
                first = i * BLOCK_N * CODE_ROW  # this step's rows, from each warp's first row
                if i > 0:  # (step 0's went out before the query's transform)
                    _issue_values(v4s, v2s, vcodes + first + v_off, E4, E2)
                raw4 = _key_elements3(next4)
                raw2 = _key_elements3(next2)
                s = _scores3(raw4, raw2, gl.convert_layout(k_words, gl.SliceLayout(2, _MMA3)), q, qc0, qc1)
                nxt = gl.minimum(i + 1, n_full - 1) * BLOCK_N  # past the end: a harmless repeat
                next4, next2 = _load_key_words3(kcodes + nxt * CODE_ROW + k_off, E4, E2, True)
                w_now = gl.convert_layout(v_words, gl.SliceLayout(2, _B3))
                k_words = gl.load(kwords + nxt + s_tok)
                v_words = gl.load(vwords + nxt + s_tok)
                async_copy.wait_group(0)
                state = _step_values(s, state, w_now, select, v4s, v2s, ones, VALUE_SUBNORMALS)
                _cta_barrier()  # every warp's reads of its tiles are done before the next copies
                if PHASE_CLOCKS:  # after the step's last value MMA
                    after = gl.max(gl.max(state[8], axis=2), axis=1)
                    _stamp3(clock_ptr, first_row, 2 + gl.minimum(i, 3), after, rows_left)
        async_copy.wait_group(0)  # where no full step ran, step 0's copies land before the rest's
        # ---- the rest: tokens clamped to each warp's range, scores masked
        last_c = gl.maximum(gl.minimum(cta_lo + w_copy * chunk + chunk, comp_hi) - 1, 0)[:, None]
        last_a = gl.maximum(gl.minimum(cta_lo + w_a * chunk + chunk, comp_hi) - 1, 0)[:, None]
        last_s = gl.maximum(gl.minimum(cta_lo + w_s * chunk + chunk, comp_hi) - 1, 0)[:, None]
        for i in range(n_full, n_all):
            start = i * BLOCK_N
            tok_c = gl.minimum((cta_lo + w_copy * chunk)[:, None] + start + vt[None, :], last_c)
            _issue_values(v4s, v2s, vcodes + tok_c.to(gl.int64) * CODE_ROW, E4, E2)
            tok_a = gl.minimum((cta_lo + w_a * chunk)[:, None] + start + kt[None, :], last_a)
            w4, w2 = _load_key_words3(kcodes + tok_a.to(gl.int64) * CODE_ROW, E4, E2, False)
            tok_m = (cta_lo + w_mma * chunk)[:, None] + start + mt[None, :]
            k_words = gl.load(kwords + gl.minimum(s_tok + start, last_s))
            v_words = gl.convert_layout(
                gl.load(vwords + gl.minimum(s_tok + start, last_s)), gl.SliceLayout(2, _B3)
            )
            k_words = gl.convert_layout(k_words, gl.SliceLayout(2, _MMA3))
            s = _scores3(_key_elements3(w4), _key_elements3(w2), k_words, q, qc0, qc1)
            s = gl.where((tok_m < hi_m[:, None])[:, :, None], s, float("-inf"))
            async_copy.wait_group(0)
            state = _step_values(s, state, v_words, select, v4s, v2s, ones, VALUE_SUBNORMALS)
            _cta_barrier()
        # ---- one partial a CTA: its splits merged under one softmax, mapped to channels by T
        if PHASE_CLOCKS:
            _stamp3(clock_ptr, first_row, 6, gl.max(gl.max(state[8], axis=2), axis=1), rows_left)
        m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa = state
        # the epilogue's global reads first: their latency then passes while the warps meet
        vt_words = vt_ptr + kv_head * vt_stride_h
        t0 = _fragment_tiles_w(vt_words + 0 * 1024)
        t1 = _fragment_tiles_w(vt_words + 1 * 1024)
        t2 = _fragment_tiles_w(vt_words + 2 * 1024)
        t3 = _fragment_tiles_w(vt_words + 3 * 1024)
        t4 = _fragment_tiles_w(vt_words + 4 * 1024)
        t5 = _fragment_tiles_w(vt_words + 5 * 1024)
        t6 = _fragment_tiles_w(vt_words + 6 * 1024)
        t7 = _fragment_tiles_w(vt_words + 7 * 1024)
        channel = gl.arange(0, 128, layout=gl.SliceLayout(1, _MMA_T))
        scale = gl.load(v_scale_ptr + kv_head * v_scale_stride_h + channel)
        # each warp's coefficient means (sums / its l, as the one-warp kernel's partial) in fp16,
        # its running max and denominator, to shared memory
        l_cols = gl.max(l_acc, axis=1)  # [W, 8]: the token-sum MMA's rows are equal
        inv_l = gl.where(l_cols > 0, 1.0 / l_cols, 0.0)  # an empty split's sums are zeros
        local = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _MMA3)))
        # [W, 8]: the columns of each band, every warp (m_i == m_i only broadcasts: a running max
        # is never NaN, gl.maximum keeps the number where a score is NaN, and the NaN reaches the
        # sums through p instead)
        keep_a = (local < 4)[None, :] & (m_i == m_i)
        keep_b = (local >= 4)[None, :] & (m_i == m_i)
        tr = (step_smem, shift_smem)
        sub = VALUE_SUBNORMALS
        _means_to_smem(means_smem, a0, wsa, inv_l, keep_a, *tr, 0, sub, _C4_0, _C4_0)
        _means_to_smem(means_smem, a1, wsa, inv_l, keep_a, *tr, 16, sub, _C4_1, _C4_1)
        _means_to_smem(means_smem, a2, wsa, inv_l, keep_a, *tr, 32, sub, _C4_2, _C4_2)
        _means_to_smem(means_smem, a3, wsa, inv_l, keep_a, *tr, 48, sub, _C4_3, _C4_3)
        _means_to_smem(means_smem, a4, wsa, inv_l, keep_b, *tr, 64, sub, _C2_0, _C2_1)
        _means_to_smem(means_smem, a5, wsa, inv_l, keep_b, *tr, 80, sub, _C2_2, _C2_3)
        _means_to_smem(means_smem, a6, wsa, inv_l, keep_b, *tr, 96, sub, _C2_4, _C2_5)
        _means_to_smem(means_smem, a7, wsa, inv_l, keep_b, *tr, 112, sub, _C2_6, _C2_7)
        m_smem.store(m_i)
        l_smem.store(l_cols)
        _all_warps()
        # the CTA's running max and denominator per column, and each warp's weight in its means
        # (exp2(m_w - m) l_w / l): in the B operand's columns, and in the output's
        weights = _merge_weights(m_smem, l_smem, gl.SliceLayout(0, _B_T))
        m_t, l_t = _merge_stats(m_smem, l_smem, gl.SliceLayout(0, _MMA_T))
        out = gl.zeros([128, 8], gl.float32, layout=_MMA_T)
        out = _transform_means(out, means_smem, t0, weights, 0)
        out = _transform_means(out, means_smem, t1, weights, 1)
        out = _transform_means(out, means_smem, t2, weights, 2)
        out = _transform_means(out, means_smem, t3, weights, 3)
        out = _transform_means(out, means_smem, t4, weights, 4)
        out = _transform_means(out, means_smem, t5, weights, 5)
        out = _transform_means(out, means_smem, t6, weights, 6)
        out = _transform_means(out, means_smem, t7, weights, 7)
        # row c's two band shares sit in columns c and c + 4: lanes t, t + 2
        bits = out.to(gl.int32, bitcast=True)
        other = gl.inline_asm_elementwise(
            "shfl.sync.bfly.b32 $0, $1, 2, 0x1f, 0xffffffff;",
            "=r,r",
            [bits],
            dtype=gl.int32,
            is_pure=True,
            pack=1,
        )
        out = out + other.to(gl.float32, bitcast=True)
        columns = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA_T))
        out = out * scale[:, None] * l_t[None, :]  # the sums again, not their means
        part = pid * n_parts + cta
        gl.store(m_ptr + part * 4 + columns, m_t, mask=columns < 4)
        gl.store(l_ptr + part * 4 + columns, l_t, mask=columns < 4)
        target = acc_ptr + (part * 4 + columns)[None, :] * D + channel[:, None]
        gl.store(target, out, mask=(columns < 4)[None, :])
        if PHASE_CLOCKS:
            _stamp3(clock_ptr, first_row, 7, _warps(_MMA3), rows_left)
