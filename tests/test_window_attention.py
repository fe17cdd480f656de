"""Sliding-window attention in wmoe::wavelet_attention (gpt-oss's sliding layers; window > 0).

Where the codec's exact ring holds every position the window reaches, the ring-window kernel
(kernels/window_attention.py) reads the ring alone; wider windows take the reference. Both are
checked against test_wavelet_attention's float64 decompress-and-attend reference with the same
window, on the CPU through the Triton interpreter and on the GPU at gpt-oss's shapes: ragged
lengths (1, shorter than the window, rings wrapped several times), several new tokens, offsets and
rotations, learned sink logits.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from test_attention_sinks import sink_logits
from test_wavelet_attention import SMALL_SPEC, dense_reference, make_case, rel_err
from wmoe_compile.kernels import wavelet_attention as K
from wmoe_compile.kernels import window_attention as W

import wmoe_compile.ops  # noqa: F401  registers the ops
from wmoe_compile.ops import attention as ops

RING = 8  # SMALL_SPEC's exact window (and 2 exact sinks)
LENS = [40, 1, 5, 23]  # 40: the ring wrapped four times; 1 and 5: shorter than the window


def _case(tq, channel, dtype=torch.float16, group=4, spec=SMALL_SPEC):
    lens = [max(n, tq) for n in LENS]
    return make_case(spec, len(lens), 2, group, tq, 64, lens, 40, dtype, channel=channel)


@pytest.mark.parametrize("tq,window", [(1, 8), (1, 5), (3, 6), (2, 1)])
@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_ring_window_kernel_matches_the_dense_reference(tq, window, channel, with_sinks):
    codec, args = _case(tq, channel)
    sinks = sink_logits(8) if with_sinks else None
    want = dense_reference(codec, args, 0.125, sinks, sliding_window=window)
    layout = ops.compressed_layout(codec.spec, 64)
    q, _, _, _, _, k_exact, v_exact, lens, k_cs, v_cs = args
    got = W.window_attention_triton(q, k_exact, v_exact, lens, k_cs, v_cs, layout, 0.125, window, sinks)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-2
    # the window matters here: attending every position is far from it
    assert rel_err(got, dense_reference(codec, args, 0.125, sinks)) > 0.05
    # the reference (the op's CPU path) applies the same window
    assert rel_err(K.wavelet_attention_reference(*args, layout, 0.125, sinks, window), want) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ring_window_kernel_other_dtypes_and_a_group_of_one(dtype):
    codec, args = _case(1, "full", dtype=dtype, group=1)
    want = dense_reference(codec, args, 0.125, sliding_window=7)
    layout = ops.compressed_layout(codec.spec, 64)
    q, _, _, _, _, k_exact, v_exact, lens, k_cs, v_cs = args
    got = W.window_attention_triton(q, k_exact, v_exact, lens, k_cs, v_cs, layout, 0.125, 7)
    assert got.dtype == dtype and rel_err(got, want) <= 1e-2


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_op_routes_windows_by_what_the_ring_holds(backend):
    previous = ops.set_backend(backend)
    try:
        codec, args = _case(1, "full")
        op = torch.ops.wmoe.wavelet_attention
        sinks = sink_logits(8)
        got = op(*args, codec.spec, 0.125, sinks, 6)
        assert rel_err(got, dense_reference(codec, args, 0.125, sinks, sliding_window=6)) <= 1e-2
        # a window of at least the capacity (40) masks nothing: the plain op, bit for bit
        assert torch.equal(op(*args, codec.spec, 0.125, sinks, 40), op(*args, codec.spec, 0.125, sinks))
        # wider than the ring: the reference, with the window applied (and a warning on the kernel path)
        ops._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wide = op(*args, codec.spec, 0.125, None, 20)
        assert rel_err(wide, dense_reference(codec, args, 0.125, sliding_window=20)) <= 1e-2
        assert (backend == "triton") == any(
            "past the codec's exact window of 8" in str(w.message) for w in caught
        )
        torch.library.opcheck(op.default, (*args, codec.spec, 0.125), {"sinks": sinks, "window": 6})
    finally:
        ops.set_backend(previous)


def test_bad_windows_fail_with_the_reason():
    codec, args = _case(1, "scale")
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        torch.ops.wmoe.wavelet_attention(*args, codec.spec, 0.125, None, -1)
    layout = ops.compressed_layout(codec.spec, 64)
    q, _, _, _, _, k_exact, v_exact, lens, k_cs, v_cs = args
    with pytest.raises(ValueError, match="reaches 10 positions back, past the codec's exact window of 8"):
        W.window_attention_triton(
            q[:, :, :1].expand(-1, -1, 3, -1), k_exact, v_exact, lens, k_cs, v_cs, layout, 0.125, 8
        )
    no_ring = ops.compressed_layout("lloyd;window=0;sinks=2", 64)
    assert "keeps no exact window" in W.ring_window_reason(no_ring, 4, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [1, 4])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_gpu_ring_window_at_gpt_oss_shapes(tq, with_sinks):
    # gpt-oss-20b's sliding layers: 64 q / 8 kv heads, D 64, a window of 128 (the default codec's
    # exact window); ragged lengths past, at and under the window
    seq_lens = [4096, tq, 100, 129, 1000]
    codec, args = make_case(
        "default", 5, 8, 8, tq, 64, seq_lens, 4096, torch.bfloat16, device="cuda", channel="full"
    )
    window = 128 - tq + 1
    sinks = sink_logits(64, "cuda") if with_sinks else None
    want = dense_reference(codec, args, 64**-0.5, sinks, sliding_window=window)
    got = torch.ops.wmoe.wavelet_attention(*args, codec.spec, 64**-0.5, sinks, window)
    assert rel_err(got, want) <= 1e-2
