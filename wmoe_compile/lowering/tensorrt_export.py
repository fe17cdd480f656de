"""TensorRT lowering through torch-tensorrt's plugin path. UNTESTED.

TensorRT's libraries come only from NVIDIA's package index, which none of the project's machines
can reach, so this path has never been run: it is kept small, follows torch-tensorrt's documented
Quick Deployable Plugin flow, and fails with a clear message when the packages are missing.

Flow:
  1. capture and rewrite the model (`wmoe_compile.export`), or take an ExportedProgram;
  2. make it functional: wmoe::kv_compress_into_cache becomes the functional companion op (a
     TensorRT plugin cannot write into its inputs) and the mutated cache buffers become extra
     inputs and outputs (TensorRT engines hold no state between calls);
  3. for every wmoe op in the graph, `generate_plugin(op)` builds a TensorRT plugin from the op's
     torch.library registration (shapes from its fake implementation, the op itself as the
     runtime implementation) and `generate_plugin_converter(op)` teaches torch-tensorrt to emit it;
  4. `torch_tensorrt.dynamo.compile` builds the engines; optionally `torch_tensorrt.save`.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

INSTALL_HINT = (
    "install the TensorRT extra from NVIDIA's package index: "
    "pip install 'wmoe-compile[tensorrt]' --extra-index-url https://pypi.nvidia.com "
    "(needs a CUDA GPU and a TensorRT >= 10.8 build matching your torch)"
)


class TensorRTUnavailableError(ImportError):
    """torch_tensorrt or tensorrt is not installed (the message says how to install them)."""


def _require_tensorrt() -> Any:
    missing = [name for name in ("tensorrt", "torch_tensorrt") if importlib.util.find_spec(name) is None]
    if missing:
        raise TensorRTUnavailableError(
            f"export_tensorrt needs the package(s) {', '.join(missing)}, which are not installed; "
            f"{INSTALL_HINT}"
        )
    try:
        import torch_tensorrt
        from torch_tensorrt.dynamo.conversion.plugins import generate_plugin, generate_plugin_converter
    except ImportError as exc:  # installed but broken or too old for the plugin API
        raise TensorRTUnavailableError(
            f"torch_tensorrt is installed but its plugin API could not be imported ({exc}); {INSTALL_HINT}"
        ) from exc
    return torch_tensorrt, generate_plugin, generate_plugin_converter


def _wmoe_ops_in(program: torch.export.ExportedProgram) -> list[str]:
    names = []
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            namespace = node.target.namespace
            if namespace in ("wmoe", "wmoe_onnx"):
                names.append(node.target.name().split(".")[0])
    return sorted(set(names))


def export_tensorrt(
    model_or_program: torch.nn.Module | torch.export.ExportedProgram,
    args: Sequence[Any],
    path: str | os.PathLike | None = None,
    *,
    config: Any = None,
    **compile_kwargs: Any,
) -> torch.fx.GraphModule:
    """Compile a rewritten model to TensorRT engines, the wmoe ops as TensorRT plugins. UNTESTED.

    model_or_program  an nn.Module (rewritten with `wmoe_compile.export(model, args, config=config)`)
                      or an ExportedProgram
    args              example inputs (CUDA tensors)
    path              if given, the compiled module is saved there with `torch_tensorrt.save`
    compile_kwargs    passed to `torch_tensorrt.dynamo.compile` (e.g. enabled_precisions)

    The returned module takes the user inputs followed by the cache state tensors (see
    `export_onnx`'s state="io") and returns the outputs followed by the updated state.
    Raises TensorRTUnavailableError (an ImportError) naming the missing package when TensorRT or
    torch-tensorrt is not installed.
    """
    torch_tensorrt, generate_plugin, generate_plugin_converter = _require_tensorrt()
    from .onnx_export import _functionalize_wmoe_mutations, _state_as_io, _to_program

    program = _to_program(model_or_program, args, None, config, None)
    program = program.run_decompositions({})
    _functionalize_wmoe_mutations(program)
    state: list[torch.Tensor] = []
    if program.graph_signature.buffers_to_mutate:
        state_io = _state_as_io(program, args, None)
        program, state = state_io.program.run_decompositions({}), state_io.example_state
        _functionalize_wmoe_mutations(program)
    for op_name in _wmoe_ops_in(program):
        generate_plugin(op_name)
        generate_plugin_converter(op_name, supports_dynamic_shapes=True)
    inputs = [*args, *state]
    options: dict[str, Any] = {"min_block_size": 1}
    options.update(compile_kwargs)
    compiled = torch_tensorrt.dynamo.compile(program, arg_inputs=inputs, **options)
    if path is not None:
        torch_tensorrt.save(compiled, os.fspath(path), arg_inputs=inputs)
    return compiled


def tensorrt_status() -> Mapping[str, bool]:
    """Which of the TensorRT packages are importable here."""
    return {name: importlib.util.find_spec(name) is not None for name in ("tensorrt", "torch_tensorrt")}
