"""How the attention op cuts the compressed range into flash-decoding splits, and when it launches
with programmatic dependent launch (CPU only).

The split kernel's programs are all the same length at decode, so a launch whose last wave of
resident programs is partly empty leaves SMs idle while it finishes. The tuned v3 config therefore
asks for whole waves (``LaunchConfig.whole_waves``); on the H200 two whole waves measured 3-4%
faster than 2.6 waves at every large decode shape (benchmarks/RESULTS.md, twelfth session). The
figures below are the H200's: 132 SMs, 64K registers per SM.
"""

from __future__ import annotations

import dataclasses

import pytest
from wmoe_compile.kernels import attention_config as C
from wmoe_compile.kernels import wavelet_attention as K

H200_SMS = 132
# the tuned config without the forty-fourth session's step options and carveout: the figures below
# were worked out on it (test_the_tuned_config_keeps_12_programs_an_sm covers the config as tuned)
TUNED = dataclasses.replace(
    K.TUNED_CONFIGS[(128, 4, "affine")],
    value_band2_half=False,
    token_sums_rows=False,
    warp_barriers=False,
    split_carveout=-1,
)
# the key tiles through the cp.async ring: without the tuned options that load keys into registers
KEYS_VIA_SMEM = dict(keys_via_smem=True, keys_ahead=False, key_loads_l2_256b=False, key_word_pairs=False)


@pytest.mark.parametrize(
    "changes, resident",
    [
        ({}, 12),  # 168 registers x 32 lanes = 5,376 per warp: 12 warps in 64K
        ({"maxnreg": 128}, 16),
        ({"maxnreg": 255}, 8),  # 8,160 per warp, allocated in units of 256: 8,192
        # (v1 takes none of the tuned config's v3-only options)
        ({"kernel": "v1", "num_warps": 2, **dict.fromkeys(C.V3_ONLY_OPTIONS, False)}, 6),
        # v3's cp.async ring: 4 stages x 8 KB (value and key tiles) + 2 KB a program (the kernel's
        # other shared memory and the driver's reservation), in 228 KB
        ({"num_stages": 4, **KEYS_VIA_SMEM}, 6),
        # value_band2_half: 4 stages x 7 KB (the 2-bit value band's tile 1 KB smaller) + 2 KB: 7 fit
        # (offline 29,184 bytes, 30,208 with the reservation)
        ({"num_stages": 4, **KEYS_VIA_SMEM, "value_band2_half": True}, 7),
        # tma_rows: both caches' [64, 32] int16 row tiles a stage, 8 KB: 3 stages + 2 KB in 228 KB
        # (the kernel takes 25,112 bytes at 3 stages offline, 26,136 with the reservation: 8 fit)
        ({"num_stages": 3, "tma_rows": True, "keys_ahead": False, "key_word_pairs": False}, 8),
        ({"num_stages": 2, "tma_rows": True, "keys_ahead": False, "key_word_pairs": False}, 12),
        ({"maxnreg": None, "whole_waves": False}, None),  # no cap: the register count is unknown
    ],
)
def test_resident_programs_per_sm(changes, resident):
    config = dataclasses.replace(TUNED, **changes)
    assert K.resident_programs_per_sm(config) == resident


@pytest.mark.parametrize(
    "programs, context, two_waves, tuned",
    [
        # B=8: 3,136 programs, 1.98 waves of 1,584 (was 66 splits, 2.67 waves). One wave (24 splits
        # of 86 steps): 86 + 2.5 steps a slot against 2 x (42 + 2.5), one wave (thirty-second
        # session: a program costs about 2.5 steps; -1.4% and -0.2% on two machines)
        (64, 131072, 49, 24),
        (96, 131072, 33, 33),  # B=12: one wave of 16 splits would be 128 + 2.5 against 2 x (62 + 2.5)
        # B=32: 3,072, 1.94 waves (was 16, 2.59); one wave of 6 splits: 85 + 1 against 2 x (43 + 1)
        (256, 32768, 12, 6),
        (64, 32768, 49, 24),  # 22 + 1 steps against 2 x (11 + 1)
        (128, 32768, 24, 12),  # 43 + 1 against 2 x (22 + 1)
        (32, 32768, 49, 49),  # the 512-token minimum caps it at 64 splits (1.29 waves): one whole wave
        (40, 32768, 39, 39),  # capped at 64 (1.62 waves): one whole wave
        (24, 32768, 64, 64),  # less than one wave even at the cap: the cap
        (64, 1024, 2, 2),  # a short context: the cap
    ],
)
def test_whole_waves_on_the_h200(programs, context, two_waves, tuned):
    tokens = context - 132  # the codec default's exact sinks and window
    resident = K.resident_programs_per_sm(TUNED)
    # the wave count ctas_per_sm asks for (two), and the tuned choice of fewer where they cost
    # fewer steps per program slot (LaunchConfig.wave_program_steps)
    by_ctas = dataclasses.replace(TUNED, wave_program_steps=0.0)
    assert K.split_count(programs, tokens, by_ctas, H200_SMS, resident) == two_waves
    assert K.split_count(programs, tokens, TUNED, H200_SMS, resident) == tuned


