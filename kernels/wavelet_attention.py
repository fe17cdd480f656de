"""Decode attention over the wavelet-compressed KV cache: the PyTorch reference, and the fused
kernels' host side (input checks, plans, launches).

Where the parts live: this module holds the compressed layout, the input checks, the reference,
the host plans that map a layout onto kernel constexprs and tables, and the launches
(``wavelet_attention_triton``). The kernels it launches: the prologue, v1 and v2 split and
exact-token kernels in kernels/wavelet_attention_kernels.py, v3's split kernel in
kernels/wavelet_attention_gluon.py (one split a CTA warp: kernels/wavelet_attention_cta.py), the
reduce in kernels/attention_reduce.py; how a code field becomes an fp16 operand in
kernels/attention_fields.py; the launch configs in kernels/attention_config.py.

The compressed format (docs/CONTRACTS.md): a key or value vector x of head_dim D is stored as
coefficients ``c = W R ((x - m) / s)`` (W a D x D orthonormal wavelet matrix; channel parameters:
offset m, smoothing s, per-kv-head rotation R, each optional) cut into contiguous bands; band b
keeps ``bits_b``-bit codes and one fp16 scale per vector, ``c_j ~= grid_b[code_j] * scale_b``.
Beside the codes an ``exact`` cache holds full-precision centred copies (x - m) of the first
``sinks`` positions and, in a ring, the last ``window`` positions.

Why attention can run on coefficients (W R orthonormal):
    q . (k - m_k)  = (W R (q * s_k)) . c_k          -> transform the query once, not every key
    sum_i p_i v_i  = (R^T W^T sum_i p_i c_v,i) * s_v + m_v  -> accumulate coefficients, inverse once
(the key offset shifts every score of a query equally: softmax drops it; the weights sum to 1).

The Triton path (``wavelet_attention_triton``) is three launches (four with v3, below):
  1. prologue: per (sequence, kv head, row block) and chunk of 32 kernel slots, transform the q
     rows of the GQA group (``q_w = M_h (q * s_k) * sm_scale * log2(e)`` with ``M_h = W_slots R_h``
     folded once per channel tensor and cached, see ``query_transform``), stored in fp16 in the
     kernel's slot order;
  2. split kernel (flash-decoding): the compressed positions of each sequence are cut into
     ``num_splits`` ranges, one program (one warp) per (range, sequence, kv head, row block). A
     program reads each compressed token's code bytes once for *all* q heads of the group,
     dequantizes them in registers and keeps an online softmax and a coefficient-domain
     accumulator. Tokens are the key MMAs' M dimension and the few query rows their N (padded to
     8): scores^T = K_field @ q^T; values put slots on M: acc^T += V_field^T @ p^T. One more program
     per (sequence, kv head, row block) handles the exact sink/window tokens in the channel domain;
  3. reduce (kernels/attention_reduce.py): merges the compressed ranges, applies W, R and s once
     (one folded matrix per kv head, see value_transform) and m, merges the exact part under the
     same softmax, writes the output in q's dtype (one program per query row for decode launches,
     whose few rows per program would leave most SMs idle; one per row block for long prefill
     chunks).

Three split kernels decode the codes:

v1 (``_split_kernel``, every layout): code bytes as MMA operands per bit plane; affine grids via the
fp16 magic number (``0x6400 | field`` is ``1024 + field``; one PRMT + LOP3 per pair), value planes
centred to small exact integers before their MMA (the tensor cores' fp32 accumulation over
thousands of tokens would lose the field against the 1024); other grids gather from a
2**bits-entry fp16 table per element (correct, ~4x slower).

v2 (``_split_kernel_v2``, affine grids only): code rows read as int16 elements, one MMA operand
per bit field of the element, ``(x >> 8?) & mask`` in place (one LOP3 per pair, the shift shared by
the fields); keys of narrow chunks (< 16 elements) as byte fields instead, so their MMAs need no
padding; values transposed through ldmatrix.trans on the int16 view (token pairs in one register,
no byte gathers). Token sums (softmax denominator, sum of p * scale) come out of the tensor cores
(ones @ p); accumulators are rescaled only when a running max grows. Field operands are either
magic (default: values centred as in v1) or fp16 subnormals (``field * 2**-24``, no offset and no
subtract, but the value sums then keep the grid offset and cancel against it at the end: measured
1.0e-2 error on one 32k-token split of random codes). On the H200 v2 issues ~17% fewer
instructions per token than v1 yet runs 5-7% slower on large launches: the loop is bound by
latency with ~3 warps per scheduler, not by issue slots or L2 (profiles in
benchmarks/RESULTS.md). The tuned tables keep the measured winners: v1 with one-warp 64-token steps
for large launches, v1 with two-warp 128-token steps for one sequence (0.0285 ms at (1, 32768)
against v2's 0.0296 and one-warp v2's 0.0308-0.0323).

v3 (kernels/wavelet_attention_gluon.py, Gluon, one layout family: head_dim 128 with a 4-bit band
of 64 coefficients then a 2-bit band of 64, affine grids): keys load from global memory straight
into MMA A fragments, value tiles go through cp.async (8-byte copies through L1) and
ldmatrix.trans, the 2-bit band fills each operand with two fields of its 8 int16 elements; exact
tokens in a separate small kernel (``_exact_kernel``). The tuned table runs it on large decode
launches: 0.303 ms at (8, 131072) against v1's 0.370 (benchmarks/RESULTS.md, fifth session).
Where it cannot run (CPU, the interpreter, no Gluon, other layouts) the call runs v1.

Kernel slot order: each kernel visits coefficients in the order its operands are built (fields of
bytes or int16 elements); that permutation (and each field's power of two) is folded into the
rows of W and per-slot factors on the host, so nothing is shuffled in the kernel.

Long prefill chunks appended to a compressed history use the same kernels with several row blocks
(causal per row); the full-precision cache is never materialised.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field, replace

import torch

from . import side_stream as _side
from .attention_fields import MAGIC_OFFSET, SUBNORMAL_UNIT, field_layout
from .fast_launch import interpreting as _interpreting
from .fast_launch import launch
from .kv_codec import channel_params as _codec_channel_params
from .wavelet_attention_kernels import HAS_TRITON  # (Triton is optional: the reference runs anywhere)

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the Triton kernel; the reference takes any head_dim
SUPPORTED_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_KERNEL_BANDS = 4
LOG2E = 1.4426950408889634

# LaunchConfig.phase_clocks (a probe): v3's split programs write int64 globaltimer stamps (ns) into
# this buffer, PHASE_SLOTS a program, program (pid, split) at row pid * num_splits + split. Slots:
# 0 after the PDL wait, 1 after the query's transform, 2-5 after full steps 0, 1, 2 and the last
# (3 onwards share slot 5), 6 after the masked steps, 7 after the epilogue's transform, 8 the SM
# (%smid), 9 the program's full steps. benchmarks/probe_attention.py phases sets and reads it.
PHASE_SLOTS = 10
PHASE_TIMES = 8  # slots 0-7 hold times
PHASE_SM, PHASE_FULL_STEPS = 8, 9
phase_clock_buffer: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------
# the compressed layout as the kernel sees it


@dataclass(frozen=True, eq=False)
class CompressedLayout:
    """What the attention kernel needs to know about the packed format (see docs/CONTRACTS.md).

    transform  [D, D] fp32 orthonormal W (coefficients c = W @ (x / s))
    bands      (start, size, bits) per band, contiguous, in storage order
    grids      2**bits fp32 values per band; coefficient = grid[code] * scale
    sinks, window  exact-token policy of the cache
    key        a string naming the layout (the codec spec), used to cache device tensors
    """

    head_dim: int
    transform: torch.Tensor
    bands: tuple[tuple[int, int, int], ...]
    grids: tuple[tuple[float, ...], ...]
    sinks: int
    window: int
    key: str = ""
    band_byte_offsets: tuple[int, ...] = field(init=False)
    n_code_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        d = self.head_dim
        if tuple(self.transform.shape) != (d, d):
            raise ValueError(f"transform must be [{d}, {d}], got {tuple(self.transform.shape)}")
        offsets, offset, expected_start = [], 0, 0
        for start, size, bits in self.bands:
            if start != expected_start or size <= 0:
                raise ValueError(f"bands must be contiguous and non-empty, got {self.bands}")
            if bits not in (2, 4, 8) or (size * bits) % 8:
                raise ValueError(f"band ({start}, {size}, {bits}): bits must be 2/4/8 and fill whole bytes")
            offsets.append(offset)
            offset += size * bits // 8
            expected_start += size
        if expected_start != d:
            raise ValueError(f"bands cover {expected_start} coefficients, head_dim is {d}")
        if len(self.grids) != len(self.bands) or any(
            len(g) != 2**bits for g, (_, _, bits) in zip(self.grids, self.bands, strict=False)
        ):
            raise ValueError("need one grid of 2**bits values per band")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got {self.sinks}, {self.window}")
        object.__setattr__(self, "band_byte_offsets", tuple(offsets))
        object.__setattr__(self, "n_code_bytes", offset)

    @property
    def n_bands(self) -> int:
        return len(self.bands)

    @property
    def n_exact(self) -> int:
        return self.sinks + self.window

    @property
    def bytes_per_vector(self) -> int:
        return self.n_code_bytes + 2 * self.n_bands


# ------------------------------------------------------------------------------------------------
# input validation (shared by the reference, the Triton path and the op's fake implementation)


def _check_metadata(inputs: tuple[torch.Tensor, ...], layout: CompressedLayout) -> None:
    """The checks that depend on shapes, strides, dtypes and devices only: ``inputs`` are
    check_attention_inputs' ten tensors in its order."""
    q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_channel_scale, v_channel_scale = (
        inputs
    )
    tensors = {
        "q": q,
        "k_codes": k_codes,
        "k_scales": k_scales,
        "v_codes": v_codes,
        "v_scales": v_scales,
        "k_exact": k_exact,
        "v_exact": v_exact,
        "seq_lens": seq_lens,
        "k_channel_scale": k_channel_scale,
        "v_channel_scale": v_channel_scale,
    }
    # an empty channel scale means "no smoothing" and may live anywhere
    devices = {name: t.device for name, t in tensors.items() if t.numel() or "channel" not in name}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"wavelet_attention: all tensors must be on one device, got {listing}")
    if q.dim() != 4:
        raise ValueError(f"q must be [B, Hq, Tq, D], got shape {tuple(q.shape)}")
    batch, hq, tq, d = q.shape
    if d != layout.head_dim:
        raise ValueError(f"q has head_dim {d}, the codec was built for head_dim {layout.head_dim}")
    if q.dtype not in SUPPORTED_Q_DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not supported; use one of {SUPPORTED_Q_DTYPES}")
    if tq < 1:
        raise ValueError("q needs at least one query token (Tq >= 1)")
    if k_codes.dim() != 4 or k_codes.dtype != torch.uint8:
        raise ValueError(
            f"k_codes must be uint8 [B, Hkv, S, n_code_bytes], got {k_codes.dtype} {tuple(k_codes.shape)}"
        )
    _, hkv, capacity, n_bytes = k_codes.shape
    if k_codes.shape[0] != batch:
        raise ValueError(f"k_codes batch {k_codes.shape[0]} != q batch {batch}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    if n_bytes != layout.n_code_bytes:
        raise ValueError(
            f"k_codes last dim {n_bytes} != the codec's n_code_bytes {layout.n_code_bytes} at head_dim {d} "
            "(q's last dim): q and the cache disagree on head_dim or codec"
        )
    want_scales = (batch, hkv, capacity, layout.n_bands)
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if tuple(t.shape) != want_scales or t.dtype != torch.float16:
            raise ValueError(f"{name} must be fp16 {list(want_scales)}, got {t.dtype} {list(t.shape)}")
    if tuple(v_codes.shape) != tuple(k_codes.shape) or v_codes.dtype != torch.uint8:
        raise ValueError(
            f"v_codes must be uint8 {list(k_codes.shape)}, got {v_codes.dtype} {list(v_codes.shape)}"
        )
    want_exact = (batch, hkv, layout.n_exact, d)
    for name, t in (("k_exact", k_exact), ("v_exact", v_exact)):
        if tuple(t.shape) != want_exact:
            raise ValueError(
                f"{name} must be [B, Hkv, sinks + window, D] = {list(want_exact)} "
                f"(sinks={layout.sinks}, window={layout.window}), got {list(t.shape)}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {t.dtype}")
    for name, t in (("k_channel_scale", k_channel_scale), ("v_channel_scale", v_channel_scale)):
        attention_channel_params(t, hkv, d, name, copy=False)  # shape checks only: views, no copies
    if (
        seq_lens.dim() != 1
        or seq_lens.shape[0] != batch
        or seq_lens.is_floating_point()
        or seq_lens.is_complex()
    ):
        raise ValueError(
            f"seq_lens must be an integer [B] = [{batch}] tensor, got {seq_lens.dtype} {list(seq_lens.shape)}"
        )


# Metadata (shapes, strides, dtypes, devices) that passed _check_metadata, with the layout: a decode
# step repeats the same metadata every call, and the checks cost ~20 us of Python here (several
# times that on the GPU machine's host).
_VALID_METADATA: set = set()
_MAX_VALID_METADATA = 1024


def check_attention_inputs(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    seq_lens: torch.Tensor,
    k_channel_scale: torch.Tensor,
    v_channel_scale: torch.Tensor,
    layout: CompressedLayout,
    check_values: bool = True,
) -> None:
    """Raise ValueError naming the problem, before any kernel runs.

    ``check_values`` also reads seq_lens (one device sync on CUDA); it is skipped while a CUDA graph
    is being captured, where a sync is not allowed.
    """
    tensors = (
        q,
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        k_exact,
        v_exact,
        seq_lens,
        k_channel_scale,
        v_channel_scale,
    )
    signature = (layout, tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors))
    try:
        known = signature in _VALID_METADATA
    except TypeError:  # symbolic shapes (tracing, the fake implementation): check, never cache
        known, signature = False, None
    if not known:
        _check_metadata(tensors, layout)
        if signature is not None:
            if len(_VALID_METADATA) >= _MAX_VALID_METADATA:
                _VALID_METADATA.clear()
            _VALID_METADATA.add(signature)
    tq, capacity = q.shape[2], k_codes.shape[2]
    if check_values and not (seq_lens.is_cuda and torch.cuda.is_current_stream_capturing()):
        lens = seq_lens.detach().to("cpu", torch.int64)
        if bool(((lens < tq) | (lens > capacity)).any()):
            bad = [(i, int(n)) for i, n in enumerate(lens.tolist()) if n < tq or n > capacity]
            raise ValueError(
                f"seq_lens must lie in [Tq, capacity] = [{tq}, {capacity}] (they count the {tq} new tokens "
                f"already written to a cache of {capacity} slots); bad (batch, length): {bad[:8]}"
            )


