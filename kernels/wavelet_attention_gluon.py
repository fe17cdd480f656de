"""The "v3" split kernel of wavelet decode attention, in Gluon (Triton's explicit-layout dialect).

Same job as ``_split_kernel_v2`` in wavelet_attention_kernels.py (online softmax over one range of
compressed tokens, coefficient-domain value sums, partials in the reduce's format), written with
explicit layouts so each operand is built where the tensor cores want it:

* keys: a token's code row already holds what an m16n8k16 A fragment wants (lane (g, t): int16
  elements 2t, 2t + 1, 2t + 8, 2t + 9 of tokens g and g + 8), so code words load from global memory
  straight into the fragment: one LOP3 per fp16 pair (mask the field, OR in the fp16 1024 exponent),
  no shared memory, shuffles or layout conversions;
* values put slots on M and tokens on K, so a register must pair two tokens: the tiles go through
  shared memory (cp.async) and come back transposed (ldmatrix.trans). The tuned launch copies 8
  bytes at a time through L1 (cp.async.ca; Triton issues 16-byte copies as .cg, L2 only): the
  bands' copies of one 32-byte sector then meet in L1 instead of each reaching L2, which was the
  kernel's limiter (benchmarks/RESULTS.md);
* the 2-bit band has 8 int16 elements per token, half an MMA's 16 rows: its tiles hold each element
  twice and rows 8-15 take the next bit field (rows g and g + 8 of a fragment sit in the same lane,
  so the per-row field choice folds away): two fields per operand, no padding;
* value fields stay "magic" (1024 + field) and are centred through the MMA's accumulator input
  (acc - (1024 + mid) * sum_n p w), not by a subtract per pair;
* token sums (softmax denominator, sum of p * scale per band) come out of the tensor cores
  (ones @ p), already in the accumulators' layout.

It runs one layout family: head_dim 128 with a 4-bit band of 64 coefficients then a 2-bit band of 64
(one code row = 16 + 8 int16 elements, one fp16 scale per band), affine grids: the codec's default.
``_v3_reason`` in wavelet_attention.py says why another layout or call is not run (the call then
runs v1). Gluon has no interpreter: the kernel runs on CUDA only and is checked on the GPU
(tests/test_wavelet_attention.py, marked gpu); on the CPU, tests/test_attention_v3_plan.py checks
the host plan that maps its slots to coefficients by emulating the operand construction, and
compiles the kernel for sm_90 (so CI's Triton proves it still builds).
"""

from __future__ import annotations

from . import ptx_patches
from .attention_fields import (
    MAGIC_OFFSET,
    MODE_MAGIC,
    MODE_SUBNORMAL,
    SUBNORMAL_UNIT,
    field_asm,
    field_centre,
)
from .wavelet_attention import PHASE_FULL_STEPS, PHASE_SLOTS, PHASE_SM

try:  # Gluon ships with Triton >= 3.5; without it v3 is simply unavailable
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    # Triton 3.6 names the cp.async copy async_copy_global_to_shared; 3.9 renamed it async_load
    # (the old name raises there)
    _async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # (the same)
    # the CTA barrier: thread_barrier on Triton 3.6, barrier on 3.9 (both bar.sync)
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    HAS_GLUON = True
    GLUON_IMPORT_ERROR = ""
except Exception as exc:  # noqa: BLE001 - any import failure means "no Gluon here"
    HAS_GLUON = False
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


if HAS_GLUON:
    try:
        # one warp: m16n8 tiles; operands in the fragments mma.sync reads (16-bit, two per register)
        _MMA = gl.constexpr(
            gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
        )
        _A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
        _B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
        # [tokens, 16 int16] value tiles: 8 elements (16 bytes, one cp.async) per thread
        _TOKEN_ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0]))
        _TOKEN_ROWS_8B = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))  # 8-byte copies
        _TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
        # ROW_COPIES: [tokens, 32 int16] rows (the 4-bit band's 16 elements, the 2-bit band's 8
        # twice), copied 16 bytes a lane, 4 lanes a token, so that a warp's copies cover whole
        # 32-byte sectors of the cache's 48-byte rows; in shared memory 64-byte rows whose 16-byte
        # chunks are XOR-swizzled by row pair, so ldmatrix's 8 rows hit 8 different bank groups
        _ROW_COPY = gl.constexpr(gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0]))
        _ROW_TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=8, per_phase=2, max_phase=4, order=[1, 0]))
        # [tokens, 2] fp16 scale pairs: one 4-byte load per token
        _SCALE_PAIRS = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [1, 1], [1, 0]))
        # VALUE_SCALES_STAGED: [tokens, 2] fp16 scale pairs, two adjacent tokens a lane
        _SCALE_PAIRS_2 = gl.constexpr(gl.BlockedLayout([2, 2], [32, 1], [1, 1], [1, 0]))
        # TOKEN_SUMS_ROWS: its operand buffer (fp16 [4, 2, 4, 2, 2, 2], row-major), the ones that
        # fill it once, and the A operand as [2 (r), 4, 2 (g'), 64 tokens] (row 8r + 2i + g'),
        # whose dimension 1 (lane bits g1, g2) its slice broadcasts: _A's registers
        _STAGE_ROWS = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, order=[5, 4, 3, 2, 1, 0]))
        _STAGE_ONES = gl.constexpr(
            gl.BlockedLayout([1, 1, 1, 2, 2, 2], [4, 2, 4, 1, 1, 1], [1, 1, 1, 1, 1, 1], [5, 4, 3, 2, 1, 0])
        )
        _SUM_ROWS = gl.constexpr(
            gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 8], [0, 0, 0, 16], [0, 0, 0, 32]],
                lane_bases=[[0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 1, 0], [0, 1, 0, 0], [0, 2, 0, 0]],
                warp_bases=[],
                block_bases=[],
                shape=[2, 4, 2, 64],
            )
        )
        _LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))  # one element per lane
        # KEY_WORD_PAIRS: [tokens, 8] int32 words of the 4-bit band, two adjacent words a lane
        # (lane (g, t): words 2t, 2t + 1 of rows g, g + 8, ...), so each pair is one 8-byte load
        _KEY_PAIRS = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]))
        # TMA_ROWS: a step's 64 code rows of one cache, copied by TMA as a [64, 32] int16 box
        # (columns 24-31 outside the [tokens, 24] view: zeros) in 64-byte rows whose 16-byte
        # chunks are swizzled so that ldmatrix's 8 rows hit 8 bank groups; and half of an A
        # operand's columns (lane (g, t): columns 2t, 2t + 1 of rows g + 8i), for the 2-bit band
        TMA_ROWS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        _TMA_ROWS = gl.constexpr(TMA_ROWS_LAYOUT)
        _HALF_A = gl.constexpr(gl.BlockedLayout([1, 2], [8, 4], [1, 1], [1, 0]))
        # VALUE_BAND2_HALF: the 2-bit value band's tile holds its 8 elements once ([tokens, 8]
        # int16 in 8-byte copies, 16 rows a warp's copy) instead of twice. Its A operand [16
        # elements, 64 tokens] repeats them in rows 8-15: _A with its row-8 register basis made a
        # leading dimension of 2, which a [8, 64] load (the layout's slice) broadcasts and a
        # reshape folds back: the same registers, no instruction (64-token steps)
        _TOKEN_ROWS_8B_HALF = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [1, 1], [1, 0]))
        # (and without CACHE_TILES, one 16-byte copy a row, 32 rows a warp's copy)
        _TOKEN_ROWS_HALF = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0]))
        _A_ROW_PAIRS = gl.constexpr(
            gl.DistributedLinearLayout(
                reg_bases=[[0, 0, 1], [1, 0, 0], [0, 0, 8], [0, 0, 16], [0, 0, 32]],
                lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
                warp_bases=[],
                block_bases=[],
                shape=[2, 8, 64],
            )
        )
        # TRANSFORM_IN_SPLIT, QUERY_IN_SPLIT: [row tiles, 32 lanes, 4 words] of a matrix in MMA
        # fragment order, a lane's 4 words of a tile contiguous (one 16-byte load)
        _T_WORDS = gl.constexpr(gl.BlockedLayout([1, 1, 4], [1, 32, 1], [1, 1, 1], [2, 1, 0]))
        # field asm of the int16 code elements (magic: 1024 + field in place)
        _F4_0, _F4_1, _F4_2, _F4_3 = (gl.constexpr(field_asm(MODE_MAGIC, 4, f)) for f in range(4))
        _F2_0, _F2_1, _F2_2, _F2_3, _F2_4, _F2_5, _F2_6, _F2_7 = (
            gl.constexpr(field_asm(MODE_MAGIC, 2, f)) for f in range(8)
        )
        # VALUE_SUBNORMALS: the value fields as fp16 subnormals (field in place: field * 2**-24)
        _S4_0, _S4_1, _S4_2, _S4_3 = (gl.constexpr(field_asm(MODE_SUBNORMAL, 4, f)) for f in range(4))
        _S2_0, _S2_1, _S2_2, _S2_3, _S2_4, _S2_5, _S2_6, _S2_7 = (
            gl.constexpr(field_asm(MODE_SUBNORMAL, 2, f)) for f in range(8)
        )
        _INV_SUBNORMAL_UNIT = gl.constexpr(1.0 / SUBNORMAL_UNIT)
        MAGIC = gl.constexpr(MAGIC_OFFSET)
        # per-operand centres of the value fields (rows 0-7, rows 8-15)
        _C4_0, _C4_1, _C4_2, _C4_3 = (gl.constexpr(field_centre(4, f)) for f in range(4))
        _C2_0, _C2_1, _C2_2, _C2_3, _C2_4, _C2_5, _C2_6, _C2_7 = (
            gl.constexpr(field_centre(2, f)) for f in range(8)
        )
        _NEG_BIG = gl.constexpr(-1.0e30)
        _PHASE_SLOTS = gl.constexpr(PHASE_SLOTS)
        _PHASE_SM = gl.constexpr(PHASE_SM)
        _PHASE_FULL_STEPS = gl.constexpr(PHASE_FULL_STEPS)
        # markers that have the kernel's PTX patched (kernels/ptx_patches.py)
        _MARK_COPIES_L2_256B = gl.constexpr(ptx_patches.marker_asm("cp_async_l2_256b"))
        _MARK_COPIES_CA = gl.constexpr(ptx_patches.marker_asm("cp_async_ca"))
        _MARK_LOADS_L2_256B = gl.constexpr(ptx_patches.marker_asm("ld_global_l2_256b"))
        _MARK_NO_PROXY_FENCES = gl.constexpr(ptx_patches.marker_asm("no_async_proxy_fences"))
        _MARK_WARP_BARRIERS = gl.constexpr(ptx_patches.marker_asm("warp_barriers"))
    except Exception as exc:  # noqa: BLE001 - a Gluon whose layout API differs: no v3
        HAS_GLUON = False
        GLUON_IMPORT_ERROR = f"Gluon layouts: {type(exc).__name__}: {exc}"


def gluon_reason() -> str | None:
    """None when this Triton's Gluon can build the v3 kernel, else why not."""
    return None if HAS_GLUON else f"Gluon unavailable ({GLUON_IMPORT_ERROR})"


