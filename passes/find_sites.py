"""Analysis pass: find every attention, K/V cache write and MoE dispatch site by dataflow.

Why: the rewrites must know *what* a group of nodes computes before replacing it, and a person
must see every candidate site with the reason it was or was not rewritten. This pass changes
nothing; it walks the graph:

- attention: each `scaled_dot_product_attention` (or an eager matmul -> softmax -> matmul);
  from its K and V operands back through `repeat_kv` to the cache (`index_copy_` into a buffer:
  static cache; `cat(past, new, dim=-2)`: dynamic cache) and on to the K/V projection (through
  views, per-head norms and RoPE); the mask back to `arange(S) <= positions`. A cache written
  into a module buffer that no recognised attention reads is reported too, as skipped.
- MoE: each `topk` over a softmax of a linear router; the expert computation downstream of the
  routing weights is cut out as a closed region (it reads only the hidden states, the top-k ids
  and weights, and constants) and *verified* to be a top-k SwiGLU mixture by evaluating it on
  random inputs against the closed-form formula with the weights found in the region. Layouts
  that cannot be told apart by shape (gate/up stacking, transposition) are resolved the same way,
  and so are expert biases and a clamped SwiGLU (gpt-oss), whose constants are read off the
  region's clamp, sigmoid and add nodes and then checked by the same evaluation.

Module names (`nn_module_stack`) are used only for the report's labels.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx

from . import _matching as m

aten = torch.ops.aten

KIND_KV = "kv_write"
KIND_ATTENTION = "attention"
KIND_MOE = "moe"


@dataclass
class SiteReport:
    """One line of the transform report: what was found, and what happened to it."""

    kind: str  # kv_write | attention | moe
    layer: int
    module_path: str
    detail: str  # e.g. "K static cache", "sdpa", "stacked experts (grouped_mm)"
    status: str = "found"  # found | rewritten | skipped
    reason: str = ""
    decided_by: str = ""  # the pass that rewrote or skipped it
    nodes: dict[str, str] = field(default_factory=dict)  # role -> node name

    def skip(self, reason: str, by: str) -> None:
        if self.status == "found":
            self.status, self.reason, self.decided_by = "skipped", reason, by

    def rewritten(self, by: str, note: str = "") -> None:
        self.status, self.reason, self.decided_by = "rewritten", note, by

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "layer": self.layer,
            "module_path": self.module_path,
            "detail": self.detail,
            "status": self.status,
            "reason": self.reason,
            "decided_by": self.decided_by,
            "nodes": dict(self.nodes),
        }


@dataclass(eq=False)
class CompressedCache:
    """The graph attributes that replace one dense K or V cache (set by insert_dwt_quantize)."""

    codes: fx.Node
    scales: fx.Node
    exact: fx.Node
    channel_scale: fx.Node
    spec: str
    passthrough: bool  # True when the exact cache covers every position (bypass_codec)


@dataclass(eq=False)
class KVWriteSite:
    role: str  # "K" or "V"
    cache_kind: str  # static | dynamic | none | unsupported
    value: fx.Node  # the tensor written (after RoPE for K)
    read: fx.Node  # what the attention reads: the write's result (or the cache itself)
    report: SiteReport
    write: fx.Node | None = None  # index_copy_ node
    buffer: fx.Node | None = None  # get_attr of the dense cache
    index: fx.Node | None = None  # positions written, int [T]
    projection: fx.Node | None = None
    compressed: CompressedCache | None = None
    # Why the compress rewrite cannot apply (set during analysis; None = rewritable).
    blocker: str | None = None
    # cache_kind "unsupported", K/V computed from caches (e.g. a latent): every cache write upstream
    upstream_writes: tuple[fx.Node, ...] = ()


@dataclass(eq=False)
class AttentionSite:
    node: fx.Node  # sdpa node, or the P @ V matmul of an eager attention
    variant: str  # sdpa | eager | <op name>
    report: SiteReport
    q: fx.Node | None = None
    k: KVWriteSite | None = None
    v: KVWriteSite | None = None
    mask: fx.Node | None = None  # boolean mask, True = attend (None when none)
    scale: float | None = None
    n_rep: int = 1
    blocker: str | None = None  # why the attention swap cannot apply
    sinks: fx.Node | None = None  # learned sink logits [Hq] (gpt-oss), joining the softmax
    window: int = 0  # a sliding window shorter than the cache (0: none, or one that masks nothing)


@dataclass(frozen=True)
class ExpertActivation:
    """h = g * sigmoid(gate_alpha * g) * (u + up_offset), where g = min(gate, clamp_limit) and
    u = clamp(up, -clamp_limit, clamp_limit) when clamp_limit is set, else the projections as
    they are. The defaults are SwiGLU, silu(gate) * up; gpt-oss uses (1.702, 7.0, 1.0)."""

    gate_alpha: float = 1.0
    clamp_limit: float | None = None
    up_offset: float = 0.0

    @property
    def is_swiglu(self) -> bool:
        return self == ExpertActivation()

    def apply(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.clamp_limit is not None:
            gate = gate.clamp(max=self.clamp_limit)
            up = up.clamp(-self.clamp_limit, self.clamp_limit)
        return gate * torch.sigmoid(self.gate_alpha * gate) * (up + self.up_offset)

    def describe(self) -> str:
        if self.is_swiglu:
            return "SwiGLU"
        clamp = f", clamped to {self.clamp_limit:g}" if self.clamp_limit is not None else ""
        return f"gate * sigmoid({self.gate_alpha:g} gate) * (up + {self.up_offset:g}){clamp}"


ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# (b_gate [E, F] | None, b_up [E, F] | None, b_down [E, H] | None)
ExpertBiases = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


@dataclass(eq=False)
class MoESite:
    report: SiteReport
    hidden: fx.Node | None = None  # [N, H] tokens entering the experts
    topk_ids: fx.Node | None = None  # [N, K]
    topk_weights: fx.Node | None = None  # [N, K] routing weights as the experts use them
    output: fx.Node | None = None  # [N, H] mixture output that tiled_moe replaces
    # Returns (w_gate [E, F, H], w_up [E, F, H], w_down [E, H, F]) in linear layout.
    expert_weights: Callable[[], ExpertWeights] | None = None
    # Returns (b_gate [E, F], b_up [E, F], b_down [E, H]), any of them None; None: no biases.
    expert_biases: Callable[[], ExpertBiases] | None = None
    activation: ExpertActivation = field(default_factory=ExpertActivation)
    weight_nodes: list[fx.Node] = field(default_factory=list)
    num_experts: int = 0
    top_k: int = 0
    blocker: str | None = None


@dataclass
class Sites:
    attention: list[AttentionSite] = field(default_factory=list)
    kv: list[KVWriteSite] = field(default_factory=list)
    moe: list[MoESite] = field(default_factory=list)

    def reports(self) -> list[SiteReport]:
        rows = [s.report for s in self.kv] + [s.report for s in self.attention] + [s.report for s in self.moe]
        order = {KIND_KV: 0, KIND_ATTENTION: 1, KIND_MOE: 2}
        return sorted(rows, key=lambda r: (r.layer, order[r.kind], r.detail))


PASS_NAME = NAME = "find_sites"

_OTHER_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "flex_attention",
)


def find_sites(gm: fx.GraphModule) -> Sites:
    """Analyse `gm` and return every attention, K/V write and MoE site (nothing is changed)."""
    sites = Sites()
    ordinal = {"attention": 0, "moe": 0}
    for node in list(gm.graph.nodes):
        attention = _match_attention(gm, node)
        if attention is not None:
            attention.report.layer = _layer(attention.report.module_path, ordinal, "attention")
            for kv in (attention.k, attention.v):
                if kv is not None:
                    kv.report.layer = attention.report.layer
                    sites.kv.append(kv)
            sites.attention.append(attention)
    for node in list(gm.graph.nodes):
        if m.is_op(node, aten.topk):
            moe = _match_moe(gm, node)
            if moe is not None:
                moe.report.layer = _layer(moe.report.module_path, ordinal, "moe")
                sites.moe.append(moe)
    sites.moe.extend(_experts_without_router(gm, sites.moe))
    sites.kv.extend(_caches_without_attention(gm, sites.kv))
    return sites


def _caches_without_attention(gm: fx.GraphModule, found: list[KVWriteSite]) -> list[KVWriteSite]:
    """Cache writes (index_copy_ into a module buffer) that no recognised attention reads: reported
    as skipped, so an attention the passes do not understand never leaves its cache dense silently."""
    claimed = {kv.write for kv in found if kv.write is not None}
    claimed.update(write for kv in found for write in kv.upstream_writes)
    sites = []
    for node in gm.graph.nodes:
        if not m.is_op(node, aten.index_copy_, aten.index_copy) or node in claimed:
            continue
        buffer = node.args[0]
        if not (isinstance(buffer, fx.Node) and buffer.op == "get_attr"):
            continue
        path = m.module_path(node)
        layer = m.layer_of(path)
        report = SiteReport(
            KIND_KV,
            -1 if layer is None else layer,
            path,
            f"cache {buffer.target}, no attention recognised",
            nodes={"write": node.name, "cache": str(buffer.target)},
        )
        report.skip(
            f"cache {buffer.target} is written by {m.describe(node)}, but no attention reading it was "
            "recognised (understood: aten.scaled_dot_product_attention, and eager "
            "matmul(softmax(q @ k^T * scale + mask), v)): left dense",
            PASS_NAME,
        )
        value = node.args[3] if isinstance(node.args[3], fx.Node) else node
        sites.append(
            KVWriteSite(
                "", "unsupported", value, node, report, write=node, buffer=buffer, blocker=report.reason
            )
        )
    return sites


def _experts_without_router(gm: fx.GraphModule, found: list[MoESite]) -> list[MoESite]:
    """Expert weights (module tensors under an `experts` module) in a layer where no router was
    matched: reported as skipped, so a routing the passes do not understand (e.g. PhiMoE's
    sparsemixer, which selects with max instead of top-k) is never left dense silently."""
    covered = {site.report.layer for site in found}
    blocks: dict[str, int | None] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr" or ".experts." not in f".{node.target}.":
            continue
        dotted = f".{node.target}."
        block = dotted[1 : dotted.index(".experts.")]  # "" for experts at the root
        blocks.setdefault(block, m.layer_of(block))
    sites = []
    for block, layer in blocks.items():
        if (
            layer in covered
            if layer is not None
            else any(s.report.module_path.startswith(block) for s in found)
        ):
            continue
        report = SiteReport(
            KIND_MOE, -1 if layer is None else layer, block, "experts without a recognised router"
        )
        sites.append(
            _blocked(
                MoESite(report=report),
                f"expert weights under {block + '.' if block else ''}experts, but no router feeding "
                "them was recognised (understood: softmax then top-k; top-k of the logits then "
                "softmax; sigmoid scores with a choice bias or group limit and the scores gathered "
                "as weights): left as the model computes it",
            )
        )
    return sites


def run(ctx):
    """Pass entry point: store the analysis on the context for the rewrites that follow."""
    from ._context import PassResult

    ctx.sites = find_sites(ctx.gm)
    notes = [
        f"{len(ctx.sites.attention)} attention, {len(ctx.sites.kv)} K/V cache, {len(ctx.sites.moe)} MoE sites"
    ]
    skipped = [r for r in ctx.sites.reports() if r.status == "skipped"]
    return PassResult(changed=False, decided=skipped, notes=notes)


def _layer(path: str, ordinal: dict[str, int], kind: str) -> int:
    index = ordinal[kind]
    ordinal[kind] += 1
    from_path = m.layer_of(path)
    return from_path if from_path is not None else index


# ----------------------------------------------------------------------------------------------
# attention


def _match_attention(gm: fx.GraphModule, node: fx.Node) -> AttentionSite | None:
    if m.is_op(node, aten.scaled_dot_product_attention):
        return _match_sdpa(gm, node)
    if m.is_op(node, aten.matmul, aten.bmm):
        return _match_eager(gm, node)
    if node.op == "call_function":
        name = str(getattr(node.target, "__name__", node.target))
        if any(op in name for op in _OTHER_ATTENTION_OPS):
            report = SiteReport(KIND_ATTENTION, -1, m.module_path(node), name, nodes={"attention": node.name})
            report.skip(
                f"attention variant {name} is not supported (expected aten.scaled_dot_product_attention "
                "or eager matmul/softmax/matmul; capture before decompositions)",
                PASS_NAME,
            )
            return AttentionSite(node=node, variant=name, report=report, blocker=report.reason)
    return None


def _match_sdpa(gm: fx.GraphModule, node: fx.Node) -> AttentionSite:
    q, k_arg, v_arg = node.args[:3]
    mask = m.arg(node, 3, "attn_mask")
    dropout = m.arg(node, 4, "dropout_p", 0.0)
    is_causal = m.arg(node, 5, "is_causal", False)
    scale = node.kwargs.get("scale")
    report = SiteReport(KIND_ATTENTION, -1, m.module_path(node), "sdpa", nodes={"attention": node.name})
    site = AttentionSite(node=node, variant="sdpa", report=report, q=q, scale=scale)
    blockers = []
    if dropout not in (0, 0.0):
        blockers.append(f"dropout_p={dropout} (training graph)")
    bool_mask, mask_reason = _bool_mask(mask)
    site.mask = bool_mask
    if mask_reason:
        blockers.append(mask_reason)
    if is_causal:
        blockers.append(
            "is_causal=True over a cache: its alignment depends on the cache length, not positions"
        )
    _attach_kv(gm, site, ((k_arg, node), (v_arg, node)), blockers)
    site.blocker = "; ".join(blockers) or None
    if site.blocker:
        report.skip(site.blocker, PASS_NAME)
    return site


def _match_eager(gm: fx.GraphModule, pv: fx.Node) -> AttentionSite | None:
    """matmul(softmax(q @ k^T * scale + mask), v) as HF's eager attention writes it; also with the
    softmax's input shifted by its own row max, and with learned sink logits (gpt-oss: the softmax
    runs over cat(scores, sinks) and the sinks' column is sliced off), whose [Hq] source the site
    keeps for the op (any other sink column is skipped with the reason)."""
    probs = pv.args[0]
    # softmax -> [slice off the sink column] -> [to] -> [dropout] -> [clone] -> matmul
    while m.is_op(probs, *m.CAST_OPS, aten.dropout, aten.clone, aten.contiguous):
        if m.is_op(probs, aten.dropout) and m.arg(probs, 1, "p", 0.0) not in (0, 0.0):
            return None
        probs = probs.args[0]
    sink_column = _drops_last_column(probs)
    if sink_column:
        probs = probs.args[0]
    if not m.is_op(probs, aten.softmax, aten._softmax):
        return None
    scores = _unshifted(m.strip_casts(probs.args[0]))
    sinks = None
    if sink_column:  # the softmax must run over cat([scores, sinks], -1), a column of sinks last
        if not (m.is_op(scores, aten.cat) and len(scores.args[0]) == 2 and _is_last_dim(scores)):
            return None
        scores, sinks = scores.args[0]
    scores = m.strip_casts(scores)
    additive_mask = None
    if m.is_op(scores, aten.add):
        scores, additive_mask = scores.args[0], scores.args[1]
    scale = None
    if m.is_op(scores, aten.mul) and isinstance(scores.args[1], (int, float)):
        scores, scale = scores.args[0], float(scores.args[1])
    elif m.is_op(scores, aten.div) and isinstance(scores.args[1], (int, float)):
        scores, scale = scores.args[0], 1.0 / float(scores.args[1])
    if not m.is_op(scores, aten.matmul, aten.bmm):
        return None
    q, kt = scores.args[0], scores.args[1]
    if not (m.is_op(kt, aten.transpose) and {kt.args[1] % 4, kt.args[2] % 4} == {2, 3}):
        return None
    k_arg = kt.args[0]
    report = SiteReport(KIND_ATTENTION, -1, m.module_path(pv), "eager", nodes={"attention": pv.name})
    site = AttentionSite(node=pv, variant="eager", report=report, q=q, scale=scale)
    blockers = []
    if sinks is not None:
        site.sinks, sink_reason = _sink_logit_source(sinks, m.shape(q))
        if sink_reason:
            blockers.append(sink_reason)
    if scale is None:
        blockers.append("eager attention without a recognisable constant score scale")
    bool_mask, mask_reason = _bool_mask_from_additive(additive_mask)
    site.mask = bool_mask
    if mask_reason:
        blockers.append(mask_reason)
    _attach_kv(gm, site, ((k_arg, kt), (pv.args[1], pv)), blockers)
    site.blocker = "; ".join(blockers) or None
    if site.blocker:
        report.skip(site.blocker, PASS_NAME)
    return site


def _sink_logit_source(column: fx.Node, q_shape: tuple[int, ...] | None) -> tuple[fx.Node | None, str | None]:
    """The [Hq] tensor of learned logits that the softmax's extra column [B, Hq, Tq, 1] broadcasts,
    as gpt-oss writes it: sinks.reshape(1, -1, 1, 1).expand(B, -1, Tq, -1), casts anywhere; else
    (None, why). Any other source could vary along the batch or the new tokens, which the op's one
    logit per head cannot express."""
    hq = q_shape[1] if q_shape and len(q_shape) == 4 else None
    unsupported = (
        f"learned attention sinks ({m.describe(column)}) not broadcast from one logit per query head "
        "(expected sinks.reshape(1, Hq, 1, 1).expand(B, Hq, Tq, 1), as gpt-oss)"
    )
    if hq is None or m.shape(column) != (q_shape[0], hq, q_shape[2], 1):
        return None, unsupported
    node = m.strip_casts(column)
    if m.is_op(node, aten.expand):
        node = m.strip_casts(node.args[0])
    if not (m.is_op(node, aten.view, aten.reshape, aten._unsafe_view) and m.shape(node) == (1, hq, 1, 1)):
        return None, unsupported
    source = m.strip_casts(node.args[0])
    dtype = m.dtype(source)
    if m.shape(source) != (hq,) or dtype is None or not dtype.is_floating_point:
        return None, unsupported
    return source, None


def _is_last_dim(node: fx.Node) -> bool:
    """Whether a cat or slice node works along its tensor's last dim."""
    dim = m.arg(node, 1, "dim", 0)
    rank = len(m.shape(node) or ())
    return isinstance(dim, int) and rank > 0 and dim % rank == rank - 1


