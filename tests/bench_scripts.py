"""Load a benchmarks/ script as a module (they are scripts, not a package), for tests of their
host side."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, freshly executed."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module's names through sys.modules
    spec.loader.exec_module(module)
    return module
