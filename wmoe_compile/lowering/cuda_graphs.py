"""Replay decode steps from a CUDA graph: the serving setup for a `backend="wmoe"` model.

Why: a compiled decode step is a few dozen kernels whose Python launch path (custom-op dispatch,
Triton argument binding) costs more host time than the GPU spends on them at small batches
(benchmarks/RESULTS.md: ~3.5 ms of host time per uncaptured 2-layer Mixtral-shape step against
~1.6 ms of GPU time). Captured once, a step is one graph replay.

    step = GraphedDecodeStep(torch.compile(model, backend="wmoe"))
    model.generate(prompt, 64, step_fn=step)   # prefill runs as is; every 1-token step replays

The wrapped function must be capturable: no host synchronisation and fixed tensor addresses
(static caches as module buffers, like the reference model and `pipeline.HFStaticCacheLM`). The
fused ops are; the attention op's PyTorch fallback (head dims other than 64/128/256) reads
sequence lengths on the host and is not: capture then fails with CUDA's capture error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphedDecodeStep:
    """`step(tokens, positions) -> logits` that replays one CUDA graph for single-token steps.

    Calls with more than one token per sequence (prefill) or on the CPU run `fn` directly. The first
    single-token call runs `fn` twice on a side stream (compilation, allocations) and captures a
    third call; each later call copies its inputs into the captured buffers and replays. The
    returned logits are the graph's output buffer: read them before the next call. The warm-up
    calls repeat the first decode step's cache write with the same values, so they change nothing.
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self._tokens: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.shape[1] != 1 or not tokens.is_cuda:
            return self.fn(tokens, positions)
        if self.graph is None:
            self._capture(tokens, positions)
        elif tokens.shape != self._tokens.shape or positions.shape != self._positions.shape:
            raise ValueError(
                f"GraphedDecodeStep captured tokens {tuple(self._tokens.shape)} and positions "
                f"{tuple(self._positions.shape)}; got {tuple(tokens.shape)} and {tuple(positions.shape)} "
                "(make a new one per batch size)"
            )
        self._tokens.copy_(tokens)
        self._positions.copy_(positions.to(self._positions.device))
        self.graph.replay()
        return self._logits

    def _capture(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        self._tokens = tokens.clone()
        self._positions = positions.to(tokens.device).clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(self._tokens, self._positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = self.fn(self._tokens, self._positions)
        self.graph = graph