def channel_scale_2d(
    channel_scale: torch.Tensor, hkv: int, d: int, name: str = "channel_scale"
) -> torch.Tensor:
    """[Hkv, D], [1, D] or [D] (or empty for no smoothing) -> fp32 [Hkv, D]."""
    if channel_scale.numel() == 0:
        return torch.ones(hkv, d, dtype=torch.float32, device=channel_scale.device)
    cs = channel_scale.unsqueeze(0) if channel_scale.dim() == 1 else channel_scale
    if cs.dim() != 2 or cs.shape[-1] != d or cs.shape[0] not in (1, hkv) or not cs.is_floating_point():
        raise ValueError(
            f"{name} must be a float [Hkv={hkv}, D={d}], [1, D] or [D] tensor (or empty for none), "
            f"got {channel_scale.dtype} {list(channel_scale.shape)}"
        )
    return cs.to(torch.float32).expand(hkv, d).contiguous()


@dataclass(frozen=True)
class ChannelParams:
    """The per-(layer, kv head) channel parameters of one cache (docs/CONTRACTS.md):
    coefficients c = W R ((x - m) / s). scale [Hkv, D]; offset [Hkv, D] or None;
    rotation [Hkv, D, D] or None (fp32 copies, or views when copy=False)."""

    scale: torch.Tensor
    offset: torch.Tensor | None
    rotation: torch.Tensor | None


_ONES: dict[tuple, torch.Tensor] = {}