def _drops_last_column(node: object) -> bool:
    """x[..., :-1]: a slice of the last dim from 0 to one before its end, step 1."""
    if not m.is_op(node, aten.slice) or not _is_last_dim(node):
        return False
    source = m.shape(node.args[0])
    start, end, step = m.arg(node, 2, "start", 0), m.arg(node, 3, "end", None), m.arg(node, 4, "step", 1)
    return bool(source) and start in (0, None) and step == 1 and end in (-1, source[-1] - 1)


def _unshifted(x: object) -> object:
    """x - max(x, -1, keepdim=True) -> x: softmax is unchanged by the shift, so the scores are x."""
    if not (m.is_op(x, aten.sub) and isinstance(x.args[1], fx.Node)):
        return x
    source, shift = x.args[0], x.args[1]
    if m.is_getitem(shift, 0):
        shift = shift.args[0]
    if not (m.is_op(shift, aten.max, aten.amax) and shift.args[0] is source):
        return x
    dim, keepdim = m.arg(shift, 1, "dim", None), m.arg(shift, 2, "keepdim", False)
    rank = len(m.shape(source) or ())
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if keepdim and rank and len(dims) == 1 and isinstance(dims[0], int) and dims[0] % rank == rank - 1:
        return source
    return x


def _bool_mask(mask: object) -> tuple[fx.Node | None, str]:
    if mask is None:
        return None, "no attention mask: a static cache would expose unwritten slots"
    if not isinstance(mask, fx.Node) or m.dtype(mask) != torch.bool:
        return None, f"attention mask is not boolean (dtype {m.dtype(mask)}); expected True = attend"
    return mask, ""


