"""Rewrite pass: linears that read the same input become one linear over their stacked weights.

Why: at decode, a projection GEMM has as many rows as sequences, so it is bound by reading its
weights and by launch latency, not by arithmetic. Attention's q, k and v projections read the
same hidden state: three GEMMs (each with its own split-K reduce on cuBLAS) read the same weight
bytes as one GEMM over the concatenated weight, which then needs one launch instead of three. The
same holds for a router and a shared expert's gate/up projections reading one input.

A group is fused when every member is a live `aten.linear` of the same input, its weight a 2-D
module tensor (get_attr) of one dtype and device with the same input width, and either none or all
of them have a module-tensor bias. The members' outputs become slices of the fused output
(`split_with_sizes` on the last dimension). Dead linears (e.g. an expert region that
replace_moe_dispatch has replaced) are never fused: they would keep their weights alive.

Memory: the fused weight is one concatenated tensor, and each member's tensor (under torch.compile
and export, the caller's own parameter) is re-pointed at its rows of it (`tensor.data = rows`;
values unchanged, so the eager model still computes the same). The weights are then held once,
not twice (for Mixtral-8x7B's q/k/v that second copy would be 1.6 GB). A graph
compiled later from the same module (prefill after decode) finds the rows already consecutive in
one storage and uses them as they are. An in-place update of a member (`load_state_dict`, an
optimizer step) therefore reaches the fused weight too. Where a tensor refuses to be re-pointed
(a tensor subclass may), the fused weight stays a copy and the pass says so.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from torch import fx

from . import _matching as m
from ._context import PassContext, PassResult, copy_meta, register_buffer

NAME = "fuse_sibling_linears"
aten = torch.ops.aten


def run(ctx: PassContext) -> PassResult:
    result = PassResult(changed=False)
    if not ctx.config.fuse_linears:
        result.notes.append("fuse_linears=False: nothing fused")
        return result
    graph = ctx.gm.graph
    live = _live_nodes(graph)
    groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node in live and m.is_op(node, aten.linear) and isinstance(node.args[0], fx.Node):
            groups[node.args[0]].append(node)
    fused = 0
    for source, members in groups.items():
        if len(members) < 2:
            continue
        reason = _reason_not_fused(ctx.gm, members)
        names = ", ".join(n.name for n in members)
        if reason is not None:
            result.notes.append(f"left {names} (input {source.name}) unfused: {reason}")
            continue
        shared = _fuse(ctx.gm, members, fused)
        held = "weights held once" if shared else "weights copied: the originals could not be re-pointed"
        result.notes.append(f"fused {names} (input {source.name}) into one linear ({held})")
        fused += 1
    if fused:
        ctx.gm.recompile()
        result.changed = True
    result.notes.insert(0, f"{fused} group(s) of sibling linears fused")
    return result


def _live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes an output or a side effect (cache writes, impure ops) depends on."""
    roots = [n for n in graph.nodes if n.op == "output" or n.is_impure()]
    live: set[fx.Node] = set()
    while roots:
        node = roots.pop()
        if node in live:
            continue
        live.add(node)
        roots.extend(node.all_input_nodes)
    return live


def _parts(gm: fx.GraphModule, node: fx.Node) -> tuple[torch.Tensor | None, torch.Tensor | None, bool]:
    """(weight, bias, has_bias) of a linear node; weight/bias None when not a module tensor."""
    weight_node = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    weight = m.get_attr_tensor(gm, weight_node) if isinstance(weight_node, fx.Node) else None
    if bias_node is None:
        return weight, None, False
    bias = m.get_attr_tensor(gm, bias_node) if isinstance(bias_node, fx.Node) else None
    return weight, bias, True


def _reason_not_fused(gm: fx.GraphModule, members: list[fx.Node]) -> str | None:
    parts = [_parts(gm, n) for n in members]
    for node, (weight, bias, has_bias) in zip(members, parts, strict=True):
        if weight is None:
            return f"{node.name}'s weight is not a module tensor"
        if weight.dim() != 2:
            return f"{node.name}'s weight is {weight.dim()}-D, not 2-D"
        if has_bias and (bias is None or bias.dim() != 1):
            return f"{node.name}'s bias is not a 1-D module tensor"
    first_weight = parts[0][0]
    for node, (weight, _, has_bias) in zip(members, parts, strict=True):
        if (weight.dtype, weight.device, weight.shape[1]) != (
            first_weight.dtype,
            first_weight.device,
            first_weight.shape[1],
        ):
            return f"{node.name}'s weight differs in dtype, device or input width"
        if has_bias != parts[0][2]:
            return "some have a bias and some do not"
    return None


def _fuse(gm: fx.GraphModule, members: list[fx.Node], index: int) -> bool:
    """Rewrite one group; True when the fused weight shares the members' storage."""
    graph = gm.graph
    parts = [_parts(gm, n) for n in members]
    sizes = [int(weight.shape[0]) for weight, _, _ in parts]
    weight, weight_shared = _stacked([p[0] for p in parts])
    weight_name = register_buffer(gm, f"wmoe_fused_linear_{index}_weight", weight)
    bias_name, bias_shared = None, True
    if parts[0][2]:
        bias, bias_shared = _stacked([p[1] for p in parts])
        bias_name = register_buffer(gm, f"wmoe_fused_linear_{index}_bias", bias)
    first = members[0]  # graph order: the input is defined before it, every user after it
    with graph.inserting_before(first):
        weight = graph.get_attr(weight_name)
        args = (first.args[0], weight)
        if bias_name is not None:
            args = (*args, graph.get_attr(bias_name))
        fused = graph.call_function(aten.linear.default, args)
        copy_meta(fused, first)
        pieces = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
        for i, node in enumerate(members):
            piece = graph.call_function(operator.getitem, (pieces, i))
            copy_meta(piece, node)
            node.replace_all_uses_with(piece)
    for node in members:
        graph.erase_node(node)
    return weight_shared and bias_shared


def _stacked(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The tensors concatenated along dim 0 and whether they now share its storage.

    When they already are consecutive rows of one contiguous storage (an earlier graph of the same
    module fused them), that storage is used as it is; otherwise the concatenation is a new tensor
    and each input is re-pointed at its rows, so the memory is not held twice."""
    first = tensors[0]
    rows = sum(int(t.shape[0]) for t in tensors)
    shape, stride = (rows, *first.shape[1:]), first.stride()
    offset = first.storage_offset()
    consecutive = True
    for t in tensors:
        same_storage = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (t.is_contiguous() and same_storage and t.storage_offset() == offset):
            consecutive = False
            break
        offset += t.numel()
    if consecutive:
        return first.detach().as_strided(shape, stride, first.storage_offset()), True
    stacked = torch.cat([t.detach() for t in tensors])
    start = 0
    try:
        for t in tensors:
            t.data = stacked[start : start + t.shape[0]]
            start += int(t.shape[0])
    except RuntimeError:  # a tensor that refuses: it keeps its own storage (values are equal)
        return stacked, False
    return stacked, True
