"""Rewrite pass: store K and V compressed where they are written to the cache.

Why: the KV cache is what grows with context and batch; storing each head vector as wavelet
codes (about a fifth of the bytes) is the memory half of this project. At every static-cache
write found by find_sites (`cache.index_copy_(2, positions, k)`), this pass

- allocates the compressed cache as module buffers at compressed size: codes uint8
  [B, Hkv, S, n_code_bytes], scales fp16 [B, Hkv, S, n_bands], and the exact sinks + recent-window
  cache [B, Hkv, sinks + window, D] (docs/CONTRACTS.md), plus the cache's channel parameters
  (offset, smoothing, rotation; given, calibrated on sample inputs, or a reported fallback: see
  _channel_params.py) as the `channel_scale` buffer the ops receive;
- replaces the write by `wmoe::kv_compress_into_cache(k, codes, scales, exact, positions, s, codec)`;
- gives the readers of the dense cache `wmoe::kv_decompress(codes, scales, s, codec, dtype)`, so the
  graph stays runnable on its own; swap_wavelet_attention then replaces the attention and this
  decompression dies. With `bypass_codec` the readers get the exact cache itself (sinks=0,
  window=S puts position p at slot p), so the graph is exact.

The dense cache buffer loses its last reader and cleanup_graph deletes it.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import fx

from . import _channel_params
from . import _matching as m
from ._context import PassContext, PassResult, copy_meta, op_available, register_buffer, tag
from .find_sites import CompressedCache, KVWriteSite

NAME = "insert_dwt_quantize"
aten = torch.ops.aten


def run(ctx: PassContext) -> PassResult:
    from wmoe_compile.codec import WaveletKVCodec, allocate_compressed_cache, get_codec

    result = PassResult(changed=False)
    candidates = [kv for kv in ctx.sites.kv if kv.report.status == "found"]
    if not candidates:
        return result
    if not ctx.config.compress_kv:
        for kv in candidates:
            kv.report.skip("compress_kv=False", NAME)
            result.decided.append(kv.report)
        return result
    if not op_available("kv_compress_into_cache") or not op_available("kv_decompress"):
        for kv in candidates:
            kv.report.skip("op not registered (wmoe::kv_compress_into_cache / kv_decompress)", NAME)
            result.decided.append(kv.report)
        return result

    site_configs: dict[int, object] = {}
    usable = []
    for kv in candidates:
        _, _, capacity, head_dim = m.shape(kv.buffer)
        codec_config = ctx.config.codec
        if ctx.config.bypass_codec or codec_config.window >= capacity:
            # A window covering the whole cache reads every position exactly; sinks are then
            # redundant. Same semantics as the configured window, without exact slots the cache
            # can never fill (the exact cache would otherwise outgrow the dense one).
            codec_config = replace(codec_config, sinks=0, window=capacity)
        elif codec_config.sinks > capacity:
            codec_config = replace(codec_config, sinks=capacity)
        try:
            WaveletKVCodec(codec_config, head_dim)
        except ValueError as exc:
            kv.report.skip(f"codec does not fit head_dim={head_dim}: {exc}", NAME)
            result.decided.append(kv.report)
            continue
        site_configs[id(kv)] = codec_config
        usable.append(kv)
    candidates = usable
    # Samples for the codec's error measurement (example inputs) and for calibration.
    samples = (
        ctx.record([kv.value for kv in candidates]) if ctx.record is not None and ctx.example_inputs else {}
    )
    params = _channel_params.resolve(ctx, candidates, site_configs, samples)
    if params.notes:
        result.notes.extend(params.notes)
    measured = []
    for kv in candidates:
        batch, heads, capacity, head_dim = m.shape(kv.buffer)
        codec_config = params.configs.get(id(kv), site_configs[id(kv)])
        codec = WaveletKVCodec(codec_config, head_dim)
        # Build the ops' cached codec now, with real tensors: the ops' fake implementations look it
        # up, and a first lookup under fake-tensor tracing would cache fake lookup tables.
        get_codec(codec.spec, head_dim)
        sample = samples.get(kv.value.name)
        channel_scale, note = params.tensors[id(kv)], params.site_notes.get(id(kv), "")
        dense = m.get_attr_tensor(ctx.gm, kv.buffer) if kv.buffer.op == "get_attr" else None
        device = dense.device if dense is not None else m.val(kv.buffer).device
        dtype = m.dtype(kv.buffer)
        window_slots = codec_config.sinks + codec_config.window
        codes, scales = allocate_compressed_cache(
            batch, heads, capacity, codec.n_code_bytes, codec.n_bands, device
        )
        tensors = {
            "codes": codes,
            "scales": scales,
            "exact": torch.zeros(batch, heads, window_slots, head_dim, dtype=dtype, device=device),
            "channel_scale": channel_scale.to(device),
        }
        base = (
            str(kv.buffer.target)
            if kv.buffer.op == "get_attr"
            else f"wmoe_layer{kv.report.layer}_{kv.role.lower()}_cache"
        )
        names = {}
        for part, tensor in tensors.items():
            names[part] = register_buffer(ctx.gm, f"{base}_{part}", tensor)
            if part != "channel_scale":  # cache state, reset to empty by checks and calibration
                ctx.state_buffers.append(names[part])
        spec = codec.spec
        _rewrite_write(ctx.gm, kv, names, spec, dtype, passthrough=ctx.config.bypass_codec)
        if sample is not None and not ctx.config.bypass_codec:
            err = _roundtrip_error(sample, kv.compressed.channel_scale, ctx.gm, spec)
            measured.append(err)
            note = (note + "; " if note else "") + f"measured relative error {err:.3g} on the sample"
        dense_bytes = head_dim * torch.tensor([], dtype=dtype).element_size()
        summary = f"{codec.bytes_per_vector} B/vector vs {dense_bytes} B dense"
        if ctx.config.bypass_codec:
            summary += "; bypass_codec: exact cache holds every position"
        kv.report.rewritten(NAME, summary + (f"; {note}" if note else ""))
        kv.report.nodes["codec"] = spec
        if kv.buffer.op == "get_attr":  # lets the torch.compile backend share state per cache
            kv.report.nodes["dense_cache"] = str(kv.buffer.target)
        result.decided.append(kv.report)
        result.changed = True
    if measured:
        # The numeric check's bound: the codec's measured error, grown like a random walk over
        # the compressed layers (each layer's error is independent of the others').
        layers = len({kv.report.layer for kv in candidates if kv.compressed is not None})
        result.expected_error = ctx.config.codec_error_gain * max(measured) * math.sqrt(max(layers, 1))
        result.notes.append(
            f"codec relative K/V error on the sample: max {max(measured):.3g} over {len(measured)} caches"
        )
    elif result.changed and not ctx.config.bypass_codec:
        result.notes.append("no sample inputs: codec error not measured, numeric check not bounded")
        result.expected_error = float("inf")
    return result


def _rewrite_write(
    gm: fx.GraphModule,
    kv: KVWriteSite,
    names: dict[str, str],
    spec: str,
    dtype: torch.dtype,
    passthrough: bool,
) -> None:
    graph = gm.graph
    write = kv.write
    with graph.inserting_before(write):
        attrs = {part: tag(graph.get_attr(name), kv.report) for part, name in names.items()}
        compress = graph.call_function(
            torch.ops.wmoe.kv_compress_into_cache.default,
            (
                kv.value,
                attrs["codes"],
                attrs["scales"],
                attrs["exact"],
                kv.index,
                attrs["channel_scale"],
                spec,
            ),
        )
        copy_meta(compress, write)
        tag(compress, kv.report)
    with graph.inserting_after(compress):
        if passthrough:
            dense_view = attrs["exact"]
        else:
            dense_view = graph.call_function(
                torch.ops.wmoe.kv_decompress.default,
                (attrs["codes"], attrs["scales"], attrs["channel_scale"], spec, dtype),
            )
            copy_meta(dense_view, write)
            tag(dense_view, kv.report)
    # A functionalized graph writes the new cache back with copy_(buffer, index_copy(...)):
    # that write-back goes with the dense cache.
    for user in list(write.users):
        if m.is_op(user, aten.copy_) and user.args[1] is write and not user.users:
            graph.erase_node(user)
    write.replace_all_uses_with(dense_view)
    graph.erase_node(write)
    kv.compressed = CompressedCache(
        codes=attrs["codes"],
        scales=attrs["scales"],
        exact=attrs["exact"],
        channel_scale=attrs["channel_scale"],
        spec=spec,
        passthrough=passthrough,
    )
    kv.read = dense_view


def _roundtrip_error(
    sample: torch.Tensor, channel_scale_node: fx.Node, gm: fx.GraphModule, spec: str
) -> float:
    channel_scale = m.get_attr_tensor(gm, channel_scale_node).to(sample.device)
    codes, scales = torch.ops.wmoe.kv_compress(sample, channel_scale, spec)
    restored = torch.ops.wmoe.kv_decompress(codes, scales, channel_scale, spec, sample.dtype)
    num = (restored.double() - sample.double()).norm()
    return float(num / sample.double().norm().clamp_min(1e-30))
