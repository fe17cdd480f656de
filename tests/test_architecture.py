"""The layering the package keeps (docs/CONTRACTS.md): passes rewrite graphs and never import
kernels (they insert ops by name, so a pass runs where no kernel can); kernels compute and never
import FX or the passes (they run inside the ops the passes insert, and under torch.export).
Checked from the source's import statements, so a violation fails here, not in a later refactor."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in `path`, relative ones written with their dots."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found.append((node.lineno, module))
            if node.module is None:  # from . import x: x may itself be a module
                found += [(node.lineno, "." * node.level + alias.name) for alias in node.names]
    return found


def _files(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).glob("*.py"))


def test_the_layers_have_files():
    assert len(_files("passes")) > 5 and len(_files("kernels")) > 5


@pytest.mark.parametrize("path", _files("passes"), ids=lambda p: p.name)
def test_passes_never_import_kernels(path):
    bad = [(line, module) for line, module in imported_modules(path) if "kernels" in module.split(".")]
    assert not bad, f"{path.name} imports kernels at {bad}: passes insert ops by name"


@pytest.mark.parametrize("path", _files("kernels"), ids=lambda p: p.name)
def test_kernels_never_import_fx_or_passes(path):
    bad = [
        (line, module)
        for line, module in imported_modules(path)
        if module.startswith("torch.fx") or {"passes", "pipeline", "lowering"} & set(module.split("."))
    ]
    assert not bad, f"{path.name} imports {bad}: kernels compute, graphs are the passes' business"


def test_the_check_sees_a_violation(tmp_path):
    # the checks above would pass vacuously if imported_modules missed these forms
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import torch.fx\nfrom ..kernels import tiled_moe\nfrom wmoe_compile.kernels.kv_codec import x\n"
        "from .. import passes\n"
    )
    modules = [m for _, m in imported_modules(sample)]
    assert modules == ["torch.fx", "..kernels", "wmoe_compile.kernels.kv_codec", "..", "..passes"]
