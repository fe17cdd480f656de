"""Lowering the rewritten graph: the torch.compile backend `wmoe`, ONNX export, TensorRT.

compile_backend   torch.compile(model, backend="wmoe", options={...}) (entry point, no import needed)
onnx_export       export_onnx(model_or_program, path, flavor="portable" | "plugin")
tensorrt_export   export_tensorrt(...): UNTESTED (TensorRT is not installable on our machines)
export_cli        `wmoe-compile export`
cuda_graphs       GraphedDecodeStep: replay each decode step from one CUDA graph (serving)
"""

from __future__ import annotations

from typing import Any

from .cuda_graphs import GraphedDecodeStep
from .tensorrt_export import TensorRTUnavailableError, export_tensorrt


def export_onnx(model_or_program: Any, path: Any, flavor: str = "portable", **kwargs: Any) -> Any:
    """Export a rewritten model or ExportedProgram to ONNX; see `onnx_export.export_onnx`.

    (Imported on first use: onnx and onnxscript add a second to `import wmoe_compile`.)
    """
    from .onnx_export import export_onnx as _export_onnx

    return _export_onnx(model_or_program, path, flavor, **kwargs)


__all__ = ["export_onnx", "export_tensorrt", "GraphedDecodeStep", "TensorRTUnavailableError"]