def _bool_mask_from_additive(mask: object) -> tuple[fx.Node | None, str]:
    """HF eager: where(bool_mask, 0, finfo.min) added to the scores."""
    if mask is None:
        return None, "no attention mask: a static cache would expose unwritten slots"
    node = m.strip_views(mask) if isinstance(mask, fx.Node) else mask
    if m.is_op(node, aten.slice):  # HF slices the mask to the key length
        node = m.strip_views(node.args[0])
    if m.is_op(node, aten.where):
        cond, keep, drop = node.args[0], node.args[1], node.args[2]
        keep_zero = m.is_op(keep, aten.zeros, aten.zeros_like, aten.scalar_tensor) or keep in (0, 0.0)
        if keep_zero and isinstance(drop, float) and drop <= -1e30:
            return cond, ""
    return None, "additive attention mask is not where(bool_mask, 0, -inf/min)"


def _attach_kv(
    gm: fx.GraphModule,
    site: AttentionSite,
    operands: tuple[tuple[object, fx.Node], tuple[object, fx.Node]],
    blockers: list[str],
) -> None:
    """operands: ((K operand, node consuming it), (V operand, node consuming it))."""
    n_reps = []
    for role, (operand, consumer) in zip(("K", "V"), operands, strict=True):
        source, n_rep = (
            m.strip_repeat_kv(m.strip_views(operand)) if isinstance(operand, fx.Node) else (None, 1)
        )
        if source is not None:
            source = m.strip_views(source)
        n_reps.append(n_rep)
        kv = _classify_kv(gm, role, source, site, operand, consumer)
        setattr(site, role.lower(), kv)
        if kv.blocker:
            blockers.append(f"{role}: {kv.blocker}")
    site.n_rep = n_reps[0]
    if n_reps[0] != n_reps[1]:
        blockers.append(f"K and V repeated differently ({n_reps[0]} vs {n_reps[1]})")
    k, v = site.k, site.v
    if k and v and k.index is not None and v.index is not None:
        if not m.structurally_equal(m.strip_views(k.index), m.strip_views(v.index)):
            blockers.append("K and V caches are written at different positions")
    if site.mask is not None and k is not None and k.cache_kind == "static" and k.index is not None:
        reason, site.window = _check_causal_mask(site.mask, k)
        if reason:
            blockers.append(reason)


