"""WaveletKVConfig / WaveletKVCodec: transforms, spec strings, packed format, reference maths."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from wmoe_compile.kernels.kv_codec import channel_params
from wmoe_compile.kernels.wavelet_transform import band_sizes, max_levels, wavelet_matrix

from wmoe_compile import WaveletKVCodec, WaveletKVConfig
from wmoe_compile.codec import (
    PRESETS,
    BandConfig,
    band_mixing,
    calibrate_channel_params,
    calibrate_channel_scale,
    channel_scale_from_weights,
    grid_values,
)

CONFIGS = [
    "default",
    "seed",
    "wavelet=db4;levels=2;bands=1/4:8:uniform:absmax,3/4:4:lloyd:mse",
    "wavelet=haar_packet;levels=max;bands=1:4:lloyd:mse",
    "wavelet=identity;levels=0;bands=1:4:int:absmax;window=0;sinks=0;k_smoothing=none",
    "wavelet=haar;levels=3;bands=1/8:8:uniform:mse,1/8:4:uniform:mse,1/4:4:lloyd:mse,1/2:2:lloyd:mse",
]


@pytest.mark.parametrize(
    "wavelet,levels",
    [("haar", 1), ("haar", 6), ("db4", 1), ("db4", 4), ("haar_packet", 3), ("haar_packet", 6)],
)
def test_transform_is_orthonormal(wavelet, levels):
    w = wavelet_matrix(wavelet, 64, levels, torch.float64)
    assert torch.allclose(w @ w.T, torch.eye(64, dtype=torch.float64), atol=1e-10)
    assert sum(band_sizes(wavelet, 64, levels)) == 64


def test_transform_constraints_raise():
    with pytest.raises(ValueError, match="divisible by 2"):
        wavelet_matrix("haar", 48, 5)
    with pytest.raises(ValueError, match="filter length"):
        wavelet_matrix("db4", 64, 5)  # level 5 would see 64 / 16 = 4 < 8 values
    assert max_levels("db4", 64) == 4 and max_levels("haar", 64) == 6 and max_levels("haar", 48) == 4
    with pytest.raises(ValueError, match="unknown wavelet"):
        wavelet_matrix("sym9", 64, 1)


def test_haar_is_pairwise_average_and_difference():
    x = torch.randn(64, dtype=torch.float64)
    c = wavelet_matrix("haar", 64, 1, torch.float64) @ x
    assert torch.allclose(c[:32], (x[0::2] + x[1::2]) / math.sqrt(2))
    assert torch.allclose(c[32:], (x[0::2] - x[1::2]) / math.sqrt(2))


def test_db4_detail_annihilates_cubics_away_from_the_wrap():
    # Four vanishing moments: a cubic polynomial has zero detail except where periodization wraps.
    t = torch.linspace(-1, 1, 64, dtype=torch.float64)
    coeffs = torch.randn(4, dtype=torch.float64)
    x = coeffs[0] + coeffs[1] * t + coeffs[2] * t**2 + coeffs[3] * t**3
    c = wavelet_matrix("db4", 64, 1, torch.float64) @ x
    detail = c[32:]
    assert detail[:-3].abs().max() < 1e-9 * x.abs().max()
    assert detail[-3:].abs().max() > 1e-4 * x.abs().max()  # the wrapped coefficients see the jump


def test_full_haar_packet_is_hadamard():
    w = wavelet_matrix("haar_packet", 64, 6, torch.float64)
    assert torch.allclose(w.abs(), torch.full_like(w, 1 / 8))


@pytest.mark.parametrize("spec", CONFIGS)
def test_spec_roundtrip(spec):
    cfg = WaveletKVConfig.from_spec(spec)
    assert WaveletKVConfig.from_spec(cfg.to_spec()) == cfg
    assert cfg.to_spec() == WaveletKVConfig.from_spec(cfg.to_spec()).to_spec()


def test_preset_with_overrides_and_errors():
    cfg = WaveletKVConfig.from_spec("default;window=64;sinks=0")
    assert cfg.window == 64 and cfg.sinks == 0 and cfg.bands == PRESETS["default"].bands
    for bad, msg in [
        ("nosuch", "unknown codec preset"),
        ("wavelet=haar;colour=blue", "unknown codec spec key"),
        ("bands=1/2:4:uniform:mse", "sum to 1"),
        ("bands=1:3:uniform:mse", "bits must be one of"),
        ("bands=1:4:gauss:mse", "unknown grid"),
        ("bands=1:4:ternary:mse", "ternary"),
        ("window=-1", "window and sinks"),
        ("levels=x", "levels must be an integer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            WaveletKVConfig.from_spec(bad)


def test_bytes_per_vector_meets_budget():
    default = WaveletKVConfig()
    assert WaveletKVCodec(default, 64).bytes_per_vector <= 28
    assert WaveletKVCodec(default, 128).bytes_per_vector <= 56
    int4 = WaveletKVCodec("wavelet=identity;levels=0;bands=1:4:int:absmax", 64)
    assert int4.bytes_per_vector == 34 and int4.n_code_bytes == 32 and int4.n_bands == 1


def test_band_sizes_must_fill_bytes():
    with pytest.raises(ValueError, match="multiples of 4"):
        WaveletKVCodec("bands=1/8:4:uniform:mse,7/8:2:uniform:mse", 16)  # 2 coefficients
    with pytest.raises(ValueError, match="whole numbers"):
        WaveletKVCodec("bands=1/3:4:uniform:mse,2/3:4:uniform:mse", 64)


@pytest.mark.parametrize(
    "grid,bits", [("uniform", 2), ("uniform", 4), ("int", 4), ("lloyd", 2), ("lloyd", 8), ("log", 4)]
)
def test_grids_are_sorted_tables_in_unit_range(grid, bits):
    vals = torch.tensor(grid_values(grid, bits), dtype=torch.float64)
    assert vals.numel() == 2**bits
    assert bool((vals[1:] >= vals[:-1]).all()) and vals.abs().max() == 1.0


def test_lloyd_max_matches_known_gaussian_levels():
    # Max (1960): 2-bit Gaussian levels +-0.4528, +-1.510 (ratio 0.2998); 1.5 sigma etc.
    vals = grid_values("lloyd", 2)
    assert vals[2] / vals[3] == pytest.approx(0.4528 / 1.5104, abs=2e-4)


def _nearest_codes_f64(cb: torch.Tensor, scale: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    levels = grid.double() * scale.double().unsqueeze(-1).unsqueeze(-1)
    return (cb.double().unsqueeze(-1) - levels).abs().argmin(dim=-1)


@pytest.mark.parametrize("spec", CONFIGS)
def test_encode_picks_nearest_level_and_decode_inverts(spec):
    codec = WaveletKVCodec(spec, 64)
    x = torch.randn(3, 40, 64) * torch.rand(3, 1, 64) * 4
    codes, scales = codec.encode(x)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 40, codec.n_code_bytes)
    assert scales.dtype == torch.float16 and scales.shape == (3, 40, codec.n_bands)
    c = codec.coefficients(x)
    c_hat = codec.decode_coefficients(codes, scales)
    for i, band in enumerate(codec.bands):
        sl = slice(band.start, band.start + band.size)
        grid = codec.grids[i]
        best = (
            grid[_nearest_codes_f64(c[..., sl], scales[..., i].float(), grid)]
            * scales[..., i : i + 1].float()
        )
        # the decoded value is a nearest level (ties may pick either neighbour)
        assert torch.allclose((c[..., sl] - c_hat[..., sl]).abs(), (c[..., sl] - best).abs(), atol=1e-5)
    x_hat = codec.decode(codes, scales)
    assert torch.allclose(x_hat, c_hat @ codec.transform.double().float(), atol=1e-5)
    rel = (x_hat - x).norm() / x.norm()
    assert rel < 0.6 and torch.isfinite(x_hat).all()


def test_mse_scale_rule_never_worse_than_absmax():
    x = torch.randn(500, 64)
    mse = WaveletKVCodec("bands=1/2:4:uniform:mse,1/2:2:uniform:mse", 64)
    absmax = WaveletKVCodec("bands=1/2:4:uniform:absmax,1/2:2:uniform:absmax", 64)
    err_mse = (mse.roundtrip(x) - x).pow(2).sum(-1)
    err_abs = (absmax.roundtrip(x) - x).pow(2).sum(-1)
    assert bool((err_mse <= err_abs * (1 + 1e-5) + 1e-6).all())
    assert err_mse.mean() < 0.8 * err_abs.mean()


def test_packing_puts_lower_index_in_lower_bits():
    codec = WaveletKVCodec("wavelet=identity;levels=0;bands=1/2:4:uniform:absmax,1/2:2:uniform:absmax", 8)
    # 4-bit band: values at the grid's top level (code 15) and bottom (0); 2-bit band: codes 3,0,0,3
    x = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 1.0]])
    codes, scales = codec.encode(x)
    assert codes.tolist() == [[0x0F, 0xF0, 0b11000011]]
    assert scales.float().tolist() == [[1.0, 1.0]]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_vector_stays_contained(bad):
    codec = WaveletKVCodec("default", 64)
    x = torch.randn(6, 64)
    clean_codes, clean_scales = codec.encode(x)
    x[2, 5] = bad
    codes, scales = codec.encode(x)
    assert (codes[2] == 0).all() and torch.isnan(scales[2]).all()
    keep = torch.tensor([0, 1, 3, 4, 5])
    assert torch.equal(codes[keep], clean_codes[keep]) and torch.equal(scales[keep], clean_scales[keep])
    x_hat = codec.decode(codes, scales)
    assert torch.isnan(x_hat[2]).all() and torch.isfinite(x_hat[keep]).all()


def test_huge_and_zero_vectors():
    codec = WaveletKVCodec("default", 64)
    x = torch.stack([torch.zeros(64), torch.randn(64) * 1e6, torch.randn(64) * 1e-9])
    codes, scales = codec.encode(x)
    x_hat = codec.decode(codes, scales)
    assert torch.isfinite(x_hat).all() and torch.isfinite(scales.float()).all()
    assert x_hat[0].abs().max() == 0
    assert scales.float().max() <= 65504.0  # saturates at the fp16 maximum, clipping larger values


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_encode_accepts_dtypes(dtype):
    codec = WaveletKVCodec("default", 64)
    x = torch.randn(4, 10, 64).to(dtype)
    codes, scales = codec.encode(x)
    ref_codes, ref_scales = codec.encode(x.float())
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert codec.roundtrip(x).dtype == dtype


def test_smoothing_folds_into_query_and_output():
    codec = WaveletKVCodec("default", 64)
    k = torch.randn(3, 50, 64) * (torch.rand(3, 1, 64) * 6 + 0.1)
    s = calibrate_channel_scale(k.unsqueeze(0))  # [Hkv, D]
    cs = s.unsqueeze(1)
    codes, scales = codec.encode(k, cs)
    c_hat = codec.decode_coefficients(codes, scales).double()
    k_hat = codec.decode(codes, scales, cs).double()
    q = torch.randn(3, 7, 64, dtype=torch.float64)
    w = codec.transform.double()
    folded_q = (q * cs.double()) @ w.T
    assert torch.allclose(folded_q @ c_hat.transpose(-1, -2), q @ k_hat.transpose(-1, -2), atol=1e-4)
    # values: sum_i p_i v_hat_i == (W^T sum_i p_i c_i) * s
    p = torch.softmax(torch.randn(3, 7, 50, dtype=torch.float64), dim=-1)
    assert torch.allclose(p @ k_hat, ((p @ c_hat) @ w) * cs.double(), atol=1e-4)


def test_attention_in_wavelet_domain_matches_decoded_attention():
    codec = WaveletKVCodec("wavelet=db4;levels=2;bands=1/4:4:uniform:mse,3/4:2:lloyd:mse", 64)
    k, v, q = torch.randn(2, 80, 64), torch.randn(2, 80, 64), torch.randn(2, 5, 64)
    kc, ks = codec.encode(k)
    vc, vs = codec.encode(v)
    k_hat, v_hat = codec.decode(kc, ks).double(), codec.decode(vc, vs).double()
    ref = torch.softmax(q.double() @ k_hat.transpose(-1, -2) / 8, -1) @ v_hat
    w = codec.transform.double()
    ck, cv = codec.decode_coefficients(kc, ks).double(), codec.decode_coefficients(vc, vs).double()
    p = torch.softmax((q.double() @ w.T) @ ck.transpose(-1, -2) / 8, -1)
    assert torch.allclose((p @ cv) @ w, ref, atol=1e-5)


def test_channel_scale_is_equal_within_rope_pairs():
    k = torch.randn(1, 2, 100, 64) * (torch.rand(2, 1, 64) * 5 + 0.2)
    s = calibrate_channel_scale(k)
    assert s.shape == (2, 64) and torch.allclose(s[:, :32], s[:, 32:])
    assert torch.allclose(s.log().mean(-1), torch.zeros(2), atol=1e-5)
    w = torch.randn(2 * 64, 96)
    sw = channel_scale_from_weights(w, 2)
    assert sw.shape == (2, 64) and torch.allclose(sw[:, :32], sw[:, 32:])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        channel_scale_from_weights(torch.randn(100, 8), 3)


def test_band_config_validates():
    with pytest.raises(ValueError, match="fraction"):
        BandConfig(Fraction(3, 2))
    with pytest.raises(ValueError, match="scale rule"):
        BandConfig(Fraction(1), 4, "uniform", "rms")


def test_calibrated_channel_params_fold_into_query_and_output():
    cfg = WaveletKVConfig()  # default: offsets + PCA rotation mixed inside each band
    assert cfg.rotation == "pca_mixed"
    mix = torch.linalg.qr(torch.randn(64, 64))[0]
    k = (torch.randn(1, 2, 300, 64) * torch.logspace(1, -1, 64)) @ mix.T + torch.randn(2, 1, 64) * 3
    params = calibrate_channel_params(cfg, "k", k)
    assert params.shape == (2, 66, 64)
    scale, offset, rotation = channel_params(params, 2, 64)
    # rotation: orthonormal rows; undoing the band mixing leaves the principal axes with
    # descending variance (calibration leaves out the sink positions)
    assert torch.allclose(rotation @ rotation.transpose(1, 2), torch.eye(64).expand(2, 64, 64), atol=1e-5)
    centred = k[:, :, 4:] - offset
    pca = band_mixing(cfg, 64).T @ rotation
    var = (centred @ pca.transpose(1, 2)).pow(2).mean(2)[0]
    assert bool((var[:, :-1] >= var[:, 1:] * 0.999).all())
    # mixed: each half keeps its PCA energy, spread evenly over its coefficients
    var_mixed = (centred @ rotation.transpose(1, 2)).pow(2).mean(2)[0]
    for band in (slice(0, 32), slice(32, 64)):
        assert torch.allclose(var_mixed[:, band].sum(-1), var[:, band].sum(-1), rtol=1e-4)
        spread_pca = var[:, band].amax(-1) / var[:, band].amin(-1)
        spread_mixed = var_mixed[:, band].amax(-1) / var_mixed[:, band].amin(-1)
        assert bool((spread_mixed < 3).all() and (spread_pca > 5).all())
    codec = WaveletKVCodec(cfg, 64)
    codes, scales = codec.encode(k, scale, offset, rotation)
    c_hat = codec.decode_coefficients(codes, scales).double()
    k_hat = codec.decode(codes, scales, scale, torch.float64, offset, rotation)
    m = codec.head_transforms(rotation).double()  # [Hkv, D, D]
    q = torch.randn(1, 2, 5, 64, dtype=torch.float64)
    folded = (q * scale.double()) @ m.transpose(1, 2)
    # q . (k_hat - m) == (M (q * s)) . c_hat
    lhs = q @ (k_hat - offset.double()).transpose(-1, -2)
    assert torch.allclose(folded @ c_hat.transpose(-1, -2), lhs, atol=1e-4)
    # values: sum p v_hat == (M^T sum p c_hat) * s + m
    p = torch.softmax(torch.randn(1, 2, 5, 300, dtype=torch.float64), -1)
    assert torch.allclose(p @ k_hat, ((p @ c_hat) @ m) * scale.double() + offset.double(), atol=1e-4)
    rel = (k_hat - k).norm() / (k - offset).norm()
    assert rel < 0.2  # compaction: most energy sits in the 4-bit half


@pytest.mark.parametrize(
    "spec,bands",
    [
        ("default", [(0, 32), (32, 32)]),
        ("lo", [(0, 16), (16, 48)]),  # 48 coefficients: a DCT-II block
        (
            "wavelet=haar;levels=1;bands=1/2:4:uniform:mse,1/2:2:uniform:mse;rotation=pca_mixed",
            [(0, 32), (32, 32)],
        ),
    ],
)
def test_band_mixing_is_orthonormal_and_block_diagonal_per_band(spec, bands):
    cfg = WaveletKVConfig.from_spec(spec)
    codec = WaveletKVCodec(cfg, 64)
    mix = band_mixing(cfg, 64).double()
    assert torch.allclose(mix @ mix.T, torch.eye(64, dtype=torch.float64), atol=1e-6)
    w = codec.transform.double()
    in_coeffs = w @ mix @ w.T  # what the mixing does to W's coefficients
    block = torch.zeros(64, 64, dtype=torch.bool)
    for start, size in bands:
        block[start : start + size, start : start + size] = True
        sub = in_coeffs[start : start + size, start : start + size]
        # every coefficient of the band mixes every coefficient of it, with equal weight
        assert bool((sub.abs() > 0.2 / size**0.5).float().mean() > 0.9)
    assert float(in_coeffs[~block].abs().max()) < 1e-6


@pytest.mark.parametrize(
    "spec,kind",
    [
        ("default;k_smoothing=qk", "k"),
        ("default;k_smoothing=q", "k"),
        ("default;k_smoothing=weights", "k"),
        ("default;v_smoothing=ov", "v"),
        ("default;v_smoothing=o", "v"),
        ("default;k_smoothing=calibrated;rotation=none;k_offset=none", "k"),
    ],
)
def test_smoothing_rules_produce_positive_pair_consistent_scales(spec, kind):
    cfg = WaveletKVConfig.from_spec(spec)
    x = torch.randn(1, 2, 50, 64) * (torch.rand(2, 1, 64) * 4 + 0.1)
    q = torch.randn(1, 6, 50, 64) * (torch.rand(6, 1, 64) * 4 + 0.1)
    weight = torch.randn(128, 96) if kind == "k" else torch.randn(96, 6 * 64)
    params = calibrate_channel_params(cfg, kind, x, q, weight)
    scale = channel_params(params, 2, 64)[0]
    assert scale.shape == (2, 1, 64) and bool((scale > 0).all()) and torch.isfinite(scale).all()
    if kind == "k":  # keys: equal within RoPE pairs
        assert torch.allclose(scale[..., :32], scale[..., 32:])
    with pytest.raises(ValueError, match="needs"):
        calibrate_channel_params(cfg, kind, x, None, None) if "calibrated" not in spec else (
            _ for _ in ()
        ).throw(ValueError("needs nothing"))


def test_rope_averaged_moments_match_brute_force_over_positions():
    from wmoe_compile.codec import RopeSpec, rope_averaged_moments, rope_theta_per_pair

    d, h, context = 8, 4, 48
    theta = rope_theta_per_pair(d, 10.0)

    def rope(x, p):
        c, s = torch.cos(theta * p.unsqueeze(-1)), torch.sin(theta * p.unsqueeze(-1))
        return torch.cat([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)

    k_pre = torch.randn(1, 2, 500, d, dtype=torch.float64) * torch.rand(d, dtype=torch.float64) * 3
    k_pre = k_pre + torch.randn(2, 1, d, dtype=torch.float64)
    positions = torch.randint(0, 1000, (500,))
    mean, second = rope_averaged_moments(rope(k_pre, positions.double()), RopeSpec(theta, positions, context))
    want_mean, want_second = 0, 0
    for p in range(context):  # every sample placed at every served position
        y = rope(k_pre, torch.full((500,), float(p), dtype=torch.float64))[0]
        want_mean = want_mean + y.mean(1) / context
        want_second = want_second + y.transpose(1, 2) @ y / 500 / context
    assert torch.allclose(mean, want_mean, atol=1e-10)
    assert torch.allclose(second, want_second, atol=1e-9)
