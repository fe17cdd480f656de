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
  [E, F, H], [E, H, F] or sequences of per-expert nn.Linear-orientation matrices).

Wrong shapes or dtypes fail here, at packing time, with the expected layout in the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PackedExperts:
    """Expert weights in the kernel layout. Call it like the op: (hidden, topk_ids, topk_weights)."""

    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    num_experts: int
    hidden_size: int
    ffn_size: int
    layout: str

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
        return torch.ops.wmoe.tiled_moe(hidden, topk_ids, topk_weights, self.w_gate_up, self.w_down, validate)

    def to(self, device: torch.device | str) -> PackedExperts:
        return PackedExperts(
            self.w_gate_up.to(device),
            self.w_down.to(device),
            self.num_experts,
            self.hidden_size,
            self.ffn_size,
            self.layout,
        )

    @property
    def nbytes(self) -> int:
        return self.w_gate_up.nbytes + self.w_down.nbytes

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


def _from_linear_experts(modules: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    for m in modules:
        for n in names:
            if getattr(getattr(m, n), "bias", None) is not None:
                raise ValueError(f"expert {n} has a bias; the tiled MoE op has no bias terms")
    gate, up, down = ([getattr(m, n).weight for m in modules] for n in names)
    return _stack(names[0], gate), _stack(names[1], up), _stack(names[2], down)


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


def _from_module(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if hasattr(experts, "gate_up_proj") and hasattr(experts, "down_proj"):
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise ValueError(f"{type(experts).__name__} has expert biases; the tiled MoE op has none")
        if not getattr(experts, "has_gate", True):
            raise ValueError(f"{type(experts).__name__} has no gate projection; the op computes SwiGLU")
        act = getattr(getattr(experts, "config", None), "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"{type(experts).__name__} uses activation {act!r}; the op computes silu (SwiGLU)"
            )
        return _split_hf_fused(
            experts.gate_up_proj,
            experts.down_proj,
            bool(getattr(experts, "is_transposed", False)),
            bool(getattr(experts, "is_concatenated", True)),
        )
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
    is_transposed: bool = False,
    is_concatenated: bool = True,
    layout: str | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> PackedExperts:
    """Pack SwiGLU expert weights once, at compile time, for `wmoe::tiled_moe`.

    Give exactly one source: `experts` (a module or a sequence of expert modules), or
    `gate_up_proj=` + `down_proj=` (HF 5.x tensors; `is_transposed` / `is_concatenated` as in
    transformers' use_experts_implementation), or `w1=` + `w3=` + `w2=` (nn.Linear orientation).
    `layout` is "tiles64" (default) or "rows" (see kernels/tiled_moe.py); `dtype` / `device`
    convert before packing.
    """
    from .kernels.tiled_moe import DEFAULT_LAYOUT, LAYOUTS, pack_down, pack_gate_up

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
    if experts is not None:
        if isinstance(experts, nn.Module):
            gate, up, down = _from_module(experts)
        else:
            gate, up, down = _from_linear_experts(list(experts))
    elif gate_up_proj is not None or down_proj is not None:
        if gate_up_proj is None or down_proj is None:
            raise ValueError(f"give both gate_up_proj= and down_proj= ({_HF_LAYOUT})")
        gate, up, down = _split_hf_fused(gate_up_proj, down_proj, is_transposed, is_concatenated)
    else:
        if w1 is None or w3 is None or w2 is None:
            raise ValueError(f"give all of w1=, w3= and w2= ({_LINEAR_LAYOUT})")
        gate, up, down = _stack("w1", w1), _stack("w3", w3), _stack("w2", w2)

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
    with torch.no_grad():
        w_gate_up = pack_gate_up(gate, up, layout)
        w_down = pack_down(down, layout)
    return PackedExperts(w_gate_up, w_down, num_experts, hidden, ffn, layout)
