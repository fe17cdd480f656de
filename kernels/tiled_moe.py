"""Tiled streaming MoE: SwiGLU experts as two Triton grouped GEMMs over packed expert weights.

    out[t] = sum_j topk_weights[t, j] * W2[e] (silu(W1[e] x_t) * W3[e] x_t),  e = topk_ids[t, j]

and, optionally (gpt-oss's experts), with expert biases and a clamped, scaled SwiGLU (SwiGLU below):

    g = W1[e] x + b1[e], u = W3[e] x + b3[e];  with a clamp limit L: g = min(g, L), u = clamp(u, -L, L)
    out[t] = sum_j topk_weights[t, j] * (W2[e] (g sigmoid(alpha g) (u + up_offset)) + b2[e])

Biases are packed as fp32 (pack_gate_up_bias / pack_down_bias). Every such code path of the kernels
sits behind a constexpr (HAS_BIAS, GATE_ALPHA, CLAMP_LIMIT, UP_OFFSET) whose default compiles it
away: the kernels of the bias-free silu(gate) * up are unchanged.

Side by side in this file: the packed weight layout (pack / unpack), a plain per-expert loop in
fp32 (the reference), the two Triton kernels and their launcher with a table of tuned launch
configs. Token grouping lives in moe_align.py.

Packed layout (H_PAD, F_PAD: hidden and ffn sizes rounded up to 64 with zero weights, which is
exact: a zero gate row gives silu(0) * 0 = 0, and zero columns of W2 read those zeros; padded ffn
columns also get zero biases, so g = 0 and h = 0 whatever the clamp or up_offset):

- "tiles64" (default): the weights as contiguous 64x64 sub-tiles, K (the reduction dim) fastest.
      w_gate_up [E, F_PAD/64, H_PAD/64, 2, 64, 64]   [..., 0, :, :] gate rows, [..., 1, :, :] up rows
      w_down    [E, H_PAD/64, F_PAD/64, 64, 64]
  The gate and up sub-tiles of one (ffn block, k block) are adjacent, so a program computing
  ffn columns [n, n + 64) streams one contiguous 16 KB chunk per k step that feeds both GEMMs,
  and a whole program's weights are one contiguous range of memory (DRAM pages read front to
  back, no strided row segments).
- "rows": nn.Linear orientation with gate and up interleaved in 64-row blocks,
      w_gate_up [E, 2 * F_PAD, H_PAD]   rows [128 j, 128 j + 64) gate, [128 j + 64, 128 j + 128) up
      w_down    [E, H_PAD, F_PAD]
  Kept because it is what a TMA 2-D descriptor wants. Measured side by side on the H200
  (benchmarks/RESULTS.md), "tiles64" was as fast or faster at every T of both benchmark shapes:
  0.187 vs 0.199 ms at Mixtral T = 1 (3.77 vs 3.54 TB/s of weights), 0.664 vs 0.688 at T = 64, and
  with the one-dot prefill kernel 0.706 vs 0.781 at T = 256 and 4.97 vs 5.33 at T = 4096, so it is
  the default.

Kernels (grouping from moe_align.py: pairs sorted by expert, tiles of <= BLOCK_M pairs):
1. gate_up: one program per (M tile, BLOCK_N ffn columns). Loads x rows (gathered by token) and
   the gate and up weight tiles, tensor-core dots into fp32 accumulators, then
   h = silu(gate) * up in registers, stored in the input dtype to h [P, F_PAD] (sorted rows).
   Prefill configs (`fused`) load gate and up as one [BLOCK_K, 2 * BLOCK_N] tile and issue one dot
   of twice the width (one N = 256 wgmma at BLOCK_N = 128, the A tile read once); the split back
   into gate and up is a reshape of the accumulator that moves no data. Both packed layouts
   already hold gate and up of the same ffn rows side by side, so neither layout changed.
   Measured on the H200: 3.15 vs 3.54 ms (two dots) for Mixtral's gate_up at T = 4096.
   Decode configs keep two dots of BLOCK_N (M = 16 tiles use mma.sync, not wgmma, and are
   bound by the weight stream either way).
2. down: one program per (M tile, BLOCK_N hidden columns, K split). h @ W2^T, scaled by the
   routing weight, and the k-way combine done with fp32 atomic adds into an fp32 [T, H] buffer,
   then one cast to the output dtype. Atomics make the sum order (and so the last bit of the
   fp32 sum) vary between runs; with k = 1 and no split each element gets one add (exact).
   A deterministic combine would need a [T, k, H] intermediate and a reduce pass (vLLM's
   moe_sum): more bytes at every T, and split-K, which the decode path needs to spread the
   W2 read over all SMs, would need one more buffer on top.

Weight tiles are fetched with plain pointer loads in a loop that Triton software-pipelines
(num_stages deep cp.async ring in shared memory). Tensor-memory (TMA) descriptors were not used:
the "tiles64" layout is not a strided 2-D box, and at decode the loads are already bandwidth-
bound with several stages in flight per SM.

Small T through the grouped path: every tile holds < BLOCK_M = 16 pairs of one expert, the grid
bound is exactly the number of experts hit (moe_align.max_tiles), and the down projection splits K
so that the weight read at T = 1 is spread over more programs than the GPU has SMs.

Direct decode path (T k <= DIRECT_MAX_PAIRS = 8, no explicit config): at decode the GPU work is a
weight stream of ~0.06-0.2 ms, and the grouped path's host work (a grouping launch, two GEMM
launches, a zero-fill, a cast, five allocations, each Triton launch binding ~20 arguments) was
measured above that (benchmarks/RESULTS.md). The direct path is two Triton launches and two
torch.empty: _gate_up_direct_kernel's programs find their expert's pairs in topk_ids themselves
(no grouping), and _down_direct_kernel gives each program a block of hidden columns over every
live expert, so the weighted combine is done in registers and the output written once in its dtype
(no atomics, no fp32 buffer). Launch constants are built once per shape (_direct_plan), and after
the first call of an argument signature the compiled kernels are launched directly (FAST_LAUNCH).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from .fast_launch import COMPILE_OPTIONS, launch
from .moe_align import ExpertGrouping, group_by_expert, interpreting
from .triton_masks import mask_and

SUBTILE = 64
LAYOUTS = ("tiles64", "rows")
DEFAULT_LAYOUT = "tiles64"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def round_up(n: int, multiple: int = SUBTILE) -> int:
    return -(-n // multiple) * multiple


# ----------------------------------------------------------------------------------------------
# Packed layout
# ----------------------------------------------------------------------------------------------


def _pad_to(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if w.shape[-2:] == (rows, cols):
        return w.contiguous()
    out = w.new_zeros(*w.shape[:-2], rows, cols)
    out[..., : w.shape[-2], : w.shape[-1]] = w
    return out


def pack_gate_up(w_gate: torch.Tensor, w_up: torch.Tensor, layout: str = DEFAULT_LAYOUT) -> torch.Tensor:
    """[E, F, H] gate and up (nn.Linear orientation) -> the packed w_gate_up of `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {LAYOUTS}")
    num_experts, ffn, hidden = w_gate.shape
    f_pad, h_pad = round_up(ffn), round_up(hidden)
    gate = _pad_to(w_gate, f_pad, h_pad).view(num_experts, f_pad // SUBTILE, SUBTILE, h_pad)
    up = _pad_to(w_up, f_pad, h_pad).view(num_experts, f_pad // SUBTILE, SUBTILE, h_pad)
    blocks = torch.stack([gate, up], dim=2)  # [E, F/64, 2, 64, H]
    if layout == "rows":
        return blocks.reshape(num_experts, 2 * f_pad, h_pad).contiguous()
    tiles = blocks.view(num_experts, f_pad // SUBTILE, 2, SUBTILE, h_pad // SUBTILE, SUBTILE)
    return tiles.permute(0, 1, 4, 2, 3, 5).contiguous()  # [E, F/64, H/64, 2, 64, 64]


def pack_down(w_down: torch.Tensor, layout: str = DEFAULT_LAYOUT) -> torch.Tensor:
    """[E, H, F] down (nn.Linear orientation) -> the packed w_down of `layout`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {LAYOUTS}")
    num_experts, hidden, ffn = w_down.shape
    f_pad, h_pad = round_up(ffn), round_up(hidden)
    padded = _pad_to(w_down, h_pad, f_pad)
    if layout == "rows":
        return padded
    tiles = padded.view(num_experts, h_pad // SUBTILE, SUBTILE, f_pad // SUBTILE, SUBTILE)
    return tiles.permute(0, 1, 3, 2, 4).contiguous()  # [E, H/64, F/64, 64, 64]


@dataclass(frozen=True)
class PackedDims:
    num_experts: int
    ffn_pad: int
    hidden_pad: int
    layout: str


def packed_dims(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> PackedDims:
    """Read (E, F_PAD, H_PAD, layout) off packed weights; raise if they do not form a packed pair."""
    key = (w_gate_up.shape, w_down.shape, w_gate_up.dtype, w_down.dtype)
    try:
        return _packed_dims_cached(*key)
    except TypeError:  # symbolic sizes (fake tensors with dynamic shapes) are not hashable
        return _packed_dims(*key)


def _packed_dims(gu: torch.Size, dn: torch.Size, gu_dtype: torch.dtype, dn_dtype: torch.dtype) -> PackedDims:
    expected = (
        "packed weights from wmoe_compile.pack_expert_weights: 'tiles64' w_gate_up "
        "[E, F_PAD/64, H_PAD/64, 2, 64, 64] with w_down [E, H_PAD/64, F_PAD/64, 64, 64], or 'rows' "
        "w_gate_up [E, 2*F_PAD, H_PAD] with w_down [E, H_PAD, F_PAD] (F_PAD, H_PAD multiples of 64)"
    )
    gu, dn = tuple(gu), tuple(dn)
    if len(gu) == 6 and len(dn) == 5:
        e, fb, hb, two, s1, s2 = gu
        ok = (two, s1, s2) == (2, SUBTILE, SUBTILE) and dn == (e, hb, fb, SUBTILE, SUBTILE)
        dims = PackedDims(e, fb * SUBTILE, hb * SUBTILE, "tiles64")
    elif len(gu) == 3 and len(dn) == 3:
        e, f2, hp = gu
        ok = f2 % (2 * SUBTILE) == 0 and hp % SUBTILE == 0 and dn == (e, hp, f2 // 2)
        dims = PackedDims(e, f2 // 2, hp, "rows")
    else:
        ok = False
    if not ok:
        raise ValueError(f"expected {expected}; got w_gate_up {list(gu)} and w_down {list(dn)}")
    if gu_dtype != dn_dtype:
        raise ValueError(f"w_gate_up is {gu_dtype} but w_down is {dn_dtype}; pack both alike")
    return dims


# The op reads the dims on every call, and at decode host time is the budget (a raise is not cached).
_packed_dims_cached = functools.lru_cache(maxsize=64)(_packed_dims)


def unpack_gate_up(w_gate_up: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of pack_gate_up: (gate, up), each [E, F_PAD, H_PAD]."""
    if layout == "rows":
        e, f2, hp = w_gate_up.shape
        blocks = w_gate_up.view(e, f2 // (2 * SUBTILE), 2, SUBTILE, hp)
    else:
        e, fb, hb = w_gate_up.shape[:3]
        blocks = w_gate_up.permute(0, 1, 3, 4, 2, 5).reshape(e, fb, 2, SUBTILE, hb * SUBTILE)
    gate = blocks[:, :, 0].reshape(blocks.shape[0], -1, blocks.shape[-1])
    up = blocks[:, :, 1].reshape(blocks.shape[0], -1, blocks.shape[-1])
    return gate, up


def unpack_down(w_down: torch.Tensor, layout: str) -> torch.Tensor:
    """Inverse of pack_down: [E, H_PAD, F_PAD]."""
    if layout == "rows":
        return w_down
    e, hb, fb = w_down.shape[:3]
    return w_down.permute(0, 1, 3, 2, 4).reshape(e, hb * SUBTILE, fb * SUBTILE)


def pack_gate_up_bias(b_gate: torch.Tensor | None, b_up: torch.Tensor | None) -> torch.Tensor:
    """[E, F] gate and up biases (either may be None: zeros) -> b_gate_up [E, 2, F_PAD] fp32, zero-padded.

    Row 0 holds the gate bias, row 1 the up bias; the same for both weight layouts."""
    ref = b_gate if b_gate is not None else b_up
    if ref is None:
        raise ValueError("give a gate bias, an up bias or both")
    num_experts, ffn = ref.shape
    out = torch.zeros(num_experts, 2, round_up(ffn), dtype=torch.float32, device=ref.device)
    for row, b in enumerate((b_gate, b_up)):
        if b is not None:
            out[:, row, :ffn] = b
    return out


def pack_down_bias(b_down: torch.Tensor) -> torch.Tensor:
    """[E, H] down bias -> b_down [E, H_PAD] fp32, zero-padded."""
    num_experts, hidden = b_down.shape
    out = torch.zeros(num_experts, round_up(hidden), dtype=torch.float32, device=b_down.device)
    out[:, :hidden] = b_down
    return out


@dataclass(frozen=True)
class SwiGLU:
    """The expert activation h = g sigmoid(gate_alpha g) (u + up_offset), after an optional clamp
    g = min(g, clamp_limit), u = clamp(u, -clamp_limit, clamp_limit). The defaults are silu(g) u.

    Its fields become the kernels' constexprs (a compiled variant per value: one per model)."""

    gate_alpha: float = 1.0
    clamp_limit: float | None = None
    up_offset: float = 0.0

    @property
    def is_default(self) -> bool:
        return self.gate_alpha == 1.0 and self.clamp_limit is None and self.up_offset == 0.0

    def constexprs(self) -> dict:
        return dict(GATE_ALPHA=self.gate_alpha, CLAMP_LIMIT=self.clamp_limit, UP_OFFSET=self.up_offset)


DEFAULT_SWIGLU = SwiGLU()


def check_swiglu(gate_alpha: float, clamp_limit: float | None, up_offset: float) -> None:
    """Raise ValueError unless the activation's parameters are usable (finite; clamp_limit > 0)."""
    for name, value in (("gate_alpha", gate_alpha), ("up_offset", up_offset)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number; got {value!r}")
    if clamp_limit is not None and (
        isinstance(clamp_limit, bool)
        or not isinstance(clamp_limit, (int, float))
        or not math.isfinite(clamp_limit)
        or clamp_limit <= 0
    ):
        raise ValueError(f"clamp_limit must be None (no clamp) or a finite number > 0; got {clamp_limit!r}")


@functools.lru_cache(maxsize=64)
def swiglu(gate_alpha: float = 1.0, clamp_limit: float | None = None, up_offset: float = 0.0) -> SwiGLU:
    """The SwiGLU of these parameters, checked (cached: the op builds it on every call)."""
    check_swiglu(gate_alpha, clamp_limit, up_offset)
    if gate_alpha == 1.0 and clamp_limit is None and up_offset == 0.0:
        return DEFAULT_SWIGLU
    return SwiGLU(float(gate_alpha), None if clamp_limit is None else float(clamp_limit), float(up_offset))


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, act: SwiGLU = DEFAULT_SWIGLU) -> torch.Tensor:
    """The activation in torch, in the inputs' dtype (biases already added)."""
    if act.is_default:
        return torch.nn.functional.silu(gate) * up
    if act.clamp_limit is not None:
        gate = gate.clamp(max=act.clamp_limit)
        up = up.clamp(-act.clamp_limit, act.clamp_limit)
    return gate * torch.sigmoid(act.gate_alpha * gate) * (up + act.up_offset)


# ----------------------------------------------------------------------------------------------
# Reference: a plain per-expert loop
# ----------------------------------------------------------------------------------------------


def moe_reference(
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    w_gate: torch.Tensor,  # [E, F, H]
    w_up: torch.Tensor,  # [E, F, H]
    w_down: torch.Tensor,  # [E, H, F]
    compute_dtype: torch.dtype = torch.float32,
    *,
    b_gate: torch.Tensor | None = None,  # [E, F]
    b_up: torch.Tensor | None = None,  # [E, F]
    b_down: torch.Tensor | None = None,  # [E, H]
    act: SwiGLU = DEFAULT_SWIGLU,
) -> torch.Tensor:
    """SwiGLU experts, one expert at a time, in `compute_dtype`; returns hidden's dtype.

    Optional biases and activation as in the module docstring (the routing weight scales b_down too).
    Pairs routed to an id outside [0, E) contribute nothing, as in the Triton path.
    """
    x = hidden.to(compute_dtype)
    out = torch.zeros_like(x)
    for expert in range(w_gate.shape[0]):
        token, slot = (topk_ids == expert).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        xe = x[token]
        gate = xe @ w_gate[expert].to(compute_dtype).T
        up = xe @ w_up[expert].to(compute_dtype).T
        if b_gate is not None:
            gate = gate + b_gate[expert].to(compute_dtype)
        if b_up is not None:
            up = up + b_up[expert].to(compute_dtype)
        y = swiglu_reference(gate, up, act) @ w_down[expert].to(compute_dtype).T
        if b_down is not None:
            y = y + b_down[expert].to(compute_dtype)
        out.index_add_(0, token, y * topk_weights[token, slot].to(compute_dtype)[:, None])
    return out.to(hidden.dtype)


def tiled_moe_reference(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,  # packed [E, 2, F_PAD]
    b_down: torch.Tensor | None = None,  # packed [E, H_PAD]
    act: SwiGLU = DEFAULT_SWIGLU,
) -> torch.Tensor:
    """The op on packed weights, computed by unpacking and running moe_reference in fp32."""
    dims = packed_dims(w_gate_up, w_down)
    gate, up = unpack_gate_up(w_gate_up, dims.layout)
    down = unpack_down(w_down, dims.layout)
    hidden_size = hidden.shape[1]
    x = torch.nn.functional.pad(hidden, (0, dims.hidden_pad - hidden_size))
    biases = {}
    if b_gate_up is not None:
        biases.update(b_gate=b_gate_up[:, 0], b_up=b_gate_up[:, 1])
    if b_down is not None:
        biases.update(b_down=b_down)
    out = moe_reference(x, topk_ids, topk_weights, gate, up, down, **biases, act=act)
    return out[:, :hidden_size].contiguous()


# ----------------------------------------------------------------------------------------------
# Launch configs: tuned per shape class and tokens-per-expert bucket, looked up on every call
# ----------------------------------------------------------------------------------------------


def _fit_block(block: int, dim: int, floor: int) -> int:
    """Halve `block` until it divides `dim` (never below `floor`)."""
    while block > floor and dim % block:
        block //= 2
    return block


def _two_stages_for_fp32(config, dtype: torch.dtype):
    """The launch tables were swept for 2-byte weights; fp32 tiles need twice the shared memory per
    pipeline stage (measured on the H200: 288 KB > 227 KB), so fp32 runs at most two stages."""
    if dtype != torch.float32:
        return config
    return replace(config, up_stages=min(config.up_stages, 2), down_stages=min(config.down_stages, 2))


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # pairs per M tile (shared by both kernels: one grouping)
    up_n: int  # gate_up: ffn columns per program (gate and up each)
    up_k: int
    up_warps: int
    up_stages: int
    down_n: int  # down: hidden columns per program
    down_k: int
    down_split: int  # K split of the down projection (atomics combine the splits)
    down_warps: int
    down_stages: int
    group_m: int = 8  # M tiles per program-order group (L2 reuse of weight tiles across M tiles)
    fused: bool = False  # gate_up: gate and up as one dot of 2 * up_n columns (else two dots)

    def fitted(self, ffn_pad: int, hidden_pad: int) -> MoEConfig:
        """Shrink block sizes that do not divide the padded dims (weight loads are unmasked)."""
        down_k = _fit_block(self.down_k, ffn_pad, SUBTILE)
        return replace(
            self,
            up_n=_fit_block(self.up_n, ffn_pad, 16),
            up_k=_fit_block(self.up_k, hidden_pad, SUBTILE),
            down_n=_fit_block(self.down_n, hidden_pad, 16),
            down_k=down_k,
            down_split=max(1, min(self.down_split, ffn_pad // down_k)),
        )


def _cfg(bm, un, uk, uw, us, dn, dk, ds, dw, dst, gm=8, fused=False) -> MoEConfig:
    return MoEConfig(bm, un, uk, uw, us, dn, dk, ds, dw, dst, gm, fused)


# Shape class: "large" experts (H * F >= 2^24, e.g. Mixtral 4096 x 14336) or "small" (fine-grained,
# e.g. 2048 x 1408). Bucket: upper bound on m = pairs per expert hit = ceil(T k / min(E, T k)).
# Winners of the per-kernel sweep in benchmarks/bench_moe.py --sweep on the H200 (benchmarks/RESULTS.md):
# Mixtral T = 1, 8, 64, 256, 1024, 4096 fill large buckets 1, 2, 32, 128, 512, inf; fine-grained
# T = 1 and 8, 64, 256, 1024, 4096 fill small buckets 1, 8, 32, 128, 512. Buckets up to 32 come from
# the earlier sweep of every T (2026-11-30); the prefill buckets (128 and up) from the sweep of
# T = 256, 1024, 4096 at 2026-11-30 11:22 UTC (which re-chose ("small", 32) unchanged), where gate
# and up as one dot (fused) beat two dots by 3-11% at every T (Mixtral T = 4096: 3.15 vs 3.54 ms for
# gate_up). Entries marked "copied" had no benchmark T in their bucket and take their neighbour's.
CONFIG_TABLE: dict[tuple[str, int], MoEConfig] = {
    ("large", 1): _cfg(16, 128, 128, 4, 3, 128, 128, 2, 4, 4),
    ("large", 2): _cfg(16, 128, 128, 4, 3, 64, 256, 4, 4, 3),
    ("large", 8): _cfg(16, 128, 128, 4, 3, 64, 256, 4, 4, 3),  # copied from ("large", 2)
    ("large", 32): _cfg(32, 128, 128, 4, 3, 128, 64, 1, 4, 4),
    ("large", 128): _cfg(128, 128, 64, 8, 4, 256, 64, 1, 8, 3, fused=True),
    ("large", 512): _cfg(128, 128, 64, 8, 4, 256, 64, 1, 8, 3, fused=True),
    ("large", 1 << 62): _cfg(128, 128, 64, 8, 4, 256, 64, 1, 8, 3, fused=True),
    ("small", 1): _cfg(16, 64, 256, 4, 3, 64, 128, 4, 4, 4),
    ("small", 2): _cfg(16, 64, 256, 4, 3, 64, 128, 4, 4, 4),  # copied from ("small", 1)
    ("small", 8): _cfg(16, 32, 256, 4, 3, 64, 128, 2, 4, 4),
    ("small", 32): _cfg(32, 128, 64, 4, 4, 128, 64, 1, 4, 4),
    ("small", 128): _cfg(128, 128, 64, 8, 4, 256, 64, 1, 8, 4, fused=True),
    ("small", 512): _cfg(128, 128, 64, 8, 3, 256, 64, 1, 8, 4, fused=True),
    ("small", 1 << 62): _cfg(128, 128, 64, 8, 3, 256, 64, 1, 8, 4, fused=True),  # copied from ("small", 512)
}
BUCKETS = sorted({bucket for _, bucket in CONFIG_TABLE})


def shape_class(hidden_pad: int, ffn_pad: int) -> str:
    return "large" if hidden_pad * ffn_pad >= (1 << 24) else "small"


def pairs_per_expert(num_tokens: int, top_k: int, num_experts: int) -> int:
    pairs = num_tokens * top_k
    return max(1, math.ceil(pairs / max(1, min(num_experts, pairs))))


def lookup_config(num_tokens: int, top_k: int, num_experts: int, hidden_pad: int, ffn_pad: int) -> MoEConfig:
    m = pairs_per_expert(num_tokens, top_k, num_experts)
    bucket = next(b for b in BUCKETS if m <= b)
    return _fitted(CONFIG_TABLE[(shape_class(hidden_pad, ffn_pad), bucket)], ffn_pad, hidden_pad)


@functools.lru_cache(maxsize=256)
def _fitted(config: MoEConfig, ffn_pad: int, hidden_pad: int) -> MoEConfig:
    # Cached: the op looks its config up on every call, and at decode host time is the budget.
    return config.fitted(ffn_pad, hidden_pad)


# Direct decode path (see _gate_up_direct_kernel): taken for P = T k <= DIRECT_MAX_PAIRS routed pairs
# when no explicit config is given (the masked rows fit one M = 16 tensor-core tile). Measured on
# the H200 (2026-11-30 14:08 UTC, benchmarks/RESULTS.md): at Mixtral T = 8 (16 pairs, 7-8 experts
# hit) the grouped path streams faster (0.578 vs 0.613 ms in a CUDA graph), at T = 1 the direct
# path is faster from Python (0.182 vs 0.192 ms) and the fine-grained T = 1 (8 pairs) 0.086 vs
# 0.236 ms. So the direct path is kept to 8 pairs.
DIRECT_MAX_PAIRS = 8


@dataclass(frozen=True)
class DirectConfig:
    up_n: int  # gate_up: ffn columns per program (gate and up each)
    up_k: int
    up_warps: int
    up_stages: int
    down_n: int  # down: hidden columns per program (each program covers every live expert's F)
    down_k: int
    down_warps: int
    down_stages: int
    down_flat: bool = False  # one loop over (live expert, K block), see _down_direct_kernel

    def fitted(self, ffn_pad: int, hidden_pad: int) -> DirectConfig:
        """Shrink block sizes that do not divide the padded dims (weight loads are unmasked)."""
        return replace(
            self,
            up_n=_fit_block(self.up_n, ffn_pad, 16),
            up_k=_fit_block(self.up_k, hidden_pad, SUBTILE),
            down_n=_fit_block(self.down_n, hidden_pad, 16),
            down_k=_fit_block(self.down_k, ffn_pad, SUBTILE),
        )


# gate_up: the tile shapes of the grouped decode bucket 1 (CONFIG_TABLE, swept on the H200).
# down: one program per down_n hidden columns, so down_n sets the grid (H_PAD / down_n programs:
# 256 at Mixtral's 4096 with 16, 128 at the fine-grained 2048 with 16); not yet swept on the GPU:
# benchmarks/bench_moe.py times the candidates of DIRECT_DOWN_CANDIDATES and prints the winner.
# Keys: a shape class (shape_class), or the padded (hidden, ffn) dims of a shape swept on its own,
# which direct_config prefers.
DIRECT_CONFIGS: dict[str | tuple[int, int], DirectConfig] = {
    "large": DirectConfig(128, 128, 4, 3, 32, 256, 4, 3),  # swept at Mixtral T = 1 (bench_moe.py)
    "small": DirectConfig(128, 64, 4, 4, 32, 128, 4, 4),  # swept at the fine-grained T = 1
}


def direct_config(hidden_pad: int, ffn_pad: int) -> DirectConfig:
    """The direct path's launch config: the entry swept at these padded dims, else their shape class's."""
    return DIRECT_CONFIGS.get((hidden_pad, ffn_pad)) or DIRECT_CONFIGS[shape_class(hidden_pad, ffn_pad)]


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped program order: GROUP_M consecutive M tiles share each weight tile while it is in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_offsets(ffn_col, is_up, ks, hidden_pad, TILED: tl.constexpr):
    """[K, N] element offsets, within one expert's packed w_gate_up, of the gate (is_up 0) or up
    (is_up 1) weights of ffn columns `ffn_col` [N] at reduction indices `ks` [K]."""
    if TILED:  # [F/64, H/64, 2, 64, 64]
        tile_index = (ffn_col[None, :] // 64) * (hidden_pad // 64) + ks[:, None] // 64
        offsets = tile_index * (2 * 64 * 64) + (ffn_col[None, :] % 64) * 64 + ks[:, None] % 64
        return offsets + is_up * (64 * 64)
    else:  # rows [2 F, H]: 64-row blocks gate, up, gate, ...
        rows = (ffn_col[None, :] // 64) * 128 + is_up * 64 + ffn_col[None, :] % 64
        return rows * hidden_pad + ks[:, None]


@triton.jit
def _load_x(x_ptrs, row_in, k_in, EVEN_H: tl.constexpr):
    if EVEN_H:
        return tl.load(x_ptrs, mask=row_in[:, None], other=0.0)
    else:
        return tl.load(x_ptrs, mask=row_in[:, None] & k_in[None, :], other=0.0)


@triton.jit
def _swiglu(
    gate,  # [M, N] fp32 accumulators of ffn columns `cols`
    up,
    b_ptr,  # packed b_gate_up [E, 2, F_PAD] fp32 (None without biases)
    expert,
    cols,
    ffn_pad,
    HAS_BIAS: tl.constexpr,
    GATE_ALPHA: tl.constexpr,
    CLAMP_LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr,
):
    """h = g sigmoid(alpha g) (u + up_offset) after the biases and the clamp (see SwiGLU). With the
    defaults (no bias, alpha 1, no clamp, offset 0) exactly the former silu(gate) * up."""
    if HAS_BIAS:
        b_gate_ptrs = b_ptr + expert.to(tl.int64) * (2 * ffn_pad) + cols
        gate += tl.load(b_gate_ptrs)[None, :]
        up += tl.load(b_gate_ptrs + ffn_pad)[None, :]
    if CLAMP_LIMIT is not None:
        gate = tl.minimum(gate, CLAMP_LIMIT)
        up = tl.minimum(tl.maximum(up, -CLAMP_LIMIT), CLAMP_LIMIT)
    if GATE_ALPHA == 1.0:
        act = gate * tl.sigmoid(gate)
    else:
        act = gate * tl.sigmoid(gate * GATE_ALPHA)
    if UP_OFFSET != 0.0:
        up = up + UP_OFFSET
    return act * up


# Integer args that change with the routing or T are not specialised (Triton would otherwise compile
# a variant per divisibility class), so one compiled kernel serves every T of a config.
@triton.jit(do_not_specialize=["n_slots", "top_k"])
def _gate_up_kernel(
    x_ptr,  # [T, H] hidden
    w_ptr,  # packed w_gate_up
    h_ptr,  # [P, F_PAD] out: silu(gate) * up, rows in sorted-pair order
    sorted_pairs_ptr,
    tiles_ptr,  # [3, n_slots]
    n_slots,
    hidden_size,
    stride_x,
    ffn_pad,
    hidden_pad,
    top_k,
    b_ptr,  # packed b_gate_up [E, 2, F_PAD] fp32, or None (HAS_BIAS False)
    TILED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_H: tl.constexpr,
    FUSED: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATE_ALPHA: tl.constexpr,
    CLAMP_LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_coords(pid, n_slots, ffn_pad // BLOCK_N, GROUP_M)
    expert = tl.load(tiles_ptr + pid_m)
    if expert < 0:  # slot past the real tile count (the grid is a bound, see moe_align)
        return
    row_start = tl.load(tiles_ptr + n_slots + pid_m)
    row_end = tl.load(tiles_ptr + 2 * n_slots + pid_m)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_in = rows < row_end
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_in, other=0)
    tokens = pairs // top_k
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_x + ks[None, :]

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # ffn columns of this program
    w_base = w_ptr + expert.to(tl.int64) * (2 * ffn_pad) * hidden_pad
    if TILED:
        k_step = (BLOCK_K // 64) * (2 * 64 * 64)
    else:
        k_step = BLOCK_K

    if FUSED:
        # One [BLOCK_K, 2 * BLOCK_N] weight tile per k step, columns [0, BLOCK_N) gate and
        # [BLOCK_N, 2 * BLOCK_N) up, and one tensor-core dot of twice the width: one wgmma of
        # N = 256 instead of two of N = 128 at BLOCK_N = 128 (the A operand read once, not twice).
        both = tl.arange(0, 2 * BLOCK_N)
        is_up = both // BLOCK_N
        ffn_col = pid_n * BLOCK_N + both % BLOCK_N
        w_ptrs = w_base + _gate_up_offsets(ffn_col, is_up, ks, hidden_pad, TILED)
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden_pad, BLOCK_K):
            x = _load_x(x_ptrs, row_in, k0 + ks < hidden_size, EVEN_H)
            w = tl.load(w_ptrs)
            if DOT_FP32:  # the interpreter's bf16 dot is wrong; exact fp32 there
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            w_ptrs += k_step
        # [BLOCK_M, (gate | up), BLOCK_N] -> gate, up: column bit log2(BLOCK_N) of the wgmma
        # accumulator is a register index within each thread, so the split moves no data.
        acc_gate, acc_up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
    else:
        # Two dots of BLOCK_N: the gate tile, and the up tile one 64-block further.
        gate_ptrs = w_base + _gate_up_offsets(cols, 0, ks, hidden_pad, TILED)
        if TILED:
            up_ptrs = gate_ptrs + 64 * 64
        else:
            up_ptrs = gate_ptrs + 64 * hidden_pad
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden_pad, BLOCK_K):
            x = _load_x(x_ptrs, row_in, k0 + ks < hidden_size, EVEN_H)
            w_gate = tl.load(gate_ptrs)
            w_up = tl.load(up_ptrs)
            if DOT_FP32:
                x = x.to(tl.float32)
                w_gate = w_gate.to(tl.float32)
                w_up = w_up.to(tl.float32)
            acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
            x_ptrs += BLOCK_K
            gate_ptrs += k_step
            up_ptrs += k_step

    h = _swiglu(acc_gate, acc_up, b_ptr, expert, cols, ffn_pad, HAS_BIAS, GATE_ALPHA, CLAMP_LIMIT, UP_OFFSET)
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * ffn_pad + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_in[:, None])


@triton.jit(do_not_specialize=["n_slots", "top_k"])
def _down_kernel(
    h_ptr,  # [P, F_PAD]
    w_ptr,  # packed w_down
    out_ptr,  # [T, H] fp32, zero-initialised; atomically accumulated
    sorted_pairs_ptr,
    tiles_ptr,
    topk_weights_ptr,  # [P]
    n_slots,
    hidden_size,
    stride_out,
    ffn_pad,
    hidden_pad,
    top_k,
    b_ptr,  # packed b_down [E, H_PAD] fp32, or None (HAS_BIAS False)
    TILED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    pid_m, pid_n = _tile_coords(pid, n_slots, hidden_pad // BLOCK_N, GROUP_M)
    expert = tl.load(tiles_ptr + pid_m)
    if expert < 0:
        return
    row_start = tl.load(tiles_ptr + n_slots + pid_m)
    row_end = tl.load(tiles_ptr + 2 * n_slots + pid_m)
    rows = row_start + tl.arange(0, BLOCK_M)
    row_in = rows < row_end
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_in, other=0)

    # This split's K blocks (uneven splits allowed: the last ones may get one block fewer).
    k_blocks = ffn_pad // BLOCK_K
    blocks_per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_begin = split * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, k_blocks)
    ks = kb_begin * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * ffn_pad + ks[None, :]

    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns of this program
    w_base = w_ptr + expert.to(tl.int64) * hidden_pad * ffn_pad
    if TILED:
        tile_index = (cols[None, :] // 64) * (ffn_pad // 64) + ks[:, None] // 64
        w_ptrs = w_base + tile_index * (64 * 64) + (cols[None, :] % 64) * 64 + ks[:, None] % 64
        k_step = (BLOCK_K // 64) * (64 * 64)
    else:
        w_ptrs = w_base + cols[None, :] * ffn_pad + ks[:, None]
        k_step = BLOCK_K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(kb_begin, kb_end):
        a = tl.load(a_ptrs, mask=row_in[:, None], other=0.0)
        w = tl.load(w_ptrs)
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += k_step

    if HAS_BIAS:  # once per pair: in the K split 0 program only (the splits' atomics add up)
        bias = tl.load(b_ptr + expert.to(tl.int64) * hidden_pad + cols)
        acc += tl.where(split == 0, bias, 0.0)[None, :]
    route_weight = tl.load(topk_weights_ptr + pairs, mask=row_in, other=0.0).to(tl.float32)
    acc = acc * route_weight[:, None]
    tokens = pairs // top_k
    out_ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_out + cols[None, :]
    out_mask = row_in[:, None] & (cols < hidden_size)[None, :]
    tl.atomic_add(out_ptrs, acc, mask=out_mask, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# Direct decode path: few pairs, no grouping launch
# ----------------------------------------------------------------------------------------------
# With P = T k <= DIRECT_MAX_PAIRS routed pairs, every program reads all P expert ids itself (one
# small load) and takes as its M rows every pair routed to its expert, masking the others. No
# grouping launch, no sorted-pair or tile buffers, no host synchronisation. Expert slot s of the
# grid names its expert one of two ways (BY_PAIR, chosen from shapes alone):
# - P <= E (BY_PAIR): slot s is pair s; it is live when pair s is the first pair routed to its
#   (valid) expert, so each expert hit gets exactly one live slot and the grid is P slots: at T = 1
#   exactly the k experts hit, nothing launched for padding;
# - P > E: slot s is expert s, live when any pair is routed to it (grid E slots).
# M is P padded to 16 (the smallest tensor-core tile), which is what the grouped decode configs
# use too, so the dots do no extra work. The down launch writes the output directly: one program
# per block of hidden columns loops over the live expert slots (the full F reduction of each), so
# the k-way weighted combine happens in registers: no atomics, no fp32 buffer to zero, no cast
# launch, and a deterministic sum.


@triton.jit
def _direct_slot(ids, pairs, ids_ptr, slot, num_experts, BY_PAIR: tl.constexpr):
    """(expert, live) of expert slot `slot`; ids [PAIRS] are the routed ids (-1 past the last pair)."""
    if BY_PAIR:
        expert = tl.load(ids_ptr + slot)
        earlier = tl.sum(((ids == expert) & (pairs < slot)).to(tl.int32), axis=0)
        live = (expert >= 0) & (expert < num_experts) & (earlier == 0)
    else:
        expert = slot
        live = tl.sum((ids == expert).to(tl.int32), axis=0) > 0
    return expert, live


@triton.jit(do_not_specialize=["num_pairs", "top_k"])
def _gate_up_direct_kernel(
    x_ptr,  # [T, H] hidden
    w_ptr,  # packed w_gate_up
    h_ptr,  # [P, F_PAD] out: silu(gate) * up, row p = pair p (rows of invalid pairs left unwritten)
    ids_ptr,  # [P] expert ids, contiguous
    num_pairs,
    top_k,
    num_experts,
    hidden_size,
    stride_x,
    ffn_pad,
    hidden_pad,
    b_ptr,  # packed b_gate_up [E, 2, F_PAD] fp32, or None (HAS_BIAS False)
    TILED: tl.constexpr,
    PAIRS: tl.constexpr,  # P padded to a power of two >= 16: the M tile
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BY_PAIR: tl.constexpr,
    EVEN_H: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATE_ALPHA: tl.constexpr,
    CLAMP_LIMIT: tl.constexpr,
    UP_OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    n_blocks = ffn_pad // BLOCK_N
    slot = pid // n_blocks
    pid_n = pid % n_blocks
    pairs = tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    expert, live = _direct_slot(ids, pairs, ids_ptr, slot, num_experts, BY_PAIR)
    if not live:
        return
    row_in = ids == expert  # live experts are valid ids, so padding rows (-1) never match
    tokens = pairs // top_k
    ks = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_x + ks[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + expert.to(tl.int64) * (2 * ffn_pad) * hidden_pad
    gate_ptrs = w_base + _gate_up_offsets(cols, 0, ks, hidden_pad, TILED)
    if TILED:
        up_ptrs = gate_ptrs + 64 * 64
        k_step = (BLOCK_K // 64) * (2 * 64 * 64)
    else:
        up_ptrs = gate_ptrs + 64 * hidden_pad
        k_step = BLOCK_K
    acc_gate = tl.zeros((PAIRS, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((PAIRS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_pad, BLOCK_K):
        x = _load_x(x_ptrs, row_in, k0 + ks < hidden_size, EVEN_H)
        w_gate = tl.load(gate_ptrs)
        w_up = tl.load(up_ptrs)
        if DOT_FP32:  # the interpreter's bf16 dot is wrong; exact fp32 there
            x = x.to(tl.float32)
            w_gate = w_gate.to(tl.float32)
            w_up = w_up.to(tl.float32)
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += k_step
        up_ptrs += k_step
    h = _swiglu(acc_gate, acc_up, b_ptr, expert, cols, ffn_pad, HAS_BIAS, GATE_ALPHA, CLAMP_LIMIT, UP_OFFSET)
    h_ptrs = h_ptr + pairs[:, None] * ffn_pad + cols[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_in[:, None])


@triton.jit(do_not_specialize=["num_pairs", "top_k", "n_slots"])
def _down_direct_kernel(
    h_ptr,  # [P, F_PAD] from _gate_up_direct_kernel
    w_ptr,  # packed w_down
    out_ptr,  # [T, H] out, hidden's dtype
    ids_ptr,  # [P]
    topk_weights_ptr,  # [P]
    num_pairs,
    top_k,
    n_slots,
    num_experts,
    hidden_size,
    stride_out,
    ffn_pad,
    hidden_pad,
    b_ptr,  # packed b_down [E, H_PAD] fp32, or None (HAS_BIAS False)
    TILED: tl.constexpr,
    PAIRS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BY_PAIR: tl.constexpr,
    FLAT: tl.constexpr,  # one loop over (live expert, K block) instead of a K loop per expert slot
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # hidden columns of this program
    pairs = tl.arange(0, PAIRS)
    pair_in = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=pair_in, other=-1)
    ks = tl.arange(0, BLOCK_K)
    if TILED:
        w_offsets = (cols[None, :] // 64) * (ffn_pad // 64) * (64 * 64) + (cols[None, :] % 64) * 64
        w_offsets += (ks[:, None] // 64) * (64 * 64) + ks[:, None] % 64
        k_step = (BLOCK_K // 64) * (64 * 64)
    else:
        w_offsets = cols[None, :] * ffn_pad + ks[:, None]
        k_step = BLOCK_K
    # Rows are pairs; each pair belongs to one expert, so the experts' masked dots add up to
    # y[p] = W2[e_p] h[p] for every valid pair (rows of other experts load as zeros).
    acc = tl.zeros((PAIRS, BLOCK_N), dtype=tl.float32)
    if FLAT:
        # The live slots compacted up front (vectors over slots, n_slots <= PAIRS), then one loop
        # over (live slot, K block): the software pipeline streams across experts without draining
        # and refilling at each expert, and dead slots cost no iteration.
        slots = tl.arange(0, PAIRS)
        if BY_PAIR:  # slot s = pair s: live when the first pair of a valid expert
            slot_expert = ids
            earlier = tl.sum(
                ((ids[None, :] == ids[:, None]) & (pairs[None, :] < slots[:, None])).to(tl.int32), 1
            )
            slot_live = (ids >= 0) & (ids < num_experts) & (earlier == 0)
        else:  # slot s = expert s: live when any pair is routed to it
            slot_expert = slots
            hits = tl.sum((ids[None, :] == slots[:, None]).to(tl.int32), axis=1)
            slot_live = (slots < n_slots) & (hits > 0)
        live_rank = tl.cumsum(slot_live.to(tl.int32), axis=0) - 1
        n_live = tl.sum(slot_live.to(tl.int32), axis=0)
        k_blocks = ffn_pad // BLOCK_K
        for step in range(0, n_live * k_blocks):
            nth = step // k_blocks
            kb = step - nth * k_blocks
            expert = tl.sum(tl.where(slot_live & (live_rank == nth), slot_expert, 0), axis=0)
            row_in = ids == expert
            a_ptrs = h_ptr + pairs[:, None] * ffn_pad + kb * BLOCK_K + ks[None, :]
            w_ptrs = w_ptr + expert.to(tl.int64) * hidden_pad * ffn_pad + w_offsets + kb * k_step
            a = tl.load(a_ptrs, mask=row_in[:, None], other=0.0)
            w = tl.load(w_ptrs)
            if DOT_FP32:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    else:
        for slot in range(0, n_slots):
            expert, live = _direct_slot(ids, pairs, ids_ptr, slot, num_experts, BY_PAIR)
            row_in = mask_and(ids == expert, live)
            a_ptrs = h_ptr + pairs[:, None] * ffn_pad + ks[None, :]
            w_ptrs = w_ptr + tl.where(live, expert, 0).to(tl.int64) * hidden_pad * ffn_pad + w_offsets
            k_end = tl.where(live, ffn_pad, 0)  # a dead slot runs no iteration (reads nothing)
            for _ in range(0, k_end, BLOCK_K):
                a = tl.load(a_ptrs, mask=row_in[:, None], other=0.0)
                w = tl.load(w_ptrs)
                if DOT_FP32:
                    a = a.to(tl.float32)
                    w = w.to(tl.float32)
                acc = tl.dot(a, w, acc, input_precision=PRECISION)
                a_ptrs += BLOCK_K
                w_ptrs += k_step
    if HAS_BIAS:  # y[p] += b2[e_p] for every valid pair (padding rows and invalid ids add nothing)
        valid = pair_in & (ids >= 0) & (ids < num_experts)
        b_ptrs = b_ptr + tl.where(valid, ids, 0).to(tl.int64)[:, None] * hidden_pad + cols[None, :]
        acc += tl.load(b_ptrs, mask=valid[:, None], other=0.0)
    # Weighted combine of each token's k pairs as one small fp32 product: out = S @ acc with
    # S[t, p] = topk_weights[p] for the pairs p of token t (TOKENS = PAIRS >= T rows).
    route = tl.load(topk_weights_ptr + pairs, mask=pair_in, other=0.0).to(tl.float32)
    tokens = tl.arange(0, PAIRS)
    combine = tl.where((pairs[None, :] // top_k) == tokens[:, None], route[None, :], 0.0)
    out = tl.dot(combine, acc, input_precision="ieee")
    out_ptrs = out_ptr + tokens[:, None] * stride_out + cols[None, :]
    out_mask = (tokens < num_pairs // top_k)[:, None] & (cols < hidden_size)[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=out_mask)


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if (dtype == torch.float32 or interpreting()) else "tf32"


def launch_gate_up(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    grouping: ExpertGrouping,
    dims: PackedDims,
    top_k: int,
    cfg: MoEConfig,
    b_gate_up: torch.Tensor | None = None,
    act: SwiGLU = DEFAULT_SWIGLU,
) -> torch.Tensor:
    num_pairs = grouping.sorted_pairs.numel()
    h = torch.empty(num_pairs, dims.ffn_pad, dtype=hidden.dtype, device=hidden.device)
    grid = (grouping.max_tiles * (dims.ffn_pad // cfg.up_n),)
    launch(
        _gate_up_kernel,
        grid,
        hidden,
        w_gate_up,
        h,
        grouping.sorted_pairs,
        grouping.tiles,
        grouping.max_tiles,
        hidden.shape[1],
        hidden.stride(0),
        dims.ffn_pad,
        dims.hidden_pad,
        top_k,
        b_gate_up,
        TILED=dims.layout == "tiles64",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.up_n,
        BLOCK_K=cfg.up_k,
        GROUP_M=cfg.group_m,
        EVEN_H=hidden.shape[1] % cfg.up_k == 0,
        FUSED=cfg.fused,
        DOT_FP32=interpreting(),
        PRECISION=_precision(hidden.dtype),
        HAS_BIAS=b_gate_up is not None,
        **act.constexprs(),
        num_warps=cfg.up_warps,
        num_stages=cfg.up_stages,
    )
    return h


def launch_down(
    h: torch.Tensor,
    w_down: torch.Tensor,
    out32: torch.Tensor,
    topk_weights: torch.Tensor,
    grouping: ExpertGrouping,
    dims: PackedDims,
    top_k: int,
    cfg: MoEConfig,
    b_down: torch.Tensor | None = None,
) -> None:
    grid = (grouping.max_tiles * (dims.hidden_pad // cfg.down_n), cfg.down_split)
    launch(
        _down_kernel,
        grid,
        h,
        w_down,
        out32,
        grouping.sorted_pairs,
        grouping.tiles,
        topk_weights,
        grouping.max_tiles,
        out32.shape[1],
        out32.stride(0),
        dims.ffn_pad,
        dims.hidden_pad,
        top_k,
        b_down,
        TILED=dims.layout == "tiles64",
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.down_n,
        BLOCK_K=cfg.down_k,
        SPLIT_K=cfg.down_split,
        GROUP_M=cfg.group_m,
        DOT_FP32=interpreting(),
        PRECISION=_precision(h.dtype),
        HAS_BIAS=b_down is not None,
        num_warps=cfg.down_warps,
        num_stages=cfg.down_stages,
    )


# Launching a compiled kernel directly. JITFunction.run binds every argument, specialises it and
# builds a cache key from the options on every call: about 6 us per launch on this project's CPU
# machine, as much as the rest of the direct path's host work together. The direct path instead
# keeps, per kernel and argument signature, the CompiledKernel that its first (ordinary) launch
# returned, and launches it again through CompiledKernel[grid] (Triton's launcher for compiled
# kernels). The signature key holds everything Triton specialises these kernels on: each tensor's
# dtype and 16-byte alignment, and the specialised ints, which are shape constants of the plan (the
# routing-dependent ints are do_not_specialize). Off under the interpreter (nothing is compiled).
FAST_LAUNCH = True


class _CompiledLaunches:
    """Compiled kernels of one @triton.jit kernel by argument signature, launched without rebinding."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.compiled: dict = {}

    def __call__(self, key, grid: tuple, args: tuple, constants: dict, tail: tuple) -> None:
        """Launch kernel[grid](*args, **constants); `tail` holds the constexpr values in parameter order."""
        compiled = self.compiled.get(key) if key is not None else None
        if compiled is not None:
            compiled[grid](*args, *tail)
            return
        compiled = self.kernel[grid](*args, **{**COMPILE_OPTIONS, **constants})
        if key is not None and FAST_LAUNCH and hasattr(compiled, "packed_metadata"):
            self.compiled[key] = compiled


def _constexpr_tail(kernel, num_runtime_args: int, constants: dict) -> tuple:
    """The constexpr values of `constants` in the kernel's parameter order (they follow the runtime args)."""
    names = kernel.arg_names[num_runtime_args:]
    missing = [name for name in names if name not in constants]
    assert not missing, f"{kernel.__name__}: constexprs {missing} have no value"
    return tuple(constants[name] for name in names)


@dataclass(frozen=True)
class _DirectPlan:
    """Everything about a direct-path launch that depends on shapes only, built once per shape."""

    up_grid: tuple[int, int, int]
    down_grid: tuple[int, int, int]
    n_slots: int
    up_constants: dict
    down_constants: dict
    up_tail: tuple
    down_tail: tuple
    key: tuple  # the arguments the plan was built from (hashable, unlike the plan's dicts)


_UP_RUNTIME_ARGS = 12  # _gate_up_direct_kernel's parameters before its constexprs
_DOWN_RUNTIME_ARGS = 14  # _down_direct_kernel's
_gate_up_direct_launches = _CompiledLaunches(_gate_up_direct_kernel)
_down_direct_launches = _CompiledLaunches(_down_direct_kernel)


@functools.lru_cache(maxsize=1024)
def _direct_plan(
    num_pairs: int,
    num_experts: int,
    hidden_size: int,
    dims: PackedDims,
    dtype: torch.dtype,
    interpret: bool,
    up_bias: bool = False,
    down_bias: bool = False,
    act: SwiGLU = DEFAULT_SWIGLU,
) -> _DirectPlan:
    """Launch constants of the direct path. The bias flags and the activation are constexprs of the
    kernels and so part of the plan's key (a bias call never reuses a bias-free compiled kernel)."""
    cfg = direct_config(dims.hidden_pad, dims.ffn_pad).fitted(dims.ffn_pad, dims.hidden_pad)
    cfg = _two_stages_for_fp32(cfg, dtype)
    if dtype == torch.float32:  # and half-width K tiles: the direct configs' K tiles are the widest
        cfg = replace(cfg, up_k=max(SUBTILE, cfg.up_k // 2))
    by_pair = num_pairs <= num_experts
    n_slots = num_pairs if by_pair else num_experts
    shared = dict(
        TILED=dims.layout == "tiles64",
        PAIRS=max(16, triton.next_power_of_2(num_pairs)),
        BY_PAIR=by_pair,
        DOT_FP32=interpret,  # the interpreter's bf16 dot is wrong
        PRECISION="ieee" if (dtype == torch.float32 or interpret) else "tf32",
    )
    up_constants = dict(
        shared,
        BLOCK_N=cfg.up_n,
        BLOCK_K=cfg.up_k,
        EVEN_H=hidden_size % cfg.up_k == 0,
        HAS_BIAS=up_bias,
        **act.constexprs(),
        num_warps=cfg.up_warps,
        num_stages=cfg.up_stages,
    )
    down_constants = dict(
        shared,
        BLOCK_N=cfg.down_n,
        BLOCK_K=cfg.down_k,
        FLAT=cfg.down_flat,
        HAS_BIAS=down_bias,
        num_warps=cfg.down_warps,
        num_stages=cfg.down_stages,
    )
    return _DirectPlan(
        up_grid=(n_slots * (dims.ffn_pad // cfg.up_n), 1, 1),  # 3-D: CompiledKernel[grid] wants all three
        down_grid=(dims.hidden_pad // cfg.down_n, 1, 1),
        n_slots=n_slots,
        up_constants=up_constants,
        down_constants=down_constants,
        up_tail=_constexpr_tail(_gate_up_direct_kernel, _UP_RUNTIME_ARGS, up_constants),
        down_tail=_constexpr_tail(_down_direct_kernel, _DOWN_RUNTIME_ARGS, down_constants),
        key=(num_pairs, num_experts, hidden_size, dims, dtype, interpret, cfg, up_bias, down_bias, act),
    )


def tiled_moe_direct(
    hidden: torch.Tensor,  # [T, H], T k <= DIRECT_MAX_PAIRS
    topk_ids: torch.Tensor,  # [T, k] integer
    topk_weights: torch.Tensor,  # [T, k] float
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    dims: PackedDims,
    b_gate_up: torch.Tensor | None = None,  # packed [E, 2, F_PAD] fp32, contiguous
    b_down: torch.Tensor | None = None,  # packed [E, H_PAD] fp32, contiguous
    act: SwiGLU = DEFAULT_SWIGLU,
) -> torch.Tensor:
    """The direct decode path: two Triton launches, two torch.empty, no grouping, no host sync.

    Inputs already validated. Pairs routed to an id outside [0, E) contribute nothing.
    """
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    # CPU tensors run here only under the interpreter (or in an offline sm_90 compile, see
    # benchmarks/bench_moe.py --prewarm-offline, which must build the GPU variants).
    interpret = False if hidden.is_cuda else interpreting()
    if b_gate_up is None and b_down is None and act is DEFAULT_SWIGLU:  # the bias-free plan, as before
        plan = _direct_plan(num_pairs, dims.num_experts, hidden_size, dims, hidden.dtype, interpret)
    else:
        plan = _direct_plan(
            num_pairs,
            dims.num_experts,
            hidden_size,
            dims,
            hidden.dtype,
            interpret,
            b_gate_up is not None,
            b_down is not None,
            act,
        )
    stride_x, unit_stride = hidden.stride()
    if unit_stride != 1:
        hidden = hidden.contiguous()
        stride_x = hidden_size
    if not topk_ids.is_contiguous():
        topk_ids = topk_ids.contiguous()
    if not topk_weights.is_contiguous():
        topk_weights = topk_weights.contiguous()
    h = torch.empty((num_pairs, dims.ffn_pad), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((num_tokens, hidden_size), dtype=hidden.dtype, device=hidden.device)
    if interpret:
        up_key = down_key = None
    else:  # what Triton specialises on beyond the plan (see FAST_LAUNCH)
        aligned = (
            hidden.data_ptr() % 16 == 0,
            topk_ids.data_ptr() % 16 == 0,
            topk_weights.data_ptr() % 16 == 0,
            w_gate_up.data_ptr() % 16 == 0,
            w_down.data_ptr() % 16 == 0,
        )
        if b_gate_up is not None or b_down is not None:  # (the plan's key says which are present)
            aligned += tuple(b.data_ptr() % 16 == 0 for b in (b_gate_up, b_down) if b is not None)
        up_key = (plan.key, stride_x, w_gate_up.dtype, topk_ids.dtype, aligned, hidden.device.index)
        down_key = (plan.key, w_down.dtype, topk_ids.dtype, topk_weights.dtype, aligned, hidden.device.index)
    _gate_up_direct_launches(
        up_key,
        plan.up_grid,
        (
            hidden,
            w_gate_up,
            h,
            topk_ids,
            num_pairs,
            top_k,
            dims.num_experts,
            hidden_size,
            stride_x,
            dims.ffn_pad,
            dims.hidden_pad,
            b_gate_up,
        ),
        plan.up_constants,
        plan.up_tail,
    )
    _down_direct_launches(
        down_key,
        plan.down_grid,
        (
            h,
            w_down,
            out,
            topk_ids,
            topk_weights,
            num_pairs,
            top_k,
            plan.n_slots,
            dims.num_experts,
            hidden_size,
            hidden_size,  # out's row stride
            dims.ffn_pad,
            dims.hidden_pad,
            b_down,
        ),
        plan.down_constants,
        plan.down_tail,
    )
    return out


def tiled_moe_triton(
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k] integer
    topk_weights: torch.Tensor,  # [T, k] float
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    config: MoEConfig | None = None,
    dims: PackedDims | None = None,
    b_gate_up: torch.Tensor | None = None,  # packed [E, 2, F_PAD] fp32, contiguous
    b_down: torch.Tensor | None = None,  # packed [E, H_PAD] fp32, contiguous
    act: SwiGLU = DEFAULT_SWIGLU,
) -> torch.Tensor:
    """The op on CUDA (or on CPU tensors under TRITON_INTERPRET=1). Inputs already validated.

    No host synchronisation: grouping, both GEMMs and the combine are queued back to back.
    Pairs routed to an expert id outside [0, E) contribute nothing (never read out of bounds).
    With no explicit config and T k <= DIRECT_MAX_PAIRS, the direct decode path (two launches).
    """
    if dims is None:
        dims = packed_dims(w_gate_up, w_down)
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return hidden.new_zeros(0, hidden_size)
    if config is None and num_tokens * top_k <= DIRECT_MAX_PAIRS:
        return tiled_moe_direct(
            hidden, topk_ids, topk_weights, w_gate_up, w_down, dims, b_gate_up, b_down, act
        )
    if config is None:
        cfg = lookup_config(num_tokens, top_k, dims.num_experts, dims.hidden_pad, dims.ffn_pad)
        cfg = _two_stages_for_fp32(cfg, hidden.dtype)
    else:
        cfg = _fitted(config, dims.ffn_pad, dims.hidden_pad)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    grouping = group_by_expert(topk_ids, dims.num_experts, cfg.block_m)
    h = launch_gate_up(hidden, w_gate_up, grouping, dims, top_k, cfg, b_gate_up, act)
    out32 = torch.zeros(num_tokens, hidden_size, dtype=torch.float32, device=hidden.device)
    launch_down(h, w_down, out32, topk_weights.reshape(-1).contiguous(), grouping, dims, top_k, cfg, b_down)
    return out32.to(hidden.dtype)
