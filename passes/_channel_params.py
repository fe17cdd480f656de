"""Channel parameters for each compressed K/V cache (used by insert_dwt_quantize).

Why: the default codec codes `R ((x - m) / s)` with an offset m, smoothing s and rotation R
calibrated per (layer, kv head) (docs/CONTRACTS.md). Without them the compiled graph would run a
different codec than the one measured. Per layer, in this order:

1. precomputed: `CompileConfig.channel_params` (by layer number or by dense cache name);
2. calibrated: the graph runs on the calibration inputs (default: the example inputs), the K/V
   write sites' tensors are recorded and `codec.calibrate_channel_params` fits them. Keys are
   stored after RoPE, so their statistics are averaged over the cache's positions when the RoPE
   frequencies are known: from `CompileConfig.rope_theta` (export fills it from the model
   config), else measured on the graph (see `measure_rope`);
3. fallback: the codec without its sample-calibrated parts, for both caches of the layer (K and
   V share one codec spec in wavelet_attention); the report, the pass notes and a warning say why.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import fx

from . import _matching as m

aten = torch.ops.aten

# Calibrating an offset and a D x D rotation from fewer vectors (past the sinks, per kv head)
# than this fits noise; such a call (e.g. a first decode step under torch.compile) falls back.
MIN_CALIBRATION_VECTORS = 8
# measure_rope accepts frequencies that reproduce the recorded RoPE output to this relative
# error (fp32 rounding is ~1e-6; bf16 models ~4e-3).
ROPE_FIT_TOLERANCE = 1e-2


@dataclass
class Resolved:
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)  # id(site) -> channel_scale
    configs: dict[int, object] = field(default_factory=dict)  # id(site) -> fallback codec config
    site_notes: dict[int, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def needs_calibration(config, kind: str) -> bool:
    """True if the codec config asks for channel parameters fitted on sample data."""
    offset = config.k_offset if kind == "k" else config.v_offset
    smoothing = config.k_smoothing if kind == "k" else config.v_smoothing
    return offset != "none" or config.rotation != "none" or smoothing not in ("none", "weights")


def fallback_config(config):
    """The codec config without its sample-calibrated parts (weights-based smoothing stays)."""
    return replace(
        config,
        k_offset="none",
        v_offset="none",
        rotation="none",
        k_smoothing="weights" if config.k_smoothing == "weights" else "none",
        v_smoothing="none",
    )


def resolve(ctx, candidates: list, site_configs: dict[int, object], samples: dict) -> Resolved:
    """Channel parameters for every candidate K/V write site (see the module docstring)."""
    from wmoe_compile.codec import channel_scale_from_weights

    out = Resolved()
    if ctx.config.bypass_codec:
        for kv in candidates:
            _, heads, _, head_dim = m.shape(kv.buffer)
            out.tensors[id(kv)] = torch.ones(heads, head_dim)
        return out
    given: dict[int, torch.Tensor] = {}
    for kv in candidates:
        tensor = ctx.config.layer_channel_params(kv.report.layer, kv.role.lower(), _dense_name(kv))
        if tensor is not None:
            _check_form(tensor, kv)
            given[id(kv)] = tensor.detach().float().cpu()
    wanted = [
        kv
        for kv in candidates
        if id(kv) not in given and needs_calibration(site_configs[id(kv)], kv.role.lower())
    ]
    recorded, record_note = _record_for_calibration(ctx, wanted, site_configs)
    failures: dict[int, str] = {}
    for kv in candidates:
        config = site_configs[id(kv)]
        if id(kv) in given:
            out.tensors[id(kv)] = given[id(kv)]
            out.site_notes[id(kv)] = "channel params given (CompileConfig.channel_params)"
        elif kv in wanted:
            tensor, note = _calibrate(ctx, kv, config, recorded, record_note)
            if tensor is None:
                failures[id(kv)] = note
            else:
                out.tensors[id(kv)], out.site_notes[id(kv)] = tensor, note
        else:
            out.tensors[id(kv)] = _scale_only(ctx, kv, config, channel_scale_from_weights)
            if config.k_smoothing == "weights" and kv.role == "K":
                out.site_notes[id(kv)] = "smoothing from projection weights"
    failed_layers = {kv.report.layer for kv in candidates if id(kv) in failures}
    for kv in candidates:
        if kv.report.layer not in failed_layers:
            continue
        config = fallback_config(site_configs[id(kv)])
        out.configs[id(kv)] = config
        out.tensors[id(kv)] = _scale_only(ctx, kv, config, channel_scale_from_weights)
        reason = failures.get(id(kv)) or "the layer's other cache could not be calibrated"
        out.site_notes[id(kv)] = (
            f"FALLBACK to the codec without offsets/rotation/calibrated smoothing: {reason}"
        )
    if failed_layers:
        message = (
            f"channel parameters missing for layer(s) {sorted(failed_layers)}: those layers run the codec "
            "without offsets / rotation / calibrated smoothing (worse quality than the measured codec); "
            "pass calibration_inputs= or CompileConfig(channel_params=...). First reason: "
            + next(iter(failures.values()))
        )
        out.notes.append(message)
        warnings.warn(f"wmoe insert_dwt_quantize: {message}", stacklevel=4)
    return out


def _dense_name(kv) -> str | None:
    return str(kv.buffer.target) if kv.buffer is not None and kv.buffer.op == "get_attr" else None


def _check_form(tensor: torch.Tensor, kv) -> None:
    """The forms the ops accept (docs/CONTRACTS.md) for this cache's [Hkv, D]."""
    _, heads, _, d = m.shape(kv.buffer)
    forms = {(d,), (1, d), (heads, d), (2, heads, d), (2, 1, d), (heads, d + 2, d)}
    if tensor.numel() and tuple(tensor.shape) not in forms:
        raise ValueError(
            f"channel_params for layer {kv.report.layer} {kv.role}: shape {list(tensor.shape)} is not one of "
            f"{sorted(forms)} (empty, scale, scale+offset, or rotation+scale+offset for Hkv={heads}, D={d})"
        )