def _classify_kv(
    gm: fx.GraphModule,
    role: str,
    source: fx.Node | None,
    site: AttentionSite,
    operand: object,
    consumer: fx.Node,
) -> KVWriteSite:
    path = m.module_path(site.node)
    report = SiteReport(KIND_KV, -1, path, f"{role} cache", nodes={"attention": site.node.name})
    if source is None:
        report.detail = f"{role} (operand is not a tensor node)"
        report.skip("attention operand is a constant", PASS_NAME)
        return KVWriteSite(role, "unsupported", site.node, site.node, report, blocker=report.reason)
    write = source
    kv = KVWriteSite(role, "none", source, source, report)
    if source.op == "get_attr":
        # Traced graphs read a cache after its in-place write through the write's result; a
        # direct read of the buffer node has no write ordered before it in the dataflow.
        kv.cache_kind = "unsupported"
        report.detail = f"{role} cache read directly"
        kv.blocker = (
            f"attention reads buffer {source.target} directly, not the result of a cache write; "
            "expected index_copy_(cache, 2, positions, k) feeding the attention"
        )
        report.skip(kv.blocker, PASS_NAME)
        return kv
    if m.is_op(write, aten.index_copy_, aten.index_copy):
        kv.cache_kind, kv.write = "static", write
        buffer, dim, index, value = write.args[:4]
        kv.buffer, kv.index, kv.value = buffer, index, value
        report.module_path = m.module_path(write) or path
        report.detail = f"{role} static cache"
        report.nodes.update(write=write.name, cache=str(getattr(buffer, "target", buffer)))
        kv.blocker = _static_write_blocker(gm, kv, dim, site, operand, consumer)
    elif m.is_op(write, aten.cat) and m.arg(write, 1, "dim", 0) in (-2, 2) and len(write.args[0]) >= 2:
        kv.cache_kind, kv.write = "dynamic", write
        past, new = write.args[0][0], write.args[0][-1]
        kv.value = new
        report.detail = f"{role} dynamic cache"
        report.nodes.update(write=write.name, past=getattr(past, "name", str(past)))
        kv.blocker = (
            "DynamicCache (cat along the sequence dim, cache passed in and out as graph inputs/outputs): "
            "the compressed cache needs preallocated module buffers; capture with a static cache "
            "(wmoe_compile.prepare(model, batch_size=..., max_cache_len=...))"
        )
    elif m.is_op(write, aten.index_put_, aten.index_put, aten.copy_, aten.slice_scatter):
        kv.cache_kind = "unsupported"
        report.detail = f"{role} cache written by {m.describe(write)}"
        kv.blocker = f"cache written with {m.describe(write)}; only index_copy_ along dim 2 is understood"
    elif upstream := _cache_writes_upstream(source):
        cached = upstream[0]
        kv.cache_kind = "unsupported"
        # every cache this operand is computed from is accounted for here, not reported again as
        # read by no attention
        kv.write, kv.upstream_writes = cached, tuple(upstream)
        report.detail = f"{role} computed from a cache"
        caches = ", ".join(str(getattr(w.args[0], "target", w.args[0])) for w in upstream)
        kv.blocker = (
            f"attention's {role} is computed from cache {caches} "
            "(e.g. multi-head latent attention, which caches a latent and expands it to K/V by a "
            "projection every step); only a cache of the K/V the attention reads is compressed"
        )
    else:
        report.detail = f"{role} without cache"
        kv.blocker = "no KV cache: attention reads K/V straight from the projection"
    projection, why = m.find_projection(kv.value)
    kv.projection = projection
    if projection is not None:
        report.nodes["projection"] = projection.name
    elif kv.blocker is None:
        kv.blocker = why
    if kv.blocker:
        report.skip(kv.blocker, PASS_NAME)
    return kv


def _static_write_blocker(
    gm: fx.GraphModule, kv: KVWriteSite, dim, site: AttentionSite, operand: object, consumer: fx.Node
) -> str | None:
    buffer, value, index = kv.buffer, kv.value, kv.index
    if m.is_op(kv.write, aten.index_copy):
        return "functional index_copy (functionalized graph): rewrite needs the in-place buffer write"
    if not isinstance(buffer, fx.Node) or buffer.op != "get_attr":
        kind = getattr(buffer, "op", type(buffer).__name__)
        return (
            f"cache is a graph input ({kind}), not a module buffer: capture with torch.export and pass "
            "ExportedProgram.module() (or use wmoe_compile.export)"
        )
    if m.get_attr_tensor(gm, buffer) is None:
        return f"cache buffer {buffer.target} not found on the module"
    cache_shape, value_shape, q_shape = m.shape(buffer), m.shape(value), m.shape(site.q)
    if cache_shape is None or value_shape is None or len(cache_shape) != 4:
        return f"cache shape {cache_shape} is not static 4-D [B, Hkv, S, D]"
    dim = dim % 4 if isinstance(dim, int) else dim
    if dim != 2:
        return (
            f"unusual cache layout: written along dim {dim} of {list(cache_shape)}; the compressed "
            "cache expects [B, Hkv, S, D] written along dim 2"
        )
    if q_shape is not None and (len(q_shape) != 4 or q_shape[-1] != cache_shape[-1]):
        return f"query shape {q_shape} does not match the cache head_dim {cache_shape[-1]}"
    if len(value_shape) != 4 or value_shape[:2] != cache_shape[:2] or value_shape[3] != cache_shape[3]:
        return f"written tensor {list(value_shape)} does not fit cache {list(cache_shape)}"
    index_shape = m.shape(index)
    if index_shape is None or len(index_shape) != 1 or m.dtype(index) not in (torch.int64, torch.int32):
        return f"cache positions must be an int tensor [T], got {index_shape} {m.dtype(index)}"
    # Every reader of the cache other than this attention would see compressed data or nothing.
    readers = _cache_readers(kv, operand, consumer) if isinstance(operand, fx.Node) else []
    if readers:
        names = ", ".join(m.describe(r) for r in readers)
        return f"cache {buffer.target} is also read by {names}; compressing it would change that reader"
    return None


def _cache_readers(kv: KVWriteSite, operand: fx.Node, consumer: fx.Node) -> list[fx.Node]:
    """Uses of the cache (buffer, written result, or views of it on the way to the attention)
    other than this write and the attention consumer."""
    chain: set[fx.Node] = set()
    node = operand
    while isinstance(node, fx.Node) and node is not kv.write and node is not kv.buffer:
        chain.add(node)
        node = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if node is None:  # the operand does not lead back to this write: treat nothing as on the path
        chain = set()
    readers = []
    buffers = [n for n in kv.buffer.graph.nodes if n.op == "get_attr" and n.target == kv.buffer.target]
    for holder in [*buffers, kv.write, *chain]:
        for user in holder.users:
            if user is kv.write or user in chain or user is consumer:
                continue
            readers.append(user)
    return readers


def _cache_writes_upstream(node: fx.Node, limit: int = 64) -> list[fx.Node]:
    """The cache writes (index_copy_) among the nearest `limit` ancestors of `node`, nearest first.
    Ancestors include what in-place writes into a tensor read (DeepSeek builds K by copy_ into the
    slices of a new_empty). The walk does not cross another attention, so an earlier layer's cache
    on the residual stream does not count."""
    seen, frontier, writes = {node}, [node], []
    while frontier and len(seen) < limit:
        current = frontier.pop(0)
        if m.is_op(current, aten.index_copy_, aten.index_copy):
            writes.append(current)
            continue
        if current is not node and "attention" in str(current.target):
            continue
        parents = list(current.all_input_nodes)
        parents += [w for w in m.mutations(current) if w is not current]
        for parent in parents:
            if parent not in seen:
                seen.add(parent)
                frontier.append(parent)
    return writes


def _mask_conjuncts(node: object) -> list[object]:
    """The terms of a chain of boolean ANDs (through views and casts), else [node]."""
    node = m.strip_views(node) if isinstance(node, fx.Node) else node
    while m.is_op(node, *m.CAST_OPS):
        node = m.strip_views(node.args[0])
    if m.is_op(node, aten.__and__, aten.bitwise_and, aten.logical_and) and len(node.args) == 2:
        return _mask_conjuncts(node.args[0]) + _mask_conjuncts(node.args[1])
    return [node]


