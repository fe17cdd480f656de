"""benchmarks/read_floor.py reads exactly the bytes the attention split kernel reads: its kernel's
XOR per program must equal the XOR of that program's slice of codes and scales (a read that skipped
or repeated words, or used the wrong head or split bounds, would change it)."""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load_read_floor():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("read_floor", BENCH / "read_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _xor(words: torch.Tensor) -> int:
    return functools.reduce(lambda a, b: a ^ b, words.tolist(), 0)


def test_read_kernel_reads_each_split_exactly():
    read_floor = _load_read_floor()
    sequences, heads, tokens, splits = 2, 3, 100, 3  # 100 tokens: the last split is short
    chunk = -(-tokens // splits)
    k_codes, v_codes = (
        torch.randint(0, 256, (sequences, heads, tokens, 48), dtype=torch.uint8) for _ in "kv"
    )
    k_scales, v_scales = (torch.rand(sequences, heads, tokens, 2).half() for _ in "kv")
    words = [
        x.reshape(sequences * heads, -1).view(torch.int32) for x in (k_codes, v_codes, k_scales, v_scales)
    ]
    out = torch.zeros(splits * sequences * heads, dtype=torch.int32)
    read_floor._read_split_kernel[(splits, sequences * heads)](
        *words, out, tokens, chunk, ROW_WORDS=12, BLOCK=64, num_warps=1
    )
    for split in range(splits):
        lo, hi = split * chunk, min(split * chunk + chunk, tokens)
        for head in range(sequences * heads):
            want = _xor(words[0][head, lo * 12 : hi * 12]) ^ _xor(words[1][head, lo * 12 : hi * 12])
            want ^= _xor(words[2][head, lo:hi]) ^ _xor(words[3][head, lo:hi])
            got = out[split * sequences * heads + head].item() & 0xFFFFFFFF
            assert got == want & 0xFFFFFFFF, (split, head)


def _run_bench_attention(tmp_path, *options: str):
    import os
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run(
        [sys.executable, "-P", str(BENCH / "bench_attention.py"), "--smoke", "--codec", "default"]
        + ["--out", str(tmp_path), *options],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("heads, smoke_heads", [(None, "8 query / 2 kv"), ("32,4", "16 query / 2 kv")])
def test_bench_attention_runs_as_the_device_runs_it(tmp_path, heads, smoke_heads):
    # `python -P` (the device's way) leaves the script's folder off sys.path; bench_attention
    # imports read_floor from there. The smoke run (CPU, interpreter, tiny shapes) writes its table;
    # --heads sets the GQA group (the smoke run keeps the group with two kv heads)
    run = _run_bench_attention(tmp_path, *(["--heads", heads] if heads else []))
    assert run.returncode == 0, run.stderr[-2000:]
    table = (tmp_path / "attention.md").read_text()
    assert "| read floor ms | x read floor |" in table
    assert f"{smoke_heads} heads, D 128" in table.splitlines()[0]
    # each row's speedup is the median of its alternating rounds' ratios (time_alternating)
    import json
    import statistics

    for row in json.loads((tmp_path / "attention.json").read_text())["codecs"]["default"]["results"]:
        rounds = list(zip(row["sdpa_rounds_ms"], row["ours_rounds_ms"], strict=True))
        assert rounds and row["speedup"] == statistics.median(p / o for p, o in rounds)
        assert row["ms"] == statistics.median(row["ours_rounds_ms"])


def test_bench_attention_times_other_head_dims(tmp_path):
    # --head-dim 64 (gpt-oss's heads, 64 / 8) with its learned sink logits (--sinks): caches,
    # queries and SDPA's dense tensors all take it, the table says so and every row's output
    # agrees with the reference (which applies the same sinks)
    import json

    run = _run_bench_attention(tmp_path, "--head-dim", "64", "--heads", "64,8", "--sinks")
    assert run.returncode == 0, run.stderr[-2000:]
    title = (tmp_path / "attention.md").read_text().splitlines()[0]
    assert "16 query / 2 kv heads, D 64; learned sink logits in ours" in title
    record = json.loads((tmp_path / "attention.json").read_text())
    assert record["info"]["head_dim"] == 64 and record["info"]["bytes_per_vector"] == 28
    assert record["info"]["sinks"] is True
    rows = record["codecs"]["default"]["results"]
    assert rows and all(row["rel_err"] < 1e-2 for row in rows)


@pytest.mark.parametrize("options", [["--head-dim", "96"], ["--head-dim", "64", "--sweep"]])
def test_bench_attention_refuses_head_dims_it_cannot_time(tmp_path, options):
    run = _run_bench_attention(tmp_path, *options)
    assert run.returncode == 2 and "--head-dim" in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize("heads", ["30,4", "32", "a,b", "0,4"])
def test_bench_attention_refuses_heads_the_op_would_refuse(tmp_path, heads):
    run = _run_bench_attention(tmp_path, "--heads", heads)
    assert run.returncode == 2 and "--heads" in run.stderr, run.stderr[-2000:]


def test_probe_clocks_reads_nvidia_smi_samples(tmp_path):
    # probe_clocks.py lines the replays' times up with nvidia-smi's samples: its timestamps are
    # local wall-clock time with milliseconds; a line cut off when the sampler stops is skipped
    import time

    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("probe_clocks", BENCH / "probe_clocks.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    t0 = time.time()
    stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(int(t0) + 2))
    log = tmp_path / "clocks.csv"
    log.write_text(
        "timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], power.draw [W], "
        "temperature.gpu, clocks_event_reasons.active\n"
        f"{stamp}.250, 1785, 3201, 697.12, 61, 0x0000000000000004\n"
        f"{stamp}.300, 17"
    )
    (sample,) = probe.read_clocks(log, t0)
    assert abs(sample[0] - (int(t0) + 2.25 - t0)) < 1e-3
    assert sample[1:] == (1785.0, 697.12, "0x0000000000000004")


def test_bench_attention_table_reports_the_sustained_figures():
    # --sustained adds each shape's figures replayed alone for a few seconds, below the table
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_attention", BENCH / "bench_attention.py")
    ba = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ba)
    info = dict(date="2026-12-02", gpu="H200", torch="2.11", triton="3.6", bytes_per_vector=52)
    info.update(heads=dict(q=32, kv=8), head_dim=128)
    row = dict(B=8, N=131072, ms=0.25, bytes=8.76e8, TBps=3.5, x_floor=1.2, read_floor_ms=0.2)
    row.update(x_read_floor=1.25, sdpa_ms=0.95, speedup=3.8, rel_err=7e-4)
    held = dict(row, sustained=dict(seconds=3.0, ms=0.262, sdpa_ms=0.928, speedup=0.928 / 0.262))
    table = ba._table(info, "default", "tuned", [held, dict(row, B=32, N=32768, sustained=None)])
    assert table.splitlines()[-1] == (
        "Sustained (3 s of each, after the first second): (8, 131072) 0.2620 ms against SDPA 0.9280: 3.54x"
    )
    assert "Sustained" not in ba._table(info, "default", "tuned", [row])


def test_bench_window_runs_as_the_device_runs_it(tmp_path):
    # bench_window (gpt-oss's sliding layers): the smoke run's rows check the op's output against
    # the reference with the same sinks and window, and time both peers
    import json
    import os
    import subprocess

    run = subprocess.run(
        [sys.executable, "-P", str(BENCH / "bench_window.py"), "--smoke", "--out", str(tmp_path)],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "window.json").read_text())["results"]
    assert [r["B"] for r in rows] == [1, 2]
    assert all(r["rel_err"] < 1e-2 and r["sdpa_window_ms"] > 0 and r["before_ms"] > 0 for r in rows)
    assert "| B | ms | bytes | floor ms |" in (tmp_path / "window.md").read_text()
