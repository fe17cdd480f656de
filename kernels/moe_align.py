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

Three implementations with identical results (on the GPU none synchronises with the host):
- `group_by_expert_triton`, one Triton launch for up to TRITON_MAX_PAIRS pairs (decode and small
  prefill): every pair counts the pairs sorted before it, O(P^2) compares spread over P / 64
  programs, and program 0 also builds the tile table. At 4096 pairs that is 16M compares, a few
  microseconds; at 32768 it would be 1G compares and program 0 alone would count all P pairs
  per expert, so it does not scale.
- `group_by_expert_blocked`, two Triton launches for any P: a per-block histogram (the pairs cut
  into NB <= 64 blocks), then a scatter in which each block's program sums the block histograms
  (O(NB * bins), from L2) into its own starting row per expert, ranks its pairs within the block
  and writes them to their sorted positions; program 0 also builds the tile table. Work is
  O(P * block + NB^2 * bins), the grid is NB, both from shapes alone.
- `group_by_expert_torch`, torch ops only (sort, scatter_add, cumsum, searchsorted): the
  reference, and the route for CPU tensors outside the interpreter. It was the GPU route for
  P > 4096 until the blocked kernels replaced it. Measured alone on the H200 at 8192-32768 pairs
  (benchmarks/RESULTS.md): 0.41-0.73 ms per call, with no host synchronisation
  (torch.cuda.set_sync_debug_mode raised nothing), so the cost is its ~15 kernels and their
  launches; the blocked route took 38-78 us and the single launch 158-234 us at 8192 pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fast_launch import interpreting, launch

# Single-launch route: O(P^2) compares (see the module docstring); at 4096 pairs still a few us.
TRITON_MAX_PAIRS = 4096
_PAIR_BLOCK = 64
_SCAN_BLOCK = 64
_SLOT_BLOCK = 32
# Blocked route: at most _MAX_BLOCKS blocks of at least _MIN_BLOCK_PAIRS pairs. Every scatter program
# re-reads all block histograms (NB * bins ints), so NB stays small; the block then grows with P,
# and ranking within a block costs O(block^2 / 2) compares per program. Every 2-D intermediate
# (pairs x bins, pairs x pairs, blocks x bins) is kept at <= _MATRIX_ELEMENTS elements.
_MAX_BLOCKS = 64
_MIN_BLOCK_PAIRS = 256
_RANK_CHUNK = 64
_BLOCK_ROWS = 16
_MATRIX_ELEMENTS = 4096


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
        _write_tile_table(tiles_ptr, counts, n_slots, BLOCK_M, EXPERT_BLOCK, SLOT_BLOCK)


@triton.jit
def _write_tile_table(
    tiles_ptr, counts, n_slots, block_m, EXPERT_BLOCK: tl.constexpr, SLOT_BLOCK: tl.constexpr
):
    """tiles[:, s] = (expert, first row, one past last row) for every slot s < n_slots.

    counts [EXPERT_BLOCK]: pairs per expert (0 past the last expert). Expert e owns the
    ceil(counts[e] / block_m) slots after those of experts < e; later slots get (-1, 0, 0).
    """
    experts = tl.arange(0, EXPERT_BLOCK)
    tiles_per_expert = (counts + block_m - 1) // block_m
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
        start = expert_row_begin + (slots - first_slot) * block_m
        end = tl.minimum(start + block_m, expert_row_end)
        slot_in = slots < n_slots
        tl.store(tiles_ptr + slots, tl.where(used, expert, -1), mask=slot_in)
        tl.store(tiles_ptr + n_slots + slots, tl.where(used, start, 0), mask=slot_in)
        tl.store(tiles_ptr + 2 * n_slots + slots, tl.where(used, end, 0), mask=slot_in)


@triton.jit
def _sort_keys(ids_ptr, pairs, pair_in, num_experts, PAD_KEY: tl.constexpr):
    """Sort key per pair: its expert, num_experts for ids outside [0, E), PAD_KEY past the end."""
    ids = tl.load(ids_ptr + pairs, mask=pair_in, other=0)
    keys = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)
    return tl.where(pair_in, keys, PAD_KEY)


