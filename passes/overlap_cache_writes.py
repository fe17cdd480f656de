"""Rewrite pass: a decode step's KV cache writes run beside the attention that reads them.

Why: a decode step's `wmoe::kv_compress_into_cache` writes one token per sequence; each is a
latency-bound kernel of about 5 us on the H200, four per two-layer step, all on the critical path
before the attention. The attention op's split kernel then fills the GPU for hundreds of
microseconds, reading only positions older than the exact window, while the new tokens go to the
exact window, which only the exact-token kernel reads, on the attention's side stream. So the
writes can run on that side stream, ahead of the exact-token kernel and beside the split kernel
(`wmoe::kv_compress_into_cache_overlapped`; kernels/side_stream.py has the stream protocol).

A write is retargeted when a `wmoe::wavelet_attention` later in the graph reads the three caches
it writes (as its K or V codes, scales and exact cache), with the same codec, and no node between
the write and that attention touches any of those caches (another reader would see the write
in flight). Whether a given call defers is decided at run time: only on CUDA with the Triton
kernel, and only for chunks that fit the exact window (a prefill chunk writes positions the split
kernel reads, so it is written in order). On by default (`CompileConfig.overlap_cache_writes`):
-0.016 / -0.011 ms of a 1.85 / 2.04 ms two-layer step on the H200 (benchmarks/RESULTS.md,
thirteenth session).
"""

from __future__ import annotations

import torch
from torch import fx

from ._context import PassContext, PassResult, op_available

NAME = "overlap_cache_writes"
# wavelet_attention's argument positions of the K and V caches: (codes, scales, exact)
_CACHE_ARGS = ((1, 2, 5), (3, 4, 6))


def _targets() -> tuple:
    return (
        torch.ops.wmoe.kv_compress_into_cache.default,
        torch.ops.wmoe.kv_compress_into_cache_overlapped.default,
        torch.ops.wmoe.wavelet_attention.default,
    )


def run(ctx: PassContext) -> PassResult:
    result = PassResult(changed=False)
    if not ctx.config.overlap_cache_writes:
        result.notes.append("overlap_cache_writes=False: every cache write stays in order")
        return result
    if not op_available("kv_compress_into_cache_overlapped") or not op_available("wavelet_attention"):
        result.notes.append("ops not registered: nothing overlapped")
        return result
    write_op, overlapped_op, attention_op = _targets()
    graph = ctx.gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    attentions = [n for n in graph.nodes if n.op == "call_function" and n.target == attention_op]
    overlapped = 0
    for write in [n for n in graph.nodes if n.op == "call_function" and n.target == write_op]:
        reason = _reason_to_keep(write, attentions, order)
        if reason is not None:
            result.notes.append(f"{write.name} stays in order: {reason}")
            continue
        write.target = overlapped_op
        overlapped += 1
    if overlapped:
        graph.lint()
        ctx.gm.recompile()
        result.changed = True
    result.notes.append(f"{overlapped} cache writes overlapped with their attention")
    return result


def _reason_to_keep(write: fx.Node, attentions: list[fx.Node], order: dict) -> str | None:
    """None when `write` can run on the attention's side stream, else why not."""
    caches = tuple(write.args[1:4])  # codes, scales, exact
    codec = write.args[6]
    reader = None
    for attention in attentions:
        for codes, scales, exact in _CACHE_ARGS:
            if (attention.args[codes], attention.args[scales], attention.args[exact]) == caches:
                reader = attention
    if reader is None:
        return "no wavelet_attention reads these caches"
    if order[reader] < order[write]:
        return f"{reader.name} reads the caches before the write"
    if reader.args[10] != codec:
        return f"{reader.name} reads them with another codec"
    for cache in caches:
        if not isinstance(cache, fx.Node):
            return "a cache is not a graph value"
        for user in cache.users:
            if user not in (write, reader) and order[write] < order[user] < order[reader]:
                return f"{user.name} uses {cache.name} between the write and {reader.name}"
    return None
