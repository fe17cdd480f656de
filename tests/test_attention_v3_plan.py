"""The Gluon v3 kernel's host plan, checked on the CPU (Gluon has no interpreter).

The kernel (kernels/wavelet_attention_gluon.py) builds its MMA operands in a fixed way: slot
16 * (4 * band + operand) + j holds, for the 4-bit band, field `operand` of int16 element j, and for
the 2-bit band, field 2 * operand + j // 8 of element j % 8; keys enter the MMA as 1024 + field in
place, values as that minus the field's centre. ``emulate`` below restates that construction in
float64 torch; with the plan's per-slot factors it must reproduce, from the same codes, the scores
q . c and the value sums sum_t p_t c_t that decode_coefficients gives. A wrong slot map, factor,
shift or centre fails here, before any GPU run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
from wmoe_compile.kernels import attention_fields, attention_plans
from wmoe_compile.kernels import wavelet_attention as K
from wmoe_compile.kernels.wavelet_attention_gluon import field_centre

from wmoe_compile.ops import attention as ops

# How far a full-step loop's instruction count may move when an option changes only code outside
# the loop: ptxas schedules the whole kernel, so the loop moves by a few instructions (up to 12 on
# Triton 3.6, 3.8 and 3.9; 13 and 16 on 3.7.1, torch 2.12's)
LOOP_SCHEDULING_NOISE = 16


# The tuned config's step options of the forty-fourth session (the 2-bit value band's half tiles,
# the token sums from one MMA, warp barriers) left off: the offline tests below were written
# against the tuned step without them, and several options they add do not combine with them.
# The "tuned" case of test_v3_compiles_for_sm90_on_this_triton compiles the tuned config as it is.
PLAIN_STEP = ("--without", "value_band2_half", "--without", "token_sums_rows", "--without", "warp_barriers")


def _run_sm90_tool(script: str, tmp_path, *options: str) -> str:
    """stdout of benchmarks/<script> compiling for sm_90 into tmp_path (skips without a Gluon that
    builds v3). In a subprocess: with TRITON_INTERPRET=1 (this suite's setting) Gluon kernels do
    not compile."""
    import os
    import pathlib
    import subprocess
    import sys

    from wmoe_compile.kernels.wavelet_attention_gluon import gluon_reason

    if gluon_reason() is not None:
        pytest.skip(gluon_reason())
    tool = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / script
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(tool), "--out", str(tmp_path), *options]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _kernel_slot(band: int, slot_in_band: int, key_word_pairs: bool = False) -> tuple[int, int]:
    """(int16 element within the band, field) the kernel puts in a slot (see the module docstring).
    key_word_pairs: a key slot of the 4-bit band as LaunchConfig.key_word_pairs loads it (lane
    (g, t)'s two words adjacent in memory: slots 2t, 2t + 1 <- elements 4t, 4t + 1; slots 2t + 8,
    2t + 9 <- 4t + 2, 4t + 3), written out here independently of the kernel's arithmetic."""
    operand, j = divmod(slot_in_band, 16)
    if band == 0:
        if key_word_pairs:
            t, half = divmod(j % 8, 2)
            return 4 * t + half + (2 if j >= 8 else 0), operand
        return j, operand
    return j % 8, 2 * operand + j // 8


def _magic(elements: torch.Tensor, bits: int, field_index: int) -> torch.Tensor:
    """1024 + the field in place, as the kernel's asm makes it (field_layout: shift, position)."""
    shift, pos = attention_fields.field_layout(bits, field_index)
    return 1024.0 + ((elements >> shift) & (((1 << bits) - 1) << pos)).double()


def emulate(layout, plan, codes, scales, query, weights, key_word_pairs=False):
    """Scores [N] and coefficient sums [D] computed the v3 kernel's way (float64)."""
    elements = codes.view(torch.int16).long() & 0xFFFF  # [N, 24] little-endian int16 elements
    first = [off // 2 for off in layout.band_byte_offsets]
    q_slots = (plan.transform_slots.double() @ query) * plan.k_factor.double()
    scores = torch.zeros(codes.shape[0], dtype=torch.float64)
    sums = torch.zeros(layout.head_dim, dtype=torch.float64)
    for band, (_, _, bits) in enumerate(layout.bands):
        slots = range(64 * band, 64 * band + 64)

        def operands(band: int, bits: int, keys: bool) -> torch.Tensor:  # [N, 64] fields in slot order
            return torch.stack(
                [
                    _magic(elements[:, first[band] + e], bits, f)
                    for e, f in (_kernel_slot(band, s, keys and key_word_pairs) for s in range(64))
                ],
                dim=1,
            )

        magic = operands(band, bits, keys=False)
        q_band = q_slots[64 * band : 64 * band + 64]
        offset = (q_band * plan.k_shift.double()[64 * band : 64 * band + 64]).sum()  # the prologue's qc
        scale = scales[:, band].double()
        scores += scale * (operands(band, bits, keys=True) @ q_band + offset)
        # values: centred through the accumulator input, then the plan's shift and step
        w = weights * scale
        centre = torch.tensor(
            [field_centre(bits, _kernel_slot(band, s - 64 * band)[1]) for s in slots], dtype=torch.float64
        )
        acc = w @ (magic - centre)
        band_sums = (
            acc + plan.v_shift.double()[64 * band : 64 * band + 64] * w.sum()
        ) * plan.v_step.double()[64 * band : 64 * band + 64]
        sums[plan.slot_coef[64 * band : 64 * band + 64].long()] += band_sums
    return scores, sums


@pytest.mark.parametrize("key_word_pairs", [False, True])
@pytest.mark.parametrize("spec", ["default", "default;window=8;sinks=2"])
def test_v3_plan_reproduces_scores_and_value_sums(spec, key_word_pairs):
    layout = ops.compressed_layout(spec, 128)
    plan = K._plan_v3(layout, torch.device("cpu"), key_word_pairs)
    n = 200
    codes = torch.randint(0, 256, (n, layout.n_code_bytes), dtype=torch.uint8)
    scales = (torch.rand(n, 2) + 0.5).half()
    query = torch.randn(128, dtype=torch.float64)
    weights = torch.rand(n, dtype=torch.float64)
    coefficients = K.decode_coefficients(codes, scales, layout).double()  # [N, D]
    want_scores = coefficients @ (layout.transform.double() @ query)
    want_sums = weights @ coefficients
    scores, sums = emulate(layout, plan, codes, scales, query, weights, key_word_pairs)
    torch.testing.assert_close(scores, want_scores, rtol=1e-6, atol=1e-6 * want_scores.abs().max().item())
    torch.testing.assert_close(sums, want_sums, rtol=1e-6, atol=1e-6 * want_sums.abs().max().item())


def test_v3_plan_slots_hold_every_coefficient_once():
    plan = K._plan_v3(ops.compressed_layout("default", 128), torch.device("cpu"))
    assert sorted(plan.slot_coef.tolist()) == list(range(128))
    assert plan.k_slots == plan.v_slots == 128


@pytest.mark.parametrize(
    "spec,head_dim,why",
    [
        ("lloyd", 128, "not affine"),
        ("default", 64, "head_dim 128"),
        ("default;bands=1/4:4:uniform:mse,3/4:2:uniform:mse", 128, "bands"),
    ],
)
def test_v3_rejects_other_layouts_with_a_reason(spec, head_dim, why):
    layout = ops.compressed_layout(spec, head_dim)
    with pytest.raises(K.UnsupportedLayout, match=why):
        K._plan_v3(layout, torch.device("cpu"))
    codes = torch.zeros(1, 1, 4, layout.n_code_bytes, dtype=torch.uint8)
    scales = torch.zeros(1, 1, 4, layout.n_bands, dtype=torch.float16)
    assert why in K._v3_reason(layout, codes, scales)


def test_v3_falls_back_off_the_gpu():
    # CPU tensors (or the interpreter): v3 cannot run, the call takes v1 and says why
    layout = ops.compressed_layout("default", 128)
    codes = torch.zeros(1, 1, 4, layout.n_code_bytes, dtype=torch.uint8)
    scales = torch.zeros(1, 1, 4, 2, dtype=torch.float16)
    assert "CUDA only" in K._v3_reason(layout, codes, scales)
    config = K.LaunchConfig(kernel="v3", num_stages=1)
    assert K.split_kernel_choice(config, layout, codes, scales) == "v1"


@pytest.mark.parametrize(
    "bad",
    [
        dict(kernel="v3", num_warps=2),
        dict(kernel="v3", num_stages=5),
        dict(kernel="v1", keys_ahead=True),
        dict(kernel="v3", keys_ahead=True, keys_via_smem=True),
        dict(kernel="v1", prefetch_value_rows=True),
        dict(kernel="v1", fill_value_rows_l2=True),
        dict(kernel="v1", value_copies_l2_256b=True),
        dict(kernel="v2", plain_loads_l2_256b=True),
        dict(kernel="v1", zero_padding_p=True),
        dict(kernel="v2", value_subnormals=True),
        dict(kernel="v1", packed_p_scaling=True),
        dict(kernel="v3", convert_p_once=True, value_scales_in_b=False, packed_p_scaling=True),
        dict(kernel="v1", band_columns=True),
        dict(kernel="v3", convert_p_once=False, band_columns=True),
        dict(kernel="v1", value_scales_staged=True),
        dict(kernel="v3", value_scales_staged=True),  # (value_scales_in_b off)
        dict(kernel="v3", value_scales_in_b=True, block_n=32, value_scales_staged=True),
        dict(kernel="v1", counted_steps=True),
        dict(kernel="v2", transform_in_split=True),
        dict(kernel="v1", query_in_split=True),
        dict(kernel="v1", phase_clocks=True),
        dict(kernel="v1", split_major_grid=True),
    ],
)
def test_v3_config_is_validated(bad):
    with pytest.raises(ValueError, match="v3"):
        K.LaunchConfig(**bad)


@pytest.mark.parametrize("bad", [dict(channel_merge_channels=0), dict(channel_merge_channels=48)])
def test_channel_merge_channels_must_be_a_power_of_two(bad):
    with pytest.raises(ValueError, match="channel_merge_channels must be a power of two"):
        K.LaunchConfig(kernel="v3", transform_in_split=True, **bad)


def test_query_in_split_needs_the_query_read_after_the_wait():
    with pytest.raises(ValueError, match="query_in_split reads the query after the PDL wait"):
        K.LaunchConfig(kernel="v3", query_in_split=True, loads_before_pdl_wait=1)


TMA_ROWS_CONFIG = dict(kernel="v3", tma_rows=True, num_stages=2, keys_ahead=False, key_word_pairs=False)


@pytest.mark.parametrize(
    "clash, named",
    [
        (dict(num_stages=1), "num_stages >= 2"),
        (dict(keys_ahead=True), "keys_ahead"),
        (dict(key_word_pairs=True), "key_word_pairs"),
        (dict(band_columns=True, convert_p_once=True), "band_columns"),
        (dict(loads_before_pdl_wait=1), "loads_before_pdl_wait=0"),
    ],
)
def test_tma_rows_config_names_what_it_cannot_take(clash, named):
    # tma_rows reads the keys and values from a ring of TMA copies: a config that also asks for the
    # keys a step ahead in registers, one stage, or another row layout is refused by name
    K.LaunchConfig(**TMA_ROWS_CONFIG)  # the valid one
    with pytest.raises(ValueError, match="tma_rows reads the keys and values from a ring") as err:
        K.LaunchConfig(**{**TMA_ROWS_CONFIG, **clash})
    assert named in str(err.value)
    with pytest.raises(ValueError, match="v3 option"):
        K.LaunchConfig(**{**TMA_ROWS_CONFIG, "kernel": "v1"})


def test_tma_row_descriptors_view_every_cache_row_as_24_int16():
    # the kernel addresses token t of (sequence b, kv head h) as flat row (b * Hkv + h) * capacity
    # + t of a [rows, 24] int16 view, read in [64, 32] boxes: the descriptors must say exactly that
    gluon = pytest.importorskip("wmoe_compile.kernels.wavelet_attention_gluon")
    if not gluon.HAS_GLUON:
        pytest.skip(gluon.GLUON_IMPORT_ERROR)
    k_codes = torch.randint(0, 256, (3, 2, 80, 48), dtype=torch.uint8)
    v_codes = torch.randint(0, 256, (3, 2, 80, 48), dtype=torch.uint8)
    k_desc, v_desc = K._tma_row_descriptors(k_codes, v_codes)
    for desc, codes in ((k_desc, k_codes), (v_desc, v_codes)):
        assert list(desc.shape) == [3 * 2 * 80, 24] and list(desc.strides) == [24, 1]
        assert list(desc.block_shape) == [64, 32] and desc.layout == gluon.TMA_ROWS_LAYOUT
        assert desc.base.data_ptr() == codes.data_ptr()
        b, h, t = 2, 1, 77  # a row's 24 int16 are its 48 code bytes
        row = (b * 2 + h) * 80 + t
        assert torch.equal(desc.base[row].view(torch.uint8), codes[b, h, t])


def test_tma_rows_reason_names_what_the_caches_lack():
    # tma_rows runs only on the default codec's 48-byte rows in contiguous CUDA codes on sm_90+;
    # the launch then runs the same step without it (wavelet_attention_triton)
    from wmoe_compile.codec import get_codec
    from wmoe_compile.ops import attention as ops

    layout = ops.compressed_layout(get_codec("default", 128).spec, 128)
    assert layout.n_code_bytes == 48
    codes = torch.zeros(2, 2, 64, 48, dtype=torch.uint8)
    reason = K.tma_rows_reason(layout, codes, codes)
    assert reason is not None and "sm_90" in reason  # (a CPU tensor)
    other = ops.compressed_layout(
        get_codec("default;bands=1/2:4:uniform:mse,1/2:4:uniform:mse", 128).spec, 128
    )
    wide = torch.zeros(2, 2, 64, other.n_code_bytes, dtype=torch.uint8)
    assert "48-byte code rows" in K.tma_rows_reason(other, wide, wide)
    strided = torch.zeros(2, 2, 64, 96, dtype=torch.uint8)[..., :48]
    assert "contiguous" in K.tma_rows_reason(layout, strided, strided)


def test_fast_launch_keys_a_tensor_descriptor_by_its_block_and_layout():
    # TMA_ROWS passes host tensor descriptors: the compiled kernel depends on their dtype, block
    # shape and layout, not on their shape or strides (runtime), and the key must be hashable
    from wmoe_compile.kernels import fast_launch

    class Descriptor:  # the attributes fast_launch reads, as Gluon's TensorDescriptor has them
        def __init__(self, rows: int, block: list) -> None:
            self.base = torch.zeros(rows, 24, dtype=torch.int16)
            self.block_shape = block
            self.layout = "NVMMASharedLayout(swizzle_byte_width=64)"

    key = fast_launch.argument_key((Descriptor(64, [64, 32]), 3))
    hash(key)
    assert key == fast_launch.argument_key((Descriptor(128, [64, 32]), 3))
    assert key != fast_launch.argument_key((Descriptor(64, [32, 32]), 3))


def _unpack_fragment_words(words: torch.Tensor) -> torch.Tensor:
    """The [H, M, K] fp32 matrix that fragment_words' [H, K / 16, M / 16, 32, 4] words hold, read the
    way the kernel's A fragments read them (lane 4g + t, word w of a tile: rows g + 8 (w % 2),
    columns 8 (w // 2) + 2t, + 1), written here independently of fragment_words' permute."""
    h, blocks, tiles = words.shape[:3]
    halves = words.contiguous().view(torch.int16).view(torch.float16).reshape(*words.shape, 2)
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    matrix = torch.zeros(h, 16 * tiles, 16 * blocks)
    for block in range(blocks):
        for tile in range(tiles):
            for w in range(4):
                for half in range(2):
                    rows = 16 * tile + g + 8 * (w % 2)
                    columns = 16 * block + 8 * (w // 2) + 2 * t + half
                    matrix[:, rows, columns] = halves[:, block, tile, :, w, half].float()
    return matrix


@pytest.mark.parametrize("rotation", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_query_slot_words_reproduce_the_prologue(rotation, pairs):
    # query_in_split: the split kernel computes the prologue's output itself, from M_h s_k in fp16
    # (fragment-ordered words) and the query in fp16, accumulating in fp32, then the slot factors
    # and qk_scale in fp32 and a round to fp16. Emulated here from the words as the kernel reads
    # them, it must give the interpreted prologue's q_w and band offsets to fp16 rounding.
    torch.manual_seed(3)
    layout = ops.compressed_layout("default", 128)
    plan = K._plan_v3(layout, torch.device("cpu"), pairs)
    batch, hkv, group, d = 2, 2, 4, 128
    q = torch.randn(batch, hkv * group, 1, d).to(torch.bfloat16)
    k_scale = torch.rand(hkv, d) + 0.5
    r = torch.linalg.qr(torch.randn(hkv, d, d, dtype=torch.float64))[0].float() if rotation else None
    qk_scale = 128**-0.5 * K.LOG2E
    m, stride = K.query_transform(plan.transform_slots, r, k_scale)
    programs, n_qc = batch * hkv, d // 32
    qw = torch.zeros(programs, 4, d, dtype=torch.float16)
    qc = torch.zeros(programs, n_qc, 4, 4)
    K._prologue_kernel[(programs, n_qc)](
        q, *q.stride()[:3], k_scale, k_scale.stride(0), m, stride, plan.k_factor, plan.k_shift,
        plan.slot_chunk, qw, qc, hkv, group, 1, 1, qk_scale, D=d, S=d, BLOCK_M=4, D_CHUNK=32,
    )  # fmt: skip
    words, head_stride = K.query_slot_transform_words(plan.transform_slots, r, k_scale, k_scale)
    assert words.shape == (hkv, 8, 8, 32, 4) and head_stride == words.stride(0)
    mq = _unpack_fragment_words(words)  # [head, slot, channel] as the A fragments hold it
    rows = q.reshape(batch, hkv, group, d).float().to(torch.float16).float()  # fp16 B operands
    acc = torch.einsum("hsc,bhrc->bhrs", mq, rows)  # fp32 accumulation of fp16 products
    emulated = (acc * (plan.k_factor * qk_scale)).to(torch.float16).reshape(programs, group, d)
    torch.testing.assert_close(
        emulated.float(), qw.float(), rtol=4e-3, atol=4e-3 * qw.float().abs().max().item()
    )
    shifted = emulated.float() * plan.k_shift
    for band in (0, 1):
        want = qc[:, :, :, band].sum(1)  # the prologue's chunk shares, summed as _load_query sums them
        got = shifted[:, :, plan.slot_chunk == band].sum(-1)
        assert (plan.slot_chunk[64 * band : 64 * (band + 1)] == band).all()  # operands 0-3 / 4-7
        torch.testing.assert_close(got, want, rtol=5e-3, atol=5e-3 * want.abs().max().item())


def test_query_in_split_rounding_moves_the_output_little():
    # query_in_split multiplies the query by M_h s_k rounded to fp16 (the prologue: fp32). That
    # rounding equals a perturbation dq = M^-1 (q_w' - q_w) of the query; attention over the
    # decompressed cache with q + dq must stay within 1e-3 of attention with q (measured 1.4e-4),
    # far inside the GPU test's 3e-3 against the prologue's path
    from test_wavelet_attention import UNIFORM_REAL, dense_reference, make_case, rel_err

    torch.manual_seed(4)
    codec, args = make_case(
        UNIFORM_REAL, 3, 2, 4, 1, 128, [4096, 1000, 2049], 4096, torch.bfloat16, "cpu", "full"
    )
    q, k_channel = args[0], args[8]
    plan = K._plan_v3(ops.compressed_layout(codec.spec, 128), torch.device("cpu"), True)
    params = K.attention_channel_params(k_channel, 2, 128, "k_channel_scale", copy=False)
    m, _ = K.query_transform(plan.transform_slots, params.rotation, k_channel)
    m = m.double().reshape(-1, 128, 128) * params.scale.double()[:, None, :]  # [Hkv, slots, channels]
    rows = q.double().reshape(3, 2, 4, 128)
    exact = torch.einsum("hsd,bhrd->bhrs", m, rows)
    rounded = torch.einsum("hsd,bhrd->bhrs", m.half().double(), rows.half().double())
    assert 0 < float((rounded - exact).norm() / exact.norm()) < 1e-3
    dq = torch.einsum("hds,bhrs->bhrd", torch.linalg.inv(m), rounded - exact)
    moved = ((rows + dq).reshape(q.shape).float(), *args[1:])
    want = dense_reference(codec, args, 128**-0.5)
    assert rel_err(dense_reference(codec, moved, 128**-0.5).double(), want) <= 1e-3


def test_channel_merge_warps_are_validated():
    with pytest.raises(ValueError, match="channel_merge_warps must be 1, 2, 4, 8 or 16"):
        K.LaunchConfig(kernel="v3", transform_in_split=True, channel_merge_warps=3)


@pytest.mark.parametrize("rotation", [False, True])
@pytest.mark.parametrize("pairs", [False, True])
def test_value_slot_transform_words_hold_t_in_fragment_order(rotation, pairs):
    # transform_in_split: the split kernel reads T from int32 words, a lane's 4 words of a row tile
    # at once, and restates them as the A fragments (lane 4g + t: rows g, g + 8 and slots 2t, 2t + 1,
    # 2t + 8, 2t + 9 of the tile). Unpacked that way here, the words must give T = (W R_h) at each
    # value slot's coefficient, and T x (the sums in slot order) the channels the reduce's
    # transform gives from the same sums in coefficient order.
    torch.manual_seed(1)
    layout = ops.compressed_layout("default", 128)
    plan = K._plan_v3(layout, torch.device("cpu"), pairs)
    hkv, d = 3, 128
    r = torch.linalg.qr(torch.randn(hkv, d, d, dtype=torch.float64))[0].float() if rotation else None
    channel_tensor = torch.rand(hkv, d) + 0.5
    words, stride = K.value_slot_transform_words(plan.transform, r, plan.slot_coef, channel_tensor)
    assert words.dtype == torch.int32 and words.shape == ((hkv if rotation else 1), 8, 8, 32, 4)
    assert stride == (words.stride(0) if rotation else 0)
    unpacked = _unpack_fragment_words(words)  # [head, channel, slot]
    composite = plan.transform.double() if r is None else plan.transform.double() @ r.double()
    composite = composite.reshape(-1, d, d)
    want = composite[:, plan.slot_coef.long(), :].transpose(1, 2)  # [H, channels, slots]
    torch.testing.assert_close(unpacked.double(), want, rtol=1e-3, atol=1e-3)  # fp16 rounding
    sums = torch.randn(words.shape[0], d, dtype=torch.float64)  # coefficient order
    by_slots = torch.einsum("hcj,hj->hc", unpacked.double(), sums[:, plan.slot_coef.long()])
    torch.testing.assert_close(by_slots, torch.einsum("hk,hkc->hc", sums, composite), rtol=0, atol=2e-2)
    # cached on the channel tensor: the same words again, new ones once it changes in place
    assert K.value_slot_transform_words(plan.transform, r, plan.slot_coef, channel_tensor)[0] is words
    channel_tensor.add_(1.0)
    assert K.value_slot_transform_words(plan.transform, r, plan.slot_coef, channel_tensor)[0] is not words


@pytest.mark.parametrize("split_chunk,channels", [(4, 16), (16, 64), (128, 32)])
@pytest.mark.parametrize("offset", [False, True])
def test_channel_merge_matches_the_two_group_reduce(split_chunk, channels, offset):
    # transform_in_split: the split kernel maps its sums to channels, so every partial reaches the
    # reduce in the channel domain and _merge_channel_rows_kernel merges them all under one
    # softmax. From the same random partials (coefficient sums mapped to channels here in float64)
    # it must give what the per-row reduce gives with its own transform; an empty split included
    torch.manual_seed(2)
    batch, hkv, group, d, num_splits, n_exact = 2, 2, 4, 64, 6, 3
    block_m, programs = 4, batch * hkv
    n_parts = num_splits + n_exact
    m = torch.randn(programs, n_parts, block_m) * 4
    den = torch.rand(programs, n_parts, block_m) + 0.5
    acc = torch.randn(programs, n_parts, block_m, d)
    m[:, 2] = -1.0e30
    den[:, 2], acc[:, 2] = 0.0, 0.0
    transform = torch.randn(hkv, d, d) / d**0.5  # [coefficient, channel]
    scale = torch.rand(hkv, d) + 0.5
    v_offset = torch.randn(hkv, d)
    heads = torch.arange(programs) % hkv
    channels_acc = acc.clone()
    channels_acc[:, :num_splits] = (
        torch.einsum("psrc,pcd->psrd", acc[:, :num_splits].double(), transform[heads].double())
        * scale[heads, None, None].double()
    ).float()
    flags = dict(D=d, BLOCK_M=block_m, OFFSET=offset)
    want = torch.full((batch, hkv * group, 1, d), float("nan"))
    output_args = (transform, transform.stride(0), scale, scale.stride(0), v_offset, v_offset.stride(0))
    # no sink logits: the sink pointer, the query's pointer and strides, the key offset's, qk_scale
    no_sinks = (v_offset, v_offset, 0, 0, 0, v_offset, 0, 1.0)
    K._reduce_rows_kernel[(programs * block_m,)](
        m, den, acc, *output_args, want, *want.stride()[:3], *no_sinks, hkv, group, 1, 1, num_splits, n_parts,
        SPLIT_CHUNK=16, **flags,
    )  # fmt: skip
    got = torch.full_like(want, float("nan"))
    K._merge_channel_rows_kernel[(programs * block_m, d // channels)](
        m, den, channels_acc, v_offset, v_offset.stride(0), got, *got.stride()[:3], *no_sinks, hkv, group, 1,
        1, n_parts, SPLIT_CHUNK=split_chunk, CHANNELS=channels, **flags,
    )  # fmt: skip
    assert not got.isnan().any() and not want.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the merge sees the partials it is given: drop the exact ones and the result moves
    fewer = torch.full_like(want, float("nan"))
    K._merge_channel_rows_kernel[(programs * block_m, d // channels)](
        m, den, channels_acc, v_offset, v_offset.stride(0), fewer, *fewer.stride()[:3], *no_sinks, hkv, group,
        1, 1, num_splits, SPLIT_CHUNK=split_chunk, CHANNELS=channels, **flags,
    )  # fmt: skip
    assert (fewer - want).abs().max() > 1e-2


def test_value_subnormals_hold_to_short_splits():
    # the uncentred value sums lose precision with the split's length: a launch whose longest split
    # passes the bound runs the centred step (the bound itself is validated)
    config = K.LaunchConfig(kernel="v3", value_subnormals=True, value_subnormals_max_split_tokens=8192)
    tokens = 32768 - 132  # the default codec's compressed span at a 32k cache
    assert not K.value_subnormals_apply(config, tokens, K.SplitPlan(1))
    assert not K.value_subnormals_apply(config, tokens, K.SplitPlan(3))  # 10,880-token splits
    assert K.value_subnormals_apply(config, tokens, K.SplitPlan(4))  # 8,192: at the bound
    assert K.value_subnormals_apply(config, tokens, K.SplitPlan(49))
    # a remainder plan: 6 splits of 83 steps and a short one
    assert K.value_subnormals_apply(config, tokens, K.SplitPlan(7, 83, 510, split_major=True))
    off = dataclasses.replace(config, value_subnormals=False)
    assert not K.value_subnormals_apply(off, tokens, K.SplitPlan(49))
    with pytest.raises(ValueError, match="value_subnormals_max_split_tokens"):
        K.LaunchConfig(kernel="v3", value_subnormals=True, value_subnormals_max_split_tokens=32)


def test_band_columns_need_a_small_group_and_two_scale_rows():
    # the MMAs' columns 4-7 repeat GQA blocks of up to 4 rows, and each token's two value scales are
    # read as one 4-byte word: other launches take the two B operands
    scales = torch.rand(2, 8, 64, 2).half()
    assert K._band_columns_fit(scales, scales, 4)
    assert K._band_columns_fit(scales, scales, 1)
    assert not K._band_columns_fit(scales, scales, 8)
    wide = torch.rand(2, 8, 64, 3).half()[..., :2]  # rows of three scales
    assert not K._band_columns_fit(wide, wide, 4)
    odd = torch.rand(2 * 8 * 64 * 2 + 1).half()[1:].view(2, 8, 64, 2)  # 2-byte aligned only
    assert not K._band_columns_fit(scales, odd, 4)


def test_key_load_hint_needs_keys_loaded_from_global_memory():
    for bad in (dict(kernel="v1"), dict(kernel="v3", num_stages=2, keys_via_smem=True)):
        with pytest.raises(ValueError, match="key_loads_l2_256b"):
            K.LaunchConfig(key_loads_l2_256b=True, **bad)
    K.LaunchConfig(kernel="v3", key_loads_l2_256b=True)  # in-step key loads take it too
    K.LaunchConfig(kernel="v3", keys_ahead=True, key_loads_l2_256b=True)


def test_key_word_pairs_needs_keys_loaded_from_global_memory():
    for bad in (dict(kernel="v1"), dict(kernel="v3", num_stages=2, keys_via_smem=True)):
        with pytest.raises(ValueError, match="key_word_pairs"):
            K.LaunchConfig(key_word_pairs=True, **bad)
    K.LaunchConfig(kernel="v3", keys_ahead=True, key_word_pairs=True)
    # a v3 failure falls back to v1 without it
    assert not K.v1_fallback(K.LaunchConfig(kernel="v3", key_word_pairs=True)).key_word_pairs


def test_key_word_pairs_run_only_on_8_byte_aligned_code_rows():
    layout = ops.compressed_layout("default", 128)
    codes = torch.zeros(2, 8, 64, layout.n_code_bytes, dtype=torch.uint8)
    assert layout.n_code_bytes % 8 == 0 and K._key_pairs_aligned(codes, layout)
    # a view 4 bytes into the storage, and rows padded to a stride that is not a multiple of 8
    storage = torch.zeros(codes.numel() + 8, dtype=torch.uint8)
    assert not K._key_pairs_aligned(storage[4 : 4 + codes.numel()].view(codes.shape), layout)
    padded = torch.zeros(2, 8, 64, layout.n_code_bytes + 4, dtype=torch.uint8)[..., : layout.n_code_bytes]
    assert not K._key_pairs_aligned(padded, layout)


def test_key_word_pairs_plan_is_not_the_unpaired_one():
    # the emulation test below has teeth: the paired plan's key slots, read in the unpaired order,
    # give other scores (the value sums do not depend on it)
    layout = ops.compressed_layout("default", 128)
    paired = K._plan_v3(layout, torch.device("cpu"), True)
    plain = K._plan_v3(layout, torch.device("cpu"), False)
    assert not torch.equal(paired.transform_slots, plain.transform_slots)
    assert torch.equal(paired.slot_coef, plain.slot_coef)
    pair_order = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    assert [attention_plans.v3_key_pair_element(j) for j in range(16)] == pair_order
    codes = torch.randint(0, 256, (50, layout.n_code_bytes), dtype=torch.uint8)
    scales = (torch.rand(50, 2) + 0.5).half()
    query = torch.randn(128, dtype=torch.float64)
    weights = torch.rand(50, dtype=torch.float64)
    want = K.decode_coefficients(codes, scales, layout).double() @ (layout.transform.double() @ query)
    wrong, _ = emulate(layout, paired, codes, scales, query, weights, key_word_pairs=False)
    assert (wrong - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize(
    "config",
    [
        K.LaunchConfig(kernel="v3", num_stages=1, block_n=16),
        # the tuned config carries v3-only options, which v1's config must drop
        K.TUNED_CONFIGS[(128, 4, "affine")],
        dataclasses.replace(
            K.TUNED_CONFIGS[(128, 4, "affine")], overlap_exact=False, exact_in_chain=True, keys_ahead=True
        ),
    ],
    ids=["v3", "tuned", "tuned_exact_in_chain"],
)
def test_a_v3_build_failure_falls_back_to_v1_once(monkeypatch, config):
    # Gluon's API moves between Triton releases (3.9 renamed the cp.async copy): a v3 kernel that
    # fails to build or launch must not fail the attention call. Pretend v3 can run here; the
    # Gluon launch then fails (no interpreter for Gluon), the call runs v1, warns once, and later
    # calls skip v3 with the recorded reason.
    import warnings

    from test_wavelet_attention import UNIFORM_SPEC, _run_triton, dense_reference, make_case, rel_err

    monkeypatch.setattr(K, "_V3_FAILURE", "")
    real_reason = K._v3_reason
    monkeypatch.setattr(
        K, "_v3_reason", lambda *a: K._V3_FAILURE or None if a[1].device.type == "cpu" else real_reason(*a)
    )
    codec, args = make_case(UNIFORM_SPEC, 2, 2, 4, 1, 128, [75, 33], 75, torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2
    assert any("v3 failed on this Triton" in str(w.message) for w in caught)
    assert K._V3_FAILURE.startswith("v3 failed on this Triton")
    assert K.split_kernel_choice(config, ops.compressed_layout(codec.spec, 128), args[1], args[2]) == "v1"


def test_a_group_of_16_where_v3_cannot_run_takes_the_v2_default_it_ran_before(monkeypatch):
    # the package's choice at 9-16 rows is v3 (two row blocks of 8); without v3 (here: the CPU) the
    # call must not run v3's one-warp settings on v1 at 16 rows, but default_config's 4 warps (v2
    # where the layout allows it, else v1)
    from test_wavelet_attention import UNIFORM_SPEC, _run_triton, dense_reference, make_case, rel_err

    launched = []
    real_launch = K.launch

    def record(kernel, grid, *args, **kw):
        launched.append((getattr(kernel, "__name__", str(kernel)), kw.get("BLOCK_M"), kw.get("num_warps")))
        return real_launch(kernel, grid, *args, **kw)

    monkeypatch.setattr(K, "launch", record)
    codec, args = make_case(UNIFORM_SPEC, 2, 1, 16, 1, 128, [75, 33], 75, torch.float16)
    assert K.tuned_config(ops.compressed_layout(codec.spec, 128), 128, 16, 2).kernel == "v3"
    got = _run_triton(args, codec, 0.125, num_splits=2)
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2
    split = [entry for entry in launched if entry[0].startswith("_split_kernel")]
    assert split == [(split[0][0], 16, K.default_config(128, 16).num_warps)], launched


@pytest.mark.parametrize("group,tq,blocks", [(16, 1, 2), (12, 1, 2), (8, 2, 2), (8, 1, 1), (4, 1, 1)])
def test_v3_takes_more_than_8_query_rows_in_row_blocks_of_8(monkeypatch, group, tq, blocks):
    # v3's MMAs take 8 query rows: a v3 config for a larger GQA group (Qwen3-235B's 16) runs it in
    # row blocks of 8 rather than falling back to v1. Pretend v3 can run here and record the launch
    # sizes it is handed; the recorder then fails the launch, so the call runs v1 (checked too).
    import warnings

    from test_wavelet_attention import UNIFORM_SPEC, _run_triton, dense_reference, make_case, rel_err

    monkeypatch.setattr(K, "_V3_FAILURE", "")
    monkeypatch.setattr(K, "_v3_reason", lambda *a: K._V3_FAILURE or None)
    seen = []

    def record_and_fail(*args, **kw):
        parts, dims = args[8:10]  # _launch_v3's partial buffers and launch sizes
        seen.append((dims, parts[2].shape))
        raise RuntimeError("recorded")

    monkeypatch.setattr(K, "_launch_v3", record_and_fail)
    codec, args = make_case(UNIFORM_SPEC, 2, 2, group, tq, 128, [75, 33], 75, torch.float16)
    config = K.TUNED_CONFIGS[(128, 8, "affine")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2
    ((dims, l_part_shape),) = seen
    hkv, _, _, n_row_blocks, _, _, block_m, _, programs = dims[:9]
    assert (block_m, n_row_blocks) == (min(K._block_m(group * tq), 8), blocks)
    assert programs == 2 * hkv * blocks and l_part_shape[0] == programs


@pytest.mark.parametrize(
    "options",
    [
        [],
        ["--keys-ahead"],
        ["--lazy-rescale"],
        ["--tuned", "--pdl"],
        ["--copy-layout-tokens", "--value-scales-in-b", "--p-movmatrix"]
        + ["--score-offset-in-mma", "--step-row-base", "--key-loads-l2-256b", "--prefetch-value-rows"]
        + ["--fill-value-rows-l2"],
        ["--row-copies", "--keys-via-smem", "--no-cache-tiles", "--stages", "2"]
        + ["--value-scales-in-b", "--p-movmatrix"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--value-copies-l2-256b", "--plain-loads-l2-256b"],
        # (the early loads need the prologue: the tuned query_in_split reads the query after the wait)
        ["--tuned", "--pdl", *PLAIN_STEP, "--loads-before-pdl-wait", "2", "--without", "query_in_split"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--split-major"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--key-word-pairs"],
        ["--keys-ahead", "--key-word-pairs", "--step-row-base"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--zero-padding-p"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--packed-p-scaling"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--packed-p-scaling", "--value-subnormals"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--band-columns"],
        ["--tuned", "--pdl", *PLAIN_STEP, "--phase-clocks"],
    ],
    ids=[
        "plain",
        "keys_ahead",
        "lazy_rescale",
        "tuned",
        "layout_options_keys_in_step",
        "row_copies",
        "tuned_ptx_hints",
        "tuned_loads_before_wait",
        "tuned_split_major",  # a remainder SplitPlan's launch: the same loop
        "tuned_key_word_pairs",
        "key_word_pairs_unhinted",  # plain loads, vectorised by Triton from the alignment hint
        "tuned_zero_padding_p",
        "tuned_packed_p_scaling",
        "tuned_value_subnormals",
        "tuned_band_columns",
        "tuned_phase_clocks",  # the probe's stamps: a reduction and a store a step
    ],
)
def test_v3_compiles_for_sm90_on_this_triton(tmp_path, options):
    # Gluon's API moves between Triton releases (3.9 renamed the cp.async copy, which broke v3's
    # first version there): compile the kernel for an H100/H200 target here, no GPU needed, so
    # CI's Triton proves it builds, without spills at the tuned register cap, at about the
    # measured instruction count (on Triton 3.6 per 64-token step: 928 rescaling every step without
    # the layout options, 886 with the sixteenth session's, 778 tuned since the seventeenth, 969
    # with the lazy rescale's branch).
    import re

    out = _run_sm90_tool("sass_attention_v3.py", tmp_path, *options)
    # keys_ahead holds 24 more registers: at the cap a few bytes may spill (outside the loop, or one
    # reload in it); row_copies spills 32 bytes on Triton 3.9 (none on the device's 3.6)
    if not {"--keys-ahead", "--row-copies", "--tuned"} & set(options):
        assert "STACK:0" in out, out
    if "--row-copies" not in options:
        assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) <= 1, out
    step = int(re.search(r"full-step loop: (\d+) instructions", out).group(1))
    hmma = int(re.search(r"(\d+)\s+HMMA", out).group(1))
    assert hmma >= 64, out  # 32 key + 32 value field MMAs at least
    assert 600 < step < 1100, out
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    hmul2 = int(re.search(r"(\d+)\s+HMUL2", out).group(1))
    if "--band-columns" in options or ("--tuned" in options and tuned.band_columns):
        # one B operand for both bands: a PRMT and a mul.f16x2 per register (8 each), one token-sum
        # MMA of p * scale fewer (4 HMMAs)
        assert hmul2 == 8 and hmma == 72, out
    elif "--packed-p-scaling" in options or ("--tuned" in options and tuned.packed_p_scaling):
        # p times the two value scales: one packed multiply per B register and band (8 + 8), where
        # the plain fp16 products took 32 on duplicated halves and 16 PRMTs to pack them again
        assert hmul2 == 16, out
    prmt = re.search(r"(\d+)\s+PRMT$", out, re.M)
    band_columns = "--band-columns" in options or ("--tuned" in options and tuned.band_columns)
    staged = "--value-scales-staged" in options or ("--tuned" in options and tuned.value_scales_staged)
    if staged and not band_columns:
        # the value scales reach the B layout already packed in token pairs: of the 18 PRMTs a
        # step, the 16 that repacked the compiler's own conversion go (two split the loaded pairs)
        assert prmt and int(prmt.group(1)) <= 4, out
    if "--value-subnormals" in options or ("--tuned" in options and tuned.value_subnormals):
        # no centring per step: of the 56 FFMAs, the 32 that centred the value accumulators (their
        # rescale stays, as FMULs) and the 8 FADDs of the p * scale sums go
        assert int(re.search(r"(\d+)\s+FFMA$", out, re.M).group(1)) <= 24, out
    if options == ["--keys-ahead", "--key-word-pairs", "--step-row-base"]:
        pairs = re.search(r"(\d+)\s+LDG\.E\.64$", out, re.M)
        assert pairs and int(pairs.group(1)) == 8, out  # Triton vectorised the pairs itself
    if "--tuned" in options:
        # what made the tuned step faster: its key words issue a step before their first use
        # (median about 345 loop instructions on Triton 3.6, 112 with the keys loaded in-step), and
        # the step's rows are addressed by immediates from one register per lane (787 instructions;
        # 858 with a 64-bit address per row), and the key loads carry the L2::256B hint (778), a
        # lane's two 4-bit key words in one load (772), p scaled by packed multiplies and the value
        # sums centred at the store (738; 747 on Triton 3.9), where instructions counted about one
        # for one in the op's time (twenty-third session), the value scales staged by lane (732;
        # 739 on 3.9, twenty-fourth session): a step that grows past 760 is a regression
        distance = int(re.search(r"load-to-use distance: median (\d+)", out).group(1))
        assert distance >= 200, out
        # (the probe's stamps add a reduction and a store a step: 26 more)
        assert step < (790 if "--phase-clocks" in options else 760), out
        hinted = re.search(r"(\d+)\s+LDG\.E\.LTC256B$", out, re.M)
        paired = re.search(r"(\d+)\s+LDG\.E\.LTC256B\.64$", out, re.M)
        pairs = "--key-word-pairs" in options or K.TUNED_CONFIGS[(128, 4, "affine")].key_word_pairs
        # the step's key words: 24 a lane, 16 of the 4-bit band and 8 of the 2-bit one; with
        # key_word_pairs the 4-bit band's as 8 pairs. Plus the 4 scale-pair loads when the PTX
        # patch hints them
        scales = 4 if "--plain-loads-l2-256b" in options else 0
        if pairs:
            assert hinted and paired and (int(hinted.group(1)), int(paired.group(1))) == (8 + scales, 8), out
        else:
            assert not paired, out
            assert hinted and int(hinted.group(1)) == 24 + scales, out
        copies = re.search(r"(\d+)\s+LDGSTS\.E\.(LTC256B\.)?64", out)
        # the value tiles' 8-byte copies: 16, or 12 with the 2-bit band's tiles halved (tuned since
        # the forty-fourth session)
        half = "--value-band2-half" in options or (
            tuned.value_band2_half and "value_band2_half" not in options
        )
        assert copies and int(copies.group(1)) == (12 if half else 16), out
        assert bool(copies.group(2)) == ("--value-copies-l2-256b" in options), out
        # launched with PDL, no load of what the prologue writes (the query) may precede the wait.
        # Tuned: no load at all. loads_before_pdl_wait: the sequence length, the first step's 4
        # scale-pair loads and its key words (24 loads, 16 paired), written before the prologue (a
        # plain launch) began
        before = (5 + (16 if pairs else 24)) if "--loads-before-pdl-wait" in options else 0
        assert f"global loads before the PDL wait: {before}" in out, out


def test_counted_steps_take_fewer_loop_instructions(tmp_path):
    # LaunchConfig.counted_steps runs the full-step loop over step numbers: the same steps, and at
    # the register cap ptxas recomputes fewer loop bounds and addresses each step (twenty-fourth
    # session, offline: 732 -> 721 on Triton 3.6, 739 -> 728 on 3.9; with the options tuned since,
    # thirty-eighth session: 728 -> 725 on 3.6, 749 -> 729 on 3.9)
    import re

    def step(*options: str) -> int:
        # (the twenty-fourth session's tuned kernel, with the prologue: with query_in_split, on since
        # the twenty-sixth, Triton 3.9 counts 748 -> 747)
        tuned = ("--tuned", "--pdl", *PLAIN_STEP, "--without", "query_in_split")
        out = _run_sm90_tool("sass_attention_v3.py", tmp_path, *tuned, *options)
        assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
        return int(re.search(r"full-step loop: (\d+) instructions", out).group(1))

    assert step("--counted-steps") <= step() - 3


def test_a_gqa_group_of_8_runs_the_group_of_4s_loop(tmp_path):
    # TUNED_CONFIGS[(128, 8, ...)] is the group of 4's, not timed at 8 rows (thirty-ninth session):
    # what carries the group of 4's measurements over is that the MMAs have 8 query columns either
    # way, so the full-step loop is the same work: the same instruction mix on Triton 3.6 (the
    # GPU's), 3.7.1 and 3.8 (ptxas schedules it a little differently), one more on 3.9 (748 -> 749:
    # four moves for three uniform-register instructions)
    import re

    def loop(block_m: int) -> tuple[int, dict[str, int]]:
        out = _run_sm90_tool(
            "sass_attention_v3.py",
            tmp_path / str(block_m),
            "--tuned",
            "--pdl",
            *PLAIN_STEP,
            "--block-m",
            str(block_m),
        )
        assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
        length = int(re.search(r"full-step loop: (\d+)", out).group(1))
        mix = {op: int(n) for n, op in re.findall(r"^\s+(\d+)\s+(\S+)$", out, re.MULTILINE)}
        return length, mix

    (length_4, mix_4), (length_8, mix_8) = loop(4), loop(8)
    assert abs(length_8 - length_4) <= 2, (length_4, length_8)
    for op in ("HMMA.16816.F32", "LOP3.LUT", "MUFU.EX2", "LDGSTS.E.64", "LDG.E.LTC256B.64", "LDSM.16.MT88.4"):
        assert mix_8.get(op) == mix_4.get(op), (op, mix_4.get(op), mix_8.get(op))
    assert mix_4.get("HMMA.16816.F32", 0) > 60  # (the parse found the loop's mix)


def test_transform_in_split_leaves_the_loop_and_adds_a_short_epilogue(tmp_path):
    # LaunchConfig.transform_in_split maps the partial's sums to channels after the loop: the loop
    # must not change beyond scheduling noise, and the epilogue must stay one pass of 16-byte loads
    # of T in fragment order and 64 MMAs (twenty-fifth session, offline on Triton 3.6: +248
    # instructions; T loaded as fp16 pairs instead took 256 four-byte loads, +624)
    import re

    def counts(*options: str) -> tuple[int, int, int, int]:
        # (with the prologue, as measured: with query_in_split as well Triton 3.9 stacks 16 bytes)
        tuned = ("--tuned", "--pdl", *PLAIN_STEP, "--without", "query_in_split")
        out = _run_sm90_tool("sass_attention_v3.py", tmp_path, *tuned, *options)
        assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
        stack = int(re.search(r"STACK:(\d+)", out).group(1))  # (Triton 3.9: 16 bytes either way)
        loop = int(re.search(r"full-step loop: (\d+) instructions", out).group(1))
        kernel = int(re.search(r"kernel: (\d+) instructions", out).group(1))
        sass = (tmp_path / "split_kernel_v3.sass").read_text()
        return stack, loop, kernel, len(re.findall(r"LDG\.E\.128", sass))

    assert K.TUNED_CONFIGS[(128, 4, "affine")].transform_in_split
    for extra in ((), ("--band-columns",)):
        stack, loop, kernel, wide = counts("--without", "transform_in_split", *extra)
        stack_t, loop_t, kernel_t, wide_t = counts(*extra)
        assert stack_t <= stack, (extra, stack, stack_t)
        assert abs(loop_t - loop) <= LOOP_SCHEDULING_NOISE, (extra, loop, loop_t)
        assert wide_t - wide == 64, (extra, wide, wide_t)
        assert 100 <= kernel_t - kernel <= 450, (extra, kernel, kernel_t)


def test_query_in_split_leaves_the_loop_and_adds_one_transform(tmp_path):
    # LaunchConfig.query_in_split computes the query's slots in the split kernel before the loop:
    # the loop as before, 64 more 16-byte loads (M_h s_k in fragment order) and MMAs, and no stack
    # (twenty-fifth session, offline on Triton 3.6: +416 instructions)
    import re

    def counts(*options: str) -> tuple[int, int, int, int]:
        out = _run_sm90_tool("sass_attention_v3.py", tmp_path, "--tuned", "--pdl", *PLAIN_STEP, *options)
        assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
        assert "global loads before the PDL wait: 0" in out, out
        stack = int(re.search(r"STACK:(\d+)", out).group(1))
        loop = int(re.search(r"full-step loop: (\d+) instructions", out).group(1))
        kernel = int(re.search(r"kernel: (\d+) instructions", out).group(1))
        sass = (tmp_path / "split_kernel_v3.sass").read_text()
        return stack, loop, kernel, len(re.findall(r"HMMA", sass))

    assert K.TUNED_CONFIGS[(128, 4, "affine")].query_in_split  # on in the tuned config since session 26
    stack, loop, kernel, mmas = counts("--without", "query_in_split")
    stack_q, loop_q, kernel_q, mmas_q = counts()
    assert stack_q <= stack and abs(loop_q - loop) <= LOOP_SCHEDULING_NOISE, (stack, stack_q, loop, loop_q)
    assert mmas_q - mmas == 64, (mmas, mmas_q)
    assert 200 <= kernel_q - kernel <= 600, (kernel, kernel_q)


def test_cta_kernel_runs_the_one_warp_step_and_its_warps_meet_only_at_named_barriers(tmp_path):
    # LaunchConfig.cta_splits (kernels/wavelet_attention_cta.py): each warp runs the one-sequence
    # config's step on its own split, so the full-step loop costs about the one-warp kernel's (750
    # against 720 instructions on Triton 3.6, 746 against 715 on 3.9: the step's own, plus the
    # branch that skips step 0's value copies), with no spill; after the warp-barrier patch no
    # CTA-wide barrier is left, the loop has none, and the warps meet three times (the query's
    # slots, before the loop, the epilogue's means). Thirty-sixth session: step 0's 16 value
    # copies go out before the query's transform runs (its first MMA) and after its 16 word loads
    # (fenced above the split ranges, below which ptxas had sunk them); after the loops the only
    # global reads are T's words (16 bytes a load) and the 4 channel scales, the value slots' step
    # and shift coming from shared memory (read from global memory there, their 32 loads went out
    # in 3-4 batches the epilogue waited for)
    import re

    def number(pattern: str, out: str) -> int:
        return int(re.search(pattern, out).group(1))

    cta = _run_sm90_tool("sass_attention_cta.py", tmp_path / "cta")
    one_warp = _run_sm90_tool(
        "sass_attention_v3.py",
        tmp_path / "v3",
        *("--tuned", "--pdl", *PLAIN_STEP, "--band-columns", "--without", "key_word_pairs", "--split-major"),
    )
    assert number(r"loop spill instructions: (\d+)", cta) == 0, cta
    assert number(r"STACK:(\d+)", cta) == 0, cta
    assert number(r"CTA barriers \(bar.sync 0\) in the PTX: (\d+)", cta) == 0, cta
    assert number(r"named barriers \(bar.sync 1, 128\) in the PTX: (\d+)", cta) == 3, cta
    assert number(r"loop barriers: (\d+)", cta) == 0, cta
    loop = number(r"full-step loop: (\d+) instructions", cta)
    assert 0 <= loop - number(r"full-step loop: (\d+) instructions", one_warp) <= 40, (cta, one_warp)
    assert number(r"shared (\d+) B per CTA", cta) <= 48 * 1024  # two CTAs (8 warps) an SM and more
    epilogue_loads = re.search(r"epilogue global loads: (\d+) \((\d+) of 16 bytes\)", cta)
    assert epilogue_loads, cta
    assert int(epilogue_loads.group(2)) == 16 and int(epilogue_loads.group(1)) - 16 <= 4, cta
    assert "before the first MMA: 16 value copies, 16 16-byte loads" in cta, cta
    assert "the transform's word loads before step 0's copies: True" in cta, cta


def test_cta_splits_reason_names_what_stands_in_the_way():
    # the CTA kernel implements the small-launch config's path: anything else runs one split a
    # program, and cta_splits_reason says why
    small = K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")]
    assert small.cta_splits == 4
    layout = ops.compressed_layout("default", 128)
    scales = torch.empty(1, 8, 64, layout.n_bands, dtype=torch.float16)
    decode = (4, 1, 1, 4, 128)  # a GQA group of 4 rows, one new token, head_dim 128
    equal = K.SplitPlan(128)

    def reason(config=small, plan=equal, shape=decode):
        return K.cta_splits_reason(config, plan, shape, layout, scales)

    assert reason() is None
    assert reason(plan=K.SplitPlan(7)) is None  # (a last CTA of three splits)
    assert "GQA group of 4 rows" in reason(shape=(8, 1, 1, 8, 128))
    assert "one new token" in reason(shape=(2, 2, 1, 4, 128))
    assert "head_dim 128" in reason(shape=(4, 1, 1, 4, 64))
    assert "band_columns" in reason(dataclasses.replace(small, band_columns=False))
    assert "query_in_split" in reason(dataclasses.replace(small, query_in_split=False))
    assert "equal splits" in reason(plan=K.SplitPlan(7, 2, 13))
    assert "4 splits a CTA" in reason(dataclasses.replace(small, cta_splits=2))


def test_access_stream_probe_issues_the_split_kernels_loads(tmp_path):
    # benchmarks/probe_access_stream.py times "the op's loads without its math" (RESULTS.md,
    # thirty-second session): its step loop must issue the same global loads as the tuned split
    # kernel's step, instruction for instruction (key words: 8 hinted 8-byte and 8 hinted 4-byte
    # loads; values: 16 8-byte cp.async; scales: 4 loads), and its 16-byte variant 8 whole-row copies
    import re

    def loads(line: str) -> dict[str, int]:
        return {op: int(n) for op, n in re.findall(r"(LDG[\w.]*) (\d+)", line)}

    probe = _run_sm90_tool("probe_access_stream.py", tmp_path / "probe", "--sass")
    lines = {line.split(":")[0]: loads(line) for line in probe.splitlines() if ":" in line}
    kernel = _run_sm90_tool("sass_attention_v3.py", tmp_path / "v3", "--tuned", "--pdl", *PLAIN_STEP)
    mix = {op: int(n) for n, op in re.findall(r"^\s+(\d+)\s+(LDG[\w.]*)$", kernel, re.M)}
    ops_loads = lines["op's loads, values 1 step ahead, stages 2"]
    for op in ("LDG.E.LTC256B.64", "LDG.E.LTC256B", "LDGSTS.E.64", "LDG.E"):
        assert ops_loads[op] == mix[op] > 0, (op, ops_loads, mix)
    rows = lines["op's loads, 16-byte value rows 1 step ahead, stages 2"]
    assert rows["LDGSTS.E.BYPASS.128"] == 8 and rows["LDGSTS.E.64"] == 0, rows
    assert (
        lines["keys, stages 2"]["LDGSTS.E.64"] == 0
        and lines["values, 1 step ahead, stages 2"]["LDG.E.LTC256B"] == 0
    )


def test_instruction_fetch_probe_times_the_code_it_claims(tmp_path):
    # benchmarks/probe_instruction_fetch.py compares straight-line code with the same FMAs in a loop
    # (RESULTS.md, thirty-fourth session): its straight variants must compile to 8 x rounds FFMAs of
    # straight-line code (1,024 and 4,096), its looped ones to a loop body of 8 x 16
    import re

    out = _run_sm90_tool("probe_instruction_fetch.py", tmp_path, "--sass")
    found = re.findall(r"(\w+): (\d+) FFMA, (\d+) instructions", out)
    counts = {name: (int(f), int(n)) for name, f, n in found}
    assert counts["fma_128_straight"][0] == 1024 and counts["fma_512_straight"][0] == 4096, counts
    assert counts["fma_128_loop"][0] == counts["fma_512_loop"][0] == 128, counts
    assert counts["fma_512_straight"][1] - counts["fma_512_straight"][0] < 100, counts  # little else


def test_band_warps_spike_compiles_for_sm90(tmp_path):
    # benchmarks/spike_band_warps.py measures a two-warp step offline (one band per warp); its
    # batched MMAs, movmatrix transposes and trivial layout restatements must keep compiling
    import re

    out = _run_sm90_tool("spike_band_warps.py", tmp_path)
    assert "STACK:0" in out, out
    assert int(re.search(r"(\d+)\s+HMMA", out).group(1)) == 40, out  # 16 key, 16 value, 8 sums
    assert int(re.search(r"(\d+)\s+MOVM", out).group(1)) == 16, out  # p and p * scale


def test_head_dim64_spike_compiles_for_sm90(tmp_path):
    # benchmarks/spike_head_dim64.py counts a head_dim-64 Gluon step offline (its register field
    # masks, 4-byte key words and scale pairs); its figures are in docs/ATTENTION.md, so it must keep
    # compiling, with the operands it was written for: 4 key, 4 value and 3 token-sum MMAs of
    # m16n8k16 tiles over 64 tokens (44 HMMA), no spill
    import re

    out = _run_sm90_tool("spike_head_dim64.py", tmp_path)
    assert "STACK:0" in out, out
    assert int(re.search(r"(\d+)\s+HMMA", out).group(1)) == 44, out
    assert 500 < int(re.search(r"loop: (\d+) instructions", out).group(1)) < 900, out


def test_tma_rows_split_kernel_compiles_without_spills_and_leaves_the_tuned_kernel(tmp_path):
    # LaunchConfig.tma_rows in the split kernel (prepared in the thirty-seventh session, not yet run
    # on a GPU): offline its loop takes 2 TMA copies and no cp.async or global code loads, no
    # spill at the 168-register cap, 705 instructions against the tuned 728 (Triton 3.6)
    import re

    tma = ("--tma-rows", "--stages", "2", "--without", "keys_ahead", "--without", "key_word_pairs")
    out = _run_sm90_tool("sass_attention_v3.py", tmp_path, "--tuned", "--pdl", *PLAIN_STEP, *tma)
    assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
    assert int(re.search(r"full-step loop: (\d+) instructions", out).group(1)) <= 720, out
    import importlib.util
    import pathlib

    tool = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sass_attention_v3.py"
    spec = importlib.util.spec_from_file_location("sass_attention_v3", tool)
    sass_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_tool)
    loop = sass_tool.loop_instructions((tmp_path / "split_kernel_v3.sass").read_text())
    ops = [i.split()[1] if i.startswith("@") else i.split()[0] for i in loop]
    assert sum(o.startswith("UTMALDG") for o in ops) == 2, ops
    assert not any(o.startswith("LDGSTS") for o in ops), ops
    assert sum(o.startswith("LDSM") for o in ops) >= 8, ops
    # Triton fences each loop's copies (fence.proxy.async: MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S);
    # tma_rows_unfenced patches them out of the PTX (thirty-eighth session: 703 loop instructions)
    assert ops.count("MEMBAR.ALL.CTA") == 1 and ops.count("FENCE.VIEW.ASYNC.S") == 1, ops
    unfenced = tmp_path / "unfenced"
    out = _run_sm90_tool(
        "sass_attention_v3.py", unfenced, "--tuned", "--pdl", *PLAIN_STEP, *tma, "--tma-rows-unfenced"
    )
    assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
    loop = sass_tool.loop_instructions((unfenced / "split_kernel_v3.sass").read_text())
    ops_unfenced = [i.split()[1] if i.startswith("@") else i.split()[0] for i in loop]
    assert not any(o.startswith(("MEMBAR", "FENCE")) for o in ops_unfenced), ops_unfenced
    assert len(ops_unfenced) < len(ops) and sum(o.startswith("UTMALDG") for o in ops_unfenced) == 2
    kernel_sass = (unfenced / "split_kernel_v3.sass").read_text()
    assert "MEMBAR" not in kernel_sass  # (the masked steps' copies too)


def test_tma_rows_early_issues_each_copy_after_its_stages_value_reads(tmp_path):
    # LaunchConfig.tma_rows_early (thirty-eighth session): a full step's stage gets its next copy
    # once the step has read its value operands, behind the proxy fence; offline 700 loop
    # instructions at 2 stages (Triton 3.6), no spill, the fence after the last value ldmatrix
    import re

    tma = ("--tma-rows", "--stages", "2", "--without", "keys_ahead", "--without", "key_word_pairs")
    out = _run_sm90_tool(
        "sass_attention_v3.py", tmp_path, "--tuned", "--pdl", *PLAIN_STEP, *tma, "--tma-rows-early"
    )
    # (Triton 3.7.1, torch 2.12's, spills one instruction here; 3.6, 3.8 and 3.9 none)
    spills_allowed = 1 if triton.__version__.startswith("3.7.") else 0
    assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) <= spills_allowed, out
    assert int(re.search(r"full-step loop: (\d+) instructions", out).group(1)) <= 720, out
    ptx = (tmp_path / "split_kernel_v3.ptx").read_text()
    loop = ptx[ptx.index("mbarrier.try_wait") :]  # the full steps' loop first
    fence = loop.index("fence.proxy.async.shared::cta")
    assert loop.rindex("ldmatrix", 0, fence) > loop.index(".trans", 0, fence)  # values read before
    assert loop.index("cp.async.bulk.tensor", fence) < loop.index("ld.global", fence)  # then scales
    # scale_pairs_two_ahead: the same issue order, the pairs carried a step longer, no spill (3.6)
    two = tmp_path / "two_ahead"
    options = ("--tuned", "--pdl", *PLAIN_STEP, *tma, "--tma-rows-early", "--scale-pairs-two-ahead")
    out = _run_sm90_tool("sass_attention_v3.py", two, *options)
    assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) <= spills_allowed, out


def _loop_ops(tmp_path, *options: str) -> tuple[list[str], str]:
    """(the full-step loop's opcodes, the tool's stdout) of sass_attention_v3.py --tuned + options."""
    import importlib.util
    import pathlib

    out = _run_sm90_tool("sass_attention_v3.py", tmp_path, "--tuned", "--pdl", *PLAIN_STEP, *options)
    tool = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sass_attention_v3.py"
    spec = importlib.util.spec_from_file_location("sass_attention_v3", tool)
    sass_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass_tool)
    loop = sass_tool.loop_instructions((tmp_path / "split_kernel_v3.sass").read_text())
    return [i.split()[1] if i.startswith("@") else i.split()[0] for i in loop], out


def test_value_band2_half_copies_and_reads_the_2bit_value_band_once(tmp_path):
    # LaunchConfig.value_band2_half (forty-first session): the 2-bit value band's tile [64, 8]
    # instead of its 8 elements twice in [64, 16]; the operand's repeat costs no instruction (no
    # shuffle, no byte permute beyond the tuned step's), 1 KB less shared memory, no spill
    import re

    tuned_ops, tuned_out = _loop_ops(tmp_path / "tuned")
    half_ops, half_out = _loop_ops(tmp_path / "half", "--value-band2-half")
    shared = [int(re.search(r"shared (\d+) B per program", o).group(1)) for o in (tuned_out, half_out)]
    assert shared[1] == shared[0] - 1024, shared
    assert int(re.search(r"loop spill instructions: (\d+)", half_out).group(1)) == 0, half_out
    copies = [sum(o.startswith("LDGSTS") for o in ops) for ops in (tuned_ops, half_ops)]
    assert copies == [16, 12], copies
    ldmatrix = [sum(o.startswith("LDSM.16.MT88") for o in ops) for ops in (tuned_ops, half_ops)]
    assert ldmatrix == [8, 6], ldmatrix
    for moves in ("SHFL.IDX", "PRMT", "STS"):  # the repeat is not a layout conversion
        assert half_ops.count(moves) <= tuned_ops.count(moves), moves
    assert len(half_ops) <= len(tuned_ops), (len(half_ops), len(tuned_ops))


def test_token_sums_rows_takes_the_token_sums_from_one_mma(tmp_path):
    # LaunchConfig.token_sums_rows (forty-second session): one MMA a 16 tokens whose operand rows
    # are ones and the two value scales replaces three ones-operand MMAs, so a step has 8 MMAs and 8
    # rescale multiplies fewer; its operand comes by four 16-byte shared loads in place (no
    # shuffle, byte permute or register move to build it), its buffer 512 bytes, no spill
    import re

    tuned_ops, tuned_out = _loop_ops(tmp_path / "tuned")
    rows_ops, rows_out = _loop_ops(tmp_path / "rows", "--token-sums-rows")
    assert int(re.search(r"loop spill instructions: (\d+)", rows_out).group(1)) == 0, rows_out
    shared = [int(re.search(r"shared (\d+) B per program", o).group(1)) for o in (tuned_out, rows_out)]
    assert shared[1] == shared[0] + 512, shared
    count = {name: [ops.count(name) for ops in (tuned_ops, rows_ops)] for name in ("HMMA.16816.F32", "FMUL")}
    assert count["HMMA.16816.F32"] == [76, 68] and count["FMUL"][1] == count["FMUL"][0] - 8, count
    loads = [ops.count("LDS.128") for ops in (tuned_ops, rows_ops)]
    assert loads[1] == loads[0] + 4, loads
    for moves in ("SHFL.IDX", "PRMT", "IMAD.MOV.U32", "MOV"):
        assert rows_ops.count(moves) <= tuned_ops.count(moves), moves
    # with value_band2_half: fewer loop instructions than either alone, and 12 programs in 64 KB
    half_ops, _ = _loop_ops(tmp_path / "half", "--value-band2-half")
    both_ops, both_out = _loop_ops(tmp_path / "both", "--value-band2-half", "--token-sums-rows")
    assert len(both_ops) < min(len(half_ops), len(rows_ops)), (len(both_ops), len(half_ops), len(rows_ops))
    assert int(re.search(r"shared (\d+) B per program", both_out).group(1)) + 1024 <= 64 * 1024 // 12


def test_token_sums_rows_needs_value_subnormals_and_the_staged_scales():
    # (the tuned step without the options that refuse cta_splits themselves)
    tuned = dataclasses.replace(
        K.TUNED_CONFIGS[(128, 4, "affine")],
        value_band2_half=False,
        token_sums_rows=False,
        warp_barriers=False,
    )
    dataclasses.replace(tuned, token_sums_rows=True)
    dataclasses.replace(tuned, token_sums_rows=True, value_band2_half=True, num_stages=2)
    for clash in (
        dict(value_subnormals=False),
        dict(value_scales_staged=False),
        dict(band_columns=True),
        dict(cta_splits=4),
    ):
        with pytest.raises(ValueError, match="token_sums_rows takes v3's token sums from one MMA"):
            dataclasses.replace(tuned, **clash, token_sums_rows=True)
    # the constexpr only when on (a launch without it keeps its JIT key); off where v1 runs instead
    without = dataclasses.replace(tuned, token_sums_rows=False)
    assert "TOKEN_SUMS_ROWS" not in K.v3_option_constexprs(without, False)
    rows = dataclasses.replace(tuned, token_sums_rows=True)
    assert K.v3_option_constexprs(rows, False)["TOKEN_SUMS_ROWS"] is True
    assert not K.v1_fallback(rows).token_sums_rows


def test_warp_barriers_take_the_cta_barriers_out_of_the_step(tmp_path):
    # LaunchConfig.warp_barriers (forty-second session): the one-warp split kernel's CTA barriers
    # become warp barriers by the PTX patch, so no BAR.SYNC is left in the kernel (ptxas keeps one
    # WARPSYNC, behind a divergence check, in the step) and no instruction is added beyond those
    import re

    tuned_ops, _ = _loop_ops(tmp_path / "tuned")
    ops, out = _loop_ops(tmp_path / "warp", "--warp-barriers")
    assert sum(o.startswith("BAR.SYNC") for o in tuned_ops) >= 4, tuned_ops
    assert not any(o.startswith("BAR.") for o in ops), ops
    assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
    assert len(ops) <= len(tuned_ops) + 8, (len(ops), len(tuned_ops))
    ptx = (tmp_path / "warp" / "split_kernel_v3.ptx").read_text()
    assert "bar.warp.sync -1;" in ptx and not re.search(r"\bbar\.sync\s+0;", ptx)
    assert "BAR.SYNC" not in (tmp_path / "warp" / "split_kernel_v3.sass").read_text()


def test_warp_barriers_need_one_warp_split_programs():
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    warp = dataclasses.replace(tuned, warp_barriers=True)
    assert warp.needs_ptx_patches and not dataclasses.replace(tuned, warp_barriers=False).needs_ptx_patches
    for clash in (dict(num_warps=2), dict(kernel="v2"), dict(cta_splits=4)):
        with pytest.raises(ValueError, match="warp_barriers makes the CTA barriers of v3's one-warp"):
            K.LaunchConfig(**{"kernel": "v3", **clash}, warp_barriers=True)
    assert K.v3_option_constexprs(warp, False)["WARP_BARRIERS"] is True
    without = dataclasses.replace(tuned, warp_barriers=False)
    assert "WARP_BARRIERS" not in K.v3_option_constexprs(without, False)
    assert not K.v1_fallback(warp).warp_barriers


def test_value_copies_16b_l1_sends_the_16_byte_copies_through_l1(tmp_path):
    # LaunchConfig.value_copies_16b_l1 (forty-first session): without cache_tiles the tiles come by
    # 16-byte copies, which Triton emits as cp.async.cg (LDGSTS.E.BYPASS.128, L2 only); the PTX
    # patch makes them .ca (LDGSTS.E.128). With value_band2_half: 6 copies a step instead of the
    # tuned kernel's 16, no spill
    import re

    plain = ("--no-cache-tiles", "--without", "copy_layout_tokens")
    ops, _ = _loop_ops(tmp_path / "cg", *plain)
    assert ops.count("LDGSTS.E.BYPASS.128") == 8 and "LDGSTS.E.128" not in ops, ops
    ops, _ = _loop_ops(tmp_path / "ca", *plain, "--value-copies-16b-l1")
    assert ops.count("LDGSTS.E.128") == 8 and not any("BYPASS" in o for o in ops), ops
    ops, out = _loop_ops(tmp_path / "ca_half", *plain, "--value-copies-16b-l1", "--value-band2-half")
    assert ops.count("LDGSTS.E.128") == 6 and sum(o.startswith("LDGSTS") for o in ops) == 6, ops
    assert int(re.search(r"loop spill instructions: (\d+)", out).group(1)) == 0, out
    tuned_ops, _ = _loop_ops(tmp_path / "tuned")
    assert len(ops) < len(tuned_ops), (len(ops), len(tuned_ops))


def test_configs_whose_kernels_carry_a_ptx_patch_marker_need_the_hook():
    # the launcher and sass_attention_v3.py install the PTX hook when needs_ptx_patches says so; a
    # marked kernel compiled without it would run unpatched
    # (the tuned config with every patch-marked option off, whichever it takes)
    patched = ("value_copies_l2_256b", "plain_loads_l2_256b", "value_copies_16b_l1", "warp_barriers")
    tuned = dataclasses.replace(K.TUNED_CONFIGS[(128, 4, "affine")], **dict.fromkeys(patched, False))
    assert not tuned.needs_ptx_patches
    sixteen = dict(cache_tiles=False, copy_layout_tokens=False, value_copies_16b_l1=True)
    for marked in (
        dataclasses.replace(tuned, value_copies_l2_256b=True),
        dataclasses.replace(tuned, plain_loads_l2_256b=True),
        dataclasses.replace(tuned, **sixteen),
        dataclasses.replace(tuned, warp_barriers=True),
        K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_unfenced=True),
    ):
        assert marked.needs_ptx_patches, marked


def test_value_copies_16b_l1_needs_the_16_byte_copies():
    plain = dict(kernel="v3", block_n=64, cache_tiles=False)
    K.LaunchConfig(**plain, value_copies_16b_l1=True, value_band2_half=True)
    for clash in (dict(cache_tiles=True), dict(row_copies=True), dict(cta_splits=4), dict(kernel="v2")):
        with pytest.raises(ValueError, match="value_copies_16b_l1 sends v3's 16-byte tile copies through L1"):
            K.LaunchConfig(**{**plain, **clash}, value_copies_16b_l1=True)
    config = K.LaunchConfig(**plain, value_copies_16b_l1=True)
    assert K.v3_option_constexprs(config, False)["VALUE_COPIES_16B_L1"] is True
    unsent = dataclasses.replace(K.TUNED_CONFIGS[(128, 4, "affine")], value_copies_16b_l1=False)
    assert "VALUE_COPIES_16B_L1" not in K.v3_option_constexprs(unsent, False)
    assert not K.v1_fallback(config).value_copies_16b_l1


def test_value_band2_half_needs_the_split_kernels_64_token_tiles():
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    dataclasses.replace(tuned, value_band2_half=True)
    dataclasses.replace(tuned, value_band2_half=True, num_stages=2)
    plain = dict(kernel="v3", block_n=64, cache_tiles=True)  # (no option that needs more)
    K.LaunchConfig(**plain, value_band2_half=True)
    K.LaunchConfig(**{**plain, "cache_tiles": False}, value_band2_half=True)  # 16-byte copies
    for clash in (
        dict(block_n=32),
        dict(row_copies=True),
        dict(num_stages=2, tma_rows=True),
        dict(cta_splits=4),
        dict(kernel="v2"),
    ):
        with pytest.raises(ValueError, match="value_band2_half halves the 2-bit value band's tiles"):
            K.LaunchConfig(**{**plain, **clash}, value_band2_half=True)
    # the constexpr only when on (a launch without it keeps its JIT key); off where v1 runs instead
    without = dataclasses.replace(tuned, value_band2_half=False)
    assert "VALUE_BAND2_HALF" not in K.v3_option_constexprs(without, False)
    half = dataclasses.replace(tuned, value_band2_half=True)
    assert K.v3_option_constexprs(half, False)["VALUE_BAND2_HALF"] is True
    assert not K.v1_fallback(half).value_band2_half


@pytest.mark.parametrize("percent", [-2, 101])
def test_split_carveout_outside_0_to_100_is_refused(percent):
    with pytest.raises(ValueError, match=r"split_carveout is a percent from 0 to 100.*got " + str(percent)):
        K.LaunchConfig(kernel="v3", split_carveout=percent)


def test_split_carveout_reaches_the_split_kernel_only_when_set():
    # as a CARVEOUT constexpr (fast_launch sets it on the compiled function); unset, the kernel keeps
    # its JIT key
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    assert K.v3_option_constexprs(tuned, False)["CARVEOUT"] == 44  # tuned since the forty-fourth session
    assert "CARVEOUT" not in K.v3_option_constexprs(dataclasses.replace(tuned, split_carveout=-1), False)
    carved = K.v3_option_constexprs(dataclasses.replace(tuned, split_carveout=100), False)
    assert carved["CARVEOUT"] == 100


def test_tma_rows_unfenced_needs_tma_rows():
    K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_unfenced=True)
    with pytest.raises(ValueError, match="tma_rows_unfenced drops the proxy fences.*needs tma_rows=True"):
        K.LaunchConfig(kernel="v3", tma_rows_unfenced=True)
    fallback = K.v1_fallback(K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_unfenced=True))
    assert not fallback.tma_rows and not fallback.tma_rows_unfenced
    # tma_rows_early relies on the fence to order a stage's reads before its next copy
    K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_early=True)
    with pytest.raises(ValueError, match="tma_rows_early .* needs tma_rows=True and tma_rows_unfenced=False"):
        K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_early=True, tma_rows_unfenced=True)
    with pytest.raises(ValueError, match="tma_rows_early"):
        K.LaunchConfig(kernel="v3", tma_rows_early=True)
    K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_early=True, scale_pairs_two_ahead=True)
    with pytest.raises(ValueError, match="scale_pairs_two_ahead .* needs tma_rows_early=True"):
        K.LaunchConfig(**TMA_ROWS_CONFIG, scale_pairs_two_ahead=True)


