"""CompileConfig: what the pass pipeline rewrites and how.

    CompileConfig()                                   # every rewrite on, default codec
    CompileConfig(codec="default;window=32")          # a codec spec string or a WaveletKVConfig
    CompileConfig(replace_moe=False)                  # switch one rewrite off
    CompileConfig(bypass_codec=True)                  # ops swapped, codec an exact passthrough

`bypass_codec` keeps the op graph the rewrites produce (kv_compress_into_cache, wavelet_attention)
but makes the codec lossless without a special codec mode: every site's codec gets `sinks=0` and
`window=S` (the site's cache capacity), so the exact ring cache holds every position at its own
slot and wavelet_attention reads every position exactly. The compressed code/scale caches are
still written (so the op path and its shapes are exercised) but never read. Memory is then the
dense cache plus the codes: bypass is for checking the rewrites, not for serving.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
    bypass_codec     make the codec an exact passthrough (see the module docstring)
    check_numerics   after every pass, run the graph on the sample inputs and compare with the
                     previous graph (needs sample inputs: export() has them)
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
    bypass_codec: bool = False
    check_numerics: bool = False
    codec_error_gain: float = 2.0

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
        for name in ("compress_kv", "swap_attention", "replace_moe", "bypass_codec", "check_numerics"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not self.codec_error_gain > 0:
            raise ValueError(f"codec_error_gain must be > 0, got {self.codec_error_gain}")

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
            "bypass_codec": self.bypass_codec,
            "check_numerics": self.check_numerics,
            "codec_error_gain": self.codec_error_gain,
        }
