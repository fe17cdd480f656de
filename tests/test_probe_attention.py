"""benchmarks/probe_attention.py's grid summary: each config against the first one measured in the
same round, so drift between rounds (the device's clock is not pinned) cancels."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.fixture(scope="module")
def probe():
    return load_benchmark("probe_attention")


def test_a_config_is_named_by_what_it_changes(probe):
    base = {"kernel": "v3", "maxnreg": 168, "pdl": True}
    assert probe.config_label(dict(base), base) == "base"
    assert probe.config_label({**base, "maxnreg": 128, "x": 1}, base) == "maxnreg=128, x=1"
    assert probe.config_label({"kernel": "v3", "maxnreg": 168}, base) == "pdl=default"


def test_same_round_ratios_cancel_drift_between_rounds(probe):
    base = {"a": 1}
    other = {"a": 2}
    # round 2 runs 10% slower for everything: B is 10% / 5% faster / slower than A in each round
    rows = [
        {"config": base, "ms": [1.0, 2.0]},
        {"config": other, "ms": [0.9, 2.1]},
        {"config": base, "ms": [1.1, 2.2]},
        {"config": other, "ms": [0.99, 2.31]},
    ]
    table = probe.same_round_summary(rows, [(8, 131072), (32, 32768)])
    lines = table.splitlines()
    assert lines[0] == "| against base, same round | (8, 131072) | (32, 32768) |"
    assert lines[2] == "| a=2 | -10.0% (-10.0 .. -10.0, 2 rounds) | +5.0% (+5.0 .. +5.0, 2 rounds) |"
    # a config listed more often than the base is compared only in rounds that have both
    rows.append({"config": other, "ms": [5.0, 5.0]})
    assert "2 rounds" in probe.same_round_summary(rows, [(8, 131072), (32, 32768)]).splitlines()[2]