def test_v3_option_constexprs_name_the_split_kernels_constexprs():
    # the launch passes these to split_kernel_v3 (a misspelt name would fail only at a GPU launch),
    # and sass_attention_v3.py compiles with the same dict: every name is one of the kernel's
    # constexprs, and each config option reaches its constexpr
    gluon = pytest.importorskip("wmoe_compile.kernels.wavelet_attention_gluon")
    if not gluon.HAS_GLUON:
        pytest.skip(gluon.GLUON_IMPORT_ERROR)
    constexprs = {p.name for p in gluon.split_kernel_v3.params if p.is_constexpr}
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    tma = K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_unfenced=True)
    early = dataclasses.replace(tuned, query_in_split=False, loads_before_pdl_wait=2)
    tma_early = K.LaunchConfig(**TMA_ROWS_CONFIG, tma_rows_early=True, scale_pairs_two_ahead=True)
    half = dataclasses.replace(tuned, value_band2_half=True)
    copies_16b = dataclasses.replace(
        half, cache_tiles=False, copy_layout_tokens=False, value_copies_16b_l1=True
    )
    configs = ((tuned, False), (tma, True), (early, False), (tma_early, False), (half, False))
    rows = dataclasses.replace(half, token_sums_rows=True, warp_barriers=True)
    configs += ((copies_16b, False), (rows, False))
    for config, split_major in configs:
        got = K.v3_option_constexprs(config, split_major)
        assert set(got) <= constexprs, set(got) - constexprs
        assert got["STAGES"] == config.num_stages and got["KEYS_AHEAD"] == config.keys_ahead
        assert got["P_ONCE"] == config.convert_p_once and got["CACHE_TILES"] == config.cache_tiles
        assert got.get("SPLIT_MAJOR", False) == split_major
        assert got.get("TMA_ROWS", False) == config.tma_rows
        assert got.get("TMA_ROWS_UNFENCED", False) == config.tma_rows_unfenced
        assert got.get("TMA_ROWS_EARLY", False) == config.tma_rows_early
        assert got.get("SCALES_TWO_AHEAD", False) == config.scale_pairs_two_ahead
        assert got.get("LOADS_BEFORE_WAIT", 0) == config.loads_before_pdl_wait
        assert got.get("VALUE_BAND2_HALF", False) == config.value_band2_half
        assert got.get("VALUE_COPIES_16B_L1", False) == config.value_copies_16b_l1
        assert got.get("TOKEN_SUMS_ROWS", False) == config.token_sums_rows
        assert got.get("WARP_BARRIERS", False) == config.warp_barriers
    # the options added late are absent when off, so a launch without them keeps its JIT key
    late = {"SPLIT_MAJOR", "TMA_ROWS", "TMA_ROWS_UNFENCED", "TMA_ROWS_EARLY", "SCALES_TWO_AHEAD"}
    late |= {"VALUE_BAND2_HALF", "VALUE_COPIES_16B_L1", "TOKEN_SUMS_ROWS", "WARP_BARRIERS"}
    off = ("value_band2_half", "value_copies_16b_l1", "token_sums_rows", "warp_barriers")
    plain = dataclasses.replace(tuned, loads_before_pdl_wait=0, **dict.fromkeys(off, False))
    assert not (late | {"LOADS_BEFORE_WAIT"}) & set(K.v3_option_constexprs(plain, False))


