"""Dataflow helpers shared by the passes: op matching, walking through views, module labels.

Sites are found by following tensors through the graph, never by parameter or module names;
`nn_module_stack` only labels reports. Everything here reads an ATen-level FX graph (from
`torch.export`, `ExportedProgram.module()`, or AOTAutograd) and changes nothing.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable

import torch
from torch import fx

aten = torch.ops.aten

# Ops that only reinterpret or copy a tensor without changing its values (per element, up to layout).
VIEW_OPS = {
    aten.view,
    aten.reshape,
    aten._unsafe_view,
    aten.transpose,
    aten.permute,
    aten.unsqueeze,
    aten.squeeze,
    aten.expand,
    aten.contiguous,
    aten.clone,
    aten.alias,
    aten.detach,
    aten.t,
}
# Ops that may change dtype but not values in the fp32 models the tests use; followed only where
# a dtype cast is harmless for what is being matched.
CAST_OPS = {aten.to, aten._to_copy, aten.type_as}
LINEAR_OPS = {aten.linear, aten.mm, aten.addmm, aten.matmul, aten.bmm}
ARANGE_OPS = {aten.arange}


def packet(node: fx.Node):
    """The OpOverloadPacket of a call_function node (aten.view for aten.view.default), or None."""
    if node.op != "call_function":
        return None
    target = node.target
    return getattr(target, "overloadpacket", target)


def is_op(node: object, *packets) -> bool:
    """True if `node` is a call_function to any overload of the given op packets."""
    return isinstance(node, fx.Node) and packet(node) in packets


def is_getitem(node: object, index: int | None = None) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return False
    return index is None or node.args[1] == index


def val(node: object):
    """The FakeTensor (or other value) recorded on a node by tracing, or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: object) -> tuple[int, ...] | None:
    v = val(node)
    if isinstance(v, torch.Tensor):
        try:
            return tuple(int(s) for s in v.shape)
        except (TypeError, ValueError):  # symbolic sizes
            return None
    return None


