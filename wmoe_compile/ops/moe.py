"""wmoe::tiled_moe: SwiGLU experts over packed weights, top-k combine fused.

    wmoe::tiled_moe(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_gate_up,
                    Tensor w_down, bool validate=False, Tensor? b_gate_up=None, Tensor? b_down=None,
                    float gate_alpha=1., float? clamp_limit=None, float up_offset=0.) -> Tensor

hidden [T, H] (bf16 / fp16; fp32 accepted), topk_ids [T, k] integer, topk_weights [T, k] float,
w_gate_up / w_down from wmoe_compile.pack_expert_weights (the layout, "tiles64" or "rows", is read
off their ranks). Returns [T, H] in hidden's dtype.

Per routed pair (token x, expert e), with g, u the gate and up projections of x:
    g += b_gate, u += b_up                          (b_gate_up [E, 2, F_PAD] fp32: rows gate, up)
    g = min(g, L); u = clamp(u, -L, L)              (only when clamp_limit L is given; L > 0)
    h = g * sigmoid(gate_alpha * g) * (u + up_offset)
    y = W_down h + b_down                           (b_down [E, H_PAD] fp32)
    out[t] = sum_j topk_weights[t, j] * y_j
The defaults give silu(g) * u without biases, and run the same kernels as before these arguments
existed; gpt-oss is gate_alpha 1.702, clamp_limit 7.0, up_offset 1.0 with both biases. The packed
bias forms come from pack_expert_weights (PackedExperts.b_gate_up / .b_down).

Expert ids outside [0, E) are never used to index weights: their pairs contribute nothing. With
validate=True they raise instead; that check reads the ids on the host, a synchronisation, so it is
off by default.

Dispatch: CUDA tensors (and CPU tensors under TRITON_INTERPRET=1, as in the tests) run the Triton
kernels in wmoe_compile.kernels.tiled_moe; other CPU tensors run the fp32 per-expert reference.
At decode (T k <= DIRECT_MAX_PAIRS routed pairs) the op is two Triton launches and two torch.empty
after its metadata checks (tiled_moe_direct); above, grouping, two GEMM launches, a zero-fill and a
cast (tiled_moe_triton).
"""

from __future__ import annotations

import torch

from ..kernels import tiled_moe as _kernels
from ..kernels.moe_align import interpreting
from ..kernels.tiled_moe import (
    DEFAULT_SWIGLU,
    PackedDims,
    SwiGLU,
    packed_dims,
    round_up,
    swiglu,
    tiled_moe_reference,
    tiled_moe_triton,
)

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def _check_bias(name: str, bias: torch.Tensor, expected: tuple, meaning: str, device: torch.device) -> None:
    if tuple(bias.shape) != expected or bias.dtype != torch.float32:
        raise ValueError(
            f"{name} must be float32 {list(expected)} ({meaning}, as pack_expert_weights packs it); got "
            f"{bias.dtype} {list(bias.shape)}"
        )
    if bias.device != device:
        raise ValueError(
            f"{name} is on {bias.device} but hidden is on {device}; all tensors must be on one device"
        )


