"""wmoe::tiled_moe: packing, token grouping, Triton kernels (interpreter on CPU, real shapes on GPU).

Every numeric check compares against a plain per-expert loop in fp32 on unpacked weights.
GPU tests: `python -m pytest -m gpu tests/test_tiled_moe.py` after `pip install -e .`; with the
package put on PYTHONPATH instead, add -P (`python -P -m pytest ...`), or the repository root, first
on sys.path, shadows it with a wmoe_compile/ that has no kernels/ mapped in.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import pytest
import torch
from torch import nn
from wmoe_compile.kernels import moe_align
from wmoe_compile.kernels import tiled_moe as tm

import wmoe_compile
import wmoe_compile.ops.moe  # noqa: F401  (registers wmoe::tiled_moe)
from wmoe_compile.moe_packing import pack_expert_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 rounds the SwiGLU intermediate h to 8 bits of mantissa; fp16 to 11.
REL_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def random_experts(num_experts, hidden, ffn, device="cpu"):
    """fp32 gate, up [E, F, H] and down [E, H, F], scaled so outputs stay O(1)."""
    gate = torch.randn(num_experts, ffn, hidden, device=device) / hidden**0.5
    up = torch.randn(num_experts, ffn, hidden, device=device) / hidden**0.5
    down = torch.randn(num_experts, hidden, ffn, device=device) / ffn**0.5
    return gate, up, down


def random_routing(num_tokens, top_k, num_experts, device="cpu", allowed=None):
    """Distinct experts per token (as top-k gives), drawn from `allowed` (default all)."""
    pool = torch.arange(num_experts) if allowed is None else torch.as_tensor(allowed)
    ids = torch.stack([pool[torch.randperm(len(pool))[:top_k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k) + 0.05
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(device), weights.to(device)


def rel_err(got, ref):
    assert torch.isfinite(got).all(), "NaN/inf in the output"
    return ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_case(num_tokens, top_k, num_experts, hidden, ffn, dtype, layout, allowed=None, config=None):
    # On a GPU machine these small cases run the compiled kernels; on the CPU, the interpreter.
    gate, up, down = random_experts(num_experts, hidden, ffn, device=DEVICE)
    x = torch.randn(num_tokens, hidden, device=DEVICE)
    ids, weights = random_routing(num_tokens, top_k, num_experts, device=DEVICE, allowed=allowed)
    packed = pack_expert_weights(w1=gate, w3=up, w2=down, layout=layout, dtype=dtype)
    got = tm.tiled_moe_triton(x.to(dtype), ids, weights, packed.w_gate_up, packed.w_down, config=config)
    # Reference on the same rounded weights and inputs, computed in fp32.
    ref = tm.moe_reference(
        x.to(dtype).float(), ids, weights, *(w.to(dtype).float() for w in (gate, up, down))
    )
    assert got.dtype == dtype and got.shape == (num_tokens, hidden)
    err = rel_err(got, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"
    return got, ref


# ---------------------------------------------------------------- packing


@pytest.mark.parametrize("layout", tm.LAYOUTS)
def test_pack_unpack_roundtrip_pads_with_zeros(layout):
    gate, up, down = random_experts(3, 72, 100)
    w_gate_up, w_down = tm.pack_gate_up(gate, up, layout), tm.pack_down(down, layout)
    dims = tm.packed_dims(w_gate_up, w_down)
    assert (dims.num_experts, dims.ffn_pad, dims.hidden_pad, dims.layout) == (3, 128, 128, layout)
    g, u = tm.unpack_gate_up(w_gate_up, layout)
    d = tm.unpack_down(w_down, layout)
    assert torch.equal(g[:, :100, :72], gate) and torch.equal(u[:, :100, :72], up)
    assert torch.equal(d[:, :72, :100], down)
    assert g[:, 100:].abs().sum() == 0 and g[:, :, 72:].abs().sum() == 0 and d[:, 72:].abs().sum() == 0


def test_tiles64_gate_and_up_subtiles_are_adjacent():
    gate, up, _ = random_experts(2, 128, 128)
    packed = tm.pack_gate_up(gate, up, "tiles64")  # [E, F/64, H/64, 2, 64, 64]
    flat = packed.reshape(-1)
    # expert 1, ffn block 1, k block 0: gate tile then up tile, one contiguous 16 KB chunk.
    start = ((1 * 2 + 1) * 2 + 0) * 2 * 64 * 64
    assert torch.equal(flat[start : start + 4096].view(64, 64), gate[1, 64:128, :64])
    assert torch.equal(flat[start + 4096 : start + 8192].view(64, 64), up[1, 64:128, :64])


def test_pack_accepts_hf_fused_tensors_and_flags():
    gate, up, down = random_experts(4, 64, 96)
    ref = pack_expert_weights(w1=gate, w3=up, w2=down)
    concat = pack_expert_weights(gate_up_proj=torch.cat([gate, up], 1), down_proj=down)
    transposed = pack_expert_weights(
        gate_up_proj=torch.cat([gate, up], 1).transpose(1, 2),
        down_proj=down.transpose(1, 2),
        is_transposed=True,
    )
    interleaved = pack_expert_weights(
        gate_up_proj=torch.stack([gate, up], 2).reshape(4, 192, 64), down_proj=down, is_concatenated=False
    )
    per_expert = pack_expert_weights(w1=list(gate), w3=list(up), w2=list(down))
    for packed in (concat, transposed, interleaved, per_expert):
        assert torch.equal(packed.w_gate_up, ref.w_gate_up) and torch.equal(packed.w_down, ref.w_down)
    assert (ref.num_experts, ref.hidden_size, ref.ffn_size, ref.layout) == (4, 64, 96, tm.DEFAULT_LAYOUT)


def test_pack_accepts_hf_transformers_experts_modules():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    for cls, config in (
        (
            MixtralExperts,
            transformers.MixtralConfig(hidden_size=64, intermediate_size=96, num_local_experts=4),
        ),
        (
            Qwen3MoeExperts,
            transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=96, num_experts=4),
        ),
    ):
        experts = cls(config)
        with torch.no_grad():
            experts.gate_up_proj.normal_(0, 64**-0.5)
            experts.down_proj.normal_(0, 96**-0.5)
        packed = pack_expert_weights(experts)
        x = torch.randn(5, 64)
        ids, weights = random_routing(5, 2, 4)
        with torch.no_grad():
            hf = experts(x, ids, weights)
        got = packed(x, ids, weights)
        assert rel_err(got, hf) < 1e-5, cls.__name__


def test_pack_accepts_reference_model_moe():
    model = wmoe_compile.models.mixtral.MixtralModel(wmoe_compile.models.mixtral.get_config("tiny"))
    moe = model.layers[0].moe
    packed = pack_expert_weights(moe)  # finds .experts, a ModuleList of w1/w3/w2 experts
    x = torch.randn(6, moe.cfg.hidden_size)
    ids, weights = random_routing(6, 2, moe.cfg.num_experts)
    with torch.no_grad():
        expected = torch.zeros_like(x)
        for t in range(6):
            for j in range(2):
                expected[t] += weights[t, j] * moe.experts[int(ids[t, j])](x[t])
    assert rel_err(packed(x, ids, weights), expected) < 1e-5


def test_pack_rejects_bad_weights_with_the_expected_layout():
    gate, up, down = random_experts(4, 64, 96)
    with pytest.raises(ValueError, match=r"gate_up_proj \[num_experts, 2 \* ffn, hidden\]"):
        pack_expert_weights(gate_up_proj=torch.cat([gate, up], 1), down_proj=down.transpose(1, 2))
    with pytest.raises(ValueError, match=r"gate_up_proj \[num_experts, 2 \* ffn, hidden\]"):
        pack_expert_weights(gate_up_proj=gate[0], down_proj=down)
    with pytest.raises(ValueError, match=r"w2 \(down\) \[hidden, ffn\]"):
        pack_expert_weights(w1=gate, w3=up, w2=down.transpose(1, 2))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        pack_expert_weights(w1=gate.to(torch.int8), w3=up, w2=down)
    with pytest.raises(ValueError, match="exactly one weight source"):
        pack_expert_weights(w1=gate, w3=up, w2=down, gate_up_proj=gate)
    with pytest.raises(ValueError, match="layout"):
        pack_expert_weights(w1=gate, w3=up, w2=down, layout="tiles32")
    with pytest.raises(ValueError, match="w1/w3/w2"):
        pack_expert_weights(nn.ModuleList([nn.Linear(4, 4)]))


# ---------------------------------------------------------------- grouping


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,block_m",
    [(1, 2, 8, 16), (7, 2, 8, 16), (40, 8, 64, 16), (130, 2, 8, 64), (9, 1, 4, 16), (24, 8, 256, 32)],
)
def test_triton_grouping_matches_torch(num_tokens, top_k, num_experts, block_m):
    ids, _ = random_routing(num_tokens, top_k, num_experts, device=DEVICE)
    if num_tokens > 5:  # ids outside [0, E) must land in no tile
        ids[2, 0] = num_experts + 3
        ids[4, -1] = -1
    got = moe_align.group_by_expert_triton(ids, num_experts, block_m)
    ref = moe_align.group_by_expert_torch(ids, num_experts, block_m)
    assert torch.equal(got.sorted_pairs, ref.sorted_pairs) and torch.equal(got.tiles, ref.tiles)
    # Each used tile: one expert, at most block_m rows, all pairs of that expert.
    flat = ids.reshape(-1)
    flat, ref = flat.cpu(), moe_align.ExpertGrouping(ref.sorted_pairs.cpu(), ref.tiles.cpu(), block_m)
    expert, start, end = ref.tiles.tolist()
    covered = []
    for e, s, t in zip(expert, start, end, strict=True):
        if e < 0:
            continue
        assert 0 < t - s <= block_m
        pairs = ref.sorted_pairs[s:t].long()
        assert (flat[pairs] == e).all()
        covered += pairs.tolist()
    valid = ((flat >= 0) & (flat < num_experts)).nonzero().flatten().tolist()
    assert sorted(covered) == valid
    assert len(expert) == moe_align.max_tiles(flat.numel(), num_experts, block_m)


def assert_same_grouping(got, ref):
    assert torch.equal(got.sorted_pairs, ref.sorted_pairs), "sorted pairs differ from the torch route"
    assert torch.equal(got.tiles, ref.tiles), "tile table differs from the torch route"


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,block_m",
    [
        (700, 8, 64, 128),  # 5600 pairs: above TRITON_MAX_PAIRS, 22 blocks of 256
        (2100, 2, 8, 64),  # 4200 pairs, few experts
        (9, 1, 4, 16),  # one partial block
    ],
)
def test_blocked_grouping_matches_torch(num_tokens, top_k, num_experts, block_m):
    ids, _ = random_routing(num_tokens, top_k, num_experts, device=DEVICE)
    ids[2, 0] = num_experts + 3  # ids outside [0, E) sort last and land in no tile
    ids[5 % num_tokens, -1] = -1
    got = moe_align.group_by_expert_blocked(ids, num_experts, block_m)
    assert_same_grouping(got, moe_align.group_by_expert_torch(ids, num_experts, block_m))


def test_blocked_grouping_many_blocks_many_bins(monkeypatch):
    # Small blocks so 2400 pairs span 5 blocks; E = 256 gives 512 bins and the narrowest chunks.
    monkeypatch.setattr(moe_align, "_MIN_BLOCK_PAIRS", 64)
    monkeypatch.setattr(moe_align, "_MAX_BLOCKS", 8)
    assert moe_align.blocked_layout(2400) == (512, 5)
    ids, _ = random_routing(300, 8, 256, device=DEVICE)
    ids[7, 3] = 999
    got = moe_align.group_by_expert_blocked(ids, 256, 16)
    assert_same_grouping(got, moe_align.group_by_expert_torch(ids, 256, 16))


def test_blocked_layout_bounds_blocks_and_grows_block():
    for num_pairs in (1, 4097, 32768, 131072, 1 << 20):
        block, blocks = moe_align.blocked_layout(num_pairs)
        assert blocks <= moe_align._MAX_BLOCKS and block >= moe_align._MIN_BLOCK_PAIRS
        assert (blocks - 1) * block < num_pairs <= blocks * block


def test_grouping_dispatch_by_pair_count(monkeypatch):
    routes = []
    for name in ("group_by_expert_triton", "group_by_expert_blocked", "group_by_expert_torch"):
        real = getattr(moe_align, name)
        monkeypatch.setattr(moe_align, name, lambda *a, name=name, real=real: routes.append(name) or real(*a))
    monkeypatch.setattr(moe_align, "TRITON_MAX_PAIRS", 16)
    for num_tokens in (8, 9):  # 16 pairs: single launch; 18 pairs: blocked
        ids, _ = random_routing(num_tokens, 2, 8, device=DEVICE)
        moe_align.group_by_expert(ids, 8, 16)
    assert routes == ["group_by_expert_triton", "group_by_expert_blocked"]


def test_decode_grid_has_no_dead_tiles():
    # T = 1: exactly k tiles, each one pair; nothing launched for padding.
    ids, _ = random_routing(1, 2, 8, device=DEVICE)
    grouping = moe_align.group_by_expert(ids, 8, 16)
    assert grouping.max_tiles == 2
    assert sorted(grouping.tiles[0].tolist()) == sorted(ids[0].tolist())
    assert (grouping.tiles[2] - grouping.tiles[1]).tolist() == [1, 1]


# ---------------------------------------------------------------- kernels vs the fp32 loop


@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts,hidden,ffn,dtype",
    [
        (1, 2, 8, 128, 192, torch.float32),  # decode, T = 1
        (5, 1, 4, 64, 128, torch.float16),  # k = 1
        (19, 2, 8, 72, 100, torch.float16),  # sizes not multiples of 64 (zero padding)
        (12, 8, 64, 64, 64, torch.float32),  # k = 8, many experts
        (33, 2, 4, 128, 128, torch.bfloat16),  # bf16 (the interpreter path dots in fp32)
    ],
)
def test_triton_matches_fp32_loop(num_tokens, top_k, num_experts, hidden, ffn, dtype, layout):
    run_case(num_tokens, top_k, num_experts, hidden, ffn, dtype, layout)


def test_experts_without_tokens_and_all_tokens_on_one_expert():
    # Experts 1, 2, 4.. get nothing; with k = 1 and one allowed expert all 40 tokens (3 M tiles) hit it.
    run_case(40, 1, 8, 64, 128, torch.float16, "tiles64", allowed=[5])
    run_case(23, 2, 8, 64, 128, torch.float32, "rows", allowed=[0, 3])


@pytest.mark.parametrize(
    "config,layout",
    [
        (tm.MoEConfig(16, 32, 64, 4, 2, 32, 64, 3, 4, 2), "tiles64"),  # split-K 3 over 3 K blocks
        (tm.MoEConfig(16, 64, 128, 4, 2, 64, 64, 2, 4, 2, group_m=1), "tiles64"),  # uneven split (3 / 2)
        (tm.MoEConfig(32, 128, 64, 4, 2, 128, 128, 1, 4, 2), "tiles64"),  # wider tiles than the packed 64
        # gate and up as one dot of 2 * up_n columns: 128 (two 64-column sub-tiles each), 64, and 32
        # (half a packed sub-tile), in both layouts.
        (tm.MoEConfig(32, 128, 64, 4, 2, 64, 64, 1, 4, 2, fused=True), "tiles64"),
        (tm.MoEConfig(16, 64, 128, 4, 2, 64, 64, 1, 4, 2, fused=True), "rows"),
        (tm.MoEConfig(16, 32, 64, 4, 2, 32, 64, 3, 4, 2, fused=True), "tiles64"),
    ],
)
def test_explicit_launch_configs(config, layout):
    run_case(37, 2, 8, 128, 192, torch.float32, layout, config=config)


def test_blocked_grouping_route_for_large_batches(monkeypatch):
    monkeypatch.setattr(moe_align, "TRITON_MAX_PAIRS", 8)
    run_case(20, 2, 8, 64, 64, torch.float32, "tiles64")


@pytest.mark.parametrize("layout,dtype", [("tiles64", torch.float32), ("rows", torch.float16)])
def test_op_above_single_launch_grouping(layout, dtype):
    # T k = 4800 > TRITON_MAX_PAIRS: the blocked grouping and the prefill (large-M) config of the table.
    assert 600 * 8 > moe_align.TRITON_MAX_PAIRS
    run_case(600, 8, 64, 64, 64, dtype, layout)


def test_zero_tokens():
    packed = pack_expert_weights(
        w1=torch.randn(2, 64, 64), w3=torch.randn(2, 64, 64), w2=torch.randn(2, 64, 64)
    )
    out = packed(torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 64)


# ---------------------------------------------------------------- the op


def op_inputs(num_tokens=6, top_k=2, num_experts=4, hidden=64, ffn=64, dtype=torch.float32, device=DEVICE):
    gate, up, down = random_experts(num_experts, hidden, ffn)
    packed = pack_expert_weights(w1=gate, w3=up, w2=down, dtype=dtype, device=device)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype)
    ids, weights = random_routing(num_tokens, top_k, num_experts, device=device)
    return x, ids, weights, packed


def test_opcheck():
    x, ids, weights, packed = op_inputs()
    torch.library.opcheck(
        torch.ops.wmoe.tiled_moe.default, (x, ids, weights, packed.w_gate_up, packed.w_down)
    )
    torch.library.opcheck(
        torch.ops.wmoe.tiled_moe.default, (x, ids.int(), weights, packed.w_gate_up, packed.w_down, True)
    )


def test_op_schema_matches_contract():
    schema = str(torch.ops.wmoe.tiled_moe.default._schema)
    contracts = os.path.dirname(__file__) + "/../docs/CONTRACTS.md"
    with open(contracts) as f:
        text = " ".join(f.read().split())
    assert " ".join(schema.split()) in text, schema


def test_op_reference_path_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the op's CPU fallback: fp32 per-expert loop
    x, ids, weights, packed = op_inputs(device="cpu")
    got = packed(x, ids, weights)
    gate, up = tm.unpack_gate_up(packed.w_gate_up, packed.layout)
    ref = tm.moe_reference(x, ids, weights, gate, up, tm.unpack_down(packed.w_down, packed.layout))
    assert rel_err(got, ref) < 1e-6


def test_op_rejects_bad_inputs():
    x, ids, weights, packed = op_inputs()
    bad_ids = ids.clone()
    bad_ids[1, 0] = packed.num_experts  # one past the last expert
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        packed(x, bad_ids, weights, validate=True)
    with pytest.raises(ValueError, match="hidden is torch.float16"):
        packed(x.half(), ids, weights)
    with pytest.raises(ValueError, match="topk_ids must be int32/int64"):
        packed(x, ids.float(), weights)
    with pytest.raises(ValueError, match="topk_weights must be floating point"):
        packed(x, ids, weights[:, :1])
    with pytest.raises(ValueError, match=r"hidden must be \[tokens, 64\]"):
        packed(x[:, :32], ids, weights)
    with pytest.raises(ValueError, match="hidden size 200 does not match"):
        torch.ops.wmoe.tiled_moe(torch.randn(6, 200), ids, weights, packed.w_gate_up, packed.w_down)
    with pytest.raises(ValueError, match="packed weights from wmoe_compile.pack_expert_weights"):
        torch.ops.wmoe.tiled_moe(x, ids, weights, packed.w_gate_up, packed.w_gate_up)


def test_out_of_range_ids_without_validation_are_dropped_not_read():
    # Without validate=True the bad pair contributes nothing (no out-of-bounds weight read).
    x, ids, weights, packed = op_inputs(num_tokens=5)
    bad_ids = ids.clone()
    bad_ids[3, 1] = 1000
    got = packed(x, bad_ids, weights)
    kept = weights.clone()
    kept[3, 1] = 0.0
    gate, up = tm.unpack_gate_up(packed.w_gate_up, packed.layout)
    ref = tm.moe_reference(x, ids, kept, gate, up, tm.unpack_down(packed.w_down, packed.layout))
    assert rel_err(got, ref) < 1e-5


# ---------------------------------------------------------------- direct decode path (T k small)


def direct_case(
    num_tokens, top_k, num_experts, layout="tiles64", dtype=torch.float32, allowed=None, ids=None
):
    """tm.tiled_moe_direct (no grouping) against the fp32 per-expert loop."""
    gate, up, down = random_experts(num_experts, 72, 100, device=DEVICE)
    packed = pack_expert_weights(w1=gate, w3=up, w2=down, layout=layout, dtype=dtype)
    x = torch.randn(num_tokens, 72, device=DEVICE)
    routed, weights = random_routing(num_tokens, top_k, num_experts, device=DEVICE, allowed=allowed)
    ids = routed if ids is None else ids.to(DEVICE)
    dims = tm.packed_dims(packed.w_gate_up, packed.w_down)
    got = tm.tiled_moe_direct(x.to(dtype), ids, weights, packed.w_gate_up, packed.w_down, dims)
    ref = tm.moe_reference(
        x.to(dtype).float(), ids, weights, *(w.to(dtype).float() for w in (gate, up, down))
    )
    assert got.dtype == dtype and got.shape == (num_tokens, 72)
    err = rel_err(got, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e} >= {REL_TOL[dtype]:.0e}"


@contextlib.contextmanager
def direct_down_flat(flat: bool):
    """DIRECT_CONFIGS with the down kernel's loop form set (plans are cached per shape: rebuilt)."""
    saved = tm.DIRECT_CONFIGS
    tm.DIRECT_CONFIGS = {k: replace(cfg, down_flat=flat) for k, cfg in saved.items()}
    tm._direct_plan.cache_clear()
    try:
        yield
    finally:
        tm.DIRECT_CONFIGS = saved
        tm._direct_plan.cache_clear()


