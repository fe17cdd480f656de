"""`wmoe-compile eval --compiled`: the CE drift through the rewritten graph equals the harness's.

A tiny random Llama-style HF model (nothing downloaded) reads bytes of CPython's pydoc topics
(vocab 256 = one id per byte). Its q/k/v weights are scaled up so attention is peaked and reading a
position compressed instead of exact changes the output measurably; the codec is a harsh one
(every coefficient at 2 bits) for the same reason.

Tolerances, derived: both computations apply the same codec with the same channel parameters
to the same positions; they differ only in fp32 operation order (whole-window encode + SDPA on
decoded K/V, against per-call encode + attention in the centred, rotated domain). Per-token log
probabilities then agree to a few fp32 ulps of the logits (measured ~5e-7), so CE (a mean)
agrees to ~1e-6. A coefficient on a grid decision boundary could flip its code under a different
order (about 1e-6 per coefficient, ~6e3 coefficients here: rare); one flip moves the affected
tokens' log p by at most ~1e-3, i.e. the CE and the mean per-token |difference| by ~2e-5 over
48 tokens. TOLERANCE = 1e-4 covers that for both.
Negative control: a 48-token prefill chunk reads the positions between the window and the
chunk's end compressed where the harness reads them exactly. Its mean per-token |difference|
(measured 1.3e-2 to 4.2e-2 over 14 seeds) must exceed 10x TOLERANCE, so the comparison can fail.
(Its CE difference is not used: per-token changes of both signs can cancel in the mean; one seed
of 14 gave 1.3e-4.)
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from wmoe_compile.eval import cli  # noqa: E402
from wmoe_compile.eval.compiled import prefill_chunk, run_compiled_eval, token_windows  # noqa: E402
from wmoe_compile.pipeline import tiny_hf_model  # noqa: E402

TOLERANCE = 1e-4  # nats; see the module docstring
HARSH_CODEC = "wavelet:default;bands=1:2:lloyd:mse"
TOKENS = CONTEXT = 48
WINDOW, SINKS = 8, 2


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


class ByteTokenizer:
    """One id per UTF-8 byte (the tiny models' vocabulary is 256)."""

    def __call__(self, text: str, return_tensors: str = "pt", add_special_tokens: bool = False):
        return SimpleNamespace(input_ids=torch.tensor([list(text.encode("utf-8"))]))


def peaked_tiny_llama():
    lm = tiny_hf_model("llama", num_layers=2, seed=int(torch.randint(0, 2**31, ())))
    with torch.no_grad():
        for module in lm.modules():
            if hasattr(module, "q_proj"):
                for proj in (module.q_proj, module.k_proj, module.v_proj):
                    proj.weight.mul_(6.0)
    return lm


def evaluate(lm, **kwargs):
    return run_compiled_eval(
        HARSH_CODEC,
        tokens=TOKENS,
        context=CONTEXT,
        window=WINDOW,
        sinks=SINKS,
        calib_tokens=64,
        loaded=(lm, ByteTokenizer()),
        progress=False,
        **kwargs,
    )


def test_compiled_drift_equals_the_harness_drift_and_the_check_can_fail():
    lm = peaked_tiny_llama()
    report = evaluate(lm)
    assert report.sites == {"kv_write": {"rewritten": 4}, "attention": {"rewritten": 2}}
    assert report.prefill_chunk == WINDOW + SINKS
    for value in (report.harness_ce, report.compiled_ce, report.baseline_ce):
        assert value == value and 0 < value < 20  # finite, not NaN
    assert report.harness_ce != report.baseline_ce  # the codec is applied at all
    assert abs(report.compiled_drift - report.harness_drift) <= TOLERANCE, report.table()
    assert report.mean_token_logprob_diff <= TOLERANCE, report.table()
    assert report.drift_standard_error > 0
    # Negative control: one prefill chunk for the whole window reads positions compressed that the
    # harness reads exactly; the comparison must see it.
    wrong = evaluate(lm, chunk=CONTEXT)
    assert wrong.mean_token_logprob_diff > 10 * TOLERANCE, wrong.table()


def test_prefill_chunk_and_windows_follow_the_harness():
    assert prefill_chunk(128, 4, 512) == 132 and prefill_chunk(128, 4, 50) == 50
    assert prefill_chunk(0, 0, 10) == 1  # no exact tokens: decode from the first token
    ids = torch.arange(1000)
    windows = token_windows(ids, tokens=100, context=64, calib_tokens=10)
    assert [w.numel() for w in windows] == [65, 37]
    assert torch.equal(windows[1], ids[64:101])
    with pytest.raises(ValueError, match="need"):
        token_windows(ids, tokens=1000, context=64, calib_tokens=10)


def test_non_wavelet_method_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="wavelet-<preset>"):
        run_compiled_eval("int4", loaded=(None, None))


def test_cli_flag_reaches_the_compiled_eval(monkeypatch, capsys):
    seen = {}

    def fake_run(method, **kwargs):
        seen[method] = kwargs
        raise ValueError("stop here")

    monkeypatch.setattr("wmoe_compile.eval.compiled.run_compiled_eval", fake_run)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--compiled", "--tokens", "64", "--context", "32", "--driver", "compile"])
    assert cli.run(args) == 2
    assert seen["wavelet"]["driver"] == "compile" and seen["wavelet"]["tokens"] == 64
    assert "stop here" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(
    not __import__("os").environ.get("WMOE_SLOW_TESTS"),
    reason="Inductor compiles two graphs (~2 min on 2 CPU cores); set WMOE_SLOW_TESTS=1",
)
def test_compiled_drift_through_torch_compile_backend():
    lm = peaked_tiny_llama()
    report = evaluate(lm, driver="compile")
    assert report.sites.get("kv_write") == {"rewritten": 4}
    assert abs(report.compiled_drift - report.harness_drift) <= TOLERANCE, report.table()
