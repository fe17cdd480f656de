"""Compile-time packing of MoE expert weights into the layout the tiled MoE kernels stream.

`pack_expert_weights` accepts
- HF transformers 5.x fused experts modules (MixtralExperts, Qwen3MoeExperts, OlmoeExperts,
  DeepseekV3 routed experts, ...): `gate_up_proj` [E, 2F, H] (gate rows, then up rows) and
  `down_proj` [E, H, F]; with the `is_transposed` / `is_concatenated` flags that
  `transformers.integrations.moe.use_experts_implementation` sets, also [E, H, 2F] / [E, F, H]
  and gate/up interleaved row by row;
- a module that holds one of those as `.experts` (HF's sparse MoE block, wmoe_compile's MoE);
- per-expert modules with nn.Linear `w1` (gate) / `w3` (up) / `w2` (down), as in
  wmoe_compile.models.mixtral.Expert and HF Mixtral 4.x, or `gate_proj` / `up_proj` / `down_proj`;
- the raw tensors: `gate_up_proj=` and `down_proj=`, or `w1=`, `w3=`, `w2=` (stacked [E, F, H],
  [E, F, H], [E, H, F] or sequences of per-expert nn.Linear-orientation matrices), with optional
  biases `b1=` (gate) [E, F], `b3=` (up) [E, F], `b2=` (down) [E, H] and activation parameters.

Expert biases and gpt-oss's clamped SwiGLU: GptOssExperts (gate_up_proj [E, H, 2F] with gate and up
columns interleaved, `gate_up_proj_bias` [E, 2F], `down_proj_bias` [E, H], `alpha`, `limit`) packs
with its biases and activation (gate_alpha = alpha, clamp_limit = limit, up_offset = 1). An experts
module whose class overrides transformers' `_apply_gate` is packed only when that gate computes
an activation the op has (checked numerically on a probe: gpt-oss's, a clamp then silu, or plain
silu); others raise. Nn.Linear experts' biases are packed too.

Wrong shapes or dtypes fail here, at packing time, with the expected layout in the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HF_LAYOUT = (
    "HF transformers 5.x fused experts: gate_up_proj [num_experts, 2 * ffn, hidden] (gate rows then "
    "up rows) and down_proj [num_experts, hidden, ffn]; with is_transposed=True gate_up_proj "
    "[num_experts, hidden, 2 * ffn] and down_proj [num_experts, ffn, hidden]"
)
_LINEAR_LAYOUT = (
    "per-expert nn.Linear orientation: w1 (gate) [ffn, hidden], w3 (up) [ffn, hidden], "
    "w2 (down) [hidden, ffn], or the same stacked as [num_experts, ffn, hidden] / "
    "[num_experts, ffn, hidden] / [num_experts, hidden, ffn]"
)


_BIAS_LAYOUT = "b1 (gate) [num_experts, ffn], b3 (up) [num_experts, ffn], b2 (down) [num_experts, hidden]"


@dataclass(frozen=True)
class PackedExperts:
    """Expert weights in the kernel layout. Call it like the op: (hidden, topk_ids, topk_weights).

    b_gate_up [E, 2, F_PAD] / b_down [E, H_PAD] fp32 are the packed biases (None without); gate_alpha,
    clamp_limit and up_offset the activation (see wmoe_compile.ops.moe)."""

    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    num_experts: int
    hidden_size: int
    ffn_size: int
    layout: str
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    gate_alpha: float = 1.0
    clamp_limit: float | None = None
    up_offset: float = 0.0

    @property
    def is_plain_swiglu(self) -> bool:
        """No biases and silu(gate) * up: the op's defaults."""
        return (
            self.b_gate_up is None
            and self.b_down is None
            and self.gate_alpha == 1.0
            and self.clamp_limit is None
            and self.up_offset == 0.0
        )

    def op_extra_args(self) -> tuple:
        """The op's trailing arguments after `validate`: biases and activation."""
        return (self.b_gate_up, self.b_down, self.gate_alpha, self.clamp_limit, self.up_offset)

    def __call__(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        validate: bool = False,
    ) -> torch.Tensor:
        from .ops import moe  # noqa: F401  (registers wmoe::tiled_moe)

        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden must be [tokens, {self.hidden_size}] for these experts; got {list(hidden.shape)}"
            )
        if self.is_plain_swiglu:
            return torch.ops.wmoe.tiled_moe(
                hidden, topk_ids, topk_weights, self.w_gate_up, self.w_down, validate
            )
        return torch.ops.wmoe.tiled_moe(
            hidden, topk_ids, topk_weights, self.w_gate_up, self.w_down, validate, *self.op_extra_args()
        )

    def to(self, device: torch.device | str) -> PackedExperts:
        return PackedExperts(
            self.w_gate_up.to(device),
            self.w_down.to(device),
            self.num_experts,
            self.hidden_size,
            self.ffn_size,
            self.layout,
            None if self.b_gate_up is None else self.b_gate_up.to(device),
            None if self.b_down is None else self.b_down.to(device),
            self.gate_alpha,
            self.clamp_limit,
            self.up_offset,
        )

    @property
    def nbytes(self) -> int:
        biases = sum(b.nbytes for b in (self.b_gate_up, self.b_down) if b is not None)
        return self.w_gate_up.nbytes + self.w_down.nbytes + biases

    @property
    def bytes_per_expert(self) -> int:
        """Bytes one routed expert streams (padding to 64 included)."""
        return self.nbytes // self.num_experts


