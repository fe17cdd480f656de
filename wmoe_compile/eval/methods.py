"""KV compression methods the quality harness compares, as fake quantizers.

Each method maps a layer's keys or values [B, Hkv, T, D] (after RoPE, as a cache stores them) to
what attention would read back from its compressed cache, and states its bytes per vector.
Exact windows and sinks are applied by the harness, identically for every method.

Methods (names for --methods):
  none                 no compression (the reference run)
  wavelet              the default WaveletKVConfig;  wavelet-<preset> a named preset;
  wavelet:<spec>       any codec spec, e.g. "wavelet:wavelet=haar;levels=1;bands=1:4:int:absmax"
  fp8                  FP8 e4m3 per token (fp16 scale = absmax / 448)
  int2 | int3 | int4 | int8   uniform symmetric INT-b per token (absmax, fp16 scale)
  kivi2 | kivi4        KIVI-style: K per channel over groups of 32 tokens, V per token in groups of
                       32 channels; asymmetric b-bit (fp16 scale and zero per group)
"""

from __future__ import annotations

import math

import torch

from ..codec import PRESETS, RopeSpec, WaveletKVCodec, WaveletKVConfig, calibrate_channel_params
from ..kernels.kv_codec import compress_reference, decompress_reference

KIVI_GROUP = 32