def test_tma_rows_spike_copies_a_step_in_one_tma_copy_and_reads_bands_by_ldmatrix(tmp_path):
    # benchmarks/spike_tma_rows.py: a step's 64 code rows of one cache by one TMA copy of a [64, 32]
    # box over the cache viewed as [tokens, 24] int16 (Gluon's blocks are powers of two), the bands
    # read as slices by ldmatrix (transposed for the value operand), no global loads (thirty-seventh
    # session, offline on Triton 3.6 and 3.9)
    import ast

    out = _run_sm90_tool("spike_tma_rows.py", tmp_path)
    facts = {line.split(" ", 1)[0]: ast.literal_eval(line.split(" ", 1)[1]) for line in out.splitlines()}
    assert set(facts) == {"keys", "values", "band2"}, out
    for name, f in facts.items():
        assert f["tma_copies"] == 1 and f["global_loads"] == 0, (name, f)
        assert f["shared_bytes"] >= 64 * 32 * 2, (name, f)
    assert facts["keys"]["ldmatrix"] == 4 and facts["keys"]["ldmatrix_transposed"] == 0, facts
    assert facts["values"]["ldmatrix_transposed"] == 4, facts
    assert facts["band2"]["ldmatrix"] == 2, facts


def test_tma_step_spike_compiles_without_spills_and_with_fewer_loop_instructions(tmp_path):
    # benchmarks/spike_tma_step.py: v3's full step with both caches' rows by one TMA copy each
    # (the 2-bit band's repeated half built in registers by _repeat_halves, whose assert_trivial
    # conversion fails to compile if it would move data); offline at the 168-register cap: 682-685
    # loop instructions against the tuned step's 728 (Triton 3.6), no spill, no global code loads
    import re

    out = _run_sm90_tool("spike_tma_step.py", tmp_path)
    assert "STACK:0" in out and "loop spill instructions: 0" in out, out
    loop = int(re.search(r"full-step loop: (\d+) instructions", out).group(1))
    counts = dict(re.findall(r"^  (\w+): (\d+)$", out, flags=re.M))
    assert counts["UTMALDG"] == "2" and counts["LDGSTS"] == "0", out
    assert int(counts["LDG"]) <= 4 and int(counts["LDSM"]) >= 8, out  # the scale pairs only
    assert loop <= 700, out


