"""Ops wmoe::kv_compress, wmoe::kv_decompress, wmoe::kv_compress_into_cache and its
_overlapped variant (docs/CONTRACTS.md).

The codec travels as its canonical spec string (WaveletKVConfig.to_spec(), or a preset name);
the head dimension comes from the tensors. channel_scale is [Hkv, D] (also [1, D], [D], or an
empty tensor for no smoothing).

Backend: Triton on CUDA tensors, the PyTorch reference elsewhere. `set_backend("triton")` forces
the Triton path (on CPU it then needs TRITON_INTERPRET=1; tests use it), `"reference"` forces the
reference everywhere.
"""

from __future__ import annotations

import torch

from ..codec import allocate_compressed_cache, get_codec, get_layout
from ..kernels import kv_codec as _k
from ..kernels import side_stream as _side

_BACKENDS = ("auto", "reference", "triton")
_backend = "auto"


def set_backend(name: str) -> str:
    """Select the implementation behind the ops; returns the previous setting."""
    global _backend
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(_BACKENDS)}, got {name!r}")
    previous, _backend = _backend, name
    return previous


def _use_triton(t: torch.Tensor) -> bool:
    if _backend == "reference" or not _k.HAS_TRITON:
        return False
    return _backend == "triton" or t.is_cuda


@torch.library.custom_op(
    "wmoe::kv_compress",
    mutates_args=(),
    schema="(Tensor x, Tensor channel_scale, str codec) -> (Tensor codes, Tensor scales)",
)
def kv_compress(
    x: torch.Tensor, channel_scale: torch.Tensor, codec: str
) -> tuple[torch.Tensor, torch.Tensor]:
    c = get_codec(codec, int(x.shape[-1]))
    if _use_triton(x):
        return _k.compress_triton(c, x, channel_scale)
    return _k.compress_reference(c, x, channel_scale)


@kv_compress.register_fake
def _(x: torch.Tensor, channel_scale: torch.Tensor, codec: str) -> tuple[torch.Tensor, torch.Tensor]:
    c = get_layout(codec, int(x.shape[-1]))  # head_dim is static (int() specialises a SymInt)
    codes = x.new_empty(*x.shape[:-1], c.n_code_bytes, dtype=torch.uint8)
    scales = x.new_empty(*x.shape[:-1], c.n_bands, dtype=torch.float16)
    return codes, scales


def _head_dim_from_codes(codec: str, n_code_bytes: int) -> int:
    # The packed width is monotone in head_dim for a spec; find the head_dim that gives it.
    for head_dim in range(4, 4097, 4):
        try:
            c = get_layout(codec, head_dim)
        except ValueError:
            continue
        if c.n_code_bytes == n_code_bytes:
            return head_dim
        if c.n_code_bytes > n_code_bytes:
            break
    raise ValueError(f"no head_dim gives {n_code_bytes} code bytes for codec {codec!r}")


@torch.library.custom_op(
    "wmoe::kv_decompress",
    mutates_args=(),
    schema="(Tensor codes, Tensor scales, Tensor channel_scale, str codec, ScalarType dtype) -> Tensor",
)
def kv_decompress(
    codes: torch.Tensor, scales: torch.Tensor, channel_scale: torch.Tensor, codec: str, dtype: torch.dtype
) -> torch.Tensor:
    c = get_codec(codec, _head_dim_from_codes(codec, int(codes.shape[-1])))
    return _k.decompress_reference(c, codes, scales, channel_scale, dtype)


@kv_decompress.register_fake
def _(
    codes: torch.Tensor, scales: torch.Tensor, channel_scale: torch.Tensor, codec: str, dtype: torch.dtype
) -> torch.Tensor:
    head_dim = _head_dim_from_codes(codec, int(codes.shape[-1]))
    return codes.new_empty(*codes.shape[:-1], head_dim, dtype=dtype)


@torch.library.custom_op(
    "wmoe::kv_compress_into_cache",
    mutates_args=("codes_cache", "scales_cache", "exact_cache"),
    schema=(
        "(Tensor x, Tensor(a!) codes_cache, Tensor(b!) scales_cache, Tensor(c!) exact_cache, "
        "Tensor positions, Tensor channel_scale, str codec) -> ()"
    ),
)
def kv_compress_into_cache(
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
    codec: str,
) -> None:
    c = get_codec(codec, int(x.shape[-1]))
    if _use_triton(x):
        _k.compress_into_cache_triton(c, x, codes_cache, scales_cache, exact_cache, positions, channel_scale)
    else:
        _k.compress_into_cache_reference(
            c, x, codes_cache, scales_cache, exact_cache, positions, channel_scale
        )


@kv_compress_into_cache.register_fake
def _(
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
    codec: str,
) -> None:
    return None


@torch.library.custom_op(
    "wmoe::kv_compress_into_cache_overlapped",
    mutates_args=("codes_cache", "scales_cache", "exact_cache"),
    schema=(
        "(Tensor x, Tensor(a!) codes_cache, Tensor(b!) scales_cache, Tensor(c!) exact_cache, "
        "Tensor positions, Tensor channel_scale, str codec) -> ()"
    ),
)
def kv_compress_into_cache_overlapped(
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
    codec: str,
) -> None:
    """kv_compress_into_cache whose write may still be running on the attention's side stream when
    it returns (kernels/side_stream.py); only ``wmoe::wavelet_attention`` over these caches may read
    them before it (the pass overlap_cache_writes checks that). Deferred on CUDA with the Triton
    kernel when the chunk fits the exact window (the split kernel then never reads what this writes);
    otherwise the ordinary in-order write."""
    c = get_codec(codec, int(x.shape[-1]))
    deferrable = _use_triton(x) and x.is_cuda and 0 < int(x.shape[-2]) <= c.config.window
    # None also on first use inside a graph capture (no stream can be made then)
    side = _side.side_stream(x.device) if deferrable else None
    if side is None:
        kv_compress_into_cache(x, codes_cache, scales_cache, exact_cache, positions, channel_scale, codec)
        return
    side.wait_stream(torch.cuda.current_stream(x.device))  # x was made on the current stream
    with torch.cuda.stream(side):
        _k.compress_into_cache_triton(c, x, codes_cache, scales_cache, exact_cache, positions, channel_scale)
    _side.defer(
        (codes_cache, scales_cache, exact_cache),
        (x, codes_cache, scales_cache, exact_cache, positions, channel_scale),
    )


@kv_compress_into_cache_overlapped.register_fake
def _(
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
    codec: str,
) -> None:
    return None


def allocate_cache(
    codec: str,
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (codes, scales, exact) caches at compressed size for one of K or V of one layer."""
    c = get_codec(codec, head_dim)
    codes, scales = allocate_compressed_cache(
        batch, num_kv_heads, max_seq_len, c.n_code_bytes, c.n_bands, device
    )
    exact = torch.zeros(
        batch, num_kv_heads, c.config.sinks + c.config.window, head_dim, dtype=dtype, device=device
    )
    return codes, scales, exact
