"""CompileConfig: what the pass pipeline rewrites and how.

    CompileConfig()                                   # every rewrite on, default codec
    CompileConfig(codec="default;window=32")          # a codec spec string or a WaveletKVConfig
    CompileConfig(replace_moe=False)                  # switch one rewrite off
    CompileConfig(bypass_codec=True)                  # ops swapped, codec an exact passthrough
    CompileConfig(channel_params={0: {"k": pk, "v": pv}, ...})   # precomputed channel parameters
    CompileConfig(calibration_inputs=(args, kwargs))  # calibrate on these, not the example inputs

Channel parameters (docs/CONTRACTS.md: offset m, smoothing s, rotation R per (layer, kv head)) are
what the default codec needs besides its spec. insert_dwt_quantize gets them, per layer, from
  1. `channel_params`: precomputed, keyed by layer (int) -> {"k": tensor, "v": tensor} (or a
     (k, v) pair), or by the dense cache's attribute name (str) -> tensor; any form the ops take,
     e.g. codec.calibrate_channel_params(...) output [Hkv, D + 2, D];
  2. calibration: the captured graph runs on `calibration_inputs` (default: the example inputs)
     and each K/V write site's tensors (post-RoPE keys, values, and queries when a smoothing rule
     needs them) are recorded and passed to codec.calibrate_channel_params. Keys are calibrated
     RoPE-aware (statistics averaged over the cache's positions) when the RoPE base is known:
     `rope_theta`, else the model config (export reads HF `rope_parameters` / `rope_theta`), else
     measured from the graph (the RoPE input and output of the key at position 1);
  3. otherwise the layer falls back to the codec without its sample-calibrated parts (no offsets,
     no rotation, smoothing only from weights) and the report and a warning say so.

`bypass_codec` keeps the op graph the rewrites produce (kv_compress_into_cache, wavelet_attention)
but makes the codec lossless without a special codec mode: every site's codec gets `sinks=0` and
`window=S` (the site's cache capacity), so the exact ring cache holds every position at its own
slot and wavelet_attention reads every position exactly. The compressed code/scale caches are
still written (so the op path and its shapes are exercised) but never read. Memory is then the
dense cache plus the codes: bypass is for checking the rewrites, not for serving.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .codec import WaveletKVConfig

MOE_LAYOUTS = ("tiles64", "rows")


@dataclass(frozen=True)
class MoEOpConfig:
    """Settings of the wmoe::tiled_moe rewrite.

    layout    packed weight layout (kernels/tiled_moe.py): "tiles64" (64x64 tiles streamed by the
              kernel's software pipeline) or "rows"; None = the kernel's default.
    dtype     dtype of the packed weights; None = the dtype of the hidden states at the site (the
              op needs hidden and weights in one dtype).
    validate  check expert ids on every call (a host synchronisation; off for serving).
    """

    layout: str | None = None
    dtype: torch.dtype | None = None
    validate: bool = False

    def __post_init__(self) -> None:
        if self.layout is not None and self.layout not in MOE_LAYOUTS:
            raise ValueError(f"MoE layout must be one of {MOE_LAYOUTS} or None, got {self.layout!r}")
        if self.dtype is not None and self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"MoE weight dtype must be bfloat16, float16 or float32, got {self.dtype}")


@dataclass(frozen=True)
class CompileConfig:
    """What `wmoe_compile.transform` / `export` / the `wmoe` torch.compile backend do.

    codec            the compressed KV format (WaveletKVConfig, or its spec string / preset name)
    moe              MoEOpConfig (or a dict of its fields)
    compress_kv      insert_dwt_quantize: K/V cache writes -> wmoe::kv_compress_into_cache
    swap_attention   swap_wavelet_attention: attention -> wmoe::wavelet_attention on the
                     compressed cache (needs compress_kv)
    replace_moe      replace_moe_dispatch: expert dispatch -> wmoe::tiled_moe on packed weights
    fuse_linears     fuse_sibling_linears: linears of one input (q/k/v projections) -> one linear
                     over their stacked weights
    decompose_topk   decompose_router_topk: a router's top-k (small k, <= 512 experts) -> k rounds
                     of max and mask, which Inductor fuses with the softmax and renormalisation
    overlap_cache_writes  overlap_cache_writes: a decode step's KV cache writes run on the
                     attention's side stream, beside its split kernel (-0.5 to -0.9% a step on the
                     H200, benchmarks/RESULTS.md)
    bypass_codec     make the codec an exact passthrough (see the module docstring)
    check_numerics   after every pass, run the graph on the sample inputs and compare with the
                     previous graph (needs sample inputs: export() has them)
    channel_params   precomputed channel parameters per layer (see the module docstring)
    calibration_inputs  (args, kwargs) or args to calibrate on (default: the example inputs);
                     start them at position 0, like the example inputs
    rope_theta       RoPE base (e.g. 10000.0) for RoPE-aware key calibration; None = from the model
                     config or measured from the graph
    codec_error_gain the numeric check's bound for the lossy KV rewrite is
                     codec_error_gain * e * sqrt(L): e the codec's relative K/V error measured on
                     the sample inputs, L the number of compressed layers (errors of separate
                     layers add like a random walk). On the random-init reference model (window
                     and sinks 0) logits/e measured 0.55-0.66 at L=1, 0.77-0.94 at L=2 and
                     1.14-1.34 at L=4, i.e. about 0.6 sqrt(L); the default 2 leaves 3x headroom.
    """

    codec: WaveletKVConfig = field(default_factory=WaveletKVConfig)
    moe: MoEOpConfig = field(default_factory=MoEOpConfig)
    compress_kv: bool = True
    swap_attention: bool = True
    replace_moe: bool = True
    fuse_linears: bool = True
    decompose_topk: bool = True
    overlap_cache_writes: bool = True
    bypass_codec: bool = False
    check_numerics: bool = False
    codec_error_gain: float = 2.0
    # Tensors: excluded from == and hash (a config is compared by its settings).
    channel_params: Mapping[int | str, Any] | None = field(default=None, compare=False)
    calibration_inputs: tuple | None = field(default=None, compare=False)
    rope_theta: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.codec, str):
            object.__setattr__(self, "codec", WaveletKVConfig.from_spec(self.codec))
        elif not isinstance(self.codec, WaveletKVConfig):
            raise TypeError(
                f"codec must be a WaveletKVConfig or a spec string, got {type(self.codec).__name__}"
            )
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEOpConfig(**self.moe))
        elif not isinstance(self.moe, MoEOpConfig):
            raise TypeError(
                f"moe must be a MoEOpConfig or a dict of its fields, got {type(self.moe).__name__}"
            )
        for name in (
            "compress_kv",
            "swap_attention",
            "replace_moe",
            "fuse_linears",
            "decompose_topk",
            "overlap_cache_writes",
            "bypass_codec",
            "check_numerics",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.codec_error_gain > 0:
            raise ValueError(f"codec_error_gain must be > 0, got {self.codec_error_gain}")
        if self.channel_params is not None:
            object.__setattr__(self, "channel_params", _check_channel_params(self.channel_params))
        if self.calibration_inputs is not None:
            object.__setattr__(self, "calibration_inputs", as_args_kwargs(self.calibration_inputs))
        if self.rope_theta is not None and not (
            isinstance(self.rope_theta, (int, float)) and self.rope_theta > 1
        ):
            raise ValueError(f"rope_theta must be a RoPE base > 1 (e.g. 10000.0), got {self.rope_theta!r}")

    def layer_channel_params(self, layer: int, kind: str, dense_cache: str | None) -> torch.Tensor | None:
        """The precomputed channel parameters of one cache (kind "k" or "v"), or None."""
        table = self.channel_params or {}
        if dense_cache is not None and dense_cache in table:
            return table[dense_cache]
        entry = table.get(layer)
        return None if entry is None else entry[kind]

    def replace(self, **changes) -> CompileConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return {
            "codec": self.codec.to_spec(),
            "moe": {
                "layout": self.moe.layout,
                "dtype": str(self.moe.dtype) if self.moe.dtype else None,
                "validate": self.moe.validate,
            },
            "compress_kv": self.compress_kv,
            "swap_attention": self.swap_attention,
            "replace_moe": self.replace_moe,
            "fuse_linears": self.fuse_linears,
            "decompose_topk": self.decompose_topk,
            "overlap_cache_writes": self.overlap_cache_writes,
            "bypass_codec": self.bypass_codec,
            "check_numerics": self.check_numerics,
            "codec_error_gain": self.codec_error_gain,
            "channel_params": sorted(map(str, self.channel_params)) if self.channel_params else None,
            "calibration_inputs": _describe_inputs(self.calibration_inputs),
            "rope_theta": self.rope_theta,
        }


def as_args_kwargs(inputs: tuple) -> tuple[tuple, dict]:
    """(args, kwargs) from either that pair or a plain tuple of positional arguments."""
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs must be a tuple of arguments or (args, kwargs), got {type(inputs).__name__}")
    if len(inputs) == 2 and isinstance(inputs[0], tuple) and isinstance(inputs[1], dict):
        return tuple(inputs[0]), dict(inputs[1])
    return tuple(inputs), {}


def _describe_inputs(inputs: tuple[tuple, dict] | None) -> list[str] | None:
    if inputs is None:
        return None
    args, kwargs = inputs
    return [
        f"{name}: {list(v.shape)}" if isinstance(v, torch.Tensor) else f"{name}: {type(v).__name__}"
        for name, v in [*((str(i), a) for i, a in enumerate(args)), *kwargs.items()]
    ]


def _check_channel_params(table: Mapping) -> dict:
    """Validate {layer: {"k": t, "v": t} | (k, v), dense cache name: t}; returns a normalised dict."""
    if not isinstance(table, Mapping):
        raise TypeError(
            "channel_params must be a dict {layer: {'k': tensor, 'v': tensor}} (or keyed by the dense "
            f"cache's attribute name), got {type(table).__name__}"
        )
    out: dict = {}
    for key, value in table.items():
        if isinstance(key, str):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"channel_params[{key!r}] must be a tensor, got {type(value).__name__}")
            out[key] = value
            continue
        if not isinstance(key, int) or isinstance(key, bool):
            raise TypeError(f"channel_params keys must be layer numbers or cache names, got {key!r}")
        if isinstance(value, (tuple, list)) and len(value) == 2:
            value = {"k": value[0], "v": value[1]}
        if not isinstance(value, Mapping) or set(value) != {"k", "v"}:
            raise ValueError(
                f"channel_params[{key}] must hold both caches of the layer: {{'k': tensor, 'v': tensor}} "
                "or a (k, v) pair"
            )
        for kind in "kv":
            if not isinstance(value[kind], torch.Tensor) or not value[kind].is_floating_point():
                raise TypeError(f"channel_params[{key}][{kind!r}] must be a float tensor")
        out[key] = {"k": value["k"], "v": value["v"]}
    return out
