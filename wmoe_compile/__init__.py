"""wmoe_compile: compile Mixture-of-Experts models for fast GPU serving.

Public API (filled in as the capabilities land; see the README's status table):
  models.build_model        the reference Mixtral-style decoder
  WaveletKVConfig, WaveletKVCodec   the compressed KV format (codec.py)
"""

from . import models
from .codec import WaveletKVCodec, WaveletKVConfig

__version__ = "0.1.0"
__all__ = ["models", "__version__", "WaveletKVConfig", "WaveletKVCodec"]
