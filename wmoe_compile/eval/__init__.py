"""Quality harness for KV compression (`wmoe-compile eval`): teacher-forced evaluation of a real
causal LM in which every attention reads the compressed K/V of past tokens."""

from .harness import EvalReport, MethodResult, compressed_cache_attention, load_model, load_text, run_eval
from .methods import KVMethod, parse_method

__all__ = [
    "EvalReport",
    "KVMethod",
    "MethodResult",
    "compressed_cache_attention",
    "load_model",
    "load_text",
    "parse_method",
    "run_eval",
]
