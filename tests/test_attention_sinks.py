"""Learned attention sinks (gpt-oss) in wmoe::wavelet_attention.

A sink is one extra logit per query head that joins the softmax and attends to nothing: the
positions keep L / (L + e^s) of the mass. The kernels apply it in the reduce (every reduce mode
here, and the split kernel's channel-domain merge in the GPU test), and must move the logit by
sm_scale * q . m_k where the keys are stored centred (offset channel parameters). Checked against
test_wavelet_attention's float64 decompress-and-attend reference with the sink's column, on the
CPU through the Triton interpreter and on the GPU at real shapes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_wavelet_attention import SMALL_SPEC, UNIFORM_SPEC, _run_triton, dense_reference, make_case, rel_err
from wmoe_compile.kernels import wavelet_attention as K

import wmoe_compile.ops  # noqa: F401  registers the ops
from wmoe_compile.ops import attention as ops


def sink_logits(hq: int, device="cpu") -> torch.Tensor:
    """Logits around the scores' log-sum-exp in these cases (about 3-8), so the positions keep
    between most and little of the mass, and far outside it: the first head's far above (its
    positions keep almost nothing: the sinks always matter), the last head's far below."""
    logits = torch.rand(hq, device=device) * 10 - 1
    logits[0], logits[-1] = 14.0, -30.0
    return logits


def _check_sink_matters(got_with, got_without):
    # a kernel that ignored the sinks would fail the reference check by this much at least
    assert rel_err(got_with, got_without.double()) > 0.05


REDUCES = {
    "block": K.LaunchConfig(block_n=16, row_reduce_max_programs=0.0),  # _reduce_kernel
    "rows": K.LaunchConfig(block_n=16, row_reduce_max_programs=1e9),  # _reduce_rows_kernel
    # _reduce_rows_kernel(MERGE_ONLY) over 16 channels a program, then _transform_heads_kernel
    "merge_then_transform": K.LaunchConfig(
        block_n=16, row_reduce_max_programs=1e9, reduce_gemm_min_rows=1, reduce_merge_channels=16
    ),
}


@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize("reduce", list(REDUCES))
def test_sinks_match_the_dense_reference_in_every_reduce(channel, reduce):
    # ragged lengths down to 1, a group of 4, 3 splits (empty ones at length 1); "full": key
    # offsets (the sink logit moves by sm_scale q . m_k), value offsets (weighted by the kept mass)
    lens = [70, 1, 33, 9]
    codec, args = make_case(UNIFORM_SPEC, 4, 2, 4, 1, 64, lens, 70, torch.float16, channel=channel)
    sinks = sink_logits(8)
    want = dense_reference(codec, args, 0.125, sinks)
    got = _run_triton(args, codec, 0.125, config=REDUCES[reduce], num_splits=3, sinks=sinks)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-2
    _check_sink_matters(got, dense_reference(codec, args, 0.125))
    # the PyTorch reference (the op's CPU path) agrees too
    layout = ops.compressed_layout(codec.spec, 64)
    assert rel_err(K.wavelet_attention_reference(*args, layout, 0.125, sinks), want) <= 1e-2


def test_sinks_in_a_prefill_chunk_over_compressed_history():
    # 40 new tokens x 2 q heads: two row blocks of the block reduce, causal inside the chunk, each
    # new token its own sink-moved logit (key offsets)
    tq = 40
    codec, args = make_case(SMALL_SPEC, 2, 2, 2, tq, 64, [100, tq], 112, torch.float16, channel="full")
    sinks = sink_logits(4)
    want = dense_reference(codec, args, 0.125, sinks)
    got = _run_triton(args, codec, 0.125, config=K.LaunchConfig(block_n=32), num_splits=2, sinks=sinks)
    assert rel_err(got, want) <= 1e-2
    _check_sink_matters(got, dense_reference(codec, args, 0.125))


@pytest.mark.parametrize("reduce", list(REDUCES))
def test_sinks_far_above_and_below_the_scores(reduce):
    # far above: the positions keep nothing (the value offset neither), no NaN from an infinite
    # e^s; far below: the sink-free output, bit for bit (the kept share rounds to exactly 1)
    codec, args = make_case(UNIFORM_SPEC, 2, 2, 2, 1, 64, [40, 7], 40, torch.float16, channel="full")
    config = REDUCES[reduce]
    plain = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    low = _run_triton(args, codec, 0.125, config=config, num_splits=2, sinks=torch.full((4,), -1.0e4))
    assert torch.equal(low, plain)
    high = _run_triton(args, codec, 0.125, config=config, num_splits=2, sinks=torch.full((4,), 1.0e4))
    assert torch.isfinite(high).all()
    assert high.abs().max() == 0


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_op_takes_sinks_and_defaults_to_none(backend):
    previous = ops.set_backend(backend)
    try:
        codec, args = make_case(SMALL_SPEC, 2, 1, 2, 2, 64, [24, 9], 24, torch.float16, channel="full")
        sinks = sink_logits(2)
        got = torch.ops.wmoe.wavelet_attention(*args, codec.spec, 0.125, sinks)
        assert rel_err(got, dense_reference(codec, args, 0.125, sinks)) <= 1e-2
        without = torch.ops.wmoe.wavelet_attention(*args, codec.spec, 0.125)
        assert torch.equal(without, torch.ops.wmoe.wavelet_attention(*args, codec.spec, 0.125, None))
        _check_sink_matters(got, without)
        torch.library.opcheck(
            torch.ops.wmoe.wavelet_attention.default, (*args, codec.spec, 0.125), {"sinks": sinks.half()}
        )
    finally:
        ops.set_backend(previous)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bad_sinks_fail_before_any_kernel(backend):
    previous = ops.set_backend(backend)
    try:
        codec, args = make_case(SMALL_SPEC, 2, 1, 2, 1, 64, [20, 5], 20, torch.float16)
        cases = [
            (torch.zeros(3), r"sinks must be \[Hq=2\]"),
            (torch.zeros(1, 2), r"sinks must be \[Hq=2\]"),
            (torch.zeros(2, dtype=torch.int32), "float tensor"),
            (torch.zeros(2, device="meta"), "one device"),
        ]
        for sinks, message in cases:
            with pytest.raises(ValueError, match=message):
                torch.ops.wmoe.wavelet_attention(*args, codec.spec, 0.125, sinks)
    finally:
        ops.set_backend(previous)


GPU_CONFIGS = [
    None,  # the package's choice (tuned: the split kernel maps its sums to channels)
    dataclasses.replace(K.TUNED_CONFIGS[(128, 4, "affine")], transform_in_split=False),
    K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")],
    K.LaunchConfig(),  # v2
]


@pytest.mark.gpu
@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: "auto" if c is None else c.kernel)
def test_gpu_sinks_at_real_shapes(channel, config):
    # gpt-oss-like: every query head its own sink; ragged lengths (1, not multiples of the step)
    seq_lens = [4096, 1, 1000, 2049, 133]
    codec, args = make_case(
        "default", 5, 2, 4, 1, 128, seq_lens, 4096, torch.bfloat16, device="cuda", channel=channel
    )
    sinks = sink_logits(8, "cuda")
    want = dense_reference(codec, args, 128**-0.5, sinks)
    plain = dense_reference(codec, args, 128**-0.5)
    for splits in (None, 1, 7):
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits, sinks=sinks)
        assert rel_err(got, want) <= 1e-2, (config, splits)
        _check_sink_matters(got, plain)
    assert not K._V3_FAILURE, K._V3_FAILURE
