"""The torch.compile backend `wmoe`: ATen graph -> wmoe passes -> AOTAutograd + Inductor.

    compiled = torch.compile(model, backend="wmoe", options={"bypass_codec": True})
    model.generate(prompt, 64, step_fn=compiled)

The backend is registered through the `torch_dynamo_backends` entry point in pyproject.toml, so
after `pip install` torch finds it by name without anyone importing wmoe_compile first.

How one Dynamo graph is compiled:
  1. Freeze: the graph's parameter and buffer inputs (and tensors marked static, such as an HF
     StaticCache) become attributes of the graph module, as in `torch.export`'s module form, so
     the passes can read weights (to pack experts, to calibrate smoothing) and recognise the KV
     cache buffers. The per-call inputs (tokens, positions, masks) stay inputs.
  2. Capture that module with torch.export (ATen level, the IR the passes are written for), run
     `wmoe_compile.pipeline.transform` with the call's real inputs as sample inputs, and take the
     rewritten program's module: the compressed KV caches are now buffers of that module.
  3. Hand the module to Inductor's `compile_fx` (AOTAutograd: buffers become graph inputs and
     their in-place updates are kept in the graph, so the compressed cache is module state that
     persists across calls, never a per-call constant).

Graphs of one model share state: the prefill graph and the decode graph are separate
compilations, but they must write and read the same compressed cache. The compressed tensors are
kept per dense cache tensor (`_SHARED_STATE`), and a later graph whose passes rewrite the same
cache reuses them.

Channel parameters (the default codec's per-(layer, kv head) offsets and rotations): calibrated
on the real inputs of the first call that compiles a graph, which for a generate loop is the
prefill, i.e. the prompt (it needs at least a few tokens past the sinks: see
passes/_channel_params.py; otherwise the layer falls back to the codec without them and the
report and a warning say so). Later graphs (decode) are handed those parameters by dense cache
name and do not calibrate again. For parameters calibrated elsewhere, e.g. on held-out text as
the quality harness does, pass `options={"channel_params": {layer: {"k": .., "v": ..}}}`. Key
calibration is RoPE-aware when `rope_theta` is given or the RoPE frequencies can be measured on
the graph (the key at position 1 before and after RoPE).

Shapes: the passes allocate caches and pack weights for concrete shapes, so the backend
specialises on input shapes. A Dynamo graph with symbolic sizes (after a shape change Dynamo
marks a dimension dynamic) is compiled once per concrete shape seen, on first use.

Inference only: with gradients enabled on parameters that require them, the graph goes to
Inductor unchanged (the rewrites have no backward).
"""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

# Options the backend itself understands, beside the CompileConfig fields.
BACKEND_OPTIONS: dict[str, str] = {
    "dump_dir": "folder for per-pass graph dumps (one sub-folder per compiled graph); "
    "defaults to $WMOE_DUMP_DIR",
    "inductor_config": "dict of torch._inductor.config patches applied while compiling",
    "release_dense_cache": "free the storage of dense KV cache buffers the rewritten graph no longer "
    "reads, so the KV cache is held only at compressed size (the uncompiled model must not run "
    "afterwards)",
}

_REPORTS: list[Any] = []  # transform reports of this process, oldest first (bounded)
_MAX_REPORTS = 64
_GRAPH_COUNTER = iter(range(1 << 62))


def compile_reports() -> list[Any]:
    """Transform reports of the graphs the `wmoe` backend compiled in this process, oldest first."""
    return list(_REPORTS)


# ----------------------------------------------------------------------------------------------
# options


def _compile_config_type() -> type:
    from ..config import CompileConfig

    return CompileConfig


def valid_option_names() -> list[str]:
    """Every key `options=` accepts: the CompileConfig fields, `config`, and the backend's own."""
    fields = {f.name for f in dataclasses.fields(_compile_config_type())}
    return sorted(fields | set(BACKEND_OPTIONS) | {"config"})