def _record_for_calibration(ctx, wanted: list, site_configs: dict) -> tuple[dict, str]:
    """Run the graph once on the calibration inputs and record what calibration needs."""
    inputs = ctx.calibration_inputs or ctx.example_inputs
    if not wanted:
        return {}, ""
    if ctx.record is None or inputs is None:
        return {}, "no calibration inputs (give example inputs, calibration_inputs= or channel_params=)"
    queries = _queries_by_site(ctx)
    nodes: list[fx.Node] = []
    for kv in wanted:
        nodes.append(kv.value)
        if kv.index is not None:
            nodes.append(kv.index)
        config = site_configs[id(kv)]
        if kv.role == "K" and config.k_smoothing in ("qk", "q") and id(kv) in queries:
            nodes.append(queries[id(kv)])
        if kv.role == "K" and ctx.config.rope_theta is None:
            rope_input = find_rope_input(kv.value)
            if rope_input is not None:
                nodes.append(rope_input)
    source = "calibration_inputs" if ctx.calibration_inputs else "the example inputs"
    try:
        return ctx.record(nodes, inputs), source
    except Exception as exc:  # noqa: BLE001 - reported: the layers fall back, the report says why
        # e.g. calibration inputs of another shape than a graph specialised on the example inputs
        first_line = (str(exc).strip().splitlines() or [""])[0][:160]
        return {}, (
            f"the graph did not run on {source} ({type(exc).__name__}: {first_line}); calibration "
            "inputs must fit the captured graph (same shapes as the example inputs)"
        )


def _queries_by_site(ctx) -> dict[int, fx.Node]:
    return {id(site.k): site.q for site in ctx.sites.attention if site.k is not None and site.q is not None}


def _calibrate(ctx, kv, config, recorded: dict, source: str) -> tuple[torch.Tensor | None, str]:
    """(channel_scale, note), or (None, why not)."""
    from wmoe_compile.codec import RopeSpec, calibrate_channel_params, rope_theta_per_pair

    sample = recorded.get(kv.value.name)
    if sample is None:
        return None, source or "the K/V tensor was not recorded on the calibration inputs"
    if sample.dim() != 4:
        return None, f"recorded K/V has shape {list(sample.shape)}, expected [B, Hkv, T, D]"
    batch, heads, tokens, head_dim = sample.shape
    vectors = batch * max(0, tokens - config.sinks)
    if vectors < MIN_CALIBRATION_VECTORS:
        return None, (
            f"only {vectors} vectors per kv head past the {config.sinks} sinks in {source} "
            f"(need >= {MIN_CALIBRATION_VECTORS}): calibrate on a longer prompt"
        )
    kind = kv.role.lower()
    positions = _positions(recorded.get(kv.index.name) if kv.index is not None else None, tokens)
    rope, rope_note = None, ""
    if kind == "k":
        capacity = m.shape(kv.buffer)[2]
        theta, rope_note = None, "RoPE unknown: key statistics at the sample positions only"
        if ctx.config.rope_theta is not None:
            theta = rope_theta_per_pair(head_dim, ctx.config.rope_theta)
            rope_note = f"RoPE base {ctx.config.rope_theta:g}"
        else:
            rope_input = find_rope_input(kv.value)
            pre = recorded.get(rope_input.name) if rope_input is not None else None
            if pre is not None and positions is not None:
                theta, why = measure_rope(pre, sample, positions)
                rope_note = "RoPE frequencies measured on the graph" if theta is not None else f"RoPE {why}"
        if theta is not None and positions is not None:
            rope = RopeSpec(theta.cpu(), positions.cpu(), capacity)
            rope_note += f", statistics averaged over positions [0, {capacity})"
    queries = None
    if kind == "k" and config.k_smoothing in ("qk", "q"):
        q_node = _queries_by_site(ctx).get(id(kv))
        queries = recorded.get(q_node.name) if q_node is not None else None
    weight = None
    if kind == "k" and kv.projection is not None:
        weight_node = m.linear_weight(kv.projection)
        weight = m.get_attr_tensor(ctx.gm, weight_node) if weight_node is not None else None
    try:
        packed = calibrate_channel_params(
            config,
            kind,
            sample.float().cpu(),
            None if queries is None else queries.float().cpu(),
            None if weight is None else weight.float().cpu(),
            rope,
        )
    except ValueError as exc:
        return None, str(exc)
    if packed is None:
        return torch.ones(heads, head_dim), ""
    parts = [
        p
        for p, on in (("offset", _offset(config, kind) != "none"), ("rotation", config.rotation != "none"))
        if on
    ]
    note = f"channel params ({', '.join(parts) or 'smoothing'}) calibrated on {vectors} vectors from {source}"
    return compact(packed, config, kind), note + (f"; {rope_note}" if rope_note else "")


