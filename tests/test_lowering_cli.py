"""`wmoe-compile export --format pt2 | onnx | onnx-plugin | tensorrt`."""

import numpy as np
import onnx
import pytest
import torch

import wmoe_compile  # noqa: F401  (registers the wmoe ops before torch.export.load)
from wmoe_compile.cli import main
from wmoe_compile.lowering.onnx_functions import WMOE_DOMAIN


def test_export_pt2_loads_and_runs(tmp_path, capsys):
    out = tmp_path / "tiny.pt2"
    code = main(["export", "--model", "tiny", "--layers", "1", "--format", "pt2", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "rewritten" in printed and str(out) in printed
    program = torch.export.load(str(out))
    tokens = torch.randint(0, 256, (1, 8))
    logits = program.module()(tokens, torch.arange(8))
    assert logits.shape == (1, 8, 256) and torch.isfinite(logits).all()
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert any("wmoe.kv_compress_into_cache" in t for t in targets)
    assert any("wmoe.wavelet_attention" in t for t in targets)


def test_export_onnx_plugin_runs_in_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    out = tmp_path / "tiny_plugin.onnx"
    args = ["export", "--layers", "1", "--format", "onnx-plugin", "--out", str(out), "--prompt-len", "5"]
    assert main(args) == 0
    model = onnx.load(str(out))
    assert any(n.domain == WMOE_DOMAIN for n in model.graph.node)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    feeds = {}
    for value in session.get_inputs():
        if value.name == "tokens":
            feeds[value.name] = np.random.randint(0, 256, size=value.shape).astype(np.int64)
        elif value.name == "positions":
            feeds[value.name] = np.arange(value.shape[0], dtype=np.int64)
        else:  # an empty cache
            dtype = {"tensor(uint8)": np.uint8, "tensor(float16)": np.float16}.get(value.type, np.float32)
            feeds[value.name] = np.zeros(value.shape, dtype=dtype)
    logits = session.run(None, feeds)[0]
    assert logits.shape == (1, 5, 256) and np.isfinite(logits).all()


def test_export_tensorrt_without_tensorrt_fails_clearly(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("torch_tensorrt") is not None:
        pytest.skip("torch_tensorrt is installed here")
    code = main(["export", "--layers", "1", "--format", "tensorrt", "--out", str(tmp_path / "t.ep")])
    assert code == 2
    assert "torch_tensorrt" in capsys.readouterr().err


def test_export_rejects_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["export", "--format", "tflite", "--out", str(tmp_path / "x")])
    code = main(["export", "--format", "pt2", "--prompt-len", "0", "--out", str(tmp_path / "x.pt2")])
    assert code == 2 and "--prompt-len" in capsys.readouterr().err
