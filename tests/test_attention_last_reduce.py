"""The reduce in each pair's last program (LaunchConfig.reduce_in_last_program,
kernels/attention_last_reduce.py): against decompress + attention in float64 and against the
reduce kernels, on fresh random inputs and ragged lengths.

On the CPU the interpreter runs v1 with it (programs run one after another there, so the pair's
last split reduces). On the GPU v3 runs it with the exact-token kernel in the three orders the
launcher has: beside the split kernel on the side stream (either may be last), before it on the
same stream (a split program is last) and chained after it (an exact program is last).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_wavelet_attention import (
    TUNED_V3,
    UNIFORM_REAL,
    UNIFORM_SPEC,
    _run_triton,
    dense_reference,
    make_case,
    rel_err,
)
from wmoe_compile.kernels import attention_last_reduce as LR
from wmoe_compile.kernels import wavelet_attention as K

V1_IN_LAST = K.LaunchConfig(kernel="v1", num_stages=1, reduce_in_last_program=True)


class _KeptCounters:
    """Stands in for attention_last_reduce.arrival_counters: hands out counters filled with
    `garbage` (what torch.empty may hold; the prologue must zero them) and keeps each call's."""

    def __init__(self, garbage: int):
        self.garbage, self.calls = garbage, []

    def __call__(self, device, programs):
        counters = torch.full((programs,), self.garbage, dtype=torch.int32, device=device)
        self.calls.append(counters)
        return counters


@pytest.mark.parametrize(
    ("batch", "group", "tq", "head_dim", "lens", "channel"),
    [
        (3, 4, 1, 128, [75, 1, 40], "scale"),  # decode, length 1 among them
        (2, 4, 1, 128, [75, 33], "full"),  # value offset and rotation (W R s per kv head)
        (2, 4, 2, 64, [70, 9], "scale"),  # two new tokens: 8 rows a program, 8 partials a load
        (1, 2, 1, 256, [61], "full"),  # head_dim 256: 2 partials a load
    ],
)
def test_v1_reduce_in_last_program_matches_the_reference_and_the_reduce_kernels(
    batch, group, tq, head_dim, lens, channel, monkeypatch
):
    codec, args = make_case(
        UNIFORM_SPEC, batch, 2, group, tq, head_dim, lens, max(lens), torch.float16, "cpu", channel
    )
    kept = _KeptCounters(garbage=-7)
    monkeypatch.setattr(K, "arrival_counters", kept)
    want = dense_reference(codec, args, head_dim**-0.5)
    unfused = dataclasses.replace(V1_IN_LAST, reduce_in_last_program=False)
    reference_path = _run_triton(args, codec, head_dim**-0.5, config=unfused, num_splits=3)
    assert not kept.calls  # the reduce kernels' path makes none
    got = _run_triton(args, codec, head_dim**-0.5, config=V1_IN_LAST, num_splits=3)
    assert rel_err(got, want) <= 1e-2
    # the same partials merged in another order (fp32), rounded to fp16
    assert rel_err(got, reference_path.double()) <= 2e-3
    # zeroed by the prologue, then each of a program's 3 splits and its exact part arrived once
    (counters,) = kept.calls
    assert counters.tolist() == [4] * counters.numel()
    # a second call with a fresh query: its own counters, reduced again
    args[0].copy_(torch.randn_like(args[0]))
    again = _run_triton(args, codec, head_dim**-0.5, config=V1_IN_LAST, num_splits=2)
    assert rel_err(again, dense_reference(codec, args, head_dim**-0.5)) <= 1e-2
    assert kept.calls[1].tolist() == [3] * counters.numel()


