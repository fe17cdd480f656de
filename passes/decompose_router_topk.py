"""Rewrite pass: a router's top-k becomes k rounds of max and mask.

Why: `aten.topk` is an extern kernel for Inductor (on CUDA a sort-based select, two launches per
call), so a MoE router at decode runs softmax, topk and the renormalisation as separate kernels,
each a few microseconds of latency for a [tokens, experts] tensor of a few hundred elements. Written
as k rounds of `max` over the experts and a mask of the winner, the same selection is pointwise
and reduction ops that Inductor fuses with the softmax before it and the renormalisation after it.

A `topk` is rewritten when it selects the largest k along the last dimension, the experts and k
are static and small (at most MAX_EXPERTS and MAX_K), and only its values and indices are read.
Over softmax probabilities (every value in [0, 1]) a taken expert is marked -1, one op per round.
Over anything else (router logits, DeepSeek's biased and group-masked sigmoid scores, its group
scores) a taken expert is tracked by index, so -inf and NaN entries select exactly as `topk`
does: distinct indices, NaN first. The values come out in descending order; between equal values
the lower expert index wins, where `topk` leaves the order of ties (and with sorted=False, of
everything) unspecified. Anything else is left alone with the reason.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from . import _matching as m
from ._context import PassContext, PassResult, copy_meta

NAME = "decompose_router_topk"
aten = torch.ops.aten

MAX_EXPERTS = 512  # a [tokens, experts] row must stay one fused reduction
MAX_K = 16  # one max-and-mask round per selected expert
_TAKEN = -1.0  # below every probability: a taken expert never wins again


def run(ctx: PassContext) -> PassResult:
    result = PassResult(changed=False)
    if not ctx.config.decompose_topk:
        result.notes.append("decompose_topk=False: nothing rewritten")
        return result
    graph = ctx.gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if not m.is_op(node, aten.topk):
            continue
        reason = _reason_not_rewritten(node)
        if reason is not None:
            result.notes.append(f"left {node.name}: {reason}")
            continue
        note = f"{node.name}: top-{node.args[1]} of {m.shape(node.args[0])[-1]} as max-and-mask rounds"
        _rewrite(graph, node)
        result.notes.append(note)
        rewritten += 1
    if rewritten:
        ctx.gm.recompile()
        result.changed = True
    result.notes.insert(0, f"{rewritten} router top-k(s) rewritten")
    return result


def _last_dim(dim: object, rank: int) -> bool:
    return isinstance(dim, int) and dim in (-1, rank - 1)


def _reason_not_rewritten(node: fx.Node) -> str | None:
    source = node.args[0]
    shape = m.shape(source)
    if shape is None or not all(isinstance(s, int) for s in shape) or len(shape) < 1:
        return "input shape is not static"
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
    dim = m.arg(node, 2, "dim", -1)
    largest = m.arg(node, 3, "largest", True)
    if not isinstance(k, int):
        return "k is not a static int"
    if not _last_dim(dim, len(shape)):
        return f"selects along dim {dim}, not the last"
    if largest is not True:
        return "selects the smallest values"
    if not (1 <= k <= MAX_K and k <= shape[-1] <= MAX_EXPERTS):
        return f"top-{k} of {shape[-1]} is outside k <= {MAX_K}, experts <= {MAX_EXPERTS}"
    if not m.dtype(source) or not m.dtype(source).is_floating_point:
        return "input is not floating point"
    if any(not m.is_getitem(user) for user in node.users):
        return "something other than its values and indices reads it"
    return None


def _is_probabilities(source: fx.Node) -> bool:
    """A softmax over the last dimension: every value in [0, 1], so -1 lies below all of them."""
    rank = len(m.shape(source) or ())
    return m.is_op(source, aten.softmax, aten._softmax) and _last_dim(source.args[1], rank)


def _rewrite(graph: fx.Graph, node: fx.Node) -> None:
    source = node.args[0]
    k = node.args[1] if len(node.args) > 1 else node.kwargs["k"]
    experts = m.shape(source)[-1]
    device = m.val(source).device
    call = graph.call_function
    with graph.inserting_before(node):
        expert_index = call(aten.arange.start, (0, experts), {"dtype": torch.int64, "device": device})
        if _is_probabilities(source):
            values, indices = _rounds_marking_probabilities(call, source, expert_index, k)
        else:
            values, indices = _rounds_tracking_indices(call, source, expert_index, k)
        all_values = call(aten.cat.default, (values, -1))
        all_indices = call(aten.cat.default, (indices, -1))
    for new in (expert_index, all_values, all_indices):
        copy_meta(new, node)
    for user in list(node.users):
        user.replace_all_uses_with(all_values if user.args[1] == 0 else all_indices)
        graph.erase_node(user)
    graph.erase_node(node)  # only what this rewrite replaced: other dead code is cleanup's


def _rounds_marking_probabilities(call, source: fx.Node, expert_index: fx.Node, k: int):
    """Max, then the winner set to -1 (below every probability), k times: `max` returns the first
    index of the maximum, so ties take the lower expert."""
    remaining, values, indices = source, [], []
    for round_ in range(k):
        best = call(aten.max.dim, (remaining, -1, True))
        values.append(call(operator.getitem, (best, 0)))
        indices.append(call(operator.getitem, (best, 1)))
        if round_ < k - 1:
            taken = call(aten.eq.Tensor, (expert_index, indices[-1]))
            remaining = call(aten.masked_fill.Scalar, (remaining, taken, _TAKEN))
    return values, indices


def _rounds_tracking_indices(call, source: fx.Node, expert_index: fx.Node, k: int):
    """For any values: each round takes the maximum over the experts not yet taken (taken ones read
    as -inf), then the lowest untaken index holding it (NaN matching NaN, so NaN is taken first, as
    `topk` takes it), and its value from the input. Taken experts are a mask, never a value, so a
    row with -inf entries still yields k distinct experts."""
    taken, values, indices = None, [], []
    for _ in range(k):
        open_ = source if taken is None else call(aten.masked_fill.Scalar, (source, taken, float("-inf")))
        top = call(operator.getitem, (call(aten.max.dim, (open_, -1, True)), 0))
        equal = call(aten.eq.Tensor, (open_, top))
        both_nan = call(
            aten.bitwise_and.Tensor, (call(aten.isnan.default, (open_,)), call(aten.isnan.default, (top,)))
        )
        hit = call(aten.bitwise_or.Tensor, (equal, both_nan))
        if taken is not None:
            hit = call(aten.bitwise_and.Tensor, (hit, call(aten.bitwise_not.default, (taken,))))
        # first untaken position of the maximum: max over 0/1 returns the first 1
        index = call(
            operator.getitem,
            (call(aten.max.dim, (call(aten._to_copy.default, (hit,), {"dtype": torch.int8}), -1, True)), 1),
        )
        indices.append(index)
        values.append(call(aten.gather.default, (source, -1, index)))
        chosen = call(aten.eq.Tensor, (expert_index, index))
        taken = chosen if taken is None else call(aten.bitwise_or.Tensor, (taken, chosen))
    return values, indices
