"""KV codec kernels: PyTorch reference and Triton compress / compress-into-cache.

Kernels know nothing of FX or of the config classes: they take a codec object (duck-typed: the
attributes of wmoe_compile.codec.WaveletKVCodec) and plain tensors.

Shapes: x [B, Hkv, T, D] (any strides, fp16 / bf16 / fp32), channel_scale broadcastable to
[Hkv, D]. Outputs: codes uint8 [B, Hkv, T, n_code_bytes], scales fp16 [B, Hkv, T, n_bands].

Triton vs reference: the Triton kernel follows the reference's rules step by step (fp32 maths,
scale rounded to fp16 before coding, the same candidate scales and tie rule). Two differences are
allowed: the transform's fp32 sums run in a different order (tl.dot or a matrix-vector tl.sum vs
torch.matmul; tl.sum vs torch.sum for band errors and `-ub` projections), and affine grids code
by arithmetic (c * 1 / (s * step) + const, rounded up) instead of a correctly rounded c / s
compared with the midpoint table, so a coefficient, a sum or a decision value can differ by a few
ulp. A code then differs (by one level) only where the
coefficient lies within that rounding of a decision boundary, an `mse` scale choice differs only
between two candidates whose errors tie to rounding, and an `-ub` scale only where the ratio sits
on an fp16 rounding boundary (one fp16 ulp). Tests check codes equal on all but such boundary
cases and reconstruction errors equal to rounding.

Cache writes: codes/scales go to slot positions[b, t] of [B, Hkv, S, ...] caches; the exact
cache [B, Hkv, sinks + window, D] receives position p < sinks at slot p and, for the last
`window` tokens of the chunk, slot sinks + p % window (docs/CONTRACTS.md). The reference checks
positions and raises; the Triton kernel (no host sync) drops writes whose position is outside
[0, S) and documents it.
"""

from __future__ import annotations

import functools

import torch

from .fast_launch import launch

try:  # Triton is optional on machines without it; the reference always works.
    import triton
    import triton.language as tl

    from .triton_masks import mask_and

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False


# ----------------------------------------------------------------------------------------------
# reference


def _as_4d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 3:
        return x.unsqueeze(0)
    if x.dim() != 4:
        raise ValueError(f"{name} must be [B, Hkv, T, D] or [Hkv, T, D], got shape {tuple(x.shape)}")
    return x