def _is_all_true(node: object) -> bool:
    """A tensor of ones (HF's placeholder for "no padding"), or the constant True."""
    return node is True or (m.is_op(node, aten.new_ones, aten.ones, aten.ones_like))


def _sliding_window(term: object, k: KVWriteSite) -> int | float | None:
    """W when `term` is `slot > position - W` (or `position - W < slot`) over the cache slots,
    with the positions the cache write uses and a constant W; else None."""
    if m.is_op(term, aten.gt):
        slots, bound = term.args[0], term.args[1]
    elif m.is_op(term, aten.lt):
        bound, slots = term.args[0], term.args[1]
    else:
        return None
    bound = m.strip_views(bound) if isinstance(bound, fx.Node) else bound
    if not (m.is_op(bound, aten.sub) and isinstance(bound.args[1], (int, float))):
        return None
    capacity = m.shape(k.buffer)[2]
    if (
        isinstance(slots, fx.Node)
        and m.is_arange_from_zero(slots, capacity)
        and m.structurally_equal(m.strip_views(bound.args[0]), m.strip_views(k.index))
    ):
        return bound.args[1]
    return None


def _check_causal_mask(mask: fx.Node, k: KVWriteSite) -> tuple[str | None, int]:
    """The mask must be `slot <= position` over the cache slots, with the positions the cache
    write uses (so seq_lens = last position + 1 describes it exactly). ANDed with it may be an
    all-true padding mask and one sliding window `slot > position - W` (W returned when shorter
    than the cache; one at least as long masks nothing: Mistral-style configs whose window exceeds
    max_cache_len). Returns (why the mask is not that, or None; W or 0)."""
    capacity = m.shape(k.buffer)[2]
    terms = [t for t in _mask_conjuncts(mask) if not _is_all_true(t)]
    window = 0
    if len(terms) > 1:
        windows = [(t, _sliding_window(t, k)) for t in terms]
        short = [w for _, w in windows if w is not None and w < capacity]
        short = [int(w) if isinstance(w, float) and w.is_integer() else w for w in short]
        if len(short) > 1 or any(not isinstance(w, int) or w < 1 for w in short):
            return (
                f"sliding-window mask: windows {short} (one window of a whole number of tokens expected)",
                0,
            )
        window = short[0] if short else 0
        # (positions < capacity <= W: such a window term lets through every slot the causal one does)
        terms = [t for t, w in windows if w is None]
    return _check_causal_term(mask, terms, k, capacity), window


def _check_causal_term(mask: fx.Node, terms: list, k: KVWriteSite, capacity: int) -> str | None:
    """Why the mask's remaining term is not `slot <= position` over the cache's slots, or None."""
    node = m.strip_views(terms[0] if len(terms) == 1 and isinstance(terms[0], fx.Node) else mask)
    if m.is_op(node, aten.le):
        slots, positions = node.args[0], node.args[1]
    elif m.is_op(node, aten.ge):
        positions, slots = node.args[0], node.args[1]
    else:
        return (
            f"attention mask is {m.describe(node)}, not a plain causal mask `slot <= position` "
            "(padding or sliding-window masks are not supported)"
        )
    if not isinstance(slots, fx.Node) or not m.is_arange_from_zero(slots, capacity):
        return f"attention mask does not compare cache slots arange({capacity}) with positions"
    slot_shape, mask_shape = m.shape(slots), m.shape(node)
    if slot_shape is None or mask_shape is None or slot_shape[-1] != capacity or mask_shape[-1] != capacity:
        return "attention mask does not run over the cache slots on its last dim"
    if not isinstance(positions, fx.Node) or not m.structurally_equal(
        m.strip_views(positions), m.strip_views(k.index)
    ):
        return "attention mask positions are not the positions written to the cache"
    return None


# ----------------------------------------------------------------------------------------------
# MoE


def _match_moe(gm: fx.GraphModule, topk: fx.Node) -> MoESite | None:
    """A router's top-k and the experts its ids and weights feed, or None when `topk` is no router.

    Three scorings: softmax (Mixtral, Qwen: the weights are the top-k values, maybe
    renormalised); top-k of the logits, then softmax over the k values (Granite, JetMoE: the
    same weights as renormalised softmax top-k); and sigmoid (DeepSeek-V3 style: the experts are
    chosen on the scores plus a per-expert bias, maybe only within the best expert groups, and
    the weights are the scores gathered at the chosen ids, maybe renormalised and scaled).
    Either way the graph keeps computing the ids and weights; only the experts they feed are
    replaced, so how the choice is made does not matter as long as the ids and weights are found."""
    getitems = {u.args[1]: u for u in topk.users if m.is_getitem(u)}
    values, ids = getitems.get(0), getitems.get(1)
    if ids is None:
        return None
    scores = _router_scores(topk.args[0])
    softmax_after = None
    if scores is not None:
        gathered = _gathered_at(scores, ids)
        logits = m.strip_casts(scores.args[0])
        scoring = "sigmoid" if m.is_op(scores, aten.sigmoid) else "softmax"
    else:  # top-k of the raw logits
        gathered, logits = None, m.strip_casts(topk.args[0])
        softmax_after = _softmax_of(values)
        scoring = "top-k logits, then softmax"
    router_weight = m.linear_weight(logits) if isinstance(logits, fx.Node) else None
    if isinstance(router_weight, fx.Node):  # routers of bf16 models cast their weight to fp32
        router_weight = m.strip_views(m.strip_casts(router_weight))
    if router_weight is None or not m.is_param_like(router_weight):
        return None
    report = SiteReport(
        KIND_MOE, -1, m.module_path(topk), f"top-k router ({scoring})", nodes={"router": logits.name}
    )
    site = MoESite(report=report, top_k=m.int_scalar(topk.args[1]) or 0)
    site.topk_ids = ids
    weight_shape = m.shape(router_weight)
    site.num_experts = weight_shape[0] if weight_shape else 0
    # the experts read the hidden states the router's linear reads, before any cast to fp32
    # (DeepSeek-V3 routes in fp32); the expert verification below checks this choice
    hidden = m.strip_casts(m.linear_input(logits))
    site.hidden = hidden
    report.nodes.update(topk=topk.name, hidden=hidden.name)
    if scores is not None and scoring == "softmax" and m.arg(scores, 1, "dim", -1) not in (-1, 1):
        return _blocked(site, "router softmax not over the expert dim")
    if m.arg(topk, 2, "dim", -1) not in (-1, 1):
        return _blocked(site, "router topk not over the expert dim")
    if not m.arg(topk, 3, "largest", True):
        return _blocked(site, "topk(largest=False) is not a router")
    if scores is None and softmax_after is None:
        return _blocked(
            site, "routing weights not found: top-k of the raw router logits, not softmaxed after"
        )
    if (
        scores is not None
        and gathered is None
        and (values is None or m.strip_casts(topk.args[0]) is not scores)
    ):
        return _blocked(
            site,
            "routing weights not found: the top-k ran over biased or masked scores, and no "
            "scores.gather(-1, ids) of the router's scores gives the weights",
        )
    site.topk_weights = _routing_weights(
        softmax_after if softmax_after is not None else gathered if gathered is not None else values
    )
    report.nodes["topk_weights"] = site.topk_weights.name
    hidden_shape = m.shape(hidden)
    if hidden_shape is None or len(hidden_shape) != 2:
        return _blocked(site, f"router input is not a static [tokens, hidden] matrix (shape {hidden_shape})")
    try:
        with torch.no_grad():
            _match_experts(gm, site)
    except Exception as exc:  # noqa: BLE001 - any failure to evaluate means "not understood"
        site.blocker = f"expert computation could not be verified: {type(exc).__name__}: {exc}"
    if site.blocker:
        report.skip(site.blocker, PASS_NAME)
    else:
        report.detail += f"; {scoring} router"
    return site