def split_options(options: Mapping[str, Any] | None) -> tuple[Any, dict[str, Any]]:
    """Split torch.compile `options` into a CompileConfig and the backend's own settings.

    Keys are CompileConfig fields (e.g. `bypass_codec`, `codec`, `replace_moe`), `config` (a
    whole CompileConfig, which the other field keys then amend) and BACKEND_OPTIONS. Unknown keys
    raise a ValueError listing every valid one.
    """
    config_type = _compile_config_type()
    options = dict(options or {})
    field_names = {f.name for f in dataclasses.fields(config_type)}
    unknown = sorted(
        k for k in options if k not in field_names and k not in BACKEND_OPTIONS and k != "config"
    )
    if unknown:
        raise ValueError(
            f"torch.compile(backend='wmoe'): unknown option(s) {unknown}; "
            f"valid options: {valid_option_names()}"
        )
    base = options.pop("config", None)
    if base is not None and not isinstance(base, config_type):
        raise TypeError(f"options['config'] must be a CompileConfig, got {type(base).__name__}")
    settings = {k: options.pop(k) for k in list(options) if k in BACKEND_OPTIONS}
    config = config_type(**options) if base is None else dataclasses.replace(base, **options)
    inductor_config = settings.setdefault("inductor_config", {})
    if not isinstance(inductor_config, Mapping):
        raise TypeError(f"options['inductor_config'] must be a dict, got {type(inductor_config).__name__}")
    return config, settings


# ----------------------------------------------------------------------------------------------
# compressed state shared between the graphs of one model


class _SharedState:
    """Tensors the passes attached for one dense cache (codes, scales, exact, channel_scale),
    keyed by the dense cache tensor's identity; entries die with the dense tensor."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, dict[str, torch.Tensor]]] = {}

    def parts_for(self, dense: torch.Tensor) -> dict[str, torch.Tensor]:
        key = id(dense)
        entry = self._entries.get(key)
        if entry is None or entry[0]() is not dense:
            entry = (weakref.ref(dense, lambda _ref, key=key: self._entries.pop(key, None)), {})
            self._entries[key] = entry
        return entry[1]


_SHARED_STATE = _SharedState()


def compressed_state(dense_cache: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors that hold `dense_cache` (a model's K or V cache buffer) compressed in the
    graphs compiled so far: {"codes", "scales", "exact", "channel_scale"} (empty if none)."""
    entry = _SHARED_STATE._entries.get(id(dense_cache))
    if entry is None or entry[0]() is not dense_cache:
        return {}
    return dict(entry[1])


# Dense caches whose storage `release_dense_cache` freed: id -> (weakref, bytes it had).
_RELEASED: dict[int, tuple[weakref.ref, int]] = {}


def _release(dense: torch.Tensor) -> None:
    storage = dense.untyped_storage()
    key = id(dense)
    _RELEASED[key] = (weakref.ref(dense, lambda _ref, key=key: _RELEASED.pop(key, None)), storage.nbytes())
    storage.resize_(0)


def _restore_released(tensors: Sequence[Any]) -> list[torch.Tensor]:
    """Give released dense caches zeroed memory back while a new graph is captured (capture and
    the passes' sample runs read them); returns the ones restored, to release again after."""
    restored = []
    for t in tensors:
        entry = _RELEASED.get(id(t)) if isinstance(t, torch.Tensor) else None
        if entry is not None and entry[0]() is t:
            t.untyped_storage().resize_(entry[1])
            with torch.no_grad():
                t.zero_()
            restored.append(t)
    return restored


# ----------------------------------------------------------------------------------------------
# freezing parameter / buffer inputs into attributes