@triton.jit(do_not_specialize=["num_pairs", "num_experts"])
def _block_histogram_kernel(
    ids_ptr,
    block_counts_ptr,  # [num_blocks, BINS] out
    num_pairs,
    num_experts,
    BLOCK_P: tl.constexpr,
    BINS: tl.constexpr,  # power of 2 > num_experts: bins 0..E-1 experts, bin E invalid ids
    CHUNK: tl.constexpr,
):
    block = tl.program_id(0)
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, BLOCK_P, CHUNK):
        pairs = block * BLOCK_P + c0 + tl.arange(0, CHUNK)
        keys = _sort_keys(ids_ptr, pairs, pairs < num_pairs, num_experts, BINS)
        counts += tl.sum((keys[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(block_counts_ptr + block * BINS + bins, counts)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_blocks", "n_slots", "block_m"])
def _block_scatter_kernel(
    ids_ptr,
    block_counts_ptr,  # [num_blocks, BINS] from _block_histogram_kernel
    sorted_pairs_ptr,
    tiles_ptr,
    num_pairs,
    num_experts,
    num_blocks,
    n_slots,
    block_m,
    BLOCK_P: tl.constexpr,
    BINS: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,  # this block's pairs handled CHUNK at a time ([CHUNK, BINS] gathers)
    OTHERS: tl.constexpr,  # compared against OTHERS pairs at a time ([CHUNK, OTHERS] compares)
    SLOT_BLOCK: tl.constexpr,
):
    block = tl.program_id(0)
    bins = tl.arange(0, BINS)
    # 1. Totals per bin, and this block's start per bin: the pairs of that bin in earlier blocks.
    totals = tl.zeros([BINS], dtype=tl.int32)
    earlier = tl.zeros([BINS], dtype=tl.int32)
    for r0 in range(0, num_blocks, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        row_in = (rows < num_blocks)[:, None]
        counts = tl.load(block_counts_ptr + rows[:, None] * BINS + bins[None, :], mask=row_in, other=0)
        totals += tl.sum(counts, axis=0)
        earlier += tl.sum(tl.where((rows < block)[:, None], counts, 0), axis=0)
    # Sorted order is by bin (invalid ids, bin E, after every expert), then by pair index.
    start = tl.cumsum(totals, 0) - totals + earlier

    # 2. Each pair's sorted position: its bin's start + pairs of its bin before it in this block.
    block_first = block * BLOCK_P
    for m0 in range(0, BLOCK_P, CHUNK):
        mine = block_first + m0 + tl.arange(0, CHUNK)
        mine_in = mine < num_pairs
        keys = _sort_keys(ids_ptr, mine, mine_in, num_experts, BINS)
        same_bin = keys[:, None] == bins[None, :]
        position = tl.sum(tl.where(same_bin, start[None, :], 0), axis=1)
        for o0 in range(0, m0 + CHUNK, OTHERS):
            others = block_first + o0 + tl.arange(0, OTHERS)
            other_keys = _sort_keys(ids_ptr, others, others < num_pairs, num_experts, BINS)
            before = (other_keys[None, :] == keys[:, None]) & (others[None, :] < mine[:, None])
            position += tl.sum(before.to(tl.int32), axis=1)
        tl.store(sorted_pairs_ptr + position, mine, mask=mine_in)

    # 3. Program 0 also builds the tile table (bins past the last expert hold no tiles).
    if block == 0:
        _write_tile_table(
            tiles_ptr, tl.where(bins < num_experts, totals, 0), n_slots, block_m, BINS, SLOT_BLOCK
        )


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
    launch(
        _align_kernel,
        grid,
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


def blocked_layout(num_pairs: int) -> tuple[int, int]:
    """(pairs per block, number of blocks) of the blocked route, from the pair count alone."""
    block = max(_MIN_BLOCK_PAIRS, triton.next_power_of_2(triton.cdiv(num_pairs, _MAX_BLOCKS)))
    return block, triton.cdiv(num_pairs, block)


def group_by_expert_blocked(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """Two Triton launches (histogram, scatter), no host sync; scales to any number of pairs."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    n_slots = max_tiles(num_pairs, num_experts, block_m)
    block_pairs, num_blocks = blocked_layout(num_pairs)
    bins = triton.next_power_of_2(num_experts + 1)  # + 1: the bin of ids outside [0, E)
    device = flat.device
    block_counts = torch.empty(num_blocks, bins, dtype=torch.int32, device=device)
    sorted_pairs = torch.empty(num_pairs, dtype=torch.int32, device=device)
    tiles = torch.empty(3, n_slots, dtype=torch.int32, device=device)
    # Many bins: fewer pairs per chunk keeps the [chunk, bins] matrices at <= 4096 elements (registers).
    chunk = max(8, min(_RANK_CHUNK, _MATRIX_ELEMENTS // bins))
    launch(
        _block_histogram_kernel,
        (num_blocks,),
        flat,
        block_counts,
        num_pairs,
        num_experts,
        BLOCK_P=block_pairs,
        BINS=bins,
        CHUNK=chunk,
        num_warps=4,
    )
    launch(
        _block_scatter_kernel,
        (num_blocks,),
        flat,
        block_counts,
        sorted_pairs,
        tiles,
        num_pairs,
        num_experts,
        num_blocks,
        n_slots,
        block_m,
        BLOCK_P=block_pairs,
        BINS=bins,
        ROWS=max(1, min(_BLOCK_ROWS, _MATRIX_ELEMENTS // bins)),
        CHUNK=chunk,
        OTHERS=_MATRIX_ELEMENTS // chunk,
        SLOT_BLOCK=max(1, min(_SLOT_BLOCK, _MATRIX_ELEMENTS // bins)),
        num_warps=4,
    )
    return ExpertGrouping(sorted_pairs, tiles, block_m)


def group_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertGrouping:
    """Group routed pairs by expert into tiles of at most `block_m` pairs, on topk_ids' device."""
    num_pairs = topk_ids.numel()
    if num_pairs == 0 or not (topk_ids.is_cuda or interpreting()):
        return group_by_expert_torch(topk_ids, num_experts, block_m)
    if num_pairs <= TRITON_MAX_PAIRS:
        return group_by_expert_triton(topk_ids, num_experts, block_m)
    return group_by_expert_blocked(topk_ids, num_experts, block_m)