def test_whole_waves_fill_their_waves():
    resident = K.resident_programs_per_sm(TUNED)
    wave = resident * H200_SMS
    for programs in range(17, 2100, 7):
        for context in (1024, 4096, 32768, 131072):
            tokens = context - 132
            cap = -(-tokens // TUNED.min_split_tokens)
            splits = K.split_count(programs, tokens, TUNED, H200_SMS, resident)
            assert 1 <= splits <= cap
            launched = programs * splits
            if launched > wave:  # more than one wave: whole ones, the last at most a split short
                waves = -(-launched // wave)
                assert waves * wave - launched < programs, (programs, context, splits)
            elif splits < cap:  # one wave or less without the cap binding: it is full
                assert wave - launched < programs, (programs, context, splits)


def test_the_tuned_config_keeps_12_programs_an_sm():
    # value_band2_half's 3.5 KB a program and the 44% carveout (100 KB): the register file still
    # bounds the H200 (and A100) at 12
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    assert tuned.value_band2_half and tuned.split_carveout == 44
    assert K.resident_programs_per_sm(tuned, 65536, 64, 228 * 1024) == 12
    assert K.resident_programs_per_sm(tuned, 65536, 64, 164 * 1024) == 12


def test_residency_follows_the_device_limits():
    # an A100 (sm_80): 64K registers, 64 warps, 164 KB of shared memory per SM; a GPU with half the
    # register file holds half the programs
    assert K.resident_programs_per_sm(TUNED, 65536, 64, 164 * 1024) == 12
    assert K.resident_programs_per_sm(TUNED, 32768, 64, 164 * 1024) == 6
    assert K.resident_programs_per_sm(TUNED, 65536, 8, 164 * 1024) == 8  # warp-limited
    deep_ring = dataclasses.replace(TUNED, num_stages=4, **KEYS_VIA_SMEM)
    assert K.resident_programs_per_sm(deep_ring, 65536, 64, 100 * 1024) == 2  # 34 KB a program
    assert K.resident_programs_per_sm(deep_ring, 65536, 64, 102 * 1024) == 3


def test_without_whole_waves_the_count_rounds_to_ctas_per_sm():
    config = dataclasses.replace(TUNED, whole_waves=False, ctas_per_sm=32.0)
    assert K.split_count(64, 131072 - 132, config, H200_SMS, 12) == 66  # round(32 * 132 / 64)
    assert K.split_count(256, 32768 - 132, config, H200_SMS, 12) == 16


def test_whole_waves_needs_a_register_cap():
    with pytest.raises(ValueError, match="whole_waves needs maxnreg"):
        K.LaunchConfig(kernel="v3", num_stages=1, whole_waves=True)


def test_programmatic_dependent_launch_only_where_it_can_run():
    # LaunchConfig.pdl asks; the call uses it only compiled on a CUDA device of sm_90 or newer, and
    # a kernel launched that way always gets the constexpr that makes it wait for its predecessor
    import torch

    asked = dataclasses.replace(TUNED, pdl=True)
    assert not K._pdl(asked, torch.device("cpu"))
    assert not K._pdl(TUNED, torch.device("cpu"))
    assert K._dependent(True) == {"PDL": True, "launch_pdl": True}
    assert K._dependent(False) == {}


def test_exact_carveout_only_in_one_wave_with_few_exact_programs():
    # LaunchConfig.exact_carveout_waves (tuned 1) and exact_carveout_programs (tuned 2,048): measured
    # faster in one wave with 40, 320 or (twenty-seventh session, the remainder plan's long splits
    # counted as its wave) 1,280 exact programs, slower in two waves. Off CUDA the sm_90 residency
    # (12 programs per SM at 168 registers) and 4 SMs stand in: a wave is 48 programs
    import torch

    cpu = torch.device("cpu")
    assert (TUNED.exact_carveout, TUNED.exact_carveout_waves, TUNED.exact_carveout_programs) == (44, 1, 2048)
    assert C.exact_carveout(TUNED, 48, 2048, cpu) == 44
    assert C.exact_carveout(TUNED, 49, 5, cpu) == -1  # two waves
    # a wave of another residency (128 registers: 16 programs per SM) is its own, not the cached one
    wider = dataclasses.replace(TUNED, maxnreg=128)
    assert C.exact_carveout(wider, 64, 5, cpu) == 44
    assert C.exact_carveout(wider, 65, 5, cpu) == -1
    assert C.exact_carveout(TUNED, 48, 2049, cpu) == -1  # too many exact programs
    assert C.exact_carveout(dataclasses.replace(TUNED, exact_carveout_waves=2), 96, 5, cpu) == 44
    unlimited = dataclasses.replace(TUNED, exact_carveout_waves=0, exact_carveout_programs=0)
    assert C.exact_carveout(unlimited, 10**6, 10**6, cpu) == 44
    assert C.exact_carveout(dataclasses.replace(TUNED, exact_carveout=-1), 1, 1, cpu) == -1
    # no register cap: the residency is unknown, so no wave count to hold it to
    uncapped = dataclasses.replace(TUNED, maxnreg=None, whole_waves=False)
    assert C.exact_carveout(uncapped, 1, 1, cpu) == -1


def test_carveout_counts_a_remainder_plans_long_splits_only():
    # a remainder plan's short splits run in the free slots of its long splits' wave: (32, 32768)'s
    # 256 programs in 6 long splits and a short one are one wave of 1,536 for the carveout (1,792
    # split programs in all); equal splits count every split
    assert C.carveout_split_programs(256, C.SplitPlan(7, 83, 512, split_major=True)) == 6 * 256
    import torch

    assert C.carveout_split_programs(64, C.SplitPlan(49)) == 49 * 64
    cpu = torch.device("cpu")
    remainder = C.SplitPlan(4, 10, 32, split_major=True)  # 12 programs: 36 long, 12 short splits
    assert C.exact_carveout(TUNED, C.carveout_split_programs(12, remainder), 60, cpu) == 44  # a wave: 48
    assert C.exact_carveout(TUNED, C.carveout_split_programs(12, C.SplitPlan(5)), 60, cpu) == -1


def test_query_in_split_only_in_as_many_waves_as_asked():
    # LaunchConfig.query_in_split_waves (tuned 1): measured faster in one wave (-2.6% at (8, 32768)),
    # slower in two ((8, 131072): each slot pays the query's transform twice). Off CUDA a wave is
    # 48 programs (12 per SM at 168 registers, 4 SMs)
    import torch

    cpu = torch.device("cpu")
    assert TUNED.query_in_split and TUNED.query_in_split_waves == 1
    assert C.query_in_split_apply(TUNED, 48, cpu)
    assert not C.query_in_split_apply(TUNED, 49, cpu)
    assert C.query_in_split_apply(dataclasses.replace(TUNED, query_in_split_waves=2), 96, cpu)
    assert not C.query_in_split_apply(dataclasses.replace(TUNED, query_in_split_waves=2), 97, cpu)
    assert C.query_in_split_apply(dataclasses.replace(TUNED, query_in_split_waves=0), 10**6, cpu)
    assert not C.query_in_split_apply(dataclasses.replace(TUNED, query_in_split=False), 1, cpu)
    # no register cap: the residency is unknown, so no wave count to hold it to
    uncapped = dataclasses.replace(TUNED, maxnreg=None, whole_waves=False)
    assert not C.query_in_split_apply(uncapped, 1, cpu)
    with pytest.raises(ValueError, match="query_in_split_waves must be >= 0"):
        dataclasses.replace(TUNED, query_in_split_waves=-1)


@pytest.mark.parametrize("warps", [0, 3, 16])
def test_prologue_warps_must_be_a_power_of_two_up_to_8(warps):
    with pytest.raises(ValueError, match="prologue_warps must be 1, 2, 4 or 8"):
        dataclasses.replace(TUNED, prologue_warps=warps)


@pytest.mark.parametrize("rows", [0, 8, 48, 128])
def test_prologue_tile_rows_must_be_a_dot_size(rows):
    with pytest.raises(ValueError, match="prologue_tile_rows must be 16, 32 or 64"):
        dataclasses.replace(TUNED, prologue_tile_rows=rows)


@pytest.mark.parametrize("precision", ["fp32", "TF32", "bf16x3", ""])
def test_prologue_precision_must_be_a_dot_precision(precision):
    with pytest.raises(ValueError, match="prologue_precision must be 'tf32x3', 'tf32' or 'ieee'"):
        dataclasses.replace(TUNED, prologue_precision=precision)


@pytest.mark.parametrize(
    ("chunk", "splits", "merged"),
    [
        (64, 12, 16),
        (64, 49, 64),
        (64, 64, 64),
        (64, 65, 64),
        (64, 1, 1),
        (64, 2, 2),
        (16, 12, 16),
        (8, 12, 8),
    ],
)
def test_reduce_merges_no_more_splits_per_load_than_the_launch_has(chunk, splits, merged):
    # (32, 32768) runs 12 splits: a 64-wide load would carry 52 masked rows (twelfth session: 16
    # per load measured faster there); 49 splits at (8, 131072) keep the tuned 64
    config = K.LaunchConfig(reduce_split_chunk=chunk)
    assert K.reduce_split_chunk(config, splits) == merged


@pytest.mark.parametrize(
    ("batch", "n_row_blocks", "gemm"),
    [(32, 1, True), (16, 1, True), (8, 1, False), (1, 1, False), (32, 2, False)],
)
def test_reduce_gemm_where_many_decode_rows_share_each_kv_heads_transform(batch, n_row_blocks, gemm):
    # tuned v3, 8 kv heads x 4 query rows per sequence: the merge + per-kv-head transform from 512
    # rows (fourteenth session: -1.3 to -1.9% at (32, 32768), 1-2% slower at B = 8); a launch with
    # several row blocks per (sequence, kv head) is not what the transform kernel's rows map to
    assert K.uses_reduce_gemm(TUNED, batch * 8 * 4, n_row_blocks) is gemm
    assert not K.uses_reduce_gemm(K.LaunchConfig(), 4096, 1)  # off unless a config asks


@pytest.mark.parametrize(
    ("programs", "context", "plan"),
    [
        # 6 splits of 85 steps (86 a slot) -> 6 of 83 and a last of 12, in the 48 free slots six
        # after another (84 a slot)
        (256, 32768, C.SplitPlan(7, 83, 510, split_major=True)),
        (128, 32768, C.SplitPlan(13, 42, 510, split_major=True)),  # 44 -> 43
        (512, 8192, C.SplitPlan(3)),  # one split a slot already: equal splits stay
    ],
)
def test_remainder_split_plans_on_the_h200(programs, context, plan):
    # LaunchConfig.remainder_split (tuned from 128 programs): long splits fill the wave, the short
    # last ones its free slots, where that costs fewer steps per slot than equal splits
    tokens = context - 132
    assert TUNED.remainder_split and TUNED.remainder_split_min_programs == 128
    assert C.split_plan(programs, tokens, TUNED, H200_SMS, 12) == plan
    # off, the plan is split_count's equal splits
    off = dataclasses.replace(TUNED, remainder_split=False)
    equal = C.split_plan(programs, tokens, off, H200_SMS, 12)
    assert equal == C.SplitPlan(K.split_count(programs, tokens, TUNED, H200_SMS, 12))
    assert (equal.split_num, equal.split_den, equal.split_major) == (1, equal.num_splits, False)


@pytest.mark.parametrize(
    ("exact_steps", "plan"),
    [
        (0.0, C.SplitPlan(7, 83, 510, split_major=True)),  # not counted: the tuned plan
        # the exact programs' work counted in the 48 free slots: shorter short splits (6 steps)
        (6.0, C.SplitPlan(7, 84, 510, split_major=True)),
        # so much of it that the free slots cost more than equal splits' 86 steps a slot
        (12.0, C.SplitPlan(6)),
    ],
)
def test_remainder_plan_counts_the_exact_programs_in_the_free_slots(exact_steps, plan):
    # LaunchConfig.remainder_exact_steps: the exact-token kernel's programs run in the wave's free
    # slots beside the short splits; with their work counted, the plan at (32, 32768) moves work
    # from the short splits to the long ones, and past a point back to equal splits
    config = dataclasses.replace(TUNED, remainder_exact_steps=exact_steps)
    assert C.split_plan(256, 32768 - 132, config, H200_SMS, 12) == plan
    # (where equal splits are two waves the rule is unchanged)
    assert C.split_plan(96, 131072 - 132, config, H200_SMS, 12) == C.SplitPlan(33)


def test_remainder_exact_steps_are_validated():
    with pytest.raises(ValueError, match="remainder_exact_steps"):
        K.LaunchConfig(remainder_exact_steps=-1.0)


@pytest.mark.parametrize(
    ("programs", "context", "remainder_plan"),
    [
        # measured slower (twenty-first session): 64 programs, where the exact kernel's programs
        # share the wave's free slots (+2.1%) ...
        (64, 32768, C.SplitPlan(25, 21, 510, split_major=True)),
        # ... and at (8, 131072) +4.8%, against the two waves of equal splits then tuned (against
        # today's one wave of 24 equal splits not measured)
        (64, 131072, C.SplitPlan(25, 84, 2046, split_major=True)),
    ],
)
def test_remainder_split_keeps_equal_splits_where_it_measured_slower(programs, context, remainder_plan):
    tokens = context - 132
    equal = C.SplitPlan(K.split_count(programs, tokens, TUNED, H200_SMS, 12))
    assert C.split_plan(programs, tokens, TUNED, H200_SMS, 12) == equal
    # the model alone would cut both: equal splits are one wave there
    anywhere = dataclasses.replace(TUNED, remainder_split_min_programs=0)
    assert programs * equal.num_splits <= H200_SMS * 12
    assert C.split_plan(programs, tokens, anywhere, H200_SMS, 12) == remainder_plan
    # ... but never where equal splits take two waves (B = 12 at 131,072)
    two = C.SplitPlan(K.split_count(96, 131072 - 132, TUNED, H200_SMS, 12))
    assert 96 * two.num_splits > H200_SMS * 12
    assert C.split_plan(96, 131072 - 132, anywhere, H200_SMS, 12) == two


@pytest.mark.parametrize("span", [0, 1, 63, 64, 65, 1000, 32636, 130940])
@pytest.mark.parametrize(
    "plan",
    [C.SplitPlan(1), C.SplitPlan(6), C.SplitPlan(7, 83, 510, True), C.SplitPlan(25, 84, 2046, True)]
    + [C.SplitPlan(2, 3, 5), C.SplitPlan(3, 1, 2)],
)
def test_split_bounds_cover_each_span_once_in_whole_steps(span, plan):
    bounds = C.split_bounds(span, plan, 64)
    assert len(bounds) == plan.num_splits
    assert bounds[0][0] == 0 and bounds[-1][1] == span  # from the start to the end ...
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))  # no gap, no overlap
    assert all(lo % 64 == 0 for lo, hi in bounds if hi > lo)  # each split starts on a whole step


