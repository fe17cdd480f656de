"""wmoe_compile: compile Mixture-of-Experts models for fast GPU serving.

Public API (filled in as the capabilities land; see the README's status table):
  models.build_model        the reference Mixtral-style decoder
  WaveletKVConfig, WaveletKVCodec   the compressed KV format (codec.py)
  pack_expert_weights, PackedExperts   expert weights packed for wmoe::tiled_moe (moe_packing.py)
  transform, export, prepare, CompileConfig   the FX pass pipeline (pipeline.py, config.py)
  export_onnx, export_tensorrt   lowering (lowering/); torch.compile(backend="wmoe") needs no import
"""

from . import models
from .codec import WaveletKVCodec, WaveletKVConfig
from .moe_packing import PackedExperts, pack_expert_weights

__version__ = "0.1.0"
__all__ = ["models", "__version__", "WaveletKVConfig", "WaveletKVCodec"]
__all__ += ["PackedExperts", "pack_expert_weights"]

# The compiler: pass pipeline, configuration, capture helpers (pipeline.py, config.py, passes/).
from .config import CompileConfig  # noqa: E402
from .pipeline import export, prepare, transform  # noqa: E402

__all__ += ["CompileConfig", "transform", "export", "prepare"]

# Lowering: ONNX (portable / plugin) and TensorRT (lowering/); the torch.compile backend `wmoe`
# is found through its entry point.
from .lowering import export_onnx, export_tensorrt  # noqa: E402

__all__ += ["export_onnx", "export_tensorrt"]