def dtype(node: object) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def input_nodes(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def arg(node: fx.Node, index: int, name: str, default=None):
    """Positional-or-keyword argument of a call_function node."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def is_same_dtype_cast(node: fx.Node) -> bool:
    if not is_op(node, *CAST_OPS):
        return False
    src = node.args[0]
    return isinstance(src, fx.Node) and dtype(src) is not None and dtype(src) == dtype(node)


def strip_views(node: fx.Node, *, through_casts: bool = True) -> fx.Node:
    """Follow view/copy ops (and same-dtype casts) back to the tensor they reinterpret."""
    while isinstance(node, fx.Node):
        if is_op(node, *VIEW_OPS) or (through_casts and is_same_dtype_cast(node)):
            src = node.args[0]
            if not isinstance(src, fx.Node):
                break
            node = src
            continue
        break
    return node


def strip_repeat_kv(node: fx.Node) -> tuple[fx.Node, int]:
    """Undo HF `repeat_kv` (unsqueeze(2) -> expand -> reshape) or repeat_interleave on dim 1.

    Returns (source [B, Hkv, S, D], n_rep); n_rep is 1 when no repetition is found.
    """
    reshape = node
    if is_op(reshape, aten.reshape, aten.view, aten._unsafe_view):
        expand = reshape.args[0]
        if is_op(expand, aten.expand) and is_op(expand.args[0], aten.unsqueeze):
            unsq = expand.args[0]
            src = unsq.args[0]
            src_shape, exp_shape = shape(src), shape(expand)
            if (
                unsq.args[1] in (2, -3)
                and src_shape is not None
                and exp_shape is not None
                and len(src_shape) == 4
                and len(exp_shape) == 5
            ):
                return src, exp_shape[2]
    if is_op(node, aten.repeat_interleave) and len(node.args) >= 2 and isinstance(node.args[1], int):
        dim = arg(node, 2, "dim")
        if dim in (1, -3):
            return node.args[0], node.args[1]
    return node, 1


def module_path(node: fx.Node) -> str:
    """The innermost module that produced `node` (from nn_module_stack), '' when unknown."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return _clean_path(path)


def common_module_path(nodes: Iterable[fx.Node]) -> str:
    """The deepest module path shared by all nodes (e.g. the MoE block around router and experts)."""
    paths = [module_path(n).split(".") for n in nodes if module_path(n)]
    if not paths:
        return ""
    common: list[str] = []
    for parts in zip(*paths, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _clean_path(path: str) -> str:
    # Dynamo-style stacks spell paths like "L['self'].layers[0].attn" or "L__self___layers_0".
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.|$)")


def layer_of(path: str) -> int | None:
    match = _LAYER_RE.search(path)
    return int(match.group(1)) if match else None


def get_attr_tensor(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor | None:
    """The tensor a get_attr node reads from the module, or None."""
    if node.op != "get_attr":
        return None
    obj = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def backward_find(
    start: fx.Node, stop: Callable[[fx.Node], bool], *, limit: int = 400
) -> tuple[list[fx.Node], bool]:
    """Breadth-first walk over inputs from `start`; returns the nodes where `stop` holds.

    The walk does not continue past stopping nodes, placeholders or get_attr nodes. The second
    result is False when the walk hit `limit` nodes (the answer may then be incomplete).
    """
    found: list[fx.Node] = []
    seen = {start}
    frontier = [start]
    while frontier:
        node = frontier.pop(0)
        for inp in input_nodes(node):
            if inp in seen:
                continue
            seen.add(inp)
            if len(seen) > limit:
                return found, False
            if stop(inp):
                found.append(inp)
            elif inp.op == "call_function":
                frontier.append(inp)
    return found, True


def linear_weight(node: fx.Node) -> fx.Node | None:
    """The weight operand of a projection node (linear, or the mm/addmm a linear decomposes to)."""
    if is_op(node, aten.linear):
        return strip_views(node.args[1])
    if is_op(node, aten.mm):
        return strip_views(node.args[1])
    if is_op(node, aten.addmm):
        return strip_views(node.args[2])
    if is_op(node, aten.matmul):
        return strip_views(node.args[1])
    return None


def linear_input(node: fx.Node) -> fx.Node | None:
    if is_op(node, aten.linear, aten.mm, aten.matmul):
        return node.args[0]
    if is_op(node, aten.addmm):
        return node.args[1]
    return None


def is_param_like(node: object) -> bool:
    """A module parameter/buffer (get_attr) or a lifted one (placeholder named like p_/b_/c_)."""
    if not isinstance(node, fx.Node):
        return False
    return node.op == "get_attr" or (
        node.op == "placeholder" and str(node.target).startswith(("p_", "b_", "c_"))
    )


def find_projection(value: fx.Node) -> tuple[fx.Node | None, str]:
    """Walk back from a K/V (or Q) tensor through views, norms and RoPE to its linear projection.

    Returns (projection node, '') or (None, reason).
    """

    def is_projection(node: fx.Node) -> bool:
        return is_op(node, *LINEAR_OPS) and is_param_like(linear_weight(node))

    if is_projection(value):
        return value, ""
    found, complete = backward_find(value, lambda n: is_op(n, *LINEAR_OPS))
    projections = [n for n in found if is_projection(n)]
    if len(projections) == 1 and len(found) == 1:
        return projections[0], ""
    if not complete:
        return None, "walk back to the projection did not end within 400 nodes"
    if not found:
        return None, "no linear projection upstream of the cached tensor"
    names = ", ".join(n.name for n in found)
    return None, f"several matmuls upstream of the cached tensor ({names}); expected one K/V projection"


def int_scalar(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return None


def is_arange_from_zero(node: fx.Node, length: int) -> bool:
    """arange(length) (start 0, step 1), possibly followed by `+ 0`."""
    node = strip_views(node)
    if is_op(node, aten.add) and node.args[1] == 0 and isinstance(node.args[0], fx.Node):
        node = strip_views(node.args[0])
    if not is_op(node, aten.arange):
        return False
    ints = [a for a in node.args if not isinstance(a, fx.Node)]
    if node.target == aten.arange.default:
        return ints[:1] == [length]
    if node.target in (aten.arange.start, aten.arange.start_step):
        step = ints[2] if len(ints) > 2 else 1
        return ints[:2] == [0, length] and step == 1
    return False


def structurally_equal(a: object, b: object, *, depth: int = 12) -> bool:
    """True if two values are provably the same tensor: the same node, or the same op applied to
    structurally equal arguments (e.g. two `arange(T) + start` computed separately).

    Same-dtype casts are looked through (they alias their input). An argument that is mutated in
    place between its creation and its use by the compared node breaks the equality (HF's static
    cache adds the step length to `cumulative_length` in place right after reading it).
    """
    graph = a.graph if isinstance(a, fx.Node) else b.graph if isinstance(b, fx.Node) else None
    order = {n: i for i, n in enumerate(graph.nodes)} if graph is not None else {}
    if isinstance(a, fx.Node) and isinstance(b, fx.Node) and (mutated_after(a) or mutated_after(b)):
        return False
    return _structurally_equal(a, b, depth, order)


def _structurally_equal(a: object, b: object, depth: int, order: dict[fx.Node, int]) -> bool:
    if isinstance(a, fx.Node):
        a = _through_casts(a)
    if isinstance(b, fx.Node):
        b = _through_casts(b)
    if a is b:
        return True
    if isinstance(a, fx.Node) and isinstance(b, fx.Node):
        if depth == 0 or a.op != "call_function" or b.op != "call_function" or a.target != b.target:
            return False
        if _is_mutating(a):  # an in-place op's result depends on state, not only on its args
            return False
        for parent in (a, b):
            for child in parent.all_input_nodes:
                if _mutated_between(_through_casts(child), parent, order):
                    return False
        return _structurally_equal(a.args, b.args, depth - 1, order) and _structurally_equal(
            a.kwargs, b.kwargs, depth - 1, order
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(
            _structurally_equal(x, y, depth, order) for x, y in zip(a, b, strict=True)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_structurally_equal(a[k], b[k], depth, order) for k in a)
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return False
    return type(a) is type(b) and a == b


def strip_casts(node: object) -> object:
    """Follow dtype casts of any kind back to their source (not views: a view changes what the
    last dimension means)."""
    while is_op(node, *CAST_OPS):
        node = node.args[0]
    return node


def _through_casts(node: fx.Node) -> fx.Node:
    while is_same_dtype_cast(node) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


# ops whose result shares its input's storage: the reshaping views, and those that view a part
_ALIASING_OPS = (VIEW_OPS - {aten.clone, aten.contiguous}) | {
    aten.slice,
    aten.select,
    aten.narrow,
    aten.diagonal,
    aten.as_strided,
}


def _aliases(node: fx.Node) -> set[fx.Node]:
    """`node` and the views / same-dtype casts of it (they share its storage)."""
    group, stack = {node}, [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            if user not in group and user.args and user.args[0] is current:
                if is_op(user, *_ALIASING_OPS) or is_same_dtype_cast(user):
                    group.add(user)
                    stack.append(user)
    return group


def mutations(node: fx.Node) -> list[fx.Node]:
    """In-place ops that write `node`'s storage (through any alias), e.g. the copy_ calls that fill
    slices of a new_empty: what `node` holds depends on their inputs too."""
    return _mutations(node)


def _mutations(node: fx.Node) -> list[fx.Node]:
    """In-place ops that write `node`'s storage (through any alias)."""
    found = []
    for alias in _aliases(node):
        for user in alias.users:
            if _is_mutating(user) and user.args and user.args[0] is alias:
                found.append(user)
    return found


def _mutated_between(node: fx.Node, reader: fx.Node, order: dict[fx.Node, int]) -> bool:
    mutations = _mutations(node)
    if not mutations:
        return False
    start, end = order[node], order[reader]
    return any(start < order[m] < end for m in mutations)


def mutated_after(node: fx.Node) -> bool:
    """True if `node`'s value is overwritten in place anywhere after it is computed."""
    return bool(_mutations(node))


def _is_mutating(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def describe(node: fx.Node) -> str:
    """Short human label: `name = op(...)`."""
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return f"{node.name} ({name})"
    return f"{node.name} ({node.op} {node.target})"
