"""Test environment: set before anything imports triton or transformers.

- TRITON_INTERPRET=1 on machines without a CUDA GPU, so Triton kernels run on the CPU.
- HF_HUB_OFFLINE=1: tests never download.
- Inductor's cache inside the build tree, not in /tmp of a shared machine.
- Tests marked `gpu` are skipped without CUDA; on a GPU run them with `pytest -m gpu`.
- The checkout's root off sys.path (see below).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# `python -m pytest` and xdist's workers put the current folder, the checkout's root, first on
# sys.path. There kernels/ and passes/ (installed as wmoe_compile.kernels and .passes through
# pyproject's package-dir) are top-level names too, and kernels/ shadows the `kernels` distribution
# that transformers (>= 5.25, a dependency of it) imports at `import transformers`: ImportError in
# every test that loads a model. The tests import the installed package, so the root goes.
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.curdir).resolve() != _ROOT]
if "kernels" in sys.modules and pathlib.Path(sys.modules["kernels"].__file__ or "").parent.parent == _ROOT:
    del sys.modules["kernels"]  # imported from the root before this ran (a plugin): forget it


def _has_cuda_gpu() -> bool:
    # Decide before importing torch: nvidia-smi present and listing a GPU, or CUDA_VISIBLE_DEVICES set.
    if os.environ.get("WMOE_FORCE_CPU") == "1":
        return False
    return shutil.which("nvidia-smi") is not None and os.path.exists("/dev/nvidia0")


HAS_GPU = _has_cuda_gpu()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / "build" / "inductor_cache"))

import pytest  # noqa: E402
import torch  # noqa: E402

# torch.library.opcheck imports this lazily; in one full CI run (not reproducible in isolation) the
# lazy import failed with ModuleNotFoundError late in the session, so import it up front.
import torch.testing._internal.optests  # noqa: E402, F401

# triton.jit picks the interpreter or the compiler when a kernel is defined, i.e. when its module is
# first imported. Tests that run the ops' PyTorch references set TRITON_INTERPRET=0 for themselves;
# had one of them imported a kernel module first, its kernels would stay compiled-mode for the rest
# of the session and every later interpreted launch would look for a GPU. Import them all now.
import wmoe_compile.kernels.kv_codec  # noqa: E402, F401
import wmoe_compile.kernels.moe_align  # noqa: E402, F401
import wmoe_compile.kernels.tiled_moe  # noqa: E402, F401
import wmoe_compile.kernels.wavelet_attention  # noqa: E402, F401
import wmoe_compile.kernels.wavelet_transform  # noqa: E402, F401


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs every run (never zeros); the seed is printed so a failure can be replayed.
    seed = (
        int.from_bytes(os.urandom(4), "little")
        if os.environ.get("WMOE_TEST_SEED") is None
        else int(os.environ["WMOE_TEST_SEED"])
    )
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.fixture(scope="session")
def tiny_reference_program():
    """The tiny reference model (2 layers, fp32, CPU) through `wmoe_compile.export` with the numeric
    check on and KV compression off: one export shared by the tests of the passes that rewrite its
    routers and projections (they only read the program and its report)."""
    import wmoe_compile as wc
    from wmoe_compile.models import build_model
    from wmoe_compile.pipeline import example_inputs_for

    torch.manual_seed(5)
    model = build_model("tiny", num_layers=2, max_seq_len=64, dtype=torch.float32, device="cpu")
    model.setup_cache(1, 64)
    args, _ = example_inputs_for(model, 1, 8)
    return wc.export(model, args, config=wc.CompileConfig(compress_kv=False, check_numerics=True))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep
        if rep.failed:
            for name, value in item.user_properties:
                if name == "seed":
                    rep.sections.append(("seed", f"replay with WMOE_TEST_SEED={value}"))