@pytest.mark.parametrize("tq,group,chunks", [(1, 4, 1), (2, 4, 1), (1, 4, 3), (2, 4, 8)])
def test_exact_kernel_writes_the_exact_tokens_partial(tq, group, chunks):
    # v3's exact sink/window tokens run in their own Triton kernel (Gluon cannot call Triton
    # functions): under the interpreter, its partials (running max in log2 units, denominator,
    # p-weighted sum of the exact values), one per chunk of the exact slots (exact_chunks), merged,
    # must match attention over exactly those positions, written at split indices num_splits
    # onwards of each program's partials
    from test_wavelet_attention import make_case

    sinks, window, capacity = 2, 40, 80
    seq_lens = [80, 13, 47, tq]
    codec, args = make_case(
        f"default;window={window};sinks={sinks}", 4, 2, group, tq, 128, seq_lens, capacity, torch.float16
    )
    q, _, _, _, _, k_exact, v_exact, lens, _, _ = args
    batch, hq, _, d = q.shape
    hkv, rows = k_exact.shape[1], group * tq
    block_m = K._block_m(rows)
    config = K.LaunchConfig(kernel="v3", exact_block=16, exact_chunks=chunks)
    layout = ops.compressed_layout(codec.spec, d)
    n_chunks, chunk_slots = K.exact_chunks(config, layout)
    # 42 slots in 16-slot steps: at most 3 programs, none empty
    assert (
        n_chunks == min(chunks, 3) and (n_chunks - 1) * chunk_slots < sinks + window <= n_chunks * chunk_slots
    )
    programs, num_splits, qk_scale = batch * hkv, 3, 0.125 * K.LOG2E
    n_parts = num_splits + n_chunks
    m_part = torch.full((programs, n_parts, block_m), float("nan"))
    l_part = torch.full_like(m_part, float("nan"))
    acc_part = torch.full((programs, n_parts, block_m, d), float("nan"))
    K._exact_kernel[(programs, n_chunks)](
        q, *q.stride()[:3], k_exact, *k_exact.stride()[:3], v_exact, *v_exact.stride()[:3], lens,
        m_part, l_part, acc_part, hkv, group, tq, 1, num_splits, n_parts, qk_scale,
        D=d, BLOCK_M=block_m, EXACT_BLOCK=16, SINKS=sinks, WINDOW=window, EXACT_SPLIT=False,
        CHUNK_SLOTS=chunk_slots, CARVEOUT=44 if chunks == 3 else -1,  # (keys a variant, reads nothing)
    )  # fmt: skip
    for b, n in enumerate(seq_lens):
        positions = [p for p in range(n) if p < sinks or p >= n - window]
        slots = [p if p < sinks else sinks + p % window for p in positions]
        for h in range(hkv):
            k = k_exact[b, h, slots].double()
            v = v_exact[b, h, slots].double()
            pid = b * hkv + h
            for r in range(rows):
                head, t = h * group + r // tq, r % tq
                visible = torch.tensor([p < n - tq + t + 1 for p in positions])
                s = (k @ q[b, head, t].double()) * qk_scale
                s = s.masked_fill(~visible, float("-inf"))
                m = s.max()
                p = torch.exp2(s - m)
                # the chunks' partials merged as the reduce merges them
                chunk_m = m_part[pid, num_splits:, r].double()
                got_m = chunk_m.max()
                w = torch.exp2(chunk_m - got_m)
                got_l = (l_part[pid, num_splits:, r].double() * w).sum()
                got_acc = (acc_part[pid, num_splits:, r].double() * w[:, None]).sum(0)
                assert got_m.item() == pytest.approx(m.item(), rel=1e-4, abs=1e-4)
                assert got_l.item() == pytest.approx(p.sum().item(), rel=1e-4)
                torch.testing.assert_close(got_acc, p @ v, rtol=1e-3, atol=1e-3)
    # the exact partials are all written, the compressed splits' slots keep their NaN fill
    assert not torch.isnan(m_part[:, num_splits:]).any() and not torch.isnan(acc_part[:, num_splits:]).any()
    assert torch.isnan(m_part[:, :num_splits]).all()