def test_remainder_plan_long_splits_are_whole_steps_at_full_capacity():
    # at the capacity the plan was made for, each long split is exactly its L steps
    bounds = C.split_bounds(32636, C.SplitPlan(7, 83, 510, True), 64)
    assert [hi - lo for lo, hi in bounds] == [83 * 64] * 6 + [32636 - 6 * 83 * 64]


def test_a_split_plan_that_leaves_part_of_the_span_uncovered_is_refused():
    with pytest.raises(ValueError, match="uncovered"):
        C.SplitPlan(2, 1, 3)  # two thirds of the span
    with pytest.raises(ValueError, match="positive"):
        C.SplitPlan(0)
    assert C.SplitPlan(4).split_den == 4  # equal splits by default


def test_the_remainder_cut_counts_its_own_program_cost():
    # LaunchConfig.remainder_program_steps (tuned 1.0) keeps the remainder cut at (32, 32768) where
    # the twenty-first session measured it (6 long splits of 83 steps, one of 12) while the wave
    # count counts a program as 2.5 steps; with the wave count's 2.5 the cut would be 84 and 6,
    # measured +1.0% (thirty-second session)
    assert (TUNED.wave_program_steps, TUNED.remainder_program_steps) == (2.5, 1.0)
    tokens = 32768 - 132
    assert C.split_plan(256, tokens, TUNED, H200_SMS, 12) == C.SplitPlan(7, 83, 510, split_major=True)
    same = dataclasses.replace(TUNED, remainder_program_steps=-1.0)  # < 0: wave_program_steps
    assert C.split_plan(256, tokens, same, H200_SMS, 12) == C.SplitPlan(7, 84, 510, split_major=True)