def test_a_pair_whose_counter_is_not_zeroed_is_never_reduced(monkeypatch):
    # the check that can fail: without the prologue's zeroing (here: the flag taken away), the
    # counters start from garbage, no program sees itself last and no output row is written
    codec, args = make_case(UNIFORM_SPEC, 2, 2, 4, 1, 128, [75, 40], 75, torch.float16, "cpu")
    kept = _KeptCounters(garbage=100)
    monkeypatch.setattr(K, "arrival_counters", kept)
    real_launch = K.launch

    def launch_without_zeroing(kernel, grid, *a, **kw):
        kw.pop("ZERO_ARRIVALS", None)
        real_launch(kernel, grid, *a, **kw)

    monkeypatch.setattr(K, "launch", launch_without_zeroing)
    out = torch.full_like(args[0], float("nan"))
    monkeypatch.setattr(K.torch, "empty", _empty_returning(out, args[0].shape))
    got = _run_triton(args, codec, 0.125, config=V1_IN_LAST, num_splits=2)
    assert got is out and torch.isnan(got).all()
    assert kept.calls[0].tolist() == [103] * 4  # 2 splits and the exact part arrived on 100


def _empty_returning(tensor, shape):
    """torch.empty that hands out `tensor` for `shape` (the op's output), else allocates."""
    real_empty = torch.empty

    def empty(*size, **kw):
        wanted = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, torch.Size)) else size
        return tensor if tuple(wanted) == tuple(shape) else real_empty(*size, **kw)

    return empty


def test_parts_per_load_keeps_a_warps_registers():
    assert LR.parts_per_load(4, 128) == 4
    assert LR.parts_per_load(8, 128) == 2
    assert LR.parts_per_load(4, 64) == 8
    assert LR.parts_per_load(4, 256) == 2
    assert LR.parts_per_load(8, 256) == 1


def test_reduce_in_last_program_is_skipped_where_a_program_has_many_rows():
    # prefill-sized row blocks (16 rows x 128 channels) keep the reduce kernels: the epilogue's
    # [parts, rows, D] loads are sized for one warp and at most 8 rows
    codec, args = make_case(UNIFORM_SPEC, 1, 2, 4, 4, 128, [60], 60, torch.float16, "cpu")
    got = _run_triton(args, codec, 0.125, config=V1_IN_LAST, num_splits=2)
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2


# ---- GPU: v3 (Gluon split kernel and Triton exact-token kernel)

ORDERS = {
    "beside": dict(overlap_exact=True),  # side stream: either kernel's program may be last
    "exact_first": dict(overlap_exact=False),  # same stream, exact kernel first: a split is last
    "exact_chained": dict(overlap_exact=False, exact_in_chain=True, pdl=False),  # an exact one is
}


@pytest.mark.gpu
@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("channel", ["scale", "full"])
def test_gpu_v3_reduce_in_last_program(order, channel):
    lens = [4096, 1, 1000, 2049, 133]
    codec, args = make_case(UNIFORM_REAL, 5, 8, 4, 1, 128, lens, 4096, torch.bfloat16, "cuda", channel)
    config = dataclasses.replace(TUNED_V3, reduce_in_last_program=True, **ORDERS[order])
    unfused = dataclasses.replace(config, reduce_in_last_program=False)
    want = dense_reference(codec, args, 128**-0.5)
    for splits in (None, 7):
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
        assert not K._V3_FAILURE, K._V3_FAILURE
        assert torch.isfinite(got).all()
        assert rel_err(got, want) <= 1e-2
        assert (
            rel_err(got, _run_triton(args, codec, 128**-0.5, config=unfused, num_splits=splits).double())
            <= 2e-3
        )


@pytest.mark.gpu
def test_gpu_v3_reduce_in_last_program_replays_from_a_cuda_graph():
    # the counters are the captured call's own, zeroed by its prologue on every replay: each
    # replay with a fresh query must equal an eager call
    codec, args = make_case(
        UNIFORM_REAL, 8, 8, 4, 1, 128, [3000] * 4 + [1, 700, 2999, 64], 3000, torch.bfloat16, "cuda"
    )
    config = dataclasses.replace(TUNED_V3, reduce_in_last_program=True)
    _run_triton(args, codec, 128**-0.5, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run_triton(args, codec, 128**-0.5, config=config)
    for round_ in range(3):
        args[0].copy_(torch.randn_like(args[0]))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, _run_triton(args, codec, 128**-0.5, config=config)), round_
        assert rel_err(captured, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE
