"""benchmarks/profile_decode.py's step breakdown: CUDA kernel names map to the step's parts, and the
table's per-step figures are the profile's totals divided by the profiled steps."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_benchmark


@pytest.mark.parametrize(
    "kernel,part",
    [
        ("split_kernel_v3", "attention"),
        ("_split_kernel_v2", "attention"),
        ("_reduce_rows_kernel", "attention"),
        ("_prologue_kernel", "attention"),
        ("_prologue_heads_kernel", "attention"),
        ("_exact_kernel", "attention"),
        ("_transform_heads_kernel", "attention"),
        ("_gate_up_direct_kernel", "MoE"),
        ("_down_kernel", "MoE"),
        ("_align_kernel", "MoE"),
        ("_kv_compress_kernel", "KV compress"),
        (
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1_execute",
            "dense GEMMs",
        ),
        (
            "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn>",
            "dense GEMMs",
        ),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", "dense GEMMs"),
        # the H200 profile of 2026-12-01 (torch 2.11, CUDA 13): lm_head and the q/k/v projections
        ("nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT", "dense GEMMs"),
        ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT", "dense GEMMs"),
        ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>", "router top-k"),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "other"),
        ("triton_poi_fused__to_copy_add_cat_0", "other"),
    ],
)
def test_kernels_map_to_their_part(kernel, part):
    assert load_benchmark("profile_decode").part_of(kernel) == part


def test_breakdown_divides_by_the_profiled_steps_and_names_what_is_in_other():
    pd = load_benchmark("profile_decode")
    kernels = {
        "split_kernel_v3": (5300.0, 20),  # us over 10 steps, calls
        "_gate_up_direct_kernel": (7000.0, 20),
        "triton_poi_fused_add_0": (300.0, 40),
        "triton_red_fused_mean_1": (100.0, 10),
    }
    table = pd.breakdown(kernels, steps=10)
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:5]
        for line in table.splitlines()
        if line.startswith("| ")
    }
    assert rows["attention"] == [" 0.530 ", " 41.7% ", " 2 "]
    assert rows["MoE"][0].strip() == "0.700"
    assert rows["other"] == [" 0.040 ", " 3.1% ", " 5 "]
    assert rows["total"][0].strip() == "1.270"
    assert "largest in other: triton_poi_fused_add_0 30.0 us; triton_red_fused_mean_1 10.0 us" in table
    with pytest.raises(ValueError, match="steps"):
        pd.breakdown(kernels, steps=0)
    with pytest.raises(ValueError, match="no kernel time"):  # e.g. a profile without CUDA rows
        pd.breakdown({}, steps=10)


def test_kernel_times_reads_the_profilers_rows():
    # the same field access as on the GPU, on a CPU profile (ops instead of kernels)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            torch.topk(x @ x, 2)
    times = load_benchmark("profile_decode").kernel_times(prof.key_averages(), DeviceType.CPU)
    us, calls = times["aten::topk"]
    assert calls == 3 and us > 0


def _span(pd, name, start, end, stream=7):
    return pd.KernelSpan(name, start, end, stream)


def test_trace_kernels_reads_only_kernel_events_in_start_order():
    pd = load_benchmark("profile_decode")
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "b", "ts": 20.0, "dur": 5.0, "args": {"stream": 7}},
            {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 3.0, "args": {}},
            {"cat": "kernel", "name": "a", "ts": 10.0, "dur": 4.0, "args": {"stream": 9}},
            {"ph": "M", "name": "process_name"},  # metadata rows have no category or duration
        ]
    }
    assert pd.trace_kernels(trace) == [_span(pd, "a", 10.0, 14.0, 9), _span(pd, "b", 20.0, 25.0, 7)]


def test_split_replays_cuts_only_at_long_idle_gaps():
    pd = load_benchmark("profile_decode")
    # a long kernel covers the short gap after the second one: the first replay is three kernels
    kernels = [
        _span(pd, "a", 0, 100),
        _span(pd, "b", 10, 20),
        _span(pd, "c", 90, 110),
        _span(pd, "d", 2000, 2010),
    ]
    replays = pd.split_replays(kernels, min_gap_us=500)
    assert [[k.name for k in r] for r in replays] == [["a", "b", "c"], ["d"]]


def test_replay_timeline_counts_idle_time_only_where_no_stream_runs():
    pd = load_benchmark("profile_decode")
    kernels = [
        _span(pd, "prologue", 0, 4),
        _span(pd, "split", 6, 30),  # 2 us idle before it
        _span(pd, "exact", 8, 12, stream=9),  # beside split on a second stream: no idle
        _span(pd, "reduce", 31, 35),  # 1 us idle after split
        _span(pd, "gemm", 38, 40),  # 3 us idle after reduce
    ]
    t = pd.replay_timeline(kernels)
    assert t.span_us == 40
    assert t.busy_us == 4 + 24 + 4 + 2
    assert t.idle_us == 6
    assert t.kernel_us == 4 + 24 + 4 + 4 + 2
    assert t.gaps == ((3, "reduce", "gemm"), (2, "prologue", "split"), (1, "split", "reduce"))
    report = pd.timeline_report([t, t, t])
    assert "idle 6.0 us in 3 gaps" in report
    assert report.index("reduce  ->  gemm") < report.index("prologue  ->  split")


def test_timeline_refuses_empty_input():
    pd = load_benchmark("profile_decode")
    with pytest.raises(ValueError, match="at least one kernel"):
        pd.replay_timeline([])
    with pytest.raises(ValueError, match="no replay"):
        pd.timeline_report([])
    # what a trace exported after a second profiler session holds: every kernel at 0, no duration
    with pytest.raises(ValueError, match="none of the 2 kernels has a duration"):
        pd.replay_timeline([_span(pd, "a", 0, 0), _span(pd, "b", 0, 0)])
