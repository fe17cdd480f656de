"""Rewrite pass: attention reads the compressed cache through one fused op.

Why: after insert_dwt_quantize the graph decompresses the whole cache into a dense tensor before
every attention, which gives back the memory traffic compression saved. `wmoe::wavelet_attention`
reads codes, scales and the exact sinks/window directly and runs in the wavelet domain
(q . k = (W q) . (W k)), so the dense cache is never materialised.

For each attention site whose K and V caches were compressed, the pass

- derives `seq_lens` by dataflow: find_sites proved the mask is `arange(S) <= positions` with
  the positions written to the cache, so the valid length is `positions[-1] + 1` (positions are
  contiguous: the model writes a chunk of consecutive slots per step; HF StaticCache builds them
  as `arange(T) + cumulative_length`);
- replaces `scaled_dot_product_attention(q, k_cache, v_cache, mask, scale)` (or the eager
  matmul/softmax/matmul) by `wavelet_attention(q, k_codes, k_scales, v_codes, v_scales, k_exact,
  v_exact, seq_lens, k_channel_scale, v_channel_scale, codec, scale[, sinks, window])`; GQA (`enable_gqa` or
  HF's repeat_kv) is handled by the op (Hq a multiple of Hkv); gpt-oss's learned sink logits (the
  softmax over cat(scores, sinks), the sinks' column dropped) pass to the op as its `sinks`, and a
  sliding window shorter than the cache as its `window` where the codec's exact ring holds it
  (a longer one is skipped: the op would decompress the cache through its reference).

Sites with another mask, no compressed cache, or an unknown variant were skipped by find_sites
with the reason; here only the switches and op availability add reasons.
"""

from __future__ import annotations

import math

import torch

from . import _matching as m
from ._context import PassContext, PassResult, copy_meta, op_available, tag
from .find_sites import AttentionSite

NAME = "swap_wavelet_attention"
aten = torch.ops.aten


def run(ctx: PassContext) -> PassResult:
    result = PassResult(changed=False)
    for site in ctx.sites.attention:
        if site.report.status != "found":
            continue
        reason = _reason_to_skip(ctx, site)
        if reason:
            site.report.skip(reason, NAME)
        else:
            _swap(ctx, site)
            sinks = f"; learned sink logits {site.sinks.name}" if site.sinks is not None else ""
            window = f"; sliding window of {site.window} over the exact ring" if site.window else ""
            site.report.rewritten(
                NAME, f"seq_lens from {site.k.index.name}[-1] + 1; GQA x{_gqa(site)}{sinks}{window}"
            )
            result.changed = True
        result.decided.append(site.report)
    if result.changed:
        # Reading exact sinks/window instead of decompressing every position changes results by
        # at most the codec error the previous pass was checked against.
        prev = next((r for r in ctx.history if r.get("pass") == "insert_dwt_quantize"), None)
        result.expected_error = None if ctx.config.bypass_codec else (prev or {}).get("expected_error")
    return result


def _reason_to_skip(ctx: PassContext, site: AttentionSite) -> str | None:
    if not ctx.config.swap_attention:
        return "swap_attention=False"
    if site.blocker:
        return site.blocker
    for kv in (site.k, site.v):
        if kv is None or kv.compressed is None:
            why = (
                "compress_kv=False"
                if not ctx.config.compress_kv
                else (kv.report.reason if kv else "no cache")
            )
            return f"{kv.role if kv else ''} cache not compressed ({why})".strip()
    if site.k.compressed.spec != site.v.compressed.spec:
        return "K and V were compressed with different codecs; the op takes one codec"
    if not op_available("wavelet_attention"):
        return "op not registered (wmoe::wavelet_attention)"
    if site.window:
        from wmoe_compile.codec import WaveletKVConfig

        ring = WaveletKVConfig.from_spec(site.k.compressed.spec).window
        if site.window > ring:
            # the op would attend through its PyTorch reference (decompressing the whole cache)
            return (
                f"sliding-window mask: a window of {site.window} tokens, longer than the codec's exact "
                f"window of {ring} (the ring-window kernel reads the exact ring only); the cache is read "
                "back through wmoe::kv_decompress"
            )
    return None


def _gqa(site: AttentionSite) -> int:
    q_shape, k_shape = m.shape(site.q), m.shape(site.k.buffer)
    if q_shape and k_shape:
        return q_shape[1] // k_shape[1]
    return site.n_rep


def _swap(ctx: PassContext, site: AttentionSite) -> None:
    from wmoe_compile.codec import get_codec

    graph = ctx.gm.graph
    k, v = site.k.compressed, site.v.compressed
    batch = m.shape(site.k.buffer)[0]
    head_dim = m.shape(site.q)[-1]
    scale = site.scale if site.scale is not None else 1.0 / math.sqrt(head_dim)
    get_codec(k.spec, head_dim)  # real lookup tables in the ops' cache before any fake tracing
    index = site.k.index
    with graph.inserting_before(site.node):
        last = graph.call_function(aten.select.int, (index, 0, -1))
        length = graph.call_function(aten.add.Tensor, (last, 1))
        seq_lens = graph.call_function(aten.expand.default, (length, [batch]))
        seq_lens = graph.call_function(
            aten.clone.default, (seq_lens,), {"memory_format": torch.contiguous_format}
        )
        attention = graph.call_function(
            torch.ops.wmoe.wavelet_attention.default,
            (
                site.q,
                k.codes,
                k.scales,
                v.codes,
                v.scales,
                k.exact,
                v.exact,
                seq_lens,
                k.channel_scale,
                v.channel_scale,
                k.spec,
                float(scale),
                *([site.sinks] if site.sinks is not None or site.window else []),
                *([site.window] if site.window else []),
            ),
        )
    for node in (last, length, seq_lens.args[0], seq_lens, attention):
        copy_meta(node, site.node)
        tag(node, site.report)
    site.node.replace_all_uses_with(attention)
    graph.erase_node(site.node)
    site.node = attention