def _qualified_name(source_name: str | None, fallback: str) -> str:
    """L['self']._modules['layers']._modules['0']._buffers['k_cache'] -> layers.0.k_cache."""
    if not source_name:
        return fallback
    text = source_name
    text = re.sub(r"^L\['self'\]", "", text)
    text = re.sub(r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", text)
    text = re.sub(r"L\['([^']+)'\]", r"\1", text)
    text = re.sub(r"\[(\d+)\]", r".\1", text)
    text = re.sub(r"\['([^']+)'\]", r".\1", text)
    parts = [re.sub(r"\W", "_", p) for p in text.strip(".").split(".") if p]
    return ".".join(parts) if parts else fallback


def _mutated_inputs(gm: fx.GraphModule) -> set[str]:
    """Placeholders written in place by the Dynamo graph (a KV cache written with index_copy_)."""
    mutated = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not node.args:
            continue
        name = getattr(node.target, "__name__", str(node.target))
        first = node.args[0]
        if name.endswith("_") and not name.endswith("__") and isinstance(first, fx.Node):
            if first.op == "placeholder":
                mutated.add(first.name)
    return mutated


def _is_state(node: fx.Node, value: Any, mutated: set[str]) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    if isinstance(value, torch.nn.Parameter) or getattr(value, "_dynamo_static_input_type", None):
        return True  # parameters, module buffers, tensors marked static (HF StaticCache)
    return node.name in mutated


@dataclasses.dataclass
class _Frozen:
    module: fx.GraphModule  # takes only the per-call inputs
    user_indices: list[int]  # positions of the per-call inputs in Dynamo's argument list
    frozen: dict[str, tuple[int, torch.Tensor]]  # attribute name -> (argument position, tensor)


def _free_name(root: torch.nn.Module, qualified: str) -> bool:
    """True if `qualified` can be registered on `root` without clashing with anything there."""
    owner: Any = root
    *path, leaf = qualified.split(".")
    for part in path:
        if part in owner._parameters or part in owner._buffers:
            return False
        child = owner._modules.get(part)
        if child is None:
            return not hasattr(torch.nn.Module, part)
        owner = child
    return not hasattr(owner, leaf) and not hasattr(torch.nn.Module, leaf)


def _set_nested(root: torch.nn.Module, qualified: str, value: torch.Tensor) -> None:
    owner = root
    *path, leaf = qualified.split(".")
    for part in path:
        child = owner._modules.get(part)
        if child is None:
            child = torch.nn.Module()
            owner.add_module(part, child)
        owner = child
    if isinstance(value, torch.nn.Parameter):
        owner.register_parameter(leaf, value)
    else:
        owner.register_buffer(leaf, value, persistent=False)


def _freeze(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> _Frozen:
    """A copy of `gm` whose parameter/buffer/static inputs are attributes read with get_attr."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise RuntimeError(f"graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs")
    mutated = _mutated_inputs(gm)
    root = torch.nn.Module()
    graph = fx.Graph()
    value_map: dict[fx.Node, fx.Node] = {}
    frozen: dict[str, tuple[int, torch.Tensor]] = {}
    user_indices: list[int] = []
    state_names: dict[int, str] = {}
    for index, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
        if not _is_state(node, value, mutated):
            value_map[node] = graph.placeholder(node.name)
            value_map[node].meta = dict(node.meta)
            user_indices.append(index)
            continue
        grapharg = node.meta.get("grapharg")
        source = getattr(grapharg, "source", None)
        source_name = (
            source.name() if callable(getattr(source, "name", None)) else getattr(source, "name", None)
        )
        name = _qualified_name(source_name, f"wmoe_input_{index}")
        if not _free_name(root, name):
            name = f"wmoe_input_{index}"
        state_names[index] = name
        _set_nested(root, name, value)
        frozen[name] = (index, value)
    for index, name in state_names.items():
        attr = graph.get_attr(name)
        attr.meta = dict(placeholders[index].meta)
        value_map[placeholders[index]] = attr
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            _set_nested(root, str(node.target), _resolve(gm, str(node.target)))
        value_map[node] = graph.node_copy(node, lambda n: value_map[n])
    module = fx.GraphModule(root, graph)
    return _Frozen(module, user_indices, frozen)


def _resolve(module: torch.nn.Module, qualified: str) -> Any:
    obj: Any = module
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return obj


# ----------------------------------------------------------------------------------------------
# one static-shape graph


def _share_state(module: torch.nn.Module, frozen: Mapping[str, tuple[int, torch.Tensor]]) -> list[str]:
    """Point the module at the compressed tensors an earlier graph created for the same dense
    caches (or record these as the ones to share). Returns the dense caches that were replaced."""
    buffers = dict(module.named_buffers())
    replaced = []
    for dense_name, (_, dense) in frozen.items():
        if isinstance(dense, torch.nn.Parameter):
            continue
        # The passes name what replaces buffer `x` as `x_codes`, `x_scales`, `x_exact`, ...
        prefix = dense_name + "_"
        parts = {n[len(prefix) :]: t for n, t in buffers.items() if n.startswith(prefix) and n not in frozen}
        if not parts:
            continue
        replaced.append(dense_name)
        shared = _SHARED_STATE.parts_for(dense)
        for part, tensor in parts.items():
            existing = shared.get(part)
            same_kind = existing is not None and (
                existing.shape == tensor.shape
                and existing.dtype == tensor.dtype
                and existing.device == tensor.device
            )
            if same_kind:
                owner_path, _, leaf = (prefix + part).rpartition(".")
                owner = module.get_submodule(owner_path) if owner_path else module
                owner.register_buffer(leaf, existing, persistent=False)
            else:
                shared[part] = tensor
    return replaced


def _with_shared_channel_params(config: Any, frozen: Mapping[str, tuple[int, torch.Tensor]]) -> Any:
    """Channel parameters an earlier graph calibrated for the same dense caches (usually the
    prefill's, from the prompt), handed to the passes by cache name so a later graph (a decode
    step, whose single token cannot be calibrated on) uses them instead of calibrating again.
    Parameters the user gave in the config win."""
    shared = {}
    for name, (_, tensor) in frozen.items():
        if isinstance(tensor, torch.nn.Parameter):
            continue
        channel = compressed_state(tensor).get("channel_scale")
        if channel is not None:
            shared[name] = channel
    if not shared:
        return config
    return dataclasses.replace(config, channel_params={**shared, **(config.channel_params or {})})


def _rebind_frozen(module: torch.nn.Module, frozen: Mapping[str, tuple[int, torch.Tensor]]) -> None:
    """Make the rewritten module hold the model's own tensors (re-export may hand back copies,
    e.g. of 0-d buffers), so in-place updates reach the model's state."""
    attributes = dict(module.named_parameters(remove_duplicate=False))
    attributes.update(module.named_buffers(remove_duplicate=False))
    for name, (_, tensor) in frozen.items():
        current = attributes.get(name)
        if current is None or current is tensor:
            continue
        if current.shape != tensor.shape or current.dtype != tensor.dtype:
            raise RuntimeError(
                f"rewritten program changed {name!r} from {tuple(tensor.shape)} to {tuple(current.shape)}"
            )
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        if isinstance(tensor, torch.nn.Parameter):
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor, persistent=False)


