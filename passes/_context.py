"""What every pass receives and returns (the pass manager lives in wmoe_compile/pipeline.py).

A pass is a module in this package with `NAME` and `run(ctx) -> PassResult`. It mutates
`ctx.gm` in place, marks the sites it decided (rewritten / skipped with a reason) and tags every
node it inserts with the site it belongs to, so a verification failure can name the site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from .find_sites import SiteReport, Sites

SITE_META_KEY = "wmoe_site"  # node.meta key: "layer 0 attention (layers.0.attn)" for inserted nodes


@dataclass
class PassResult:
    changed: bool
    decided: list[SiteReport] = field(default_factory=list)  # sites this pass rewrote or skipped
    notes: list[str] = field(default_factory=list)
    # Relative error of the graph outputs this pass may introduce against the previous graph
    # (the pass manager's numeric check); None = exact up to floating-point reordering.
    expected_error: float | None = None


@dataclass
class PassContext:
    gm: fx.GraphModule
    config: Any  # wmoe_compile.config.CompileConfig (not imported: passes do not depend on the API layer)
    sites: Sites
    # Sample inputs (args, kwargs) when the caller gave them: used for calibration and checks.
    example_inputs: tuple[tuple, dict] | None = None
    # Inputs to calibrate channel parameters on, when they differ from the example inputs.
    calibration_inputs: tuple[tuple, dict] | None = None
    # Buffers the rewrites created (qualified names): state the numeric check resets.
    state_buffers: list[str] = field(default_factory=list)
    # Set by the pass manager when there are sample inputs: record(nodes, inputs=None) runs the
    # current graph on `inputs` (default: the example inputs) from an empty cache and returns
    # {node name: value} (e.g. K/V for calibration).
    record: Any = None
    # get_attr targets read before the pipeline ran (cleanup deletes those no longer read).
    initial_attrs: set[str] = field(default_factory=set)
    # One dict per pass already run: {"pass": name, "expected_error": float | None, ...}.
    history: list[dict] = field(default_factory=list)


def site_label(report: SiteReport) -> str:
    where = f" ({report.module_path})" if report.module_path else ""
    return f"layer {report.layer} {report.kind} {report.detail}{where}"


def tag(node: fx.Node, report: SiteReport) -> fx.Node:
    node.meta[SITE_META_KEY] = site_label(report)
    return node


def op_available(name: str) -> bool:
    """True if torch.ops.wmoe.<name> is registered (importing wmoe_compile.ops registers them)."""
    try:
        getattr(torch.ops.wmoe, name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register_buffer(gm: fx.GraphModule, qualified_name: str, tensor: torch.Tensor) -> str:
    """Register a non-persistent buffer at a dotted path on `gm` (so export treats it as mutable
    state, like the dense cache it replaces); returns the name actually used (unique)."""
    owner_path, _, leaf = qualified_name.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    name, i = leaf, 1
    while hasattr(owner, name):
        name, i = f"{leaf}_{i}", i + 1
    owner.register_buffer(name, tensor, persistent=False)
    return f"{owner_path}.{name}" if owner_path else name


def copy_meta(new: fx.Node, old: fx.Node) -> None:
    """Keep the provenance of the node being replaced (module stack, stack trace) on its replacement."""
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