def test_direct_config_prefers_an_entry_swept_at_the_dims(monkeypatch):
    # DIRECT_CONFIGS keyed by padded (hidden, ffn) dims (a shape swept on its own, e.g. gpt-oss-20b's
    # 2880 x 2880) win over the shape class; other dims keep their class's entry, and the direct
    # plan's grids follow the chosen entry
    dims = tm.PackedDims(num_experts=8, ffn_pad=192, hidden_pad=128, layout="tiles64")
    swept = tm.DirectConfig(64, 64, 4, 4, 64, 64, 4, 4)
    assert tm.direct_config(128, 192) == tm.DIRECT_CONFIGS["small"] != swept
    monkeypatch.setitem(tm.DIRECT_CONFIGS, (128, 192), swept)
    tm._direct_plan.cache_clear()
    try:
        assert tm.direct_config(128, 192) == swept
        assert tm.direct_config(192, 128) == tm.DIRECT_CONFIGS["small"]
        plan = tm._direct_plan(2, 8, 128, dims, torch.bfloat16, True)
        assert plan.up_grid == (2 * 192 // 64, 1, 1) and plan.down_grid == (128 // 64, 1, 1)
    finally:
        tm._direct_plan.cache_clear()


@pytest.mark.parametrize(
    "num_tokens,top_k,num_experts",
    [
        (1, 1, 4),  # k = 1: one expert hit, three without tokens
        (1, 2, 8),  # Mixtral decode: slots are pairs (P <= E)
        (1, 8, 16),  # fine-grained decode, k = 8
        (2, 2, 8),
        (3, 2, 8),
        (2, 8, 16),  # 16 pairs, one full M tile
        (3, 1, 2),  # P > E: slots are experts
        (3, 8, 8),  # P = 24 > E: slots are experts, M tile 32 (past DIRECT_MAX_PAIRS, still exact)
    ],
)
@pytest.mark.parametrize("flat", [False, True])
def test_direct_path_matches_fp32_loop(num_tokens, top_k, num_experts, flat):
    # flat: the down kernel's one loop over (live expert, K block) instead of a K loop per slot.
    with direct_down_flat(flat):
        direct_case(num_tokens, top_k, num_experts)


@pytest.mark.parametrize("layout,dtype", [("rows", torch.float16), ("tiles64", torch.bfloat16)])
def test_direct_path_layouts_and_half_dtypes(layout, dtype):
    direct_case(2, 2, 8, layout=layout, dtype=dtype)


@pytest.mark.parametrize("flat", [False, True])
def test_direct_path_experts_shared_by_tokens(flat):
    # Every token routed to experts 2 and 5: each expert owns one live slot and all three tokens' rows.
    with direct_down_flat(flat):
        direct_case(3, 2, 8, allowed=[2, 5])
        direct_case(3, 1, 8, allowed=[4])  # all tokens on one expert, k = 1
        direct_case(6, 2, 4, allowed=[1, 3])  # P = 12 > E: expert slots, two of four live


@pytest.mark.parametrize("flat", [False, True])
def test_direct_path_drops_out_of_range_ids(flat):
    with direct_down_flat(flat):
        check_direct_path_drops_out_of_range_ids()


def check_direct_path_drops_out_of_range_ids():
    ids = torch.tensor([[1, 1000], [-1, 3]])  # the bad pairs contribute nothing, never index weights
    gate, up, down = random_experts(4, 64, 64, device=DEVICE)
    packed = pack_expert_weights(w1=gate, w3=up, w2=down)
    x = torch.randn(2, 64, device=DEVICE)
    _, weights = random_routing(2, 2, 4, device=DEVICE)
    dims = tm.packed_dims(packed.w_gate_up, packed.w_down)
    got = tm.tiled_moe_direct(x, ids.to(DEVICE), weights, packed.w_gate_up, packed.w_down, dims)
    kept = weights.clone()
    kept[0, 1] = kept[1, 0] = 0.0
    ref = tm.moe_reference(x, ids.clamp(0, 3).to(DEVICE), kept, gate, up, down)
    assert rel_err(got, ref) < 1e-5


def test_direct_path_non_contiguous_routing():
    ids = torch.stack([torch.randperm(8)[:3] for _ in range(2)]).T.contiguous().T  # [2, 3], transposed
    assert not ids.is_contiguous()
    direct_case(2, 3, 8, ids=ids)


def test_op_takes_the_direct_path_at_decode(monkeypatch):
    # T k <= DIRECT_MAX_PAIRS: two launches, no grouping; one pair more: the grouped path.
    x, ids, weights, packed = op_inputs(num_tokens=4, top_k=2, num_experts=8)
    routes = []
    real_direct = tm.tiled_moe_direct
    monkeypatch.setattr(tm, "tiled_moe_direct", lambda *a: routes.append("direct") or real_direct(*a))
    real_group = moe_align.group_by_expert
    monkeypatch.setattr(tm, "group_by_expert", lambda *a: routes.append("grouped") or real_group(*a))
    assert 4 * 2 == tm.DIRECT_MAX_PAIRS
    out_direct = packed(x, ids, weights)
    assert routes == ["direct"]
    monkeypatch.setattr(tm, "DIRECT_MAX_PAIRS", 7)
    out_grouped = packed(x, ids, weights)
    assert routes == ["direct", "grouped"]
    assert rel_err(out_direct, out_grouped) < 1e-5


def test_op_direct_path_validates_ids():
    x, ids, weights, packed = op_inputs(num_tokens=1, top_k=2, num_experts=4)
    bad_ids = ids.clone()
    bad_ids[0, 1] = -1
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        packed(x, bad_ids, weights, validate=True)
    bad_ids[0, 1] = 4
    with pytest.raises(ValueError, match=r"e.g. \[4\]"):
        packed(x, bad_ids, weights, validate=True)
    packed(x, ids, weights, validate=True)  # valid ids pass


# ---------------------------------------------------------------- GPU, real shapes

MIXTRAL = dict(num_experts=8, hidden=4096, ffn=14336, top_k=2)
FINE_GRAINED = dict(num_experts=64, hidden=2048, ffn=1408, top_k=8)


def gpu_case(shape, num_tokens, dtype=torch.bfloat16, layout="tiles64", allowed=None, config=None):
    e, h, f, k = shape["num_experts"], shape["hidden"], shape["ffn"], shape["top_k"]
    gate, up, down = random_experts(e, h, f, device="cuda")
    packed = pack_expert_weights(w1=gate, w3=up, w2=down, dtype=dtype, layout=layout)
    x = torch.randn(num_tokens, h, device="cuda")
    ids, weights = random_routing(num_tokens, k, e, device="cuda", allowed=allowed)
    if config is None:
        got = packed(x.to(dtype), ids, weights)
    else:
        got = tm.tiled_moe_triton(x.to(dtype), ids, weights, packed.w_gate_up, packed.w_down, config=config)
    ref = tm.moe_reference(
        x.to(dtype).float(), ids, weights, *(w.to(dtype).float() for w in (gate, up, down))
    )
    err = rel_err(got, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
def test_gpu_mixtral_shapes(num_tokens):
    gpu_case(MIXTRAL, num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4096])
def test_gpu_fine_grained_shapes(num_tokens):
    gpu_case(FINE_GRAINED, num_tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False])