def _router_scores(choice: fx.Node) -> fx.Node | None:
    """The softmax or sigmoid of the router logits that a top-k's input is made from: the scores
    themselves, or (sigmoid routers) the scores plus a per-expert bias, with experts outside the
    chosen groups masked off. None when the input is anything else."""
    node = m.strip_casts(choice)
    for _ in range(4):
        if m.is_op(node, aten.softmax, aten._softmax, aten.sigmoid):
            return node
        if m.is_op(node, aten.masked_fill):  # experts of groups not chosen
            node = m.strip_casts(node.args[0])
        elif m.is_op(node, aten.add) and len(node.args) == 2 and _is_expert_bias(node.args[1], node):
            node = m.strip_casts(node.args[0])
        else:
            return None
    return None


def _is_expert_bias(bias: object, add: fx.Node) -> bool:
    """A module tensor of one value per expert, broadcast over the tokens (DeepSeek-V3's
    e_score_correction_bias: it steers the choice, not the weights; ERNIE 4.5 keeps it as [1, E]
    and squeezes it)."""
    bias = m.strip_casts(bias)
    source = m.strip_views(bias) if isinstance(bias, fx.Node) else bias
    bias_shape, source_shape, out_shape = m.shape(bias), m.shape(source), m.shape(add)
    return (
        m.is_param_like(source)
        and bias_shape is not None
        and source_shape is not None
        and out_shape is not None
        and (len(bias_shape) == 1 and bias_shape[0] == out_shape[-1])
        and math.prod(source_shape) == bias_shape[0]
    )


def _softmax_of(values: fx.Node | None) -> fx.Node | None:
    """A softmax over the last dim of the top-k values (through casts), else None."""
    frontier = [values] if values is not None else []
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if m.is_op(user, aten.softmax, aten._softmax) and m.arg(user, 1, "dim", -1) in (
                -1,
                len(m.shape(node) or ()) - 1,
            ):
                return user
            if m.is_op(user, *m.CAST_OPS):
                frontier.append(user)
    return None


def _gathered_at(scores: fx.Node, ids: fx.Node) -> fx.Node | None:
    """`scores.gather(-1, ids)`: the weights of a router that chose its experts on other values."""
    for user in ids.users:
        if (
            m.is_op(user, aten.gather)
            and user.args[2] is ids
            and m.strip_casts(user.args[0]) is scores
            and user.args[1] in (-1, len(m.shape(scores) or ()) - 1)
        ):
            return user
    return None


def _blocked(site: MoESite, reason: str) -> MoESite:
    site.blocker = reason
    site.report.skip(reason, PASS_NAME)
    return site


def _routing_weights(values: fx.Node) -> fx.Node:
    """Follow the routing weights (top-k values, or scores gathered at the ids) through
    renormalisation (w / w.sum(-1), maybe plus an epsilon), a constant scale (DeepSeek's
    routed_scaling_factor) and casts, to the node the experts read."""
    node = values
    for _ in range(8):
        users = list(node.users)
        step = next(
            (
                u
                for u in users
                if m.is_op(u, aten.div, aten.div_) and u.args[0] is node and _is_sum_of(u.args[1], node)
            ),
            None,
        ) or next(
            (
                u
                for u in users
                if m.is_op(u, aten.mul, aten.mul_)
                and u.args[0] is node
                and isinstance(u.args[1], (int, float))
                and not isinstance(u.args[1], bool)
            ),
            None,
        )
        if step is not None:
            node = step
            continue
        if len(users) == 1 and m.is_op(users[0], *m.CAST_OPS):
            node = users[0]
            continue
        break
    return node


def _is_sum_of(denominator: object, node: fx.Node) -> bool:
    """`node.sum(-1, keepdim=True)`, or that plus a constant epsilon, or clamped to at least one
    (ERNIE 4.5's moe_norm_min)."""
    if m.is_op(denominator, aten.add) and isinstance(denominator.args[1], (int, float)):
        denominator = denominator.args[0]
    elif m.is_op(denominator, aten.clamp_min) and isinstance(denominator.args[1], (int, float)):
        denominator = denominator.args[0]
    elif (
        m.is_op(denominator, aten.clamp)
        and isinstance(m.arg(denominator, 1, "min"), (int, float))
        and m.arg(denominator, 2, "max") is None
    ):
        denominator = denominator.args[0]
    return m.is_op(denominator, aten.sum) and denominator.args[0] is node


def _hidden_aliases(hidden: fx.Node) -> set[fx.Node]:
    """`hidden` and the other views of the same tensor with its [N, H] shape (HF reshapes the
    block's [B, T, H] input once for the router and again for the experts)."""
    view_ops = (aten.view, aten.reshape, aten._unsafe_view, aten.contiguous, aten.alias)
    target = m.shape(hidden)
    root = hidden
    while m.is_op(root, *view_ops) and isinstance(root.args[0], fx.Node):
        root = root.args[0]
    aliases, seen, frontier = {hidden}, {root}, [root]
    while frontier:
        node = frontier.pop()
        if m.shape(node) == target:
            aliases.add(node)
        for user in node.users:
            if user not in seen and m.is_op(user, *view_ops) and user.args[0] is node:
                seen.add(user)
                frontier.append(user)
    return aliases


def _closed_nodes(graph: fx.Graph, boundary: set[fx.Node]) -> set[fx.Node]:
    """Nodes computable from `boundary`, module attributes and constants alone."""
    closed: set[fx.Node] = set()
    for node in graph.nodes:
        if node in boundary or node.op == "get_attr" or (node.op == "placeholder" and m.is_param_like(node)):
            closed.add(node)
        elif node.op == "call_function" and all(i in closed for i in node.all_input_nodes):
            closed.add(node)
    return closed


