"""Token grouping for the tiled MoE GEMMs: which routed (token, slot) pairs each M tile computes.

A *pair* p = token * k + slot is one routed copy of a token (topk_ids.flatten()[p] is its expert).
The GEMM kernels need the pairs grouped by expert and cut into tiles of at most BLOCK_M pairs of
one expert. Everything here runs on the device with no host synchronisation: the number of tiles
depends on the routing, so the launch grid uses a bound computed from shapes alone
(`max_tiles`), and tile slots past the real count carry expert -1, which makes their programs
exit at once. Unlike padding every expert to a multiple of BLOCK_M (vLLM's moe_align_block_size),
no tile holds padding rows beyond its expert's last pair, and at T = 1 the bound is exactly k
tiles, so the decode path launches no dead work.

Output, `ExpertGrouping`:
- sorted_pairs int32 [P]: pair indices, stably sorted by expert. Pairs routed to an id outside
  [0, E) sort last and belong to no tile: they contribute nothing and are never used to index
  expert weights (the op's `validate=True` turns them into an error instead).
- tiles int32 [3, max_tiles]: per tile slot, (expert or -1, first row, one past last row), rows
  indexing sorted_pairs.

Two implementations with identical results: one Triton launch for up to TRITON_MAX_PAIRS pairs
(decode and small prefill, where the six to ten small torch kernels of the sort/histc/cumsum
route would cost more than the grouping itself), and the torch route for larger batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The Triton route compares every pair with every other (O(P^2) work spread over P / PAIR_BLOCK
# programs); at 4096 pairs that is 16M compares, a few microseconds, still cheaper than torch.sort.
TRITON_MAX_PAIRS = 4096
_PAIR_BLOCK = 64
_SCAN_BLOCK = 64
_SLOT_BLOCK = 32


@dataclass(frozen=True)
class ExpertGrouping:
    sorted_pairs: torch.Tensor  # int32 [P]
    tiles: torch.Tensor  # int32 [3, max_tiles]: expert (-1 = unused slot), row_start, row_end
    block_m: int

    @property
    def max_tiles(self) -> int:
        return self.tiles.shape[1]


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m), from shapes only (no look at the routing)."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def group_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """Reference grouping with torch ops only (sort, scatter_add, cumsum, searchsorted): no host sync."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    keys = torch.where(valid, flat, num_experts)  # invalid ids sort after every real expert
    _, order = torch.sort(keys, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, keys, torch.ones_like(keys))
    counts = counts[:num_experts]
    row_end = torch.cumsum(counts, 0)
    row_begin = row_end - counts
    tiles_per_expert = (counts + block_m - 1) // block_m
    slot_end = torch.cumsum(tiles_per_expert, 0)
    slot_begin = slot_end - tiles_per_expert
    n_slots = max_tiles(num_pairs, num_experts, block_m)
    slots = torch.arange(n_slots, device=device)
    expert = torch.searchsorted(slot_end, slots, right=True)  # first e with slot_end[e] > slot
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    start = row_begin[e] + (slots - slot_begin[e]) * block_m
    end = torch.minimum(start + block_m, row_end[e])
    # Unused slots: expert -1 and an empty row range, so no reader can mistake them for work.
    tiles = torch.stack(
        [torch.where(used, expert, -1), torch.where(used, start, 0), torch.where(used, end, 0)]
    ).to(torch.int32)
    return ExpertGrouping(order.to(torch.int32), tiles.contiguous(), block_m)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "n_slots"])
