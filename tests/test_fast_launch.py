"""kernels/fast_launch.py: when a kept CompiledKernel is reused and when the ordinary launch runs,
on a stand-in kernel (this machine compiles nothing); and every project launch site passes its
runtime arguments positionally, as the fast path needs (else it silently stays on the slow one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from wmoe_compile.kernels import fast_launch as fl
from wmoe_compile.kernels import kv_codec as kc
from wmoe_compile.kernels import moe_align as ma
from wmoe_compile.kernels import tiled_moe as tm
from wmoe_compile.kernels import wavelet_attention as wa

from wmoe_compile.codec import get_codec
from wmoe_compile.moe_packing import pack_expert_weights
from wmoe_compile.ops import kv_codec as kv_ops


def _body(x_ptr, n, scale, BLOCK: tl.constexpr, FLAG: tl.constexpr = 3):  # the stand-in's signature
    pass


class _Compiled:
    packed_metadata = object()

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        assert len(grid) == 3, f"CompiledKernel[grid] reads grid[0], grid[1] and grid[2], got {grid}"
        return lambda *args: self.log.append(("compiled", grid, args))


class _Kernel:
    """Records launches like JITFunction[grid](...) and returns a compiled stand-in."""

    def __init__(self):
        self.fn = _body
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Compiled(self.log)

        return run


@pytest.fixture
def compiling(monkeypatch):
    """The fast path as on a GPU machine: not interpreting, device 0."""
    monkeypatch.setattr(fl, "interpreting", lambda: False)
    monkeypatch.setattr(fl.torch.cuda, "current_device", lambda: 0)
    return _Kernel()


def _kinds(kernel):
    return [entry[0] for entry in kernel.log]


def test_second_launch_reuses_the_compiled_kernel_with_constexprs_in_order(compiling):
    k = compiling
    x = torch.zeros(64)
    fl.launch(k, (4,), x, 7, 0.5, BLOCK=32, num_warps=2)
    fl.launch(k, (8, 2), x, 7, 0.25, BLOCK=32, num_warps=2)  # a new float and grid: still a hit
    fl.launch(k, (5,), x, 7, 0.25, BLOCK=32, num_warps=2)
    assert _kinds(k) == ["jit", "compiled", "compiled"]
    assert [entry[1] for entry in k.log[1:]] == [(8, 2, 1), (5, 1, 1)]  # padded to three dimensions
    assert k.log[1][2] == (x, 7, 0.25, 32, 3)  # runtime args, then BLOCK and FLAG's default


def test_launches_ask_for_fused_multiply_adds_unless_the_call_says_otherwise(compiling):
    # Triton 3.10 turns the default off (3.9 warns): the kernels were tuned and measured with it on
    k = compiling
    x = torch.zeros(64)
    fl.launch(k, (1,), x, 7, 1.0, BLOCK=32)
    fl.launch(k, (1,), x, 7, 1.0, BLOCK=32, enable_fp_fusion=False)
    assert [entry[3].get("enable_fp_fusion") for entry in k.log] == [True, False]
    moe_launches = tm._CompiledLaunches(_Kernel())
    moe_launches(None, (1, 1, 1), (x, 7, 1.0), {"BLOCK": 32}, (32, 3))
    assert moe_launches.kernel.log[0][3] == {"enable_fp_fusion": True, "BLOCK": 32}


def test_what_changes_the_key(compiling):
    k = compiling
    buf = torch.zeros(64, dtype=torch.uint8)
    fl.launch(k, (1,), buf, 16, 1.0, BLOCK=32)
    fl.launch(k, (1,), buf[1:], 16, 1.0, BLOCK=32)  # misaligned pointer
    fl.launch(k, (1,), buf.view(torch.int8), 16, 1.0, BLOCK=32)  # dtype
    fl.launch(k, (1,), buf, 1, 1.0, BLOCK=32)  # an int Triton would specialise differently
    fl.launch(k, (1,), buf, 16, 1.0, BLOCK=64)  # a constexpr
    fl.launch(k, (1,), buf, 16, 1.0, BLOCK=32, num_warps=8)  # a launch option
    assert _kinds(k) == ["jit"] * 6
    fl.launch(k, (1,), buf, 1, 1.0, BLOCK=32)
    assert _kinds(k)[-1] == "compiled"


def test_ordinary_launch_when_the_fast_path_cannot_apply(compiling, monkeypatch):
    k = compiling
    x = torch.zeros(64)
    for _ in range(2):
        fl.launch(k, (1,), x, 7, scale=1.0, BLOCK=32)  # a runtime argument by keyword
        fl.launch(k, (1,), x, 7, 1.0, BLOCK=32, FLAG=[1])  # unhashable keyword value
    assert _kinds(k) == ["jit"] * 4
    monkeypatch.setattr(fl, "ENABLED", False)
    fl.launch(k, (1,), x, 7, 1.0, BLOCK=32)
    fl.launch(k, (1,), x, 7, 1.0, BLOCK=32)
    assert _kinds(k)[-2:] == ["jit", "jit"]


def test_kept_kernels_are_bounded(compiling, monkeypatch):
    k = compiling
    monkeypatch.setattr(fl, "MAX_ENTRIES_PER_KERNEL", 2)
    x = torch.zeros(64)
    for n in (16, 32, 48, 16, 48):
        fl.launch(k, (1,), x, n, 1.0, BLOCK=32)
    assert _kinds(k) == ["jit", "jit", "jit", "compiled", "jit"]  # 48 was never kept
    fl.clear()
    fl.launch(k, (1,), x, 16, 1.0, BLOCK=32)
    assert _kinds(k)[-1] == "jit"


def _body_with_carveout(x_ptr, n, BLOCK: tl.constexpr, CARVEOUT: tl.constexpr = -1):
    pass


class _CompiledWithFunction(_Compiled):
    function = 1234  # a loaded CUfunction handle


class _CarveoutKernel(_Kernel):
    def __init__(self):
        super().__init__()
        self.fn = _body_with_carveout

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _CompiledWithFunction(self.log)

        return run


def test_a_carveout_constexpr_is_set_on_each_compiled_variant_once(compiling, monkeypatch):
    # CARVEOUT >= 0 keys its own compiled variant, whose function gets that preferred carveout after
    # its first launch; a kept variant's later launches need no driver call; -1 asks for none
    calls = []
    monkeypatch.setattr(fl, "set_preferred_carveout", lambda compiled, percent: calls.append(percent))
    k = _CarveoutKernel()
    x = torch.zeros(64)
    fl.launch(k, (1,), x, 7, BLOCK=32, CARVEOUT=44)
    fl.launch(k, (1,), x, 7, BLOCK=32, CARVEOUT=44)
    fl.launch(k, (1,), x, 7, BLOCK=32)  # the driver's choice: another variant, nothing set
    fl.launch(k, (1,), x, 7, BLOCK=32, CARVEOUT=0)
    assert _kinds(k) == ["jit", "compiled", "jit", "jit"]
    assert calls == [44, 0]
    monkeypatch.setattr(fl, "ENABLED", False)  # the ordinary launch every time: set every time
    fl.launch(k, (1,), x, 7, BLOCK=32, CARVEOUT=44)
    assert calls == [44, 0, 44]


def test_a_carveout_out_of_range_or_without_a_loaded_function_is_refused():
    with pytest.raises(ValueError, match="percent from 0 to 100"):
        fl.set_preferred_carveout(_CompiledWithFunction([]), 101)
    with pytest.raises(RuntimeError, match="no loaded function"):
        fl.set_preferred_carveout(object(), 44)
    if not torch.cuda.is_available():  # this machine has no driver library: said so, not a crash
        saved = fl._LIBCUDA.copy()
        fl._LIBCUDA.clear()
        try:
            with pytest.raises(RuntimeError, match="CUDA driver library"):
                fl.set_preferred_carveout(_CompiledWithFunction([]), 44)
        finally:
            fl._LIBCUDA[:] = saved


def test_exact_carveout_must_be_a_percent():
    assert wa.LaunchConfig(exact_carveout=44).exact_carveout == 44
    for bad in (-2, 101):
        with pytest.raises(ValueError, match="exact_carveout is a percent"):
            wa.LaunchConfig(exact_carveout=bad)


@pytest.fixture
def recorded_launches(monkeypatch):
    """(kernel name, positional args, runtime parameters) of every launch through the project's sites."""
    seen = []
    real = fl.launch

    def record(kernel, grid, *args, **kwargs):
        seen.append((kernel.fn.__name__, len(args), fl.kernel_info(kernel).n_runtime))
        real(kernel, grid, *args, **kwargs)

    for module in (wa, kc, tm, ma):
        monkeypatch.setattr(module, "launch", record)
    return seen