def _descendants(start: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _match_experts(gm: fx.GraphModule, site: MoESite) -> None:
    hidden, ids, weights = site.hidden, site.topk_ids, site.topk_weights
    aliases = _hidden_aliases(hidden)
    boundary = aliases | {ids, weights}
    closed = _closed_nodes(gm.graph, boundary)
    from_hidden = set().union(*(_descendants(a) for a in aliases))
    reach = _descendants(weights) & _descendants(ids) & from_hidden
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    target_shape = m.shape(hidden)
    candidates = sorted(
        (
            n
            for n in reach & closed
            if m.shape(n) == target_shape and m.dtype(n) is not None and m.dtype(n).is_floating_point
        ),
        key=order.__getitem__,
    )
    if not candidates:
        site.blocker = "no [tokens, hidden] output computed from the hidden states and routing alone"
        return
    failures, regions = [], []
    for output in reversed(candidates[-4:]):
        region = _region(output, boundary)
        regions.append(region)
        lifted = [n.name for n in region if n.op == "placeholder"]
        if lifted:
            site.blocker = (
                f"expert weights are graph inputs ({', '.join(lifted[:3])}, ...: parameters lifted by "
                "export/AOTAutograd); the rewrite reads and packs them at compile time, so pass the "
                "ExportedProgram (or .module()), or freeze parameters"
            )
            return
        weight_nodes = [n for n in region if n.op == "get_attr"]
        layouts = _expert_layouts(gm, region, weight_nodes, site)
        if not layouts:
            failures.append(f"{output.name}: no expert weights in a known layout")
            continue
        # Two routings: random, and every token on the same experts (a dispatch with a
        # per-expert capacity would drop tokens there, and must not pass as a plain mixture).
        sample_sets = [_sample_inputs(hidden, ids, weights, site, concentrated=c) for c in (False, True)]
        results = [_evaluate_region(gm, region, output, samples) for samples in sample_sets]
        activations = _activation_candidates(region)
        for label, getter, bias_getter in layouts:
            w_gate, w_up, w_down = getter()
            biases = bias_getter() if bias_getter is not None else None
            for activation in activations:
                checks = list(zip(sample_sets, results, strict=True))
                if activation.clamp_limit is not None:  # the clamp must bite, or any limit passes
                    clamped = _past_the_limit(sample_sets[0], hidden, w_gate, w_up, biases, activation)
                    checks.append((clamped, _evaluate_region(gm, region, output, clamped)))
                err = max(
                    _rel_err(
                        got,
                        reference_moe(
                            sm[hidden], sm[ids], sm[weights], w_gate, w_up, w_down, biases, activation
                        ),
                    )
                    for sm, got in checks
                )
                name = label if activation.is_swiglu else f"{label}, {activation.describe()}"
                if err <= _tolerance(m.dtype(output)):
                    site.output, site.expert_weights = output, getter
                    site.expert_biases, site.activation = bias_getter, activation
                    # Label: the module around router and experts (the topk sits in the router).
                    site.report.module_path = (
                        m.common_module_path([site.topk_ids, output]) or site.report.module_path
                    )
                    site.weight_nodes = weight_nodes
                    site.report.detail = name
                    site.report.nodes.update(output=output.name, weights=f"{len(weight_nodes)} tensors")
                    return
                failures.append(f"{output.name} as {name}: relative error {err:.2e}")
    site.blocker = (
        "expert computation does not match a top-k SwiGLU mixture ("
        + "; ".join(failures[:4])
        + ")"
        + _unmatched_expert_parts(regions)
    )


def _unmatched_expert_parts(regions: list[list[fx.Node]]) -> str:
    """The biases and clamps the expert regions hold, as a clause for the skip reason: the
    mixture takes them only in the forms gpt-oss uses (a bias per expert projection; the gate
    clamped from above and the up projection on both sides at one limit)."""
    nodes = [n for region in regions for n in region]
    biases = sorted(
        {str(n.target).rsplit(".", 1)[-1] for n in nodes if n.op == "get_attr" and "bias" in str(n.target)}
    )
    clamps = sorted(
        {m.packet(n).__name__ for n in nodes if m.is_op(n, aten.clamp, aten.clamp_min, aten.clamp_max)}
    )
    parts = [f"expert biases ({', '.join(biases)})"] if biases else []
    parts += [f"clamped activations ({', '.join(clamps)})"] if clamps else []
    if not parts:
        return ""
    return (
        "; the experts have " + " and ".join(parts) + ", which matched none of the forms the fused "
        "experts take (a bias per projection; gate clamped from above, up on both sides at one limit)"
    )


def _region(output: fx.Node, boundary: set[fx.Node]) -> list[fx.Node]:
    """The nodes between `boundary` and `output`, in graph order (boundary nodes included)."""
    seen: set[fx.Node] = set()
    stack = [output]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in boundary:
            continue
        stack.extend(node.all_input_nodes)
    order = {n: i for i, n in enumerate(output.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def _tolerance(dtype: torch.dtype | None) -> float:
    # Relative Frobenius error allowed between the region and the closed-form mixture: rounding
    # of the compute dtype, with headroom for different summation order.
    eps = torch.finfo(dtype).eps if dtype is not None and dtype.is_floating_point else 1e-7
    return max(16 * eps, 1e-5)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def reference_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    biases: ExpertBiases | None = None,
    activation: ExpertActivation | None = None,
) -> torch.Tensor:
    """sum_k w[n,k] * (W_down[e] act(W_gate[e] x + b_gate[e], W_up[e] x + b_up[e]) + b_down[e]),
    e = ids[n,k]; act is silu(gate) * up unless `activation` says otherwise; in fp32."""
    b_gate, b_up, b_down = biases if biases is not None else (None, None, None)
    activation = activation or ExpertActivation()
    x = hidden.float()
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        xe = x[rows]
        gate, up = xe @ w_gate[e].float().T, xe @ w_up[e].float().T
        if b_gate is not None:
            gate = gate + b_gate[e].float()
        if b_up is not None:
            up = up + b_up[e].float()
        if activation.is_swiglu:
            act = F.silu(gate) * up
        else:
            act = activation.apply(gate, up)
        y = act @ w_down[e].float().T
        if b_down is not None:
            y = y + b_down[e].float()
        out.index_add_(0, rows, y * topk_weights[rows, slots, None].float())
    return out


def _float_scalar(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _activation_candidates(region: list[fx.Node]) -> list[ExpertActivation]:
    """SwiGLU, and before it the clamped form with the constants the region's nodes hold (gpt-oss:
    sigmoid(gate * alpha), clamp(gate, max=limit), clamp(up, -limit, limit), up + 1); which one
    the region computes is decided by evaluating it, not by these shapes."""
    alphas, limits, offsets = set(), set(), set()
    clamps = {n for n in region if m.is_op(n, aten.clamp, aten.clamp_min, aten.clamp_max)}
    for node in region:
        if m.is_op(node, aten.sigmoid) and m.is_op(node.args[0], aten.mul):
            scale = [_float_scalar(a) for a in node.args[0].args[:2]]
            alphas.update(v for v in scale if v is not None)
        elif node in clamps:
            bounds = [_float_scalar(a) for a in (*node.args[1:], *node.kwargs.values())]
            limits.update(abs(v) for v in bounds if v is not None)
        elif m.is_op(node, aten.add, aten.add_) and any(i in clamps for i in node.all_input_nodes):
            offsets.update(v for v in (_float_scalar(a) for a in node.args[1:2]) if v is not None)
    if not (alphas or limits or offsets):
        return [ExpertActivation()]
    forms = itertools.product(sorted(alphas) or [1.0], sorted(limits) or [None], sorted(offsets) or [0.0])
    candidates = [ExpertActivation(a, c, o) for a, c, o in itertools.islice(forms, 8)]
    return [c for c in candidates if not c.is_swiglu] + [ExpertActivation()]


def _sample_inputs(
    hidden: fx.Node, ids: fx.Node, weights: fx.Node, site: MoESite, *, concentrated: bool
) -> dict[fx.Node, torch.Tensor]:
    """Random hidden states and routing weights; distinct expert ids per token, drawn at random
    or (concentrated) the same k experts for every token."""
    gen = torch.Generator().manual_seed(1234 + concentrated)
    n_tokens, width = m.shape(hidden)
    k, experts = m.shape(ids)[-1], site.num_experts
    device = m.val(hidden).device
    x = torch.randn(n_tokens, width, generator=gen).to(device=device, dtype=m.dtype(hidden))
    if concentrated:
        chosen = torch.randperm(experts, generator=gen)[:k].expand(n_tokens, k).contiguous()
    else:
        chosen = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(n_tokens)])
    w = torch.rand(n_tokens, k, generator=gen) + 0.1
    w = (w / w.sum(-1, keepdim=True)).to(device=device, dtype=m.dtype(weights))
    samples = {n: x for n in _hidden_aliases(hidden)}
    samples[ids] = chosen.to(device=device, dtype=m.dtype(ids))
    samples[weights] = w
    return samples


def _past_the_limit(
    samples: dict[fx.Node, torch.Tensor],
    hidden: fx.Node,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    biases: ExpertBiases | None,
    activation: ExpertActivation,
) -> dict[fx.Node, torch.Tensor]:
    """`samples` with the hidden states scaled so that the gate and up projections' median
    magnitude is four times the clamp limit: about half of them lie past it on either side, so a
    reading with the wrong limit, or clamps on the wrong sides, differs from the region."""
    del biases  # not scaled; the scaled projections dwarf them
    x = samples[hidden].float()
    typical = min(float(torch.einsum("nh,efh->enf", x, w.float()).abs().median()) for w in (w_gate, w_up))
    scale = max(1.0, 4.0 * activation.clamp_limit / max(typical, 1e-30))
    scaled = dict(samples)
    x_scaled = (x * scale).to(samples[hidden].dtype)
    for node, value in samples.items():
        if value is samples[hidden]:
            scaled[node] = x_scaled
    return scaled


def _evaluate_region(
    gm: fx.GraphModule, region: list[fx.Node], output: fx.Node, samples: dict[fx.Node, torch.Tensor]
) -> torch.Tensor:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs = []
    for node in region:
        if node in samples:
            env[node] = graph.placeholder(f"in_{node.name}")
            inputs.append(samples[node])
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[output])
    sub = fx.GraphModule(gm, graph)
    with torch.no_grad():
        return sub(*inputs)