def _align_kernel(
    ids_ptr,
    sorted_pairs_ptr,
    tiles_ptr,
    num_pairs,
    num_experts,
    n_slots,
    BLOCK_M: tl.constexpr,
    PAIR_BLOCK: tl.constexpr,
    SCAN_BLOCK: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    # 1. Sorted position of each of this program's pairs = number of pairs ordered before it
    #    (smaller expert, or same expert and smaller index: a stable sort).
    pairs = pid * PAIR_BLOCK + tl.arange(0, PAIR_BLOCK)
    pair_in = pairs < num_pairs
    ids = tl.load(ids_ptr + pairs, mask=pair_in, other=0)
    keys = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
    before = tl.zeros([PAIR_BLOCK], dtype=tl.int32)
    for q0 in range(0, num_pairs, SCAN_BLOCK):
        others = q0 + tl.arange(0, SCAN_BLOCK)
        other_in = others < num_pairs
        other_ids = tl.load(ids_ptr + others, mask=other_in, other=0)
        other_keys = tl.where((other_ids >= 0) & (other_ids < num_experts), other_ids, num_experts)
        other_keys = other_keys.to(tl.int32)
        earlier = (other_keys[None, :] < keys[:, None]) | (
            (other_keys[None, :] == keys[:, None]) & (others[None, :] < pairs[:, None])
        )
        earlier = earlier & other_in[None, :]
        before += tl.sum(earlier.to(tl.int32), axis=1)
    tl.store(sorted_pairs_ptr + before, pairs, mask=pair_in)

    # 2. Program 0 also builds the tile table from the per-expert counts.
    if pid == 0:
        experts = tl.arange(0, EXPERT_BLOCK)
        counts = tl.zeros([EXPERT_BLOCK], dtype=tl.int32)
        for q0 in range(0, num_pairs, SCAN_BLOCK):
            others = q0 + tl.arange(0, SCAN_BLOCK)
            other_in = others < num_pairs
            other_ids = tl.load(ids_ptr + others, mask=other_in, other=-1).to(tl.int32)
            hit = (other_ids[None, :] == experts[:, None]) & other_in[None, :]
            counts += tl.sum(hit.to(tl.int32), axis=1)
        counts = tl.where(experts < num_experts, counts, 0)
        tiles_per_expert = (counts + BLOCK_M - 1) // BLOCK_M
        slot_end = tl.cumsum(tiles_per_expert, 0)
        slot_begin = slot_end - tiles_per_expert
        row_end = tl.cumsum(counts, 0)
        row_begin = row_end - counts
        for s0 in range(0, n_slots, SLOT_BLOCK):
            slots = s0 + tl.arange(0, SLOT_BLOCK)
            # owner[s, e]: slot s is one of expert e's tiles (at most one e per slot).
            owner = (slot_begin[None, :] <= slots[:, None]) & (slots[:, None] < slot_end[None, :])
            used = tl.sum(owner.to(tl.int32), axis=1) > 0
            expert = tl.sum(tl.where(owner, experts[None, :], 0), axis=1)
            first_slot = tl.sum(tl.where(owner, slot_begin[None, :], 0), axis=1)
            expert_row_begin = tl.sum(tl.where(owner, row_begin[None, :], 0), axis=1)
            expert_row_end = tl.sum(tl.where(owner, row_end[None, :], 0), axis=1)
            start = expert_row_begin + (slots - first_slot) * BLOCK_M
            end = tl.minimum(start + BLOCK_M, expert_row_end)
            slot_in = slots < n_slots
            tl.store(tiles_ptr + slots, tl.where(used, expert, -1), mask=slot_in)
            tl.store(tiles_ptr + n_slots + slots, tl.where(used, start, 0), mask=slot_in)
            tl.store(tiles_ptr + 2 * n_slots + slots, tl.where(used, end, 0), mask=slot_in)


def group_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """One Triton launch (no host sync); meant for up to TRITON_MAX_PAIRS pairs."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    n_slots = max_tiles(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=flat.device)
    tiles = torch.empty(3, n_slots, dtype=torch.int32, device=flat.device)
    grid = (triton.cdiv(num_pairs, _PAIR_BLOCK),)
    _align_kernel[grid](
        flat,
        sorted_pairs,
        tiles,
        num_pairs,
        num_experts,
        n_slots,
        BLOCK_M=block_m,
        PAIR_BLOCK=_PAIR_BLOCK,
        SCAN_BLOCK=_SCAN_BLOCK,
        EXPERT_BLOCK=triton.next_power_of_2(num_experts),
        SLOT_BLOCK=_SLOT_BLOCK,
        num_warps=4,
    )
    return ExpertGrouping(sorted_pairs, tiles, block_m)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """Group routed pairs by expert into tiles of at most `block_m` pairs, on topk_ids' device."""
    num_pairs = topk_ids.numel()
    if num_pairs == 0:
        return group_by_expert_torch(topk_ids, num_experts, block_m)
    triton_can_run = topk_ids.is_cuda or interpreting()
    if triton_can_run and num_pairs <= TRITON_MAX_PAIRS:
        return group_by_expert_triton(topk_ids, num_experts, block_m)
    return group_by_expert_torch(topk_ids, num_experts, block_m)
