"""Quality harness pieces that need no model: the compressed-cache attention and the baselines."""

from __future__ import annotations

import math

import pytest
import torch

from wmoe_compile.eval import compressed_cache_attention, parse_method
from wmoe_compile.eval.methods import KIVI_GROUP, CodecMethod, Kivi


def _brute_force(q, k, v, k_hat, v_hat, scaling, window, sinks):
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    out = torch.zeros(b, h, t, d, dtype=torch.float64)
    for head in range(h):
        kv = head // groups
        for i in range(t):
            keys, vals = [], []
            for p in range(i + 1):
                exact = p < sinks or p > i - window
                keys.append((k if exact else k_hat)[:, kv, p])
                vals.append((v if exact else v_hat)[:, kv, p])
            keys, vals = torch.stack(keys, 1).double(), torch.stack(vals, 1).double()
            w = torch.softmax((keys @ q[:, head, i].double().unsqueeze(-1)).squeeze(-1) * scaling, -1)
            out[:, head, i] = (w.unsqueeze(-1) * vals).sum(1)
    return out


@pytest.mark.parametrize("window,sinks", [(0, 0), (1, 0), (5, 2), (3, 7), (100, 4)])
def test_compressed_cache_attention_matches_step_by_step_decoding(window, sinks):
    q = torch.randn(2, 6, 19, 8)
    k, v = torch.randn(2, 3, 19, 8), torch.randn(2, 3, 19, 8)
    k_hat, v_hat = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    got = compressed_cache_attention(q, k, v, k_hat, v_hat, 0.35, window, sinks)
    ref = _brute_force(q, k, v, k_hat, v_hat, 0.35, window, sinks)
    assert torch.allclose(got.double(), ref, atol=1e-5)


def test_compressed_cache_attention_is_exact_attention_without_compression():
    q, k, v = torch.randn(1, 4, 30, 16), torch.randn(1, 2, 30, 16), torch.randn(1, 2, 30, 16)
    got = compressed_cache_attention(q, k, v, k, v, 0.25, 0, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25
    )
    assert torch.allclose(got, ref, atol=1e-5)


def test_baseline_bytes_per_vector():
    assert parse_method("int4").bytes_per_vector(64) == 34
    assert parse_method("int2").bytes_per_vector(64) == 18
    assert parse_method("fp8").bytes_per_vector(64) == 66
    # KIVI-2: 16 B codes + fp16 (scale, zero) per channel per 32 tokens (K) / per 32 channels (V)
    assert parse_method("kivi2").bytes_per_vector(64) == 16 + 4 * 64 / KIVI_GROUP
    assert parse_method("wavelet").bytes_per_vector(64) <= 28
    assert parse_method("wavelet").bytes_per_vector(128) <= 56


def test_window_and_sinks_apply_to_every_method():
    for name in ("int4", "fp8", "kivi2", "wavelet"):
        m = parse_method(name, window=64, sinks=2)
        assert (m.window, m.sinks) == (64, 2)
    assert parse_method("int4").window == 128 and parse_method("int4").sinks == 4


def test_int_and_fp8_per_token_errors_are_bounded():
    x = torch.randn(1, 2, 50, 64) * 3
    for name, bound in (("int4", 1 / 14), ("int8", 1 / 254)):
        err = (parse_method(name).quantize(x, "k", 0) - x).abs()
        step_half = x.abs().amax(-1, keepdim=True) * bound
        assert bool((err <= step_half * 1.01 + 1e-6).all()), name
    fp8 = parse_method("fp8").quantize(x, "k", 0)
    assert ((fp8 - x).abs() <= x.abs() * 2**-4 + 1e-3 * x.abs().amax()).all()


def test_kivi_groups_keys_per_channel_and_values_per_token():
    m = Kivi(2, 128, 4)
    x = torch.randn(1, 1, 2 * KIVI_GROUP, 64)
    x[..., 5] *= 50  # an outlier channel: per-channel K groups isolate it
    k_hat = m.quantize(x, "k", 0)
    # each (channel, 32-token group) uses its own min/max: errors in channel 0 ignore channel 5
    err0 = (k_hat[..., 0] - x[..., 0]).abs().max()
    assert err0 <= (x[..., 0].max() - x[..., 0].min()) / 3 / 2 * 1.01 + 1e-3
    v_hat = m.quantize(x, "v", 0)
    g = x[0, 0, 3, :KIVI_GROUP]
    assert (v_hat[0, 0, 3, :KIVI_GROUP] - g).abs().max() <= (g.max() - g.min()) / 6 * 1.01 + 1e-3


def test_codec_method_needs_calibration_when_smoothing():
    m = parse_method("wavelet:default;k_smoothing=calibrated")
    assert isinstance(m, CodecMethod)
    with pytest.raises(RuntimeError, match="not calibrated"):
        m.quantize(torch.randn(1, 2, 4, 64), "k", 0)
    m2 = parse_method("wavelet:default;k_offset=none;v_offset=none;rotation=none")
    x = torch.randn(1, 2, 40, 64)
    rel = (m2.quantize(x, "v", 3) - x).norm() / x.norm()
    assert 0 < rel < 0.4 and math.isfinite(float(rel))


def test_parse_method_errors():
    for bad in ("int9", "zip", "wavelet-nosuch", "wavelet:bands=1:3:uniform:mse"):
        with pytest.raises(ValueError):
            parse_method(bad)


def test_report_json_roundtrip_and_plot_labels(tmp_path):
    from wmoe_compile.eval.harness import EvalReport, MethodResult
    from wmoe_compile.eval.plot import _label, plot_rate_distortion

    results = [
        MethodResult("int4", "", 34, 4.25, 128, 4, 2.5, 0.02, 0.9, [0.1, 0.3], [0.2, 0.2]),
        MethodResult("wavelet:default;bands=1/4:8:uniform:mse,3/4:2:uniform:mse", "s", 32, 4.0, 128, 4, 2.49,
                     0.01, 0.95, [0.05], [0.07]),
    ]  # fmt: skip
    report = EvalReport("m", "t", 64, 32, 64, 2.48, results)
    back = EvalReport.from_json(report.to_json())
    assert back == report and back.results[0].k_rel_err_mean == pytest.approx(0.2)
    assert _label(results[1].method, 64) == "16@8 + 48@2" and _label("kivi4", 64) == "kivi4"
    plot_rate_distortion(back, str(tmp_path / "rd.png"))
    assert (tmp_path / "rd.png").stat().st_size > 1000
