"""export_tensorrt: TensorRT cannot be installed on the project's machines, so what is tested is
that its absence is reported clearly (which package, how to install) before any work is done."""

import importlib.util

import pytest
import torch

from wmoe_compile.lowering import TensorRTUnavailableError, export_tensorrt, tensorrt_export
from wmoe_compile.models import build_model

HAVE_TENSORRT = all(importlib.util.find_spec(n) is not None for n in ("tensorrt", "torch_tensorrt"))


@pytest.mark.skipif(HAVE_TENSORRT, reason="TensorRT is installed here")
def test_missing_tensorrt_names_packages_and_install_command():
    model = build_model("tiny", num_layers=1)
    model.setup_cache(1, 8)
    args = (torch.randint(0, model.cfg.vocab_size, (1, 4)), torch.arange(4))
    with pytest.raises(TensorRTUnavailableError) as info:
        export_tensorrt(model, args)
    message = str(info.value)
    assert "torch_tensorrt" in message and "tensorrt" in message
    assert "pip install 'wmoe-compile[tensorrt]'" in message
    assert "pypi.nvidia.com" in message
    assert isinstance(info.value, ImportError)


def test_only_the_missing_package_is_named(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "tensorrt":
            return importlib.machinery.ModuleSpec("tensorrt", None)
        if name == "torch_tensorrt":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(tensorrt_export.importlib.util, "find_spec", find_spec)
    with pytest.raises(TensorRTUnavailableError, match=r"package\(s\) torch_tensorrt, which"):
        tensorrt_export._require_tensorrt()
    assert tensorrt_export.tensorrt_status() == {"tensorrt": True, "torch_tensorrt": False}


def test_docstring_says_untested():
    assert "UNTESTED" in export_tensorrt.__doc__
    assert "UNTESTED" in tensorrt_export.__doc__


def test_glue_before_tensorrt_with_a_stand_in(monkeypatch):
    # Everything export_tensorrt does before TensorRT itself, checked with a stand-in for
    # torch_tensorrt: the plugin ops it registers and the functional program it would compile.
    calls = {"plugins": [], "converters": []}

    class StandInDynamo:
        @staticmethod
        def compile(program, arg_inputs, **options):
            calls["program"], calls["inputs"], calls["options"] = program, arg_inputs, options
            return program.module()

    class StandInTorchTensorRT:
        dynamo = StandInDynamo

    def generate_plugin(name):
        calls["plugins"].append(name)

    def generate_plugin_converter(name, **kwargs):
        calls["converters"].append((name, kwargs))

    monkeypatch.setattr(
        tensorrt_export,
        "_require_tensorrt",
        lambda: (StandInTorchTensorRT, generate_plugin, generate_plugin_converter),
    )
    model = build_model("tiny", num_layers=1)
    model.setup_cache(1, 16)
    args = (torch.randint(0, model.cfg.vocab_size, (1, 5)), torch.arange(5))
    compiled = export_tensorrt(model, args)
    assert set(calls["plugins"]) >= {
        "wmoe::wavelet_attention",
        "wmoe::tiled_moe",
        "wmoe_onnx::kv_compress_into_cache_functional",
    }
    assert "wmoe::kv_compress_into_cache" not in calls["plugins"], "a plugin cannot write its inputs"
    assert [name for name, _ in calls["converters"]] == calls["plugins"]
    assert calls["options"]["min_block_size"] == 1
    program = calls["program"]
    assert not program.graph_signature.buffers_to_mutate, "engines hold no state: caches are inputs"
    outputs = compiled(*calls["inputs"])
    n_state = len(calls["inputs"]) - len(args)
    assert n_state > 0 and len(outputs) == 1 + n_state
    assert outputs[0].shape == (1, 5, model.cfg.vocab_size) and torch.isfinite(outputs[0]).all()
