"""ONNX export of a rewritten model: a portable flavour and a plugin flavour.

    export_onnx(model, "model.onnx", flavor="portable", args=(tokens, positions))

Both go through torch.onnx's dynamo exporter with a custom translation table for the wmoe ops.
Each wmoe op becomes one node in the `wmoe` ONNX domain whose attributes carry the codec spec
and the other static parameters (schemas registered with onnx.defs, see onnx_functions.py), plus
a model-local FunctionProto implementing it in standard ops.
  plugin    keeps those nodes: a runtime with wmoe plugins (TensorRT) implements them natively,
            onnxruntime runs the functions.
  portable  inlines the functions: standard ONNX ops only, checked with onnx.checker full_check.

State. ONNX graphs have no mutable buffers, and torch.onnx drops buffer mutations silently (the
KV cache write would be lost). With `state="io"` (the default when the program mutates buffers),
every mutated buffer becomes a graph input `past.<buffer>` and its new value a graph output
`present.<buffer>`, so a caller can run decode steps by feeding the outputs back. With
`state="frozen"` the buffers' current values become initializers and the updates are dropped (a
single-step graph).

Mutating ops. wmoe::kv_compress_into_cache writes into its caches; the exporter cannot translate
the auto-functionalized form, so it is replaced by the functional op
wmoe_onnx::kv_compress_into_cache_functional (returns the new caches) before translation.
"""

from __future__ import annotations

import dataclasses
import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import onnx
import onnx_ir as ir
import onnxscript
import onnxscript.optimizer
import torch

from . import onnx_functions
from .onnx_functions import WMOE_DOMAIN, WMOE_OPSET_VERSION

FLAVORS = ("portable", "plugin")
STATE_MODES = ("io", "frozen")


# ----------------------------------------------------------------------------------------------
# functional companion of the mutating op (export only)


