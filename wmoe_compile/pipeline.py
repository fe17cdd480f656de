"""The pass manager and the public entry points: transform, export, prepare.

    ep = wmoe_compile.export(model, (tokens, positions), config=CompileConfig(), dump_dir="dumps")
    ep.module()(tokens, positions)            # rewritten, runnable; torch.export.save(ep, "m.pt2")
    rewritten, report = wmoe_compile.transform(graph_module_or_exported_program, config)
    print(report)                             # every site: rewritten, or skipped with the reason

Pipeline (ordered): find_sites (analysis) -> insert_dwt_quantize -> swap_wavelet_attention ->
replace_moe_dispatch -> fuse_sibling_linears -> decompose_router_topk -> cleanup_graph ->
overlap_cache_writes. After every
pass: graph lint, fake-tensor shape propagation (every input and module tensor converted into one
FakeTensorMode, so nothing runs on real state), and (config.check_numerics) a numeric comparison
with the previous graph on the sample inputs. A failure raises PassVerificationError naming the
pass and the site. insert_dwt_quantize runs the graph on the calibration (or example) inputs to
calibrate the codec's per-(layer, kv head) channel parameters (passes/_channel_params.py).
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from .config import CompileConfig
from .passes import (
    cleanup_graph,
    decompose_router_topk,
    find_sites,
    fuse_sibling_linears,
    insert_dwt_quantize,
    overlap_cache_writes,
    replace_moe_dispatch,
    swap_wavelet_attention,
)
from .passes._context import SITE_META_KEY, PassContext, PassResult
from .passes.find_sites import SiteReport, Sites, relative_error

DEFAULT_PASSES: tuple[ModuleType, ...] = (
    find_sites,
    insert_dwt_quantize,
    swap_wavelet_attention,
    replace_moe_dispatch,
    fuse_sibling_linears,
    decompose_router_topk,
    cleanup_graph,
    overlap_cache_writes,
)


class PassVerificationError(RuntimeError):
    """A pass left a graph that fails a check; names the pass, the check and the site."""

    def __init__(self, pass_name: str, check: str, detail: str, site: str | None = None) -> None:
        self.pass_name, self.check, self.detail, self.site = pass_name, check, detail, site
        where = f" at {site}" if site else ""
        super().__init__(f"pass {pass_name!r} failed {check}{where}: {detail}")


@dataclass
class PassRecord:
    index: int
    name: str
    changed: bool
    seconds: float
    nodes_before: int
    nodes_after: int
    added: dict[str, int]  # op -> count of nodes added
    removed: dict[str, int]
    notes: list[str] = field(default_factory=list)
    decided: list[str] = field(default_factory=list)  # "layer 0 attention sdpa: rewritten"
    numeric: dict[str, float] | None = None  # {"relative_error": .., "bound": ..}
    dump: str | None = None  # NN_<pass> folder

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def op_changes(self, most: int = 3) -> str:
        """What this pass changed, as op counts: the project's own ops first, then the largest
        changes, e.g. "-4 wmoe.kv_compress_into_cache, +4 wmoe.kv_compress_into_cache_overlapped"
        (a pass that retargets nodes keeps the node count), "and N more ops" past `most`;
        "unchanged" when the pass changed nothing."""
        if not self.changed:
            return "unchanged"
        deltas = [(n, op) for op, n in self.added.items()] + [(-n, op) for op, n in self.removed.items()]
        deltas.sort(key=lambda d: (not d[1].startswith("wmoe."), -abs(d[0]), d[1]))
        shown = ", ".join(f"{n:+d} {op}" for n, op in deltas[:most])
        rest = len(deltas) - most
        return (shown or "same op counts") + (f", and {rest} more ops" if rest > 0 else "")


@dataclass
class TransformReport:
    """What the pipeline did: one record per pass and one row per site."""

    config: dict
    passes: list[PassRecord] = field(default_factory=list)
    sites: list[SiteReport] = field(default_factory=list)
    numerics: dict[str, float] | None = None  # final graph vs original on the sample inputs
    dump_dir: str | None = None

    def counts(self) -> dict[str, dict[str, int]]:
        table: dict[str, dict[str, int]] = {}
        for site in self.sites:
            table.setdefault(site.kind, Counter())[site.status] += 1
        return {kind: dict(c) for kind, c in table.items()}

    def rewritten(self, kind: str | None = None) -> list[SiteReport]:
        return [s for s in self.sites if s.status == "rewritten" and (kind is None or s.kind == kind)]

    def skipped(self, kind: str | None = None) -> list[SiteReport]:
        return [s for s in self.sites if s.status == "skipped" and (kind is None or s.kind == kind)]

    def to_dict(self) -> dict:
        return {
            "config": self.config,
            "passes": [p.to_dict() for p in self.passes],
            "sites": [s.to_dict() for s in self.sites],
            "numerics": self.numerics,
            "dump_dir": self.dump_dir,
        }

    def __str__(self) -> str:
        lines = ["passes:"]
        for p in self.passes:
            delta = p.nodes_after - p.nodes_before
            num = ""
            if p.numeric:
                num = f"  numeric rel.err {p.numeric['relative_error']:.2e} (bound {p.numeric['bound']:.2e})"
            lines.append(
                f"  {p.index:02d} {p.name:<24} {p.nodes_before:>5} -> {p.nodes_after:<5} ({delta:+d})"
                f" {p.seconds * 1e3:7.1f} ms  {p.op_changes()}{num}"
            )
        lines.append("sites:")
        for s in self.sites:
            reason = f": {s.reason}" if s.reason else ""
            lines.append(
                f"  layer {s.layer:>3} {s.kind:<9} {s.detail:<44} {s.status:<9} [{s.module_path}]{reason}"
            )
        if self.numerics:
            lines.append(
                "numerics: final vs original relative error "
                f"{self.numerics['relative_error']:.3e} (bound {self.numerics['bound']:.3e})"
            )
        if self.dump_dir:
            lines.append(f"dumps: {self.dump_dir}/index.html")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# running graphs on the sample inputs


def _positional(gm: fx.GraphModule, example_inputs: tuple[tuple, dict]) -> tuple:
    args, kwargs = example_inputs
    if not kwargs:
        return tuple(args)
    return tuple(inspect.signature(gm.forward).bind(*args, **kwargs).args)


def _mutated_buffers(gm: fx.GraphModule) -> set[str]:
    """Module tensors the graph writes in place (per the ops' schemas: `Tensor(a!)` arguments)."""
    names = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
            if isinstance(value, fx.Node) and value.op == "get_attr":
                names.add(str(value.target))
    return names


class _StateGuard:
    """Zero the given buffers (the KV caches: every run starts from an empty cache), run, then
    restore every buffer the graph writes, so checks and calibration leave the module's state as
    they found it. Only written buffers are copied (not the weights)."""

    def __init__(self, gm: fx.GraphModule, reset: Sequence[str]) -> None:
        self.gm, self.reset = gm, set(reset)
        self.keep = self.reset | _mutated_buffers(gm)

    def __enter__(self) -> None:
        self.saved = {
            name: buf.detach().clone() for name, buf in self.gm.named_buffers() if name in self.keep
        }
        for name, buf in self.gm.named_buffers():
            if name in self.reset:
                buf.zero_()

    def __exit__(self, *exc) -> None:
        with torch.no_grad():
            for name, buf in self.gm.named_buffers():
                if name in self.saved:
                    buf.copy_(self.saved[name])


def _run_outputs(gm: fx.GraphModule, example_inputs, reset: Sequence[str]) -> list[torch.Tensor]:
    with torch.no_grad(), _StateGuard(gm, reset):
        out = gm(*example_inputs[0], **example_inputs[1])
    return [t.detach().clone() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _record_nodes(gm: fx.GraphModule, example_inputs, reset: Sequence[str], names: set[str]) -> dict:
    recorded: dict[str, torch.Tensor] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            value = super().run_node(n)
            if n.name in names and isinstance(value, torch.Tensor):
                recorded[n.name] = value.detach().clone()
            return value

    with torch.no_grad(), _StateGuard(gm, reset):
        Recorder(gm).run(*_positional(gm, example_inputs))
    return recorded


def _outputs_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    if len(got) != len(want):
        return math.inf
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        if a.shape != b.shape:
            return math.inf
        if not a.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(a, b) else math.inf)
            continue
        if torch.isnan(a).any() and not torch.isnan(b).any():
            return math.nan
        worst = max(worst, relative_error(a, b))
    return worst


def _rounding_bound(outputs: list[torch.Tensor]) -> float:
    """Relative error allowed for rewrites that are exact up to floating-point reordering: a few
    units of the output dtype's rounding (bf16 3e-2, fp16 4e-3), at least 1e-4 (fp32 reductions
    in a different order over a whole model)."""
    dtypes = [t.dtype for t in outputs if t.is_floating_point()]
    eps = max((torch.finfo(d).eps for d in dtypes), default=torch.finfo(torch.float32).eps)
    return max(1e-4, 4 * eps)


# ----------------------------------------------------------------------------------------------
# verification


class _FakeProp(fx.Interpreter):
    """Fake-tensor shape propagation that never touches real module state.

    Placeholders get fake tensors built from their recorded metadata, and every parameter,
    buffer and constant a get_attr reads is converted into the same FakeTensorMode
    (`mode.from_tensor`, memoised, so aliasing between module tensors is kept), so in-place ops
    (cache writes) mutate fakes and no op ever runs on a real tensor; the mode refuses real
    inputs. Remembers the node it was on when something failed."""

    def __init__(self, gm: fx.GraphModule, mode) -> None:
        super().__init__(gm)
        self.mode = mode
        self.current: fx.Node | None = None

    def fetch_attr(self, target: str) -> Any:
        value = super().fetch_attr(target)
        if isinstance(value, torch.Tensor):
            return self._fake(value)
        return value

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        result = super().run_node(n)
        if n.op == "get_attr" and isinstance(n.meta.get("val"), torch.Tensor):
            return result
        n.meta["val"] = pytree.tree_map_only(torch.Tensor, self._fake, result)
        return result

    def _fake(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        if isinstance(tensor, FakeTensor) and tensor.fake_mode is self.mode:
            return tensor
        return self.mode.from_tensor(tensor, static_shapes=True)


def _fake_inputs(gm: fx.GraphModule, mode) -> list:
    fakes = []
    with mode:
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            value = node.meta.get("val")
            if isinstance(value, torch.Tensor):
                fakes.append(
                    torch.empty_strided(
                        tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device=value.device
                    )
                )
            else:
                fakes.append(value)
    return fakes


def _warm_op_caches(gm: fx.GraphModule) -> None:
    """Build the wmoe ops' cached codec tables with real tensors before fake-tensor tracing.

    The ops' fake implementations look the tables up (lru caches); a first lookup under an active
    FakeTensorMode would read or cache fake tensors and fail (tolist() on a fake tensor).
    """
    from .codec import get_codec

    for node in gm.graph.nodes:
        if node.op != "call_function" or not str(node.target).startswith("wmoe."):
            continue
        spec = next((a for a in node.args if isinstance(a, str)), None)
        first = node.args[0] if node.args else None
        head_dim = _node_shape(first)[-1] if _node_shape(first) else None
        if spec is None or head_dim is None:
            continue
        if str(node.target).startswith("wmoe.wavelet_attention"):
            from .ops.attention import compressed_layout

            compressed_layout(spec, head_dim)
        elif "kv_decompress" not in str(node.target):  # decompress's first input is codes
            get_codec(spec, head_dim)


def _node_shape(node: object) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _verify(gm: fx.GraphModule, pass_name: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        gm.graph.lint()
        gm.recompile()
    except Exception as exc:
        raise PassVerificationError(pass_name, "graph lint", str(exc)) from exc
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if any(
        not isinstance(n.meta.get("val"), (torch.Tensor, int, float, bool, type(None))) for n in placeholders
    ):
        return  # no recorded input metadata (e.g. a symbolic_trace graph): nothing to propagate
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    _warm_op_caches(gm)
    # a shape environment lets a data-dependent scalar (aten.item, e.g. JetMoE's expert counts)
    # propagate as an unbacked symbol instead of failing the check
    mode = FakeTensorMode(shape_env=ShapeEnv())
    prop = _FakeProp(gm, mode)
    try:
        with mode:
            prop.run(*_fake_inputs(gm, mode), enable_io_processing=False)
    except Exception as exc:
        node = prop.current
        site = node.meta.get(SITE_META_KEY) if node is not None else None
        where = f"node {node.format_node()}" if node is not None else "graph"
        raise PassVerificationError(
            pass_name, "fake-tensor shape propagation", f"{where}: {type(exc).__name__}: {exc}", site
        ) from exc


def _localise(prev: fx.GraphModule, gm: fx.GraphModule, example_inputs, reset, bound: float):
    """Find the rewritten site whose output deviates most: compare, in both graphs, the first
    untagged consumer of each site's inserted nodes (same node name before and after)."""
    anchors: dict[str, str] = {}
    for node in gm.graph.nodes:
        label = node.meta.get(SITE_META_KEY)
        if not label:
            continue
        for user in node.users:
            if SITE_META_KEY not in user.meta and user.op == "call_function":
                anchors.setdefault(user.name, label)
    prev_names = {n.name for n in prev.graph.nodes}
    names = {n for n in anchors if n in prev_names}
    if not names:
        return None, None
    before = _record_nodes(prev, example_inputs, reset, names)
    after = _record_nodes(gm, example_inputs, reset, names)
    worst = None
    for name in names:
        if name in before and name in after and before[name].shape == after[name].shape:
            err = relative_error(after[name].float(), before[name].float())
            if worst is None or not err <= worst[1]:
                worst = (name, err)
    if worst is None:
        return None, None
    return anchors[worst[0]], f"largest deviation at node {worst[0]}: relative error {worst[1]:.3e}"


# ----------------------------------------------------------------------------------------------
# the pass manager


def run_passes(
    gm: fx.GraphModule,
    config: CompileConfig,
    *,
    example_inputs: tuple[tuple, dict] | None = None,
    dump_dir: str | os.PathLike | None = None,
    passes: Sequence[ModuleType] = DEFAULT_PASSES,
) -> TransformReport:
    """Run `passes` in order on `gm` (in place), verifying after each; returns the report."""
    from . import ops  # noqa: F401  (registers the wmoe ops the rewrites emit)
    from .dump import GraphDumper

    report = TransformReport(config=config.to_dict(), dump_dir=str(dump_dir) if dump_dir else None)
    calibration_inputs = config.calibration_inputs
    ctx = PassContext(
        gm=gm,
        config=config,
        sites=Sites(),
        example_inputs=example_inputs,
        calibration_inputs=calibration_inputs,
    )
    ctx.initial_attrs = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}

    def reset_names() -> list[str]:
        dense = [
            str(kv.buffer.target)
            for kv in ctx.sites.kv
            if kv.buffer is not None and kv.buffer.op == "get_attr"
        ]
        return dense + list(ctx.state_buffers)

    if example_inputs is not None or calibration_inputs is not None:

        def record(nodes, inputs=None):
            inputs = inputs if inputs is not None else example_inputs
            return _record_nodes(gm, inputs, reset_names(), {n.name for n in nodes})

        ctx.record = record
    dumper = GraphDumper(dump_dir) if dump_dir else None
    if dumper:
        dumper.dump(0, "input", gm, sites=[], notes=["captured graph, before any pass"])
    check = config.check_numerics and example_inputs is not None
    reference = _run_outputs(gm, example_inputs, []) if check else None
    previous_outputs = reference
    for index, pass_module in enumerate(passes, start=1):
        name = pass_module.NAME
        before_ops = _op_counts(gm)
        nodes_before = len(gm.graph.nodes)
        prev_gm = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if check else None
        start = time.perf_counter()
        result: PassResult = pass_module.run(ctx)
        seconds = time.perf_counter() - start
        _verify(gm, name)
        after_ops = _op_counts(gm)
        record = PassRecord(
            index=index,
            name=name,
            changed=result.changed,
            seconds=seconds,
            nodes_before=nodes_before,
            nodes_after=len(gm.graph.nodes),
            added=dict(after_ops - before_ops),
            removed=dict(before_ops - after_ops),
            notes=list(result.notes),
            decided=[f"layer {s.layer} {s.kind} {s.detail}: {s.status}" for s in result.decided],
        )
        if check and index > 1:
            outputs = _run_outputs(gm, example_inputs, reset_names())
            err = _outputs_error(outputs, previous_outputs)
            bound = result.expected_error if result.expected_error is not None else _rounding_bound(outputs)
            record.numeric = {"relative_error": err, "bound": bound}
            if not err <= bound:
                site, detail = _localise(prev_gm, gm, example_inputs, reset_names(), bound)
                raise PassVerificationError(
                    name,
                    "numeric check",
                    f"outputs differ from the previous graph by relative error {err:.3e} > bound {bound:.3e}"
                    + (f"; {detail}" if detail else ""),
                    site,
                )
            previous_outputs = outputs
        ctx.history.append({"pass": name, "expected_error": result.expected_error})
        if dumper:
            record.dump = dumper.dump(index, name, gm, sites=ctx.sites.reports(), notes=record.notes)
        report.passes.append(record)
    report.sites = ctx.sites.reports()
    if check:
        outputs = _run_outputs(gm, example_inputs, reset_names())
        errors = [h["expected_error"] for h in ctx.history if h["expected_error"] is not None]
        bound = sum(errors) if errors else _rounding_bound(outputs)
        report.numerics = {"relative_error": _outputs_error(outputs, reference), "bound": bound}
    if dumper:
        dumper.write_index(report)
    return report


def _op_counts(gm: fx.GraphModule) -> Counter:
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            counts[_op_label(node)] += 1
        elif node.op in ("get_attr", "placeholder"):
            counts[node.op] += 1
    return counts


def _op_label(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "name", None)
    if callable(name):  # OpOverload.name() -> "aten::view"
        return name().replace("::", ".")
    return getattr(target, "__name__", str(target))


# ----------------------------------------------------------------------------------------------
# public API


def _resolve_dump_dir(dump_dir) -> str | None:
    value = dump_dir if dump_dir is not None else os.environ.get("WMOE_DUMP_DIR")
    return str(value) if value else None


def _check_aten_level(gm: fx.GraphModule) -> None:
    # ExportedProgram.module() calls a `_guards_fn` submodule (input checks): not a model layer.
    modules = [
        n.name for n in gm.graph.nodes if n.op == "call_module" and not str(n.target).startswith("_guards")
    ]
    if modules:
        raise ValueError(
            f"the graph is not ATen-level (call_module nodes: {', '.join(modules[:5])}); capture it "
            "with torch.export (then pass the ExportedProgram or ExportedProgram.module()) or use "
            "wmoe_compile.export"
        )


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of the graph; tensors are shared, not copied."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    # GraphModule's constructor registers copied buffers as persistent; keep the original flags.
    for name, module in gm.named_modules():
        if not module._non_persistent_buffers_set:
            continue
        try:
            target = new.get_submodule(name) if name else new
        except AttributeError:
            continue
        target._non_persistent_buffers_set |= module._non_persistent_buffers_set & set(target._buffers)
    new.meta.update(getattr(gm, "meta", {}))
    return new


def transform(
    graph: fx.GraphModule | torch.export.ExportedProgram,
    config: CompileConfig | None = None,
    dump_dir: str | os.PathLike | None = None,
    *,
    example_inputs: tuple[tuple, dict] | tuple | None = None,
) -> tuple[fx.GraphModule | torch.export.ExportedProgram, TransformReport]:
    """Run the default pipeline on an ATen-level graph; returns (rewritten, report).

    graph           an ExportedProgram (rewritten and re-exported: the result is an
                    ExportedProgram) or an ATen-level GraphModule (e.g. ExportedProgram.module(),
                    or AOTAutograd's forward graph; the input is left unchanged, tensors shared)
    config          CompileConfig (default: every rewrite on)
    dump_dir        per-pass dumps (default: $WMOE_DUMP_DIR; none when unset)
    example_inputs  (args, kwargs) or args for calibration and the numeric check; an
                    ExportedProgram brings its own. The codec's channel parameters are calibrated
                    on config.calibration_inputs when given (same shapes), else on these, unless
                    config.channel_params has them; without either a layer falls back to the
                    codec without them, and the report and a warning say so.
    """
    config = config or CompileConfig()
    dump_dir = _resolve_dump_dir(dump_dir)
    if example_inputs is not None and not (
        len(example_inputs) == 2
        and isinstance(example_inputs[0], tuple)
        and isinstance(example_inputs[1], dict)
    ):
        example_inputs = (tuple(example_inputs), {})
    if isinstance(graph, torch.export.ExportedProgram):
        examples = example_inputs or graph.example_inputs
        if examples is None:
            raise ValueError("re-exporting the rewritten program needs example inputs; pass example_inputs=")
        gm = graph.module()
        report = run_passes(gm, config, example_inputs=examples, dump_dir=dump_dir)
        return _reexport(gm, examples), report
    if not isinstance(graph, fx.GraphModule):
        raise TypeError(
            "transform takes a torch.fx.GraphModule or torch.export.ExportedProgram, got "
            f"{type(graph).__name__}; for an nn.Module use wmoe_compile.export(model, args)"
        )
    _check_aten_level(graph)
    if config.check_numerics and example_inputs is None:
        warnings.warn("check_numerics=True but no example_inputs: the numeric check is skipped", stacklevel=2)
    gm = _copy_graph_module(graph)
    report = run_passes(gm, config, example_inputs=example_inputs, dump_dir=dump_dir)
    return gm, report


def _reexport(gm: fx.GraphModule, example_inputs: tuple[tuple, dict]) -> torch.export.ExportedProgram:
    args, kwargs = example_inputs
    with torch.no_grad():
        return torch.export.export(gm, tuple(args), dict(kwargs or {}), strict=False)


def export(
    model: nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    config: CompileConfig | None = None,
    dump_dir: str | os.PathLike | None = None,
    *,
    strict: bool = False,
) -> torch.export.ExportedProgram:
    """Capture `model` with torch.export, rewrite it, and re-export: a runnable ExportedProgram
    that saves and loads as .pt2 (import wmoe_compile before torch.export.load, so the wmoe ops
    are registered). The transform report is attached as `program.wmoe_report`.

    `prepare(model)` runs first (e.g. HF experts_implementation="eager" -> "grouped_mm").
    The args are the example inputs: they are traced, used to calibrate the codec's channel
    parameters (unless config.calibration_inputs or config.channel_params are given), and for the
    numeric check when config.check_numerics is set; start them at position 0 (the compressed
    cache starts empty). The RoPE base for key calibration comes from the model's config when
    config.rope_theta is not set (rope_base_of).
    """
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    model = prepare(model)
    kwargs = dict(kwargs or {})
    config = config or CompileConfig()
    if config.rope_theta is None:
        base = rope_base_of(model)
        if base is not None:
            config = config.replace(rope_theta=base)
    with torch.no_grad():
        captured = torch.export.export(model, args, kwargs, strict=strict)
    program, report = transform(captured, config, dump_dir, example_inputs=(args, kwargs))
    program.wmoe_report = report
    return program


def rope_base_of(model: nn.Module) -> float | None:
    """The RoPE base (theta) of the reference model or an HF model with default rotate-half RoPE
    over the whole head (HF `rope_parameters` / `rope_theta`); None when unknown or another
    RoPE variant (scaled, partial), whose keys are then calibrated at the sample positions."""
    from .models.mixtral import MixtralModel

    if isinstance(model, MixtralModel):
        return float(model.cfg.rope_theta)
    inner = model.model if isinstance(model, HFStaticCacheLM) else model
    config = getattr(inner, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    params = getattr(config, "rope_parameters", None)
    params = params if isinstance(params, dict) else {}
    if params.get("rope_type", "default") != "default":
        return None
    if (getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        return None
    base = params.get("rope_theta", getattr(config, "rope_theta", None))
    return float(base) if base is not None else None


# ----------------------------------------------------------------------------------------------
# prepare: what must change before capture


_CAPTURABLE_EXPERTS = ("grouped_mm", "batched_mm")
_UNDERSTOOD_ATTENTION = ("sdpa", "eager")


def prepare(
    model: nn.Module, *, batch_size: int | None = None, max_cache_len: int | None = None
) -> nn.Module:
    """Make `model` capturable by torch.export in the form the passes understand.

    - wmoe_compile reference model: MoE dispatch "routed" (nonzero loop) -> "dense" (static
      shapes); with batch_size/max_cache_len, allocates the static cache.
    - HF transformers 5.x model: experts_implementation "eager" (a Python loop over `nonzero`,
      10+ graph breaks, not exportable) -> "grouped_mm"; attention implementations other than
      sdpa/eager -> sdpa. With batch_size and max_cache_len, returns `HFStaticCacheLM`, a module
      whose forward(input_ids, cache_position) -> logits holds a StaticCache as buffers (what
      the KV rewrites need; DynamicCache is found but not rewritten).
    Anything else is returned unchanged. Raises ValueError saying what to change when a model
    cannot be made capturable.
    """
    from .models.mixtral import MixtralModel, MoE

    if isinstance(model, MixtralModel):
        for module in model.modules():
            if isinstance(module, MoE) and module.dispatch != "dense":
                module.dispatch = "dense"
        if batch_size is not None:
            model.setup_cache(batch_size, max_cache_len)
        return model.eval()
    config = getattr(model, "config", None)
    if (
        config is not None
        and hasattr(config, "_attn_implementation")
        and hasattr(model, "set_attn_implementation")
    ):
        _prepare_hf(model)
        if (batch_size is None) != (max_cache_len is None):
            raise ValueError("give both batch_size and max_cache_len for a static cache, or neither")
        if batch_size is not None:
            return HFStaticCacheLM(model, batch_size, max_cache_len)
        return model.eval()
    return model


def _prepare_hf(model: nn.Module) -> None:
    config = model.config
    experts = getattr(config, "_experts_implementation", None)
    # a model without switchable experts (Llama 4: one batched matmul over every expert) runs its
    # own experts code, not transformers' per-expert loop: left for the capture to take as it is
    switchable = getattr(model, "_can_set_experts_implementation", lambda: True)()
    if experts is not None and experts not in _CAPTURABLE_EXPERTS and _has_experts(model) and switchable:
        if experts != "eager":
            raise ValueError(
                f"experts_implementation={experts!r} is not capturable by the wmoe passes; load the model "
                f"with experts_implementation='grouped_mm' (or 'batched_mm')"
            )
        try:
            model.set_experts_implementation("grouped_mm")
        except Exception as exc:  # noqa: BLE001 - report what to change instead
            raise ValueError(
                "experts_implementation='eager' loops over nonzero() and cannot be captured, and "
                f"switching it failed ({exc}); load the model with experts_implementation='grouped_mm'"
            ) from exc
    attention = config._attn_implementation
    if attention not in _UNDERSTOOD_ATTENTION:
        try:
            model.set_attn_implementation("sdpa")
        except Exception as exc:  # noqa: BLE001
            raise ValueError(
                f"attn_implementation={attention!r} is not understood by the passes and could not be "
                f"switched ({exc}); load the model with attn_implementation='sdpa'"
            ) from exc


def _has_experts(model: nn.Module) -> bool:
    return any(
        hasattr(m, "gate_up_proj") or hasattr(m, "down_proj") and hasattr(m, "num_experts")
        for m in model.modules()
    )


class HFStaticCacheLM(nn.Module):
    """An HF causal LM with a transformers StaticCache held as module buffers, for torch.export.

    forward(input_ids [B, T], cache_position [T]) -> logits [B, T, vocab]. cache_position are the
    cache slots of the T tokens (consecutive, starting at the current length); the cache's length
    is reset from cache_position[0] on every call, so one exported program serves prefill and
    decode. Unlike transformers' TorchExportableModuleWithStaticCache (whose cache tensors export
    as constants under strict=False), the cache tensors are read through this module's buffers,
    so torch.export sees them as mutable state.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_cache_len: int) -> None:
        super().__init__()
        from transformers import StaticCache

        self.model = model.eval()
        text_config = model.config.get_text_config()
        cache = StaticCache(config=text_config, max_cache_len=max_cache_len)
        _check_attention_layers(model, cache)
        _unroll_sliding_layers(cache, max_cache_len)
        # One decode step on a dummy token lets every layer size its own cache: what a layer
        # caches is the model's choice (K and V of num_key_value_heads x head_dim for most; for
        # DeepSeek's multi-head latent attention, one "head" of latent and one of rotary key, of
        # different widths), which the config alone does not say across transformers versions.
        device = next(model.parameters()).device
        with torch.no_grad():
            self.model(
                input_ids=torch.ones(batch_size, 1, dtype=torch.long, device=device),
                cache=cache,
                use_cache=True,
            )
        for layer in cache.layers:
            layer.keys.zero_()
            layer.values.zero_()
        self._cache = cache
        self.batch_size, self.max_cache_len = batch_size, max_cache_len
        for i, layer in enumerate(cache.layers):
            self.register_buffer(f"key_cache_{i}", layer.keys, persistent=False)
            self.register_buffer(f"value_cache_{i}", layer.values, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self._cache.layers):
            layer.keys = getattr(self, f"key_cache_{i}")
            layer.values = getattr(self, f"value_cache_{i}")
            layer.cumulative_length = cache_position[0].clone()  # the layer adds T to it in place
        return self.model(input_ids=input_ids, cache=self._cache, use_cache=True).logits


def _check_attention_layers(model: nn.Module, cache: nn.Module) -> None:
    """Raise, naming them, when some layers of `cache` hold recurrent state instead of K/V.

    Linear-attention layers (the Gated DeltaNet layers of Qwen3-Next and Qwen3.5-MoE, Mamba-style
    layers) keep a convolution and a recurrent state whose update branches on Python flags (prefill
    or decode): an exported program would keep the branch of its example."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    linear = [i for i, layer in enumerate(cache.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
    if linear:
        raise ValueError(
            f"{type(model).__name__} has layers with recurrent state instead of a K/V cache (linear "
            f"attention, layers {linear[:8]}{' ...' if len(linear) > 8 else ''}); prepare's static "
            "cache holds attention layers only (their update branches on Python state an export "
            "would freeze). Models whose every layer is attention are supported."
        )


def _unroll_sliding_layers(cache: nn.Module, max_cache_len: int) -> None:
    """Give every sliding-window (or chunked-attention) layer of `cache` a full-length static layer.

    transformers' sliding layer holds only the last `sliding_window` tokens, chooses between an
    in-place write and a roll on a Python-int count of the tokens it has seen, and sizes the mask
    from that count: an exported program keeps the count and branch of its example, so it fails once
    a sequence outgrows the window, and (Llama 4's chunked layers, even within the window) attends
    to the wrong slots. A full-length layer is written at the tokens' positions like every other
    layer; the model's sliding-window or chunk mask, computed over the whole cache, still hides the
    tokens outside the window, so the results are the same (the passes then report that mask as not
    a plain causal one). The price is memory where the window is shorter than max_cache_len: such a
    layer holds max_cache_len tokens instead of the window's.
    """
    from transformers.cache_utils import StaticLayer

    for index, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            cache.layers[index] = StaticLayer(max_cache_len=max_cache_len)


def example_inputs_for(model: nn.Module, batch: int = 2, tokens: int = 8) -> tuple[tuple, dict]:
    """Example (args, kwargs) for a prefill from position 0, for the reference model or an
    HFStaticCacheLM; token ids are random (never all zeros)."""
    from .models.mixtral import MixtralModel

    if isinstance(model, MixtralModel):
        vocab = model.cfg.vocab_size
        device = model.lm_head.weight.device
        return (
            torch.randint(1, vocab, (batch, tokens), device=device),
            torch.arange(tokens, device=device),
        ), {}
    if isinstance(model, HFStaticCacheLM):
        vocab = model.model.config.get_text_config().vocab_size
        device = next(model.parameters()).device
        ids = torch.randint(1, vocab, (model.batch_size, tokens), device=device)
        return (ids, torch.arange(tokens, device=device)), {}
    raise TypeError(f"no example inputs known for {type(model).__name__}; pass them explicitly")


# ----------------------------------------------------------------------------------------------
# tiny random HF models (tests and `wmoe-compile dump`; built from configs, nothing downloaded)

# kind -> (transformers config class, model class, config fields beyond the shared tiny ones)
_HF_TINY_SPECS: dict[str, tuple[str, str, dict]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2),
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    ),
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            # MLA: every head has its own K/V; head_dim is the rotary part (qk_rope_head_dim)
            num_key_value_heads=4,
            head_dim=8,
        ),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(intermediate_size=96, tie_word_embeddings=True)),
    "ernie4.5-moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            intermediate_size=96,
            moe_intermediate_size=48,
            moe_num_experts=4,
            moe_k=2,
            moe_num_shared_experts=1,
            moe_layer_start_index=0,  # (the released models start at layer 1)
        ),
    ),
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,  # layers alternate: sliding window, then full attention
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},
        ),
    ),
}
HF_TINY = tuple(_HF_TINY_SPECS)