def _attribute_names(module: torch.nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters(remove_duplicate=False)} | {
        n for n, _ in module.named_buffers(remove_duplicate=False)
    }


def _compile_static(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: Any,
    settings: Mapping[str, Any],
    config_patches: Mapping[str, Any],
) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    from ..pipeline import transform

    restored = _restore_released(example_inputs)
    frozen = _freeze(gm, example_inputs)
    user_inputs = tuple(example_inputs[i] for i in frozen.user_indices)
    graph_index = next(_GRAPH_COUNTER)
    dump_dir = settings.get("dump_dir") or os.environ.get("WMOE_DUMP_DIR") or None
    graph_dump_dir = os.path.join(dump_dir, f"graph_{graph_index:03d}") if dump_dir else None
    # Capture and the passes' sample runs must not change the model's state (cache contents,
    # HF's cumulative_length counters): snapshot it and put it back afterwards.
    state = [t for _, t in frozen.frozen.values() if not isinstance(t, torch.nn.Parameter)]
    config = _with_shared_channel_params(config, frozen.frozen)
    with torch.no_grad():
        snapshot = [t.clone() for t in state]
        captured = torch.export.export(frozen.module, user_inputs, strict=False)
        program, report = transform(captured, config, graph_dump_dir, example_inputs=(user_inputs, {}))
        for t, saved in zip(state, snapshot, strict=True):
            t.copy_(saved)
        del snapshot
    _REPORTS.append(report)
    del _REPORTS[:-_MAX_REPORTS]
    module = program.module()
    _rebind_frozen(module, frozen.frozen)
    replaced = _share_state(module, frozen.frozen)
    still_read = _attribute_names(module)
    # Dense caches nothing reads any more can give their memory back (the tensor object stays,
    # with empty storage); ones an earlier graph released stay released.
    to_release = {id(t): t for t in restored}
    if settings.get("release_dense_cache"):
        for name in replaced:
            if name not in still_read:
                to_release[id(frozen.frozen[name][1])] = frozen.frozen[name][1]
    # Inputs frozen into the compiled module must be the same tensors on every call.
    identity_checks = [(i, t, n) for n, (i, t) in frozen.frozen.items() if n in still_read]
    with torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = compile_fx(module, list(user_inputs), config_patches=dict(config_patches))
    for tensor in to_release.values():
        _release(tensor)
    user_indices = frozen.user_indices

    def run(*args: Any) -> Any:
        for index, tensor, name in identity_checks:
            if args[index] is not tensor:
                raise RuntimeError(
                    f"wmoe backend: {name!r} is a different tensor than at compile time (the compiled graph "
                    "holds parameters, buffers and static caches by reference); keep the same tensors "
                    "or call torch._dynamo.reset() and compile again"
                )
        return compiled(*[args[i] for i in user_indices])

    run.wmoe_report = report  # type: ignore[attr-defined]
    return run