if HAS_GLUON:

    @gluon.jit
    def _field(raw, ASM: gl.constexpr):
        """fp16 operand of one field of every int16 code element in raw (two elements per op)."""
        return gl.inline_asm_elementwise(ASM, "=r,r", [raw], dtype=gl.float16, is_pure=True, pack=2)

    @gluon.jit
    def _field_pair(raw, upper, ASM_LO: gl.constexpr, ASM_HI: gl.constexpr):
        """Rows/columns 8-15 (upper) take the next field of the same elements (2-bit band)."""
        return gl.where(upper, _field(raw, ASM_HI), _field(raw, ASM_LO))

    @gluon.jit
    def _band_operands(raw4, raw2, upper, SUBNORMALS: gl.constexpr = False):
        """The 8 field operands of one step's codes (keys [tokens, 16] or values [16, tokens]): 4
        of the 4-bit band (field f of every element), 4 of the 2-bit band (fields 2o, 2o + 1).
        Magic fp16 (1024 + field in place), or with SUBNORMALS fp16 subnormals (field in place
        times 2**-24: no offset). (A shared raw >> 8 for the upper-byte fields compiled to the same
        SASS: ptxas already merges the shifts inside the field asm.)"""
        o0 = _field(raw4, _S4_0 if SUBNORMALS else _F4_0)
        o1 = _field(raw4, _S4_1 if SUBNORMALS else _F4_1)
        o2 = _field(raw4, _S4_2 if SUBNORMALS else _F4_2)
        o3 = _field(raw4, _S4_3 if SUBNORMALS else _F4_3)
        o4 = _field_pair(raw2, upper, _S2_0 if SUBNORMALS else _F2_0, _S2_1 if SUBNORMALS else _F2_1)
        o5 = _field_pair(raw2, upper, _S2_2 if SUBNORMALS else _F2_2, _S2_3 if SUBNORMALS else _F2_3)
        o6 = _field_pair(raw2, upper, _S2_4 if SUBNORMALS else _F2_4, _S2_5 if SUBNORMALS else _F2_5)
        o7 = _field_pair(raw2, upper, _S2_6 if SUBNORMALS else _F2_6, _S2_7 if SUBNORMALS else _F2_7)
        return o0, o1, o2, o3, o4, o5, o6, o7

    @gluon.jit
    def _copy(smem, pointers, CACHE: gl.constexpr):
        """cp.async of one tile; CACHE: through L1 (.ca; the default cache policy otherwise)."""
        if CACHE:
            _async_load(smem, pointers, cache_modifier=".ca")
        else:
            _async_load(smem, pointers)

    @gluon.jit
    def _row_offsets(tok, ROW: gl.constexpr, RELATIVE: gl.constexpr):
        """tok * ROW. RELATIVE (tok is an arange: the step's rows from a per-step base pointer,
        STEP_ROW_BASE): as int64, written (tok & -8) * ROW + (tok & 7) * ROW, whose first part
        LLVM folds to a constant per register and whose second is the lane's own, so ptxas
        addresses all of a lane's rows from one 64-bit register plus immediates. Written tok *
        ROW, each register's row reaches LLVM as a sign-extended int32 it cannot split, and ptxas
        keeps a 64-bit address per row (the tuned step: 858 loop instructions instead of 787,
        seventeenth session). Not for absolute token indices: there the split costs 40-150."""
        if RELATIVE:
            return (tok & -8).to(gl.int64) * ROW + (tok & 7).to(gl.int64) * ROW
        else:
            return tok * ROW

    @gluon.jit
    def _step_rows(codes, first, rows, ROW: gl.constexpr, RELATIVE: gl.constexpr):
        """(pointer, token indices) addressing rows first + rows of `codes`: RELATIVE (STEP_ROW_BASE)
        a pointer to row `first` and rows themselves (see _row_offsets), else `codes` and first +
        rows."""
        if RELATIVE:
            return codes + first * ROW, rows
        else:
            return codes, first + rows

    @gluon.jit
    def _issue_stage(
        ring,
        stage,
        kcodes,
        vcodes,
        tok,
        ROW: gl.constexpr,
        E4: gl.constexpr,
        E2: gl.constexpr,
        KEYS: gl.constexpr,
        CACHE: gl.constexpr,
        ROW_COPIES: gl.constexpr = False,
        RELATIVE: gl.constexpr = False,
    ):
        """cp.async the code tiles of BLOCK_N tokens into stage `stage` of the ring (k4s, k2s, v4s,
        v2s), one commit group: the values' and (KEYS; else the key buffers are an unused
        placeholder) the keys' [tokens, 16] int16 per band, the 2-bit band's 8 elements twice (a
        [tokens, 8] v2s, VALUE_BAND2_HALF: the values' once).
        tok: token indices in SliceLayout(1, _TOKEN_ROWS). CACHE: through L1 (cp.async.ca), where
        the bands' copies of one 32-byte sector meet (48-byte rows straddle sectors, the 2-bit
        band shares its sector with 4-bit codes), instead of each going to L2. ROW_COPIES: the row
        rings' copies instead (_issue_rows; tok in SliceLayout(1, _ROW_COPY)). RELATIVE: tok is an
        arange of rows from kcodes/vcodes (see _row_offsets)."""
        k4s, k2s, v4s, v2s = ring
        if ROW_COPIES:
            _issue_rows(k4s, v4s, stage, kcodes, vcodes, tok, ROW, E4, E2)
        else:
            if CACHE:  # Triton issues 16-byte copies as cp.async.cg (L2 only): 8-byte ones take .ca
                ve = gl.arange(0, 16, layout=gl.SliceLayout(0, _TOKEN_ROWS_8B))
                tok = gl.convert_layout(tok, gl.SliceLayout(1, _TOKEN_ROWS_8B))
            else:
                ve = gl.arange(0, 16, layout=gl.SliceLayout(0, _TOKEN_ROWS))
            if KEYS:
                k_rows = kcodes + _row_offsets(tok, ROW, RELATIVE)[:, None]
                _copy(k4s.index(stage), k_rows + E4 + ve[None, :], CACHE)
                _copy(k2s.index(stage), k_rows + E2 + (ve % 8)[None, :], CACHE)
            v_rows = vcodes + _row_offsets(tok, ROW, RELATIVE)[:, None]
            _copy(v4s.index(stage), v_rows + E4 + ve[None, :], CACHE)
            if v2s.shape[2] == 8:  # VALUE_BAND2_HALF: the 2-bit band's 8 elements once
                # (8-byte copies for CACHE as the other bands', else one 16-byte copy a row)
                HALF: gl.constexpr = _TOKEN_ROWS_8B_HALF if CACHE else _TOKEN_ROWS_HALF
                if RELATIVE:  # (tok is arange(BLOCK_N): made again in this layout, no shuffles)
                    tok2 = gl.arange(0, tok.shape[0], layout=gl.SliceLayout(1, HALF))
                else:
                    tok2 = gl.convert_layout(tok, gl.SliceLayout(1, HALF))
                ve2 = gl.arange(0, 8, layout=gl.SliceLayout(0, HALF))
                v2_rows = vcodes + _row_offsets(tok2, ROW, RELATIVE)[:, None]
                _copy(v2s.index(stage), v2_rows + E2 + ve2[None, :], CACHE)
            else:
                _copy(v2s.index(stage), v_rows + E2 + (ve % 8)[None, :], CACHE)
            async_copy.commit_group()

    @gluon.jit
    def _issue_rows(
        krows, vrows, stage, kcodes, vcodes, tok, ROW: gl.constexpr, E4: gl.constexpr, E2: gl.constexpr
    ):
        """ROW_COPIES: cp.async (16 bytes a lane, L2 only) the key and value code rows of BLOCK_N
        tokens into stage `stage` of the row rings, one commit group. Row t of a stage holds the
        4-bit band's elements in columns 0-15 and the 2-bit band's in 16-23 and again in 24-31, so
        each band is a [tokens, 16] slice. tok: token indices in SliceLayout(1, _ROW_COPY)."""
        col = gl.arange(0, 32, layout=gl.SliceLayout(0, _ROW_COPY))
        chunk = col // 8
        src = col + gl.where(chunk < 2, E4, gl.where(chunk < 3, E2 - 16, E2 - 24))
        # runs of 8 contiguous elements from multiples of 8 (E4 and E2 are): 16-byte copies (Triton
        # 3.6 infers it, 3.9 needs the hint)
        src = gl.max_contiguous(gl.multiple_of(src, 8), 8)
        _async_load(krows.index(stage), kcodes + tok[:, None] * ROW + src[None, :])
        _async_load(vrows.index(stage), vcodes + tok[:, None] * ROW + src[None, :])
        async_copy.commit_group()

    @gluon.jit
    def _stage_tiles(ring, stage, ROW_COPIES: gl.constexpr):
        """The four [tokens, 16] band tiles (keys 4-bit, 2-bit, values 4-bit, 2-bit) of one ring
        stage: slices of the row rings (ROW_COPIES; ring = (krows, krows, vrows, vrows)), else the
        per-band rings."""
        k4s, k2s, v4s, v2s = ring
        if ROW_COPIES:
            k = k4s.index(stage)
            v = v4s.index(stage)
            tiles = (k.slice(0, 16, 1), k.slice(16, 16, 1), v.slice(0, 16, 1), v.slice(16, 16, 1))
        else:
            tiles = (k4s.index(stage), k2s.index(stage), v4s.index(stage), v2s.index(stage))
        return tiles

    @gluon.jit
    def _load_keys(
        codes,
        tok,
        ROW: gl.constexpr,
        E4: gl.constexpr,
        E2: gl.constexpr,
        RELATIVE: gl.constexpr = False,
        PAIRS: gl.constexpr = False,
    ):
        """Key code words of BLOCK_N tokens straight from global memory into A fragments (lane
        (g, t) reads words of its own tokens): [tokens, 16] int16 per band, the 2-bit band's 8
        elements twice. tok: token indices in SliceLayout(1, _A) (RELATIVE: see _row_offsets).
        PAIRS: the 4-bit band's slots in KEY_WORD_PAIRS order (_pair_elements)."""
        kj = gl.arange(0, 16, layout=gl.SliceLayout(0, _A))
        rows = codes + _row_offsets(tok, ROW, RELATIVE)[:, None]
        e4 = _pair_elements(kj) if PAIRS else kj
        return gl.load(rows + E4 + e4[None, :]), gl.load(rows + E2 + (kj % 8)[None, :])

    @gluon.jit
    def _pair_elements(kj):
        """KEY_WORD_PAIRS: the 4-bit band's int16 element in A slot kj. Lane (g, t) holds slots
        2t, 2t + 1 and 2t + 8, 2t + 9; with elements 4t, 4t + 1 and 4t + 2, 4t + 3 there, its two
        words are adjacent in memory (the plan's key slots follow: _plan_v3(key_word_pairs))."""
        return (kj % 8) // 2 * 4 + kj % 2 + kj // 8 * 2

    @gluon.jit
    def _load_key_words(
        codes,
        tok,
        ROW: gl.constexpr,
        E4: gl.constexpr,
        E2: gl.constexpr,
        RELATIVE: gl.constexpr = False,
        L2_256B: gl.constexpr = False,
        PAIRS: gl.constexpr = False,
    ):
        """_load_keys as int32 words, [tokens, 8] per band (the element pairs a lane's fragment
        registers hold). PAIRS (KEY_WORD_PAIRS): the 4-bit band's two words of a lane and row come
        from adjacent memory words 2t, 2t + 1 (one 8-byte load) and are put in fragment words t,
        t + 4 (see _pair_elements). KEYS_AHEAD carries these across the loop edge: carried as int16 elements,
        the 2-bit band's repeated elements and the pairs were repacked by PRMTs and moves every
        step (about 40 loop instructions). L2_256B: loads with the L2::256B prefetch-size hint,
        which gl.load cannot give: inline asm, marked pure (as side-effecting asm the step took 9
        more instructions). Pure asm may move, so benchmarks/sass_attention_v3.py --pdl counts the
        loads before the PDL wait, and a CPU test requires none."""
        BLOCK_N: gl.constexpr = tok.shape[0]
        kj = gl.arange(0, 16, layout=gl.SliceLayout(0, _A))
        rows = codes + _row_offsets(tok, ROW, RELATIVE)[:, None]
        w2, _ = gl.split(gl.reshape(rows + E2 + (kj % 8)[None, :], [BLOCK_N, 8, 2]))
        word = gl.pointer_type(gl.int32)
        w2 = w2.to(word, bitcast=True)
        if PAIRS:
            # rows g + 8r in both layouts' row slices: a renaming, no data moves
            tok_p = gl.convert_layout(tok, gl.SliceLayout(1, _KEY_PAIRS), assert_trivial=True)
            cw = gl.arange(0, 8, layout=gl.SliceLayout(0, _KEY_PAIRS))
            rows_p = codes + _row_offsets(tok_p, ROW, RELATIVE)[:, None]
            w4 = (rows_p + E4 + 2 * cw[None, :]).to(word, bitcast=True)  # memory words 0-7
        else:
            w4, _ = gl.split(gl.reshape(rows + E4 + kj[None, :], [BLOCK_N, 8, 2]))
            w4 = w4.to(word, bitcast=True)
        if L2_256B:  # a miss fetches the 256-byte block around the word into L2
            asm: gl.constexpr = "ld.global.L2::256B.b32 $0, [$1];"
            k2 = gl.inline_asm_elementwise(asm, "=r,l", [w2], dtype=gl.int32, is_pure=True, pack=1)
            if PAIRS:  # both words of a lane's pair from the first one's address
                asm2: gl.constexpr = "ld.global.L2::256B.v2.b32 {$0, $1}, [$2];"
                k4 = gl.inline_asm_elementwise(asm2, "=r,=r,l,l", [w4], dtype=gl.int32, is_pure=True, pack=2)
            else:
                k4 = gl.inline_asm_elementwise(asm, "=r,l", [w4], dtype=gl.int32, is_pure=True, pack=1)
        else:
            if PAIRS:  # 8-byte aligned pairs (48-byte rows, even words): one vector load
                w4 = gl.max_contiguous(gl.multiple_of(w4, [1, 8]), [1, 2])
            k4 = gl.load(w4)
            k2 = gl.load(w2)
        if PAIRS:  # memory word 2t -> fragment word t, 2t + 1 -> t + 4
            k4 = gl.reshape(gl.permute(gl.reshape(k4, [BLOCK_N, 4, 2]), [0, 2, 1]), [BLOCK_N, 8])
        return k4, k2

    @gluon.jit
    def _key_elements(words):
        """int32 words [tokens, 8] of _load_key_words -> the int16 elements [tokens, 16] in the A
        fragments (the words' own registers: assert_trivial proves no data moves)."""
        BLOCK_N: gl.constexpr = words.shape[0]
        pairs = gl.join(words.to(gl.int16), (words >> 16).to(gl.int16))
        return gl.convert_layout(gl.reshape(pairs, [BLOCK_N, 16]), _A, assert_trivial=True)

    @gluon.jit
    def _fetch_rows_into_l2(codes, ROW: gl.constexpr, BLOCK_N: gl.constexpr):
        """Prefetch BLOCK_N code rows from `codes` (int16 pointer to the first row) into L2: one
        `prefetch.global.L2` a lane, lane i at byte 128 i (the range's last byte for lanes past
        it). No destination register, so nothing waits for it."""
        BYTES: gl.constexpr = BLOCK_N * ROW * 2
        lane = gl.arange(0, 32, layout=_LANES)
        lines = codes.to(gl.pointer_type(gl.int8), bitcast=True) + gl.minimum(lane * 128, BYTES - 1)
        gl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.b32 $0, 0;", "=r,l", [lines], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _fill_rows_into_l2(codes, ROW: gl.constexpr, BLOCK_N: gl.constexpr):
        """One word per 256-byte block of BLOCK_N code rows from `codes` (int16 pointer to the
        first row), lane i at byte 256 i (the range's last word for lanes past it), loaded with
        the L2::256B hint so that a miss fills the block. Returns the words: the caller must use
        them (ptxas deletes a load whose result is unused), a step later so nothing waits."""
        BYTES: gl.constexpr = BLOCK_N * ROW * 2
        lane = gl.arange(0, 32, layout=_LANES)
        blocks = codes.to(gl.pointer_type(gl.int8), bitcast=True) + gl.minimum(lane * 256, BYTES - 4)
        return gl.inline_asm_elementwise(
            "ld.global.L2::256B.b32 $0, [$1];",
            "=r,l",
            [blocks.to(gl.pointer_type(gl.int32), bitcast=True)],
            dtype=gl.int32,
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _load_scale_pairs(scales, tok, ROW: gl.constexpr):
        """The two fp16 band scales of BLOCK_N tokens, [tokens, 2] in tok's parent layout (one 4-byte
        load per token)."""
        sb = gl.arange(0, 2, layout=gl.SliceLayout(0, tok.type.layout.parent))
        return gl.load(scales + tok[:, None] * ROW + sb[None, :])

    @gluon.jit
    def _split_scales(pair):
        """[tokens, 2] fp16 -> two fp32 vectors in the scores' token layout."""
        s0, s1 = gl.split(pair.to(gl.float32))
        return gl.convert_layout(s0, gl.SliceLayout(1, _MMA)), gl.convert_layout(s1, gl.SliceLayout(1, _MMA))

    @gluon.jit
    def _split_value_scales(pair):
        """[tokens, 2] fp16 -> two fp16 vectors in the value MMAs' K layout (SliceLayout(1, _B)):
        one conversion each, where _split_scales then the B layout took two."""
        s0, s1 = gl.split(pair)
        return gl.convert_layout(s0, gl.SliceLayout(1, _B)), gl.convert_layout(s1, gl.SliceLayout(1, _B))

    @gluon.jit
    def _value_scales_staged(pair, buf0, buf1):
        """[tokens, 2] fp16 (two adjacent tokens a lane, _SCALE_PAIRS_2) -> two fp16 vectors in
        SliceLayout(1, _B), as _split_value_scales, through buf0 / buf1 (fp16 shared [4, 4, 2, 2]
        each, row-major) in the order (t, c, h, e) of token 16c + 8h + 2t + e: the 16 tokens the
        lanes of one t hold in the B layout are 32 contiguous bytes, so two 16-byte loads a band
        return the packed token pairs themselves. The compiler's own conversion loaded them in
        another order and repacked them with 16 PRMTs a step; a lane's two adjacent tokens are
        stored as one word a band."""
        BLOCK_N: gl.constexpr = pair.shape[0]
        gl.static_assert(BLOCK_N == 64, "the staging order is that of 64-token steps")
        s0, s1 = gl.split(pair)
        _cta_barrier()  # the previous step's loads of the buffers are done
        buf0.store(gl.permute(gl.reshape(s0, [4, 2, 4, 2]), [2, 0, 1, 3]))  # (c, h, t, e) -> (t, c, h, e)
        buf1.store(gl.permute(gl.reshape(s1, [4, 2, 4, 2]), [2, 0, 1, 3]))
        _cta_barrier()
        w0 = buf0.permute([1, 2, 0, 3]).reshape([BLOCK_N]).load(gl.SliceLayout(1, _B))
        w1 = buf1.permute([1, 2, 0, 3]).reshape([BLOCK_N]).load(gl.SliceLayout(1, _B))
        return w0, w1

    @gluon.jit
    def _value_scales_staged_rows(pair, buf0, buf1, rows):
        """TOKEN_SUMS_ROWS: _value_scales_staged, and the step's token-sum operand [16, BLOCK_N]
        in _A from `rows` (_token_sum_rows_buffer), into which the same scales are stored between
        the same barriers: rows 8 and 9 the 4-bit and the 2-bit band's scale of each token, the
        others ones (and so the sums' rows 0, 8 and 9 are those of p, p * the 4-bit band's scale
        and p * the 2-bit band's)."""
        BLOCK_N: gl.constexpr = pair.shape[0]
        gl.static_assert(BLOCK_N == 64, "the staging order is that of 64-token steps")
        s0, s1 = gl.split(pair)
        # (c, h, t, e, band) -> (c, band, t, h, 1, e): both bands' slots, r = 1, in one store (two
        # would be parted by a barrier: the compiler sees one buffer written twice)
        slots = gl.permute(gl.reshape(pair, [4, 2, 4, 1, 2, 2]), [0, 5, 2, 1, 3, 4])
        _cta_barrier()  # the previous step's loads of the buffers are done
        buf0.store(gl.permute(gl.reshape(s0, [4, 2, 4, 2]), [2, 0, 1, 3]))  # (c, h, t, e) -> (t, c, h, e)
        buf1.store(gl.permute(gl.reshape(s1, [4, 2, 4, 2]), [2, 0, 1, 3]))
        rows.slice(1, 1, 4).store(slots)
        _cta_barrier()
        w0 = buf0.permute([1, 2, 0, 3]).reshape([BLOCK_N]).load(gl.SliceLayout(1, _B))
        w1 = buf1.permute([1, 2, 0, 3]).reshape([BLOCK_N]).load(gl.SliceLayout(1, _B))
        # (c, g', t, h, r, e) -> [2 (r), 2 (g'), 64 tokens 16c + 8h + 2t + e]; lanes g, g + 2, g +
        # 4 and g + 6 read the same bytes (the slice of _SUM_ROWS' dimension 1)
        pairs = rows.permute([4, 1, 0, 3, 2, 5]).reshape([2, 2, BLOCK_N]).load(gl.SliceLayout(1, _SUM_ROWS))
        shape = gl.full([2, 4, 2, BLOCK_N], 0, gl.float16, layout=_SUM_ROWS)  # (its shape only)
        every = gl.broadcast(gl.expand_dims(pairs, 1), shape)[0]  # row 8r + 2 (g // 2) + g % 2
        return w0, w1, gl.convert_layout(gl.reshape(every, [16, BLOCK_N]), _A)

    @gluon.jit
    def _token_sum_rows_buffer():
        """TOKEN_SUMS_ROWS: the full steps' token-sum operand buffer of _value_scales_staged_rows, fp16
        [4 (c), 2 (g'), 4 (t), 2 (h), 2 (r), 2 (e)] holding row 8r + g' of token 16c + 8h + 2t + e,
        which the operand repeats in its rows 8r + g' + 2i: lane (g, t)'s four registers of one
        16-token MMA (rows g, g + 8, tokens 2t + e and 8 + 2t + e) are 16 contiguous bytes, so four
        16-byte loads give its operand in place, the 8 lanes of a load's phase 8 different bank
        groups. Filled with ones here; each step stores its scales into rows 8 and 9 (r = 1)."""
        buf = gl.allocate_shared_memory(gl.float16, [4, 2, 4, 2, 2, 2], _STAGE_ROWS)
        buf.store(gl.full([4, 2, 4, 2, 2, 2], 1.0, gl.float16, layout=_STAGE_ONES))
        return buf

    @gluon.jit
    def _token_sums_from_rows(sums):
        """TOKEN_SUMS_ROWS: the accumulator [16, 8] whose rows 0, 8, 9 hold the token sums of p,
        p * the 4-bit band's scale and p * the 2-bit band's -> three [16, 8] accumulators each with
        one sum in every row, as the ones-operand MMAs leave l_acc, wsa and wsb."""
        row = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))[:, None]
        every_row = gl.zeros_like(sums)
        den = gl.sum(gl.where(row == 0, sums, 0.0), axis=0)[None, :]
        band4 = gl.sum(gl.where(row == 8, sums, 0.0), axis=0)[None, :]
        band2 = gl.sum(gl.where(row == 9, sums, 0.0), axis=0)[None, :]
        return every_row + den, every_row + band4, every_row + band2

    @gluon.jit
    def _token_sum_rows(w0, w1):
        """TOKEN_SUMS_ROWS in the masked steps: the token sums' A operand [16, BLOCK_N] of
        _value_scales_staged_rows built in registers from w0, w1 (SliceLayout(1, _B) fp16; the A
        layout's lane (g, t) holds the same tokens as the B layout's): rows 8 + 2i the 4-bit
        band's scales, 9 + 2i the 2-bit band's, rows 0-7 ones."""
        row = gl.arange(0, 16, layout=gl.SliceLayout(1, _A))[:, None]
        a0 = gl.convert_layout(w0, gl.SliceLayout(0, _A))[None, :]
        a1 = gl.convert_layout(w1, gl.SliceLayout(0, _A))[None, :]
        return gl.where(row < 8, gl.full_like(a0, 1.0), gl.where(row % 2 == 0, a0, a1))

    @gluon.jit
    def _rows_repeated(rows):
        """[8, 64] in SliceLayout(0, _A_ROW_PAIRS) -> the [16, 64] A operand whose rows 8-15
        repeat rows 0-7: the same registers (a broadcast and a reshape, no instruction)."""
        shape = gl.full([2, 8, 64], 0, rows.dtype, layout=_A_ROW_PAIRS)  # (its shape only)
        pairs = gl.broadcast(gl.expand_dims(rows, 0), shape)[0]
        return gl.convert_layout(gl.reshape(pairs, [16, 64]), _A)

    @gluon.jit
    def _scores(
        raw4,
        raw2,
        k0,
        k1,
        q0,
        q1,
        q2,
        q3,
        q4,
        q5,
        q6,
        q7,
        qc0,
        qc1,
        BLOCK_N: gl.constexpr,
        OFFSET_IN_MMA: gl.constexpr = False,
    ):
        """Scores^T [BLOCK_N tokens, 8 rows] (log2 domain): per band the field MMAs against the
        transformed query slices plus the band's score offset, times the band's scale. raw4/raw2:
        the step's key code words in A fragments. OFFSET_IN_MMA: the offset enters as the band's
        first MMA's accumulator input (no add per score)."""
        kj = gl.arange(0, 16, layout=gl.SliceLayout(0, _A))
        upper = (kj >= 8)[None, :]
        zero = gl.zeros([BLOCK_N, 8], gl.float32, layout=_MMA)
        o0, o1, o2, o3, o4, o5, o6, o7 = _band_operands(raw4, raw2, upper)
        if OFFSET_IN_MMA:
            sa = mma_v2(o0, q0, zero + qc0[None, :])
        else:
            sa = mma_v2(o0, q0, zero)
        sa = mma_v2(o1, q1, sa)
        sa = mma_v2(o2, q2, sa)
        sa = mma_v2(o3, q3, sa)
        if OFFSET_IN_MMA:
            sb = mma_v2(o4, q4, zero + qc1[None, :])
        else:
            sb = mma_v2(o4, q4, zero)
        sb = mma_v2(o5, q5, sb)
        sb = mma_v2(o6, q6, sb)
        sb = mma_v2(o7, q7, sb)
        if OFFSET_IN_MMA:
            return sa * k0[:, None] + sb * k1[:, None]
        return (sa + qc0[None, :]) * k0[:, None] + (sb + qc1[None, :]) * k1[:, None]

    @gluon.jit
    def _p_to_b_by_movmatrix(p16):
        """p [tokens, 8] fp16 from the scores' accumulator layout into the value MMAs' B layout
        with one movmatrix.trans per 8 x 8 block: lane (g, t) holds token g, columns 2t and 2t + 1
        of each block, and B wants tokens 2t and 2t + 1 of column g, i.e. the block transposed. The
        reshape and permute only restate which element each register now holds (assert_trivial
        proves the final conversion moves no data)."""
        moved = gl.inline_asm_elementwise(
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;",
            "=r,r",
            [p16],
            dtype=gl.float16,
            is_pure=True,
            pack=2,
        )
        blocks = gl.permute(gl.reshape(moved, [p16.shape[0] // 8, 8, 8]), [0, 2, 1])
        return gl.convert_layout(gl.reshape(blocks, [p16.shape[0], 8]), _B, assert_trivial=True)

    @gluon.jit
    def _scale_p_packed(p16, w0, w1):
        """p * w0 and p * w1 (p [tokens, 8] fp16 in the B layout, w0/w1 [tokens] fp16 in its K
        slice) by one mul.f16x2 per register and band. Written as fp16 products of broadcast
        vectors, the compiler multiplies each element alone (an HMUL2 on duplicated halves) and
        packs the pairs again (a PRMT): 48 instructions a step where these take 32 (the same
        IEEE products, bit for bit)."""
        return gl.inline_asm_elementwise(
            "mul.rn.f16x2 $0, $2, $3; mul.rn.f16x2 $1, $2, $4;",
            "=r,=r,r,r,r",
            [p16, w0[:, None], w1[:, None]],
            dtype=(gl.float16, gl.float16),
            is_pure=True,
            pack=2,
        )

    @gluon.jit
    def _load_scale_words(scales, tok, ROW: gl.constexpr):
        """The two fp16 band scales of each token as one int32 word (band 0 in the low half),
        [tokens] (BAND_COLUMNS; rows of exactly two scales)."""
        words = scales.to(gl.pointer_type(gl.int32), bitcast=True)
        return gl.load(words + tok * (ROW // 2))

    @gluon.jit
    def _scale_p_by_column_band(p16, words, select):
        """BAND_COLUMNS: p [tokens, 8] fp16 in the B layout times each token's scale of the band its
        column serves (columns 0-3 the 4-bit band's, 4-7 the 2-bit band's): per register, one PRMT
        picks the two tokens' scales of that band from their scale words (select: 0x5410 or
        0x7632 per column) and one mul.f16x2 applies them."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 w; prmt.b32 w, $2, $3, $4; mul.rn.f16x2 $0, $1, w; }",
            "=r,r,r,r,r,r",
            [p16, words[:, None], select[None, :]],
            dtype=gl.float16,
            is_pure=True,
            pack=2,
        )

    @gluon.jit
    def _centre(upper_rows, C_LO: gl.constexpr, C_HI: gl.constexpr):
        """[16, 1] fp32 centres of one value operand's rows (folds to constants per register)."""
        return gl.where(upper_rows, C_HI, C_LO)

    @gluon.jit
    def _accumulate_values(
        s,
        state,
        w0,
        w1,
        tile4,
        tile2,
        ones,
        LAZY_RESCALE: gl.constexpr,
        P_ONCE: gl.constexpr,
        W_IN_B: gl.constexpr = False,
        P_MOVMATRIX: gl.constexpr = False,
        SUBNORMALS: gl.constexpr = False,
        PACKED_SCALING: gl.constexpr = False,
        BAND_COLUMNS: gl.constexpr = False,
        TILES_LOADED: gl.constexpr = False,
        SUMS_ROWS: gl.constexpr = False,
    ):
        """Online-softmax update of one step: rescale when a running max grows, p = exp2(s - m),
        then the value fields of both bands against p * scale, centred through the accumulator
        input. state: (running max, the 8 field accumulators, the token sums of p, p * scale of
        each band); tile4/tile2: this step's value tiles (their cp.async already waited for).
        W_IN_B: w0/w1 are fp16 in SliceLayout(1, _B) already (VALUE_SCALES_IN_B; needs P_ONCE).
        P_MOVMATRIX: p reaches the B layout by movmatrix (needs P_ONCE). SUBNORMALS: the value
        fields as fp16 subnormals, summed uncentred (no offset to cancel each step); the store
        takes the centres off once (_store_operand). BAND_COLUMNS (needs P_ONCE): columns 4-7
        repeat the query rows, w0 holds the tokens' scale words and w1 the per-column PRMT
        selectors; one B operand p * scale serves both bands (4-bit fields read columns 0-3, 2-bit
        fields 4-7), its token sums accumulate in wsa (columns as the bands) and wsb stays.
        TILES_LOADED: tile4 / tile2 are the value operands already in registers (a caller reading
        its tiles another way: benchmarks/spike_tma_step.py).
        SUMS_ROWS (needs SUBNORMALS and W_IN_B, not BAND_COLUMNS): `ones` is the step's token-sum
        operand of _value_scales_staged_rows (rows 0, 8, 9: ones and each band's scales), so one
        MMA a 16 tokens sums p, p * the 4-bit band's scale and p * the 2-bit band's into rows 0, 8, 9
        of l_acc (see _token_sums_from_rows); wsa and wsb stay unused."""
        m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa, wsb = state
        if SUMS_ROWS:
            needs: gl.constexpr = "SUMS_ROWS needs SUBNORMALS and W_IN_B, not BAND_COLUMNS"
            gl.static_assert(SUBNORMALS and W_IN_B and not BAND_COLUMNS, needs)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        if (not LAZY_RESCALE) or gl.max(m_new - m_i, axis=0) > 0:
            alpha = gl.exp2(m_i - m_new)[None, :]
            a0 = a0 * alpha
            a1 = a1 * alpha
            a2 = a2 * alpha
            a3 = a3 * alpha
            a4 = a4 * alpha
            a5 = a5 * alpha
            a6 = a6 * alpha
            a7 = a7 * alpha
            l_acc = l_acc * alpha
            if not SUMS_ROWS:
                wsa = wsa * alpha
            if not (BAND_COLUMNS or SUMS_ROWS):
                wsb = wsb * alpha
            m_i = m_new
        p = gl.exp2(s - m_i[None, :])
        if P_ONCE:  # one layout conversion of p, the scales applied in fp16 in the B layout
            if P_MOVMATRIX:
                p16 = _p_to_b_by_movmatrix(p.to(gl.float16))
            else:
                p16 = gl.convert_layout(p.to(gl.float16), _B)
            if BAND_COLUMNS:
                pa = _scale_p_by_column_band(p16, w0, w1)
                pb = pa
            elif W_IN_B and PACKED_SCALING:
                pa, pb = _scale_p_packed(p16, w0, w1)
            elif W_IN_B:
                pa = p16 * w0[:, None]
                pb = p16 * w1[:, None]
            else:
                pa = p16 * gl.convert_layout(w0.to(gl.float16), gl.SliceLayout(1, _B))[:, None]
                pb = p16 * gl.convert_layout(w1.to(gl.float16), gl.SliceLayout(1, _B))[:, None]
        else:
            pa = gl.convert_layout((p * w0[:, None]).to(gl.float16), _B)
            pb = gl.convert_layout((p * w1[:, None]).to(gl.float16), _B)
            p16 = gl.convert_layout(p.to(gl.float16), _B)
        l_acc = mma_v2(ones, p16, l_acc)
        slot = gl.arange(0, 16, layout=gl.SliceLayout(1, _A))
        upper = (slot >= 8)[:, None]
        if TILES_LOADED:  # the caller's registers: r4, r2 [16 elements, BLOCK_N tokens] in _A
            r4 = tile4
            r2 = tile2
        else:
            r4 = tile4.permute([1, 0]).load(_A)  # [16 elements, BLOCK_N tokens]
            if tile2.shape[1] == 8:  # VALUE_BAND2_HALF: [8 elements, tokens], rows 8-15 the same
                r2 = _rows_repeated(tile2.permute([1, 0]).load(gl.SliceLayout(0, _A_ROW_PAIRS)))
            else:
                r2 = tile2.permute([1, 0]).load(_A)
        o0, o1, o2, o3, o4, o5, o6, o7 = _band_operands(r4, r2, upper, SUBNORMALS)
        if SUBNORMALS:
            # the sums of p * scale straight in their accumulators, the fields' sums uncentred
            if not SUMS_ROWS:  # (SUMS_ROWS: in l_acc's rows 8 and 9 already)
                wsa = mma_v2(ones, pa, wsa)
            if not (BAND_COLUMNS or SUMS_ROWS):
                wsb = mma_v2(ones, pb, wsb)
            a0 = mma_v2(o0, pa, a0)
            a1 = mma_v2(o1, pa, a1)
            a2 = mma_v2(o2, pa, a2)
            a3 = mma_v2(o3, pa, a3)
            a4 = mma_v2(o4, pb, a4)
            a5 = mma_v2(o5, pb, a5)
            a6 = mma_v2(o6, pb, a6)
            a7 = mma_v2(o7, pb, a7)
            return (m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa, wsb)
        zero = gl.zeros([16, 8], gl.float32, layout=_MMA)
        # this step's sums of p * scale, in every row of the accumulators' layout
        step_a = mma_v2(ones, pa, zero)
        wsa = wsa + step_a
        if BAND_COLUMNS:  # one operand: its columns are the bands
            step_b = step_a
        else:
            step_b = mma_v2(ones, pb, zero)
            wsb = wsb + step_b
        upper_rows = (gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA)) >= 8)[:, None]
        a0 = mma_v2(o0, pa, a0 - _C4_0 * step_a)
        a1 = mma_v2(o1, pa, a1 - _C4_1 * step_a)
        a2 = mma_v2(o2, pa, a2 - _C4_2 * step_a)
        a3 = mma_v2(o3, pa, a3 - _C4_3 * step_a)
        a4 = mma_v2(o4, pb, a4 - _centre(upper_rows, _C2_0, _C2_1) * step_b)
        a5 = mma_v2(o5, pb, a5 - _centre(upper_rows, _C2_2, _C2_3) * step_b)
        a6 = mma_v2(o6, pb, a6 - _centre(upper_rows, _C2_4, _C2_5) * step_b)
        a7 = mma_v2(o7, pb, a7 - _centre(upper_rows, _C2_6, _C2_7) * step_b)
        return (m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa, wsb)

    @gluon.jit
    def _operand_values(
        acc,
        sums,
        v_step_ptr,
        v_shift_ptr,
        SLOT0: gl.constexpr,
        SUBNORMALS: gl.constexpr = False,
        C_LO: gl.constexpr = 0.0,
        C_HI: gl.constexpr = 0.0,
    ):
        """Coefficient sums of one operand's 16 slots, [16 slots, 8 columns] in the accumulator
        layout: (acc + shift * sum_n p w) * step (see _plan_v3). SUBNORMALS: acc holds the
        uncentred sums of field * 2**-24; its rows' magic centres (C_LO for rows 0-7, C_HI for
        8-15) less the magic offset are the field mids to take off: acc * 2**24 - mid * sum_n p w
        is what the centred accumulator holds."""
        slots = SLOT0 + gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
        step = gl.load(v_step_ptr + slots)
        shift = gl.load(v_shift_ptr + slots)
        if SUBNORMALS:
            upper_rows = gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA)) >= 8
            mid = gl.where(upper_rows, C_HI - MAGIC, C_LO - MAGIC)
            return (acc * _INV_SUBNORMAL_UNIT + (shift - mid)[:, None] * sums) * step[:, None]
        return (acc + shift[:, None] * sums) * step[:, None]

    @gluon.jit
    def _store_operand(
        acc,
        sums,
        acc_out,
        v_step_ptr,
        v_shift_ptr,
        slot_coef_ptr,
        row_ok,
        SLOT0: gl.constexpr,
        D: gl.constexpr,
        SUBNORMALS: gl.constexpr = False,
        C_LO: gl.constexpr = 0.0,
        C_HI: gl.constexpr = 0.0,
        BAND_COLUMNS: gl.constexpr = False,
        UPPER_BAND: gl.constexpr = False,
    ):
        """_operand_values scattered to coefficient order. BAND_COLUMNS: the operand's rows are
        columns 0-3, or 4-7 for the 2-bit band's operands (UPPER_BAND); row_ok already repeats
        every 4 columns."""
        slots = SLOT0 + gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
        rows = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))
        if BAND_COLUMNS:
            row_ok = row_ok & ((rows >= 4) == UPPER_BAND)
            rows = rows % 4
        coef = gl.load(slot_coef_ptr + slots)
        values = _operand_values(acc, sums, v_step_ptr, v_shift_ptr, SLOT0, SUBNORMALS, C_LO, C_HI)
        gl.store(acc_out + rows[None, :] * D + coef[:, None], values, mask=row_ok[None, :])

    @gluon.jit
    def _fragment_tiles(words_ptr, TILES: gl.constexpr):
        """TILES stacked [16, 16] fp16 A fragments from the host's fragment-ordered words
        (fragment_words): [TILES, 32 lanes, 4 words] int32, a lane's 4 words of a tile in 16
        contiguous bytes (one LDG.128 each, where loading the fp16 matrix itself gave 32-bit
        loads), restated as [16 TILES, 16] fp16 without moving data (assert_trivial). Word w of lane
        (g, t) in tile r: rows 16r + g + 8 (w % 2), columns 8 (w // 2) + 2t, + 1."""
        tile = gl.arange(0, TILES, layout=gl.SliceLayout(1, gl.SliceLayout(2, _T_WORDS)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, _T_WORDS)))
        word = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _T_WORDS)))
        offsets = (tile[:, None, None] * 32 + lane[None, :, None]) * 4 + word[None, None, :]
        words = gl.load(words_ptr + offsets)
        halves = gl.join(words.to(gl.int16), (words >> 16).to(gl.int16))  # [TILES, 32, 4, 2]
        # lane = 4g + t, word = 2 * (column >= 8) + (row >= 8): [tile, g, t, hi column, hi row, half]
        parts = gl.reshape(halves, [TILES, 8, 4, 2, 2, 2])
        rows_cols = gl.reshape(gl.permute(parts, [0, 4, 1, 3, 2, 5]), [16 * TILES, 16])
        return gl.convert_layout(rows_cols, _A, assert_trivial=True).to(gl.float16, bitcast=True)

    @gluon.jit
    def _transform_tile(vt_words):
        """One operand's [128 channels, 16 slots] fp16 slice of T as the A fragments (the words of
        value_slot_transform_words: 8 row tiles of that operand's 16 slots)."""
        return _fragment_tiles(vt_words, 8)

    @gluon.jit
    def _query_in_split(
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        qt_words,
        k_factor_ptr,
        k_shift_ptr,
        qk_scale,
        batch,
        kv_head,
        row_block,
        group,
        n_new,
        BLOCK_M: gl.constexpr,
        BAND_COLUMNS: gl.constexpr = False,
    ):
        """QUERY_IN_SPLIT: what _load_query reads from the prologue, computed here: q_slots = (M_h
        (q * s_k)) * k_factor * qk_scale in fp16 as the key MMAs' 8 B operands, and each band's score
        offset sum_s q_slot * k_shift over that fp16 query. M_h s_k [128 slots, 128 channels] comes in
        fp16 as fragment-ordered words (query_slot_transform_words: the tile of slots 16j.. and
        channels 16c.. at (8c + j) x 128 words); the query rows load straight into B fragments
        (channels on K, rows on N; fp16). 64 MMAs, one movmatrix pair per operand (accumulator ->
        B layout, as p). Returns (q0, ..., q7, qc0, qc1)."""
        channel = gl.arange(0, 16, layout=gl.SliceLayout(1, _B))
        column = gl.arange(0, 8, layout=gl.SliceLayout(0, _B))
        local = column
        if BAND_COLUMNS:  # columns 4-7 repeat rows 0-3
            local = column % 4
        rows = row_block * BLOCK_M + local
        ok = (local < BLOCK_M) & (rows < group * n_new)
        head = kv_head * group + rows // n_new
        q_rows = q_ptr + batch * q_stride_b + head * q_stride_h + (rows % n_new) * q_stride_t
        # [16 channels, 8 rows] fp16 B operands, one per channel block
        blocks = (
            _query_block(q_rows, ok, channel, 0),
            _query_block(q_rows, ok, channel, 1),
            _query_block(q_rows, ok, channel, 2),
            _query_block(q_rows, ok, channel, 3),
            _query_block(q_rows, ok, channel, 4),
            _query_block(q_rows, ok, channel, 5),
            _query_block(q_rows, ok, channel, 6),
            _query_block(q_rows, ok, channel, 7),
        )
        tables = (qt_words, k_factor_ptr, k_shift_ptr, qk_scale)
        q0, s0 = _query_operand(blocks, *tables, 0)
        q1, s1 = _query_operand(blocks, *tables, 1)
        q2, s2 = _query_operand(blocks, *tables, 2)
        q3, s3 = _query_operand(blocks, *tables, 3)
        q4, s4 = _query_operand(blocks, *tables, 4)
        q5, s5 = _query_operand(blocks, *tables, 5)
        q6, s6 = _query_operand(blocks, *tables, 6)
        q7, s7 = _query_operand(blocks, *tables, 7)
        # v3's key slots: operands 0-3 hold the 4-bit band, 4-7 the 2-bit band (_plan_v3); each
        # band's offset summed over its slots in registers first, then across lanes once
        qc0 = gl.sum((s0 + s1) + (s2 + s3), axis=0)
        qc1 = gl.sum((s4 + s5) + (s6 + s7), axis=0)
        return q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1

    @gluon.jit
    def _query_block(q_rows, ok, channel, C: gl.constexpr):
        """Channels 16C .. 16C + 15 of the query rows as a [16, 8] fp16 B operand."""
        x = gl.load(q_rows[None, :] + (16 * C + channel)[:, None], mask=ok[None, :], other=0.0)
        return x.to(gl.float32).to(gl.float16)

    @gluon.jit
    def _query_operand(blocks, qt_words, k_factor_ptr, k_shift_ptr, qk_scale, J: gl.constexpr):
        """Key operand J's query slots (16J ..) as the B operand, and their score-offset terms q_slot
        * k_shift ([16 slots, 8 rows], fp32, over the fp16-rounded query the MMA multiplies, as the
        prologue)."""
        acc = gl.zeros([16, 8], gl.float32, layout=_MMA)
        for c in gl.static_range(8):
            acc = mma_v2(_fragment_tiles(qt_words + (8 * c + J) * 128, 1), blocks[c], acc)
        slots = 16 * J + gl.arange(0, 16, layout=gl.SliceLayout(1, _MMA))
        qw16 = (acc * (gl.load(k_factor_ptr + slots) * qk_scale)[:, None]).to(gl.float16)
        shifted = qw16.to(gl.float32) * gl.load(k_shift_ptr + slots)[:, None]
        return _p_to_b_by_movmatrix(qw16), shifted

    @gluon.jit
    def _transform_operand(
        out,
        acc,
        sums,
        inv_l,
        keep,
        v_step_ptr,
        v_shift_ptr,
        vt_words,
        SLOT0: gl.constexpr,
        SUBNORMALS: gl.constexpr = False,
        C_LO: gl.constexpr = 0.0,
        C_HI: gl.constexpr = 0.0,
    ):
        """TRANSFORM_IN_SPLIT: out [128 channels, 8 columns] += T[:, slots] x (one operand's
        coefficient sums / l), on the tensor cores in fp16 with fp32 accumulation. The sums,
        divided by each column's softmax denominator, are weighted means of coefficients (no fp16
        overflow whatever the split's length); they leave the accumulator layout for the B operand
        by movmatrix, as p does. keep: BAND_COLUMNS, the four columns of the operand's band (the
        others hold the other band's products); None: every column (the MMA keeps columns apart, so
        a padding row's values reach only its own column, which the store masks). vt_words: the kv
        head's T in fragment order (L2-resident: every program of the head reads the same 32 KB)."""
        values = _operand_values(acc, sums, v_step_ptr, v_shift_ptr, SLOT0, SUBNORMALS, C_LO, C_HI)
        means = values * inv_l[None, :]
        if keep is not None:
            means = gl.where(keep[None, :], means, 0.0)
        b = _p_to_b_by_movmatrix(means.to(gl.float16))
        a = _transform_tile(vt_words + (SLOT0 // 16) * (8 * 32 * 4))
        return mma_v2(a, b, out)

    @gluon.jit
    def _stamp(stamps, slot, after):
        """PHASE_CLOCKS: the globaltimer (ns) into stamps[slot], read once `after` (a scalar) is
        computed: the asm takes it as an input, so ptxas cannot issue the read before it."""
        lane = gl.arange(0, 32, layout=_LANES)
        dep = gl.full([32], 0, gl.int32, layout=_LANES) + after.to(gl.int32)
        now = gl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer; // $1", "=l,r", [dep], dtype=gl.int64, is_pure=False, pack=1
        )
        gl.store(stamps + slot + lane * 0, now, mask=lane == 0)

    @gluon.jit
    def _wait_for_prologue():
        """griddepcontrol.wait (PDL): the prologue's writes (qw, qc) are visible after this (with
        QUERY_IN_SPLIT, no prologue: the previous kernel's, e.g. the query's or the caches')."""
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _load_query(
        qw_ptr, qc_ptr, pid, BLOCK_M: gl.constexpr, N_QC: gl.constexpr, BAND_COLUMNS: gl.constexpr = False
    ):
        """The prologue's transformed query rows of program `pid` as the key MMAs' 8 B operands (16
        slots each, rows on N), and each band's score offset per row (the sum of the prologue's
        N_QC chunk shares). BAND_COLUMNS: columns 4-7 repeat rows 0-3. Returns (q0, ..., q7, qc0,
        qc1)."""
        qs = gl.arange(0, 16, layout=gl.SliceLayout(1, _B))
        qr = gl.arange(0, 8, layout=gl.SliceLayout(0, _B))
        if BAND_COLUMNS:
            qr = qr % 4
        q_rows = qw_ptr + pid * BLOCK_M * 128 + qr[None, :] * 128 + qs[:, None]
        q_ok = (qr < BLOCK_M)[None, :]
        q0 = gl.load(q_rows + 0 * 16, mask=q_ok, other=0.0)
        q1 = gl.load(q_rows + 1 * 16, mask=q_ok, other=0.0)
        q2 = gl.load(q_rows + 2 * 16, mask=q_ok, other=0.0)
        q3 = gl.load(q_rows + 3 * 16, mask=q_ok, other=0.0)
        q4 = gl.load(q_rows + 4 * 16, mask=q_ok, other=0.0)
        q5 = gl.load(q_rows + 5 * 16, mask=q_ok, other=0.0)
        q6 = gl.load(q_rows + 6 * 16, mask=q_ok, other=0.0)
        q7 = gl.load(q_rows + 7 * 16, mask=q_ok, other=0.0)
        local = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))
        if BAND_COLUMNS:
            local = local % 4
        qc_rows = qc_ptr + pid * N_QC * BLOCK_M * 4 + local * 4
        qc0 = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, _MMA))
        qc1 = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, _MMA))
        for k in gl.static_range(N_QC):
            qc0 += gl.load(qc_rows + k * BLOCK_M * 4 + 0, mask=local < BLOCK_M, other=0.0)
            qc1 += gl.load(qc_rows + k * BLOCK_M * 4 + 1, mask=local < BLOCK_M, other=0.0)
        return q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1

    @gluon.jit
    def _repeat_halves(x, DIM: gl.constexpr):
        """TMA_ROWS: the 2-bit band's 8 elements x ([tokens, 8] for keys, DIM 1; [8, tokens] for
        values, DIM 0) in _HALF_A -> its operand [tokens, 16] / [16, tokens] in _A, the 8 repeated
        along DIM as the cp.async tiles hold them; assert_trivial proves no data moves."""
        both = gl.join(x, x)
        if DIM == 1:
            both = gl.reshape(gl.permute(both, [0, 2, 1]), [x.shape[0], 16])
        else:
            both = gl.reshape(gl.permute(both, [2, 0, 1]), [16, x.shape[1]])
        return gl.convert_layout(both, _A, assert_trivial=True)

    @gluon.jit
    def _issue_rows_tma(tma_ring, stage, k_row, v_row, pred):
        """TMA_ROWS: the caches' 64 code rows from flat rows k_row / v_row into stage `stage` of
        the row rings, completing on its barrier (pred False: nothing is issued). tma_ring: the two
        descriptors, the two row rings and their barriers."""
        k_desc, v_desc, krows, vrows, bars = tma_ring
        bar = bars.index(stage)
        # the boxes' bytes: TMA writes (and counts) the zero-filled columns 24-31 too
        mbarrier.expect(bar, 2 * 64 * 32 * 2, pred=pred)
        _tma_load(k_desc, [k_row, 0], bar, krows.index(stage), pred=pred)
        _tma_load(v_desc, [v_row, 0], bar, vrows.index(stage), pred=pred)

    @gluon.jit
    def _tma_key_operands(tma_ring, stage, phase):
        """TMA_ROWS: wait for stage `stage`'s copy (its `phase`-th completion), then its key
        operands raw4 / raw2 [tokens, 16] in _A, from ldmatrix reads of the bands' slices."""
        _, _, krows, _, bars = tma_ring
        mbarrier.wait(bars.index(stage), phase)
        ktile = krows.index(stage)
        raw4 = ktile.slice(0, 16, dim=1).load(_A)
        raw2 = _repeat_halves(ktile.slice(16, 8, dim=1).load(_HALF_A), 1)
        return raw4, raw2

    @gluon.jit
    def _tma_value_operands(tma_ring, stage):
        """TMA_ROWS: stage `stage`'s value operands r4 / r2 [16, tokens] in _A (transposed
        ldmatrix reads), once its copy has been waited for (_tma_key_operands)."""
        vtile = tma_ring[3].index(stage)
        r4 = vtile.slice(0, 16, dim=1).permute([1, 0]).load(_A)
        r2 = _repeat_halves(vtile.slice(16, 8, dim=1).permute([1, 0]).load(_HALF_A), 0)
        return r4, r2

    @gluon.jit
    def _tma_operands(tma_ring, stage, phase):
        """TMA_ROWS: _tma_key_operands then _tma_value_operands: the stage's four operands."""
        raw4, raw2 = _tma_key_operands(tma_ring, stage, phase)
        r4, r2 = _tma_value_operands(tma_ring, stage)
        return raw4, raw2, r4, r2

    @gluon.jit
    def _masked_steps(
        rest,
        query,
        state,
        CODE_ROW: gl.constexpr,
        SCALE_ROW: gl.constexpr,
        E4: gl.constexpr,
        E2: gl.constexpr,
        KEYS_VIA_SMEM: gl.constexpr,
        CACHE_TILES: gl.constexpr,
        ROW_COPIES: gl.constexpr,
        VALUE_SCALES_IN_B: gl.constexpr,
        SCORE_OFFSET_IN_MMA: gl.constexpr,
        LAZY_RESCALE: gl.constexpr,
        P_ONCE: gl.constexpr,
        P_MOVMATRIX: gl.constexpr,
        KEY_WORD_PAIRS: gl.constexpr = False,
        VALUE_SUBNORMALS: gl.constexpr = False,
        PACKED_P_SCALING: gl.constexpr = False,
        BAND_COLUMNS: gl.constexpr = False,
        select=None,
        TMA_ROWS: gl.constexpr = False,
        tma_rows=None,
        SUMS_ROWS: gl.constexpr = False,
    ):
        """split_kernel_v3's steps after its full ones (rest: the ring, the caches, the range
        full_hi .. hi, the rows' limits, the token index vectors and the ones operand): tokens
        clamped to the range (loads stay in bounds), scores masked per row, one stage in flight.
        TMA_ROWS: the code rows by TMA instead, tma_rows = (the ring of _issue_rows_tma, the flat
        row of token 0 in each cache, the ring's next copy number); rows past the range are read
        unclamped (the scores mask them; past the view TMA fills zeros). SUMS_ROWS
        (TOKEN_SUMS_ROWS): the token sums' operand built in registers (_token_sum_rows).
        Returns the updated softmax state."""
        ring, kcodes, vcodes, kscales, vscales, full_hi, hi, row_hi, vt, st, kt, mt, ones = rest
        q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1 = query
        BLOCK_N: gl.constexpr = ones.shape[1]
        last = hi - 1
        for start in range(full_hi, hi, BLOCK_N):
            if TMA_ROWS:
                tma_ring, k_row0, v_row0, g0 = tma_rows
                RING: gl.constexpr = tma_ring[2].shape[0]
                g = g0 + (start - full_hi) // BLOCK_N  # this copy's number in the ring
                _issue_rows_tma(tma_ring, g % RING, k_row0 + start, v_row0 + start, True)
            else:
                tok = gl.minimum(start + vt, last)
                _issue_stage(
                    ring, 0, kcodes, vcodes, tok, CODE_ROW, E4, E2, KEYS_VIA_SMEM, CACHE_TILES, ROW_COPIES
                )
            k0, k1 = _split_scales(_load_scale_pairs(kscales, gl.minimum(start + st, last), SCALE_ROW))
            if BAND_COLUMNS:
                words = _load_scale_words(vscales, gl.minimum(start + st, last), SCALE_ROW)
                w0 = gl.convert_layout(words, gl.SliceLayout(1, _B))
                w1 = select
            else:
                w_pair = _load_scale_pairs(vscales, gl.minimum(start + st, last), SCALE_ROW)
                if VALUE_SCALES_IN_B:
                    w0, w1 = _split_value_scales(w_pair)
                else:
                    w0, w1 = _split_scales(w_pair)
            if TMA_ROWS:
                raw4, raw2, v4t, v2t = _tma_operands(tma_ring, g % RING, (g // RING) & 1)
            else:
                k4t, k2t, v4t, v2t = _stage_tiles(ring, 0, ROW_COPIES)
                if KEYS_VIA_SMEM:
                    async_copy.wait_group(0)
                    raw4 = k4t.load(_A)
                    raw2 = k2t.load(_A)
                else:
                    raw4, raw2 = _load_keys(
                        kcodes, gl.minimum(start + kt, last), CODE_ROW, E4, E2, False, KEY_WORD_PAIRS
                    )
                    async_copy.wait_group(0)
            s = _scores(
                raw4, raw2, k0, k1, q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1, BLOCK_N, SCORE_OFFSET_IN_MMA
            )
            s = gl.where((start + mt)[:, None] < row_hi[None, :], s, float("-inf"))
            state = _accumulate_values(
                s,
                state,
                w0,
                w1,
                v4t,
                v2t,
                _token_sum_rows(w0, w1) if SUMS_ROWS else ones,
                LAZY_RESCALE,
                P_ONCE,
                VALUE_SCALES_IN_B,
                P_MOVMATRIX,
                VALUE_SUBNORMALS,
                PACKED_P_SCALING,
                BAND_COLUMNS,
                TMA_ROWS,
                SUMS_ROWS,
            )
        return state

    @gluon.jit
    def split_kernel_v3(
        qw_ptr,  # fp16 [programs, BLOCK_M, 128]: transformed query in v3 slot order (prologue)
        qc_ptr,  # fp32 [programs, N_QC, BLOCK_M, 4]: chunk shares of each band's score offset
        kc_ptr,  # uint8 codes [B, Hkv, capacity, CODE_ROW bytes]
        kc_stride_b,
        kc_stride_h,  # bytes
        ks_ptr,  # fp16 scales [B, Hkv, capacity, SCALE_ROW]
        ks_stride_b,
        ks_stride_h,  # elements
        vc_ptr,
        vc_stride_b,
        vc_stride_h,
        vs_ptr,
        vs_stride_b,
        vs_stride_h,
        seq_lens_ptr,  # int [B]: positions in the cache per sequence
        v_step_ptr,  # fp32 [128] per value slot (see attention_plans._plan_v3)
        v_shift_ptr,  # fp32 [128]
        slot_coef_ptr,  # int32 [128]: coefficient held by each value slot
        # TRANSFORM_IN_SPLIT: T [128 channels, 128 slots] per kv head, T[c, j] = (W R_h)[coefficient of
        # value slot j, c] in fp16, as int32 words in fragment order (value_slot_transform_words:
        # [Hkv, 8 operands, 8 row tiles, 32 lanes, 4 words]); head stride 0: one T for every kv head
        vt_ptr,
        vt_stride_h,
        v_scale_ptr,  # TRANSFORM_IN_SPLIT: fp32 [Hkv, 128] value channel scale s
        v_scale_stride_h,
        # QUERY_IN_SPLIT (no prologue): the query [B, Hq, n_new, 128], M_h s_k [128 slots, 128
        # channels] per kv head as fragment-ordered words (query_slot_transform_words), the key
        # slots' factors and shifts (the prologue's tables), and sm_scale * log2(e)
        q_ptr,
        q_stride_b,
        q_stride_h,
        q_stride_t,
        qt_ptr,
        qt_stride_h,
        k_factor_ptr,
        k_shift_ptr,
        qk_scale,
        m_ptr,  # fp32 [programs, n_parts, BLOCK_M]: running max (log2 domain)
        l_ptr,  # fp32 [programs, n_parts, BLOCK_M]: softmax denominator
        acc_ptr,  # fp32 [programs, n_parts, BLOCK_M, D]: coefficient sums (TRANSFORM_IN_SPLIT: channels)
        n_kv_heads,
        group,  # q heads per kv head
        n_new,  # new tokens per sequence (1 for decode)
        n_row_blocks,
        num_splits,  # compressed splits; partials num_splits onwards (the exact tokens) are not written here
        n_parts,  # partials per program (the compressed splits, then the exact tokens' chunks)
        # each split takes span * split_num / split_den of its program's compressed span, in whole
        # steps, the last one what is left (1 / num_splits: equal splits; see attention_config.SplitPlan)
        split_num,
        split_den,
        # PHASE_CLOCKS: int64 [programs * num_splits, PHASE_SLOTS] globaltimer stamps (see _stamp)
        clock_ptr,
        # TMA_ROWS: tensor descriptors of the key and value codes viewed as [rows, 24] int16
        # (every (sequence, kv head)'s rows in turn), [64, 32] blocks in _TMA_ROWS (else unread)
        k_rows_desc,
        v_rows_desc,
        CODE_ROW: gl.constexpr,  # int16 elements per code row (token stride)
        SCALE_ROW: gl.constexpr,  # fp16 scales per row (token stride)
        E4: gl.constexpr,  # first int16 element of the 4-bit band
        E2: gl.constexpr,  # first int16 element of the 2-bit band
        D: gl.constexpr,
        BLOCK_M: gl.constexpr,  # query rows per program (<= 8)
        N_QC: gl.constexpr,
        BLOCK_N: gl.constexpr,  # tokens per step
        SINKS: gl.constexpr,
        WINDOW: gl.constexpr,
        STAGES: gl.constexpr,  # code-tile ring stages: the tiles of STAGES - 1 steps ahead in flight
        KEYS_VIA_SMEM: gl.constexpr,  # keys through the ring too (else loaded at their step, no smem)
        KEYS_AHEAD: gl.constexpr,  # the next step's key words loaded into registers before this step's values
        CACHE_TILES: gl.constexpr,  # the ring's copies through L1 (see _issue_stage)
        P_ONCE: gl.constexpr,  # one layout conversion of p (scales applied in fp16 after it)
        LAZY_RESCALE: gl.constexpr,
        PDL: gl.constexpr = False,  # launched with programmatic dependent launch: wait for the prologue
        # the value tiles' token indices made in the layout of their 8-byte copies (CACHE_TILES), not
        # converted to it each step by shuffles (912 loop instructions instead of 928, no BRA.DIV)
        COPY_LAYOUT_TOKENS: gl.constexpr = False,
        # the value scales split straight into the value MMAs' K layout in fp16 (one conversion,
        # not one to the scores' rows and another to the B layout; needs P_ONCE)
        VALUE_SCALES_IN_B: gl.constexpr = False,
        # each band's score offset as its first key MMA's accumulator input (no add per score)
        SCORE_OFFSET_IN_MMA: gl.constexpr = False,
        # p to the value MMAs' B layout by one movmatrix.trans per 8 x 8 block (needs P_ONCE)
        P_MOVMATRIX: gl.constexpr = False,
        # full steps address their code rows from a scalar pointer to the step's first row (per-lane
        # offsets are then loop-invariant; offline 876 loop instructions instead of 904, but ptxas
        # then uses the key words sooner after their loads: 7-9% slower, sixteenth session)
        STEP_ROW_BASE: gl.constexpr = False,
        # let the next kernel in the stream launch now (PDL): the exact-token kernel of
        # LaunchConfig.exact_in_chain, which needs nothing from this one until it ends
        TRIGGER_DEPENDENTS: gl.constexpr = False,
        # the key and value code rows through one [tokens, 32] ring each, by 16-byte copies that
        # cover whole sectors (needs KEYS_VIA_SMEM: the keys come from the ring too)
        ROW_COPIES: gl.constexpr = False,
        # the full steps' key-word loads ask L2 for 256-byte blocks on a miss (ld.global.L2::256B)
        KEY_LOADS_L2_256B: gl.constexpr = False,
        # each step prefetches the next step's value rows into L2 (one prefetch a lane)
        PREFETCH_VALUE_ROWS: gl.constexpr = False,
        # each step loads one word per 256-byte block of the next step's value rows with the
        # L2::256B hint, and folds the previous step's words into a sink (prepared, not timed)
        FILL_VALUE_ROWS_L2: gl.constexpr = False,
        # every cp.async copy (the code tiles) asks L2 for 256-byte blocks on a miss: PTX patched
        # after Triton writes it (kernels/ptx_patches.py)
        VALUE_COPIES_L2_256B: gl.constexpr = False,
        # every plain global load (in the loop: the scale pairs) the same, by the same patch
        PLAIN_LOADS_L2_256B: gl.constexpr = False,
        # with PDL: the first full steps' cache reads issued before the wait for the prologue (they
        # need nothing from it): this many steps' key, value and scale rows prefetched into L2, and
        # the first step's key words and scale pairs loaded into registers; the query after the
        # wait. 0: every load after the wait
        LOADS_BEFORE_WAIT: gl.constexpr = 0,
        # grid (programs, num_splits) instead of (num_splits, programs): blocks go out split by
        # split, so a plan's short last splits come after every long one (SplitPlan.split_major)
        SPLIT_MAJOR: gl.constexpr = False,
        # each step's code rows by one TMA copy a cache into STAGES-deep rings, the bands read by
        # ldmatrix (LaunchConfig.tma_rows; benchmarks/spike_tma_step.py); needs the default
        # codec's 48-byte rows, STAGES >= 2 and the keys from there (not KEYS_AHEAD)
        TMA_ROWS: gl.constexpr = False,
        # with TMA_ROWS: the kernel's proxy fences (one before each loop's copies) removed from its
        # PTX (kernels/ptx_patches.py; LaunchConfig.tma_rows_unfenced says why that is safe here)
        TMA_ROWS_UNFENCED: gl.constexpr = False,
        # with TMA_ROWS: a full step's stage gets its next copy (STAGES steps ahead) once the step
        # has read its value operands, after its scores (behind the proxy fence that orders those
        # ldmatrix reads before the copy), instead of at the next step's start: about STAGES - 1/2
        # steps of lead instead of STAGES - 1 (LaunchConfig.tma_rows_early)
        TMA_ROWS_EARLY: gl.constexpr = False,
        # with TMA_ROWS_EARLY: the scale pairs loaded two steps ahead (carried in registers), so
        # that they keep more than a step of lead (LaunchConfig.scale_pairs_two_ahead)
        SCALES_TWO_AHEAD: gl.constexpr = False,
        # each lane's two 4-bit-band key words by one 8-byte load (the plan's key slots ordered
        # for it: _plan_v3(key_word_pairs=True)); keys from global memory only
        KEY_WORD_PAIRS: gl.constexpr = False,
        # the padding rows of the MMAs' N get p = 0 (see the state's initial running max)
        ZERO_PADDING_P: gl.constexpr = False,
        # the value fields as fp16 subnormals summed uncentred, centred once at the store (no
        # per-step centring: LaunchConfig.value_subnormals says when the split is short enough)
        VALUE_SUBNORMALS: gl.constexpr = False,
        # p times the value scales by one packed fp16 multiply per register and band (needs
        # VALUE_SCALES_IN_B; bit-identical)
        PACKED_P_SCALING: gl.constexpr = False,
        # a GQA group of at most 4 rows: the MMAs' N columns 4-7 repeat the query rows, and the
        # value MMAs' B operand is p times the 4-bit band's scales in columns 0-3 and the 2-bit
        # band's in 4-7: one B operand and one p * scale token sum for both bands (needs P_ONCE,
        # BLOCK_M <= 4 and rows of two scales)
        BAND_COLUMNS: gl.constexpr = False,
        # the full steps' value scales reach the B layout through shared memory in the order of its
        # lanes' token pairs (no PRMTs after the loads; needs VALUE_SCALES_IN_B, 64-token steps;
        # nothing under BAND_COLUMNS)
        VALUE_SCALES_STAGED: gl.constexpr = False,
        # the full-step loop counts steps (start = lo + step * BLOCK_N) instead of stepping over
        # token positions up to full_hi, and its scale pairs come from a scalar pointer per step:
        # ptxas then recomputes fewer loop bounds and addresses per step at the register cap
        # (offline: 732 -> 721 loop instructions on Triton 3.6; the same loads, bit for bit)
        COUNTED_STEPS: gl.constexpr = False,
        # the partial's sums leave in the channel domain, centred (x - m: T x (sums / l) on the
        # tensor cores, times s and l), so the reduce merges every partial under one softmax and
        # maps nothing back (LaunchConfig.transform_in_split)
        TRANSFORM_IN_SPLIT: gl.constexpr = False,
        # the query's transform to slots computed here from the query (_query_in_split), so no
        # prologue runs before this kernel (LaunchConfig.query_in_split; needs LOADS_BEFORE_WAIT 0)
        QUERY_IN_SPLIT: gl.constexpr = False,
        # a probe: each program stamps its phases into clock_ptr (LaunchConfig.phase_clocks)
        PHASE_CLOCKS: gl.constexpr = False,
        # the preferred shared-memory carveout, set by fast_launch.launch on the compiled function
        # (LaunchConfig.split_carveout; unread here)
        CARVEOUT: gl.constexpr = -1,
        # the 2-bit value band's ring tiles hold its 8 elements once, [BLOCK_N, 8], and its
        # operand repeats them from the same registers: half the band's copies and ldmatrix, 1 KB
        # less shared memory a stage (LaunchConfig.value_band2_half; 64-token steps, cached tiles)
        VALUE_BAND2_HALF: gl.constexpr = False,
        # without CACHE_TILES: the tiles' 16-byte copies through L1 (cp.async.ca by a PTX patch,
        # kernels/ptx_patches.py; Triton emits them as .cg; LaunchConfig.value_copies_16b_l1)
        VALUE_COPIES_16B_L1: gl.constexpr = False,
        # the token sums (p, and p times each band's scale) as rows 0, 8, 9 of one MMA's A operand (1
        # and the tokens' scales, staged with VALUE_SCALES_STAGED), so one MMA a 16 tokens and one
        # accumulator instead of three of each (LaunchConfig.token_sums_rows; needs
        # VALUE_SUBNORMALS and VALUE_SCALES_STAGED)
        TOKEN_SUMS_ROWS: gl.constexpr = False,
        # every CTA barrier (Triton's for its shared-memory conversions and the ring, and the staged
        # scales') as a warp barrier, by a PTX patch (kernels/ptx_patches.py): one warp a program,
        # so bar.warp.sync orders the same memory accesses, and ptxas may move instructions across
        # it, where BAR.SYNC fences the schedule (LaunchConfig.warp_barriers)
        WARP_BARRIERS: gl.constexpr = False,
    ):
        """One (split, sequence, kv head, row block): online softmax over a range of compressed
        tokens in the coefficient domain; grid (num_splits, programs), or (programs, num_splits)
        with SPLIT_MAJOR."""
        if PDL and LOADS_BEFORE_WAIT == 0:
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
        if WARP_BARRIERS:
            gl.static_assert(gl.num_warps() == 1, "WARP_BARRIERS: CTA barriers of one-warp programs")
            gl.inline_asm_elementwise(_MARK_WARP_BARRIERS, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if VALUE_COPIES_L2_256B:
            gl.inline_asm_elementwise(_MARK_COPIES_L2_256B, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if VALUE_COPIES_16B_L1:
            gl.static_assert(
                not CACHE_TILES, "VALUE_COPIES_16B_L1 patches the 16-byte copies of CACHE_TILES off"
            )
            gl.inline_asm_elementwise(_MARK_COPIES_CA, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if PLAIN_LOADS_L2_256B:
            gl.inline_asm_elementwise(_MARK_LOADS_L2_256B, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if TMA_ROWS_EARLY:
            gl.static_assert(
                TMA_ROWS and not TMA_ROWS_UNFENCED,
                "TMA_ROWS_EARLY issues a copy right after its stage's ldmatrix reads: the fence must stay",
            )
        gl.static_assert(TMA_ROWS_EARLY or not SCALES_TWO_AHEAD, "SCALES_TWO_AHEAD is TMA_ROWS_EARLY's")
        if TMA_ROWS_UNFENCED:
            gl.static_assert(TMA_ROWS, "TMA_ROWS_UNFENCED removes the fences before TMA_ROWS' copies")
            gl.inline_asm_elementwise(_MARK_NO_PROXY_FENCES, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if SPLIT_MAJOR:
            pid = gl.program_id(0)
            split = gl.program_id(1)
        else:
            split = gl.program_id(0)
            pid = gl.program_id(1)
        stamps = clock_ptr + (pid * num_splits + split) * _PHASE_SLOTS
        if PHASE_CLOCKS:
            _stamp(stamps, 0, split)
            smid = gl.inline_asm_elementwise(
                "mov.u32 $0, %smid;", "=r", [], dtype=gl.int32, is_pure=False, pack=1
            )
            gl.store(stamps + _PHASE_SM, smid.to(gl.int64))
        row_block = pid % n_row_blocks
        kv_head = (pid // n_row_blocks) % n_kv_heads
        batch = pid // (n_row_blocks * n_kv_heads)
        # query rows on the MMAs' N (8; rows >= BLOCK_M are padding)
        local = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))
        select = None
        if BAND_COLUMNS:  # columns 4-7 repeat rows 0-3 (limits, masks and all)
            gl.static_assert(BLOCK_M <= 4, "BAND_COLUMNS needs BLOCK_M <= 4")
            gl.static_assert(SCALE_ROW == 2, "BAND_COLUMNS reads each token's two scales as a word")
            gl.static_assert(P_ONCE, "BAND_COLUMNS scales p in the B layout (P_ONCE)")
            local = local % 4
            # the PRMT selector of each column's band in the scale words
            column = gl.arange(0, 8, layout=gl.SliceLayout(0, _B))
            select = gl.where(column < 4, 0x5410, 0x7632)
        rows = row_block * BLOCK_M + local
        row_ok = (local < BLOCK_M) & (rows < group * n_new)
        token = rows % n_new
        seq_len = gl.load(seq_lens_ptr + batch).to(gl.int32)
        # causal: new token t sees positions < seq_len - n_new + t + 1
        limit = gl.where(row_ok, seq_len - n_new + token + 1, 0)
        comp_hi = gl.minimum(gl.maximum(seq_len - WINDOW, SINKS), gl.max(limit, axis=0))
        span = gl.maximum(comp_hi - SINKS, 0).to(gl.int64)  # (x split_num may pass 2^31)
        chunk = gl.cdiv(gl.cdiv(span * split_num, split_den).to(gl.int32), BLOCK_N) * BLOCK_N
        lo = SINKS + split * chunk
        hi = gl.minimum(lo + chunk, comp_hi)
        row_hi = gl.minimum(limit, hi)
        # steps below every real row's limit need no score mask
        all_hi = gl.min(gl.where(row_ok, row_hi, hi), axis=0)
        full_hi = lo + gl.maximum(all_hi - lo, 0) // BLOCK_N * BLOCK_N
        # ---- the TMA ring of code rows: stage i holds copy i's key and value rows
        if TMA_ROWS:
            gl.static_assert(
                STAGES >= 2 and not KEYS_AHEAD and not KEYS_VIA_SMEM and not ROW_COPIES,
                "TMA_ROWS: a ring of STAGES >= 2 row tiles, the keys read from it",
            )
            gl.static_assert(
                CODE_ROW == 24 and E4 == 0 and E2 == 16 and not KEY_WORD_PAIRS and not BAND_COLUMNS,
                "TMA_ROWS reads the default codec's rows: the 4-bit band's 16 elements, the 2-bit band's 8",
            )
            gl.static_assert(
                not COUNTED_STEPS
                and LOADS_BEFORE_WAIT == 0
                and not PREFETCH_VALUE_ROWS
                and not FILL_VALUE_ROWS_L2,
                "TMA_ROWS: no COUNTED_STEPS, LOADS_BEFORE_WAIT, PREFETCH_VALUE_ROWS or FILL_VALUE_ROWS_L2",
            )
            krows_t = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 32], _TMA_ROWS)
            vrows_t = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 32], _TMA_ROWS)
            bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(bars.index(i), count=1)
            # the flat rows of this (sequence, kv head)'s token 0 in the [rows, 24] views
            k_row0 = ((batch.to(gl.int64) * kc_stride_b + kv_head * kc_stride_h) // (2 * CODE_ROW)).to(
                gl.int32
            )
            v_row0 = ((batch.to(gl.int64) * vc_stride_b + kv_head * vc_stride_h) // (2 * CODE_ROW)).to(
                gl.int32
            )
            ring = (krows_t, krows_t, vrows_t, vrows_t)  # (unread: the cp.async ring's place)
            tma_ring = (k_rows_desc, v_rows_desc, krows_t, vrows_t, bars)
            # the first copies (numbers 0 ..; none past the full steps: each copy is waited for) go
            # out now: they need nothing from the query, whose transform they then overlap
            for i in gl.static_range(STAGES if TMA_ROWS_EARLY else STAGES - 1):
                first = lo + i * BLOCK_N
                _issue_rows_tma(tma_ring, i, k_row0 + first, v_row0 + first, first + BLOCK_N <= full_hi)
        # ---- loop invariants
        if QUERY_IN_SPLIT:
            gl.static_assert(LOADS_BEFORE_WAIT == 0, "QUERY_IN_SPLIT reads the query after the wait")
            q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1 = _query_in_split(
                q_ptr,
                q_stride_b,
                q_stride_h,
                q_stride_t,
                qt_ptr + kv_head * qt_stride_h,
                k_factor_ptr,
                k_shift_ptr,
                qk_scale,
                batch,
                kv_head,
                row_block,
                group,
                n_new,
                BLOCK_M,
                BAND_COLUMNS,
            )
        elif LOADS_BEFORE_WAIT == 0:
            q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1 = _load_query(
                qw_ptr, qc_ptr, pid, BLOCK_M, N_QC, BAND_COLUMNS
            )
        if PHASE_CLOCKS and LOADS_BEFORE_WAIT == 0:
            _stamp(stamps, 1, gl.max(qc0 + qc1, axis=0))
            gl.store(stamps + _PHASE_FULL_STEPS, ((full_hi - lo) // BLOCK_N).to(gl.int64))
        ones = gl.full([16, BLOCK_N], 1.0, gl.float16, layout=_A)  # token sums through the MMA
        kcodes = (kc_ptr + batch * kc_stride_b + kv_head * kc_stride_h).to(
            gl.pointer_type(gl.int16), bitcast=True
        )
        vcodes = (vc_ptr + batch * vc_stride_b + kv_head * vc_stride_h).to(
            gl.pointer_type(gl.int16), bitcast=True
        )
        kscales = ks_ptr + batch * ks_stride_b + kv_head * ks_stride_h
        vscales = vs_ptr + batch * vs_stride_b + kv_head * vs_stride_h
        kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _A))
        st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _SCALE_PAIRS))
        sv = st  # the value scales' token indices: two adjacent tokens a lane when staged
        if VALUE_SCALES_STAGED and not BAND_COLUMNS:  # (BAND_COLUMNS reads a token's scales as a word)
            gl.static_assert(VALUE_SCALES_IN_B, "VALUE_SCALES_STAGED stages B-layout scales")
            sv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _SCALE_PAIRS_2))
            stage_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[3, 2, 1, 0])
            vs_buf0 = gl.allocate_shared_memory(gl.float16, [4, 4, 2, 2], stage_layout)
            vs_buf1 = gl.allocate_shared_memory(gl.float16, [4, 4, 2, 2], stage_layout)
            if TOKEN_SUMS_ROWS:  # the token sums' operand: the scales in rows 8 and 9, ones elsewhere
                vs_rows = _token_sum_rows_buffer()
        if TOKEN_SUMS_ROWS:
            gl.static_assert(
                VALUE_SUBNORMALS and VALUE_SCALES_STAGED and not BAND_COLUMNS,
                "TOKEN_SUMS_ROWS needs VALUE_SUBNORMALS and VALUE_SCALES_STAGED, not BAND_COLUMNS",
            )
        if ROW_COPIES:
            vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _ROW_COPY))
        elif CACHE_TILES and COPY_LAYOUT_TOKENS:  # already in the 8-byte copies' layout: no shuffles
            vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _TOKEN_ROWS_8B))
        else:
            vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _TOKEN_ROWS))
        mt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _MMA))
        # the ring of code tiles: stage i holds step i's key and value tiles
        # (TMA_ROWS: allocated, and its first copies issued, before the query's transform)
        if ROW_COPIES:
            krows = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 32], _ROW_TILE)
            vrows = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 32], _ROW_TILE)
            ring = (krows, krows, vrows, vrows)
        elif not TMA_ROWS:
            KEY_STAGES: gl.constexpr = STAGES if KEYS_VIA_SMEM else 1  # 1: an unused placeholder
            k4s = gl.allocate_shared_memory(gl.int16, [KEY_STAGES, BLOCK_N, 16], _TILE)
            k2s = gl.allocate_shared_memory(gl.int16, [KEY_STAGES, BLOCK_N, 16], _TILE)
            v4s = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 16], _TILE)
            if VALUE_BAND2_HALF:
                v2s = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 8], _TILE)
            else:
                v2s = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 16], _TILE)
            ring = (k4s, k2s, v4s, v2s)
        # ---- state: running max, 8 field accumulators, token sums of p and of p * scale per band
        acc0 = gl.zeros([16, 8], gl.float32, layout=_MMA)
        m0 = gl.full([8], _NEG_BIG, gl.float32, layout=gl.SliceLayout(0, _MMA))
        if ZERO_PADDING_P:
            # the MMAs' padding rows (the GQA group fills 4 of N's 8) start at a running max no
            # score reaches: every step's p there is exp2(s - 1e30) = 0 and alpha exp2(0) = 1, so
            # the value and token-sum MMAs multiply zeros in those columns instead of p = 1 (their
            # query is zero, their scores 0), at no cost in instructions; real rows are untouched
            m0 = gl.where(row_ok, m0, -_NEG_BIG)
        state = (m0,) + (acc0,) * 11
        # ---- full steps: every token below every row's limit, no masks or clamps. The tiles of
        # step i + STAGES - 1 are in flight while step i computes; scales one step ahead.
        if full_hi > lo:
            last_full = full_hi - BLOCK_N
            if not TMA_ROWS:  # (TMA_ROWS: its first copies went out before the query's transform)
                for i in gl.static_range(STAGES - 1):
                    ahead = gl.minimum(lo + i * BLOCK_N, last_full)  # past the end: a harmless repeat
                    _issue_stage(
                        ring,
                        i,
                        kcodes,
                        vcodes,
                        ahead + vt,
                        CODE_ROW,
                        E4,
                        E2,
                        KEYS_VIA_SMEM,
                        CACHE_TILES,
                        ROW_COPIES,
                    )
            k_pair = _load_scale_pairs(kscales, lo + st, SCALE_ROW)
            if BAND_COLUMNS:
                v_pair = _load_scale_words(vscales, lo + st, SCALE_ROW)
            else:
                v_pair = _load_scale_pairs(vscales, lo + sv, SCALE_ROW)
            if SCALES_TWO_AHEAD:  # the second step's scale pairs too
                second = gl.minimum(lo + BLOCK_N, last_full)
                k_pair1 = _load_scale_pairs(kscales, second + st, SCALE_ROW)
                v_pair1 = _load_scale_pairs(vscales, second + sv, SCALE_ROW)
            if KEYS_AHEAD:
                next4, next2 = _load_key_words(
                    kcodes, lo + kt, CODE_ROW, E4, E2, False, KEY_LOADS_L2_256B, KEY_WORD_PAIRS
                )
            if LOADS_BEFORE_WAIT > 0:
                for i in gl.static_range(LOADS_BEFORE_WAIT):
                    first = gl.minimum(lo + i * BLOCK_N, last_full)
                    _fetch_rows_into_l2(vcodes + first * CODE_ROW, CODE_ROW, BLOCK_N)
                    if i > 0 or not KEYS_AHEAD:  # (step 0's key words are loaded above)
                        _fetch_rows_into_l2(kcodes + first * CODE_ROW, CODE_ROW, BLOCK_N)
                    if i > 0:  # (and its scale pairs)
                        _fetch_rows_into_l2(kscales + first * SCALE_ROW, SCALE_ROW, BLOCK_N)
                        _fetch_rows_into_l2(vscales + first * SCALE_ROW, SCALE_ROW, BLOCK_N)
                if PDL:
                    _wait_for_prologue()
                q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1 = _load_query(
                    qw_ptr, qc_ptr, pid, BLOCK_M, N_QC, BAND_COLUMNS
                )
            if FILL_VALUE_ROWS_L2:
                fill = gl.zeros([32], gl.int32, layout=_LANES)
                sink = gl.zeros([32], gl.int32, layout=_LANES)
            # COUNTED_STEPS: the loop over step numbers (start from the step), else over positions
            for step_or_start in range(
                0 if COUNTED_STEPS else lo,
                (full_hi - lo) // BLOCK_N if COUNTED_STEPS else full_hi,
                1 if COUNTED_STEPS else BLOCK_N,
            ):
                if COUNTED_STEPS:
                    step = step_or_start
                    start = lo + step * BLOCK_N
                else:
                    start = step_or_start
                    step = (start - lo) // BLOCK_N
                ahead = gl.minimum(start + (STAGES - 1) * BLOCK_N, last_full)
                slot = (step + STAGES - 1) % STAGES  # the stage the previous step read
                if TMA_ROWS:  # (its ldmatrix results fed that step's MMAs: read, so free)
                    if not TMA_ROWS_EARLY:
                        first = start + (STAGES - 1) * BLOCK_N
                        _issue_rows_tma(tma_ring, slot, k_row0 + first, v_row0 + first, first <= last_full)
                else:
                    k_base, ahead_tok = _step_rows(kcodes, ahead, vt, CODE_ROW, STEP_ROW_BASE)
                    v_base, _ = _step_rows(vcodes, ahead, vt, CODE_ROW, STEP_ROW_BASE)
                    _issue_stage(
                        ring,
                        slot,
                        k_base,
                        v_base,
                        ahead_tok,
                        CODE_ROW,
                        E4,
                        E2,
                        KEYS_VIA_SMEM,
                        CACHE_TILES,
                        ROW_COPIES,
                        STEP_ROW_BASE,
                    )
                k0, k1 = _split_scales(k_pair)
                if BAND_COLUMNS:
                    w0 = gl.convert_layout(v_pair, gl.SliceLayout(1, _B))
                    w1 = select
                elif TOKEN_SUMS_ROWS:  # and the token sums' operand, in place of the ones
                    w0, w1, sums_rows = _value_scales_staged_rows(v_pair, vs_buf0, vs_buf1, vs_rows)
                elif VALUE_SCALES_STAGED:
                    w0, w1 = _value_scales_staged(v_pair, vs_buf0, vs_buf1)
                elif VALUE_SCALES_IN_B:
                    w0, w1 = _split_value_scales(v_pair)
                else:
                    w0, w1 = _split_scales(v_pair)
                cur = step % STAGES
                nxt = gl.minimum(start + BLOCK_N, last_full)
                if PREFETCH_VALUE_ROWS:  # the next step's value rows, for its copies to find in L2
                    _fetch_rows_into_l2(vcodes + nxt * CODE_ROW, CODE_ROW, BLOCK_N)
                if FILL_VALUE_ROWS_L2:  # last step's words are in by now; this step's wait a step
                    sink = sink ^ fill
                    fill = _fill_rows_into_l2(vcodes + nxt * CODE_ROW, CODE_ROW, BLOCK_N)
                if COUNTED_STEPS:  # scalar per-step pointers, loop-invariant lane offsets
                    k_pair = _load_scale_pairs(kscales + nxt * SCALE_ROW, st, SCALE_ROW)
                elif not TMA_ROWS_EARLY:  # (TMA_ROWS_EARLY: after the step's copy is issued)
                    k_pair = _load_scale_pairs(kscales, nxt + st, SCALE_ROW)
                if BAND_COLUMNS:
                    v_pair = _load_scale_words(vscales, nxt + st, SCALE_ROW)
                elif COUNTED_STEPS:
                    v_pair = _load_scale_pairs(vscales + nxt * SCALE_ROW, sv, SCALE_ROW)
                elif not TMA_ROWS_EARLY:
                    v_pair = _load_scale_pairs(vscales, nxt + sv, SCALE_ROW)
                k4t, k2t, v4t, v2t = _stage_tiles(ring, cur, ROW_COPIES)
                if TMA_ROWS_EARLY:  # copy number `step`: its keys now, its values after the scores
                    raw4, raw2 = _tma_key_operands(tma_ring, cur, (step // STAGES) & 1)
                elif TMA_ROWS:  # copy number `step` (v4t / v2t: the value operands in registers)
                    raw4, raw2, v4t, v2t = _tma_operands(tma_ring, cur, (step // STAGES) & 1)
                elif KEYS_VIA_SMEM:
                    async_copy.wait_group(STAGES - 1)  # this step's group has landed
                    raw4 = k4t.load(_A)
                    raw2 = k2t.load(_A)
                elif KEYS_AHEAD:
                    raw4 = _key_elements(next4)
                    raw2 = _key_elements(next2)
                else:
                    k_rows, k_tok = _step_rows(kcodes, start, kt, CODE_ROW, STEP_ROW_BASE)
                    if KEY_LOADS_L2_256B:  # the hinted loads take words: the same elements
                        w4, w2 = _load_key_words(
                            k_rows, k_tok, CODE_ROW, E4, E2, STEP_ROW_BASE, True, KEY_WORD_PAIRS
                        )
                        raw4 = _key_elements(w4)
                        raw2 = _key_elements(w2)
                    else:
                        raw4, raw2 = _load_keys(
                            k_rows, k_tok, CODE_ROW, E4, E2, STEP_ROW_BASE, KEY_WORD_PAIRS
                        )
                s = _scores(
                    raw4, raw2, k0, k1, q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1, BLOCK_N, SCORE_OFFSET_IN_MMA
                )
                if KEYS_AHEAD and not KEYS_VIA_SMEM:
                    # this step's key words are spent: their registers take the next step's, whose
                    # global latency then hides behind this step's value work
                    k_rows, k_tok = _step_rows(kcodes, nxt, kt, CODE_ROW, STEP_ROW_BASE)
                    next4, next2 = _load_key_words(
                        k_rows, k_tok, CODE_ROW, E4, E2, STEP_ROW_BASE, KEY_LOADS_L2_256B, KEY_WORD_PAIRS
                    )
                if not KEYS_VIA_SMEM and not TMA_ROWS:
                    async_copy.wait_group(STAGES - 1)
                if TMA_ROWS_EARLY:
                    # the stage is read once its values are: its next copy goes out now, behind the
                    # proxy fence (ordering those reads first), then the next step's scale loads,
                    # which that fence would otherwise wait for
                    v4t, v2t = _tma_value_operands(tma_ring, cur)
                    first = start + STAGES * BLOCK_N
                    _issue_rows_tma(tma_ring, cur, k_row0 + first, v_row0 + first, first <= last_full)
                    if SCALES_TWO_AHEAD:  # loaded here, the next step's pairs would have a third of a step
                        k_pair = k_pair1
                        v_pair = v_pair1
                        after_next = gl.minimum(start + 2 * BLOCK_N, last_full)
                        k_pair1 = _load_scale_pairs(kscales, after_next + st, SCALE_ROW)
                        v_pair1 = _load_scale_pairs(vscales, after_next + sv, SCALE_ROW)
                    else:
                        k_pair = _load_scale_pairs(kscales, nxt + st, SCALE_ROW)
                        v_pair = _load_scale_pairs(vscales, nxt + sv, SCALE_ROW)
                state = _accumulate_values(
                    s,
                    state,
                    w0,
                    w1,
                    v4t,
                    v2t,
                    sums_rows if TOKEN_SUMS_ROWS else ones,
                    LAZY_RESCALE,
                    P_ONCE,
                    VALUE_SCALES_IN_B,
                    P_MOVMATRIX,
                    VALUE_SUBNORMALS,
                    PACKED_P_SCALING,
                    BAND_COLUMNS,
                    TMA_ROWS,
                    TOKEN_SUMS_ROWS,
                )
                if PHASE_CLOCKS:  # after the step's last value MMA
                    _stamp(stamps, 2 + gl.minimum(step, 3), gl.max(gl.max(state[8], axis=1), axis=0))
            async_copy.wait_group(0)
            if FILL_VALUE_ROWS_L2:
                # a store no run makes (n_new >= 1), which the compiler cannot know: it keeps the
                # fill loads alive
                sink = sink ^ fill
                never = gl.full([32], n_new, gl.int32, layout=_LANES) < 0
                slot = (pid * n_parts + split) * BLOCK_M + gl.arange(0, 32, layout=_LANES) % BLOCK_M
                gl.store(m_ptr + slot, sink.to(gl.float32), mask=never)
        # ---- the rest: tokens clamped to the range (loads stay in bounds), scores masked per row
        rest = (ring, kcodes, vcodes, kscales, vscales, full_hi, hi, row_hi, vt, st, kt, mt, ones)
        tma_rows = None
        if TMA_ROWS:  # the full steps' copies were numbered 0 .. their count - 1
            n_full = (full_hi - lo) // BLOCK_N
            tma_rows = (tma_ring, k_row0, v_row0, n_full)
        if hi > full_hi:
            if LOADS_BEFORE_WAIT > 0:  # (a program with full steps has waited already: at once)
                if PDL:
                    _wait_for_prologue()
                q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1 = _load_query(
                    qw_ptr, qc_ptr, pid, BLOCK_M, N_QC, BAND_COLUMNS
                )
            state = _masked_steps(
                rest,
                (q0, q1, q2, q3, q4, q5, q6, q7, qc0, qc1),
                state,
                CODE_ROW,
                SCALE_ROW,
                E4,
                E2,
                KEYS_VIA_SMEM,
                CACHE_TILES,
                ROW_COPIES,
                VALUE_SCALES_IN_B,
                SCORE_OFFSET_IN_MMA,
                LAZY_RESCALE,
                P_ONCE,
                P_MOVMATRIX,
                KEY_WORD_PAIRS,
                VALUE_SUBNORMALS,
                PACKED_P_SCALING,
                BAND_COLUMNS,
                select,
                TMA_ROWS,
                tma_rows,
                TOKEN_SUMS_ROWS,
            )
        # ---- partials in the reduce's format
        m_i, a0, a1, a2, a3, a4, a5, a6, a7, l_acc, wsa, wsb = state
        if TOKEN_SUMS_ROWS:  # the sums in rows 0, 8, 9 of l_acc: to every row of their three
            l_acc, wsa, wsb = _token_sums_from_rows(l_acc)
        if PHASE_CLOCKS:
            _stamp(stamps, 6, gl.max(gl.max(a7, axis=1), axis=0))
        part = pid * n_parts + split
        kept = row_ok
        if BAND_COLUMNS:  # columns 4-7 repeat 0-3
            kept = row_ok & (gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA)) < 4)
        gl.store(m_ptr + part * BLOCK_M + local, m_i, mask=kept)
        gl.store(l_ptr + part * BLOCK_M + local, gl.max(l_acc, axis=0), mask=kept)
        acc_out = acc_ptr + part * BLOCK_M * D
        sub = VALUE_SUBNORMALS
        wsb_or_a = wsa if BAND_COLUMNS else wsb  # BAND_COLUMNS: wsa's columns are the bands
        if TRANSFORM_IN_SPLIT:
            l_cols = gl.max(l_acc, axis=0)
            inv_l = gl.where(l_cols > 0, 1.0 / l_cols, 0.0)  # an empty split's sums are zeros
            columns = gl.arange(0, 8, layout=gl.SliceLayout(0, _MMA))
            keep_a = None
            keep_b = None
            if BAND_COLUMNS:  # each band's operands keep their own four columns
                keep_a = row_ok & (columns < 4)
                keep_b = row_ok & (columns >= 4)
            out = gl.zeros([128, 8], gl.float32, layout=_MMA)
            tr = (v_step_ptr, v_shift_ptr, vt_ptr + kv_head * vt_stride_h)
            out = _transform_operand(out, a0, wsa, inv_l, keep_a, *tr, 0, sub, _C4_0, _C4_0)
            out = _transform_operand(out, a1, wsa, inv_l, keep_a, *tr, 16, sub, _C4_1, _C4_1)
            out = _transform_operand(out, a2, wsa, inv_l, keep_a, *tr, 32, sub, _C4_2, _C4_2)
            out = _transform_operand(out, a3, wsa, inv_l, keep_a, *tr, 48, sub, _C4_3, _C4_3)
            out = _transform_operand(out, a4, wsb_or_a, inv_l, keep_b, *tr, 64, sub, _C2_0, _C2_1)
            out = _transform_operand(out, a5, wsb_or_a, inv_l, keep_b, *tr, 80, sub, _C2_2, _C2_3)
            out = _transform_operand(out, a6, wsb_or_a, inv_l, keep_b, *tr, 96, sub, _C2_4, _C2_5)
            out = _transform_operand(out, a7, wsb_or_a, inv_l, keep_b, *tr, 112, sub, _C2_6, _C2_7)
            if BAND_COLUMNS:  # row c's two band shares sit in columns c and c + 4: lanes t, t + 2
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
                columns = columns % 4
            channel = gl.arange(0, 128, layout=gl.SliceLayout(1, _MMA))
            scale = gl.load(v_scale_ptr + kv_head * v_scale_stride_h + channel)
            out = out * scale[:, None] * l_cols[None, :]  # the sums again, not their means
            gl.store(acc_out + columns[None, :] * D + channel[:, None], out, mask=kept[None, :])
            if PHASE_CLOCKS:
                _stamp(stamps, 7, gl.max(gl.max(out, axis=1), axis=0))
        else:
            store = (v_step_ptr, v_shift_ptr, slot_coef_ptr, row_ok)
            _store_operand(a0, wsa, acc_out, *store, 0, D, sub, _C4_0, _C4_0, BAND_COLUMNS, False)
            _store_operand(a1, wsa, acc_out, *store, 16, D, sub, _C4_1, _C4_1, BAND_COLUMNS, False)
            _store_operand(a2, wsa, acc_out, *store, 32, D, sub, _C4_2, _C4_2, BAND_COLUMNS, False)
            _store_operand(a3, wsa, acc_out, *store, 48, D, sub, _C4_3, _C4_3, BAND_COLUMNS, False)
            _store_operand(a4, wsb_or_a, acc_out, *store, 64, D, sub, _C2_0, _C2_1, BAND_COLUMNS, True)
            _store_operand(a5, wsb_or_a, acc_out, *store, 80, D, sub, _C2_2, _C2_3, BAND_COLUMNS, True)
            _store_operand(a6, wsb_or_a, acc_out, *store, 96, D, sub, _C2_4, _C2_5, BAND_COLUMNS, True)
            _store_operand(a7, wsb_or_a, acc_out, *store, 112, D, sub, _C2_6, _C2_7, BAND_COLUMNS, True)