def channel_params(
    channel_scale: torch.Tensor, hkv: int, d: int
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Split the `channel_scale` argument of the ops into (scale [Hkv, 1, D], offset [Hkv, 1, D],
    rotation [Hkv, D, D]), each None when absent. Coefficients: c = W R ((x - m) / s).

    Accepted forms: an empty tensor (none); [D], [1, D] or [Hkv, D] (scale s); [2, Hkv, D] or
    [2, 1, D] (row 0 scale, row 1 offset m); [Hkv, D + 2, D] (rows [0, D) the per-head orthonormal
    rotation R, row D the scale, row D + 1 the offset; codec.pack_channel_params builds it)."""
    if channel_scale.numel() == 0:
        return None, None, None
    cs = channel_scale
    if cs.dim() == 3 and cs.shape[0] in (1, hkv) and cs.shape[1] == d + 2 and cs.shape[2] == d:
        cs = cs.expand(hkv, d + 2, d)
        return cs[:, d : d + 1], cs[:, d + 1 : d + 2], cs[:, :d]
    if cs.dim() == 1:
        cs = cs.unsqueeze(0)
    if cs.dim() == 2:
        cs = cs.unsqueeze(0)
    if cs.dim() != 3 or cs.shape[0] not in (1, 2) or cs.shape[-1] != d or cs.shape[1] not in (1, hkv):
        raise ValueError(
            f"channel_scale must be [Hkv={hkv}, D={d}], [1, D] or [D] (scale), [2, Hkv, D] (scale and "
            f"offset), [Hkv, D + 2, D] (rotation, scale, offset), or empty for none; "
            f"got shape {tuple(channel_scale.shape)}"
        )
    cs = cs.expand(cs.shape[0], hkv, d).unsqueeze(2)
    return cs[0], (cs[1] if cs.shape[0] == 2 else None), None


def compress_reference(
    codec, x: torch.Tensor, channel_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., Hkv, T, D] -> (codes uint8 [..., n_code_bytes], scales fp16 [..., n_bands])."""
    if x.dim() < 3:
        raise ValueError(f"x must be [..., Hkv, T, D], got shape {tuple(x.shape)}")
    _check_float(x, "x")
    scale, offset, rotation = channel_params(channel_scale, x.shape[-3], x.shape[-1])
    return codec.encode(x, scale, offset, rotation)


def decompress_reference(
    codec, codes: torch.Tensor, scales: torch.Tensor, channel_scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    if codes.dtype != torch.uint8 or scales.dtype != torch.float16:
        raise ValueError(f"codes must be uint8 and scales fp16, got {codes.dtype} and {scales.dtype}")
    if codes.dim() < 3:
        raise ValueError(f"codes must be [..., Hkv, T, n_code_bytes], got shape {tuple(codes.shape)}")
    scale, offset, rotation = channel_params(channel_scale, codes.shape[-3], codec.head_dim)
    return codec.decode(codes, scales, scale, dtype, offset, rotation)


def _check_float(x: torch.Tensor, name: str) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name} must be fp16, bf16 or fp32, got {x.dtype}")


def check_cache_args(
    codec,
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Validate shapes/dtypes of a cache write; returns positions as [B, T] (a view)."""
    _check_float(x, "x")
    if x.dim() != 4:
        raise ValueError(f"x must be [B, Hkv, T, D], got shape {tuple(x.shape)}")
    b, h, t, d = x.shape
    if d != codec.head_dim:
        raise ValueError(f"x head_dim {d} != codec head_dim {codec.head_dim}")
    if codes_cache.dtype != torch.uint8 or codes_cache.dim() != 4 or tuple(codes_cache.shape[:2]) != (b, h):
        raise ValueError(
            f"codes_cache must be uint8 [B={b}, Hkv={h}, S, {codec.n_code_bytes}], "
            f"got {codes_cache.dtype} {tuple(codes_cache.shape)}"
        )
    s = codes_cache.shape[2]
    if codes_cache.shape[3] != codec.n_code_bytes:
        raise ValueError(f"codes_cache last dim {codes_cache.shape[3]} != n_code_bytes {codec.n_code_bytes}")
    if scales_cache.dtype != torch.float16 or tuple(scales_cache.shape) != (b, h, s, codec.n_bands):
        raise ValueError(
            f"scales_cache must be fp16 [{b}, {h}, {s}, {codec.n_bands}], "
            f"got {scales_cache.dtype} {tuple(scales_cache.shape)}"
        )
    n_exact = codec.config.sinks + codec.config.window
    if exact_cache.dim() != 4 or tuple(exact_cache.shape) != (b, h, n_exact, d):
        raise ValueError(
            f"exact_cache must be [B={b}, Hkv={h}, sinks + window={n_exact}, D={d}], "
            f"got {tuple(exact_cache.shape)}"
        )
    _check_float(exact_cache, "exact_cache")
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 (or int32), got {positions.dtype}")
    if positions.dim() == 1:
        if positions.shape[0] != t:
            raise ValueError(f"positions [T] must have T={t} entries, got {positions.shape[0]}")
        return positions.unsqueeze(0).expand(b, t)
    if positions.dim() == 2 and tuple(positions.shape) == (b, t):
        return positions
    raise ValueError(f"positions must be [T={t}] or [B={b}, T={t}], got shape {tuple(positions.shape)}")


def compress_into_cache_reference(
    codec,
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
) -> None:
    pos = check_cache_args(codec, x, codes_cache, scales_cache, exact_cache, positions).long()
    b, h, t, d = x.shape
    s = codes_cache.shape[2]
    if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= s):
        raise ValueError(f"positions must lie in [0, S={s}), got range [{int(pos.min())}, {int(pos.max())}]")
    codes, scales = compress_reference(codec, x, channel_scale)
    batch = torch.arange(b, device=x.device).unsqueeze(1).expand(b, t)
    # [B, S, Hkv, ...] views so one advanced index (batch, pos) addresses a slot of every head.
    codes_cache.permute(0, 2, 1, 3)[batch, pos] = codes.permute(0, 2, 1, 3)
    scales_cache.permute(0, 2, 1, 3)[batch, pos] = scales.permute(0, 2, 1, 3)
    sinks, window = codec.config.sinks, codec.config.window
    exact_view = exact_cache.permute(0, 2, 1, 3)
    _, offset, _ = channel_params(channel_scale, h, d)
    # exact copies are stored centred too (x - m), so every key/value a query reads shares the offset
    x_exact = x if offset is None else (x.float() - offset.unsqueeze(0))
    xv = x_exact.permute(0, 2, 1, 3).to(exact_cache.dtype)
    is_sink = pos < sinks
    if bool(is_sink.any()):
        exact_view[batch[is_sink], pos[is_sink]] = xv[is_sink]
    if window > 0:
        in_ring = torch.arange(t, device=x.device).unsqueeze(0).expand(b, t) >= t - window
        exact_view[batch[in_ring], sinks + pos[in_ring] % window] = xv[in_ring]


# ----------------------------------------------------------------------------------------------
# Triton
#
# One kernel, two paths chosen per launch (constexpr VEC):
#   VEC (decode steps, T < VEC_MAX_T): one program per vector. Each band's coefficients are a
#     matrix-vector product with the band's rows of M (R, W or W R); all scale candidates of a
#     band are coded at once as a [candidates, band] tile, so a vector takes a few dependent
#     steps instead of a 16-step loop per band.
#   tile (prefill chunks): one program per (BLOCK_T tokens, b * h); each band's coefficients are
#     tl.dots accumulated over BLOCK_K-channel chunks of the transform's input (_tile_coeffs), the
#     scale candidates a runtime loop that keeps the best scale per row, codes made once after it.
# Affine grids (level v = offset + step * v, e.g. `uniform`) code without table lookups or
# divisions: code = clamp(ceil(c / (s * step) - offset / step - 1/2), 0, 2**bits - 1), the count
# of grid midpoints below c / s up to fp32 rounding. Other grids (lloyd, int, log) use the
# midpoint table with a correctly rounded c / s, as the reference does.

if HAS_TRITON:

    @triton.jit
    def _quantize_band(u, mids_ptr, lut_off, BITS: tl.constexpr):
        # Binary search: count of midpoints strictly below u (midpoints ascending, padded by +inf).
        code = tl.zeros(u.shape, dtype=tl.int32)
        for k in tl.static_range(BITS):
            cand = code + (1 << (BITS - 1 - k))
            mid = tl.load(mids_ptr + lut_off + cand - 1)
            code = tl.where(u > mid, cand, code)
        return code

    @triton.jit
    def _safe_div(c, s):
        # c / s correctly rounded (as torch divides); a zero scale maps every coefficient to 0.
        pos = s > 0.0
        return tl.where(pos, tl.math.div_rn(c, tl.where(pos, s, 1.0)), 0.0)

    @triton.jit
    def _grid_code(
        c,
        s,
        grid_ptr,
        mids_ptr,
        LUT_OFFSET: tl.constexpr,
        BITS: tl.constexpr,
        AFFINE: tl.constexpr,
        STEP: tl.constexpr,
        Z0: tl.constexpr,
        GRID_OFFSET: tl.constexpr,
    ):
        # (code, grid[code]) of c against scale s (c and s broadcast against each other)
        if AFFINE:
            ok = s > 0.0
            inv = tl.where(ok, 1.0 / tl.where(ok, s * STEP, 1.0), 0.0)
            code_f = tl.minimum(tl.maximum(tl.math.ceil(c * inv + Z0), 0.0), (1 << BITS) - 1.0)
            code = code_f.to(tl.int32)
            level = GRID_OFFSET + STEP * code_f
        else:
            code = _quantize_band(_safe_div(c, s), mids_ptr, LUT_OFFSET, BITS)
            level = tl.load(grid_ptr + LUT_OFFSET + code)
        return code, level

    @triton.jit
    def _load_y(x_row, sxd, m_row, s_row, scsd, cols, mask, HAS_OFFSET: tl.constexpr, HAS_CS: tl.constexpr):
        # (x - m) / s in fp32 at channel indices `cols` (pointer rows broadcast against cols)
        y = tl.load(x_row + cols * sxd, mask=mask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            y = y - tl.load(m_row + cols * scsd, mask=mask, other=0.0)
        if HAS_CS:
            y = tl.math.div_rn(y, tl.load(s_row + cols * scsd, mask=mask, other=1.0))
        return y

    @triton.jit
    def _band_coeffs(
        y,
        rows_ok,
        x_row,
        sxd,
        m_row,
        s_row,
        scsd,
        mat_ptr,
        s_mi,
        s_mj,
        VEC: tl.constexpr,
        START: tl.constexpr,
        SIZE: tl.constexpr,
        BLOCK_S: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        MODE: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        HAS_CS: tl.constexpr,
    ):
        # The band's coefficients c_i = sum_j M[START + i, j] y_j: [BLOCK_S] (VEC) or
        # [BLOCK_T, BLOCK_S] (MODE 0 only: the tile path's transforms are _tile_coeffs; rows_ok
        # [BLOCK_T, 1] masks tokens past T); columns past SIZE are 0.
        # MODE 0: no transform (c = y's channels).
        i = tl.arange(0, BLOCK_S)
        i_ok = i < SIZE
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        if MODE == 0:
            if VEC:
                c = _load_y(x_row, sxd, m_row, s_row, scsd, START + i, i_ok, HAS_OFFSET, HAS_CS)
            else:
                cols = (START + i)[None, :]
                c = _load_y(x_row, sxd, m_row, s_row, scsd, cols, rows_ok & i_ok[None, :], HAS_OFFSET, HAS_CS)
        else:
            mat = tl.load(
                mat_ptr + (START + i)[:, None] * s_mi + d[None, :] * s_mj,
                mask=i_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            c = tl.sum(mat * y[None, :], axis=1)
        return c

    @triton.jit
    def _band_rows_t(
        mat_ptr, s_mi, s_mj, j, j_ok, START: tl.constexpr, SIZE: tl.constexpr, BLOCK_S: tl.constexpr
    ):
        # [BLOCK_K, BLOCK_S]: element [jj, i] = M[START + i, j[jj]]; columns past SIZE are 0
        i = tl.arange(0, BLOCK_S)
        return tl.load(
            mat_ptr + (START + i)[None, :] * s_mi + j[:, None] * s_mj,
            mask=j_ok[:, None] & (i < SIZE)[None, :],
            other=0.0,
        )

    @triton.jit
    def _tile_coeffs(
        rows_ok,
        x_row,
        sxd,
        m_row,
        s_row,
        scsd,
        mat_ptr,
        s_mi,
        s_mj,
        rot_ptr,
        sri,
        srj,
        BLOCK_T: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_K: tl.constexpr,
        MODE: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        HAS_CS: tl.constexpr,
        N_BANDS: tl.constexpr,
        B0_START: tl.constexpr,
        B0_SIZE: tl.constexpr,
        B0_BLOCK_S: tl.constexpr,
        B1_START: tl.constexpr,
        B1_SIZE: tl.constexpr,
        B1_BLOCK_S: tl.constexpr,
        B2_START: tl.constexpr,
        B2_SIZE: tl.constexpr,
        B2_BLOCK_S: tl.constexpr,
        B3_START: tl.constexpr,
        B3_SIZE: tl.constexpr,
        B3_BLOCK_S: tl.constexpr,
    ):
        # Every band's coefficients [BLOCK_T, B*_BLOCK_S] (MODE 1-3), the transform's input taken
        # BLOCK_K channels at a time: each band's tl.dot accumulates over the chunks in channel
        # order, the same fp32 FMA chain as one dot over all D channels. One dot over D loads
        # whole [BLOCK_T, D] and [D, band] operands into registers per thread (FMA dot on fp32):
        # at D = 128, ~1000 values, spilled to local memory (4 KB+ per thread on sm_90).
        # MODE 3 (c = W (R y)): z = R y is made BLOCK_K rows of R at a time, each from y chunks.
        acc0 = tl.zeros((BLOCK_T, B0_BLOCK_S), tl.float32)
        acc1 = tl.zeros((BLOCK_T, B1_BLOCK_S), tl.float32)
        acc2 = tl.zeros((BLOCK_T, B2_BLOCK_S), tl.float32)
        acc3 = tl.zeros((BLOCK_T, B3_BLOCK_S), tl.float32)
        for j0 in tl.range(0, BLOCK_D, BLOCK_K, loop_unroll_factor=1):
            j = j0 + tl.arange(0, BLOCK_K)
            j_ok = j < D
            if MODE == 3:
                z = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
                for k0 in tl.range(0, BLOCK_D, BLOCK_K, loop_unroll_factor=1):
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_ok = k < D
                    k_rows = rows_ok & k_ok[None, :]
                    y = _load_y(x_row, sxd, m_row, s_row, scsd, k[None, :], k_rows, HAS_OFFSET, HAS_CS)
                    rt = tl.load(
                        rot_ptr + j[None, :] * sri + k[:, None] * srj,
                        mask=k_ok[:, None] & j_ok[None, :],
                        other=0.0,
                    )
                    z = tl.dot(y, rt, z, input_precision="ieee")
            else:
                z = _load_y(
                    x_row, sxd, m_row, s_row, scsd, j[None, :], rows_ok & j_ok[None, :], HAS_OFFSET, HAS_CS
                )
            if N_BANDS > 0:
                m0 = _band_rows_t(mat_ptr, s_mi, s_mj, j, j_ok, B0_START, B0_SIZE, B0_BLOCK_S)
                acc0 = tl.dot(z, m0, acc0, input_precision="ieee")
            if N_BANDS > 1:
                m1 = _band_rows_t(mat_ptr, s_mi, s_mj, j, j_ok, B1_START, B1_SIZE, B1_BLOCK_S)
                acc1 = tl.dot(z, m1, acc1, input_precision="ieee")
            if N_BANDS > 2:
                m2 = _band_rows_t(mat_ptr, s_mi, s_mj, j, j_ok, B2_START, B2_SIZE, B2_BLOCK_S)
                acc2 = tl.dot(z, m2, acc2, input_precision="ieee")
            if N_BANDS > 3:
                m3 = _band_rows_t(mat_ptr, s_mi, s_mj, j, j_ok, B3_START, B3_SIZE, B3_BLOCK_S)
                acc3 = tl.dot(z, m3, acc3, input_precision="ieee")
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _n_non_finite(c, VEC: tl.constexpr):
        bad = tl.where((c == c) & (tl.abs(c) < float("inf")), 0, 1)
        if VEC:
            n = tl.sum(bad, axis=0)
        else:
            n = tl.sum(bad, axis=1)
        return n

    @triton.jit
    def _encode_band_vec(
        c,
        row_ok,
        row_finite,
        code_base,
        scale_base,
        grid_ptr,
        mids_ptr,
        frac_ptr,
        BLOCK_F: tl.constexpr,
        N_FRACTIONS: tl.constexpr,
        BAND: tl.constexpr,
        SIZE: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BITS: tl.constexpr,
        BYTE_OFFSET: tl.constexpr,
        LUT_OFFSET: tl.constexpr,
        MSE: tl.constexpr,
        UNBIASED: tl.constexpr,
        AFFINE: tl.constexpr,
        STEP: tl.constexpr,
        Z0: tl.constexpr,
        GRID_OFFSET: tl.constexpr,
    ):
        # One vector's band c [BLOCK_S]: every scale candidate at once as a [BLOCK_F, BLOCK_S] tile.
        i = tl.arange(0, BLOCK_S)
        in_band = i < SIZE
        absmax = tl.max(tl.where(in_band, tl.abs(c), 0.0), axis=0)
        if MSE:
            fi = tl.arange(0, BLOCK_F)
            f_ok = fi < N_FRACTIONS
            f = tl.load(frac_ptr + fi, mask=f_ok, other=0.0)
            s = tl.minimum(absmax * f, 65504.0).to(tl.float16).to(tl.float32)
            codes, levels = _grid_code(
                c[None, :], s[:, None], grid_ptr, mids_ptr, LUT_OFFSET, BITS, AFFINE, STEP, Z0, GRID_OFFSET
            )
            diff = c[None, :] - levels * s[:, None]
            err = tl.where(f_ok, tl.sum(tl.where(in_band[None, :], diff * diff, 0.0), axis=1), float("inf"))
            # the first (largest) candidate among equal errors, as the reference's argmin
            best = tl.min(tl.where(err == tl.min(err, axis=0), fi, BLOCK_F), axis=0)
            pick = fi == best
            code = tl.sum(tl.where(pick[:, None], codes, 0), axis=0)
            level = tl.sum(tl.where(pick[:, None], levels, 0.0), axis=0)
            scale = tl.sum(tl.where(pick, s, 0.0), axis=0)
        else:
            scale = tl.minimum(absmax, 65504.0).to(tl.float16).to(tl.float32)
            code, level = _grid_code(
                c, scale, grid_ptr, mids_ptr, LUT_OFFSET, BITS, AFFINE, STEP, Z0, GRID_OFFSET
            )
        if UNBIASED:
            # store |c|^2 / <grid[code], c>: no gain bias (codec.py: _unbiased_scale)
            energy = tl.sum(tl.where(in_band, c * c, 0.0), axis=0)
            proj = tl.sum(tl.where(in_band, level * c, 0.0), axis=0)
            proj_ok = proj > 0.0
            ratio = tl.math.div_rn(energy, tl.where(proj_ok, proj, 1.0))
            scale = tl.where(proj_ok, tl.minimum(ratio, 65504.0).to(tl.float16).to(tl.float32), scale)
        code = tl.where(mask_and(in_band, row_finite), code, 0)
        # pack: band coefficients g*PER_BYTE .. g*PER_BYTE + PER_BYTE - 1 form the band's byte g
        PER_BYTE: tl.constexpr = 8 // BITS
        grouped = tl.reshape(code, (BLOCK_S // PER_BYTE, PER_BYTE))
        shifts = tl.arange(0, PER_BYTE) * BITS
        packed = tl.sum(grouped << shifts[None, :], axis=1)
        g = tl.arange(0, BLOCK_S // PER_BYTE)
        in_bytes = mask_and(g < SIZE // PER_BYTE, row_ok)
        tl.store(code_base + BYTE_OFFSET + g, packed.to(tl.uint8), mask=in_bytes)
        tl.store(scale_base + BAND, tl.where(row_finite, scale, float("nan")).to(tl.float16), mask=row_ok)

    @triton.jit
    def _tile_candidate_error(
        c,
        absmax,
        in_band,
        fi,
        grid_ptr,
        mids_ptr,
        frac_ptr,
        LUT_OFFSET: tl.constexpr,
        BITS: tl.constexpr,
        AFFINE: tl.constexpr,
        STEP: tl.constexpr,
        Z0: tl.constexpr,
        GRID_OFFSET: tl.constexpr,
    ):
        # (squared error [BLOCK_T], scale [BLOCK_T]) of coding c [BLOCK_T, BLOCK_S] with candidate fi
        f = tl.load(frac_ptr + fi)
        s = tl.minimum(absmax * f, 65504.0).to(tl.float16).to(tl.float32)
        _, lv = _grid_code(c, s[:, None], grid_ptr, mids_ptr, LUT_OFFSET, BITS, AFFINE, STEP, Z0, GRID_OFFSET)
        diff = c - lv * s[:, None]
        return tl.sum(tl.where(in_band[None, :], diff * diff, 0.0), axis=1), s

    @triton.jit
    def _encode_band_tile(
        c,
        row_ok,
        row_finite,
        code_base,
        scale_base,
        grid_ptr,
        mids_ptr,
        frac_ptr,
        BLOCK_T: tl.constexpr,
        N_FRACTIONS: tl.constexpr,
        BAND: tl.constexpr,
        SIZE: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BITS: tl.constexpr,
        BYTE_OFFSET: tl.constexpr,
        LUT_OFFSET: tl.constexpr,
        MSE: tl.constexpr,
        UNBIASED: tl.constexpr,
        AFFINE: tl.constexpr,
        STEP: tl.constexpr,
        Z0: tl.constexpr,
        GRID_OFFSET: tl.constexpr,
    ):
        # BLOCK_T vectors' band c [BLOCK_T, BLOCK_S]; the scale candidates in a runtime loop.
        i = tl.arange(0, BLOCK_S)
        in_band = i < SIZE
        absmax = tl.max(tl.where(in_band[None, :], tl.abs(c), 0.0), axis=1)
        if MSE:
            # A runtime loop that keeps only each row's best error and scale; the codes are made
            # once after it, from that scale (the same arithmetic, so the same codes). Unrolled,
            # with [BLOCK_T, BLOCK_S] codes and levels carried through every candidate, the affine
            # variant compiled (sm_90, D = 128) to ~35k instructions and 23 KB of spills per
            # thread; table lookups unrolled 16 times compiled for minutes.
            best_err, scale = _tile_candidate_error(
                c, absmax, in_band, 0, grid_ptr, mids_ptr, frac_ptr, LUT_OFFSET, BITS, AFFINE, STEP, Z0,
                GRID_OFFSET,
            )  # fmt: skip
            for fi in tl.range(1, N_FRACTIONS, loop_unroll_factor=1):
                err, s = _tile_candidate_error(
                    c, absmax, in_band, fi, grid_ptr, mids_ptr, frac_ptr, LUT_OFFSET, BITS, AFFINE, STEP,
                    Z0, GRID_OFFSET,
                )  # fmt: skip
                better = err < best_err  # strict: the first (largest) candidate wins ties
                best_err = tl.where(better, err, best_err)
                scale = tl.where(better, s, scale)
        else:
            scale = tl.minimum(absmax, 65504.0).to(tl.float16).to(tl.float32)
        code, level = _grid_code(
            c, scale[:, None], grid_ptr, mids_ptr, LUT_OFFSET, BITS, AFFINE, STEP, Z0, GRID_OFFSET
        )
        if UNBIASED:
            energy = tl.sum(tl.where(in_band[None, :], c * c, 0.0), axis=1)
            proj = tl.sum(tl.where(in_band[None, :], level * c, 0.0), axis=1)
            proj_ok = proj > 0.0
            ratio = tl.math.div_rn(energy, tl.where(proj_ok, proj, 1.0))
            scale = tl.where(proj_ok, tl.minimum(ratio, 65504.0).to(tl.float16).to(tl.float32), scale)
        code = tl.where(in_band[None, :] & row_finite[:, None], code, 0)
        PER_BYTE: tl.constexpr = 8 // BITS
        grouped = tl.reshape(code, (BLOCK_T, BLOCK_S // PER_BYTE, PER_BYTE))
        shifts = tl.arange(0, PER_BYTE) * BITS
        packed = tl.sum(grouped << shifts[None, None, :], axis=2)
        g = tl.arange(0, BLOCK_S // PER_BYTE)
        tl.store(
            code_base[:, None] + BYTE_OFFSET + g[None, :],
            packed.to(tl.uint8),
            mask=row_ok[:, None] & (g < SIZE // PER_BYTE)[None, :],
        )
        tl.store(scale_base + BAND, tl.where(row_finite, scale, float("nan")).to(tl.float16), mask=row_ok)

    @triton.jit
    def _encode_band(
        c,
        row_ok,
        row_finite,
        code_base,
        scale_base,
        grid_ptr,
        mids_ptr,
        frac_ptr,
        VEC: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_F: tl.constexpr,
        N_FRACTIONS: tl.constexpr,
        BAND: tl.constexpr,
        SIZE: tl.constexpr,
        BLOCK_S: tl.constexpr,
        BITS: tl.constexpr,
        BYTE_OFFSET: tl.constexpr,
        LUT_OFFSET: tl.constexpr,
        MSE: tl.constexpr,
        UNBIASED: tl.constexpr,
        AFFINE: tl.constexpr,
        STEP: tl.constexpr,
        Z0: tl.constexpr,
        GRID_OFFSET: tl.constexpr,
    ):
        if VEC:
            _encode_band_vec(
                c, row_ok, row_finite, code_base, scale_base, grid_ptr, mids_ptr, frac_ptr, BLOCK_F,
                N_FRACTIONS, BAND, SIZE, BLOCK_S, BITS, BYTE_OFFSET, LUT_OFFSET, MSE, UNBIASED, AFFINE,
                STEP, Z0, GRID_OFFSET,
            )  # fmt: skip
        else:
            _encode_band_tile(
                c, row_ok, row_finite, code_base, scale_base, grid_ptr, mids_ptr, frac_ptr, BLOCK_T,
                N_FRACTIONS, BAND, SIZE, BLOCK_S, BITS, BYTE_OFFSET, LUT_OFFSET, MSE, UNBIASED, AFFINE,
                STEP, Z0, GRID_OFFSET,
            )  # fmt: skip

    @triton.jit
    def _kv_compress_kernel(
        x_ptr,
        cs_ptr,
        off_ptr,
        rot_ptr,
        w_ptr,
        grid_ptr,
        mids_ptr,
        frac_ptr,
        codes_ptr,
        scales_ptr,
        exact_ptr,
        pos_ptr,
        T,
        S,
        sxb,
        sxh,
        sxt,
        sxd,
        scsh,
        scsd,
        srh,
        sri,
        srj,
        scb,
        sch,
        sct,
        ssb,
        ssh,
        sst,
        seb,
        seh,
        set_,
        sed,
        spb,
        spt,
        H: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
        VEC: tl.constexpr,
        B0_START: tl.constexpr,
        B0_SIZE: tl.constexpr,
        B0_BLOCK_S: tl.constexpr,
        B0_BITS: tl.constexpr,
        B0_BYTE_OFFSET: tl.constexpr,
        B0_LUT_OFFSET: tl.constexpr,
        B0_MSE: tl.constexpr,
        B0_UNBIASED: tl.constexpr,
        B0_AFFINE: tl.constexpr,
        B0_STEP: tl.constexpr,
        B0_Z0: tl.constexpr,
        B0_GRID_OFFSET: tl.constexpr,
        B1_START: tl.constexpr,
        B1_SIZE: tl.constexpr,
        B1_BLOCK_S: tl.constexpr,
        B1_BITS: tl.constexpr,
        B1_BYTE_OFFSET: tl.constexpr,
        B1_LUT_OFFSET: tl.constexpr,
        B1_MSE: tl.constexpr,
        B1_UNBIASED: tl.constexpr,
        B1_AFFINE: tl.constexpr,
        B1_STEP: tl.constexpr,
        B1_Z0: tl.constexpr,
        B1_GRID_OFFSET: tl.constexpr,
        B2_START: tl.constexpr,
        B2_SIZE: tl.constexpr,
        B2_BLOCK_S: tl.constexpr,
        B2_BITS: tl.constexpr,
        B2_BYTE_OFFSET: tl.constexpr,
        B2_LUT_OFFSET: tl.constexpr,
        B2_MSE: tl.constexpr,
        B2_UNBIASED: tl.constexpr,
        B2_AFFINE: tl.constexpr,
        B2_STEP: tl.constexpr,
        B2_Z0: tl.constexpr,
        B2_GRID_OFFSET: tl.constexpr,
        B3_START: tl.constexpr,
        B3_SIZE: tl.constexpr,
        B3_BLOCK_S: tl.constexpr,
        B3_BITS: tl.constexpr,
        B3_BYTE_OFFSET: tl.constexpr,
        B3_LUT_OFFSET: tl.constexpr,
        B3_MSE: tl.constexpr,
        B3_UNBIASED: tl.constexpr,
        B3_AFFINE: tl.constexpr,
        B3_STEP: tl.constexpr,
        B3_Z0: tl.constexpr,
        B3_GRID_OFFSET: tl.constexpr,
        N_BANDS: tl.constexpr,
        N_FRACTIONS: tl.constexpr,
        BLOCK_F: tl.constexpr,
        HAS_CS: tl.constexpr,
        HAS_OFFSET: tl.constexpr,
        MODE: tl.constexpr,
        HAS_POS: tl.constexpr,
        WRITE_EXACT: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
    ):
        # MODE: 0 no transform, 1 rotation R only, 2 fixed W only, 3 R then W (c = W R y)
        if VEC:  # one vector per program
            pid = tl.program_id(0)
            t = pid % T
            bh = pid // T
            t_ok = t < T
        else:  # BLOCK_T tokens of one (b, h) per program
            t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
            bh = tl.program_id(1)
            t_ok = t < T
        b = bh // H
        h = bh % H
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        m_row = off_ptr + h * scsh
        s_row = cs_ptr + h * scsh
        if VEC:
            x_row = x_ptr + b * sxb + h * sxh + t * sxt
            cols = d
            cols_ok = d_ok
            rows_ok = t_ok
        else:
            x_row = x_ptr + b * sxb + h * sxh + t[:, None] * sxt
            cols = d[None, :]
            cols_ok = t_ok[:, None] & d_ok[None, :]
            rows_ok = t_ok[:, None]
        if MODE == 1:
            mat_ptr = rot_ptr + h * srh
            s_mi = sri
            s_mj = srj
        else:
            mat_ptr = w_ptr
            s_mi = D
            s_mj = 1

        # every band's coefficients first: a vector with any non-finite coefficient is stored as
        # codes 0 and NaN scales in every band (codec.py)
        if VEC or MODE == 0:
            y = _load_y(x_row, sxd, m_row, s_row, scsd, cols, cols_ok, HAS_OFFSET, HAS_CS)
            if MODE == 3:  # rotate first (z = R y), then each band takes its rows of W
                rot = tl.load(
                    rot_ptr + h * srh + d[:, None] * sri + d[None, :] * srj,
                    mask=d_ok[:, None] & d_ok[None, :],
                    other=0.0,
                )
                y = tl.sum(rot * y[None, :], axis=1)
            if N_BANDS > 0:
                c0 = _band_coeffs(
                    y, rows_ok, x_row, sxd, m_row, s_row, scsd, mat_ptr, s_mi, s_mj, VEC, B0_START,
                    B0_SIZE, B0_BLOCK_S, D, BLOCK_D, MODE, HAS_OFFSET, HAS_CS,
                )  # fmt: skip
            if N_BANDS > 1:
                c1 = _band_coeffs(
                    y, rows_ok, x_row, sxd, m_row, s_row, scsd, mat_ptr, s_mi, s_mj, VEC, B1_START,
                    B1_SIZE, B1_BLOCK_S, D, BLOCK_D, MODE, HAS_OFFSET, HAS_CS,
                )  # fmt: skip
            if N_BANDS > 2:
                c2 = _band_coeffs(
                    y, rows_ok, x_row, sxd, m_row, s_row, scsd, mat_ptr, s_mi, s_mj, VEC, B2_START,
                    B2_SIZE, B2_BLOCK_S, D, BLOCK_D, MODE, HAS_OFFSET, HAS_CS,
                )  # fmt: skip
            if N_BANDS > 3:
                c3 = _band_coeffs(
                    y, rows_ok, x_row, sxd, m_row, s_row, scsd, mat_ptr, s_mi, s_mj, VEC, B3_START,
                    B3_SIZE, B3_BLOCK_S, D, BLOCK_D, MODE, HAS_OFFSET, HAS_CS,
                )  # fmt: skip
        else:
            c0, c1, c2, c3 = _tile_coeffs(
                rows_ok, x_row, sxd, m_row, s_row, scsd, mat_ptr, s_mi, s_mj, rot_ptr + h * srh, sri, srj,
                BLOCK_T, D, BLOCK_D, BLOCK_K, MODE, HAS_OFFSET, HAS_CS, N_BANDS, B0_START, B0_SIZE,
                B0_BLOCK_S, B1_START, B1_SIZE, B1_BLOCK_S, B2_START, B2_SIZE, B2_BLOCK_S, B3_START, B3_SIZE,
                B3_BLOCK_S,
            )  # fmt: skip
        n_bad = 0
        if N_BANDS > 0:
            n_bad += _n_non_finite(c0, VEC)
        if N_BANDS > 1:
            n_bad += _n_non_finite(c1, VEC)
        if N_BANDS > 2:
            n_bad += _n_non_finite(c2, VEC)
        if N_BANDS > 3:
            n_bad += _n_non_finite(c3, VEC)
        row_finite = n_bad == 0
        if VEC:
            keep = row_finite
        else:
            keep = row_finite[:, None]

        if HAS_POS:
            p = tl.load(pos_ptr + b * spb + t * spt, mask=t_ok, other=0).to(tl.int64)
            row_ok = t_ok & (p >= 0) & (p < S)
        else:
            p = t.to(tl.int64)
            row_ok = t_ok
        code_base = codes_ptr + b * scb + h * sch + p * sct
        scale_base = scales_ptr + b * ssb + h * ssh + p * sst
        if N_BANDS > 0:
            _encode_band(
                tl.where(keep, c0, 0.0), row_ok, row_finite, code_base, scale_base, grid_ptr, mids_ptr,
                frac_ptr, VEC, BLOCK_T, BLOCK_F, N_FRACTIONS, 0, B0_SIZE, B0_BLOCK_S, B0_BITS,
                B0_BYTE_OFFSET, B0_LUT_OFFSET, B0_MSE, B0_UNBIASED, B0_AFFINE, B0_STEP, B0_Z0,
                B0_GRID_OFFSET,
            )  # fmt: skip
        if N_BANDS > 1:
            _encode_band(
                tl.where(keep, c1, 0.0), row_ok, row_finite, code_base, scale_base, grid_ptr, mids_ptr,
                frac_ptr, VEC, BLOCK_T, BLOCK_F, N_FRACTIONS, 1, B1_SIZE, B1_BLOCK_S, B1_BITS,
                B1_BYTE_OFFSET, B1_LUT_OFFSET, B1_MSE, B1_UNBIASED, B1_AFFINE, B1_STEP, B1_Z0,
                B1_GRID_OFFSET,
            )  # fmt: skip
        if N_BANDS > 2:
            _encode_band(
                tl.where(keep, c2, 0.0), row_ok, row_finite, code_base, scale_base, grid_ptr, mids_ptr,
                frac_ptr, VEC, BLOCK_T, BLOCK_F, N_FRACTIONS, 2, B2_SIZE, B2_BLOCK_S, B2_BITS,
                B2_BYTE_OFFSET, B2_LUT_OFFSET, B2_MSE, B2_UNBIASED, B2_AFFINE, B2_STEP, B2_Z0,
                B2_GRID_OFFSET,
            )  # fmt: skip
        if N_BANDS > 3:
            _encode_band(
                tl.where(keep, c3, 0.0), row_ok, row_finite, code_base, scale_base, grid_ptr, mids_ptr,
                frac_ptr, VEC, BLOCK_T, BLOCK_F, N_FRACTIONS, 3, B3_SIZE, B3_BLOCK_S, B3_BITS,
                B3_BYTE_OFFSET, B3_LUT_OFFSET, B3_MSE, B3_UNBIASED, B3_AFFINE, B3_STEP, B3_Z0,
                B3_GRID_OFFSET,
            )  # fmt: skip

        if WRITE_EXACT:  # exact copies of x - m (docs/CONTRACTS.md: sinks and the recent ring)
            x_ex = _load_y(x_row, sxd, m_row, s_row, scsd, cols, cols_ok, HAS_OFFSET, False)
            x_ex = x_ex.to(exact_ptr.dtype.element_ty)
            ex_base = exact_ptr + b * seb + h * seh
            if SINKS > 0:
                sink_ok = row_ok & (p < SINKS)
                if VEC:
                    tl.store(ex_base + p * set_ + d * sed, x_ex, mask=mask_and(d_ok, sink_ok))
                else:
                    ptrs = ex_base + p[:, None] * set_ + d[None, :] * sed
                    tl.store(ptrs, x_ex, mask=sink_ok[:, None] & d_ok[None, :])
            if WINDOW > 0:
                ring_ok = row_ok & (t >= T - WINDOW)
                slot = SINKS + p % WINDOW
                if VEC:
                    tl.store(ex_base + slot * set_ + d * sed, x_ex, mask=mask_and(d_ok, ring_ok))
                else:
                    ptrs = ex_base + slot[:, None] * set_ + d[None, :] * sed
                    tl.store(ptrs, x_ex, mask=ring_ok[:, None] & d_ok[None, :])


MAX_KERNEL_BANDS = 4
# Prefill (tile path): channels of the transform's input per tl.dot step (_tile_coeffs).
PREFILL_BLOCK_K = 16
# Chunks shorter than this take the one-program-per-vector path (decode steps, short verifies).
VEC_MAX_T = 16
_BAND_FIELDS = (
    "START",
    "SIZE",
    "BLOCK_S",
    "BITS",
    "BYTE_OFFSET",
    "LUT_OFFSET",
    "MSE",
    "UNBIASED",
    "AFFINE",
    "STEP",
    "Z0",
    "GRID_OFFSET",
)


def grid_affine(grid: list[float]) -> tuple[bool, float, float]:
    """Is grid[v] == offset + step * v for every code v (to fp32 precision)? -> (affine, step, offset)."""
    n = len(grid)
    offset, step = grid[0], (grid[-1] - grid[0]) / (n - 1)
    tol = 1e-6 * max(1.0, max(abs(g) for g in grid))
    affine = step > 0 and all(abs(g - (offset + step * v)) <= tol for v, g in enumerate(grid))
    return affine, step, offset


def _band_constants(codec, lut_offsets: list[int], vec: bool) -> dict[str, int | bool | float]:
    """Per-band constexprs B{i}_* for up to MAX_KERNEL_BANDS bands (Triton wants scalars here)."""
    if codec.n_bands > MAX_KERNEL_BANDS:
        raise ValueError(
            f"the Triton compress kernel handles up to {MAX_KERNEL_BANDS} bands, this codec has "
            f"{codec.n_bands}; "
            "use the reference implementation (ops.set_backend('reference')) or fewer bands"
        )
    out: dict[str, int | bool | float] = {}
    for i in range(MAX_KERNEL_BANDS):
        values: tuple = (0, 0, 4, 8, 0, 0, False, False, False, 0.0, 0.0, 0.0)  # unused slot
        if i < codec.n_bands:
            band, rule = codec.bands[i], codec.scale_rules[i]
            affine, step, offset = grid_affine(codec.grids[i].tolist())
            # tl.dot (tile path) needs >= 16 columns; the vector path only whole bytes (>= 4)
            block_s = max(16 if not vec else 4, _next_pow2(band.size))
            values = (
                band.start,
                band.size,
                block_s,
                band.bits,
                codec.band_byte_offsets[i],
                lut_offsets[i],
                rule.startswith("mse"),
                rule.endswith("-ub"),
                affine,
                float(step) if affine else 0.0,
                float(-offset / step - 0.5) if affine else 0.0,
                float(offset) if affine else 0.0,
            )
        out.update({f"B{i}_{name}": v for name, v in zip(_BAND_FIELDS, values, strict=True)})
    return out


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _block_t(t: int, block_d: int) -> int:
    # tl.dot needs >= 16 rows; cap rows so [BLOCK_T, BLOCK_D] tiles stay modest in registers.
    cap = 64 if block_d <= 64 else 32
    return max(16, min(cap, _next_pow2(t)))


def transform_mode(codec, has_rotation: bool) -> int:
    """0: no transform, 1: rotation only, 2: fixed W only, 3: rotation then W."""
    w_identity = codec.config.wavelet == "identity" or codec.levels == 0
    return (1 if has_rotation else 0) + (0 if w_identity else 2)


def launch_config(codec, x: torch.Tensor, channel_scale: torch.Tensor, exact: bool, positions: bool) -> dict:
    """The constexprs and launch shape of one call (also what an offline compile check needs).
    The returned dict is shared between calls of the same shapes: read it, do not modify it."""
    b, h, t, d = x.shape
    scale, offset, rotation = channel_params(channel_scale, h, d)
    return _launch_config(
        codec, (b, h, t, d), scale is not None, offset is not None, rotation is not None, exact, positions
    )


@functools.lru_cache(maxsize=512)
def _launch_config(
    codec, shape: tuple, has_scale: bool, has_offset: bool, has_rotation: bool, exact: bool, positions: bool
) -> dict:
    # cached per shape: building the band constants per call cost ~40 us of Python on this
    # project's CPU machine (several times that on the GPU machine's host), every decode step
    b, h, t, d = shape
    lut_offsets, off = [], 0
    for band in codec.bands:
        lut_offsets.append(off)
        off += 2**band.bits
    vec = t < VEC_MAX_T
    block_d = _next_pow2(max(d, 16))
    block_t = 1 if vec else _block_t(t, block_d)
    n_fractions = int(codec.scale_fractions.numel())
    constexprs = dict(
        H=h,
        D=d,
        BLOCK_D=block_d,
        BLOCK_T=block_t,
        BLOCK_K=PREFILL_BLOCK_K,
        VEC=vec,
        **_band_constants(codec, lut_offsets, vec),
        N_BANDS=codec.n_bands,
        N_FRACTIONS=n_fractions,
        BLOCK_F=_next_pow2(n_fractions),
        HAS_CS=has_scale,
        HAS_OFFSET=has_offset,
        MODE=transform_mode(codec, has_rotation),
        HAS_POS=positions,
        WRITE_EXACT=exact,
        SINKS=codec.config.sinks if exact else 0,
        WINDOW=codec.config.window if exact else 0,
    )
    grid = (b * h * t,) if vec else (triton.cdiv(t, block_t), b * h)
    return {"grid": grid, "constexprs": constexprs, "num_warps": 4}


def _launch(
    codec,
    x: torch.Tensor,
    channel_scale: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    exact: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the reference implementation")
    b, h, t, d = x.shape
    if t == 0 or b * h == 0:
        return
    device = x.device
    # device copies of W and the tables are cached per device: nothing is copied per launch, so the
    # launch can be captured in a CUDA graph
    w, grids, mids, fractions = codec.device_tables(device)
    scale, offset, rotation = channel_params(channel_scale, h, d)
    # channel parameters are read in place through their strides (fp32 avoids a conversion copy)
    if scale is not None and offset is not None and scale.stride() != offset.stride():
        scale, offset = scale.contiguous(), offset.contiguous()
    scale2 = w if scale is None else scale.float()
    offset2 = w if offset is None else offset.float()
    if scale is not None and offset is not None and scale2.stride() != offset2.stride():
        scale2, offset2 = scale2.contiguous(), offset2.contiguous()
    ref = scale2 if scale is not None else offset2
    cs_args = (scale2, ref.stride(0), ref.stride(2)) if ref is not w else (scale2, 0, 0)
    rot = w.unsqueeze(0) if rotation is None else rotation.float()
    if exact is None:
        exact_args = (codes, 0, 0, 0, 0)
    else:
        exact_args = (exact, *exact.stride())
    if positions is None:
        pos_args = (codes, 0, 0)
        s_len = t
    else:
        pos_args = (positions, positions.stride(0), positions.stride(1))
        s_len = codes.shape[2]
    cfg = _launch_config(
        codec,
        (b, h, t, d),
        scale is not None,
        offset is not None,
        rotation is not None,
        exact is not None,
        positions is not None,
    )
    launch(
        _kv_compress_kernel,
        cfg["grid"],
        x,
        cs_args[0],
        offset2,
        rot,
        w,
        grids,
        mids,
        fractions,
        codes,
        scales,
        exact_args[0],
        pos_args[0],
        t,
        s_len,
        *x.stride(),
        cs_args[1],
        cs_args[2],
        *rot.stride(),
        codes.stride(0),
        codes.stride(1),
        codes.stride(2),
        scales.stride(0),
        scales.stride(1),
        scales.stride(2),
        *exact_args[1:],
        pos_args[1],
        pos_args[2],
        num_warps=cfg["num_warps"],
        **cfg["constexprs"],
    )


def compress_triton(codec, x: torch.Tensor, channel_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton compress; same contract as compress_reference."""
    if x.dim() < 3:
        raise ValueError(f"x must be [..., Hkv, T, D], got shape {tuple(x.shape)}")
    _check_float(x, "x")
    if x.shape[-1] != codec.head_dim:
        raise ValueError(f"x head_dim {x.shape[-1]} != codec head_dim {codec.head_dim}")
    lead = x.shape[:-3]
    x4 = x.reshape(-1, *x.shape[-3:])
    b, h, t, _ = x4.shape
    codes = torch.empty(b, h, t, codec.n_code_bytes, dtype=torch.uint8, device=x.device)
    scales = torch.empty(b, h, t, codec.n_bands, dtype=torch.float16, device=x.device)
    _launch(codec, x4, channel_scale, codes, scales, None, None)
    return codes.reshape(*lead, h, t, -1), scales.reshape(*lead, h, t, -1)


def compress_into_cache_triton(
    codec,
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
) -> None:
    """Triton cache write; same contract as compress_into_cache_reference, except that positions
    outside [0, S) are dropped instead of raising (checking would need a host sync)."""
    pos = check_cache_args(codec, x, codes_cache, scales_cache, exact_cache, positions)
    if codes_cache.stride(3) != 1 or scales_cache.stride(3) != 1:
        raise ValueError("codes_cache and scales_cache need a contiguous last dimension")
    _launch(codec, x, channel_scale, codes_cache, scales_cache, exact_cache, pos)