# ----------------------------------------------------------------------------------------------
# dynamic graphs: one static compilation per concrete shape


def _is_symbolic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(not isinstance(d, int) for d in value.shape)
    return False


def _has_symbolic_inputs(gm: fx.GraphModule) -> bool:
    return any(
        _is_symbolic(n.meta.get("example_value", n.meta.get("val")))
        for n in gm.graph.nodes
        if n.op == "placeholder"
    )


def _shape_key(args: Sequence[Any]) -> tuple:
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((tuple(a.shape), tuple(a.stride()), a.dtype, a.device))
        elif isinstance(a, (int, float, bool)):
            key.append(a)
        else:
            key.append(type(a))
    return tuple(key)


def _specialize_per_shape(compile_one: Callable[[Sequence[Any]], Callable[..., Any]]) -> Callable[..., Any]:
    variants: dict[tuple, Callable[..., Any]] = {}

    def run(*args: Any) -> Any:
        key = _shape_key(args)
        fn = variants.get(key)
        if fn is None:
            fn = variants[key] = compile_one(list(args))
        return fn(*args)

    return run


# ----------------------------------------------------------------------------------------------
# the backend


def wmoe_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> Callable[..., Any]:
    """torch.compile backend: the wmoe rewrites, then AOTAutograd + Inductor.

    `options`: CompileConfig fields (e.g. `bypass_codec`, `codec`, `replace_moe`), or `config=` a
    whole CompileConfig, plus `dump_dir`, `inductor_config` and `release_dense_cache` (see
    BACKEND_OPTIONS). `mode` is Inductor's (`"max-autotune"`, `"reduce-overhead"`, ...).
    """
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    import wmoe_compile.ops  # noqa: F401  (registers the wmoe ops the rewritten graph calls)

    config, settings = split_options(options)
    config_patches: dict[str, Any] = {}
    if mode not in (None, "default"):
        config_patches.update(list_mode_options(mode))
    config_patches.update(settings["inductor_config"])
    training = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs
    )
    if training:
        # The rewrites are inference-only: compile the original graph, and say so.
        warnings.warn(
            "wmoe backend: gradients are enabled for parameters that require them, so this graph is "
            "compiled without the wmoe rewrites; run inference under torch.no_grad() or "
            "torch.inference_mode() to get them",
            stacklevel=2,
        )
        return compile_fx(gm, example_inputs, config_patches=config_patches)
    if _has_symbolic_inputs(gm):
        return _specialize_per_shape(lambda args: _compile_static(gm, args, config, settings, config_patches))
    return _compile_static(gm, list(example_inputs), config, settings, config_patches)
