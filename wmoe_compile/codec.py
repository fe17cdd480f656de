"""The wavelet KV codec: configuration, canonical spec strings, the packed format, reference math.

A head vector x (D channels) is stored as
  1. optional channel parameters per (layer, kv head), calibrated on sample text
     (calibrate_channel_params): an offset m, a smoothing vector s and an orthonormal rotation R,
     ``y = R ((x - m) / s)``; all fold into the query (keys) or the output (values),
  2. one fixed orthonormal transform: ``c = W @ y`` (``W`` from kernels/wavelet_transform.py),
  3. contiguous coefficient bands, each with ``bits`` in {2, 4, 8}, one fp16 scale per vector
     and a lookup table ``grid`` of 2**bits values in [-1, 1]: ``c_j ~= grid[code_j] * scale``.
Packed: ``codes`` uint8 [..., n_code_bytes] (band 0 first; inside a byte the lower-index
coefficient sits in the lower bits) and ``scales`` fp16 [..., n_bands].
``bytes_per_vector = n_code_bytes + 2 * n_bands``, fixed. See docs/CONTRACTS.md.

The default (PRESETS["default"] == WaveletKVConfig()) is the measured winner on SmolLM2-135M
(benchmarks/RESULTS.md): calibrated offsets + a per-head PCA rotation followed by a Hadamard
inside each band (`rotation=pca_mixed`, band_mixing), W = identity, the 32 leading components at
4 bits and the 32 trailing ones at 2 bits on uniform (affine) grids: 28 B per 64-d vector, 52 B
per 128-d. The mixing spreads each band's PCA energy evenly over its coefficients, which lets
uniform grids match Lloyd-Max grids (the `lloyd` preset, plain PCA), and the attention kernel
decodes affine grids (code * step + offset) 4.4x faster than table grids.
Fixed wavelets (haar, db4, haar_packet) stay available; on these keys/values they did not compact
energy (~50% in either half) and measured 5x the drift at the same bytes.

Encoding rules (all shared bit-for-bit by the reference and the Triton kernel, see
kernels/kv_codec.py):
  - scale rule ``absmax``: scale = max |c| over the band (the grid's outer level is 1).
    scale rule ``mse``: try ``absmax * f`` for the fractions in SCALE_FRACTIONS, each rounded to
    fp16, and keep the one with the least squared error of the band (ties: the larger scale).
    Values past the chosen scale clip to the outer grid level. For a ternary grid this is the
    optimal-threshold rule: the threshold is scale / 2 and the scale minimises the error.
    suffix ``-ub`` (``absmax-ub``, ``mse-ub``): code with that scale, then store
    ``|c|^2 / <grid[code], c>`` instead, so the reconstruction carries no gain bias (see
    _unbiased_scale); attention is far more sensitive to a gain bias than to error energy.
  - the scale is rounded to fp16 first and codes are computed against the rounded scale, so the
    decoder sees exactly what the encoder optimised; scales saturate at the fp16 maximum.
  - code = number of grid midpoints strictly below ``c / scale`` (nearest level, ties go down);
    a zero scale maps every coefficient to ``c / scale := 0``.
  - a vector with any non-finite coefficient (NaN or Inf in x, or overflow) is stored as all codes
    0 and every band scale NaN: it decodes to all-NaN, exactly as an uncompressed cache would
    propagate it, and never touches another vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from fractions import Fraction
from functools import lru_cache

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .kernels.wavelet_transform import WAVELETS, band_sizes, max_levels, wavelet_matrix

GRIDS = ("uniform", "int", "lloyd", "log", "ternary")
SCALE_RULES = ("absmax", "mse", "absmax-ub", "mse-ub")
K_SMOOTHING = ("none", "calibrated", "weights", "qk", "q")
V_SMOOTHING = ("none", "calibrated", "ov", "o")
OFFSETS = ("none", "calibrated")
ROTATIONS = ("none", "pca", "pca_mixed")
ALLOWED_BITS = (2, 4, 8)
FP16_MAX = 65504.0

# Candidate clipping fractions for the `mse` scale rule: absmax * f, f from 1 down to 0.25.
# Lower fractions matter for 2-bit and ternary bands (optimal clip ~0.5-0.7 of absmax for
# Gaussian-like coefficients); 16 candidates keep the in-kernel search cheap.
SCALE_FRACTIONS = tuple(1.0 - 0.05 * i for i in range(16))


# ----------------------------------------------------------------------------------------------
# grids


def _gaussian_lloyd_max(levels: int, iterations: int = 400) -> list[float]:
    """Lloyd-Max quantizer levels for a unit Gaussian (float64, ascending)."""
    # Start from uniform levels over +-2.5 sigma and iterate centroid/midpoint conditions.
    pts = [(-2.5 + 5.0 * (i + 0.5) / levels) for i in range(levels)]
    sqrt2 = math.sqrt(2.0)
    inv_sqrt2pi = 1.0 / math.sqrt(2.0 * math.pi)

    def cdf(t: float) -> float:
        return 0.5 * (1.0 + math.erf(t / sqrt2))

    def pdf(t: float) -> float:
        return inv_sqrt2pi * math.exp(-0.5 * t * t)

    for _ in range(iterations):
        edges = [-math.inf] + [(pts[i] + pts[i + 1]) / 2 for i in range(levels - 1)] + [math.inf]
        new = []
        for i in range(levels):
            lo, hi = edges[i], edges[i + 1]
            mass = cdf(hi) - cdf(lo)
            pdf_lo = 0.0 if math.isinf(lo) else pdf(lo)
            pdf_hi = 0.0 if math.isinf(hi) else pdf(hi)
            new.append((pdf_lo - pdf_hi) / mass if mass > 0 else pts[i])
        pts = new
    return pts


@lru_cache(maxsize=32)
def grid_values(grid: str, bits: int) -> tuple[float, ...]:
    """The 2**bits lookup-table values of a grid, ascending, in [-1, 1] (outer level at +-1)."""
    if grid not in GRIDS:
        raise ValueError(f"unknown grid {grid!r}; valid: {', '.join(GRIDS)}")
    if bits not in ALLOWED_BITS:
        raise ValueError(f"bits must be one of {ALLOWED_BITS}, got {bits}")
    n = 2**bits
    if grid == "uniform":
        # Mid-rise: n evenly spaced levels, no zero level, +-1 at the ends.
        vals = [(2 * i + 1 - n) / (n - 1) for i in range(n)]
    elif grid == "int":
        # Symmetric integer grid -m..m / m (m = 2**(bits-1) - 1) as in INT-b per-token baselines;
        # the 2**bits-th code repeats 0 (one code unused).
        m = 2 ** (bits - 1) - 1
        vals = sorted([k / m for k in range(-m, m + 1)] + [0.0])
    elif grid == "lloyd":
        pts = _gaussian_lloyd_max(n)
        # symmetrise exactly (the iteration is symmetric up to rounding)
        upper = [(pts[n // 2 + i] - pts[n // 2 - 1 - i]) / 2 for i in range(n // 2)]
        vals = [-u / upper[-1] for u in reversed(upper)] + [u / upper[-1] for u in upper]
    elif grid == "log":
        # Seed recipe's logarithmic grid: +-2**-j, j = 0 .. n/2 - 1.
        mags = [2.0**-j for j in range(n // 2)]
        vals = sorted([-m for m in mags] + mags)
    else:  # ternary
        if bits != 2:
            raise ValueError(f"grid 'ternary' needs bits=2, got {bits}")
        vals = [-1.0, 0.0, 0.0, 1.0]
    return tuple(float(v) for v in vals)


# ----------------------------------------------------------------------------------------------
# config


@dataclass(frozen=True)
class BandConfig:
    """One contiguous coefficient band: its share of head_dim, bits, grid and scale rule."""

    fraction: Fraction
    bits: int = 4
    grid: str = "uniform"
    scale_rule: str = "mse"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fraction", Fraction(self.fraction))
        if not (0 < self.fraction <= 1):
            raise ValueError(f"band fraction must be in (0, 1], got {self.fraction}")
        if self.bits not in ALLOWED_BITS:
            raise ValueError(f"band bits must be one of {ALLOWED_BITS}, got {self.bits}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"unknown scale rule {self.scale_rule!r}; valid: {', '.join(SCALE_RULES)}")
        grid_values(self.grid, self.bits)  # validates the grid name and bits combination

    def to_spec(self) -> str:
        return f"{self.fraction}:{self.bits}:{self.grid}:{self.scale_rule}"

    @classmethod
    def from_spec(cls, text: str) -> BandConfig:
        parts = text.strip().split(":")
        if len(parts) != 4:
            raise ValueError(
                f"band spec {text!r} must read fraction:bits:grid:scale_rule, e.g. '1/2:4:uniform:mse'"
            )
        try:
            fraction, bits = Fraction(parts[0]), int(parts[1])
        except (ValueError, ZeroDivisionError) as exc:
            raise ValueError(f"band spec {text!r}: bad fraction or bits ({exc})") from None
        return cls(fraction, bits, parts[2], parts[3])


def _default_bands() -> tuple[BandConfig, ...]:
    return (BandConfig(Fraction(1, 2), 4, "uniform", "mse"), BandConfig(Fraction(1, 2), 2, "uniform", "mse"))


def _lloyd_bands() -> tuple[BandConfig, ...]:
    return (BandConfig(Fraction(1, 2), 4, "lloyd", "mse"), BandConfig(Fraction(1, 2), 2, "lloyd", "mse"))


@dataclass(frozen=True)
class WaveletKVConfig:
    """Everything that fixes the compressed KV format and how a sequence's cache is kept.

    wavelet      haar | db4 | haar_packet | identity (see kernels/wavelet_transform.py)
    levels       transform depth; None = the deepest the head dimension allows
    bands        contiguous coefficient bands in order (fractions of head_dim summing to 1), each
                 with bits in {2, 4, 8}, a grid (uniform | int | lloyd | log | ternary) and a
                 scale rule (absmax | mse; for the detail band the `mse` rule is the threshold rule)
    window       most recent tokens kept in full precision (an exact ring cache beside the codes)
    sinks        leading tokens kept exact
    k_smoothing  per-channel key smoothing folded into the query (equal within RoPE pairs):
                 none | calibrated (s = rms_k ** alpha over calibration keys) | weights
                 (rms predicted from k_proj rows) | qk (s = sqrt(rms_k / rms_q): minimises the
                 score error q . (k - k_hat) for a fixed step, by Cauchy-Schwarz)
    v_smoothing  per-channel value smoothing folded into the attention output: none |
                 calibrated (rms_v ** alpha) | ov (s = sqrt(rms_v / |o_proj column|): minimises
                 the error after the output projection)
    smoothing_alpha  exponent for `calibrated` / `weights` (s normalised to geometric mean 1)
    rotation     none | pca: a per-(layer, kv head) orthonormal rotation R, calibrated as the
                 principal axes of the centred, smoothed samples (largest variance first), applied
                 before W: c = W R ((x - m) / s). It folds into the query / output exactly like W.
                 pca_mixed: the PCA rotation followed by a Hadamard inside each band (band_mixing)
    k_offset, v_offset  none | calibrated: subtract a per-channel offset m (the calibration mean)
                 before coding, x' = (x - m) / s. Keys: every key, exact ones included, is stored
                 centred, which shifts each query's scores by the constant q . m (softmax does
                 not see it). Values: every value is stored centred and attention adds m back
                 once per output (softmax weights sum to 1).
    """

    wavelet: str = "identity"
    levels: int | None = 0
    bands: tuple[BandConfig, ...] = field(default_factory=_default_bands)
    window: int = 128
    sinks: int = 4
    k_smoothing: str = "none"
    v_smoothing: str = "none"
    smoothing_alpha: float = 1.0
    k_offset: str = "calibrated"
    v_offset: str = "calibrated"
    rotation: str = "pca_mixed"

    def __post_init__(self) -> None:
        if self.wavelet not in WAVELETS:
            raise ValueError(f"unknown wavelet {self.wavelet!r}; valid: {', '.join(WAVELETS)}")
        if self.levels is not None and self.levels < 0:
            raise ValueError(f"levels must be >= 0 or None (deepest), got {self.levels}")
        bands = tuple(b if isinstance(b, BandConfig) else BandConfig(*b) for b in self.bands)
        object.__setattr__(self, "bands", bands)
        if not bands:
            raise ValueError("a codec needs at least one band")
        total = sum((b.fraction for b in bands), Fraction(0))
        if total != 1:
            raise ValueError(f"band fractions must sum to 1, got {total} ({self.bands_spec()})")
        if self.window < 0 or self.sinks < 0:
            raise ValueError(f"window and sinks must be >= 0, got window={self.window} sinks={self.sinks}")
        for name, valid in (("k_smoothing", K_SMOOTHING), ("v_smoothing", V_SMOOTHING)):
            if getattr(self, name) not in valid:
                raise ValueError(f"{name} must be one of {', '.join(valid)}, got {getattr(self, name)!r}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {self.rotation!r}")
        for name in ("k_offset", "v_offset"):
            if getattr(self, name) not in OFFSETS:
                raise ValueError(f"{name} must be one of {', '.join(OFFSETS)}, got {getattr(self, name)!r}")
        if not (0.0 <= self.smoothing_alpha <= 2.0):
            raise ValueError(f"smoothing_alpha must be in [0, 2], got {self.smoothing_alpha}")

    def bands_spec(self) -> str:
        return ",".join(b.to_spec() for b in self.bands)

    def to_spec(self) -> str:
        """Canonical string: every field, fixed order; from_spec(to_spec()) == self."""
        levels = "max" if self.levels is None else str(self.levels)
        return (
            f"wavelet={self.wavelet};levels={levels};bands={self.bands_spec()};window={self.window};"
            f"sinks={self.sinks};k_smoothing={self.k_smoothing};v_smoothing={self.v_smoothing};"
            f"smoothing_alpha={self.smoothing_alpha:g};k_offset={self.k_offset};v_offset={self.v_offset};"
            f"rotation={self.rotation}"
        )

    @classmethod
    def from_spec(cls, spec: str) -> WaveletKVConfig:
        """Parse a canonical spec, a preset name (see PRESETS), or a preset name followed by
        overrides, e.g. ``"default;window=64"``. Omitted fields take the dataclass defaults."""
        spec = spec.strip()
        parts = [p.strip() for p in spec.split(";") if p.strip()]
        if not parts:
            raise ValueError("empty codec spec")
        base = cls()
        if "=" not in parts[0]:
            name = parts.pop(0)
            if name not in PRESETS:
                raise ValueError(f"unknown codec preset {name!r}; presets: {', '.join(PRESETS)}")
            base = PRESETS[name]
        kwargs: dict[str, object] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ValueError(f"codec spec item {part!r} must read key=value")
            if key == "wavelet":
                kwargs[key] = value
            elif key == "levels":
                kwargs[key] = None if value == "max" else _parse_int(key, value)
            elif key == "bands":
                kwargs[key] = tuple(BandConfig.from_spec(b) for b in value.split(",") if b.strip())
            elif key in ("window", "sinks"):
                kwargs[key] = _parse_int(key, value)
            elif key in ("k_smoothing", "v_smoothing", "k_offset", "v_offset", "rotation"):
                kwargs[key] = value
            elif key == "smoothing_alpha":
                try:
                    kwargs[key] = float(value)
                except ValueError:
                    raise ValueError(f"smoothing_alpha must be a number, got {value!r}") from None
            else:
                raise ValueError(
                    f"unknown codec spec key {key!r}; valid: wavelet, levels, bands, window, sinks, "
                    "k_smoothing, v_smoothing, smoothing_alpha, k_offset, v_offset, rotation"
                )
        return replace(base, **kwargs)

    def bytes_per_vector(self, head_dim: int) -> int:
        return WaveletKVCodec(self, head_dim).bytes_per_vector


def _parse_int(key: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{key} must be an integer, got {value!r}") from None


def _bands(*items: tuple[str, int, str]) -> tuple[BandConfig, ...]:
    return tuple(BandConfig(Fraction(f), bits, grid, "mse") for f, bits, grid in items)


def _fixed_wavelet(wavelet: str, levels: int | None) -> WaveletKVConfig:
    # the best measured configs without a calibrated rotation (offsets still calibrated)
    return WaveletKVConfig(
        wavelet=wavelet, levels=levels, k_smoothing="calibrated", rotation="none", bands=_lloyd_bands()
    )


# Named configs (issue 8 measured them on SmolLM2-135M; benchmarks/RESULTS.md has the tables).
# Every dataclass default is the `default` preset: 28 B per 64-d vector, 52 B per 128-d.
PRESETS: dict[str, WaveletKVConfig] = {
    "default": WaveletKVConfig(),
    # the default until 2026-11-30: Lloyd-Max grids after a plain PCA rotation (same bytes); the
    # attention kernel reads table grids 4.4x slower than affine ones
    "lloyd": WaveletKVConfig(bands=_lloyd_bands(), rotation="pca"),
    "lo": WaveletKVConfig(bands=_bands(("1/4", 4, "uniform"), ("3/4", 2, "uniform"))),  # 24 B / 64-d
    "hq": WaveletKVConfig(bands=_bands(("1/2", 4, "uniform"), ("1/2", 4, "uniform"))),  # 36 B / 64-d
    "hq8": WaveletKVConfig(bands=_bands(("1/8", 8, "uniform"), ("7/8", 4, "uniform"))),  # 40 B / 64-d
    "max": WaveletKVConfig(bands=_bands(("1/2", 8, "uniform"), ("1/2", 8, "uniform"))),  # 68 B / 64-d
    "wht": _fixed_wavelet("haar_packet", None),  # full-depth Haar packet (Walsh-Hadamard), 28 B
    "haar": _fixed_wavelet("haar", 1),  # one-level Haar, 28 B
    # The seed recipe as DESIGN.md wrote it (log-grid approximation, ternary detail), kept for the record.
    "seed": WaveletKVConfig(
        wavelet="haar",
        levels=1,
        bands=(
            BandConfig(Fraction(1, 2), 4, "log", "absmax"),
            BandConfig(Fraction(1, 2), 2, "ternary", "mse"),
        ),
        window=0,
        sinks=0,
        k_offset="none",
        v_offset="none",
        rotation="none",
    ),
}


# ----------------------------------------------------------------------------------------------
# codec


@dataclass(frozen=True)
class Band:
    start: int
    size: int
    bits: int


@dataclass(frozen=True)
class CodecLayout:
    """The packed geometry of a config at one head_dim (pure Python, no tensors)."""

    levels: int
    bands: tuple[Band, ...]
    band_byte_offsets: tuple[int, ...]
    n_code_bytes: int
    bytes_per_vector: int

    @property
    def n_bands(self) -> int:
        return len(self.bands)


def codec_layout(config: WaveletKVConfig | str, head_dim: int) -> CodecLayout:
    """Bands, byte offsets and sizes; raises ValueError naming the constraint a band breaks."""
    if isinstance(config, str):
        config = WaveletKVConfig.from_spec(config)
    head_dim = int(head_dim)
    levels = config.levels if config.levels is not None else max_levels(config.wavelet, head_dim)
    band_sizes(config.wavelet, head_dim, levels)  # validates wavelet / head_dim / levels
    bands: list[Band] = []
    offsets: list[int] = []
    start = offset = 0
    for b in config.bands:
        size = b.fraction * head_dim
        if size.denominator != 1:
            raise ValueError(
                f"band {b.to_spec()} covers {size} of head_dim={head_dim} coefficients; "
                "band fractions times head_dim must be whole numbers"
            )
        size = int(size)
        if size % 4 != 0:
            raise ValueError(
                f"band {b.to_spec()} covers {size} coefficients of head_dim={head_dim}; band sizes "
                "must be multiples of 4 so every band fills whole bytes at 2, 4 or 8 bits"
            )
        bands.append(Band(start, size, b.bits))
        offsets.append(offset)
        start += size
        offset += size * b.bits // 8
    return CodecLayout(levels, tuple(bands), tuple(offsets), offset, offset + 2 * len(bands))


@lru_cache(maxsize=256)
def get_layout(spec: str, head_dim: int) -> CodecLayout:
    return codec_layout(WaveletKVConfig.from_spec(spec), head_dim)


def allocate_compressed_cache(
    batch: int,
    num_kv_heads: int,
    capacity: int,
    n_code_bytes: int,
    n_bands: int,
    device: torch.device | str = "cpu",
    row_positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (codes uint8 [B, Hkv, capacity, n_code_bytes], scales fp16 [B, Hkv, capacity,
    n_bands]) of a compressed cache: contiguous, or with ``row_positions`` (>= capacity) views of
    the capacity into rows of that many positions (the write and read ops take strides; the tests
    check them on such views). The package allocates contiguous caches: padded rows at 131,072
    positions were measured no faster (benchmarks/RESULTS.md, thirty-first session)."""
    if capacity < 1:
        raise ValueError(f"a compressed cache needs a capacity of at least 1 position, got {capacity}")
    rows = capacity if row_positions is None else row_positions
    if rows < capacity:
        raise ValueError(f"rows of {rows} positions cannot hold a capacity of {capacity}")
    codes = torch.zeros(batch, num_kv_heads, rows, n_code_bytes, dtype=torch.uint8, device=device)
    scales = torch.zeros(batch, num_kv_heads, rows, n_bands, dtype=torch.float16, device=device)
    return codes[:, :, :capacity], scales[:, :, :capacity]


