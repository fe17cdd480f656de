"""The compressed cache as the decode attention sees it, and the checks every path shares.

``CompressedLayout`` is the codec's storage format in the terms the kernels and the reference read
it: per band the coefficients it holds, its bits and grid, where its codes sit in a token's row;
the sinks and window kept exact. ``check_attention_inputs`` is what the reference, the Triton path
and the op's fake implementation all run first, so that bad input gets one clear error before
anything is launched; ``attention_channel_params`` gathers the codec's channel parameters (scale,
offset, rotation) in the form both paths take.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_codec import channel_params as _codec_channel_params

SUPPORTED_HEAD_DIMS = (64, 128, 256)  # the Triton kernel; the reference takes any head_dim
SUPPORTED_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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


def check_sink_logits(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    """Learned sink logits (gpt-oss): None, or one float logit per query head, on q's device."""
    if sinks is None:
        return
    hq = q.shape[1]
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise ValueError(
            f"sinks must be a float tensor of one logit per query head [Hq={hq}], got "
            f"{getattr(sinks, 'dtype', type(sinks).__name__)}"
        )
    if sinks.dim() != 1 or sinks.shape[0] != hq:
        raise ValueError(f"sinks must be [Hq={hq}] (one logit per query head), got {list(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}: every tensor must share one device")


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
