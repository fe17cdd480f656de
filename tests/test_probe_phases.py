"""benchmarks/probe_attention.py phases: the summary of the split programs' globaltimer stamps
(LaunchConfig.phase_clocks), on hand-made stamps."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_benchmark


def test_phase_lengths_start_at_the_last_stamp_written():
    probe = load_benchmark("probe_attention")
    # slots: wait, query, steps 0, 1, 2, 3+, masked, epilogue (ns), SM, full steps. The second
    # program ran one full step: its masked steps start after step 0, not at a skipped slot
    rows = torch.tensor(
        [
            [1000, 3000, 5000, 7000, 9000, 11000, 11000, 14000, 3, 4],
            [2000, 4500, 6000, -1, -1, -1, 8000, 10000, 5, 1],
            [1500, 4000, -1, -1, -1, -1, 4500, 6500, 3, 0],
        ]
    )
    got = probe.summarise_phases(rows)
    assert got["programs"] == 3 and got["full_steps"] == [0, 1, 4]
    assert got["phase_us"]["query"]["min"] == pytest.approx(2.0)
    assert got["phase_us"]["query"]["max"] == pytest.approx(2.5)
    assert got["phase_us"]["step 1"]["p50"] == pytest.approx(2.0)  # the one program with step 1
    masked = got["phase_us"]["masked steps"]
    assert (masked["min"], masked["max"]) == pytest.approx((0.0, 2.0))  # 11000 - 11000, 8000 - 6000
    assert got["phase_us"]["epilogue"]["max"] == pytest.approx(3.0)
    since = got["since_first_wait_us"]
    assert since["wait done"]["max"] == pytest.approx(1.0) and since["epilogue"]["max"] == pytest.approx(13.0)
    assert got["programs_per_sm"] == dict(min=1, max=2, sms=2)
    # (between stamps of adjacent slots: 6000 - 4500)
    assert got["smallest_stamp_step_ns"] == pytest.approx(1500.0)