Layout = tuple[str, Callable[[], ExpertWeights], Callable[[], ExpertBiases] | None]


def _expert_layouts(
    gm: fx.GraphModule, region: list[fx.Node], weight_nodes: list[fx.Node], site: MoESite
) -> list[Layout]:
    """Candidate readings of the region's weights as (w_gate [E,F,H], w_up [E,F,H], w_down [E,H,F]),
    each with a reading of its biases (None: no biases)."""
    experts = site.num_experts
    width = m.shape(site.hidden)[1]
    tensors = {n: m.get_attr_tensor(gm, n) for n in weight_nodes}
    layouts: list[Layout] = []
    per_expert = _per_expert_triples(region, site)
    if per_expert is not None:
        triples = [(tensors[a], tensors[b], tensors[c]) for a, b, c in per_expert]
        layouts.append(
            (
                "per-expert SwiGLU linears (dense masked loop)",
                lambda: tuple(torch.stack(ws) for ws in zip(*triples, strict=True)),
                None,
            )
        )
        return layouts
    stacked = [n for n, t in tensors.items() if t is not None and t.dim() == 3 and t.shape[0] == experts]
    if len(stacked) != 2:
        return layouts
    # per-expert bias rows [E, 2F] (gate_up) and [E, H] (down), as gpt-oss's experts hold them
    rows = {n: t for n, t in tensors.items() if t is not None and t.dim() == 2 and t.shape[0] == experts}
    for gate_up_node, down_node in itertools.permutations(stacked):
        gate_up, down = tensors[gate_up_node], tensors[down_node]
        for down_t in (False, True):  # [E, H, F] (linear layout) or [E, F, H]
            w_down = down.transpose(1, 2) if down_t else down
            if w_down.shape[1] != width:
                continue
            ffn = w_down.shape[2]
            for gu_t in (False, True):  # [E, 2F, H] or [E, H, 2F]
                w_gu = gate_up.transpose(1, 2) if gu_t else gate_up
                if tuple(w_gu.shape[1:]) != (2 * ffn, width):
                    continue
                for split in ("concatenated", "interleaved"):
                    label = (
                        f"stacked experts: gate_up {list(gate_up.shape)} "
                        f"({'transposed, ' if gu_t else ''}{split}), down {list(down.shape)}"
                        f"{' (transposed)' if down_t else ''}"
                    )
                    getter = _stacked_getter(w_gu, w_down, ffn, split)
                    for b_gu, b_down in _bias_readings(rows, ffn, width):
                        named = [f"{n.target.rsplit('.', 1)[-1]}" for n in (b_gu, b_down) if n is not None]
                        biases = f", biases {', '.join(named)}" if named else ""
                        bias_getter = (
                            _bias_getter(rows.get(b_gu), rows.get(b_down), ffn, split) if named else None
                        )
                        layouts.append((label + biases, getter, bias_getter))
    return layouts


def _bias_readings(
    rows: dict[fx.Node, torch.Tensor], ffn: int, width: int
) -> list[tuple[fx.Node | None, fx.Node | None]]:
    """(gate_up bias, down bias) assignments of the region's [E, n] tensors: each one whose width
    fits, two different tensors; no biases when the region holds none that fit."""
    gate_up = [n for n, t in rows.items() if t.shape[1] == 2 * ffn] or [None]
    down = [n for n, t in rows.items() if t.shape[1] == width] or [None]
    return [(a, b) for a in gate_up for b in down if a is None or a is not b]


def _stacked_getter(w_gu: torch.Tensor, w_down: torch.Tensor, ffn: int, split: str):
    def get() -> ExpertWeights:
        if split == "concatenated":
            return w_gu[:, :ffn], w_gu[:, ffn:], w_down
        return w_gu[:, 0::2], w_gu[:, 1::2], w_down

    return get


def _bias_getter(b_gu: torch.Tensor | None, b_down: torch.Tensor | None, ffn: int, split: str):
    def get() -> ExpertBiases:
        if b_gu is None:
            return None, None, b_down
        if split == "concatenated":
            return b_gu[:, :ffn], b_gu[:, ffn:], b_down
        return b_gu[:, 0::2], b_gu[:, 1::2], b_down

    return get


def _per_expert_triples(
    region: list[fx.Node], site: MoESite
) -> list[tuple[fx.Node, fx.Node, fx.Node]] | None:
    """Reference-model pattern: out += weight_e * w2_e(silu(w1_e x) * w3_e x), weight_e from ids == e."""
    aliases = _hidden_aliases(site.hidden)
    by_expert: dict[int, tuple[fx.Node, fx.Node, fx.Node]] = {}
    for down in region:
        if not m.is_op(down, aten.linear, aten.mm, aten.addmm):
            continue
        act = m.strip_views(m.linear_input(down))
        if not m.is_op(act, aten.mul):
            continue
        a, b = act.args[0], act.args[1]
        if m.is_op(b, aten.silu):
            a, b = b, a
        if not m.is_op(a, aten.silu):
            continue
        gate, up = a.args[0], b
        if not (m.is_op(gate, aten.linear) and m.is_op(up, aten.linear)):
            continue
        if m.strip_views(gate.args[0]) not in aliases and gate.args[0] not in aliases:
            continue
        if up.args[0] not in aliases and m.strip_views(up.args[0]) not in aliases:
            continue
        expert = _expert_index_of(down, site.topk_ids)
        nodes = (m.linear_weight(gate), m.linear_weight(up), m.linear_weight(down))
        if expert is None or expert in by_expert or any(n.op != "get_attr" for n in nodes):
            return None
        by_expert[expert] = nodes
    if sorted(by_expert) != list(range(site.num_experts)):
        return None
    return [by_expert[e] for e in range(site.num_experts)]


def _expert_index_of(expert_out: fx.Node, ids: fx.Node) -> int | None:
    """The e in `weight_e * expert_out` where weight_e is derived from `ids == e`."""
    for user in expert_out.users:
        if not m.is_op(user, aten.mul):
            continue
        other = user.args[0] if user.args[1] is expert_out else user.args[1]
        if not isinstance(other, fx.Node):
            continue
        found, _ = m.backward_find(other, lambda n: m.is_op(n, aten.eq) and n.args[0] is ids, limit=12)
        values = {m.int_scalar(n.args[1]) for n in found}
        if len(values) == 1 and None not in values:
            return values.pop()
    return None


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error in fp64 (used by the pass manager's numeric check as well)."""
    return _rel_err(got, want)
