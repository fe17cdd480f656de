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