def test_gpu_prefill_gate_up_one_dot_and_two_dots(fused):
    # The prefill config of T = 1000 with gate and up as one dot of 2 * up_n columns, or as two.
    config = replace(tm.lookup_config(1000, 2, 8, 4096, 14336), fused=fused)
    gpu_case(MIXTRAL, 1000, config=config)


@pytest.mark.gpu
def test_gpu_fine_grained_rows_layout_blocked_grouping():
    gpu_case(FINE_GRAINED, 1024, layout="rows")  # 8192 pairs: the blocked grouping route


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(3000, 2, 8), (4096, 8, 64), (16384, 8, 256)])
def test_gpu_blocked_grouping_matches_torch(num_tokens, top_k, num_experts):
    # (T, k, E) as TEST_GROUPING_CASES in benchmarks/bench_moe.py (its offline prewarm compiles them).
    ids = torch.rand(num_tokens, num_experts, device="cuda").topk(top_k, dim=-1).indices
    ids[10, 0] = num_experts
    ids[-1, -1] = -5
    for block_m in (64, 128):
        got = moe_align.group_by_expert(ids, num_experts, block_m)
        assert_same_grouping(got, moe_align.group_by_expert_torch(ids, num_experts, block_m))


@pytest.mark.gpu
def test_gpu_fp16_rows_layout_one_hot_expert():
    gpu_case(MIXTRAL, 40, dtype=torch.float16, layout="rows", allowed=[3, 6])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,num_tokens,allowed,flat",
    [
        (MIXTRAL, 4, None, False),
        (MIXTRAL, 3, [1, 6], False),
        (FINE_GRAINED, 1, None, False),
        (MIXTRAL, 4, None, True),
        (FINE_GRAINED, 1, None, True),
    ],
)
def test_gpu_direct_decode_path(shape, num_tokens, allowed, flat):
    # T k <= DIRECT_MAX_PAIRS: slots are experts (Mixtral T = 4, 8 pairs of 8 experts), pairs sharing
    # experts (T = 3 on two experts), or pairs (fine-grained T = 1, 8 pairs of 64 experts); both loop
    # forms of the down kernel.
    assert num_tokens * shape["top_k"] <= tm.DIRECT_MAX_PAIRS
    with direct_down_flat(flat):
        gpu_case(shape, num_tokens, allowed=allowed)


