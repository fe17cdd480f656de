"""Op wmoe::wavelet_attention: causal GQA attention over the wavelet-compressed KV cache.

Schema (docs/CONTRACTS.md)::

    wmoe::wavelet_attention(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales,
        Tensor k_exact, Tensor v_exact, Tensor seq_lens, Tensor k_channel_scale,
        Tensor v_channel_scale, str codec, float sm_scale, Tensor? sinks=None, int window=0) -> Tensor

q [B, Hq, Tq, D] (Hq a multiple of Hkv; the Tq new tokens are already in the cache); seq_lens [B]
counts valid positions including them; query t attends positions < seq_lens[b] - Tq + t + 1.
The channel arguments carry the cache's channel parameters in any form wmoe::kv_compress takes
(docs/CONTRACTS.md): empty; [Hkv, D], [1, D] or [D] (scale s); [2, Hkv, D] (s, offset m);
[Hkv, D + 2, D] (rotation R, s, m). The kernel folds s and R into the query, applies R^T and s to
the output once, and adds the value offset once (the exact copies are stored centred like the
codes; key offsets shift every score of a query equally and drop out of the softmax).
sinks: None, or a learned logit per query head [Hq] in the scaled scores' units (gpt-oss): the
softmax runs over the scores and that logit, whose weight then attends to nothing.
window > 0: a sliding window, query t attends positions > seq_lens[b] - Tq + t - window only (a
window of at least the capacity masks nothing). Where the codec's exact ring holds every position
the window reaches (window + Tq - 1 <= the codec's window) the ring-window kernel reads the ring
alone (kernels/window_attention.py); wider windows take the reference, with a warning.

Backend: the fused Triton kernels (launched by kernels/wavelet_attention.py) on CUDA tensors, the PyTorch
reference elsewhere. A layout the kernel does not handle (head_dim outside 64/128/256, more than
four power-of-two band chunks) falls back to the reference with a warning that says why.
`set_backend("triton")` forces the kernel (on the CPU it then needs TRITON_INTERPRET=1; tests use
that), `"reference"` forces the reference.

Input checks run before any kernel. The seq_lens range check reads seq_lens on the host (one
device sync per call; skipped inside CUDA-graph capture); `set_value_checks(False)` turns it off
for serving loops that guarantee it.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..codec import WaveletKVConfig, codec_layout, get_codec
from ..kernels import side_stream as _side
from ..kernels import wavelet_attention as _k
from ..kernels import window_attention as _w

_BACKENDS = ("auto", "reference", "triton")
_backend = "auto"
_value_checks = True
_warned: set[str] = set()


def set_backend(name: str) -> str:
    """Select the implementation behind the op; returns the previous setting."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {name!r}")
    previous, _backend = _backend, name
    return previous


def set_value_checks(enabled: bool) -> bool:
    """Check seq_lens against [Tq, capacity] on every call (a host sync); returns the previous setting."""
    global _value_checks
    previous, _value_checks = _value_checks, bool(enabled)
    return previous


@lru_cache(maxsize=64)
def compressed_layout(codec: str, head_dim: int) -> _k.CompressedLayout:
    """The kernel's view of a codec spec at one head_dim (cached)."""
    c = get_codec(codec, head_dim)
    return _k.CompressedLayout(
        head_dim=head_dim,
        transform=c.transform.to(torch.float32),
        bands=tuple((b.start, b.size, b.bits) for b in c.bands),
        grids=tuple(tuple(float(v) for v in g.tolist()) for g in c.grids),
        sinks=c.config.sinks,
        window=c.config.window,
        key=f"{c.spec}|D={head_dim}",
    )


@lru_cache(maxsize=64)
def shape_layout(codec: str, head_dim: int) -> _k.CompressedLayout:
    """The layout's geometry (bands, sinks, window) from the codec spec alone: pure Python plus a
    meta-device transform and placeholder grids, so the fake implementation never builds lookup
    tables or reads a tensor value (it may first run under torch.export's fake mode)."""
    config = WaveletKVConfig.from_spec(codec)
    geometry = codec_layout(config, head_dim)
    with unset_fake_temporarily():
        transform = torch.empty(head_dim, head_dim, device="meta")
    return _k.CompressedLayout(
        head_dim=head_dim,
        transform=transform,
        bands=tuple((b.start, b.size, b.bits) for b in geometry.bands),
        grids=tuple((0.0,) * 2**b.bits for b in geometry.bands),
        sinks=config.sinks,
        window=config.window,
        key=f"{codec}|D={head_dim}|shape-only",
    )


