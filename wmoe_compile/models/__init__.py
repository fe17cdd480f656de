"""Reference models: small, direct code that specifies what the passes rewrite."""

from .mixtral import CONFIGS, MixtralModel, ModelConfig, build_model, get_config

__all__ = ["CONFIGS", "MixtralModel", "ModelConfig", "build_model", "get_config"]
