"""Cleanup pass: drop what the rewrites left dead, including the tensors it kept alive.

Why: a rewrite replaces the *uses* of a region and leaves the region behind; the dense KV cache
buffers and the original expert weights stay attached to the module until nobody reads them.
Memory only goes down if they are deleted, so this pass

- removes `_assert_tensor_metadata` nodes that check tensors nothing else reads any more (they
  are side-effecting, so dead-code elimination keeps them and, through them, the dead region);
- removes unused inference dropouts (`aten.dropout(x, p, train=False)`, an identity): FX counts
  random ops as impure, so the dropout HF's eager attentions apply to their weights kept a
  swapped attention's whole dense path alive (in exported programs of eager-attention models,
  gpt-oss's among them, the key cache decompressed and the scores computed every step for nothing);
- eliminates dead code (in-place cache writes and custom ops with mutable arguments are kept:
  FX treats them as impure);
- deletes module parameters and buffers that were read before the pipeline ran and are not read
  now (the dense caches, the unpacked expert weights), and submodules left empty.
"""

from __future__ import annotations

import torch
from torch import fx

from ._context import PassContext, PassResult

NAME = "cleanup_graph"
_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}


def run(ctx: PassContext) -> PassResult:
    graph = ctx.gm.graph
    before = len(graph.nodes)
    while True:
        removed = _drop_orphan_asserts(graph)
        removed |= _drop_unused_eval_dropouts(graph)
        removed |= graph.eliminate_dead_code()
        if not removed:
            break
    read_now = {n.target for n in graph.nodes if n.op == "get_attr"}
    deleted = []
    for target in sorted(ctx.initial_attrs - read_now):
        if _delete_attr(ctx.gm, target):
            deleted.append(target)
    ctx.gm.delete_all_unused_submodules()
    ctx.gm.recompile()
    result = PassResult(changed=bool(deleted) or len(graph.nodes) != before)
    if deleted:
        result.notes.append(f"deleted {len(deleted)} unread tensors: " + ", ".join(deleted[:8]))
        if len(deleted) > 8:
            result.notes[-1] += f", ... ({len(deleted) - 8} more)"
    result.notes.append(f"removed {before - len(graph.nodes)} dead nodes")
    return result


def _drop_orphan_asserts(graph: fx.Graph) -> bool:
    removed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            checked = node.args[0] if node.args else None
            if isinstance(checked, fx.Node) and all(u.target in _ASSERTS for u in checked.users):
                graph.erase_node(node)
                removed = True
    return removed


def _drop_unused_eval_dropouts(graph: fx.Graph) -> bool:
    removed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten.dropout.default and not node.users:
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train")
            if train is False:  # an identity: nothing random happens, nothing reads it
                graph.erase_node(node)
                removed = True
    return removed


def _delete_attr(gm: fx.GraphModule, target: str) -> bool:
    owner_path, _, leaf = target.rpartition(".")
    try:
        owner = gm.get_submodule(owner_path) if owner_path else gm
    except AttributeError:
        return False
    if leaf in owner._parameters:
        del owner._parameters[leaf]
    elif leaf in owner._buffers:
        del owner._buffers[leaf]
        owner._non_persistent_buffers_set.discard(leaf)
    elif hasattr(owner, leaf) and isinstance(getattr(owner, leaf), torch.Tensor):
        delattr(owner, leaf)
    else:
        return False
    return True