def _ones(hkv: int, d: int, device: torch.device) -> torch.Tensor:
    """A cached [Hkv, D] fp32 ones (no scale): no fill kernel per call."""
    key = (hkv, d, str(device))
    if key not in _ONES:
        _ONES[key] = torch.ones(hkv, d, dtype=torch.float32, device=device)
    return _ONES[key]


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on `device` with its last dimension contiguous (the kernels' row reads)."""
    t = t.to(device)
    return t if t.stride(-1) == 1 else t.contiguous()


def attention_channel_params(
    channel_scale: torch.Tensor, hkv: int, d: int, name: str = "channel_scale", copy: bool = True
) -> ChannelParams:
    """Any accepted `channel_scale` form (empty; [D], [1, D], [Hkv, D]: scale; [2, Hkv, D] or
    [2, 1, D]: scale and offset; [Hkv, D + 2, D]: rotation, scale, offset) -> ChannelParams.
    copy=False returns views of `channel_scale` in its dtype (possibly broadcast along Hkv)."""
    if channel_scale.numel() and not channel_scale.is_floating_point():
        raise ValueError(f"{name} must be a float tensor, got {channel_scale.dtype}")
    try:
        scale, offset, rotation = _codec_channel_params(channel_scale, hkv, d)
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None
    scale = _ones(hkv, d, channel_scale.device) if scale is None else scale[:, 0]
    offset = None if offset is None else offset[:, 0]
    if copy:
        scale = scale.to(torch.float32).contiguous()
        offset = None if offset is None else offset.to(torch.float32).contiguous()
        rotation = None if rotation is None else rotation.to(torch.float32).contiguous()
    return ChannelParams(scale=scale, offset=offset, rotation=rotation)


# ------------------------------------------------------------------------------------------------
# reference (pure PyTorch, fp32 math; CPU or CUDA)


def decode_coefficients(codes: torch.Tensor, scales: torch.Tensor, layout: CompressedLayout) -> torch.Tensor:
    """codes uint8 [..., n_code_bytes], scales fp16 [..., n_bands] -> fp32 coefficients [..., D]."""
    parts = []
    for i, ((_, size, bits), offset) in enumerate(zip(layout.bands, layout.band_byte_offsets, strict=True)):
        per_byte = 8 // bits
        packed = codes[..., offset : offset + size // per_byte].to(torch.int32)
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
        idx = ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)
        grid = torch.tensor(layout.grids[i], dtype=torch.float32, device=codes.device)
        parts.append(grid[idx.long()] * scales[..., i : i + 1].float())
    return torch.cat(parts, dim=-1)


def _gather_cache(
    codes: torch.Tensor,
    scales: torch.Tensor,
    exact: torch.Tensor,
    params: ChannelParams,
    seq_len: int,
    layout: CompressedLayout,
) -> torch.Tensor:
    """fp32 [Hkv, seq_len, D] for one sequence, centred (x - m): exact positions from `exact`
    (stored centred), the rest decoded: x - m = (R^T W^T c) * s."""
    coef = decode_coefficients(codes[:, :seq_len], scales[:, :seq_len], layout)
    x = coef @ layout.transform.to(coef.device)
    if params.rotation is not None:
        x = x @ params.rotation.to(x.device)
    x = x * params.scale.to(x.device)[:, None, :]
    pos = torch.arange(seq_len, device=codes.device)
    ring_lo = max(seq_len - layout.window, layout.sinks)
    sink_pos = pos[: min(layout.sinks, seq_len)]
    if sink_pos.numel():
        x[:, sink_pos] = exact[:, sink_pos].float()
    if layout.window > 0 and ring_lo < seq_len:
        ring_pos = pos[ring_lo:]
        x[:, ring_pos] = exact[:, layout.sinks + ring_pos % layout.window].float()
    return x


def wavelet_attention_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    seq_lens: torch.Tensor,
    k_channel_scale: torch.Tensor,
    v_channel_scale: torch.Tensor,
    layout: CompressedLayout,
    sm_scale: float,
) -> torch.Tensor:
    """Decompress each sequence's valid positions and attend in fp32 (causal over the Tq new tokens).

    Materialises one sequence's K/V at a time; meant for CPU, tests and unsupported layouts.
    """
    batch, hq, tq, d = q.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    k_params = attention_channel_params(k_channel_scale, hkv, d, "k_channel_scale")
    v_params = attention_channel_params(v_channel_scale, hkv, d, "v_channel_scale")
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        # centred keys shift each query's scores by the constant q . m_k, which softmax ignores
        k = _gather_cache(k_codes[b], k_scales[b], k_exact[b], k_params, seq_len, layout)
        v = _gather_cache(v_codes[b], v_scales[b], v_exact[b], v_params, seq_len, layout)
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        scores = (q[b].float() @ k.transpose(-1, -2)) * sm_scale  # [Hq, Tq, seq_len]
        limits = seq_len - tq + 1 + torch.arange(tq, device=q.device)
        allowed = torch.arange(seq_len, device=q.device)[None, :] < limits[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        o = torch.softmax(scores, dim=-1) @ v
        if v_params.offset is not None:  # the weights sum to 1: add the value offset once
            o = o + v_params.offset.to(o.device).repeat_interleave(group, dim=0)[:, None, :]
        out[b] = o.to(q.dtype)
    return out


# ------------------------------------------------------------------------------------------------
# host-side plan: how the layout maps onto the kernel's constexprs and small device tensors


class UnsupportedLayout(ValueError):
    """The Triton kernel cannot run this layout; the message says why (callers fall back)."""


@dataclass(frozen=True)
class _KernelBand:
    coef_start: int  # first coefficient (and first kernel slot) of this chunk
    size: int  # coefficients: a power of two >= 16
    bits: int
    byte_offset: int
    scale_index: int  # which of the vector's fp16 scales applies
    affine: bool
    grid_step: float
    grid_offset: float
    grid: tuple[float, ...]

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def n_bytes(self) -> int:
        return self.size // self.per_byte


def _is_affine(grid: tuple[float, ...]) -> tuple[bool, float, float]:
    """grid[v] == offset + step * v for every code v (to fp32 precision)?"""
    offset, step = grid[0], (grid[-1] - grid[0]) / (len(grid) - 1)
    tol = 1e-6 * max(1.0, max(abs(g) for g in grid))
    affine = step != 0 and all(abs(g - (offset + step * v)) <= tol for v, g in enumerate(grid))
    return affine, step, offset


def _kernel_bands(layout: CompressedLayout) -> list[_KernelBand]:
    """Cut each codec band into power-of-two chunks (each bit plane of a chunk is one tl.dot;
    planes narrower than 16 bytes are zero-padded to 16 in the kernel)."""
    if layout.head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedLayout(f"head_dim {layout.head_dim} (the kernel supports {SUPPORTED_HEAD_DIMS})")
    if layout.n_bands > MAX_KERNEL_BANDS:
        raise UnsupportedLayout(f"{layout.n_bands} bands, the kernel handles {MAX_KERNEL_BANDS}")
    chunks = []
    for index, ((start, size, bits), offset) in enumerate(
        zip(layout.bands, layout.band_byte_offsets, strict=True)
    ):
        per_byte = 8 // bits
        affine, step, grid_offset = _is_affine(layout.grids[index])
        remaining, coef, byte = size // per_byte, start, offset  # in bytes
        while remaining:
            chunk_bytes = 1 << (remaining.bit_length() - 1)
            chunks.append(
                _KernelBand(
                    coef,
                    chunk_bytes * per_byte,
                    bits,
                    byte,
                    index,
                    affine,
                    step,
                    grid_offset,
                    tuple(layout.grids[index]),
                )
            )
            remaining -= chunk_bytes
            coef += chunk_bytes * per_byte
            byte += chunk_bytes
    if len(chunks) > MAX_KERNEL_BANDS:
        raise UnsupportedLayout(
            f"bands {layout.bands} need {len(chunks)} power-of-two chunks, "
            f"the kernel handles {MAX_KERNEL_BANDS}"
        )
    return chunks


def _slot_order(chunks: list[_KernelBand]) -> list[int]:
    """Coefficient index held by each kernel slot (see the module docstring)."""
    order = []
    for kb in chunks:
        order += [kb.coef_start + k * kb.per_byte + j for j in range(kb.per_byte) for k in range(kb.n_bytes)]
    return order


@dataclass
class _Plan:
    bands: list[_KernelBand]
    constexprs: dict[str, int]
    transform_slots: torch.Tensor  # [D, D] fp32, row s = W[coefficient held by slot s]
    col_step: torch.Tensor  # [D] fp32: coefficient = scale * step * (mma value + shift)
    col_shift: torch.Tensor  # [D] fp32, keys (MMA value 1024 + field)
    col_vshift: torch.Tensor  # [D] fp32, values (MMA value field - mid, see _plane)
    col_band: torch.Tensor  # [D] int32: kernel band of each slot
    lut: torch.Tensor  # [4 * 256] fp16 grids of table (non-affine) bands


_PLANS: dict[tuple, _Plan] = {}


def _plan(layout: CompressedLayout, device: torch.device) -> _Plan:
    cache_key = (layout.key or id(layout), str(device))
    plan = _PLANS.get(cache_key)
    if plan is not None:
        return plan
    chunks = _kernel_bands(layout)
    d = layout.head_dim
    col_step = torch.ones(d, dtype=torch.float64)
    col_shift = torch.zeros(d, dtype=torch.float64)
    col_vshift = torch.zeros(d, dtype=torch.float64)
    col_band = torch.zeros(d, dtype=torch.int32)
    lut = torch.zeros(MAX_KERNEL_BANDS * 256, dtype=torch.float16)
    constexprs: dict[str, int] = {}
    for i in range(MAX_KERNEL_BANDS):
        if i < len(chunks):
            kb = chunks[i]
            col_band[kb.coef_start : kb.coef_start + kb.size] = i
            if kb.affine:
                # plane j holds code << (bits * j) in place: the MMA sees 1024 + 2**(bits*j) * code
                for j in range(kb.per_byte):
                    plane = slice(kb.coef_start + j * kb.n_bytes, kb.coef_start + (j + 1) * kb.n_bytes)
                    step = kb.grid_step / 2 ** (kb.bits * j)
                    col_step[plane] = step
                    col_shift[plane] = kb.grid_offset / step - MAGIC_OFFSET
                    col_vshift[plane] = kb.grid_offset / step + 2 ** (kb.bits * (j + 1) - 1)
            else:
                lut[i * 256 : i * 256 + len(kb.grid)] = torch.tensor(kb.grid, dtype=torch.float32).half()
            values = (kb.coef_start, kb.size, kb.bits, kb.byte_offset, kb.scale_index, int(kb.affine))
        else:
            values = (0, 0, 8, 0, 0, 0)
        for name, value in zip(("START", "SIZE", "BITS", "BYTE", "SCALE", "AFFINE"), values, strict=True):
            constexprs[f"KB{i}_{name}"] = value
    plan = _Plan(
        bands=chunks,
        constexprs=constexprs,
        transform_slots=layout.transform.to(torch.float32)[_slot_order(chunks)].contiguous().to(device),
        col_step=col_step.float().to(device),
        col_shift=col_shift.float().to(device),
        col_vshift=col_vshift.float().to(device),
        col_band=col_band.to(device),
        lut=lut.to(device),
    )
    _PLANS[cache_key] = plan
    return plan


# ------------------------------------------------------------------------------------------------
# v2 plan: int16 element views, one MMA operand per bit field (see the module docstring)

# how a field becomes an fp16 operand (magic, centred, subnormal) and the PTX that builds it:
# kernels/attention_fields.py


@dataclass(frozen=True)
class _FieldChunk:
    """A power-of-two run of int16 code elements of one band. Values: each bit field of the int16
    elements is one MMA operand of max(n_elems, 16) slots (narrow chunks zero-padded to the MMA's
    16). Keys: the same for chunks of >= 16 elements; narrower chunks are read as bytes instead
    (one operand per field of the 2 * n_elems bytes), which fills the MMA without padding."""

    elem_offset: int  # first int16 element of the chunk in the code row
    n_elems: int
    bits: int
    scale_index: int
    k_slot0: int  # first key slot
    v_slot0: int  # first value slot
    coef_start: int  # coefficient held by field 0 of byte 0
    grid_step: float
    grid_offset: float

    @property
    def v_fields(self) -> int:
        return 16 // self.bits

    @property
    def v_padded(self) -> int:
        return max(self.n_elems, 16)

    @property
    def k_bytes(self) -> bool:
        return self.n_elems < 16

    @property
    def k_fields(self) -> int:
        return 8 // self.bits if self.k_bytes else 16 // self.bits

    @property
    def k_padded(self) -> int:
        return max(2 * self.n_elems, 16) if self.k_bytes else self.n_elems

    def coef_of_byte_field(self, byte: int, bit_offset: int) -> int:
        return self.coef_start + byte * (8 // self.bits) + bit_offset // self.bits

    def v_slots(self):
        """(slot, coefficient, pos) of each value slot: field f of int16 element e."""
        for f in range(self.v_fields):
            _, pos = field_layout(self.bits, f)
            offset = f * self.bits
            for e in range(self.n_elems):
                coef = self.coef_of_byte_field(2 * e + offset // 8, offset % 8)
                yield self.v_slot0 + f * self.v_padded + e, coef, pos

    def k_slots(self):
        """(slot, coefficient, pos) of each key slot."""
        if not self.k_bytes:  # >= 16 elements: the value layout (flat field planes)
            for slot, coef, pos in self.v_slots():
                yield slot - self.v_slot0 + self.k_slot0, coef, pos
            return
        for f in range(self.k_fields):
            for byte in range(2 * self.n_elems):
                pos = f * self.bits
                yield self.k_slot0 + f * self.k_padded + byte, self.coef_of_byte_field(byte, pos), pos


def _field_chunks(layout: CompressedLayout) -> list[_FieldChunk]:
    """Cut the layout into v2 chunks; UnsupportedLayout when v2 cannot run it (v1 then does)."""
    if layout.head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedLayout(f"head_dim {layout.head_dim} (the kernel supports {SUPPORTED_HEAD_DIMS})")
    chunks: list[_FieldChunk] = []
    k_slot = v_slot = 0
    for index, ((start, size, bits), offset) in enumerate(
        zip(layout.bands, layout.band_byte_offsets, strict=True)
    ):
        affine, step, grid_offset = _is_affine(layout.grids[index])
        if not affine:
            raise UnsupportedLayout(f"band {index}: grid is not affine (v2 needs code * step + offset)")
        n_bytes = size * bits // 8
        if offset % 2 or n_bytes % 2:
            raise UnsupportedLayout(
                f"band {index}: bytes [{offset}, {offset + n_bytes}) are not int16-aligned"
            )
        remaining, elem, coef = n_bytes // 2, offset // 2, start
        while remaining:
            n = 1 << (remaining.bit_length() - 1)
            chunk = _FieldChunk(elem, n, bits, index, k_slot, v_slot, coef, step, grid_offset)
            chunks.append(chunk)
            k_slot += chunk.k_fields * chunk.k_padded
            v_slot += chunk.v_fields * chunk.v_padded
            remaining -= n
            elem += n
            coef += 2 * n * (8 // bits)
    if len(chunks) > MAX_KERNEL_BANDS:
        raise UnsupportedLayout(f"{len(chunks)} int16 chunks, the v2 kernel handles {MAX_KERNEL_BANDS}")
    return chunks


@dataclass
class _PlanV2:
    chunks: list[_FieldChunk]
    chunk_constexpr: tuple  # per chunk (see _split_kernel_v2's CHUNKS)
    k_slots: int
    v_slots: int
    transform_slots: torch.Tensor  # [k_slots, D] fp32, row s = W[coefficient of key slot s] (0: padding)
    k_factor: torch.Tensor  # [k_slots]: q slot = (W q)[coef] * qk_scale * k_factor
    k_shift: torch.Tensor  # [k_slots]: per-chunk score offset = sum_s q_slot * k_shift
    slot_chunk: torch.Tensor  # [k_slots] int32
    v_step: torch.Tensor  # [v_slots]: coefficient sum = v_step * (acc + v_shift * sum(p * scale))
    v_shift: torch.Tensor  # [v_slots]
    slot_coef: torch.Tensor  # [v_slots] int32, -1 for padding
    transform: torch.Tensor  # [D, D] fp32 W (the reduce's inverse transform)


@dataclass
class _SlotTables:
    """A slot plan's tables on the host (float64 while filled slot by slot; see _PlanV2)."""

    rows: torch.Tensor  # [k_slots, D]: W's row of each key slot's coefficient
    k_factor: torch.Tensor  # [k_slots]
    k_shift: torch.Tensor  # [k_slots]
    slot_chunk: torch.Tensor  # [k_slots] int32
    v_step: torch.Tensor  # [v_slots]
    v_shift: torch.Tensor  # [v_slots]
    slot_coef: torch.Tensor  # [v_slots] int32, -1 for padding

    @classmethod
    def zeros(cls, k_slots: int, v_slots: int, d: int) -> _SlotTables:
        f64 = dict(dtype=torch.float64)
        return cls(
            rows=torch.zeros(k_slots, d, **f64),
            k_factor=torch.zeros(k_slots, **f64),
            k_shift=torch.zeros(k_slots, **f64),
            slot_chunk=torch.zeros(k_slots, dtype=torch.int32),
            v_step=torch.zeros(v_slots, **f64),
            v_shift=torch.zeros(v_slots, **f64),
            slot_coef=torch.full((v_slots,), -1, dtype=torch.int32),
        )

    def plan(
        self, layout: CompressedLayout, device: torch.device, chunks: list, chunk_constexpr: tuple
    ) -> _PlanV2:
        """The device plan: fp32 tables (int32 maps) on `device`."""
        return _PlanV2(
            chunks=chunks,
            chunk_constexpr=chunk_constexpr,
            k_slots=self.rows.shape[0],
            v_slots=self.v_step.shape[0],
            transform_slots=self.rows.float().contiguous().to(device),
            k_factor=self.k_factor.float().to(device),
            k_shift=self.k_shift.float().to(device),
            slot_chunk=self.slot_chunk.to(device),
            v_step=self.v_step.float().to(device),
            v_shift=self.v_shift.float().to(device),
            slot_coef=self.slot_coef.to(device),
            transform=layout.transform.to(torch.float32).contiguous().to(device),
        )


_PLANS_V2: dict[tuple, _PlanV2] = {}


def _plan_v2(layout: CompressedLayout, device: torch.device, subnormal: bool) -> _PlanV2:
    cache_key = (layout.key or id(layout), str(device), subnormal)
    plan = _PLANS_V2.get(cache_key)
    if plan is not None:
        return plan
    chunks = _field_chunks(layout)
    k_slots = sum(c.k_fields * c.k_padded for c in chunks)
    v_slots = sum(c.v_fields * c.v_padded for c in chunks)
    transform = layout.transform.to(torch.float64)
    t = _SlotTables.zeros(k_slots, v_slots, layout.head_dim)
    # the MMA sees unit * code * 2**pos (subnormal), or 1024 + code * 2**pos (keys) and
    # code * 2**pos - mid (values) in magic mode; coefficient = scale * (offset + step * code)
    unit = SUBNORMAL_UNIT if subnormal else 1.0
    for ci, c in enumerate(chunks):
        t.slot_chunk[c.k_slot0 : c.k_slot0 + c.k_fields * c.k_padded] = ci
        for slot, coef, pos in c.k_slots():
            t.rows[slot] = transform[coef]
            t.k_factor[slot] = c.grid_step / 2**pos
            if subnormal:  # score = scale / unit * (dot + sum_s q_s * k_shift_s)
                t.k_shift[slot] = c.grid_offset * unit * 2**pos / c.grid_step
            else:  # score = scale * (dot + sum_s q_s * k_shift_s)
                t.k_shift[slot] = c.grid_offset * 2**pos / c.grid_step - MAGIC_OFFSET
        for slot, coef, pos in c.v_slots():
            per_value = c.grid_step / (2**pos * unit)
            t.slot_coef[slot] = coef
            t.v_step[slot] = per_value
            if subnormal:
                t.v_shift[slot] = c.grid_offset / per_value
            else:
                t.v_shift[slot] = 2 ** (pos + c.bits - 1) + c.grid_offset / per_value
    chunk_constexpr = tuple(
        (
            c.elem_offset,
            c.n_elems,
            c.bits,
            c.scale_index,
            c.k_slot0,
            c.v_slot0,
            c.v_padded,
            int(c.k_bytes),
            c.k_padded,
        )
        for c in chunks
    )
    plan = t.plan(layout, device, chunks, chunk_constexpr)
    _PLANS_V2[cache_key] = plan
    return plan


# ------------------------------------------------------------------------------------------------
# v3 plan: the Gluon kernel's slots (kernels/wavelet_attention_gluon.py). One layout family: head_dim
# 128, a 4-bit band of 64 coefficients then a 2-bit band of 64, affine grids (the codec's default).
# Each band is 4 MMA operands of 16 slots: the 4-bit band's operand f is field f of its 16 int16
# elements; the 2-bit band's operand o holds field 2o of its 8 elements in slots 0-7 and field
# 2o + 1 in slots 8-15. Keys and values share the slot order (128 slots, no padding).

V3_BANDS = ((0, 64, 4), (64, 64, 2))
V3_MAX_ROWS = 8  # query rows per program: the key MMAs' N


def v3_operand_fields(band: int, operand: int) -> tuple[int, int]:
    """(field of slots 0-7, field of slots 8-15) of operand `operand` of v3 band `band`."""
    return (operand, operand) if band == 0 else (2 * operand, 2 * operand + 1)


def _v3_layout_check(layout: CompressedLayout) -> None:
    if layout.head_dim != 128 or tuple(layout.bands) != V3_BANDS:
        raise UnsupportedLayout(
            f"v3 runs head_dim 128 with bands {V3_BANDS}, "
            f"got head_dim {layout.head_dim}, bands {layout.bands}"
        )
    for index, grid in enumerate(layout.grids):
        if not _is_affine(grid)[0]:
            raise UnsupportedLayout(f"band {index}: grid is not affine (v3 needs code * step + offset)")


def v3_key_pair_element(j: int) -> int:
    """LaunchConfig.key_word_pairs: the 4-bit band's int16 element in key slot j (0-15) of an
    operand. Lane (g, t) of an m16n8k16 A fragment holds slots 2t, 2t + 1 and 2t + 8, 2t + 9;
    giving them elements 4t, 4t + 1 and 4t + 2, 4t + 3 puts its two words side by side in
    memory, for one 8-byte load (the kernel's _pair_elements)."""
    return (j % 8) // 2 * 4 + j % 2 + j // 8 * 2


def _v3_coefficient(start: int, bits: int, offset: int, element: int) -> int:
    """The coefficient of the field at bit `offset` of int16 element `element` of the band that
    starts at coefficient `start` with `bits`-bit codes."""
    byte = 2 * element + offset // 8  # within the band (int16 elements are little-endian)
    return start + byte * (8 // bits) + (offset % 8) // bits


def _plan_v3(layout: CompressedLayout, device: torch.device, key_word_pairs: bool = False) -> _PlanV2:
    """v3's slot maps in _PlanV2's form (the prologue and reduce read them alike; v3 has no
    chunk constexprs: its two bands are fixed). key_word_pairs: the 4-bit band's key slots in
    v3_key_pair_element's order (the value slots keep theirs: values come through shared memory)."""
    cache_key = (layout.key or id(layout), str(device), "v3", key_word_pairs)
    plan = _PLANS_V2.get(cache_key)
    if plan is not None:
        return plan
    _v3_layout_check(layout)
    d = layout.head_dim
    transform = layout.transform.to(torch.float64)
    t = _SlotTables.zeros(d, d, d)
    key_coef = torch.full((d,), -1, dtype=torch.int64)
    for band, (start, size, bits) in enumerate(layout.bands):
        _, step, grid_offset = _is_affine(layout.grids[band])
        n_elems = size * bits // 16
        for operand in range(4):
            fields = v3_operand_fields(band, operand)
            for j in range(16):
                # the 2-bit band's 8 elements appear twice per operand, the second time as field 2o + 1
                field_index = fields[j // n_elems] if n_elems == 8 else fields[0]
                offset = field_index * bits
                _, pos = field_layout(bits, field_index)
                per_value = step / 2**pos
                slot = 16 * (4 * band + operand) + j
                paired = key_word_pairs and n_elems == 16  # (the 2-bit band has one word a lane)
                key_coef[slot] = _v3_coefficient(
                    start, bits, offset, v3_key_pair_element(j) if paired else j % n_elems
                )
                t.rows[slot] = transform[key_coef[slot]]
                # keys: the MMA sees 1024 + code * 2**pos; values: code * 2**pos - mid once centred
                t.k_factor[slot] = per_value
                t.k_shift[slot] = grid_offset / per_value - MAGIC_OFFSET
                t.slot_chunk[slot] = band
                t.v_step[slot] = per_value
                t.v_shift[slot] = 2 ** (pos + bits - 1) + grid_offset / per_value
                t.slot_coef[slot] = _v3_coefficient(start, bits, offset, j % n_elems)
    if sorted(t.slot_coef.tolist()) != list(range(d)) or sorted(key_coef.tolist()) != list(range(d)):
        raise AssertionError("v3 slots must hold every coefficient once")  # a bug in this plan
    plan = t.plan(layout, device, [], ())
    _PLANS_V2[cache_key] = plan
    return plan


# per-layout answers of the support checks: layouts with a key (every op call's) are fixed, and
# the op asks on every call, where host time is the decode budget
_LAYOUT_REASONS: dict[tuple[str, str], str | None] = {}


def _layout_reason(layout: CompressedLayout, which: str, check) -> str | None:
    cache_key = (which, layout.key) if layout.key else None
    if cache_key is not None and cache_key in _LAYOUT_REASONS:
        return _LAYOUT_REASONS[cache_key]
    try:
        check(layout)
        reason = None
    except UnsupportedLayout as exc:
        reason = str(exc)
    if cache_key is not None:
        _LAYOUT_REASONS[cache_key] = reason
    return reason


def _v2_layout_reason(layout: CompressedLayout) -> str | None:
    """None when the v2 kernel can run this layout, else why not."""
    return _layout_reason(layout, "v2", _field_chunks)


def _v2_reason(layout: CompressedLayout, k_codes: torch.Tensor, k_scales: torch.Tensor) -> str | None:
    """None when the v2 kernel can run this layout and these cache strides, else why not."""
    reason = _v2_layout_reason(layout)
    if reason is not None:
        return reason
    if any(st % 2 for st in k_codes.stride()[:3]) or k_codes.data_ptr() % 2:
        return "code cache strides are not int16-aligned"
    return None


# set when the v3 kernel failed to build or launch on this Triton (its Gluon API moves between
# releases): every later call runs v1, and the first failure is reported once as a warning
_V3_FAILURE = ""


def _v3_reason(
    layout: CompressedLayout, k_codes: torch.Tensor, k_scales: torch.Tensor, block_m: int
) -> str | None:
    """None when the Gluon v3 kernel can run this call, else why not (the call then runs v1)."""
    reason = _layout_reason(layout, "v3", _v3_layout_check)
    if reason is not None:
        return reason
    if _V3_FAILURE:
        return _V3_FAILURE
    if _interpreting() or not k_codes.is_cuda:
        return "v3 is a Gluon kernel: CUDA only, no interpreter"
    if torch.cuda.get_device_capability(k_codes.device) < (8, 0):
        return "v3 needs sm_80 or newer (mma.sync m16n8k16, cp.async)"
    if block_m > V3_MAX_ROWS:
        return f"{block_m} query rows per program, v3 handles {V3_MAX_ROWS}"
    if any(st % 2 for st in k_codes.stride()[:3]) or k_codes.data_ptr() % 2:
        return "code cache strides are not int16-aligned"
    if any(st % 2 for st in k_scales.stride()[:3]) or k_scales.data_ptr() % 4:
        return "scale rows are not 4-byte aligned pairs"
    from .wavelet_attention_gluon import gluon_reason  # Gluon only where v3 can run

    return gluon_reason()


def _key_pairs_aligned(k_codes: torch.Tensor, layout: CompressedLayout) -> bool:
    """Whether every 4-bit-band key word pair LaunchConfig.key_word_pairs loads (8 bytes at byte
    8t of the band, t < 4) is 8-byte aligned in this cache."""
    strides = k_codes.stride()[:3]  # uint8 codes: bytes
    return (
        k_codes.data_ptr() % 8 == 0
        and all(st % 8 == 0 for st in strides)
        and layout.band_byte_offsets[0] % 8 == 0
    )


def _band_columns_fit(k_scales: torch.Tensor, v_scales: torch.Tensor, block_m: int) -> bool:
    """Whether LaunchConfig.band_columns can run: a GQA block of at most 4 rows (the MMAs' columns
    4-7 repeat them) and scale rows of exactly two fp16 scales (the kernel's row stride is the key
    scales'), the value scales read as one 4-byte word per token (4-byte aligned rows)."""
    strides = v_scales.stride()[:3]  # fp16 elements
    return (
        block_m <= 4
        and k_scales.stride(2) == 2
        and v_scales.shape[-1] == 2
        and v_scales.stride(-1) == 1
        and v_scales.stride(2) == 2
        and v_scales.data_ptr() % 4 == 0
        and all(st % 2 == 0 for st in strides)
    )


def split_kernel_choice(
    config: LaunchConfig,
    layout: CompressedLayout,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    block_m: int,
) -> str:
    """The split kernel a call runs: the config's where it can run, else v1 (every layout the
    Triton path accepts, and the faster Triton kernel on large launches: v2 is the fallback only
    of configs that ask for v2)."""
    if config.kernel == "v3" and _v3_reason(layout, k_codes, k_scales, block_m) is None:
        return "v3"
    if config.kernel == "v2" and _v2_reason(layout, k_codes, k_scales) is None:
        return "v2"
    return "v1"


def triton_support(layout: CompressedLayout) -> str | None:
    """None when the Triton kernel handles `layout`, else the reason it does not."""
    if not HAS_TRITON:
        return "triton is not installed"
    return _layout_reason(layout, "v1", _kernel_bands)


# the reduce's kernels and sizing: kernels/attention_reduce.py
from .attention_reduce import REDUCE_GEMM_TILE, reduce_split_chunk, uses_reduce_gemm  # noqa: E402

if HAS_TRITON:
    from .attention_reduce import (  # noqa: E402
        _merge_channel_rows_kernel,
        _reduce_kernel,
        _reduce_rows_kernel,
        _transform_heads_kernel,
    )

# launch configurations and launch sizing: kernels/attention_config.py
from .attention_config import (  # noqa: E402
    SMALL_LAUNCH_CONFIGS,
    SMALL_LAUNCH_PROGRAMS,
    TUNED_CONFIGS,
    LaunchConfig,
    SplitPlan,
    _sm_count,
    carveout_split_programs,
    choose_num_splits,
    choose_split_plan,
    default_config,
    exact_carveout,
    query_in_split_apply,
    resident_programs_per_sm,
    split_count,
    v1_fallback,
    value_subnormals_apply,
)


def tuned_config(
    layout: CompressedLayout, head_dim: int, block_m: int, programs: int | None = None
) -> LaunchConfig:
    """The tuned launch config for this layout's grids (affine: v2 could run it) and launch size
    (programs = sequences x kv heads x row blocks; None: a large launch), else the untuned default."""
    grids = "affine" if _v2_layout_reason(layout) is None else "table"
    key = (head_dim, block_m, grids)
    if programs is not None and programs <= SMALL_LAUNCH_PROGRAMS and key in SMALL_LAUNCH_CONFIGS:
        return SMALL_LAUNCH_CONFIGS[key]
    return TUNED_CONFIGS.get(key) or default_config(head_dim, block_m)


V2_MAX_BLOCK_M = 16  # v2 accumulators are [slots, rows] per field: more rows would spill


# Query rows (q heads of a group x new tokens) per program, by size. They are the N dimension of
# the MMAs (padded to 8 by Triton), so small groups waste little.
_BLOCK_M_STEPS = (4, 8, 16, 32, 64)


def _block_m(rows: int) -> int:
    for step in _BLOCK_M_STEPS:
        if rows <= step:
            return step
    return _BLOCK_M_STEPS[-1]


# ------------------------------------------------------------------------------------------------
# the query transform: kernel slot rows of W times the kv head's rotation, cached per channel tensor

# id(channel tensor) -> (weak reference to it, its version, slot rows, composite [Hkv, S, D] fp32).
# The weak reference proves the entry belongs to that very tensor (a freed tensor's id can be
# reused) and drops the entry when the tensor dies.
_COMPOSITES: dict[int, tuple] = {}


def _tensor_version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: never cache them
        return None


def _cached_product(cache: dict, channel_tensor: torch.Tensor, source: torch.Tensor, build) -> torch.Tensor:
    """build() cached while ``channel_tensor`` lives and is not modified in place (its version
    counter) and ``source`` is the same tensor; never stored during CUDA graph capture (a product
    computed there would only run at replay)."""
    version = _tensor_version(channel_tensor)
    key = id(channel_tensor)
    hit = cache.get(key) if version is not None else None
    if hit is not None and hit[0]() is channel_tensor and hit[1] == version and hit[2] is source:
        return hit[3]
    product = build()
    capturing = product.is_cuda and torch.cuda.is_current_stream_capturing()
    if version is not None and not capturing:
        ref = weakref.ref(channel_tensor, lambda _, key=key: cache.pop(key, None))
        cache[key] = (ref, version, source, product)
    return product


_VALUE_COMPOSITES: dict[int, tuple] = {}


def value_transform(
    inverse: torch.Tensor, rotation: torch.Tensor, scale: torch.Tensor, channel_tensor: torch.Tensor
) -> torch.Tensor:
    """[Hkv, D, D] fp32 C_h = W R_h diag(s_h): the reduce's whole way back from coefficient sums to
    centred channels (x - m = (c W R_h) * s_h) as one matrix per kv head, so the reduce reads one
    [D, D] matrix instead of two and runs one product. Computed in fp64, cached like
    query_transform (on the value channel tensor)."""

    def build() -> torch.Tensor:
        composite = torch.matmul(inverse.to(torch.float64), rotation.to(torch.float64))
        return (composite * scale.to(torch.float64)[:, None, :]).float().contiguous()

    return _cached_product(_VALUE_COMPOSITES, channel_tensor, inverse, build)


def fragment_words(matrix: torch.Tensor) -> torch.Tensor:
    """[H, M, K] (M and K multiples of 16) in fp16 as int32 words in the order of the Gluon v3
    kernel's m16n8k16 A fragments: [H, K / 16 column blocks, M / 16 row tiles, 32 lanes, 4 words],
    word w of lane 4g + t in a tile holding rows g + 8 (w % 2) and columns 8 (w // 2) + 2t, + 1 of
    it, so a lane loads a tile's 4 words as 16 contiguous bytes (_fragment_tiles)."""
    h, m, k = matrix.shape
    if m % 16 or k % 16:
        raise ValueError(f"fragment_words needs rows and columns in multiples of 16, got {m} x {k}")
    t = matrix.to(torch.float16)
    # [H, tile, row-hi w0, g, block, column-hi w1, t, half] -> [H, block, tile, g, t, w1, w0, half]
    parts = t.reshape(h, m // 16, 2, 8, k // 16, 2, 4, 2).permute(0, 4, 1, 3, 6, 5, 2, 7)
    words = parts.contiguous().view(torch.int16).view(torch.int32)
    return words.reshape(h, k // 16, m // 16, 32, 4)


_VALUE_SLOT_WORDS: dict[int, tuple] = {}


def value_slot_transform_words(
    inverse: torch.Tensor,
    rotation: torch.Tensor | None,
    slot_coef: torch.Tensor,
    channel_tensor: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """(words, head stride) for LaunchConfig.transform_in_split: per kv head the [D channels, S value
    slots] matrix T[c, j] = (W R_h)[coefficient of slot j, c] (0 for padding slots) in fp16, which
    maps a split's value-slot sums to centred channels before s, as fragment_words: [Hkv, S / 16
    operands, D / 16 row tiles, 32 lanes, 4 words]. One matrix, head stride 0, without a rotation.
    Built in fp64, cached like value_transform (on the value channel tensor)."""

    def build() -> torch.Tensor:
        composite = inverse.to(torch.float64)  # [D coefficients, D channels]
        if rotation is not None:
            composite = torch.matmul(composite, rotation.to(torch.float64))  # [Hkv, D, D]
        heads = composite.reshape(-1, *composite.shape[-2:])
        padding = slot_coef < 0
        rows = heads[:, slot_coef.clamp(min=0).long(), :]  # [H, S, D]
        rows[:, padding] = 0.0
        return fragment_words(rows.transpose(1, 2))  # T: [H, D channels, S slots]

    words = _cached_product(_VALUE_SLOT_WORDS, channel_tensor, slot_coef, build)
    return words, (words.stride(0) if rotation is not None else 0)


_QUERY_SLOT_WORDS: dict[int, tuple] = {}


def query_slot_transform_words(
    slot_rows: torch.Tensor,
    rotation: torch.Tensor | None,
    k_scale: torch.Tensor,
    channel_tensor: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """(words, head stride) for LaunchConfig.query_in_split: per kv head the prologue's [S slots, D
    channels] matrix M_h = W_slots R_h with the key channel scale folded in (M_h diag(s_k,h)), in
    fp16, as fragment_words ([Hkv, D / 16 channel blocks, S / 16 slot tiles, 32 lanes, 4 words]).
    The slots' factors and qk_scale stay out (in fp32 in the kernel): a 2-bit field's factor is
    2**-14 of its step, where fp16 would go subnormal. Built in fp64, cached on the key channel
    tensor."""

    def build() -> torch.Tensor:
        m = slot_rows.to(torch.float64)  # [S, D]
        if rotation is not None:
            m = torch.matmul(m, rotation.to(torch.float64))  # [Hkv, S, D]
        return fragment_words(m * k_scale.to(torch.float64)[:, None, :])

    words = _cached_product(_QUERY_SLOT_WORDS, channel_tensor, slot_rows, build)
    return words, words.stride(0)


def query_transform(
    slot_rows: torch.Tensor, rotation: torch.Tensor | None, channel_tensor: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(M, head stride) with q_slots = M_h (q * s): M_h = W_slots R_h [S, D] fp32 for each kv head
    h (one matrix for all heads, stride 0, without a rotation). Folding R into W once per channel
    tensor lets the prologue run one [rows, D] x [D, S] product instead of two dependent ones
    (measured 13 us of a 44 us call at B = 1 before). Computed in fp64; cached while
    ``channel_tensor`` lives and is not modified in place (its version counter), never during CUDA
    graph capture (the product would only run at replay)."""
    if rotation is None:
        return slot_rows, 0
    composite = _cached_product(
        _COMPOSITES,
        channel_tensor,
        slot_rows,
        lambda: torch.matmul(slot_rows.to(torch.float64), rotation.to(torch.float64)).float().contiguous(),
    )
    return composite, composite.stride(0)


# ------------------------------------------------------------------------------------------------
# the Triton kernels this module launches (v3's split kernel: kernels/wavelet_attention_gluon.py)

if HAS_TRITON:
    from .wavelet_attention_kernels import (  # noqa: E402
        _exact_kernel,
        _prologue_heads_kernel,
        _prologue_kernel,
        _split_kernel,
        _split_kernel_v2,
    )


# _prologue_heads_kernel (LaunchConfig.prologue_tile_rows query rows a program) runs for decode
# launches with at least PROLOGUE_HEADS_MIN_ROWS query rows in all. Measured 2026-12-01 (H200,
# torch.profiler): at B = 8 (32 rows) 4.6 -> 4.7 us and the op no faster, so smaller launches keep
# one program per sequence.
PROLOGUE_HEADS_MIN_ROWS = 64


def exact_chunks(config: LaunchConfig, layout: CompressedLayout) -> tuple[int, int]:
    """(programs per (sequence, kv head, row block), slots each) of the exact-token kernel: the
    config's exact_chunks, in whole EXACT_BLOCK steps, none of them empty."""
    slots = layout.sinks + layout.window
    per_chunk = max(1, -(-slots // max(1, config.exact_chunks)))
    per_chunk = -(-per_chunk // config.exact_block) * config.exact_block
    return max(1, -(-slots // per_chunk)), per_chunk


def _pdl(config: LaunchConfig, device: torch.device) -> bool:
    """Whether this call launches with programmatic dependent launch: the config asks, on a GPU
    that has it (sm_90+), compiled (never under the interpreter)."""
    return (
        config.pdl
        and device.type == "cuda"
        and not _interpreting()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def _dependent(pdl: bool) -> dict:
    """Launch keywords of a kernel that waits in-kernel for the one before it (its PDL constexpr
    makes it call griddepcontrol.wait before any read)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


def _prologue_pdl(pdl: bool, config: LaunchConfig) -> dict:
    """Launch keywords of the prologue: with PDL it lets the split kernel launch at once, and with
    LaunchConfig.prologue_waits it is itself launched early and waits for the kernel before it."""
    if not pdl:
        return {}
    return {"PDL": True, "WAIT": True, "launch_pdl": True} if config.prologue_waits else {"PDL": True}


_SIDE_STREAMS = _side.STREAMS  # the shared second stream (kernels/side_stream.py)
_side_stream = _side.side_stream


def _launch_exact(
    q: torch.Tensor,
    common_exact: tuple,
    parts: tuple[torch.Tensor, ...],
    dims: tuple,
    layout: CompressedLayout,
    config: LaunchConfig,
    chain: bool = False,
    carveout: int = -1,
) -> None:
    """The exact sink/window tokens' partials (slots num_splits onwards, one per exact program:
    exact_chunks) for the v3 split kernel, on the current stream (arguments as for _launch_v3; dims
    end with n_parts and the exact slots per program). chain: launched with PDL right after the
    split kernel (LaunchConfig.exact_in_chain). carveout: its preferred shared-memory carveout in
    percent (attention_config.exact_carveout), -1 for the driver's choice."""
    _, _, m_part, l_part, acc_part = parts
    hkv, group, tq, n_row_blocks, num_splits, _, block_m, d, programs, qk_scale, n_parts, chunk_slots = dims
    chunks = n_parts - num_splits
    launch(
        _exact_kernel,
        (programs, chunks),
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *common_exact,
        m_part,
        l_part,
        acc_part,
        hkv,
        group,
        tq,
        n_row_blocks,
        num_splits,
        n_parts,
        qk_scale,
        D=d,
        BLOCK_M=block_m,
        EXACT_BLOCK=config.exact_block,
        SINKS=layout.sinks,
        WINDOW=layout.window,
        EXACT_SPLIT=common_exact[0].dtype in (torch.float16, torch.bfloat16),
        CHUNK_SLOTS=chunk_slots,
        num_warps=1,
        **({"PDL_CHAIN": True, "launch_pdl": True} if chain else {}),
        **({"CARVEOUT": carveout} if carveout >= 0 and q.is_cuda else {}),
    )


def _phase_clock_buffer(config: LaunchConfig, programs: int, device: torch.device) -> torch.Tensor | None:
    """With config.phase_clocks, phase_clock_buffer checked for a launch of `programs` split
    programs (else None)."""
    if not config.phase_clocks:
        return None
    need = programs * PHASE_SLOTS
    buffer = phase_clock_buffer
    if buffer is None or buffer.dtype != torch.int64 or buffer.numel() < need or buffer.device != device:
        raise ValueError(
            "LaunchConfig.phase_clocks needs wavelet_attention.phase_clock_buffer: an int64 tensor "
            f"on {device} of at least {need} elements (split programs x PHASE_SLOTS)"
        )
    return buffer


def _cache_operands(k_codes, k_scales, v_codes, v_scales) -> tuple:
    """The split kernels' cache arguments: each of the four tensors with its sequence and kv-head
    strides."""
    return tuple(x for t in (k_codes, k_scales, v_codes, v_scales) for x in (t, t.stride(0), t.stride(1)))


def _launch_v3(
    q: torch.Tensor,
    common_exact: tuple,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    seq_lens: torch.Tensor,
    plan2: _PlanV2,
    parts: tuple[torch.Tensor, ...],
    dims: tuple,
    layout: CompressedLayout,
    config: LaunchConfig,
    split_options: dict,
    side: torch.cuda.Stream | None = None,
    carveout: int = -1,
    plan: SplitPlan | None = None,
    value_channels: tuple | None = None,
    query_args: tuple | None = None,
) -> None:
    """The exact-token kernel and the Gluon split kernel v3 (wavelet_attention_triton's v3 branch;
    parts: its qw, qc and partial buffers; dims: its launch sizes, in the order unpacked below).
    value_channels: with config.transform_in_split, (T words, head stride, s, head stride) of
    value_slot_transform_words and the value channel scale. query_args: with config.query_in_split
    (no prologue ran), (q, its 3 strides, M s_k words, head stride, slot factors, slot shifts,
    qk_scale).
    side: a stream ordered after the prologue, to run the exact-token kernel on once the split
    kernel is enqueued (the caller joins it back before the reduce), else None. carveout: the
    exact-token kernel's (_launch_exact). plan: how the splits cut each span (equal splits of
    dims' num_splits when None)."""
    qw, qc, m_part, l_part, acc_part = parts
    hkv, group, tq, n_row_blocks, num_splits, n_qc, block_m, d, programs, qk_scale, n_parts, _ = dims
    if config.value_copies_l2_256b or config.plain_loads_l2_256b or config.tma_rows_unfenced:
        from . import ptx_patches

        ptx_patches.install()  # before the marked kernel compiles
    chain = config.exact_in_chain and _pdl(config, q.device)
    if side is None and not config.exact_in_chain:
        _launch_exact(q, common_exact, parts, dims, layout, config, carveout=carveout)
    if side is not None and config.exact_before_split:
        with torch.cuda.stream(side):
            _launch_exact(q, common_exact, parts, dims, layout, config, carveout=carveout)
    plan = plan or SplitPlan(num_splits)
    # a remainder plan's short splits go out last; split_major_grid: neighbouring blocks take
    # neighbouring programs (kv heads) instead of a program's neighbouring splits
    split_major = plan.split_major or config.split_major_grid
    clocks = _phase_clock_buffer(config, programs * plan.num_splits, q.device)
    if clocks is None:  # unread
        clocks = m_part
    if config.transform_in_split:
        if value_channels is None:
            raise ValueError("transform_in_split needs the value channels' transform (value_channels)")
    else:  # unread: any int32 and fp32 tensors
        value_channels = (plan2.slot_coef, 0, plan2.v_step, 0)
    if config.query_in_split:
        if query_args is None:
            raise ValueError("query_in_split needs the query and its slot transform (query_args)")
    else:  # unread
        query_args = (qw, 0, 0, 0, plan2.slot_coef, 0, plan2.v_step, plan2.v_step, 1.0)
    # what both split kernels take alike: the cache, each operand with its sequence and kv-head
    # strides, the lengths, the value slots' step and shift, and the cache rows' geometry
    cache = _cache_operands(k_codes, k_scales, v_codes, v_scales)
    cache_args = (*cache, seq_lens, plan2.v_step, plan2.v_shift)
    cache_constants = dict(
        CODE_ROW=k_codes.stride(2) // 2,
        E4=layout.band_byte_offsets[0] // 2,
        E2=layout.band_byte_offsets[1] // 2,
        D=d,
        BLOCK_N=config.block_n,
        SINKS=layout.sinks,
        WINDOW=layout.window,
    )
    if config.cta_splits:  # (checked by the caller: cta_splits_reason) a CTA of splits, a warp each
        from . import ptx_patches
        from .wavelet_attention_cta import WARPS, split_kernel_cta

        ptx_patches.install()  # its warp-barrier patch, before the kernel compiles

        _, q_sb, q_sh, _, qt_words, qt_stride, k_factor, k_shift, q_scale = query_args  # (q itself)
        vt_words, vt_stride, v_cs, v_cs_stride = value_channels
        launch(
            split_kernel_cta,
            (programs, -(-plan.num_splits // WARPS)),
            *cache_args,
            vt_words,
            vt_stride,
            v_cs,
            v_cs_stride,
            q,
            q_sb,
            q_sh,
            qt_words,
            qt_stride,
            k_factor,
            k_shift,
            q_scale,
            m_part,
            l_part,
            acc_part,
            hkv,
            plan.num_splits,  # (dims carry the CTAs' partials, one a CTA)
            n_parts,
            clocks,
            **cache_constants,
            TRIGGER_DEPENDENTS=chain,
            VALUE_SUBNORMALS=config.value_subnormals,
            PHASE_CLOCKS=config.phase_clocks,
            num_warps=WARPS,
            **split_options,
            **_dependent(_pdl(config, k_codes.device)),
        )
    else:
        from .wavelet_attention_gluon import split_kernel_v3

        launch(
            split_kernel_v3,
            (programs, num_splits) if split_major else (num_splits, programs),
            qw,
            qc,
            *cache_args,
            plan2.slot_coef,
            *value_channels,
            *query_args,
            m_part,
            l_part,
            acc_part,
            hkv,
            group,
            tq,
            n_row_blocks,
            num_splits,
            n_parts,
            plan.split_num,
            plan.split_den,
            clocks,
            *(
                _tma_row_descriptors(k_codes, v_codes) if config.tma_rows else (seq_lens, seq_lens)
            ),  # else unread
            **cache_constants,
            SCALE_ROW=k_scales.stride(2),
            BLOCK_M=block_m,
            N_QC=n_qc,
            **v3_option_constexprs(config, split_major),
            TRIGGER_DEPENDENTS=chain,
            num_warps=1,
            **split_options,
            **_dependent(_pdl(config, k_codes.device)),
        )
    if config.exact_in_chain:  # in order after the split kernel (beside it with PDL)
        _launch_exact(q, common_exact, parts, dims, layout, config, chain=chain, carveout=carveout)
    if side is not None and not config.exact_before_split:
        with torch.cuda.stream(side):
            _launch_exact(q, common_exact, parts, dims, layout, config, carveout=carveout)


def v3_option_constexprs(config: LaunchConfig, split_major: bool) -> dict:
    """split_kernel_v3's constexprs that follow from `config` (and the grid's order, split_major:
    a remainder plan's or split_major_grid). The launch and benchmarks/sass_attention_v3.py both
    take them from here, so the offline SASS is the launched kernel's. Options added late are
    passed only when on, so the kernels launched without them keep their JIT keys."""
    return dict(
        STAGES=config.num_stages,
        KEYS_VIA_SMEM=config.keys_via_smem,
        KEYS_AHEAD=config.keys_ahead,
        CACHE_TILES=config.cache_tiles,
        P_ONCE=config.convert_p_once,
        LAZY_RESCALE=config.lazy_rescale,
        COPY_LAYOUT_TOKENS=config.copy_layout_tokens,
        VALUE_SCALES_IN_B=config.value_scales_in_b,
        SCORE_OFFSET_IN_MMA=config.score_offset_in_mma,
        P_MOVMATRIX=config.p_movmatrix,
        STEP_ROW_BASE=config.step_row_base,
        ROW_COPIES=config.row_copies,
        KEY_LOADS_L2_256B=config.key_loads_l2_256b,
        KEY_WORD_PAIRS=config.key_word_pairs,
        ZERO_PADDING_P=config.zero_padding_p,
        VALUE_SUBNORMALS=config.value_subnormals,
        PACKED_P_SCALING=config.packed_p_scaling,
        BAND_COLUMNS=config.band_columns,
        VALUE_SCALES_STAGED=config.value_scales_staged,
        COUNTED_STEPS=config.counted_steps,
        TRANSFORM_IN_SPLIT=config.transform_in_split,
        QUERY_IN_SPLIT=config.query_in_split,
        PHASE_CLOCKS=config.phase_clocks,
        PREFETCH_VALUE_ROWS=config.prefetch_value_rows,
        FILL_VALUE_ROWS_L2=config.fill_value_rows_l2,
        VALUE_COPIES_L2_256B=config.value_copies_l2_256b,
        PLAIN_LOADS_L2_256B=config.plain_loads_l2_256b,
        **({"LOADS_BEFORE_WAIT": config.loads_before_pdl_wait} if config.loads_before_pdl_wait else {}),
        **({"SPLIT_MAJOR": True} if split_major else {}),
        **({"TMA_ROWS": True} if config.tma_rows else {}),
        **({"TMA_ROWS_UNFENCED": True} if config.tma_rows_unfenced else {}),
    )


def tma_rows_reason(layout: CompressedLayout, k_codes: torch.Tensor, v_codes: torch.Tensor) -> str | None:
    """None when LaunchConfig.tma_rows can run on these caches, else what stands in the way: the
    kernel reads the default codec's 48-byte rows (the 4-bit band's 32 bytes, then the 2-bit
    band's 16) through a tensor descriptor of every row of a cache in turn, which Hopper's TMA unit
    copies (16-byte aligned, contiguous codes)."""
    needs = [
        (
            layout.n_code_bytes == 48 and tuple(layout.band_byte_offsets) == (0, 32),
            "48-byte code rows, bands at 0 and 32",
        ),
        (
            k_codes.is_cuda and torch.cuda.get_device_capability(k_codes.device)[0] >= 9,
            "a GPU with TMA (sm_90+)",
        ),
        (
            all(c.is_contiguous() and c.data_ptr() % 16 == 0 for c in (k_codes, v_codes)),
            "contiguous, 16-byte aligned codes",
        ),
    ]
    missing = [what for ok, what in needs if not ok]
    return None if not missing else "tma_rows needs " + ", ".join(missing)


def _tma_row_descriptors(k_codes: torch.Tensor, v_codes: torch.Tensor) -> tuple:
    """TMA_ROWS' tensor descriptors: each cache's codes as [rows, 24] int16 (every (sequence, kv
    head)'s rows in turn), [64, 32] blocks (the box's columns 24-31 fall outside: zero-filled)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .wavelet_attention_gluon import TMA_ROWS_LAYOUT

    def rows(codes: torch.Tensor):
        view = codes.view(torch.int16).view(-1, codes.shape[-1] // 2)
        return TensorDescriptor.from_tensor(view, [64, 32], TMA_ROWS_LAYOUT)

    return rows(k_codes), rows(v_codes)


def cta_splits_reason(
    config: LaunchConfig, plan: SplitPlan, shape: tuple, layout: CompressedLayout, k_scales: torch.Tensor
) -> str | None:
    """None when LaunchConfig.cta_splits can run this launch (kernels/wavelet_attention_cta.py
    implements the small-launch config's path only), else what stands in the way. shape: (GQA
    group, new tokens, row blocks, rows a block, head_dim)."""
    from .wavelet_attention_cta import WARPS

    group, tq, n_row_blocks, block_m, d = shape
    num_splits = plan.num_splits
    needs = [
        (config.cta_splits == WARPS, f"{WARPS} splits a CTA (the kernel's warps)"),
        (
            d == 128 and config.block_n == 64 and config.num_stages == 1,
            "head_dim 128, 64-token steps, one stage",
        ),
        (
            group == 4 and tq == 1 and n_row_blocks == 1 and block_m == 4,
            "a GQA group of 4 rows, one new token",
        ),
        (
            config.band_columns and config.query_in_split and config.transform_in_split,
            "band_columns, query_in_split, transform_in_split",
        ),
        (
            config.keys_ahead and config.key_loads_l2_256b and not config.keys_via_smem,
            "keys a step ahead, L2::256B loads",
        ),
        (
            not config.key_word_pairs and not config.row_copies and config.cache_tiles,
            "no key_word_pairs, row_copies; cache_tiles",
        ),
        (
            config.score_offset_in_mma and config.p_movmatrix and config.convert_p_once,
            "score_offset_in_mma, p_movmatrix",
        ),
        (not config.lazy_rescale, "no lazy_rescale"),
        (plan.split_num == 1 and plan.split_den == num_splits and not plan.split_major, "equal splits"),
        (k_scales.stride(2) == 2 and layout.n_bands == 2, "two fp16 scales a row"),
    ]
    missing = [what for ok, what in needs if not ok]
    return "needs " + "; ".join(missing) if missing else None


def wavelet_attention_triton(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    seq_lens: torch.Tensor,
    k_channel_scale: torch.Tensor,
    v_channel_scale: torch.Tensor,
    layout: CompressedLayout,
    sm_scale: float,
    config: LaunchConfig | None = None,
    num_splits: int | SplitPlan | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """The fused kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    Raises ValueError on bad input and UnsupportedLayout when the layout is outside the kernel.
    ``config``/``num_splits`` override the tuned launch parameters (benchmarks and tests):
    ``num_splits`` an int for that many equal splits, or a SplitPlan.
    """
    if not HAS_TRITON:
        raise UnsupportedLayout("triton is not installed")
    if validate:
        check_attention_inputs(
            q,
            k_codes,
            k_scales,
            v_codes,
            v_scales,
            k_exact,
            v_exact,
            seq_lens,
            k_channel_scale,
            v_channel_scale,
            layout,
        )
    reason = triton_support(layout)
    if reason is not None:
        raise UnsupportedLayout(f"wavelet_attention Triton kernel: unsupported {reason}")
    interpreting = _interpreting()
    if not (q.is_cuda or interpreting):
        raise ValueError("the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    for name, t in (
        ("k_codes", k_codes),
        ("v_codes", v_codes),
        ("k_scales", k_scales),
        ("v_scales", v_scales),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if k_codes.stride(2) != v_codes.stride(2) or k_scales.stride(2) != v_scales.stride(2):
        raise ValueError("k and v caches must share their per-token strides")
    batch, hq, tq, d = q.shape
    hkv, capacity = k_codes.shape[1], k_codes.shape[2]
    group = hq // hkv
    rows = group * tq
    block_m = _block_m(rows)
    n_row_blocks = -(-rows // block_m)
    if config is None:
        config = tuned_config(layout, d, block_m, batch * hkv * n_row_blocks)
    kernel = split_kernel_choice(config, layout, k_codes, k_scales, block_m)
    if config.kernel == "v3" and kernel != "v3":
        config = v1_fallback(config)
    use_v3, use_v2 = kernel == "v3", kernel == "v2"
    if use_v3 and config.key_word_pairs and not _key_pairs_aligned(k_codes, layout):
        # the paired loads read 8 bytes at once: rows that are not 8-byte aligned take the same
        # kernel with one 4-byte load per word
        config = replace(config, key_word_pairs=False)
    if use_v3 and config.band_columns and not _band_columns_fit(k_scales, v_scales, block_m):
        # GQA groups of more than 4 rows fill the MMAs' columns; other scale rows: the two B operands
        config = replace(config, band_columns=False)
    if use_v2 and block_m > V2_MAX_BLOCK_M:
        block_m = V2_MAX_BLOCK_M
        n_row_blocks = -(-rows // block_m)
    programs = batch * hkv * n_row_blocks
    if num_splits is None:
        plan = choose_split_plan(programs, capacity, layout, config, q.device)
    elif isinstance(num_splits, SplitPlan):
        plan = num_splits
    else:  # equal splits, as given
        plan = SplitPlan(num_splits)
    num_splits, split_num, split_den = plan.num_splits, plan.split_num, plan.split_den
    if use_v3 and config.query_in_split and not query_in_split_apply(config, programs * num_splits, q.device):
        # a launch of more waves than config.query_in_split_waves: the prologue transforms the query
        config = replace(config, query_in_split=False)
    if config.value_subnormals and not value_subnormals_apply(config, capacity - layout.n_exact, plan):
        # uncentred value sums lose precision with the split's length: past the bound (from the
        # capacity, so no host sync), the centred step
        config = replace(config, value_subnormals=False)
    # partials per program: the compressed splits, then the exact tokens' (v3: exact_chunks of them,
    # from their own kernel; v1 and v2: one, from the split kernel's last split)
    exact_programs, exact_slots = exact_chunks(config, layout) if use_v3 else (1, 0)
    # the compressed partials: one a split, or with cta_splits one a CTA (its warps' splits merged)
    compressed_parts = num_splits
    if use_v3 and config.cta_splits:
        # where the CTA kernel's path does not fit (cta_splits_reason says why: another GQA group,
        # several new tokens, a launch of more waves than query_in_split takes ...), one split a
        # program, as query_in_split and value_subnormals apply where they fit
        if cta_splits_reason(config, plan, (group, tq, n_row_blocks, block_m, d), layout, k_scales):
            config = replace(config, cta_splits=0)
        else:
            compressed_parts = -(-num_splits // config.cta_splits)
    if use_v3 and config.tma_rows and tma_rows_reason(layout, k_codes, v_codes):
        # (the same step, its rows by loads and copies)
        config = replace(config, tma_rows=False, tma_rows_unfenced=False)
    n_parts = compressed_parts + exact_programs
    device = q.device
    if use_v3 or use_v2:
        plan2 = (
            _plan_v3(layout, device, config.key_word_pairs)
            if use_v3
            else _plan_v2(layout, device, config.subnormal)
        )
        n_slots = plan2.k_slots
        slot_rows, slot_factor, slot_shift, slot_band = (
            plan2.transform_slots,
            plan2.k_factor,
            plan2.k_shift,
            plan2.slot_chunk,
        )
        inverse = plan2.transform
    else:
        plan = _plan(layout, device)
        n_slots = d
        slot_rows, slot_factor, slot_shift, slot_band = (
            plan.transform_slots,
            plan.col_step,
            plan.col_shift,
            plan.col_band,
        )
        inverse = plan.transform_slots
    # the prologue's slot chunks: D_CHUNK divides the slots (a power of two times the plane width)
    d_chunk = min(32, n_slots & -n_slots)
    n_qc = n_slots // d_chunk
    qw = torch.empty(programs, block_m, n_slots, device=device, dtype=torch.float16)
    qc = torch.empty(programs, n_qc, block_m, 4, device=device, dtype=torch.float32)
    m_part = torch.empty(programs, n_parts, block_m, device=device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(programs, n_parts, block_m, d, device=device, dtype=torch.float32)
    out = torch.empty(q.shape, device=device, dtype=q.dtype)
    qk_scale = float(sm_scale) * LOG2E
    # views into the caller's channel tensors (no per-call copies): kernels read them with a
    # per-kv-head stride and rows contiguous in D
    k_params = attention_channel_params(k_channel_scale, hkv, d, "k_channel_scale", copy=False)
    v_params = attention_channel_params(v_channel_scale, hkv, d, "v_channel_scale", copy=False)
    k_cs, v_cs = _on(k_params.scale, device), _on(v_params.scale, device)
    k_rotation = None if k_params.rotation is None else _on(k_params.rotation, device)
    v_rotation = None if v_params.rotation is None else _on(v_params.rotation, device)
    v_offset = None if v_params.offset is None else _on(v_params.offset, device)
    pdl = _pdl(config, device)  # the prologue lets the split kernel launch early; see LaunchConfig.pdl
    # overlap_exact: the exact-token kernel runs on the side stream (forked after the prologue);
    # deferred cache writes of this step's tokens (kernels/side_stream.py) are queued there ahead of
    # it. Without that ordering, the current stream waits for them before anything reads the caches.
    side = _side_stream(device) if use_v3 and config.overlap_exact and q.is_cuda else None
    caches = (k_codes, k_scales, v_codes, v_scales, k_exact, v_exact)
    if q.is_cuda and side is None and any(_side.pending(c) for c in caches):
        _side.join(device, caches)
    query_in_split = use_v3 and config.query_in_split
    query_args = None
    # the prologue's fp32 transform: not needed (nor built) where the split kernel transforms the query
    if not query_in_split:
        q_transform, q_transform_stride_h = query_transform(slot_rows, k_rotation, k_channel_scale)
    if query_in_split:
        # no prologue: the split kernel transforms the query itself (LaunchConfig.query_in_split)
        words, stride = query_slot_transform_words(slot_rows, k_rotation, k_cs, k_channel_scale)
        query_args = (q, *q.stride()[:3], words, stride, slot_factor, slot_shift, qk_scale)
    elif n_row_blocks == 1 and batch * block_m >= PROLOGUE_HEADS_MIN_ROWS and d <= 128:
        # decode with many sequences: the rows that share a kv head's transform in one dot (head_dim
        # 256 would hold a [64, 256] fp32 query tile per program: not measured, so not taken)
        launch(
            _prologue_heads_kernel,
            (hkv, -(-batch * block_m // config.prologue_tile_rows), n_qc),
            q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cs,
            k_cs.stride(0),
            q_transform,
            q_transform_stride_h,
            slot_factor,
            slot_shift,
            slot_band,
            qw,
            qc,
            batch,
            hkv,
            group,
            tq,
            qk_scale,
            D=d,
            S=n_slots,
            BLOCK_M=block_m,
            D_CHUNK=d_chunk,
            ROWS=config.prologue_tile_rows,
            PRECISION=config.prologue_precision,
            num_warps=config.prologue_warps,
            **_prologue_pdl(pdl, config),
        )
    else:
        launch(
            _prologue_kernel,
            (programs, n_qc),
            q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cs,
            k_cs.stride(0),
            q_transform,
            q_transform_stride_h,
            slot_factor,
            slot_shift,
            slot_band,
            qw,
            qc,
            hkv,
            group,
            tq,
            n_row_blocks,
            qk_scale,
            D=d,
            S=n_slots,
            BLOCK_M=block_m,
            D_CHUNK=d_chunk,
            PRECISION=config.prologue_precision,
            num_warps=config.prologue_warps,
            **_prologue_pdl(pdl, config),
        )
    # overlap_exact: the exact-token kernel's stream forks after the prologue and joins back
    # before the reduce; the kernel is enqueued after the split kernel, so the split's programs
    # take the SMs first and the exact ones fill the slots its last, partial wave leaves free
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    # ptxas register cap for the split kernel (more resident programs per SM; GPU compile only)
    split_options = {} if config.maxnreg is None or interpreting else {"maxnreg": config.maxnreg}
    common_exact = (
        k_exact,
        *k_exact.stride()[:3],
        v_exact,
        *v_exact.stride()[:3],
        seq_lens,
    )
    value_channels = None
    if use_v3 and config.transform_in_split:
        words, stride = value_slot_transform_words(inverse, v_rotation, plan2.slot_coef, v_channel_scale)
        value_channels = (words, stride, v_cs, v_cs.stride(0))
    if use_v3:
        _phase_clock_buffer(config, programs * num_splits, device)  # (refused here, not by falling back)
        try:
            try:
                _launch_v3(
                    q,
                    common_exact,
                    k_codes,
                    k_scales,
                    v_codes,
                    v_scales,
                    seq_lens,
                    plan2,
                    (qw, qc, m_part, l_part, acc_part),
                    (hkv, group, tq, n_row_blocks, compressed_parts, n_qc, block_m, d, programs, qk_scale)
                    + (n_parts, exact_slots),
                    layout,
                    config,
                    split_options,
                    side,
                    exact_carveout(
                        config, carveout_split_programs(programs, plan), programs * exact_programs, device
                    ),
                    plan,
                    value_channels,
                    query_args,
                )
            finally:  # the reduce (or the fallback below) runs after the exact tokens' partial
                if side is not None:
                    torch.cuda.current_stream(device).wait_stream(side)
                    _side.forget(caches)  # deferred writes into them came before it
        except Exception as exc:  # noqa: BLE001 - any build or launch failure: run v1 instead
            global _V3_FAILURE
            _V3_FAILURE = f"v3 failed on this Triton ({type(exc).__name__}: {str(exc)[:300]})"
            warnings.warn(f"wavelet_attention: {_V3_FAILURE}; the v1 kernel runs instead", stacklevel=2)
            return wavelet_attention_triton(
                q,
                k_codes,
                k_scales,
                v_codes,
                v_scales,
                k_exact,
                v_exact,
                seq_lens,
                k_channel_scale,
                v_channel_scale,
                layout,
                sm_scale,
                v1_fallback(config),
                plan,
                validate=False,
            )
    elif use_v2:
        launch(
            _split_kernel_v2,
            (num_splits + 1, programs),
            qw,
            qc,
            q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            *_cache_operands(k_codes, k_scales, v_codes, v_scales),
            *common_exact,
            plan2.v_step,
            plan2.v_shift,
            plan2.slot_coef,
            m_part,
            l_part,
            acc_part,
            hkv,
            group,
            tq,
            n_row_blocks,
            num_splits,
            split_num,
            split_den,
            qk_scale,
            CODE_STRIDE=k_codes.stride(2),
            SCALE_STRIDE=k_scales.stride(2),
            N_SCALES=layout.n_bands,
            D=d,
            S=n_slots,
            BLOCK_M=block_m,
            N_QC=n_qc,
            BLOCK_N=config.block_n,
            EXACT_BLOCK=config.exact_block,
            SINKS=layout.sinks,
            WINDOW=layout.window,
            USE_ASM=config.use_asm and not interpreting,
            SUBNORMAL=config.subnormal,
            LAZY_RESCALE=config.lazy_rescale,
            CHUNKS=plan2.chunk_constexpr,
            EXACT_SPLIT=k_exact.dtype in (torch.float16, torch.bfloat16) and not interpreting,
            CENTRE_IN_MMA=config.centre_in_mma and not config.subnormal,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **split_options,
        )
    else:
        launch(
            _split_kernel,
            (num_splits + 1, programs),
            qw,
            qc,
            q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            *_cache_operands(k_codes, k_scales, v_codes, v_scales),
            *common_exact,
            plan.lut,
            plan.col_step,
            plan.col_vshift,
            m_part,
            l_part,
            acc_part,
            hkv,
            group,
            tq,
            n_row_blocks,
            num_splits,
            split_num,
            split_den,
            qk_scale,
            CODE_STRIDE=k_codes.stride(2),
            SCALE_STRIDE=k_scales.stride(2),
            N_SCALES=layout.n_bands,
            D=d,
            BLOCK_M=block_m,
            N_QC=n_qc,
            BLOCK_N=config.block_n,
            EXACT_BLOCK=config.exact_block,
            SINKS=layout.sinks,
            WINDOW=layout.window,
            USE_ASM=config.use_asm and not interpreting,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            CENTRE_IN_MMA=config.centre_in_mma,
            **split_options,
            **plan.constexprs,
            **_dependent(pdl),
        )
    # W, R and s as one matrix per kv head: the reduces apply no R (channel partials need none)
    if v_rotation is not None and value_channels is None:
        inverse = value_transform(inverse, v_rotation, v_cs, v_channel_scale)
        v_cs = _ones(hkv, d, device)
    # the way back to channels and out: what the reduces and _transform_heads_kernel all take
    output_args = (
        inverse,
        inverse.stride(0) if inverse.dim() == 3 else 0,
        v_cs,
        v_cs.stride(0),
        v_cs if v_offset is None else v_offset,  # unread without OFFSET
        0 if v_offset is None else v_offset.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    reduce_args = (m_part, l_part, acc_part, *output_args, hkv, group, tq, n_row_blocks, num_splits, n_parts)
    channel_flags = dict(OFFSET=v_offset is not None)
    # the reduce waits in-kernel for the split kernel (PDL) unless a stream join comes between them
    if value_channels is not None:
        # every partial in the channel domain: one merge, no transform (LaunchConfig.transform_in_split)
        channels = min(config.channel_merge_channels, d)
        launch(
            _merge_channel_rows_kernel,
            (programs * block_m, d // channels),
            m_part,
            l_part,
            acc_part,
            *output_args[4:],
            hkv,
            group,
            tq,
            n_row_blocks,
            n_parts,
            D=d,
            BLOCK_M=block_m,
            SPLIT_CHUNK=reduce_split_chunk(config, n_parts),
            CHANNELS=channels,
            num_warps=config.channel_merge_warps,
            **channel_flags,
            **_dependent(pdl and side is None),
        )
    elif programs * block_m <= config.row_reduce_max_programs * _sm_count(device):
        # few (sequence, kv head) pairs and many splits: one program per query row
        gemm = uses_reduce_gemm(config, programs * block_m, n_row_blocks)
        merge_warps = config.reduce_merge_warps if gemm and config.reduce_merge_warps else config.reduce_warps
        # the merge of each row over several programs, a slice of its D sums each
        channels = min(config.reduce_merge_channels, d) if gemm else 0
        launch(
            _reduce_rows_kernel,
            (programs * block_m, d // channels) if channels else (programs * block_m,),
            *reduce_args,
            D=d,
            BLOCK_M=block_m,
            SPLIT_CHUNK=reduce_split_chunk(config, n_parts),
            num_warps=merge_warps,
            **({"TRANSFORM_FIRST": True} if config.reduce_transform_first else {}),
            **channel_flags,
            **_dependent(pdl and side is None),
            **({"MERGE_ONLY": True} if gemm else {}),
            **({"CHANNELS": channels} if channels else {}),
        )
        if gemm:
            tile = REDUCE_GEMM_TILE
            launch(
                _transform_heads_kernel,
                (hkv * -(-batch * block_m // tile), d // min(d, config.transform_channels)),
                acc_part,
                *output_args,
                hkv,
                group,
                tq,
                batch,
                num_splits,
                n_parts,
                D=d,
                BLOCK_M=block_m,
                TILE=tile,
                D_CHUNK=min(d, config.transform_channels),
                num_warps=config.transform_warps,
                **channel_flags,
                **_dependent(pdl),
            )
    else:
        launch(
            _reduce_kernel,
            (programs,),
            *reduce_args,
            D=d,
            BLOCK_M=block_m,
            D_CHUNK=min(d, 32),
            num_warps=4,
            **channel_flags,
            **_dependent(pdl and side is None),
        )
    return out


def bytes_read(
    layout: CompressedLayout, batch: int, n_kv_heads: int, seq_len: int, exact_itemsize: int
) -> int:
    """Bytes a decode step must read: compressed K and V of every non-exact position plus the exact
    sink/window tokens (the floor the benchmark divides by bandwidth)."""
    n_exact = min(seq_len, layout.n_exact)
    n_comp = seq_len - n_exact
    per_head = 2 * n_comp * layout.bytes_per_vector + 2 * n_exact * layout.head_dim * exact_itemsize
    return batch * n_kv_heads * per_head


__all__ = [
    "CompressedLayout",
    "LaunchConfig",
    "TUNED_CONFIGS",
    "UnsupportedLayout",
    "bytes_read",
    "ChannelParams",
    "attention_channel_params",
    "channel_scale_2d",
    "check_attention_inputs",
    "choose_num_splits",
    "choose_split_plan",
    "decode_coefficients",
    "default_config",
    "resident_programs_per_sm",
    "split_count",
    "split_kernel_choice",
    "triton_support",
    "tuned_config",
    "wavelet_attention_reference",
    "wavelet_attention_triton",
]