@torch.library.custom_op("wmoe_onnx::kv_compress_into_cache_functional", mutates_args=())
def kv_compress_into_cache_functional(
    x: torch.Tensor,
    codes_cache: torch.Tensor,
    scales_cache: torch.Tensor,
    exact_cache: torch.Tensor,
    positions: torch.Tensor,
    channel_scale: torch.Tensor,
    codec: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """wmoe::kv_compress_into_cache on copies of the caches; returns the updated copies."""
    codes, scales, exact = codes_cache.clone(), scales_cache.clone(), exact_cache.clone()
    torch.ops.wmoe.kv_compress_into_cache(x, codes, scales, exact, positions, channel_scale, codec)
    return codes, scales, exact


@kv_compress_into_cache_functional.register_fake
def _(x, codes_cache, scales_cache, exact_cache, positions, channel_scale, codec):
    return torch.empty_like(codes_cache), torch.empty_like(scales_cache), torch.empty_like(exact_cache)


_MUTATING_TO_FUNCTIONAL: dict[str, tuple[Any, tuple[str, ...]]] = {
    # op name -> (functional op, mutated argument names in the functional op's output order)
    "wmoe::kv_compress_into_cache": (
        torch.ops.wmoe_onnx.kv_compress_into_cache_functional.default,
        ("codes_cache", "scales_cache", "exact_cache"),
    ),
    # the same write, which on a GPU may overlap the attention (a stream detail ONNX has no notion of)
    "wmoe::kv_compress_into_cache_overlapped": (
        torch.ops.wmoe_onnx.kv_compress_into_cache_functional.default,
        ("codes_cache", "scales_cache", "exact_cache"),
    ),
}


def _functionalize_wmoe_mutations(program: torch.export.ExportedProgram) -> int:
    """Replace auto_functionalized_v2(wmoe mutating op) by the functional companion op, in place."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    graph = program.graph_module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (auto_functionalized_v2, auto_functionalized):
            continue
        op = node.args[0]
        name = op.name() if hasattr(op, "name") else str(op)
        if name not in _MUTATING_TO_FUNCTIONAL:
            continue
        if node.target is auto_functionalized:
            raise NotImplementedError(
                f"{name}: auto_functionalized (v1) graphs are not supported; export with torch >= 2.6 "
                "where torch.export produces auto_functionalized_v2"
            )
        functional_op, mutated = _MUTATING_TO_FUNCTIONAL[name]
        kwargs = dict(node.kwargs)
        bases = kwargs.pop("_all_bases")
        new_kwargs: dict[str, Any] = {}
        base_output_for: dict[int, int] = {}
        for position, arg in enumerate(mutated):
            base_index = kwargs.pop(f"_{arg}_base_index")
            view_keys = [k for k in kwargs if k.startswith(f"_{arg}_")]
            if view_keys:
                raise NotImplementedError(
                    f"{name}: argument {arg} is a view of a buffer ({view_keys}); the cache must be a "
                    "whole buffer for ONNX export"
                )
            new_kwargs[arg] = bases[base_index]
            base_output_for[base_index] = position
        schema_args = [a.name for a in functional_op._schema.arguments]
        args = tuple(new_kwargs[a] if a in new_kwargs else kwargs[a] for a in schema_args)
        with graph.inserting_before(node):
            functional = graph.call_function(functional_op, args)
            functional.meta = dict(node.meta)
            fake_outputs = functional_op(
                *[a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
            )
            functional.meta["val"] = fake_outputs
        for user in list(node.users):
            if user.target is not operator.getitem:
                raise NotImplementedError(
                    f"unexpected use of the auto_functionalized node: {user.format_node()}"
                )
            index = user.args[1]
            if index == 0:  # the op's own (empty) result
                if user.users:
                    raise NotImplementedError(f"{name} returns nothing, but its result is used")
                graph.erase_node(user)
                continue
            user.args = (functional, base_output_for[index - 1])
        graph.erase_node(node)
        replaced += 1
    if replaced:
        graph.lint()
        program.graph_module.recompile()
    return replaced


# ----------------------------------------------------------------------------------------------
# state as inputs / outputs


class _StateAsIO(torch.nn.Module):
    """Runs `inner` with the given tensors as its mutated buffers and returns their new values."""

    def __init__(self, inner: torch.nn.Module, state_names: Sequence[str], n_args: int) -> None:
        super().__init__()
        self.inner = inner
        self.state_names = list(state_names)
        self.n_args = n_args

    def forward(self, *args_and_state: torch.Tensor) -> tuple[Any, ...]:
        args, state = args_and_state[: self.n_args], args_and_state[self.n_args :]
        # The unlifted program copies each buffer's new value into it (copy_); with functional_call
        # the buffer is our input tensor, so returning the inputs returns the updated cache.
        out = torch.func.functional_call(self.inner, dict(zip(self.state_names, state, strict=True)), args)
        outs = out if isinstance(out, tuple) else (out,)
        return (*outs, *state)


@dataclasses.dataclass
class _StateIO:
    program: torch.export.ExportedProgram  # takes (*args, *state), returns (*outputs, *new state)
    state_names: list[str]
    example_state: list[torch.Tensor]  # the buffers' current values (copies)
    n_user_outputs: int


def _state_as_io(
    program: torch.export.ExportedProgram, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> _StateIO:
    """Re-export `program` with its mutated buffers as trailing inputs and outputs."""
    state_names = list(dict.fromkeys(program.graph_signature.buffers_to_mutate.values()))
    if kwargs:
        raise ValueError("state='io' needs positional example args only (no kwargs)")
    inner = program.module()
    buffers = dict(inner.named_buffers())
    example_state = [buffers[name].detach().clone() for name in state_names]
    n_user_outputs = len(program.graph_signature.user_outputs)
    wrapper = _StateAsIO(inner, state_names, len(args))
    reexported = torch.export.export(wrapper, (*args, *example_state), strict=False)
    return _StateIO(reexported, state_names, example_state, n_user_outputs)


# ----------------------------------------------------------------------------------------------
# translation table (torch op -> wmoe-domain ONNX node)


def _wmoe_opset():
    import onnxscript

    onnx_functions.register_schemas()
    return onnxscript.values.Opset(WMOE_DOMAIN, WMOE_OPSET_VERSION)


def _static_dim(value: Any, axis: int, what: str) -> int:
    shape = getattr(value, "shape", None)
    dim = None if shape is None else shape[axis]
    if not isinstance(dim, int):
        raise ValueError(f"{what}: dimension {axis} must be static for ONNX export, got {dim!r}")
    return dim


def _channel_params(channel_scale: Any, head_dim: int) -> tuple[Any, str]:
    """(value, form) of an op's channel parameters, following kernels.kv_codec.channel_params:
    empty -> ones (dividing by 1.0 is exact), [D] / [1|Hkv, D] -> "s", [2, 1|Hkv, D] -> "sm",
    [1|Hkv, D + 2, D] -> "rsm"."""
    import numpy as np
    from onnxscript import opset18 as op

    shape = getattr(channel_scale, "shape", None)
    dims = [d for d in shape] if shape is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        raise ValueError(f"channel parameters need a static shape for ONNX export, got {dims}")
    if 0 in dims:
        ones = onnx.numpy_helper.from_array(np.ones((1, head_dim), np.float32))
        return op.Constant(value=ones), "s"
    if len(dims) == 3 and dims[1] == head_dim + 2 and dims[2] == head_dim:
        return channel_scale, "rsm"
    if len(dims) == 3 and dims[0] == 2 and dims[2] == head_dim:
        return channel_scale, "sm"
    if (len(dims) in (1, 2) or (len(dims) == 3 and dims[0] == 1)) and dims[-1] == head_dim:
        return channel_scale, "s"
    raise ValueError(
        f"channel parameters of shape {dims} are none of the forms [Hkv, D], [2, Hkv, D], "
        f"[Hkv, D + 2, D] (D = {head_dim}), or empty"
    )


def _head_dim_for(codec: str, n_code_bytes: int) -> int:
    """The head dimension whose packed width under `codec` is n_code_bytes (width grows with D)."""
    from ..codec import get_codec

    for head_dim in range(4, 4097, 4):
        try:
            width = get_codec(codec, head_dim).n_code_bytes
        except ValueError:
            continue
        if width == n_code_bytes:
            return head_dim
        if width > n_code_bytes:
            break
    raise ValueError(f"no head_dim gives {n_code_bytes} code bytes under codec {codec!r}")


def _canonical(codec: str) -> str:
    """Nodes carry the canonical spec (every field), not a preset name: a plugin needs no table."""
    from ..codec import WaveletKVConfig

    return WaveletKVConfig.from_spec(codec).to_spec()


def _translate_kv_compress(x, channel_scale, codec: str):
    head_dim = _static_dim(x, -1, "kv_compress x")
    wmoe = _wmoe_opset()
    params, form = _channel_params(channel_scale, head_dim)
    return wmoe.KvCompress(x, params, codec=_canonical(codec), head_dim=head_dim, channel_params=form)


def _translate_kv_decompress(codes, scales, channel_scale, codec: str, dtype: int):
    head_dim = _head_dim_for(codec, _static_dim(codes, -1, "kv_decompress codes"))
    wmoe = _wmoe_opset()
    params, form = _channel_params(channel_scale, head_dim)
    out = wmoe.KvDecompress(
        codes,
        scales,
        params,
        codec=_canonical(codec),
        head_dim=head_dim,
        channel_params=form,
        dtype=int(dtype),
    )
    # The output type is fixed by an attribute, which type inference of a custom op cannot see.
    out.dtype = ir.DataType(int(dtype))
    return out


def _translate_kv_compress_into_cache(
    x, codes_cache, scales_cache, exact_cache, positions, channel_scale, codec: str
):
    head_dim = _static_dim(x, -1, "kv_compress_into_cache x")
    wmoe = _wmoe_opset()
    params, form = _channel_params(channel_scale, head_dim)
    return wmoe.KvCompressIntoCache(
        x,
        codes_cache,
        scales_cache,
        exact_cache,
        positions,
        params,
        codec=_canonical(codec),
        head_dim=head_dim,
        channel_params=form,
    )


def _translate_wavelet_attention(
    q,
    k_codes,
    k_scales,
    v_codes,
    v_scales,
    k_exact,
    v_exact,
    seq_lens,
    k_cs,
    v_cs,
    codec: str,
    sm_scale: float,
    sinks=None,
    window: int = 0,
):
    head_dim = _static_dim(q, -1, "wavelet_attention q")
    wmoe = _wmoe_opset()
    k_params, k_form = _channel_params(k_cs, head_dim)
    v_params, v_form = _channel_params(v_cs, head_dim)
    function = wmoe.WaveletAttention if sinks is None else wmoe.WaveletAttentionSinks
    return function(
        q,
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        k_exact,
        v_exact,
        seq_lens,
        k_params,
        v_params,
        *([] if sinks is None else [sinks]),
        codec=_canonical(codec),
        head_dim=head_dim,
        k_channel_params=k_form,
        v_channel_params=v_form,
        sm_scale=float(sm_scale),
        window=int(window),
    )


def _translate_tiled_moe(
    hidden,
    topk_ids,
    topk_weights,
    w_gate_up,
    w_down,
    validate: bool = False,
    b_gate_up=None,
    b_down=None,
    gate_alpha: float = 1.0,
    clamp_limit: float | None = None,
    up_offset: float = 0.0,
):
    # Validation reads ids on the host in PyTorch; in ONNX out-of-range ids contribute nothing.
    del validate
    if len(w_gate_up.shape) == 6:
        layout, experts = "tiles64", w_gate_up.shape[0]
        ffn_pad, hidden_pad = w_gate_up.shape[1] * 64, w_gate_up.shape[2] * 64
    else:
        layout, experts = "rows", w_gate_up.shape[0]
        ffn_pad, hidden_pad = w_gate_up.shape[1] // 2, w_gate_up.shape[2]
    wmoe = _wmoe_opset()
    dims = {
        "layout": layout,
        "num_experts": int(experts),
        "ffn_pad": int(ffn_pad),
        "hidden_pad": int(hidden_pad),
    }
    plain = b_gate_up is None and b_down is None and (gate_alpha, clamp_limit, up_offset) == (1.0, None, 0.0)
    if plain:
        return wmoe.TiledMoe(hidden, topk_ids, topk_weights, w_gate_up, w_down, **dims)
    import numpy as np
    from onnxscript import opset18 as op

    def zeros(*shape: int):  # a bias the experts do not have adds nothing
        return op.Constant(value=onnx.numpy_helper.from_array(np.zeros(shape, np.float32)))

    return wmoe.TiledMoeBiased(
        hidden,
        topk_ids,
        topk_weights,
        w_gate_up,
        w_down,
        b_gate_up if b_gate_up is not None else zeros(int(experts), 2, int(ffn_pad)),
        b_down if b_down is not None else zeros(int(experts), int(hidden_pad)),
        **dims,
        gate_alpha=float(gate_alpha),
        clamped=int(clamp_limit is not None),
        clamp_limit=float(clamp_limit if clamp_limit is not None else 0.0),
        up_offset=float(up_offset),
    )


def translation_table() -> dict[Any, Any]:
    """torch op overload -> ONNX translation, for every wmoe op registered in this process."""
    import wmoe_compile.ops  # noqa: F401  (registers the wmoe ops)

    table: dict[Any, Any] = {
        torch.ops.wmoe_onnx.kv_compress_into_cache_functional.default: _translate_kv_compress_into_cache,
    }
    candidates = {
        "kv_compress": _translate_kv_compress,
        "kv_decompress": _translate_kv_decompress,
        "wavelet_attention": _translate_wavelet_attention,
        "tiled_moe": _translate_tiled_moe,
    }
    for name, translate in candidates.items():
        if hasattr(torch.ops.wmoe, name):
            table[getattr(torch.ops.wmoe, name).default] = translate
    return table


# ----------------------------------------------------------------------------------------------
# the driver


def _to_program(
    model_or_program: torch.nn.Module | torch.export.ExportedProgram,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None,
    config: Any,
    dynamic_shapes: Any,
) -> torch.export.ExportedProgram:
    if isinstance(model_or_program, torch.export.ExportedProgram):
        return model_or_program
    if not isinstance(model_or_program, torch.nn.Module):
        raise TypeError(
            "export_onnx takes an nn.Module or a torch.export.ExportedProgram, "
            f"got {type(model_or_program).__name__}"
        )
    if not args and not kwargs:
        raise ValueError("export_onnx(model, ...) needs example inputs: pass args=(...) (and/or kwargs=)")
    from ..pipeline import export as wmoe_export

    if dynamic_shapes is not None:
        raise ValueError("dynamic_shapes: pass an ExportedProgram exported with dynamic shapes instead")
    return wmoe_export(model_or_program, tuple(args), kwargs, config=config)


def _rename_io(
    model: onnx.ModelProto,
    user_input_names: Sequence[str] | None,
    state_names: Sequence[str],
    n_user_outputs: int,
) -> None:
    """past.<buffer> / present.<buffer> for the state; optional names for user inputs."""
    renames: dict[str, str] = {}
    inputs = list(model.graph.input)
    n_user_inputs = len(inputs) - len(state_names)
    if user_input_names is not None:
        if len(user_input_names) != n_user_inputs:
            raise ValueError(f"input_names has {len(user_input_names)} names for {n_user_inputs} user inputs")
        renames.update({v.name: n for v, n in zip(inputs[:n_user_inputs], user_input_names, strict=True)})
    for value, name in zip(inputs[n_user_inputs:], state_names, strict=True):
        renames[value.name] = f"past.{name}"
    outputs = list(model.graph.output)
    for value, name in zip(outputs[n_user_outputs:], state_names, strict=True):
        renames[value.name] = f"present.{name}"
    if not renames:
        return

    def rename(name: str) -> str:
        return renames.get(name, name)

    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        value.name = rename(value.name)
    for node in model.graph.node:
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
    # An output that is also an input (a state the graph left unchanged) needs its own node.
    input_names = {v.name for v in model.graph.input}
    for value in model.graph.output:
        if value.name in input_names:
            new_name = f"present.{value.name.removeprefix('past.')}"
            model.graph.node.append(onnx.helper.make_node("Identity", [value.name], [new_name]))
            value.name = new_name


def export_onnx(
    model_or_program: torch.nn.Module | torch.export.ExportedProgram,
    path: str | os.PathLike | None,
    flavor: str = "portable",
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    config: Any = None,
    state: str | None = None,
    input_names: Sequence[str] | None = None,
    opset_version: int | None = None,
    dynamic_shapes: Any = None,
    check: bool = True,
) -> onnx.ModelProto:
    """Export a model (rewritten by the wmoe passes) or an ExportedProgram to ONNX.

    model_or_program  an nn.Module (captured and rewritten with `wmoe_compile.export(model, args,
                      kwargs, config)`) or an ExportedProgram used as given
    path              where to write the .onnx file (None: only return the model)
    flavor            "portable" (standard ONNX ops only) or "plugin" (wmoe-domain nodes plus
                      model-local functions)
    args / kwargs     example inputs (for an ExportedProgram: defaults to its example inputs)
    state             "io" (mutated buffers as past.* inputs and present.* outputs; the default
                      when there are any) or "frozen" (current values as initializers, updates
                      dropped)
    input_names       names for the user inputs (default: the forward's argument names)
    check             run onnx.checker (full_check) on the result

    Returns the ONNX ModelProto.
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    if state is not None and state not in STATE_MODES:
        raise ValueError(f"state must be one of {STATE_MODES} (or None for automatic), got {state!r}")
    program = _to_program(model_or_program, args, kwargs, config, dynamic_shapes)
    if not args and not kwargs and program.example_inputs is not None:
        args, kwargs = program.example_inputs
    # Functional IR without decomposing anything: buffer mutations become explicit outputs.
    program = program.run_decompositions({})
    _functionalize_wmoe_mutations(program)
    mutated = program.graph_signature.buffers_to_mutate
    if input_names is None:
        input_names = [
            spec.arg.name
            for spec in program.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT
        ]
    state = state or ("io" if mutated else "frozen")
    state_names: list[str] = []
    n_user_outputs = len(program.graph_signature.user_outputs)
    if state == "io" and mutated:
        state_io = _state_as_io(program, args, kwargs)
        program, state_names, n_user_outputs = state_io.program, state_io.state_names, state_io.n_user_outputs
        program = program.run_decompositions({})
        _functionalize_wmoe_mutations(program)

    onnx_functions.register_schemas()
    export_kwargs: dict[str, Any] = {
        "dynamo": True,
        "optimize": False,
        "custom_translation_table": translation_table(),
    }
    if opset_version is not None:
        export_kwargs["opset_version"] = opset_version
    onnx_program = torch.onnx.export(
        program, tuple(args), kwargs=dict(kwargs or {}), verbose=False, **export_kwargs
    )
    model_ir = onnx_program.model
    onnx_functions.attach_functions(model_ir)
    proto = ir.to_proto(model_ir)
    has_wmoe = any(n.domain == WMOE_DOMAIN for n in proto.graph.node)
    if flavor == "portable":
        if has_wmoe:
            proto = onnx_functions.inline_functions(proto)
        # Standard ops only now: fold the constants the inlined bodies introduced (constant
        # folding only: the full optimizer's pattern rewriter is quadratic in graph size).
        folded = ir.from_proto(proto)
        onnxscript.optimizer.fold_constants(folded, onnx_shape_inference=False)
        onnxscript.optimizer.remove_unused_nodes(folded)
        proto = ir.to_proto(folded)
    elif not has_wmoe:
        # Still import the domain so consumers see which flavour this is.
        proto.opset_import.append(onnx.helper.make_opsetid(WMOE_DOMAIN, WMOE_OPSET_VERSION))
    _rename_io(proto, input_names, state_names, n_user_outputs)
    onnx.helper.set_model_props(
        proto, {"wmoe.flavor": flavor, "wmoe.state": state, "wmoe.state_names": ",".join(state_names)}
    )
    if check:
        onnx.checker.check_model(proto, full_check=True)
    if path is not None:
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        large = proto.ByteSize() > 1_800_000_000  # protobuf's 2 GB limit: weights go beside it
        onnx.save_model(proto, path, save_as_external_data=large, location=os.path.basename(path) + ".data")
    return proto
