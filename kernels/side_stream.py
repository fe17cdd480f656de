"""The second CUDA stream that decode attention overlaps work on, and the cache writes left on it.

Why: the attention op's split kernel keeps every SM busy for hundreds of microseconds at large
decode shapes, while small latency-bound kernels around it (the exact-token kernel, the KV cache
writes of the step) would each cost their whole duration on the main stream. On a second stream
they run beside the split kernel. The attention op forks that stream after its prologue and joins it
before its reduce (``overlap_exact``).

Deferred cache writes (``wmoe::kv_compress_into_cache_overlapped``) go one step further: the
write of the step's new K/V tokens is enqueued on the side stream when the write op runs, and the
attention op that reads those caches joins it. Only the exact-token kernel reads what such a write
produces in the same step (the new tokens sit in the exact window; the split kernel reads only
older, compressed positions), and it runs on the side stream after the write. ``defer`` records
which caches have a write in flight, keeping the write's tensors alive until ``forget`` (the
caching allocator must not hand their memory to the main stream while the side stream reads them);
an attention op that cannot order its readers after the write calls ``join`` first.
"""

from __future__ import annotations

import torch

STREAMS: dict[int, torch.cuda.Stream] = {}
# data_ptr of a cache with a write in flight on the side stream -> the tensors that write uses
_PENDING: dict[int, tuple[torch.Tensor, ...]] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The device's second stream (made on first use), or None while a CUDA graph is being
    captured and none exists yet (a stream cannot be created then; the work then runs in order
    on the current stream)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = STREAMS.get(index)
    if stream is None and not torch.cuda.is_current_stream_capturing():
        stream = STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def defer(caches: tuple[torch.Tensor, ...], keep: tuple[torch.Tensor, ...]) -> None:
    """Record that a write into ``caches`` is in flight on the side stream; ``keep`` (what the write
    reads and writes) stays referenced until the write is joined."""
    for cache in caches:
        _PENDING[cache.data_ptr()] = keep


def pending(cache: torch.Tensor) -> bool:
    """Whether a deferred write into ``cache`` has not been joined yet."""
    return cache.data_ptr() in _PENDING


def forget(caches: tuple[torch.Tensor, ...]) -> None:
    """The writes into ``caches`` are ordered before the current stream's next work: drop them."""
    for cache in caches:
        _PENDING.pop(cache.data_ptr(), None)


def join(device: torch.device, caches: tuple[torch.Tensor, ...]) -> None:
    """Order the current stream after the side stream (so after every deferred write into
    ``caches``) and forget those writes."""
    if device.type == "cuda":
        stream = STREAMS.get(device.index if device.index is not None else torch.cuda.current_device())
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
    forget(caches)