def tiny_hf_model(
    kind: str,
    *,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
    num_layers: int = 2,
    seed: int = 0,
) -> nn.Module:
    """A randomly initialised transformers 5.x causal LM from a tiny config.

    kind: "mixtral" | "qwen3-moe" | "qwen2-moe" (a shared expert beside the routed ones, gated by
    a sigmoid; routing weights not renormalised) | "olmoe" (q/k norms over whole projections) |
    "granitemoe" (top-k of the router logits, then softmax over the k) | "phimoe" (sparsemixer
    routing through max, not top-k: the passes report its experts and leave them) |
    "deepseek-v3" (multi-head latent attention, which the KV rewrites skip with the reason; 8
    routed experts top-2 chosen on biased sigmoid scores within the best of 2 groups, a shared
    expert, layer 0 dense) | "ernie4.5-moe" (experts chosen on softmax scores plus a choice bias,
    weights gathered from the scores and renormalised; a shared expert) | "llama" (dense,
    SmolLM2-like: only the KV/attention rewrites apply) |
    "gpt-oss" (learned attention sinks, sliding-window and full layers in turn, experts with
    biases and a clamped SwiGLU: its caches are compressed, its attention and experts reported and
    left). Hidden 64, 4 query / 2 KV heads of 16, 4 experts top-2 for the other MoE kinds. A model
    class without an SDPA path (gpt-oss) gets eager attention when "sdpa" is asked for.
    """
    import transformers

    common = dict(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    if kind not in _HF_TINY_SPECS:
        raise ValueError(f"unknown tiny HF model {kind!r}; valid: {', '.join(HF_TINY)}")
    config_name, model_name, fields = _HF_TINY_SPECS[kind]
    config = getattr(transformers, config_name)(**{**common, **fields})
    model_class = getattr(transformers, model_name)
    if attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        attn_implementation = "eager"
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():  # seeded weights without resetting the caller's generator
        torch.manual_seed(seed)
        model = model_class(config).eval()
        for module in model.modules():
            # DeepSeek's choice bias is zero at init: make it steer; gpt-oss's sink logits too
            for name, std in (("e_score_correction_bias", 0.1), ("sinks", 1.0)):
                tensor = getattr(module, name, None)
                if isinstance(tensor, torch.Tensor):
                    tensor.data.normal_(0.0, std)
    if experts_implementation is not None:
        model.set_experts_implementation(experts_implementation)
    return model