@pytest.mark.gpu
def test_gpu_direct_path_compiled_launches():
    # From the second call of an argument signature on, the direct path launches the stored compiled
    # kernels (tm.FAST_LAUNCH): same result bit for bit (no atomics), and a hidden state that is not
    # 16-byte aligned gets kernels of its own signature.
    x, ids, weights, packed = op_inputs(
        num_tokens=2, top_k=2, num_experts=8, hidden=128, ffn=192, dtype=torch.bfloat16, device="cuda"
    )
    launches = (tm._gate_up_direct_launches, tm._down_direct_launches)
    for launch in launches:
        launch.compiled.clear()
    first = packed(x, ids, weights)
    assert [len(launch.compiled) for launch in launches] == [1, 1]
    assert torch.equal(packed(x, ids, weights), first)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view_as(x)
    shifted.copy_(x)
    assert shifted.data_ptr() % 16 != 0
    assert torch.equal(packed(shifted, ids, weights), first)
    assert torch.equal(packed(shifted, ids, weights), first)
    assert [len(launch.compiled) for launch in launches] == [2, 2]
    gate, up = tm.unpack_gate_up(packed.w_gate_up, packed.layout)
    down = tm.unpack_down(packed.w_down, packed.layout)
    ref = tm.moe_reference(x.float(), ids, weights, gate.float(), up.float(), down.float())
    assert rel_err(first, ref) < REL_TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_validate_flag():
    x, ids, weights, packed = op_inputs(
        num_tokens=4, hidden=128, ffn=128, dtype=torch.bfloat16, device="cuda"
    )
    ids[0, 0] = -2
    with pytest.raises(ValueError, match="outside"):
        packed(x, ids, weights, validate=True)