def _offset(config, kind: str) -> str:
    return config.k_offset if kind == "k" else config.v_offset


def compact(packed: torch.Tensor, config, kind: str) -> torch.Tensor:
    """The smallest `channel_scale` form holding what the config uses: s [Hkv, D]; s and m
    [2, Hkv, D]; or the full [Hkv, D + 2, D] when there is a rotation."""
    d = packed.shape[-1]
    if config.rotation != "none":
        return packed
    if _offset(config, kind) == "none":
        return packed[:, d].contiguous()
    return torch.stack([packed[:, d], packed[:, d + 1]]).contiguous()


def _scale_only(ctx, kv, config, from_weights) -> torch.Tensor:
    _, heads, _, head_dim = m.shape(kv.buffer)
    ones = torch.ones(heads, head_dim)
    if kv.role != "K" or config.k_smoothing != "weights" or kv.projection is None:
        return ones
    weight_node = m.linear_weight(kv.projection)
    weight = m.get_attr_tensor(ctx.gm, weight_node) if weight_node is not None else None
    if weight is None or weight.dim() != 2 or weight.shape[0] != heads * head_dim:
        return ones
    return from_weights(weight, heads, config.smoothing_alpha).float().cpu()


def _positions(index: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
    """Positions [T] of the recorded vectors (the cache write's index; one row if per batch)."""
    if index is None:
        return None
    if index.dim() == 2 and bool((index == index[:1]).all()):
        index = index[0]
    if index.dim() != 1 or index.numel() != tokens:
        return None
    return index.long()


# ----------------------------------------------------------------------------------------------
# RoPE frequencies from the graph


def find_rope_input(key: fx.Node) -> fx.Node | None:
    """The key before rotate-half RoPE, by dataflow: key = x * cos + rotate_half(x) * sin, i.e. an
    add of two products where an operand of one product feeds the other. None if no such shape."""
    node = m.strip_views(key)
    if not m.is_op(node, aten.add) or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    if not (m.is_op(a, aten.mul) and m.is_op(b, aten.mul)):
        return None
    for first, second in ((a, b), (b, a)):
        upstream = _ancestors(second, limit=12)
        for operand in first.args:
            if isinstance(operand, fx.Node) and operand in upstream and operand.op == "call_function":
                return operand
    return None


def _ancestors(node: fx.Node, limit: int) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier and len(seen) < limit:
        current = frontier.pop(0)
        for inp in m.input_nodes(current):
            if inp not in seen:
                seen.add(inp)
                frontier.append(inp)
    return seen


def measure_rope(
    pre: torch.Tensor, post: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor | None, str]:
    """Rotate-half RoPE frequencies [D/2] (radians per position) from a key before (`pre`) and
    after (`post`) RoPE, [B, H, T, D] at `positions` [T]: the angle between the two at position 1
    (unambiguous: default RoPE turns at most 1 rad per position), accepted only if rotating every
    recorded position by it reproduces `post` (so scaled or interleaved variants are refused)."""
    if pre.shape != post.shape or pre.dim() != 4 or pre.shape[-1] % 2:
        return None, f"not measured: shapes {list(pre.shape)} / {list(post.shape)}"
    # on the CPU, where calibration runs (recordings may be on a GPU, positions anywhere)
    pre, post, positions = pre.cpu(), post.cpu(), positions.cpu()
    at_one = (positions == 1).nonzero()
    if at_one.numel() == 0:
        return None, "not measured: the calibration inputs have no token at position 1"
    h = pre.shape[-1] // 2
    z_pre = torch.complex(pre[..., :h].double(), pre[..., h:].double())
    z_post = torch.complex(post[..., :h].double(), post[..., h:].double())
    t = int(at_one[0, 0])
    theta = torch.angle((z_post[:, :, t] * z_pre[:, :, t].conj()).sum(dim=(0, 1)))  # [h]
    predicted = z_pre * torch.exp(1j * theta * positions.double().view(-1, 1))
    error = float((predicted - z_post).abs().norm() / z_post.abs().norm().clamp_min(1e-30))
    if error > ROPE_FIT_TOLERANCE:
        return None, f"not recognised (rotate-half fit error {error:.2g})"
    return theta, ""