def test_key_value_warps_spike_compiles_for_sm90(tmp_path):
    # benchmarks/spike_kv_warps.py cuts the v3 step into a key half and a value half, offline, to
    # size a warp-specialized v3, and builds them as one such kernel. Both halves reuse v3's
    # helpers, so they must keep compiling with them. The numbers docs/ATTENTION.md quotes hold on
    # this Triton: the step's MMAs split 32 / 44, and each half fits well under v3's 168-register
    # cap without spilling.
    import re

    out = _run_sm90_tool("spike_kv_warps.py", tmp_path)
    halves = dict(re.findall(r"(key_half|value_half): REG:(\d+) STACK:0 ", out))
    assert set(halves) == {"key_half", "value_half"}, out  # both compiled, neither spills
    assert all(int(regs) <= 128 for regs in halves.values()), out
    mmas = re.findall(r"HMMA\.16816\.F32 (\d+)", out)
    assert mmas == ["32", "44"], out  # key fields; value fields and the three token sums
    # and both as the partitions of one kernel: 4 key warps and 4 value warps under warp_specialize
    # at 80 registers a thread, so three programs fit an SM (84 fits two: registers go per warp in
    # units of 256)
    assert re.search(r"specialized_kernel \(8 warps: .*\): REG:80 ", out), out