def _check_inputs(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    gate_alpha: float = 1.0,
    clamp_limit: float | None = None,
    up_offset: float = 0.0,
) -> tuple[PackedDims, SwiGLU]:
    """Metadata checks only (no device reads, a few us of host time); returns the packed dims and the
    activation."""
    dims = packed_dims(w_gate_up, w_down)
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden]; got shape {list(hidden.shape)}")
    if hidden.dtype not in _DTYPES or hidden.dtype != w_gate_up.dtype:
        raise ValueError(
            f"hidden is {hidden.dtype} but the packed weights are {w_gate_up.dtype}; both must be the "
            "same of bfloat16 / float16 / float32"
        )
    if round_up(hidden.shape[1]) != dims.hidden_pad:
        raise ValueError(
            f"hidden size {hidden.shape[1]} does not match the packed weights (hidden padded to "
            f"{dims.hidden_pad})"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != hidden.shape[0] or topk_ids.dtype not in _INT_DTYPES:
        raise ValueError(
            f"topk_ids must be int32/int64 [tokens={hidden.shape[0]}, k]; got {topk_ids.dtype} "
            f"{list(topk_ids.shape)}"
        )
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.dtype.is_floating_point:
        raise ValueError(
            f"topk_weights must be floating point with topk_ids' shape {list(topk_ids.shape)}; got "
            f"{topk_weights.dtype} {list(topk_weights.shape)}"
        )
    device = hidden.device
    if not (
        topk_ids.device == device
        and topk_weights.device == device
        and w_gate_up.device == device
        and w_down.device == device
    ):
        devices = {t.device for t in (hidden, topk_ids, topk_weights, w_gate_up, w_down)}
        raise ValueError(f"all tensors must be on one device; got {sorted(map(str, devices))}")
    if b_gate_up is not None:
        expected = (dims.num_experts, 2, dims.ffn_pad)
        _check_bias("b_gate_up", b_gate_up, expected, "[E, 2, F_PAD]: row 0 gate bias, row 1 up bias", device)
    if b_down is not None:
        _check_bias("b_down", b_down, (dims.num_experts, dims.hidden_pad), "[E, H_PAD]", device)
    if gate_alpha == 1.0 and clamp_limit is None and up_offset == 0.0:
        return dims, DEFAULT_SWIGLU
    return dims, swiglu(gate_alpha, clamp_limit, up_offset)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise if any id is outside [0, num_experts). Reads back to the host: a synchronisation."""
    if topk_ids.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(topk_ids)).tolist()  # one read-back, not two
    if low < 0 or high >= num_experts:
        bad = topk_ids[(topk_ids < 0) | (topk_ids >= num_experts)]
        raise ValueError(
            f"topk_ids holds expert ids outside [0, {num_experts}): e.g. {bad[:8].tolist()} "
            f"(min {low}, max {high})"
        )


@torch.library.custom_op("wmoe::tiled_moe", mutates_args=())
def tiled_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    validate: bool = False,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    gate_alpha: float = 1.0,
    clamp_limit: float | None = None,
    up_offset: float = 0.0,
) -> torch.Tensor:
    dims, act = _check_inputs(
        hidden,
        topk_ids,
        topk_weights,
        w_gate_up,
        w_down,
        b_gate_up,
        b_down,
        gate_alpha,
        clamp_limit,
        up_offset,
    )
    if validate:
        check_expert_ids(topk_ids, dims.num_experts)
    plain = b_gate_up is None and b_down is None and act is DEFAULT_SWIGLU  # the calls of before
    if not plain:
        if b_gate_up is not None and not b_gate_up.is_contiguous():
            b_gate_up = b_gate_up.contiguous()
        if b_down is not None and not b_down.is_contiguous():
            b_down = b_down.contiguous()
    if hidden.is_cuda or interpreting():
        num_tokens = hidden.shape[0]
        if 0 < num_tokens * topk_ids.shape[1] <= _kernels.DIRECT_MAX_PAIRS:  # decode: two launches
            if plain:
                return _kernels.tiled_moe_direct(hidden, topk_ids, topk_weights, w_gate_up, w_down, dims)
            return _kernels.tiled_moe_direct(
                hidden, topk_ids, topk_weights, w_gate_up, w_down, dims, b_gate_up, b_down, act
            )
        if plain:
            return tiled_moe_triton(hidden, topk_ids, topk_weights, w_gate_up, w_down, dims=dims)
        return tiled_moe_triton(
            hidden,
            topk_ids,
            topk_weights,
            w_gate_up,
            w_down,
            dims=dims,
            b_gate_up=b_gate_up,
            b_down=b_down,
            act=act,
        )
    return tiled_moe_reference(hidden, topk_ids, topk_weights, w_gate_up, w_down, b_gate_up, b_down, act)


@tiled_moe.register_fake
def _tiled_moe_fake(
    hidden,
    topk_ids,
    topk_weights,
    w_gate_up,
    w_down,
    validate=False,
    b_gate_up=None,
    b_down=None,
    gate_alpha=1.0,
    clamp_limit=None,
    up_offset=0.0,
):
    _check_inputs(
        hidden,
        topk_ids,
        topk_weights,
        w_gate_up,
        w_down,
        b_gate_up,
        b_down,
        gate_alpha,
        clamp_limit,
        up_offset,
    )
    return hidden.new_empty(hidden.shape)