def _check_dtype(name: str, w: torch.Tensor) -> None:
    if w.dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"{name} has dtype {w.dtype}; the tiled MoE kernels take bfloat16 or float16 "
            "(float32 for testing). Dequantize first or pass dtype=."
        )


def _stack(name: str, ws: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    if isinstance(ws, torch.Tensor):
        if ws.dim() != 3:
            raise ValueError(
                f"{name} must be stacked [num_experts, out, in]; got shape {list(ws.shape)}. "
                f"Expected {_LINEAR_LAYOUT}"
            )
        return ws.detach()
    ws = [w.detach() for w in ws]
    if not ws:
        raise ValueError(f"{name} is empty: need one matrix per expert ({_LINEAR_LAYOUT})")
    shapes = {tuple(w.shape) for w in ws}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(
            f"{name} must hold one 2-D matrix of the same shape per expert; got shapes "
            f"{sorted(shapes)}. Expected {_LINEAR_LAYOUT}"
        )
    return torch.stack(ws)


class _Experts(NamedTuple):
    """Unpacked expert weights in nn.Linear orientation, optional biases, activation (None: default)."""

    gate: torch.Tensor  # [E, F, H]
    up: torch.Tensor  # [E, F, H]
    down: torch.Tensor  # [E, H, F]
    b_gate: torch.Tensor | None = None  # [E, F]
    b_up: torch.Tensor | None = None  # [E, F]
    b_down: torch.Tensor | None = None  # [E, H]
    act: tuple[float, float | None, float] | None = None  # (gate_alpha, clamp_limit, up_offset)


def _linear_biases(linears: list[nn.Module]) -> torch.Tensor | None:
    """Stacked biases of per-expert nn.Linear modules ([E, out]); zeros for experts without one."""
    biases = [getattr(m, "bias", None) for m in linears]
    if all(b is None for b in biases):
        return None
    ref = next(b for b in biases if b is not None)
    return torch.stack([(b if b is not None else torch.zeros_like(ref)).detach() for b in biases])


def _stack_bias(name: str, bs: torch.Tensor | Sequence[torch.Tensor] | None) -> torch.Tensor | None:
    if bs is None:
        return None
    if isinstance(bs, torch.Tensor):
        if bs.dim() != 2:
            raise ValueError(
                f"bias {name} must be stacked [num_experts, size]; got {list(bs.shape)}. "
                f"Expected {_BIAS_LAYOUT}"
            )
        return bs.detach()
    bs = [b.detach() for b in bs]
    if not bs or len({tuple(b.shape) for b in bs}) != 1 or bs[0].dim() != 1:
        raise ValueError(
            f"bias {name} must hold one vector of the same size per expert; got shapes "
            f"{sorted({tuple(b.shape) for b in bs})}. Expected {_BIAS_LAYOUT}"
        )
    return torch.stack(bs)


def _from_linear_experts(modules: Sequence[nn.Module]) -> _Experts:
    names = None
    for candidate in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        if all(hasattr(modules[0], n) for n in candidate):
            names = candidate
            break
    if names is None:
        raise ValueError(
            f"expert modules of type {type(modules[0]).__name__} have neither w1/w3/w2 nor "
            f"gate_proj/up_proj/down_proj; pass the tensors instead ({_LINEAR_LAYOUT}, or {_HF_LAYOUT})"
        )
    gate, up, down = ([getattr(m, n).weight for m in modules] for n in names)
    b_gate, b_up, b_down = (_linear_biases([getattr(m, n) for m in modules]) for n in names)
    return _Experts(
        _stack(names[0], gate), _stack(names[1], up), _stack(names[2], down), b_gate, b_up, b_down
    )


def _split_hf_fused(
    gate_up_proj: torch.Tensor, down_proj: torch.Tensor, is_transposed: bool, is_concatenated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gate_up_proj, down_proj = gate_up_proj.detach(), down_proj.detach()
    if gate_up_proj.dim() != 3 or down_proj.dim() != 3:
        raise ValueError(
            f"expected {_HF_LAYOUT}; got gate_up_proj {list(gate_up_proj.shape)} and down_proj "
            f"{list(down_proj.shape)}"
        )
    if is_transposed:
        gate_up_proj = gate_up_proj.transpose(1, 2)
        down_proj = down_proj.transpose(1, 2)
    num_experts, two_ffn, hidden = gate_up_proj.shape
    ok = (
        two_ffn % 2 == 0
        and down_proj.shape[0] == num_experts
        and down_proj.shape[1] == hidden
        and down_proj.shape[2] * 2 == two_ffn
    )
    if not ok:
        raise ValueError(
            f"expected {_HF_LAYOUT} (is_transposed={is_transposed}); got gate_up_proj "
            f"{list(gate_up_proj.shape if not is_transposed else gate_up_proj.transpose(1, 2).shape)} "
            f"and down_proj {list(down_proj.shape if not is_transposed else down_proj.transpose(1, 2).shape)}"
        )
    if is_concatenated:
        gate, up = gate_up_proj[:, : two_ffn // 2], gate_up_proj[:, two_ffn // 2 :]
    else:  # rows interleaved: gate 0, up 0, gate 1, up 1, ...
        gate, up = gate_up_proj[:, 0::2], gate_up_proj[:, 1::2]
    return gate, up, down_proj


def _split_hf_bias(
    gate_up_bias: torch.Tensor, down_bias: torch.Tensor | None, gate: torch.Tensor, is_concatenated: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """HF gate_up_proj_bias [E, 2F] (split like the weights' output dim) -> gate and up biases [E, F]."""
    num_experts, ffn, _ = gate.shape
    if gate_up_bias is None:
        return None, None, down_bias
    gate_up_bias = gate_up_bias.detach()
    if tuple(gate_up_bias.shape) != (num_experts, 2 * ffn):
        raise ValueError(
            f"gate_up_proj_bias must be [num_experts={num_experts}, 2 * ffn={2 * ffn}]; got "
            f"{list(gate_up_bias.shape)}"
        )
    if is_concatenated:
        return gate_up_bias[:, :ffn], gate_up_bias[:, ffn:], down_bias
    return gate_up_bias[:, 0::2], gate_up_bias[:, 1::2], down_bias


def _is_transformers_default_gate(fn) -> bool:
    return getattr(fn, "__module__", "") == "transformers.integrations.moe" and (
        getattr(fn, "__name__", "") == "_default_apply_gate"
    )


def _probe_activation(experts: nn.Module, is_concatenated: bool) -> tuple[float, float | None, float]:
    """The (gate_alpha, clamp_limit, up_offset) that the module's own `_apply_gate` computes.

    Candidates come from its attributes (`alpha`; `limit` or `swiglu_limit`); each is compared with
    the module's gate on a probe spanning twice the clamp limit, laid out as its weights are
    (concatenated or interleaved gate/up columns, so a gate that splits otherwise matches nothing)."""
    from .kernels.tiled_moe import SwiGLU, swiglu_reference

    name = type(experts).__name__
    alpha = getattr(experts, "alpha", None)
    limit = next(
        (getattr(experts, n) for n in ("limit", "swiglu_limit") if getattr(experts, n, None) is not None),
        None,
    )
    alphas = dict.fromkeys([float(alpha), 1.0] if isinstance(alpha, (int, float)) else [1.0])
    limits = dict.fromkeys([float(limit), None] if isinstance(limit, (int, float)) else [None])
    candidates = [(a, lim, off) for a in alphas for lim in limits for off in (1.0, 0.0)]
    ffn = 32
    scale = 2.0 * (float(limit) if isinstance(limit, (int, float)) else 4.0)
    gen = torch.Generator().manual_seed(0)
    gate, up = ((torch.rand(8, ffn, generator=gen) * 2 - 1) * scale for _ in range(2))
    gate_up = (
        torch.cat([gate, up], -1) if is_concatenated else torch.stack([gate, up], -1).reshape(8, 2 * ffn)
    )
    try:
        with torch.no_grad():
            got = experts._apply_gate(gate_up).float()
    except Exception as exc:  # noqa: BLE001  (any failure: the gate is not one the op can take)
        raise ValueError(
            f"{name}._apply_gate could not be checked on a probe: {type(exc).__name__}: {exc}"
        ) from exc
    for a, lim, off in candidates:
        want = swiglu_reference(gate, up, SwiGLU(a, lim, off))
        if got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            return a, lim, off
    raise ValueError(
        f"{name}._apply_gate computes an activation wmoe::tiled_moe does not have: the op computes "
        "h = g * sigmoid(gate_alpha * g) * (u + up_offset) after an optional clamp g = min(g, L), "
        f"u = clamp(u, -L, L) (tried gate_alpha, clamp_limit, up_offset in {candidates})"
    )


def _from_module(experts: nn.Module) -> _Experts:
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        name = type(experts).__name__
        if not getattr(experts, "has_gate", True):
            raise ValueError(f"{name} has no gate projection; the op computes SwiGLU")
        is_concatenated = bool(getattr(experts, "is_concatenated", True))
        apply_gate = getattr(type(experts), "_apply_gate", None)
        if apply_gate is None or _is_transformers_default_gate(apply_gate):
            hidden_act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
            if hidden_act not in ("silu", "swish"):
                raise ValueError(f"{name} uses activation {hidden_act!r}; the op computes silu (SwiGLU)")
            act = None
        else:  # the class's own gate (gpt-oss: clamp, sigmoid(alpha g), up + 1): what does it compute?
            act = _probe_activation(experts, is_concatenated)
        gate, up, down = _split_hf_fused(
            experts.gate_up_proj,
            experts.down_proj,
            bool(getattr(experts, "is_transposed", False)),
            is_concatenated,
        )
        gate_up_bias = getattr(experts, "gate_up_proj_bias", None)
        down_bias = getattr(experts, "down_proj_bias", None)
        if getattr(experts, "has_bias", False) and gate_up_bias is None and down_bias is None:
            raise ValueError(f"{name} has has_bias=True but neither gate_up_proj_bias nor down_proj_bias")
        biases = _split_hf_bias(
            gate_up_bias, None if down_bias is None else down_bias.detach(), gate, is_concatenated
        )
        return _Experts(gate, up, down, *biases, act)
    if isinstance(experts, (nn.ModuleList, nn.Sequential)):
        return _from_linear_experts(list(experts))
    if hasattr(experts, "experts") and isinstance(experts.experts, nn.Module):
        return _from_module(experts.experts)
    raise ValueError(
        f"cannot find expert weights in {type(experts).__name__}: expected a module with gate_up_proj and "
        f"down_proj ({_HF_LAYOUT}), a ModuleList of experts with w1/w3/w2 ({_LINEAR_LAYOUT}), or a module "
        "holding either as `.experts`"
    )


def pack_expert_weights(
    experts: nn.Module | Sequence[nn.Module] | None = None,
    *,
    gate_up_proj: torch.Tensor | None = None,
    down_proj: torch.Tensor | None = None,
    w1: torch.Tensor | Sequence[torch.Tensor] | None = None,
    w3: torch.Tensor | Sequence[torch.Tensor] | None = None,
    w2: torch.Tensor | Sequence[torch.Tensor] | None = None,
    b1: torch.Tensor | Sequence[torch.Tensor] | None = None,
    b3: torch.Tensor | Sequence[torch.Tensor] | None = None,
    b2: torch.Tensor | Sequence[torch.Tensor] | None = None,
    is_transposed: bool = False,
    is_concatenated: bool = True,
    layout: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    gate_alpha: float | None = None,
    clamp_limit: float | None = None,
    up_offset: float | None = None,
) -> PackedExperts:
    """Pack SwiGLU expert weights once, at compile time, for `wmoe::tiled_moe`.

    Give exactly one source: `experts` (a module or a sequence of expert modules), or
    `gate_up_proj=` + `down_proj=` (HF 5.x tensors; `is_transposed` / `is_concatenated` as in
    transformers' use_experts_implementation), or `w1=` + `w3=` + `w2=` (nn.Linear orientation).
    With a tensor source, optional biases `b1=` (gate) [E, F], `b3=` (up) [E, F], `b2=` (down) [E, H]
    (stacked, or one vector per expert; packed as fp32) and the activation `gate_alpha=`,
    `clamp_limit=`, `up_offset=` (None: 1.0, no clamp, 0.0). A module source brings its own biases
    and activation (GptOssExperts: alpha, limit, up_offset 1), so those arguments go with tensors only.
    `layout` is "tiles64" (default) or "rows" (see kernels/tiled_moe.py); `dtype` / `device`
    convert the weights before packing.
    """
    from .kernels.tiled_moe import (
        DEFAULT_LAYOUT,
        LAYOUTS,
        check_swiglu,
        pack_down,
        pack_down_bias,
        pack_gate_up,
        pack_gate_up_bias,
    )

    layout = layout or DEFAULT_LAYOUT
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {LAYOUTS}")
    sources = [
        experts is not None,
        gate_up_proj is not None or down_proj is not None,
        w1 is not None or w3 is not None or w2 is not None,
    ]
    if sum(sources) != 1:
        raise ValueError(
            "give exactly one weight source: experts=, or gate_up_proj= and down_proj=, or w1=, w3= and w2="
        )
    given_act = {"gate_alpha": gate_alpha, "clamp_limit": clamp_limit, "up_offset": up_offset}
    if experts is not None:
        given = [n for n, v in (("b1", b1), ("b3", b3), ("b2", b2), *given_act.items()) if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} go with tensor sources only: a module source's biases and activation "
                "are read from the module"
            )
        if isinstance(experts, nn.Module):
            source = _from_module(experts)
        else:
            source = _from_linear_experts(list(experts))
    else:
        if gate_up_proj is not None or down_proj is not None:
            if gate_up_proj is None or down_proj is None:
                raise ValueError(f"give both gate_up_proj= and down_proj= ({_HF_LAYOUT})")
            gate, up, down = _split_hf_fused(gate_up_proj, down_proj, is_transposed, is_concatenated)
        else:
            if w1 is None or w3 is None or w2 is None:
                raise ValueError(f"give all of w1=, w3= and w2= ({_LINEAR_LAYOUT})")
            gate, up, down = _stack("w1", w1), _stack("w3", w3), _stack("w2", w2)
        act = None
        if any(v is not None for v in given_act.values()):
            act = (
                1.0 if gate_alpha is None else gate_alpha,
                clamp_limit,
                0.0 if up_offset is None else up_offset,
            )
        source = _Experts(
            gate, up, down, *(_stack_bias(n, b) for n, b in (("b1", b1), ("b3", b3), ("b2", b2))), act
        )
    gate, up, down = source.gate, source.up, source.down

    num_experts, ffn, hidden = gate.shape
    if tuple(up.shape) != (num_experts, ffn, hidden) or tuple(down.shape) != (num_experts, hidden, ffn):
        raise ValueError(
            f"inconsistent expert shapes: gate {list(gate.shape)}, up {list(up.shape)}, down "
            f"{list(down.shape)}; expected {_LINEAR_LAYOUT} (gate and up [E, F, H], down [E, H, F])"
        )
    if num_experts < 1 or ffn < 1 or hidden < 1:
        raise ValueError(f"empty expert weights: num_experts={num_experts}, ffn={ffn}, hidden={hidden}")
    for name, w in (("gate", gate), ("up", up), ("down", down)):
        _check_dtype(name, w)
    if len({gate.dtype, up.dtype, down.dtype}) != 1 and dtype is None:
        raise ValueError(
            f"gate/up/down dtypes differ ({gate.dtype}, {up.dtype}, {down.dtype}); pass dtype= to convert"
        )
    dtype = dtype or gate.dtype
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {_FLOAT_DTYPES}; got {dtype}")
    device = device if device is not None else gate.device
    gate, up, down = (w.to(device=device, dtype=dtype) for w in (gate, up, down))
    for name, b, size in (
        ("b1 (gate)", source.b_gate, ffn),
        ("b3 (up)", source.b_up, ffn),
        ("b2 (down)", source.b_down, hidden),
    ):
        if b is not None and (tuple(b.shape) != (num_experts, size) or not b.dtype.is_floating_point):
            raise ValueError(
                f"bias {name} must be floating point [num_experts={num_experts}, {size}]; got {b.dtype} "
                f"{list(b.shape)}. Expected {_BIAS_LAYOUT}"
            )
    gate_alpha, clamp_limit, up_offset = source.act or (1.0, None, 0.0)
    check_swiglu(gate_alpha, clamp_limit, up_offset)
    b_gate, b_up, b_down = (
        None if b is None else b.to(device=device, dtype=torch.float32) for b in source[3:6]
    )
    with torch.no_grad():
        w_gate_up = pack_gate_up(gate, up, layout)
        w_down = pack_down(down, layout)
        b_gate_up = None if b_gate is None and b_up is None else pack_gate_up_bias(b_gate, b_up)
        b_down = None if b_down is None else pack_down_bias(b_down)
    return PackedExperts(
        w_gate_up,
        w_down,
        num_experts,
        hidden,
        ffn,
        layout,
        b_gate_up,
        b_down,
        float(gate_alpha),
        None if clamp_limit is None else float(clamp_limit),
        float(up_offset),
    )