_COMPILE_REDUCE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from wmoe_compile.kernels import wavelet_attention as wa

fn = wa._reduce_rows_kernel
for merge_only, channels, warps in ((False, 0, 4), (True, 0, 4), (True, 32, 4), (True, 0, 1)):
    constexprs = dict(D=128, BLOCK_M=4, SPLIT_CHUNK=128, OFFSET=True)
    constexprs.update(MERGE_ONLY=merge_only, CHANNELS=channels)
    signature = {
        name: "constexpr" if name in constexprs else ("*fp32" if name.endswith("_ptr") else "i32")
        for name in fn.arg_names if name not in ("PDL", "TRANSFORM_FIRST")
    }
    signature.update(PDL="constexpr", TRANSFORM_FIRST="constexpr", out_ptr="*bf16")
    constexprs.update(PDL=True, TRANSFORM_FIRST=False)
    source = ASTSource(
        fn=fn,
        signature={name: signature[name] for name in fn.arg_names},
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    print("compiled", merge_only, channels, warps)
"""


def test_per_row_reduce_compiles_for_sm90_in_every_mode():
    # The interpreter runs what a constexpr branch returns from and stops; the compiler still
    # builds the code after the return (a slice of the row's sums met the transform's [D, D] there
    # and failed on the GPU only). Compile each mode for an H200 target, no GPU needed.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_REDUCE], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split("\n")[:4] == [
        "compiled False 0 4",
        "compiled True 0 4",
        "compiled True 32 4",
        "compiled True 0 1",  # the tuned merge (reduce_merge_warps)
    ], run.stdout


_COMPILE_SPLIT_V1_V2 = """
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from wmoe_compile.kernels import wavelet_attention as wa
from wmoe_compile.ops import attention as ops

layout = ops.compressed_layout("default", 128)
pointers = dict(q_ptr="*bf16", qw_ptr="*fp16", kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp16", vs_ptr="*fp16")
pointers.update(ke_ptr="*bf16", ve_ptr="*bf16", seq_lens_ptr="*i32", lut_ptr="*fp16", slot_coef_ptr="*i32")


def build(fn, constexprs):
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*fp32")
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    source = ASTSource(
        fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    )
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    print("compiled", fn.__name__)


common = dict(CODE_STRIDE=48, SCALE_STRIDE=2, N_SCALES=layout.n_bands, D=128, BLOCK_M=4, N_QC=4, BLOCK_N=64)
common.update(EXACT_BLOCK=32, SINKS=layout.sinks, WINDOW=layout.window, USE_ASM=True, CENTRE_IN_MMA=False)
build(wa._split_kernel, dict(common, PDL=True, **wa._plan(layout, torch.device("cpu")).constexprs))
plan2 = wa._plan_v2(layout, torch.device("cpu"), False)
v2 = dict(S=plan2.k_slots, SUBNORMAL=False, LAZY_RESCALE=True, CHUNKS=plan2.chunk_constexpr, EXACT_SPLIT=True)
build(wa._split_kernel_v2, dict(common, **v2))
# head_dim 64: both chunks stack fields (keys: the 2-bit bytes; values: both), in every operand mode
# and with the value words loaded once (value_words_once)
layout = ops.compressed_layout("default", 64)
common.update(CODE_STRIDE=24, D=64, BLOCK_M=8, N_QC=2)
modes = ((False, False, False), (True, False, False), (False, True, False), (False, False, True))
for subnormal, centre, once in modes:
    plan2 = wa._plan_v2(layout, torch.device("cpu"), subnormal)
    v2 = dict(S=plan2.k_slots, SUBNORMAL=subnormal, LAZY_RESCALE=True, CHUNKS=plan2.chunk_constexpr)
    v2.update(EXACT_SPLIT=True, CENTRE_IN_MMA=centre, VALUE_WORDS_ONCE=once)
    build(wa._split_kernel_v2, dict(common, **v2))
"""


def test_v1_and_v2_split_kernels_compile_for_sm90():
    # the interpreter runs v1 and v2 in CI but never compiles them: build both for an H100/H200
    # target here (the twentieth session gave them each split's share of the span as two runtime
    # integers, multiplied in int64)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_SPLIT_V1_V2], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[1::2] == ["_split_kernel"] + ["_split_kernel_v2"] * 5, run.stdout


@pytest.mark.parametrize("n_exact,split_chunk", [(1, 4), (3, 4), (3, 128)])
@pytest.mark.parametrize(
    "reduce", ["rows", "rows_transform_first", "rows_then_heads", "row_slices_then_heads", "block"]
)
def test_reduces_merge_every_exact_partial(n_exact, split_chunk, reduce):
    # With exact_chunks, v3's exact tokens arrive as several partials after the compressed splits'
    # (channel domain, where the compressed ones hold coefficient sums). Every reduce must merge
    # them all under one softmax with the compressed ones: random partials here, the reduce under
    # the interpreter against the same merge in float64.
    torch.manual_seed(0)
    batch, hkv, group, d, num_splits = 2, 2, 4, 64, 5
    block_m, programs = 4, batch * hkv
    n_parts = num_splits + n_exact
    m = torch.randn(programs, n_parts, block_m) * 4
    den = torch.rand(programs, n_parts, block_m) + 0.5
    acc = torch.randn(programs, n_parts, block_m, d)
    m[:, 1] = -1.0e30  # an empty split (no tokens)
    den[:, 1], acc[:, 1] = 0.0, 0.0
    transform = torch.randn(hkv, d, d) / d**0.5  # [coefficient, channel] per kv head
    scale = torch.rand(hkv, d) + 0.5
    out = torch.full((batch, hkv * group, 1, d), float("nan"))

    def merged(lo, hi):
        mm = m[:, lo:hi].double()
        top = mm.max(dim=1).values
        w = torch.exp2(mm - top[:, None])
        return top, (den[:, lo:hi].double() * w).sum(1), (acc[:, lo:hi].double() * w[..., None]).sum(1)

    m_c, l_c, acc_c = merged(0, num_splits)
    m_e, l_e, acc_e = merged(num_splits, n_parts)
    top = torch.maximum(m_c, m_e)
    a, b = torch.exp2(m_c - top), torch.exp2(m_e - top)
    heads = torch.arange(programs) % hkv
    values = torch.einsum("prc,pcd->prd", acc_c, transform[heads].double()) * scale[heads, None].double()
    want = (values * a[..., None] + acc_e * b[..., None]) / (l_c * a + l_e * b)[..., None]
    want = want.reshape(batch, hkv * group, 1, d)

    output_args = (transform, transform.stride(0), scale, scale.stride(0), scale, 0, out, *out.stride()[:3])
    no_sinks = (scale, scale, 0, 0, 0, scale, 0, 1.0)  # (tests/test_attention_sinks.py has them)
    args = (m, den, acc, *output_args, *no_sinks, hkv, group, 1, 1, num_splits, n_parts)
    if reduce == "block":
        K._reduce_kernel[(programs,)](*args, D=d, BLOCK_M=block_m, D_CHUNK=32, OFFSET=False)
    else:
        merge_only = reduce in ("rows_then_heads", "row_slices_then_heads")
        # row_slices: each row's merge in d / 16 programs of 16 sums each
        channels = 16 if reduce == "row_slices_then_heads" else 0
        grid = (programs * block_m, d // channels) if channels else (programs * block_m,)
        # 4 partials per load: the chunks straddle the compressed / exact boundary; 128: one load
        # of all of them, most masked
        K._reduce_rows_kernel[grid](
            *args, D=d, BLOCK_M=block_m, SPLIT_CHUNK=split_chunk, OFFSET=False, MERGE_ONLY=merge_only,
            TRANSFORM_FIRST=reduce == "rows_transform_first", CHANNELS=channels,
        )  # fmt: skip
        if merge_only:
            tile = K.REDUCE_GEMM_TILE
            K._transform_heads_kernel[(hkv * -(-batch * block_m // tile), d // 32)](
                acc, *output_args, hkv, group, 1, batch, num_splits, n_parts,
                D=d, BLOCK_M=block_m, TILE=tile, D_CHUNK=32, OFFSET=False,
            )  # fmt: skip
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want, rtol=2e-4, atol=2e-4)
