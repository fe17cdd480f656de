"""The launch-config lists that benchmarks/device_pending.sh hands to probe_attention.py on the GPU.

A file naming a LaunchConfig field that no longer exists (an option removed after a failed
experiment) or holding an invalid combination would only fail on the device, after the machine
started and the budget was spent: check every one here, on the CPU."""

from __future__ import annotations

import json
import pathlib

import pytest
from wmoe_compile.kernels import wavelet_attention as wa

PROBES = sorted((pathlib.Path(__file__).parent.parent / "benchmarks" / "configs").glob("probe_*.json"))


def test_there_are_probe_files():
    assert len(PROBES) > 10, PROBES


@pytest.mark.parametrize("path", PROBES, ids=lambda p: p.name)
def test_probe_file_holds_valid_launch_configs(path):
    configs = json.loads(path.read_text())
    assert isinstance(configs, list) and configs, f"{path.name}: a non-empty list of configs"
    for i, config in enumerate(configs):
        if config == "auto":  # timeline and phases: the package's own choice for the shape
            continue
        assert isinstance(config, dict), f"{path.name}[{i}]: a LaunchConfig dict or 'auto', got {config!r}"
        wa.LaunchConfig(**config)  # raises on an unknown field or an invalid combination


def test_an_unknown_field_is_refused():
    # the check above is only worth something if a stale field fails
    with pytest.raises(TypeError, match="balanced_pieces"):
        wa.LaunchConfig(balanced_pieces=True)


@pytest.mark.parametrize(
    "name, head_dim, heads",
    [
        ("probe_head_dim64.json", 64, (8, 1)),
        ("probe_head_dim64_stacked2.json", 64, (8, 1)),
        ("probe_head_dim256.json", 256, (4, 1)),
    ],
)
def test_head_dim_grids_run_correctly_at_their_head_dim(name, head_dim, heads):
    # device_pending.sh head_dim_grid / stacked time these Triton-kernel configs at head_dim 64
    # (gpt-oss's 64 / 8 heads: GQA groups of 8) and 256 (groups of 4) against the untuned default
    # (the grid's base); each must run and match decompress + attention (the interpreter runs the
    # same kernels), so that the device call times only configs that work. The second grid's
    # winner is what the package launches at head_dim 64 since the forty-sixth session.
    from bench_scripts import load_benchmark

    bench = load_benchmark("bench_attention")
    configs = json.loads((PROBES[0].parent / name).read_text())
    unique = [c for i, c in enumerate(configs) if c not in configs[:i]]
    setup = bench.Setup(2, 700, *heads, "cpu", smoke=True, head_dim=head_dim)
    setup.use_codec(bench.CODECS["default"])
    block_m = wa._block_m(heads[0] // heads[1])
    assert wa.LaunchConfig(**unique[0]) == wa.default_config(head_dim, block_m), unique[0]
    if name == "probe_head_dim64_stacked2.json":
        assert wa.LaunchConfig(**unique[1]) == wa.tuned_config(setup.layout, head_dim, block_m)
    assert len(unique) >= 6, name
    for config in unique:
        err = bench.rel_error(setup, wa.LaunchConfig(**config))
        assert err <= 1e-2, (config, err)  # (a NaN fails the comparison too)