def test_every_launch_site_passes_runtime_arguments_positionally(recorded_launches, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("checks the interpreter's launches on the CPU machine")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_attention as ba

    setup = ba.Setup(1, 300, ba.HQ, ba.HKV, "cpu", smoke=True)
    setup.use_codec(ba.CODECS["default"])
    for config in (
        wa.LaunchConfig(kernel="v1", block_n=16, row_reduce_max_programs=1e9),  # the per-row reduce
        wa.LaunchConfig(kernel="v2", block_n=16, row_reduce_max_programs=0.0),  # the block reduce
    ):
        wa.wavelet_attention_triton(*setup.args(0), setup.layout, setup.sm_scale, config=config)
    monkeypatch.setattr(wa, "PROLOGUE_HEADS_MIN_ROWS", 0)  # the decode prologue of large batches
    small_steps = wa.LaunchConfig(block_n=16)
    wa.wavelet_attention_triton(*setup.args(0), setup.layout, setup.sm_scale, config=small_steps)
    codec = get_codec("default", 64)
    caches = kv_ops.allocate_cache("default", 1, 2, 8, 64, torch.float32)
    kc.compress_into_cache_triton(codec, torch.randn(1, 2, 1, 64), *caches, torch.tensor([3]), torch.empty(0))
    gate, up, down = (torch.randn(4, 32, 32) / 6 for _ in range(3))
    packed = pack_expert_weights(w1=gate, w3=up, w2=down)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [1, 3]])
    weights = torch.full((5, 2), 0.5)
    tm.tiled_moe_triton(torch.randn(5, 32), ids, weights, packed.w_gate_up, packed.w_down)
    ma.group_by_expert_blocked(ids, 4, 16)
    names = {name for name, _, _ in recorded_launches}
    expected = {
        "_prologue_kernel",
        "_prologue_heads_kernel",
        "_split_kernel",
        "_split_kernel_v2",
        "_reduce_kernel",
        "_reduce_rows_kernel",
        "_kv_compress_kernel",
        "_align_kernel",
        "_gate_up_kernel",
        "_down_kernel",
        "_block_histogram_kernel",
        "_block_scatter_kernel",
    }
    assert expected <= names, f"not launched: {expected - names}"
    wrong = [(name, n, want) for name, n, want in recorded_launches if n != want]
    assert not wrong, f"launch sites passing a runtime argument by keyword: {wrong}"
