"""Compressed caches as views into rows longer than their capacity.

The ops take the caches' strides: a cache may be a view into longer rows (e.g.
codec.allocate_compressed_cache(row_positions=...), or a slice of a larger buffer). A write into a
silent contiguous copy, or a read that assumes rows of `capacity` positions, would be wrong without
an error. These tests compare each op on such views with the same op on contiguous caches holding
the same values. (The thirtieth session padded the package's caches at multiples of 65,536
positions for speed; the thirty-first measured that padding no faster and removed it:
benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import pytest
import torch
from wmoe_compile.kernels import wavelet_attention as wa

import wmoe_compile.ops  # noqa: F401  registers the ops
from wmoe_compile.codec import allocate_compressed_cache, get_codec
from wmoe_compile.ops import attention as attention_ops
from wmoe_compile.ops import kv_codec as ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = "default;window=16;sinks=4"


def test_allocated_caches_are_contiguous_unless_rows_are_asked_for():
    codec = get_codec(SPEC, 64)
    for capacity in (1000, 4096, 65536):
        codes, scales, exact = ops.allocate_cache(SPEC, 1, 2, capacity, 64, torch.float16, DEVICE)
        assert codes.shape == (1, 2, capacity, codec.n_code_bytes)
        assert scales.shape == (1, 2, capacity, codec.n_bands)
        assert codes.is_contiguous() and scales.is_contiguous() and exact.is_contiguous()
    codes, scales = allocate_compressed_cache(1, 2, 4096, codec.n_code_bytes, codec.n_bands, DEVICE, 4128)
    assert codes.shape == (1, 2, 4096, codec.n_code_bytes) and not codes.is_contiguous()
    assert codes.stride() == (2 * 4128 * codec.n_code_bytes, 4128 * codec.n_code_bytes, codec.n_code_bytes, 1)
    assert scales.stride() == (2 * 4128 * codec.n_bands, 4128 * codec.n_bands, codec.n_bands, 1)
    assert not codes.any() and not scales.any()
    with pytest.raises(ValueError, match="cannot hold a capacity of 4096"):
        allocate_compressed_cache(1, 2, 4096, codec.n_code_bytes, codec.n_bands, DEVICE, 4000)
    with pytest.raises(ValueError, match="at least 1 position"):
        allocate_compressed_cache(1, 2, 0, codec.n_code_bytes, codec.n_bands, DEVICE)


def _filled_caches(batch: int, hkv: int, capacity: int, head_dim: int, step_backend: str):
    """(padded, contiguous) caches written by the same wmoe::kv_compress_into_cache calls: a
    prefill of all but the last 3 positions (reference backend: the interpreter is slow), then
    two decode-sized writes at the rows' ends by ``step_backend``."""
    torch.manual_seed(0)
    # rows 1/128 longer than the capacity, at a size the interpreter runs quickly
    codec = get_codec(SPEC, head_dim)
    rows = allocate_compressed_cache(
        batch, hkv, capacity, codec.n_code_bytes, codec.n_bands, DEVICE, capacity + capacity // 128
    )
    exact = ops.allocate_cache(SPEC, batch, hkv, 1, head_dim, torch.float16, DEVICE)[2]
    padded = (*rows, exact)
    assert not padded[0].is_contiguous()
    plain = tuple(t.contiguous().clone() for t in padded)
    cs = torch.rand(hkv, head_dim, device=DEVICE) + 0.5
    for backend, start, stop in (
        ("reference", 0, capacity - 3),
        (step_backend, capacity - 3, capacity - 1),
        (step_backend, capacity - 1, capacity),
    ):
        x = torch.randn(batch, hkv, stop - start, head_dim, device=DEVICE, dtype=torch.float16)
        positions = torch.arange(start, stop, device=DEVICE)
        previous = ops.set_backend(backend)
        try:
            for cache in (padded, plain):
                torch.ops.wmoe.kv_compress_into_cache(x, *cache, positions, cs, SPEC)
        finally:
            ops.set_backend(previous)
    return padded, plain, cs


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cache_writes_follow_the_padded_rows(backend):
    padded, plain, cs = _filled_caches(2, 2, 4096, 64, backend)
    for got, want in zip(padded, plain, strict=True):
        assert torch.equal(got, want)
    # and the dense readers' decompression reads them alike
    dense = [torch.ops.wmoe.kv_decompress(c[0], c[1], cs, SPEC, torch.float16) for c in (padded, plain)]
    assert dense[0].abs().sum() > 0 and torch.equal(dense[0], dense[1])
    # the padding itself is untouched: writes went through the views' strides
    rows = padded[0].as_strided((2, 2, 4128, padded[0].shape[-1]), padded[0].stride())
    assert rows[:, :, 4096:].eq(0).all() and rows[:, :, :4096].ne(0).any()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_attention_reads_the_padded_rows(backend):
    # decode attention over ragged lengths up to the full capacity: the padded views and the
    # contiguous copies give the same output, bit for bit (same kernel, same values)
    batch, hkv, group, capacity, head_dim = 2, 2, 4, 4096, 64
    padded, plain, cs = _filled_caches(batch, hkv, capacity, head_dim, "triton")
    q = torch.randn(batch, hkv * group, 1, head_dim, device=DEVICE, dtype=torch.float16)
    seq_lens = torch.tensor([capacity, 2500], device=DEVICE, dtype=torch.int32)
    layout = attention_ops.compressed_layout(SPEC, head_dim)
    run = wa.wavelet_attention_reference if backend == "reference" else wa.wavelet_attention_triton
    outs = []
    for codes, scales, exact in (padded, plain):
        # K and V share the caches here: what matters is where each op reads them
        args = (q, codes, scales, codes, scales, exact, exact, seq_lens, cs, cs)
        outs.append(run(*args, layout, head_dim**-0.5))
    assert torch.isfinite(outs[0]).all() and outs[0].abs().sum() > 0
    assert torch.equal(outs[0], outs[1])
