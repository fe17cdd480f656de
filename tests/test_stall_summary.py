"""benchmarks/stall_summary.py reads Nsight Compute's source-page CSV: stall shares over all
samples, the hot loop, and a clear error for a file that is not that export."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_long_sb","stall_wait","stall_selected","stall_long_sb (Not Issued)"'
)


def _csv(tmp_path, body: list[str]):
    path = tmp_path / "stalls.csv"
    path.write_text("\n".join(['"Kernel Name","split_kernel_v3",', HEADER, *body]) + "\n")
    return path


def test_shares_and_hot_loop_of_a_small_export(tmp_path):
    summary = load_benchmark("stall_summary")
    path = _csv(
        tmp_path,
        [
            '"0x0","      LDC R1, c[0x0][0x28]","2","2","64","0","2","0","0"',
            '"0x10","LDG.E R98, desc[UR16][R90.64]","5","4","1,000","0","3","2","0"',
            '"0x20","LOP3.LUT R88, R98, 0xf000f, R151, 0xea, !PT","90","88","1,000","80","6","4","80"',
            '"0x30","@!P2 BRA 0x10","3","3","1,000","0","0","3","0"',
        ],
    )
    lines = summary.read_source_csv(path)
    assert [line.executed for line in lines] == [64, 1000, 1000, 1000]
    assert lines[2].stalls == {"long_sb": 80, "wait": 6, "selected": 4}  # "(Not Issued)" columns left out
    shares = dict(summary.reason_shares(lines))
    assert shares["long_sb"] == pytest.approx(80 / 100)
    assert shares["wait"] == pytest.approx(11 / 100)
    loop = summary.hot_loop(lines)
    assert [line.index for line in loop] == [1, 2, 3]
    assert summary.opcode("@!P2 BRA 0x10") == "BRA"
    assert summary.opcode_shares(loop, 100) == [("LOP3", 1, 0.90), ("LDG", 1, 0.05), ("BRA", 1, 0.03)]


def test_a_file_that_is_not_the_source_page_export_is_refused_by_name(tmp_path):
    summary = load_benchmark("stall_summary")
    path = tmp_path / "details.csv"
    path.write_text('"ID","Section Name","Metric Name"\n"0","SpeedOfLight","Duration"\n')
    with pytest.raises(ValueError, match="--page source --csv --print-source sass"):
        summary.read_source_csv(path)