def _use_triton(q: torch.Tensor) -> bool:
    if _backend == "reference" or not _k.HAS_TRITON:
        return False
    return _backend == "triton" or q.is_cuda


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"wmoe::wavelet_attention: using the PyTorch reference: {reason}", stacklevel=3)


@torch.library.custom_op(
    "wmoe::wavelet_attention",
    mutates_args=(),
    schema=(
        "(Tensor q, Tensor k_codes, Tensor k_scales, Tensor v_codes, Tensor v_scales, Tensor k_exact, "
        "Tensor v_exact, Tensor seq_lens, Tensor k_channel_scale, Tensor v_channel_scale, str codec, "
        "float sm_scale, Tensor? sinks=None, int window=0) -> Tensor"
    ),
)
def wavelet_attention(
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
    codec: str,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    layout = compressed_layout(codec, int(q.shape[-1]))
    args = (
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
    _k.check_attention_inputs(*args, layout, check_values=_value_checks)
    _k.check_sink_logits(sinks, q)
    window = _sliding_window(window, k_codes.shape[2])
    if window:
        return _window_attention(args, layout, sm_scale, sinks, window)
    reason = _k.triton_support(layout) if _use_triton(q) else "the reference backend"
    if reason is None:  # orders itself after deferred cache writes (kernels/side_stream.py)
        out = _k.wavelet_attention_triton(*args, layout, sm_scale, validate=False, sinks=sinks)
    else:
        if _use_triton(q):
            _warn_once(f"the Triton kernel does not support {reason}")
        if q.is_cuda:  # a cache write deferred to the side stream must land before the reference reads
            _side.join(q.device, args[1:7])
        out = _k.wavelet_attention_reference(*args, layout, sm_scale, sinks)
    # The fake impl promises a contiguous [B, Hq, Tq, D]; Inductor asserts the strides.
    return out.contiguous()


def _sliding_window(window: int, capacity: int) -> int:
    """The window the op applies: 0 for none and for one of at least the capacity (positions are
    below the capacity, so it masks nothing)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no sliding window), got {window!r}")
    return 0 if window >= capacity else window


def _window_attention(
    args: tuple, layout: _k.CompressedLayout, sm_scale: float, sinks: torch.Tensor | None, window: int
) -> torch.Tensor:
    q = args[0]
    reason = _w.ring_window_reason(layout, window, int(q.shape[2]))
    if q.is_cuda:  # a cache write deferred to the side stream must land before either path reads
        _side.join(q.device, args[1:7])
    if reason is None and _use_triton(q):
        q, _, _, _, _, k_exact, v_exact, seq_lens, k_cs, v_cs = args
        out = _w.window_attention_triton(
            q, k_exact, v_exact, seq_lens, k_cs, v_cs, layout, sm_scale, window, sinks
        )
    else:
        if _use_triton(q):
            _warn_once(f"the ring-window kernel does not cover it: {reason}")
        out = _k.wavelet_attention_reference(*args, layout, sm_scale, sinks, window)
    return out.contiguous()


@wavelet_attention.register_fake
def _(
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
    codec: str,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    layout = shape_layout(codec, int(q.shape[-1]))  # head_dim is static (int() specialises)
    # Shape checks only, never tensor values. Outside the fake mode, so anything the checks
    # cache (e.g. a ones scale for an empty channel argument) is a real tensor; ops on the fake
    # inputs still run fake (a FakeTensor dispatches through its own mode).
    with unset_fake_temporarily():
        _k.check_attention_inputs(
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
            check_values=False,
        )
        _k.check_sink_logits(sinks, q)
        _sliding_window(window, 1)
    return q.new_empty(q.shape)
