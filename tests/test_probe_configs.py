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