class KVMethod:
    """Base: identity quantizer (the uncompressed reference)."""

    name = "none"
    window = 0
    sinks = 0

    def bytes_per_vector(self, head_dim: int) -> float:
        return 2.0 * head_dim  # fp16 cache

    def calibrate(
        self,
        layer: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        module: torch.nn.Module,
        rope: RopeSpec | None = None,
    ) -> None:
        """See sample queries/keys/values of a layer (calibration text) before the evaluation;
        `rope` says where the sample keys sat and which positions will be served."""

    def quantize(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        return x


class CodecMethod(KVMethod):
    """The wavelet codec through the same reference the ops use (kernels/kv_codec.py), with
    offsets / smoothing / rotations calibrated per layer (codec.calibrate_channel_params)."""

    def __init__(self, config: WaveletKVConfig, name: str) -> None:
        self.config = config
        self.name = name
        self.window = config.window
        self.sinks = config.sinks
        self._codecs: dict[int, WaveletKVCodec] = {}
        self._params: dict[tuple[int, str], torch.Tensor] = {}

    def codec(self, head_dim: int) -> WaveletKVCodec:
        if head_dim not in self._codecs:
            self._codecs[head_dim] = WaveletKVCodec(self.config, head_dim)
        return self._codecs[head_dim]

    def bytes_per_vector(self, head_dim: int) -> float:
        return float(self.codec(head_dim).bytes_per_vector)

    def calibrate(
        self,
        layer: int,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        module: torch.nn.Module,
        rope: RopeSpec | None = None,
    ) -> None:
        k_weight = getattr(getattr(module, "k_proj", None), "weight", None)
        o_weight = getattr(getattr(module, "o_proj", None), "weight", None)
        for kind, x, weight in (("k", keys, k_weight), ("v", values, o_weight)):
            params = calibrate_channel_params(
                self.config,
                kind,
                x,
                queries,
                None if weight is None else weight.detach(),
                rope if kind == "k" else None,
            )
            if params is not None:
                self._params[(layer, kind)] = params

    def needs_calibration(self, kind: str) -> bool:
        c = self.config
        offset, smooth = (c.k_offset, c.k_smoothing) if kind == "k" else (c.v_offset, c.v_smoothing)
        return offset != "none" or smooth != "none" or c.rotation != "none"

    def quantize(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        codec = self.codec(x.shape[-1])
        params = self._params.get((layer, kind))
        if params is None:
            if self.needs_calibration(kind):
                raise RuntimeError(
                    f"{self.name}: layer {layer} {kind} channel parameters were not calibrated"
                )
            params = torch.empty(0)
        params = params.to(x.device)
        codes, scales = compress_reference(codec, x, params)
        return decompress_reference(codec, codes, scales, params, x.dtype)


class IntPerToken(KVMethod):
    """Symmetric INT-b per token: levels -m..m (m = 2**(b-1) - 1), scale = absmax / m in fp16."""

    def __init__(self, bits: int, window: int, sinks: int) -> None:
        self.bits, self.window, self.sinks = bits, window, sinks
        self.name = f"int{bits}"

    def bytes_per_vector(self, head_dim: int) -> float:
        return head_dim * self.bits / 8 + 2

    def quantize(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        m = 2 ** (self.bits - 1) - 1
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / m).half().float()
        q = torch.where(scale > 0, xf / scale.clamp_min(1e-30), 0.0).round().clamp(-m, m)
        return (q * scale).to(x.dtype)


class FP8PerToken(KVMethod):
    name = "fp8"

    def __init__(self, window: int, sinks: int) -> None:
        self.window, self.sinks = window, sinks

    def bytes_per_vector(self, head_dim: int) -> float:
        return head_dim + 2

    def quantize(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) / 448.0).half().float()
        y = torch.where(scale > 0, xf / scale.clamp_min(1e-30), 0.0)
        return (y.to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


class Kivi(KVMethod):
    """KIVI (Liu et al. 2024) style asymmetric quantization: keys per channel over groups of
    KIVI_GROUP consecutive tokens, values per token over groups of KIVI_GROUP channels."""

    def __init__(self, bits: int, window: int, sinks: int) -> None:
        self.bits, self.window, self.sinks = bits, window, sinks
        self.name = f"kivi{bits}"

    def bytes_per_vector(self, head_dim: int) -> float:
        # codes + an fp16 (scale, zero) pair per group: K groups hold KIVI_GROUP tokens of one
        # channel (D pairs per KIVI_GROUP tokens), V groups KIVI_GROUP channels of one token.
        k = head_dim * self.bits / 8 + 4 * head_dim / KIVI_GROUP
        v = head_dim * self.bits / 8 + 4 * math.ceil(head_dim / KIVI_GROUP)
        return (k + v) / 2

    def quantize(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        levels = 2**self.bits - 1
        xf = x.float()
        b, h, t, d = xf.shape
        if kind == "k":
            pad = (-t) % KIVI_GROUP
            xp = torch.nn.functional.pad(xf, (0, 0, 0, pad), mode="replicate") if pad else xf
            g = xp.reshape(b, h, -1, KIVI_GROUP, d)
            lo, hi = g.amin(dim=3, keepdim=True), g.amax(dim=3, keepdim=True)
        else:
            g = xf.reshape(b, h, t, -1, KIVI_GROUP)
            lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
        lo = lo.half().float()
        scale = ((hi - lo) / levels).half().float()
        q = torch.where(scale > 0, (g - lo) / scale.clamp_min(1e-30), 0.0).round().clamp(0, levels)
        out = q * scale + lo
        if kind == "k":
            out = out.reshape(b, h, -1, d)[:, :, :t]
        return out.reshape(b, h, t, d).to(x.dtype)


def parse_method(text: str, window: int | None = None, sinks: int | None = None) -> KVMethod:
    """A method by name (see the module docstring). window/sinks: exact tokens for baselines
    (default 128 / 4) and overrides for wavelet configs when given."""
    text = text.strip()
    w = 128 if window is None else window
    s = 4 if sinks is None else sinks
    if text == "none":
        return KVMethod()
    if text == "fp8":
        return FP8PerToken(w, s)
    if text.startswith("int") and text[3:].isdigit():
        bits = int(text[3:])
        if not 2 <= bits <= 8:
            raise ValueError(f"INT baseline bits must be 2..8, got {bits}")
        return IntPerToken(bits, w, s)
    if text.startswith("kivi") and text[4:].isdigit():
        return Kivi(int(text[4:]), w, s)
    if text == "wavelet" or text.startswith("wavelet-") or text.startswith("wavelet:"):
        if text == "wavelet":
            config = PRESETS["default"]
        elif text.startswith("wavelet-"):
            preset = text[len("wavelet-") :]
            if preset not in PRESETS:
                raise ValueError(f"unknown wavelet preset {preset!r}; presets: {', '.join(PRESETS)}")
            config = PRESETS[preset]
        else:
            config = WaveletKVConfig.from_spec(text[len("wavelet:") :])
        overrides = {}
        if window is not None:
            overrides["window"] = window
        if sinks is not None:
            overrides["sinks"] = sinks
        if overrides:
            config = WaveletKVConfig.from_spec(
                config.to_spec() + "".join(f";{k}={v}" for k, v in overrides.items())
            )
        return CodecMethod(config, text)
    raise ValueError(
        f"unknown method {text!r}; valid: none, fp8, int2..int8, kivi2, kivi4, wavelet, "
        f"wavelet-<preset> ({', '.join(PRESETS)}), wavelet:<codec spec>"
    )
