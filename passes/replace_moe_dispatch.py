"""Rewrite pass: replace expert dispatch by one tiled streaming MoE op on packed weights.

Why: captured MoE layers compute experts as a dense masked loop (every expert on every token),
a sort/grouped_mm sequence, or gathered bmm's; at decode sizes all of them read far more weight
bytes, or launch far more kernels, than the tokens need. `wmoe::tiled_moe` groups tokens by expert
and streams only the routed experts' weights in 64x64 tiles.

find_sites identified each MoE site by dataflow (softmax router -> topk -> renormalise -> expert
region) and verified numerically that the region computes a top-k SwiGLU mixture with the weights
it found, in the layout it found. This pass packs those weights once, at compile time
(`wmoe_compile.pack_expert_weights`), attaches them to the module as buffers, and replaces the
region's output by

    tiled_moe(hidden, topk_ids, topk_weights, w_gate_up, w_down)

and, for experts with biases or a clamped SwiGLU (gpt-oss), with the packed biases and the
activation's constants that find_sites read off the region and verified:

    tiled_moe(hidden, topk_ids, topk_weights, w_gate_up, w_down, validate,
              b_gate_up, b_down, gate_alpha, clamp_limit, up_offset)

The router (softmax, topk, renormalisation) stays in the graph; the old expert region and, once
nothing else reads them, the original expert weights are removed by cleanup_graph.
"""

from __future__ import annotations

import torch

from . import _matching as m
from ._context import PassContext, PassResult, copy_meta, op_available, register_buffer, tag
from .find_sites import MoESite

NAME = "replace_moe_dispatch"
aten = torch.ops.aten


def run(ctx: PassContext) -> PassResult:
    result = PassResult(changed=False)
    for site in ctx.sites.moe:
        if site.report.status != "found":
            continue
        if not ctx.config.replace_moe:
            site.report.skip("replace_moe=False", NAME)
        elif not op_available("tiled_moe"):
            site.report.skip("op not registered (wmoe::tiled_moe)", NAME)
        else:
            note = _replace(ctx, site)
            site.report.rewritten(NAME, note)
            result.changed = True
        result.decided.append(site.report)
    return result


def _replace(ctx: PassContext, site: MoESite) -> str:
    from wmoe_compile.moe_packing import pack_expert_weights

    settings = ctx.config.moe
    hidden_dtype = m.dtype(site.hidden)
    weight_dtype = settings.dtype or hidden_dtype
    w_gate, w_up, w_down = site.expert_weights()
    b_gate, b_up, b_down = site.expert_biases() if site.expert_biases is not None else (None, None, None)
    packed = pack_expert_weights(
        w1=w_gate,
        w3=w_up,
        w2=w_down,
        b1=b_gate,
        b3=b_up,
        b2=b_down,
        layout=settings.layout,
        dtype=weight_dtype,
        device=w_gate.device,
    )
    owner = site.report.module_path if _has_submodule(ctx.gm, site.report.module_path) else ""
    prefix = f"{owner}.wmoe" if owner else f"wmoe_moe_layer{site.report.layer}"
    tensors = {"w_gate_up": packed.w_gate_up, "w_down": packed.w_down}
    biases = {"b_gate_up": packed.b_gate_up, "b_down": packed.b_down}
    tensors.update({key: value for key, value in biases.items() if value is not None})
    names = {key: register_buffer(ctx.gm, f"{prefix}_{key}", value) for key, value in tensors.items()}
    # Persistent: packed weights are model weights (saved with the program), not scratch state.
    for name in names.values():
        owner_path, _, leaf = name.rpartition(".")
        module = ctx.gm.get_submodule(owner_path) if owner_path else ctx.gm
        module._non_persistent_buffers_set.discard(leaf)

    graph = ctx.gm.graph
    output = site.output
    activation = site.activation
    with graph.inserting_before(output):
        attrs = {key: graph.get_attr(name) for key, name in names.items()}
        hidden = site.hidden
        if weight_dtype != hidden_dtype:
            hidden = graph.call_function(aten._to_copy.default, (hidden,), {"dtype": weight_dtype})
        weights = (attrs["w_gate_up"], attrs["w_down"])
        args = (hidden, site.topk_ids, site.topk_weights, *weights, settings.validate)
        if "b_gate_up" in attrs or "b_down" in attrs or not activation.is_swiglu:
            args += (
                attrs.get("b_gate_up"),
                attrs.get("b_down"),
                activation.gate_alpha,
                activation.clamp_limit,
                activation.up_offset,
            )
        moe = graph.call_function(torch.ops.wmoe.tiled_moe.default, args)
        new_nodes = [*attrs.values(), moe] + ([hidden] if hidden is not site.hidden else [])
        out_dtype = m.dtype(output)
        replacement = moe
        if out_dtype is not None and out_dtype != weight_dtype:
            replacement = graph.call_function(aten._to_copy.default, (moe,), {"dtype": out_dtype})
            new_nodes.append(replacement)
    for node in new_nodes:
        copy_meta(node, output)
        tag(node, site.report)
    output.replace_all_uses_with(replacement)
    site.output = replacement
    mib = sum(t.nbytes for t in tensors.values()) / 2**20
    extras = [f"biases {', '.join(k for k in biases if k in attrs)}"] if len(attrs) > 2 else []
    extras += [activation.describe()] if not activation.is_swiglu else []
    return (
        f"{packed.num_experts} experts top-{site.top_k}, hidden {packed.hidden_size}, ffn {packed.ffn_size}; "
        f"packed {packed.layout} {weight_dtype} ({mib:.2f} MiB)" + "".join(f"; {e}" for e in extras)
    )


def _has_submodule(gm: torch.nn.Module, path: str) -> bool:
    if not path:
        return False
    try:
        gm.get_submodule(path)
    except AttributeError:
        return False
    return True
