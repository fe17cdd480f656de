"""benchmarks/bench_decode.py's host side (the run itself needs a GPU): its arguments are checked
before anything runs, and its table renders rows whose eager variants were skipped."""

from __future__ import annotations

import pytest
from bench_scripts import load_benchmark


@pytest.mark.parametrize(
    "argv",
    [
        ["--skip", "eagr"],
        ["--wmoe-inductor-config", "[1, 2]"],
        ["--wmoe-inductor-config", "{not json"],
        ["--wmoe-off", "decompose_topk,fuse_linear"],
    ],
)
def test_bad_arguments_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("bench_decode").main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert argv[0].lstrip("-") in err, err


def test_rows_without_eager_render_with_dashes_and_the_options_in_the_header():
    bench = load_benchmark("bench_decode")
    env = dict(
        layers=2,
        gpu="H200",
        torch="2.11",
        triton="3.6",
        date="2026-11-30",
        codec="default",
        wmoe_off=["decompose_topk", "fuse_linears"],
        wmoe_inductor_config={"max_autotune_gemm": True},
    )
    row = dict(B=8, N=131072, wmoe_ms=1.9, inductor_ms=3.6, wmoe={"call_ms": 3.0, "graph_ms": 1.9})
    capacity = bench.kv_capacity("default", 80.0)
    table = bench.render(env, [row], capacity)
    assert "wmoe with decompose_topk, fuse_linears off" in table and "max_autotune_gemm" in table
    line = next(x for x in table.splitlines() if x.startswith("| 8 | 131072 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:4] == ["-", "-"]  # eager routed / dense skipped
    assert cells[10] == "1.89x"  # vs inductor still computed
