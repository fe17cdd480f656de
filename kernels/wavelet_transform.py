"""Orthonormal discrete wavelet transforms over the head dimension, as D x D matrices.

The KV codec stores coefficients ``c = W @ x`` of a head vector ``x``. Because every matrix here
is orthonormal (``W @ W.T == I``), dot products survive the transform (``q . k == (W q) . (W k)``)
and a weighted sum of values can be inverse-transformed once (``sum p_i v_i == W.T sum p_i c_i``);
that is what lets attention run on coefficients without a per-key inverse transform.

Coefficient order (one level = one split of the current approximation into halves):
  ``[a_L, d_L, d_{L-1}, ..., d_1]`` with ``len(a_L) == D / 2**L`` and ``len(d_l) == D / 2**l``.

Transforms:
  haar          Haar DWT, L levels (D divisible by 2**L).
  db4           Daubechies with 4 vanishing moments (8 taps; PyWavelets' "db4") and
                *periodization*, so each level maps n values to n coefficients (not n + 6).
                Every level's input length must be >= 8 (the filter length).
  haar_packet   Full Haar wavelet packet of depth L: every band (not only the approximation) is
                split again. Depth log2(D) gives a Walsh-Hadamard matrix (Paley order) scaled by
                1/sqrt(D): every coefficient mixes every channel, which spreads outlier channels.
  identity      No transform (baseline for per-token quantizers).

Matrices are built in float64 and returned as float32 (or the dtype asked for).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

WAVELETS = ("haar", "db4", "haar_packet", "identity")

# Daubechies 4-vanishing-moment scaling filter (reconstruction low-pass, 8 taps), normalised so
# sum(h) == sqrt(2) and sum(h**2) == 1. Standard published values (Daubechies, "Ten Lectures").
_DB4_LOWPASS = (
    0.23037781330885523,
    0.7148465705525415,
    0.6308807679295904,
    -0.02798376941698385,
    -0.18703481171888114,
    0.030841381835986965,
    0.032883011666982945,
    -0.010597401784997278,
)


def max_levels(wavelet: str, head_dim: int) -> int:
    """The largest level count `wavelet` allows for `head_dim`."""
    _check_wavelet(wavelet)
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    if wavelet == "identity":
        return 0
    min_len = len(_DB4_LOWPASS) if wavelet == "db4" else 2
    levels, n = 0, head_dim
    while n % 2 == 0 and n >= min_len:
        levels += 1
        n //= 2
    return levels


def _check_wavelet(wavelet: str) -> None:
    if wavelet not in WAVELETS:
        raise ValueError(f"unknown wavelet {wavelet!r}; valid: {', '.join(WAVELETS)}")


def _check_levels(wavelet: str, head_dim: int, levels: int) -> None:
    if levels < 0:
        raise ValueError(f"levels must be >= 0, got {levels}")
    if wavelet == "identity":
        if levels != 0:
            raise ValueError(f"wavelet 'identity' takes levels=0, got {levels}")
        return
    if head_dim % (2**levels) != 0:
        raise ValueError(
            f"{wavelet} with {levels} levels needs head_dim divisible by 2**{levels}={2**levels}; "
            f"head_dim={head_dim} allows at most {max_levels(wavelet, head_dim)} levels"
        )
    if wavelet == "db4" and levels > 0 and head_dim // 2 ** (levels - 1) < len(_DB4_LOWPASS):
        raise ValueError(
            f"db4 with periodization needs every level's input length >= {len(_DB4_LOWPASS)} "
            f"(the filter length): level {levels} would see head_dim / 2**{levels - 1} = "
            f"{head_dim // 2 ** (levels - 1)}; head_dim={head_dim} allows at most "
            f"{max_levels('db4', head_dim)} levels"
        )


def _analysis_step(n: int, lowpass: tuple[float, ...]) -> torch.Tensor:
    """n x n orthonormal matrix of one periodized analysis step: rows [lowpass | highpass]."""
    h = torch.tensor(lowpass, dtype=torch.float64)
    taps = h.numel()
    # Quadrature mirror high-pass g[k] = (-1)^k h[taps-1-k] makes the two filter banks orthogonal.
    g = torch.tensor([(-1) ** k * lowpass[taps - 1 - k] for k in range(taps)], dtype=torch.float64)
    step = torch.zeros(n, n, dtype=torch.float64)
    half = n // 2
    for k in range(half):
        for t in range(taps):
            col = (2 * k + t) % n  # periodization: the filter wraps around the vector
            step[k, col] += h[t]
            step[half + k, col] += g[t]
    return step


@lru_cache(maxsize=64)
def _transform_f64(wavelet: str, head_dim: int, levels: int) -> torch.Tensor:
    _check_wavelet(wavelet)
    _check_levels(wavelet, head_dim, levels)
    if wavelet == "identity" or levels == 0:
        return torch.eye(head_dim, dtype=torch.float64)
    lowpass = _DB4_LOWPASS if wavelet == "db4" else (1 / math.sqrt(2), 1 / math.sqrt(2))
    total = torch.eye(head_dim, dtype=torch.float64)
    if wavelet == "haar_packet":
        # Split every band at every level: block-diagonal Haar steps over the current bands.
        for level in range(levels):
            n_bands = 2**level
            size = head_dim // n_bands
            block = _analysis_step(size, lowpass)
            total = torch.block_diag(*([block] * n_bands)) @ total
        return total
    n = head_dim
    for _ in range(levels):
        # Split only the approximation (the first n coefficients); details pass through.
        step = torch.eye(head_dim, dtype=torch.float64)
        step[:n, :n] = _analysis_step(n, lowpass)
        total = step @ total
        n //= 2
    return total


def wavelet_matrix(
    wavelet: str, head_dim: int, levels: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The D x D orthonormal analysis matrix W (coefficients ``c = W @ x``).

    Raises ValueError naming the constraint when the wavelet, head_dim or level count don't fit.
    """
    return _transform_f64(wavelet, int(head_dim), int(levels)).to(dtype).clone()


def band_sizes(wavelet: str, head_dim: int, levels: int) -> list[int]:
    """Sizes of the natural sub-bands in coefficient order: [a_L, d_L, ..., d_1]
    (haar_packet: 2**L equal bands)."""
    _check_wavelet(wavelet)
    _check_levels(wavelet, head_dim, levels)
    if wavelet == "identity" or levels == 0:
        return [head_dim]
    if wavelet == "haar_packet":
        return [head_dim // 2**levels] * 2**levels
    sizes = [head_dim // 2**levels]
    sizes += [head_dim // 2**level for level in range(levels, 0, -1)]
    return sizes