class WaveletKVCodec:
    """The packed format for one head dimension, and the PyTorch reference encode/decode.

    Attributes the fused attention kernel reads:
      transform     [D, D] fp32 orthonormal W (coefficients c = W @ (x / s))
      bands         list of (start, size, bits) contiguous coefficient ranges
      grids         one fp32 LUT per band (2**bits values in [-1, 1]); value = grid[code] * scale
      n_code_bytes, n_bands, bytes_per_vector
    """

    def __init__(self, config: WaveletKVConfig | str, head_dim: int) -> None:
        if isinstance(config, str):
            config = WaveletKVConfig.from_spec(config)
        self.config = config
        self.head_dim = int(head_dim)
        layout = codec_layout(config, self.head_dim)
        self.levels = layout.levels
        self.bands = list(layout.bands)
        self.n_bands = len(self.bands)
        self.band_byte_offsets = list(layout.band_byte_offsets)
        self.n_code_bytes = layout.n_code_bytes
        self.bytes_per_vector = layout.bytes_per_vector
        # Real tensors even when first built while a FakeTensorMode is active (op fakes, tracing):
        # they are cached and shared.
        with unset_fake_temporarily():
            self._build_tables(config)
        self.spec = config.to_spec()

    def _build_tables(self, config: WaveletKVConfig) -> None:
        self.transform = wavelet_matrix(config.wavelet, self.head_dim, self.levels)
        self.grids = [torch.tensor(grid_values(b.grid, b.bits), dtype=torch.float32) for b in config.bands]
        self.midpoints = [(g[1:] + g[:-1]) / 2 for g in self.grids]
        self.scale_rules = [b.scale_rule for b in config.bands]
        self.scale_fractions = torch.tensor(SCALE_FRACTIONS, dtype=torch.float32)

    def __repr__(self) -> str:
        return (
            f"WaveletKVCodec({self.spec!r}, head_dim={self.head_dim}, "
            f"bytes_per_vector={self.bytes_per_vector})"
        )

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.bytes_per_vector / self.head_dim

    def device_tables(
        self, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(W, grids, midpoints, scale fractions) on `device`, cached: what the kernels read."""
        return _device_tables(self.spec, self.head_dim, str(torch.device(device)))

    def band_tensors(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """All grids and midpoints concatenated (fp32) for kernels: band b's LUT starts at the
        sum of 2**bits of the bands before it; its 2**bits - 1 midpoints (then +inf) at the same offset."""
        return _band_tensors(self.spec, self.head_dim, str(torch.device(device)))

    # --- reference encode / decode (pure PyTorch, CPU or CUDA) ---------------------------------

    def coefficients(
        self,
        x: torch.Tensor,
        channel_scale: torch.Tensor | None = None,
        channel_offset: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 coefficients c = W R ((x - m) / s) for x [..., Hkv, T, D]; s and m broadcast
        against x ([Hkv, 1, D]); R is [Hkv, D, D] (per kv head) or None."""
        self._check_last_dim(x, "x")
        y = x.float()
        if channel_offset is not None:
            y = y - channel_offset.float()
        if channel_scale is not None:
            y = y / channel_scale.float()
        if rotation is not None:  # z = R y per kv head, then c = W z (the kernel's order)
            self._check_rotation(rotation)
            y = y @ rotation.to(y.device).float().transpose(-1, -2)
        return y @ self.transform.to(y.device).T

    def head_transforms(
        self, rotation: torch.Tensor | None, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The matrix M = W R that maps a (centred, smoothed) vector to its coefficients:
        [D, D] without a rotation, [Hkv, D, D] with one. Keys: q' = M (q * s); values:
        out = (M^T sum_i p_i c_i) * s + m."""
        w = self.transform.to(device)
        if rotation is None:
            return w
        self._check_rotation(rotation)
        return w @ rotation.to(device).float()

    def _check_rotation(self, rotation: torch.Tensor) -> None:
        if rotation.dim() != 3 or tuple(rotation.shape[-2:]) != (self.head_dim, self.head_dim):
            raise ValueError(
                f"rotation must be [Hkv, {self.head_dim}, {self.head_dim}], got {tuple(rotation.shape)}"
            )

    def encode(
        self,
        x: torch.Tensor,
        channel_scale: torch.Tensor | None = None,
        channel_offset: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] (any float dtype) -> (codes uint8 [..., n_code_bytes], scales fp16 [..., n_bands])."""
        c = self.coefficients(x, channel_scale, channel_offset, rotation)
        finite = torch.isfinite(c).all(dim=-1, keepdim=True)
        c = torch.where(finite, c, torch.zeros((), device=c.device))
        code_parts, scale_parts = [], []
        for i, band in enumerate(self.bands):
            cb = c[..., band.start : band.start + band.size]
            codes, scale = self._encode_band(i, cb)
            code_parts.append(_pack(codes, band.bits))
            scale_parts.append(scale)
        codes = torch.cat(code_parts, dim=-1)
        scales = torch.stack(scale_parts, dim=-1)
        codes = torch.where(finite, codes, torch.zeros((), dtype=codes.dtype, device=codes.device))
        scales = torch.where(
            finite, scales, torch.full((), math.nan, dtype=scales.dtype, device=scales.device)
        )
        return codes, scales

    def _encode_band(self, index: int, cb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        grid = self.grids[index].to(cb.device)
        mids = self.midpoints[index].to(cb.device)
        rule = self.scale_rules[index]
        absmax = cb.abs().amax(dim=-1)
        if rule.startswith("absmax"):
            scale16 = _to_fp16_scale(absmax)
            codes = _quantize(cb, scale16, mids)
        else:
            # All candidate scales at once: [n_candidates, ..., size]; argmin keeps the first
            # (largest) candidate among equal errors, as the kernel's strict `<` update does.
            fractions = self.scale_fractions.to(cb.device).reshape(-1, *([1] * absmax.dim()))
            cand16 = _to_fp16_scale(absmax.unsqueeze(0) * fractions)
            cand_codes = _quantize(cb.unsqueeze(0), cand16, mids)
            err = (
                (cb.unsqueeze(0) - grid[cand_codes.long()] * cand16.float().unsqueeze(-1)).pow(2).sum(dim=-1)
            )
            best = err.argmin(dim=0, keepdim=True)
            codes = cand_codes.gather(0, best.unsqueeze(-1).expand(1, *cand_codes.shape[1:])).squeeze(0)
            scale16 = cand16.gather(0, best).squeeze(0)
        if rule.endswith("-ub"):
            scale16 = _unbiased_scale(cb, grid[codes.long()], scale16)
        return codes, scale16

    def decode_coefficients(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(codes, scales) -> fp32 coefficients [..., D]."""
        if codes.shape[-1] != self.n_code_bytes or scales.shape[-1] != self.n_bands:
            raise ValueError(
                f"codes [..., {codes.shape[-1]}] / scales [..., {scales.shape[-1]}] do not match this codec "
                f"(n_code_bytes={self.n_code_bytes}, n_bands={self.n_bands})"
            )
        parts = []
        for i, band in enumerate(self.bands):
            off = self.band_byte_offsets[i]
            nbytes = band.size * band.bits // 8
            idx = _unpack(codes[..., off : off + nbytes], band.bits)
            grid = self.grids[i].to(codes.device)
            parts.append(grid[idx.long()] * scales[..., i : i + 1].float())
        return torch.cat(parts, dim=-1)

    def decode(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        channel_scale: torch.Tensor | None = None,
        dtype: torch.dtype = torch.float32,
        channel_offset: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(codes, scales) -> x_hat [..., D] = (R^T W^T c_hat) * s + m, in `dtype`."""
        c = self.decode_coefficients(codes, scales)
        x = c @ self.head_transforms(rotation, c.device)
        if channel_scale is not None:
            x = x * channel_scale.float()
        if channel_offset is not None:
            x = x + channel_offset.float()
        return x.to(dtype)

    def roundtrip(
        self,
        x: torch.Tensor,
        channel_scale: torch.Tensor | None = None,
        channel_offset: torch.Tensor | None = None,
        rotation: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """decode(encode(x)) in x's dtype (fake quantization, as the quality harness uses it)."""
        codes, scales = self.encode(x, channel_scale, channel_offset, rotation)
        return self.decode(codes, scales, channel_scale, x.dtype, channel_offset, rotation)

    def _check_last_dim(self, x: torch.Tensor, name: str) -> None:
        if x.shape[-1] != self.head_dim:
            raise ValueError(
                f"{name} has last dimension {x.shape[-1]}, this codec's head_dim is {self.head_dim}"
            )


@lru_cache(maxsize=64)
def get_codec(spec: str, head_dim: int) -> WaveletKVCodec:
    """Cached codec for a spec string (what ops and kernels carry)."""
    return WaveletKVCodec(WaveletKVConfig.from_spec(spec), int(head_dim))


@lru_cache(maxsize=64)
def _band_tensors(spec: str, head_dim: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    codec = get_codec(spec, head_dim)
    with unset_fake_temporarily():
        return _concat_tables(codec, device)


@lru_cache(maxsize=64)
def _device_tables(
    spec: str, head_dim: int, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codec = get_codec(spec, head_dim)
    grids, mids = _band_tensors(spec, head_dim, device)
    with unset_fake_temporarily():
        w = codec.transform.to(device).contiguous()
        fractions = codec.scale_fractions.to(device)
    return w, grids, mids, fractions


def _concat_tables(codec: WaveletKVCodec, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    grids = torch.cat(codec.grids).to(device)
    mids = torch.cat([torch.cat([m, m.new_full((1,), math.inf)]) for m in codec.midpoints]).to(device)
    return grids, mids


def _unbiased_scale(cb: torch.Tensor, levels: torch.Tensor, scale16: torch.Tensor) -> torch.Tensor:
    """Rescale so the reconstruction's projection on the band equals the band:
    scale = |c|^2 / <grid[code], c>. Minimum-error scales shrink (the reconstruction has less
    energy than c); in attention that shrink is systematic (it cools every score and scales every
    value sum), while an error orthogonal to c averages out. Falls back to the coding scale when
    <grid[code], c> <= 0 (every code on a zero level)."""
    energy = cb.pow(2).sum(dim=-1)
    proj = (levels * cb).sum(dim=-1)
    ok = proj > 0
    ratio = energy / torch.where(ok, proj, torch.ones((), device=proj.device))
    return torch.where(ok, _to_fp16_scale(ratio), scale16)


def _to_fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.clamp(max=FP16_MAX).to(torch.float16)


def _quantize(cb: torch.Tensor, scale16: torch.Tensor, mids: torch.Tensor) -> torch.Tensor:
    s = scale16.float().unsqueeze(-1)
    u = torch.where(
        s > 0, cb / torch.where(s > 0, s, torch.ones((), device=s.device)), torch.zeros((), device=s.device)
    )
    # number of midpoints strictly below u == index of the nearest level (ties go down)
    return torch.searchsorted(mids, u.contiguous(), right=False).to(torch.uint8)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    vals = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


# ----------------------------------------------------------------------------------------------
# per-channel smoothing (folded into the query for keys, into the output for values)


def rope_pair_rms(x: torch.Tensor) -> torch.Tensor:
    """Per-channel RMS of x [..., Hkv, T, D] over all leading dims and T, averaged in energy over
    each rotate-half RoPE pair (i, i + D/2), so the result commutes with RoPE. Returns [Hkv, D]."""
    if x.dim() < 3:
        raise ValueError(f"expected x [..., Hkv, T, D], got shape {tuple(x.shape)}")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE pairs need an even head_dim, got {d}")
    xf = x.float().transpose(-3, 0).reshape(x.shape[-3], -1, d)  # [Hkv, N, D]
    energy = xf.pow(2).mean(dim=1)
    paired = (energy[:, : d // 2] + energy[:, d // 2 :]) / 2
    return torch.cat([paired, paired], dim=-1).sqrt()


def smoothing_from_rms(rms: torch.Tensor, alpha: float = 1.0, eps: float = 1e-6) -> torch.Tensor:
    """s = rms ** alpha per head, normalised to geometric mean 1 (fp32 [Hkv, D])."""
    s = rms.float().clamp_min(eps).pow(alpha)
    return s / s.log().mean(dim=-1, keepdim=True).exp()


def calibrate_channel_scale(x: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """Smoothing vector s [Hkv, D] from sample keys (or values) x [..., Hkv, T, D], e.g. a prompt."""
    return smoothing_from_rms(rope_pair_rms(x), alpha)


def channel_offset(x: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """Per-channel mean [Hkv, D] of sample keys or values x [..., Hkv, T, D], leaving out the
    first `skip` positions (attention-sink tokens are outliers and are kept exact anyway)."""
    if x.dim() < 3:
        raise ValueError(f"expected x [..., Hkv, T, D], got shape {tuple(x.shape)}")
    xs = x[..., skip:, :] if x.shape[-2] > skip else x
    return xs.float().transpose(-3, 0).reshape(x.shape[-3], -1, x.shape[-1]).mean(1)


def channel_scale_qk(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Key smoothing s = sqrt(rms_k / rms_q) [Hkv, D] from sample queries [..., Hq, T, D] and keys
    [..., Hkv, T, D] (each kv head pools the energy of its query group); RoPE-pair averaged.
    For a quantization step that scales with the rms of k / s, the score error
    sum_j q_j s_j e_j is smallest for this s (Cauchy-Schwarz)."""
    rms_k = rope_pair_rms(keys)
    rms_q = rope_pair_rms(queries)
    hkv, hq = rms_k.shape[0], rms_q.shape[0]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of kv heads {hkv}")
    rms_q = rms_q.pow(2).reshape(hkv, hq // hkv, -1).mean(1).sqrt()
    return smoothing_from_rms(rms_k / rms_q.clamp_min(1e-6), 0.5)


def channel_scale_ov(values: torch.Tensor, o_proj_weight: torch.Tensor) -> torch.Tensor:
    """Value smoothing s = sqrt(rms_v / w) [Hkv, D], w_j the norm of the o_proj columns that read
    value channel j (all query heads of the kv head's group)."""
    hkv, d = values.shape[-3], values.shape[-1]
    rms_v = values.float().transpose(-3, 0).reshape(hkv, -1, d).pow(2).mean(1).sqrt()
    cols = o_proj_weight.float().pow(2).sum(0)  # [Hq * D]
    hq = cols.numel() // d
    if cols.numel() != hq * d or hq % hkv:
        raise ValueError(
            f"o_proj has {cols.numel()} input columns; expected a multiple of Hkv * D = {hkv * d}"
        )
    w = cols.reshape(hkv, hq // hkv, d).sum(1).sqrt()
    return smoothing_from_rms(rms_v / w.clamp_min(1e-12), 0.5)


def channel_scale_from_weights(
    k_proj_weight: torch.Tensor, num_kv_heads: int, alpha: float = 1.0
) -> torch.Tensor:
    """Smoothing vector s [Hkv, D] from a k_proj weight [Hkv * D, hidden]: a channel's row norm is
    its RMS for an isotropic input; pair-averaged for RoPE."""
    rows = k_proj_weight.float()
    if rows.shape[0] % num_kv_heads:
        raise ValueError(f"k_proj rows {rows.shape[0]} are not a multiple of num_kv_heads={num_kv_heads}")
    d = rows.shape[0] // num_kv_heads
    energy = rows.pow(2).sum(dim=1).reshape(num_kv_heads, d)
    paired = (energy[:, : d // 2] + energy[:, d // 2 :]) / 2
    return smoothing_from_rms(torch.cat([paired, paired], dim=-1).sqrt(), alpha)


def pca_rotation(x: torch.Tensor) -> torch.Tensor:
    """Per-head principal axes of samples x [..., Hkv, T, D] as rows, largest variance first:
    an orthonormal [Hkv, D, D] R (R @ R.T == I)."""
    hkv, d = x.shape[-3], x.shape[-1]
    xs = x.double().transpose(-3, 0).reshape(hkv, -1, d)
    return pca_rotation_from_moments(xs.transpose(1, 2) @ xs / max(1, xs.shape[1]))


def pca_rotation_from_moments(cov: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of a symmetric [Hkv, D, D] moment matrix as rows, largest eigenvalue first;
    each axis signed so its largest entry is positive (deterministic)."""
    _, vecs = torch.linalg.eigh(cov.double())  # ascending eigenvalues, eigenvectors as columns
    rot = vecs.flip(-1).transpose(1, 2)
    idx = rot.abs().argmax(dim=-1, keepdim=True)
    sign = torch.sign(rot.gather(-1, idx))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return (rot * sign).float()


@dataclass(frozen=True)
class RopeSpec:
    """How the calibration keys were rotated, and the positions the codec will serve.

    theta      [D/2] radians per position of each rotate-half pair (i, i + D/2)
    positions  [T] position of every calibration sample
    context    statistics are averaged over positions [0, context)
    """

    theta: torch.Tensor
    positions: torch.Tensor
    context: int


def rope_theta_per_pair(head_dim: int, base: float) -> torch.Tensor:
    """Default (Llama) RoPE frequencies: base ** (-2 i / D), i < D / 2."""
    return float(base) ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _position_average(omega: torch.Tensor, context: int) -> torch.Tensor:
    """(1 / L) sum_{p < L} exp(j omega p), elementwise (complex128)."""
    omega = omega.double()
    num = 1 - torch.exp(1j * omega * context)
    den = context * (1 - torch.exp(1j * omega))
    small = omega.abs() < 1e-12
    return torch.where(small, torch.ones_like(num), num / torch.where(small, torch.ones_like(den), den))


def rope_averaged_moments(
    keys: torch.Tensor, rope: RopeSpec, skip: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean [Hkv, D] and second moment [Hkv, D, D] of RoPE'd keys averaged over the positions
    [0, rope.context), from calibration keys [..., Hkv, T, D] taken at rope.positions.

    Keys are stored after RoPE, so their statistics depend on where in the sequence they sit: a
    pair rotating by theta per position carries its mean and correlations around. Un-rotating the
    samples (z = k_i + j k_{i+D/2}, z_pre = z exp(-j theta p)) and averaging the rotation over the
    served positions gives statistics valid for the whole context, from a short sample."""
    hkv, t, d = keys.shape[-3], keys.shape[-2], keys.shape[-1]
    h = d // 2
    x = keys.double().transpose(-3, 0).reshape(hkv, -1, t, d)[:, :, skip:]  # [Hkv, N, T', D]
    pos = rope.positions.double()[skip:]
    theta = rope.theta.double()
    z = torch.complex(x[..., :h], x[..., h:]) * torch.exp(-1j * theta * pos.unsqueeze(-1))
    z = z.reshape(hkv, -1, h)
    n = z.shape[1]
    mu = z.mean(1)  # [Hkv, h]
    a = z.transpose(1, 2) @ z.conj() / n  # A_il = E[z_i conj(z_l)]
    b = z.transpose(1, 2) @ z / n  # B_il = E[z_i z_l]
    mu = mu * _position_average(theta, rope.context)
    a = a * _position_average(theta[:, None] - theta[None, :], rope.context)
    b = b * _position_average(theta[:, None] + theta[None, :], rope.context)
    mean = torch.cat([mu.real, mu.imag], dim=-1)
    second = torch.empty(hkv, d, d, dtype=torch.float64)
    second[:, :h, :h] = (a + b).real / 2  # E[x1_i x1_l]
    second[:, h:, h:] = (a - b).real / 2  # E[x2_i x2_l]
    second[:, h:, :h] = (a + b).imag / 2  # E[x2_i x1_l]
    second[:, :h, h:] = (b - a).imag / 2  # E[x1_i x2_l]
    return mean, second


def pack_channel_params(
    head_dim: int,
    num_kv_heads: int,
    scale: torch.Tensor | None = None,
    offset: torch.Tensor | None = None,
    rotation: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `channel_scale` tensor the ops take, in its full form [Hkv, D + 2, D]: rows [0, D) the
    rotation R (identity when None), row D the scale s (ones), row D + 1 the offset m (zeros)."""
    d, h = head_dim, num_kv_heads
    out = torch.zeros(h, d + 2, d)
    out[:, :d] = torch.eye(d) if rotation is None else rotation.float().reshape(h, d, d)
    out[:, d] = 1.0 if scale is None else scale.float().reshape(h, d)
    out[:, d + 1] = 0.0 if offset is None else offset.float().reshape(h, d)
    return out


def calibrate_channel_params(
    config: WaveletKVConfig,
    kind: str,
    samples: torch.Tensor,
    queries: torch.Tensor | None = None,
    proj_weight: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
) -> torch.Tensor | None:
    """Offset, smoothing and rotation for one layer's keys (kind "k") or values ("v") from
    calibration samples [..., Hkv, T, D], as the ops' `channel_scale` tensor [Hkv, D + 2, D]
    (None when the config asks for none of them). `queries` [..., Hq, T, D] serve k_smoothing=qk;
    `proj_weight` is k_proj's weight (k_smoothing=weights) or o_proj's (v_smoothing=ov).
    `rope` (keys only): the keys' offset and rotation come from statistics averaged over the
    served positions (rope_averaged_moments) instead of the samples' own positions."""
    if kind not in ("k", "v"):
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    hkv, d = samples.shape[-3], samples.shape[-1]
    offset_rule = config.k_offset if kind == "k" else config.v_offset
    smooth_rule = config.k_smoothing if kind == "k" else config.v_smoothing
    if offset_rule == "none" and smooth_rule == "none" and config.rotation == "none":
        return None
    x = samples.float()
    offset = channel_offset(x, skip=config.sinks) if offset_rule == "calibrated" else None
    if offset is not None:
        x = x - offset.unsqueeze(1)
    scale = None
    if smooth_rule == "calibrated":
        scale = calibrate_channel_scale(x, config.smoothing_alpha)
    elif smooth_rule == "weights":
        if proj_weight is None:
            raise ValueError("k_smoothing=weights needs k_proj's weight")
        scale = channel_scale_from_weights(proj_weight, hkv, config.smoothing_alpha)
    elif smooth_rule == "qk":
        if queries is None:
            raise ValueError("k_smoothing=qk needs sample queries")
        scale = channel_scale_qk(queries, x)
    elif smooth_rule == "ov":
        if proj_weight is None:
            raise ValueError("v_smoothing=ov needs o_proj's weight")
        scale = channel_scale_ov(x, proj_weight)
    elif smooth_rule == "q":
        # s = 1 / rms_q: the coded vector is k * rms_q, whose squared error is the expected
        # score error E[(q . e)^2] for decorrelated query channels
        if queries is None:
            raise ValueError("k_smoothing=q needs sample queries")
        rms_q = rope_pair_rms(queries)
        hq = rms_q.shape[0]
        rms_q = rms_q.pow(2).reshape(hkv, hq // hkv, -1).mean(1).sqrt()
        scale = smoothing_from_rms(1.0 / rms_q.clamp_min(1e-6), 1.0)
    elif smooth_rule == "o":
        # s = 1 / |o_proj column|: the coded vector's squared error is the error after o_proj
        if proj_weight is None:
            raise ValueError("v_smoothing=o needs o_proj's weight")
        cols = proj_weight.float().pow(2).sum(0)
        w = cols.reshape(hkv, -1, d).sum(1).sqrt()
        scale = smoothing_from_rms(1.0 / w.clamp_min(1e-12), 1.0)
    if scale is not None:
        x = x / scale.unsqueeze(1)
    rotation = None
    if kind == "k" and rope is not None:
        mean, second = rope_averaged_moments(samples, rope, skip=config.sinks)
        if offset_rule == "calibrated":
            offset = mean.float()
            second = second - mean.unsqueeze(-1) * mean.unsqueeze(-2)
        if config.rotation != "none":
            if scale is not None:
                inv = 1.0 / scale.double()
                second = second * inv.unsqueeze(-1) * inv.unsqueeze(-2)
            rotation = pca_rotation_from_moments(second)
    elif config.rotation != "none":
        rotation = pca_rotation(x[..., config.sinks :, :])
    if rotation is not None and config.rotation == "pca_mixed":
        rotation = band_mixing(config, d) @ rotation
    return pack_channel_params(d, hkv, scale, offset, rotation)


def _hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def _dct_ii(n: int) -> torch.Tensor:
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    m = torch.cos(math.pi * (i + 0.5) * k / n) * math.sqrt(2.0 / n)
    m[0] /= math.sqrt(2.0)
    return m


def band_mixing(config: WaveletKVConfig, head_dim: int) -> torch.Tensor:
    """Orthonormal [D, D] B with W^T B W block-diagonal over the config's bands: a normalised
    Hadamard (a DCT-II where the band size is not a power of two) inside each band of W's
    coefficients. `rotation=pca_mixed` stores R' = B R: each band keeps the energy of its PCA
    components, spread evenly over its coefficients, so one scale per band and a uniform grid fit
    every coefficient alike (after PCA a band's variances fall by ~10x from first to last)."""
    layout = codec_layout(config, head_dim)
    mix = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for band in layout.bands:
        n = band.size
        block = _hadamard(n) if n & (n - 1) == 0 else _dct_ii(n)
        mix[band.start : band.start + n, band.start : band.start + n] = block
    w = wavelet_matrix(config.wavelet, head_dim, layout.levels).double()
    return (w.T @ mix @ w).float()
