"""wmoe::wavelet_attention: the fused Triton kernel against decompress + attention in float64.

On the CPU the kernel runs under TRITON_INTERPRET=1 (conftest) at small shapes; tests marked gpu
run the same checks at real shapes on CUDA. The reference here is independent of the kernel file:
it decodes with the codec's own WaveletKVCodec.decode and overlays the exact sinks/window by the
contract's rule (position p is exact if p < sinks or p >= seq_len - window).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from wmoe_compile.kernels import attention_config
from wmoe_compile.kernels import wavelet_attention as K
from wmoe_compile.kernels.attention_layout import SUPPORTED_HEAD_DIMS
from wmoe_compile.kernels.kv_codec import channel_params

import wmoe_compile.ops  # noqa: F401  registers the ops
from wmoe_compile.codec import get_codec, pack_channel_params
from wmoe_compile.ops import attention as ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_SPEC = "lloyd;window=8;sinks=2"  # Lloyd-Max grids: the kernel's table path


@pytest.fixture
def triton_backend():
    previous = ops.set_backend("triton")
    yield
    ops.set_backend(previous)


def _fill_exact(
    x: torch.Tensor, seq_lens: list[int], sinks: int, window: int, dtype: torch.dtype
) -> torch.Tensor:
    """The exact cache as kv_compress_into_cache writes it; never-written slots hold garbage."""
    b, h, _, d = x.shape
    exact = torch.randn(b, h, sinks + window, d, device=x.device).mul(100).to(dtype)
    for i, n in enumerate(seq_lens):
        for p in range(n):
            if p < sinks:
                exact[i, :, p] = x[i, :, p].to(dtype)
            if window:
                exact[i, :, sinks + p % window] = x[i, :, p].to(dtype)
    return exact


def _random_rotation(hkv: int, d: int, device) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(hkv, d, d, device=device, dtype=torch.float64))
    return q.float()


def make_case(
    spec, batch, hkv, group, tq, head_dim, seq_lens, capacity, dtype, device=DEVICE, channel="scale"
):
    """Random q/k/v, compressed into a cache of `capacity` slots; slots past seq_len hold garbage.
    channel="scale": per-channel smoothing only ([Hkv, D] channel scales); "full": offsets and a
    per-head rotation too ([Hkv, D + 2, D]; keys and values stored centred, exact copies too)."""
    codec = get_codec(spec, head_dim)
    # keys with outlier channels and a per-channel mean, like real ones
    k = torch.randn(batch, hkv, capacity, head_dim, device=device) * (
        torch.rand(hkv, 1, head_dim, device=device) * 3 + 0.2
    )
    v = torch.randn(batch, hkv, capacity, head_dim, device=device)
    k_cs = torch.rand(hkv, head_dim, device=device) + 0.5
    v_cs = torch.rand(hkv, head_dim, device=device) + 0.5
    if channel == "full":
        k = k + torch.randn(hkv, 1, head_dim, device=device) * 2
        v = v + torch.randn(hkv, 1, head_dim, device=device)
        k_m, v_m = k.mean(dim=(0, 2)), v.mean(dim=(0, 2))  # [Hkv, D]
        k_r, v_r = _random_rotation(hkv, head_dim, device), _random_rotation(hkv, head_dim, device)
        kc, ks = codec.encode(k, k_cs[:, None, :], k_m[:, None, :], k_r)
        vc, vs = codec.encode(v, v_cs[:, None, :], v_m[:, None, :], v_r)
        k, v = k - k_m[:, None, :], v - v_m[:, None, :]  # the exact cache holds centred copies
        k_cs = pack_channel_params(head_dim, hkv, k_cs, k_m, k_r).to(device)
        v_cs = pack_channel_params(head_dim, hkv, v_cs, v_m, v_r).to(device)
    else:
        kc, ks = codec.encode(k, k_cs[:, None, :])
        vc, vs = codec.encode(v, v_cs[:, None, :])
    for i, n in enumerate(seq_lens):  # garbage past each sequence's length must never be read
        for codes, scales in ((kc, ks), (vc, vs)):
            codes[i, :, n:] = torch.randint(0, 256, codes[i, :, n:].shape, dtype=torch.uint8, device=device)
            scales[i, :, n:] = torch.full_like(scales[i, :, n:], float("nan"))
    cfg = codec.config
    k_exact = _fill_exact(k, seq_lens, cfg.sinks, cfg.window, dtype)
    v_exact = _fill_exact(v, seq_lens, cfg.sinks, cfg.window, dtype)
    q = (torch.randn(batch, hkv * group, tq, head_dim, device=device) * 1.5).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return codec, (q, kc, ks, vc, vs, k_exact, v_exact, lens, k_cs, v_cs)


def dense_reference(codec, args, sm_scale, sink_logits=None, sliding_window=0):
    """Decompress every valid position with the codec, overlay the exact tokens, attend in float64.
    `sink_logits` [Hq]: learned sink logits as gpt-oss's eager attention applies them (a softmax over
    cat(scores, sink), the sink's column dropped). `sliding_window` > 0: query t (position n - tq + t)
    sees the `sliding_window` positions up to its own only (HF's sliding-window mask)."""
    q, kc, ks, vc, vs, k_exact, v_exact, lens, k_cs, v_cs = args
    sinks, window = codec.config.sinks, codec.config.window
    batch, hq, tq, _ = q.shape
    group = hq // kc.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    hkv, d = kc.shape[1], q.shape[-1]
    for b, n in enumerate(lens.tolist()):
        kv = []
        for codes, scales, exact, cs in ((kc, ks, k_exact, k_cs), (vc, vs, v_exact, v_cs)):
            scale, offset, rotation = channel_params(cs, hkv, d)
            x = codec.decode(codes[b, :, :n], scales[b, :, :n], scale, torch.float64, offset, rotation)
            shift = 0.0 if offset is None else offset.double()[:, 0]  # exact copies are centred
            for p in range(n):
                if p < sinks:
                    x[:, p] = exact[b, :, p].double() + shift
                elif p >= n - window:
                    x[:, p] = exact[b, :, sinks + p % window].double() + shift
            kv.append(x.repeat_interleave(group, dim=0))
        scores = q[b].double() @ kv[0].transpose(-1, -2) * sm_scale
        limit = n - tq + 1 + torch.arange(tq, device=q.device)
        slot = torch.arange(n, device=q.device)[None, :]
        scores = scores.masked_fill(slot >= limit[:, None], float("-inf"))
        if sliding_window:
            scores = scores.masked_fill(slot < limit[:, None] - sliding_window, float("-inf"))
        if sink_logits is not None:
            sink_column = sink_logits.double().to(q.device)[:, None, None].expand(hq, tq, 1)
            weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1)
        out[b] = weights @ kv[1]
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the output"
    return float((got.double() - want).norm() / want.norm())


def _run_triton(args, codec, sm_scale, **kw):
    layout = ops.compressed_layout(codec.spec, args[0].shape[-1])
    return K.wavelet_attention_triton(*args, layout, sm_scale, **kw)


def _replay_with_fresh_inputs(args, codec, fresh=(0,), want_kw=None, **kw):
    """Capture the op in a CUDA graph, give the captured tensors args[i] for i in `fresh` new random
    values (0: the query; 5, 6: the exact keys and values), replay, and check the replay equals an
    ordinary call on the new values (with `want_kw` in place of `kw` where given) bit for bit: a
    graph must hold no host value of the call it was captured from. Returns the replay's output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run_triton(args, codec, 128**-0.5, **kw)
    for i in fresh:
        args[i].copy_(torch.randn_like(args[i]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _run_triton(args, codec, 128**-0.5, **(kw if want_kw is None else want_kw)))
    return captured


CASES = [
    # head_dim, dtype, Tq, group (q heads per kv head)
    (64, torch.float16, 1, 4),
    (64, torch.bfloat16, 3, 2),
    (128, torch.bfloat16, 1, 1),
    (128, torch.float16, 2, 4),
    (64, torch.float32, 1, 2),
]


@pytest.mark.parametrize("spec", [SMALL_SPEC, "default;window=8;sinks=2"])  # table and affine grids
@pytest.mark.parametrize("head_dim,dtype,tq,group", CASES)
def test_matches_decompress_attention(head_dim, dtype, tq, group, spec):
    # ragged: the whole sequence is new tokens (length Tq, 1 when Tq == 1), a length that is not a
    # multiple of any block, and a full cache
    capacity = 70
    seq_lens = [tq, 41, capacity]
    codec, args = make_case(spec, 3, 2, group, tq, head_dim, seq_lens, capacity, dtype)
    sm_scale = head_dim**-0.5
    want = dense_reference(codec, args, sm_scale)
    got = _run_triton(args, codec, sm_scale, config=K.LaunchConfig(block_n=16), num_splits=3)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert rel_err(got, want) <= 1e-2
    ref = ops.compressed_layout(codec.spec, head_dim)
    assert rel_err(K.wavelet_attention_reference(*args, ref, sm_scale), want) <= 1e-2


@pytest.mark.parametrize("group,tq", [(8, 1), (4, 2)])
def test_the_ops_own_config_at_a_group_of_8_rows(group, tq):
    # block_m 8 takes the group of 4's tuned v3 configs (thirty-ninth session); here, where v3
    # cannot run, their v1 fallback: one sequence (the small-launch config) and three
    codec, args = make_case(
        UNIFORM_REAL, 3, 2, group, tq, 128, [tq, 130, 67], 130, torch.float32, channel="full"
    )
    layout = ops.compressed_layout(codec.spec, 128)
    assert K.tuned_config(layout, 128, K._block_m(group * tq), 6).kernel == "v3"
    want = dense_reference(codec, args, 128**-0.5)
    assert rel_err(_run_triton(args, codec, 128**-0.5), want) <= 1e-2
    one = [a[1:2] for a in args[:8]] + list(args[8:])  # the full 130-token sequence alone
    assert rel_err(_run_triton(one, codec, 128**-0.5), dense_reference(codec, one, 128**-0.5)) <= 1e-2


OTHER_SPECS = [
    "seed",  # log-grid + ternary tables (gathers), no window, no sinks
    "wavelet=db4;levels=2;bands=1/4:8:uniform:absmax,3/4:4:lloyd:mse;window=5;sinks=1",  # 8-bit + 3 chunks
    "wavelet=haar_packet;levels=max;bands=1/2:4:lloyd:mse,1/2:2:uniform:mse;window=4;sinks=0",
    "default;window=0;sinks=3",
    "default;window=16;sinks=0",
]


@pytest.mark.parametrize("spec", OTHER_SPECS)
def test_other_codec_layouts(spec):
    capacity = 50
    seq_lens = [capacity, 23]
    codec, args = make_case(spec, 2, 2, 2, 1, 64, seq_lens, capacity, torch.float16)
    got = _run_triton(args, codec, 0.125, config=K.LaunchConfig(block_n=16), num_splits=2)
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2


V2_VARIANTS = [
    # (kernel, subnormal, lazy_rescale, per-row reduce, centre_in_mma)
    ("v2", True, True, True, False),
    ("v2", False, True, False, False),
    ("v2", True, False, False, False),
    ("v2", False, False, True, False),
    ("v2", False, True, False, True),
    ("v2", False, False, True, True),
    ("v1", True, True, False, False),
    ("v1", False, True, False, True),
]


@pytest.mark.parametrize("kernel,subnormal,lazy,row_reduce,centre", V2_VARIANTS)
def test_kernel_variants(kernel, subnormal, lazy, row_reduce, centre):
    # operand encodings (fp16 subnormals / 1024-offset magic, values centred per operand or through
    # the MMA's accumulator input), lazy or eager rescaling, both reduce kernels, and the v1
    # byte-plane kernel on the same inputs
    capacity = 75
    codec, args = make_case(UNIFORM_SPEC, 2, 2, 4, 1, 64, [capacity, 33], capacity, torch.float16)
    config = K.LaunchConfig(
        block_n=16,
        kernel=kernel,
        subnormal=subnormal,
        lazy_rescale=lazy,
        row_reduce_max_programs=1e9 if row_reduce else 0.0,
        centre_in_mma=centre,
    )
    got = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2


UNIFORM_SPEC = "default;bands=1/2:4:uniform:mse,1/2:2:uniform:mse;window=8;sinks=2"


@pytest.mark.parametrize(
    "spec,row_reduce", [(SMALL_SPEC, False), (UNIFORM_SPEC, True), (UNIFORM_SPEC, False)]
)
def test_full_channel_params(spec, row_reduce):
    # offsets and per-head rotations (the default codec's channel parameters): the kernel rotates
    # the query and the output once, and adds the value offset once
    capacity = 60
    codec, args = make_case(spec, 2, 2, 2, 1, 64, [capacity, 29], capacity, torch.float16, channel="full")
    want = dense_reference(codec, args, 0.125)
    config = K.LaunchConfig(block_n=16, row_reduce_max_programs=1e9 if row_reduce else 0.0)
    got = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    assert rel_err(got, want) <= 1e-2
    ref = ops.compressed_layout(codec.spec, 64)
    assert rel_err(K.wavelet_attention_reference(*args, ref, 0.125), want) <= 1e-2


@pytest.mark.parametrize("channel,splits", [("full", 3), ("scale", 5), ("full", 1)])
def test_reduce_gemm_equals_the_per_row_reduce(channel, splits):
    # merge per row, then the transform as one dot per kv head over 16 rows of 4 sequences: 5
    # sequences leave the second tile part padding; ragged lengths down to 1 (all splits empty);
    # two kv heads with their own rotation, offset and scale ("full"), or one shared transform
    lens = [70, 1, 33, 64, 9]
    codec, args = make_case(UNIFORM_SPEC, 5, 2, 4, 1, 64, lens, 70, torch.float16, channel=channel)
    want = dense_reference(codec, args, 0.125)
    rows = K.LaunchConfig(block_n=16, row_reduce_max_programs=1e9)
    per_row = _run_triton(args, codec, 0.125, config=rows, num_splits=splits)
    gemm = dataclasses.replace(rows, reduce_gemm_min_rows=1)
    got = _run_triton(args, codec, 0.125, config=gemm, num_splits=splits)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-2
    # the same sums in another order (scaled before the transform, a tf32x3 dot): fp32-close, but
    # the fp16 outputs may round one ulp (2^-11) apart; a wrong row or scale is far beyond this
    assert rel_err(got, per_row) <= 1e-3
    # each row's merge spread over 4 programs of 16 sums: the same sums, bit for bit
    sliced = _run_triton(
        args, codec, 0.125, config=dataclasses.replace(gemm, reduce_merge_channels=16), num_splits=splits
    )
    assert torch.equal(sliced, got)
    # the transform kernel's programs taking 64 output channels each instead of 32: the same dots
    wide = _run_triton(
        args, codec, 0.125, config=dataclasses.replace(gemm, transform_channels=64), num_splits=splits
    )
    assert rel_err(wide, got) <= 1e-6


@pytest.mark.parametrize("plan", [K.SplitPlan(2, 3, 5), K.SplitPlan(3, 5, 12, split_major=True)])
def test_unequal_split_plans_cover_every_token(plan):
    # a SplitPlan's splits take span * split_num / split_den tokens each (whole steps), the last what
    # is left: 2 splits of 3/5 of each sequence's span, or 3 of 5/12. Ragged lengths: each sequence's
    # own span is cut so (a kernel that took 1 / split_den of the span would drop tokens). On the
    # interpreter this runs v1; v3 takes the same plan (test_gpu_v3_takes_a_split_plan_launched_split_major)
    lens = [70, 1, 33, 64, 9]
    codec, args = make_case(UNIFORM_SPEC, 5, 2, 4, 1, 64, lens, 70, torch.float16, channel="full")
    want = dense_reference(codec, args, 0.125)
    config = K.LaunchConfig(block_n=16)
    got = _run_triton(args, codec, 0.125, config=config, num_splits=plan)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= 1e-2
    assert rel_err(got, _run_triton(args, codec, 0.125, config=config, num_splits=plan.num_splits)) <= 1e-3


def test_query_transform_cache_follows_the_channel_tensor():
    # the kernel caches W_slots R per channel tensor: an in-place update of the tensor (new rotation)
    # and a fresh tensor must both be seen, else attention would silently use a stale rotation
    capacity = 40
    codec, args = make_case(UNIFORM_SPEC, 1, 2, 2, 1, 64, [capacity], capacity, torch.float16, channel="full")
    config = K.LaunchConfig(block_n=16)
    first = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    assert rel_err(first, dense_reference(codec, args, 0.125)) <= 1e-2
    k_cs = args[8]
    with torch.no_grad():
        k_cs[:, :64] = _random_rotation(2, 64, k_cs.device)  # a different rotation, same tensor
    cached = _run_triton(args, codec, 0.125, config=config, num_splits=2)
    fresh = list(args)
    fresh[8] = k_cs.clone()  # a new tensor with the same values: nothing cached for it yet
    K._COMPOSITES.clear()
    uncached = _run_triton(tuple(fresh), codec, 0.125, config=config, num_splits=2)
    assert rel_err(cached, uncached.double()) <= 1e-6
    assert rel_err(cached, first.double()) > 1e-2  # the new rotation changed the scores


def test_value_transform_cache_follows_the_channel_tensor():
    # the reduce reads W R_h diag(s_h) cached per value channel tensor: an in-place change of the
    # rotation or the scale must reach the output, and match a fresh uncached computation
    capacity = 40
    codec, args = make_case(UNIFORM_SPEC, 1, 2, 2, 1, 64, [capacity], capacity, torch.float16, channel="full")
    for row_reduce in (True, False):
        config = K.LaunchConfig(block_n=16, row_reduce_max_programs=1e9 if row_reduce else 0.0)
        first = _run_triton(args, codec, 0.125, config=config, num_splits=2)
        assert rel_err(first, dense_reference(codec, args, 0.125)) <= 1e-2
        v_cs = args[9].clone()  # its own tensor (the case may share one for K and V)
        updated = list(args)
        updated[9] = v_cs
        _run_triton(tuple(updated), codec, 0.125, config=config, num_splits=2)  # caches the composite
        with torch.no_grad():
            v_cs[:, :64] = _random_rotation(2, 64, v_cs.device)  # new rotation, same tensor
            v_cs[:, 64] *= 1.5  # and new scales (row D of the [Hkv, D + 2, D] form)
        cached = _run_triton(tuple(updated), codec, 0.125, config=config, num_splits=2)
        K._VALUE_COMPOSITES.clear()
        uncached = _run_triton(tuple(updated), codec, 0.125, config=config, num_splits=2)
        assert rel_err(cached, uncached.double()) <= 1e-6
        assert rel_err(cached, first.double()) > 1e-2  # the new rotation changed the output


def test_tuned_config_by_launch_size():
    # one sequence (few programs, latency-bound splits) takes the small-launch table (v3 with
    # shorter splits; where v3 cannot run, v1's two-warp 128-token steps), larger launches the
    # one-warp 64-token config (the measured winners, benchmarks/RESULTS.md); table grids have no
    # small-launch entry
    affine = ops.compressed_layout("default", 128)
    small = K.tuned_config(affine, 128, 4, programs=8)
    large = K.tuned_config(affine, 128, 4, programs=K.SMALL_LAUNCH_PROGRAMS + 1)
    assert (small.kernel, small.min_split_tokens, small.reduce_split_chunk) == ("v3", 256, 128)
    # and the key words loaded one by one (key_word_pairs was +0.4% there, twenty-second session),
    # the MMAs' padding columns serving the 2-bit band (-2.7% there, +1.5-2.3% sustained at the
    # large shapes, twenty-third session), 16 channels a merge program (twenty-fifth session; 64 at
    # the large shapes); both transform the query in the split kernel where the launch is one wave
    # (twenty-sixth session), so no cache read goes before the PDL wait; one sequence's blocks go
    # out split-major (its SMs' blocks then share kv heads, twenty-eighth session) and its exact
    # tokens run in the PDL chain, not on a side stream (the merge keeps its programmatic launch,
    # twenty-ninth session); four of its splits a CTA, sharing the transforms (thirty-fifth)
    assert small == dataclasses.replace(
        large,
        min_split_tokens=256,
        reduce_split_chunk=128,
        key_word_pairs=False,
        band_columns=True,
        channel_merge_channels=16,
        exact_chunks=3,  # (5 at the large shapes)
        split_major_grid=True,
        overlap_exact=False,
        exact_in_chain=True,
        cta_splits=4,
        # the large launches' step options of the forty-fourth session: the CTA kernel has none
        value_band2_half=False,
        token_sums_rows=False,
        warp_barriers=False,
        split_carveout=-1,
    )
    assert not large.split_major_grid and not large.cta_splits
    assert large.overlap_exact and not large.exact_in_chain
    assert large.transform_in_split and large.channel_merge_channels == 64
    assert large.query_in_split and large.query_in_split_waves == 1 and not large.loads_before_pdl_wait
    assert not large.band_columns
    assert large.key_word_pairs and large.value_subnormals and large.packed_p_scaling
    small_v1 = K.v1_fallback(small)
    assert (small_v1.kernel, small_v1.block_n, small_v1.num_warps) == ("v1", 128, 2)
    large_v1 = K.v1_fallback(large)  # the same settings, v3's options dropped
    assert (large_v1.kernel, large_v1.block_n, large_v1.maxnreg, large_v1.keys_ahead) == (
        "v1",
        64,
        168,
        False,
    )
    assert (large.kernel, large.block_n, large.num_warps, large.maxnreg) == ("v3", 64, 1, 168)
    assert K.tuned_config(affine, 128, 4) == large
    # two sequences of 8 kv heads already run faster on v3 (sixteenth session: 0.0405 against 0.046 ms)
    assert K.tuned_config(affine, 128, 4, programs=16).kernel == "v3"
    lloyd = K.tuned_config(ops.compressed_layout("lloyd", 128), 128, 4, programs=8)
    assert lloyd == K.TUNED_CONFIGS[(128, 4, "table")]


def test_gqa_groups_of_8_and_16_take_the_group_of_4s_configs():
    # block_m 8 (Qwen3-MoE's 32 query / 4 kv heads, or a group of 4 with two new tokens) ran the
    # untuned v2 default until the thirty-ninth session; now v3 with the group of 4's settings,
    # without the two options that need 4 rows (band_columns, cta_splits)
    affine = ops.compressed_layout("default", 128)
    assert K._block_m(8) == K._block_m(4 * 2) == 8
    large = K.tuned_config(affine, 128, 8, programs=64)
    small = K.tuned_config(affine, 128, 8, programs=4)
    # (but the forty-first and forty-second sessions' step options, timed at groups of 4 only)
    step_options = dict(value_band2_half=False, token_sums_rows=False, warp_barriers=False, split_carveout=-1)
    group_of_4 = K.tuned_config(affine, 128, 4, programs=64)
    assert large == dataclasses.replace(group_of_4, **step_options) and large.kernel == "v3"
    assert group_of_4.token_sums_rows and not large.token_sums_rows
    group_of_4_small = K.tuned_config(affine, 128, 4, programs=4)
    assert small == dataclasses.replace(group_of_4_small, band_columns=False, cta_splits=0)
    assert K.v1_fallback(small) == K.v1_fallback(group_of_4_small)  # v1's own small-launch settings
    # 9-16 rows (Qwen3-235B's 64 / 4 heads): the same configs, run in two row blocks of 8 (fortieth
    # session; the untuned v2 default before, 3.6x slower at (8, 131072)); where v3 cannot run,
    # that default again, not v3's one-warp settings on v1; 32 rows and more (prefill chunks) keep it
    assert K.tuned_config(affine, 128, 16, programs=64) == large
    assert K.tuned_config(affine, 128, 16, programs=4) == small
    assert K.v1_fallback(large, 16) == K.v1_fallback(small, 16) == K.default_config(128, 16)
    assert K.v1_fallback(large, 8) == K.v1_fallback(large)
    assert K.tuned_config(affine, 128, 32, programs=64) == K.default_config(128, 32)


@pytest.mark.parametrize(
    "bad,named",
    [
        (dict(block_n=48), "block_n"),
        (dict(reduce_split_chunk=0), "reduce_split_chunk"),
        (dict(kernel="v4"), "kernel"),
        (dict(remainder_split_min_programs=-1), "remainder_split_min_programs"),
        # without cache_tiles the tiles are copied in another layout
        (dict(kernel="v3", num_warps=1, copy_layout_tokens=True), "copy_layout_tokens"),
        (dict(kernel="v1", cache_tiles=True, copy_layout_tokens=True), "copy_layout_tokens"),
        (dict(kernel="v3", num_warps=1, value_scales_in_b=True), "value_scales_in_b"),  # no p_once
        (dict(kernel="v3", num_warps=1, p_movmatrix=True), "p_movmatrix"),  # no p_once
        (dict(kernel="v1", score_offset_in_mma=True), "score_offset_in_mma"),
        (dict(kernel="v2", step_row_base=True), "step_row_base"),
        (dict(kernel="v1", value_words_once=True), "value_words_once"),
        # the exact kernel is either on the side stream or in the PDL chain, and the chain needs PDL
        (dict(kernel="v3", num_warps=1, pdl=True, overlap_exact=True, exact_in_chain=True), "exact_in_chain"),
        (dict(kernel="v3", num_warps=1, exact_in_chain=True), "exact_in_chain"),
        # row copies bring the keys through the ring too, and replace the 8-byte cached copies
        (dict(kernel="v3", num_warps=1, row_copies=True), "row_copies"),
        (dict(kernel="v3", num_warps=1, keys_via_smem=True, cache_tiles=True, row_copies=True), "row_copies"),
    ],
)
def test_launch_config_rejects_bad_fields(bad, named):
    with pytest.raises(ValueError, match=f"LaunchConfig.{named}"):
        K.LaunchConfig(**bad)


def test_v2_slot_maps_cover_every_coefficient():
    # every coefficient appears exactly once among the key slots and once among the value slots
    for head_dim in SUPPORTED_HEAD_DIMS:
        layout = ops.compressed_layout(UNIFORM_SPEC, head_dim)
        chunks = K._field_chunks(layout)
        for slots in (lambda c: c.k_slots(), lambda c: c.v_slots()):
            coefs = sorted(coef for c in chunks for _, coef, _ in slots(c))
            assert coefs == list(range(head_dim))
        plan = K._plan_v2(layout, torch.device("cpu"), subnormal=True)
        assert int((plan.slot_coef >= 0).sum()) == head_dim


@pytest.mark.parametrize(
    "spec,head_dim,operands",
    [
        # (key operands, value operands) per chunk
        ("default", 64, [(2, 2), (2, 2)]),  # 4-bit: 8 elements x 2 fields; 2-bit: 4 x 4, bytes 8 x 2
        ("default", 128, [(4, 4), (4, 4)]),  # the 2-bit band's 8 elements stack 2 value fields
        ("default", 256, [(4, 4), (8, 8)]),  # wide chunks: one field an operand, as before
        # an 8-bit band of 8 elements: its two fields need different shifts, so they do not stack
        ("default;bands=1/4:8:uniform:mse,3/4:2:uniform:mse", 64, [(1, 2), (2, 2), (1, 2)]),
    ],
)
def test_v2_narrow_chunks_stack_fields_instead_of_padding(spec, head_dim, operands):
    # a chunk narrower than the MMA's 16 rows stacks fields in each operand (what cut head_dim 64's
    # MMAs per step from 18 to 8): the slots hold every coefficient once and, where every group of
    # fields shares a shift, no padding
    layout = ops.compressed_layout(spec, head_dim)
    chunks = K._field_chunks(layout)
    assert [(c.k_operands, c.v_operands) for c in chunks] == operands
    for c in chunks:
        for slots in (c.k_slots(), c.v_slots()):
            for _, _, pos in slots:
                assert 0 <= pos and pos + c.bits <= 10  # inside the fp16 mantissa
    plan = K._plan_v2(layout, torch.device("cpu"), subnormal=False)
    assert plan.v_slots == sum(c.v_operands * c.v_padded for c in chunks)
    assert plan.k_slots == sum(c.k_operands * c.k_padded for c in chunks)
    if spec == "default":
        assert plan.k_slots == plan.v_slots == head_dim and int((plan.slot_coef >= 0).sum()) == head_dim


@pytest.mark.parametrize("group,tq,dtype", [(8, 1, torch.bfloat16), (2, 3, torch.float16)])
def test_v2_value_words_once_changes_no_result(group, tq, dtype):
    # LaunchConfig.value_words_once loads a stacked value chunk's words once and repeats them by a
    # reshape: the operands hold the same values in the same rows, so the output is bit-identical
    # (and matches decompress + attention), at gpt-oss's group of 8 and with several new tokens
    capacity = 90
    codec, args = make_case("default;window=8;sinks=2", 2, 2, group, tq, 64, [capacity, 37], capacity, dtype)
    base = K.LaunchConfig(block_n=16, kernel="v2")
    got = _run_triton(
        args, codec, 0.125, config=dataclasses.replace(base, value_words_once=True), num_splits=3
    )
    assert torch.equal(got, _run_triton(args, codec, 0.125, config=base, num_splits=3))
    assert rel_err(got, dense_reference(codec, args, 0.125)) <= 1e-2


@pytest.mark.parametrize(
    "bits,first,count,shift",
    [(2, 0, 4, 0), (2, 4, 4, 8), (2, 4, 2, 8), (2, 2, 4, None), (4, 2, 2, 8), (8, 0, 2, None)],
)
def test_stacked_fields_share_one_shift_or_none(bits, first, count, shift):
    from wmoe_compile.kernels.attention_fields import field_layout, stacked_shift

    assert stacked_shift(bits, first, count) == shift
    for f in range(16 // bits):  # one field: field_layout's shift
        assert stacked_shift(bits, f, 1) == field_layout(bits, f)[0]


def test_splits_and_blocks_agree():
    capacity = 90
    codec, args = make_case(SMALL_SPEC, 2, 1, 4, 1, 64, [capacity, 57], capacity, torch.float16)
    want = dense_reference(codec, args, 0.125)
    # 11 splits: more than one chunk of the reduces' wide split loads (8 or 16), the last partial;
    # both reduce kernels
    outs = [
        _run_triton(
            args, codec, 0.125, config=K.LaunchConfig(block_n=bn, row_reduce_max_programs=rr), num_splits=ns
        )
        for bn, ns, rr in (
            (16, 1, 0.0),
            (16, 5, 0.0),
            (32, 2, 0.0),
            (64, 1, 0.0),
            (16, 11, 0.0),
            (16, 11, 1e9),
        )
    ]
    for out in outs:
        assert rel_err(out, want) <= 1e-2
        assert rel_err(out, outs[0].double()) <= 2e-3  # only summation order differs


def test_prefill_chunk_over_compressed_history():
    # 40 new tokens x 2 q heads = 80 query rows: two row blocks, causal inside the chunk; the chunk
    # is longer than the window, so most of it is itself read back compressed.
    capacity = 112
    tq = 40
    codec, args = make_case(SMALL_SPEC, 2, 2, 2, tq, 64, [100, tq], capacity, torch.float16)
    want = dense_reference(codec, args, 0.125)
    got = _run_triton(args, codec, 0.125, config=K.LaunchConfig(block_n=32), num_splits=2)
    assert rel_err(got, want) <= 1e-2


def test_channel_scale_forms(triton_backend):
    capacity = 40
    codec, args = make_case(SMALL_SPEC, 1, 2, 2, 1, 64, [capacity], capacity, torch.float16)
    q, kc, ks, vc, vs, ke, ve, lens, _, _ = args
    one_row = torch.rand(64) + 0.5
    codes_k, scales_k = codec.encode(torch.randn(1, 2, capacity, 64), one_row)
    full = (q, codes_k, scales_k, vc, vs, ke, ve, lens, one_row.expand(2, 64).contiguous(), torch.empty(0))
    expected = torch.ops.wmoe.wavelet_attention(*full, codec.spec, 0.125)
    for form in (one_row, one_row[None, :]):
        got = torch.ops.wmoe.wavelet_attention(*full[:8], form, torch.ones(2, 64), codec.spec, 0.125)
        assert rel_err(got, expected.double()) <= 1e-5


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_opcheck(backend):
    previous = ops.set_backend(backend)
    try:
        capacity = 24
        codec, args = make_case(SMALL_SPEC, 2, 1, 2, 2, 64, [capacity, 9], capacity, torch.float16)
        torch.library.opcheck(torch.ops.wmoe.wavelet_attention.default, (*args, codec.spec, 0.125))
    finally:
        ops.set_backend(previous)


def _bad(args, **replace):
    names = ("q", "kc", "ks", "vc", "vs", "ke", "ve", "lens", "k_cs", "v_cs")
    values = dict(zip(names, args, strict=True))
    values.update(replace)
    return tuple(values[n] for n in names)


def test_bad_inputs_fail_before_any_kernel(triton_backend):
    capacity = 20
    codec, args = make_case(SMALL_SPEC, 2, 2, 2, 1, 64, [capacity, 5], capacity, torch.float16)
    q, kc, ks, vc, vs, ke, ve, lens, k_cs, v_cs = args
    op = torch.ops.wmoe.wavelet_attention
    cases = [
        (dict(q=torch.randn(2, 3, 1, 64, dtype=torch.float16)), "multiple of kv heads"),
        (dict(lens=torch.tensor([capacity + 1, 5], dtype=torch.int32)), "seq_lens must lie in"),
        (dict(lens=torch.tensor([0, 5], dtype=torch.int32)), "seq_lens must lie in"),
        (dict(lens=torch.tensor([5.0, 5.0])), "integer"),
        (dict(q=q.to(torch.float64)), "dtype"),
        (dict(q=q[..., :32]), "disagree on head_dim"),
        (dict(kc=kc[..., :-1]), "n_code_bytes"),
        (dict(ks=ks.float()), "k_scales must be fp16"),
        (dict(ke=ke[:, :, :-1]), r"sinks \+ window"),
        (dict(k_cs=torch.ones(3, 64)), "k_channel_scale"),
        (dict(v_cs=torch.ones(2, 64, device="meta")), "one device"),
    ]
    op(*args, codec.spec, 0.125)  # good metadata is remembered (check_attention_inputs) ...
    for replace, message in cases:
        for _ in range(2):  # ... bad metadata never is: it fails every time
            with pytest.raises(ValueError, match=message):
                op(*_bad(args, **replace), codec.spec, 0.125)
    assert op(*args, codec.spec, 0.125).isfinite().all()


def test_unsupported_head_dim_errors_in_kernel_and_falls_back_in_op(triton_backend):
    capacity = 12
    codec, args = make_case("default;window=4;sinks=1", 1, 1, 2, 1, 96, [capacity], capacity, torch.float16)
    layout = ops.compressed_layout(codec.spec, 96)
    with pytest.raises(K.UnsupportedLayout, match="head_dim 96"):
        K.wavelet_attention_triton(*args, layout, 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.ops.wmoe.wavelet_attention(*args, codec.spec, 0.1)
    assert rel_err(got, dense_reference(codec, args, 0.1)) <= 1e-2
    ops._warned.clear()
    assert any("head_dim 96" in str(w.message) for w in caught) or ops._backend == "triton"


# ------------------------------------------------------------------------------------------------
# GPU: real shapes


# the codec default's bytes with affine grids (the v2 kernel) and the real window and sinks
UNIFORM_REAL = "default"  # affine grids (the default preset since 2026-11-30)
TUNED_V3 = K.TUNED_CONFIGS[(128, 4, "affine")]
# the tuned config without the forty-fourth session's step options (the 2-bit value band's half
# tiles, the token sums from one MMA, warp barriers, and the carveout taken with them): the base
# of the variants below, written against it, several of which those options do not combine with
TUNED_V3_PLAIN_STEP = dataclasses.replace(
    TUNED_V3, value_band2_half=False, token_sums_rows=False, warp_barriers=False, split_carveout=-1
)
# the tuned config with the coefficient sums mapped to channels by the reduce, not the split kernel
REDUCE_TRANSFORM = dataclasses.replace(TUNED_V3_PLAIN_STEP, transform_in_split=False)
# the split kernel's first cache reads before its PDL wait: that needs the prologue to transform
# the query (the tuned configs do it in the split kernel, query_in_split, reading it after the wait)
EARLY_LOADS = dict(loads_before_pdl_wait=1, query_in_split=False)
V2_GPU_CONFIGS = [
    K.LaunchConfig(),
    K.LaunchConfig(use_asm=False),
    K.LaunchConfig(subnormal=True, lazy_rescale=False),
    K.LaunchConfig(row_reduce_max_programs=1e9),
    K.LaunchConfig(kernel="v1", maxnreg=168),
    K.LaunchConfig(centre_in_mma=True, maxnreg=168),
    K.LaunchConfig(kernel="v1", centre_in_mma=True, maxnreg=168),
]


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("spec", [UNIFORM_REAL, "lloyd"])
def test_gpu_real_shapes(head_dim, spec):
    capacity = 4096
    seq_lens = [4096, 1, 1000, 2049]
    codec, args = make_case(spec, 4, 8, 4, 1, head_dim, seq_lens, capacity, torch.bfloat16, device="cuda")
    want = dense_reference(codec, args, head_dim**-0.5)
    # Lloyd grids (the default) run v1 whatever the config asks; v2 variants only for affine grids
    configs = V2_GPU_CONFIGS if spec == UNIFORM_REAL else [K.LaunchConfig()]
    for config in configs:
        got = _run_triton(args, codec, head_dim**-0.5, config=config)
        assert rel_err(got, want) <= 1e-2, config


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,hkv,group,tq",
    [
        (1, 4, 8, 1),  # Qwen3-MoE's 32 / 4 heads, one sequence: the small-launch config
        (6, 4, 8, 1),  # the large launches' config
        (3, 8, 6, 1),  # Mixtral-8x22B's 48 / 8: 6 of the 8 rows real
        (3, 8, 4, 2),  # a group of 4 with two new tokens (causal rows)
    ],
)
def test_gpu_a_group_of_8_rows_runs_v3_with_the_packages_own_config(batch, hkv, group, tq):
    # thirty-ninth session: block_m 8 takes the group of 4's tuned configs (v3), not the untuned v2
    seq_lens = [8192, tq, 3000, 2049, 133, 4097][:batch]
    codec, args = make_case(
        UNIFORM_REAL, batch, hkv, group, tq, 128, seq_lens, 8192, torch.bfloat16, "cuda", "full"
    )
    layout = ops.compressed_layout(codec.spec, 128)
    block_m = K._block_m(group * tq)
    assert block_m == 8
    config = K.tuned_config(layout, 128, block_m, batch * hkv)
    assert K.split_kernel_choice(config, layout, args[1], args[2]) == "v3"
    got = _run_triton(args, codec, 128**-0.5)  # the op's own choice of config and splits
    assert torch.isfinite(got).all()
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE  # v3 ran (a failed build would have fallen back to v1)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch,hkv,group,tq",
    [
        (3, 4, 16, 1),  # Qwen3-235B's 64 / 4 heads: two row blocks of 8
        (1, 4, 16, 1),  # one sequence
        (3, 4, 12, 1),  # 12 rows: the second block half padding
        (3, 2, 8, 2),  # a group of 8 with two new tokens (causal rows across the blocks)
    ],
)
@pytest.mark.parametrize("source", ["package", "tuned", "small"])
def test_gpu_v3_runs_a_group_of_more_than_8_rows_in_row_blocks(batch, hkv, group, tq, source):
    # fortieth session: more than 8 query rows run on v3 in row blocks of 8 (a v3 config fell back
    # to v1 before, and the package chose v2); every row of every block must match the reference
    seq_lens = [8192, tq, 3000, 2049][:batch]
    codec, args = make_case(
        UNIFORM_REAL, batch, hkv, group, tq, 128, seq_lens, 8192, torch.bfloat16, "cuda", "full"
    )
    layout = ops.compressed_layout(codec.spec, 128)
    block_m = K._block_m(group * tq)
    if source == "package":
        config = None  # the op's own choice
        chosen = K.tuned_config(layout, 128, block_m, batch * hkv)
        assert K.split_kernel_choice(chosen, layout, args[1], args[2]) == "v3"
    else:
        config = (K.SMALL_LAUNCH_CONFIGS if source == "small" else K.TUNED_CONFIGS)[(128, 8, "affine")]
        assert K.split_kernel_choice(config, layout, args[1], args[2]) == "v3"
    want = dense_reference(codec, args, 128**-0.5)
    for splits in (None, 1, 7) if source != "package" else (None,):
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
        assert torch.isfinite(got).all()
        assert rel_err(got, want) <= 1e-2, splits
        # each query head against its own reference row: a block writing another's rows shows here
        for head in range(group * hkv):
            assert rel_err(got[:, head], want[:, head]) <= 1e-2, (splits, head)
    assert not K._V3_FAILURE, K._V3_FAILURE


def _config_id(config: K.LaunchConfig) -> str:
    """The fields that differ from LaunchConfig's defaults, e.g. 'kernel=v3-num_stages=1'."""
    default = K.LaunchConfig()
    fields = [f for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)]
    return "-".join(f"{f.name}={getattr(config, f.name)}" for f in fields) or "default"


V3_GPU_CONFIGS = [
    K.LaunchConfig(kernel="v3", num_stages=1),
    K.LaunchConfig(kernel="v3", num_stages=2, maxnreg=168),
    K.LaunchConfig(kernel="v3", num_stages=3, lazy_rescale=False, keys_via_smem=True),
    K.LaunchConfig(kernel="v3", num_stages=2, keys_via_smem=True, cache_tiles=True),
    K.LaunchConfig(kernel="v3", num_stages=1, cache_tiles=True, convert_p_once=True, maxnreg=168),
    K.LaunchConfig(
        kernel="v3", num_stages=1, cache_tiles=True, convert_p_once=True, maxnreg=168, overlap_exact=True
    ),
    K.LaunchConfig(kernel="v3", num_stages=1, cache_tiles=True, convert_p_once=True, keys_ahead=True),
    K.LaunchConfig(kernel="v3", num_stages=2, lazy_rescale=False, keys_ahead=True),
    # the tuned config (since the seventeenth session with the key words a step ahead), and without
    # two of its layout options
    K.TUNED_CONFIGS[(128, 4, "affine")],
    dataclasses.replace(
        TUNED_V3_PLAIN_STEP,
        copy_layout_tokens=False,
        value_scales_in_b=False,
        packed_p_scaling=False,
        value_scales_staged=False,
    ),
    # every tuned option but keys_ahead: the key words loaded in their step, as hinted words (a
    # lane's two 4-bit key words by one 8-byte load, key_word_pairs, as tuned)
    dataclasses.replace(TUNED_V3_PLAIN_STEP, keys_ahead=False),
    # key_word_pairs by Triton's own vector loads (unhinted), and the tuned config without it
    dataclasses.replace(TUNED_V3_PLAIN_STEP, key_word_pairs=True, key_loads_l2_256b=False),
    dataclasses.replace(TUNED_V3_PLAIN_STEP, key_word_pairs=False),
    # the exact-token kernel as a link of the PDL chain instead of on the side stream
    dataclasses.replace(TUNED_V3_PLAIN_STEP, overlap_exact=False, exact_in_chain=True),
    # key and value rows by 16-byte copies through two-stage rings, both read by ldmatrix (keys
    # through the ring: not a step ahead in registers, rows by the tokens' own pointers, as measured)
    ROW_COPIES_CONFIG := dataclasses.replace(
        TUNED_V3_PLAIN_STEP,
        num_stages=2,
        keys_via_smem=True,
        keys_ahead=False,
        key_loads_l2_256b=False,
        key_word_pairs=False,
        step_row_base=False,
        cache_tiles=False,
        copy_layout_tokens=False,
        row_copies=True,
    ),
    # the value fields as subnormals, centred once at the store (active at the 4096-token
    # capacity's splits: all within the bound), with p scaled by packed multiplies
    dataclasses.replace(TUNED_V3_PLAIN_STEP, packed_p_scaling=True, value_subnormals=True),
    # the MMAs' padding columns serving the 2-bit band (GQA groups of up to 4 rows; the group of 8
    # and the 8-row speculative block below run without it), with uncentred and centred value sums
    dataclasses.replace(TUNED_V3_PLAIN_STEP, band_columns=True, value_subnormals=True),
    dataclasses.replace(TUNED_V3_PLAIN_STEP, band_columns=True, value_subnormals=False),
    # the full-step loop over step numbers instead of token positions
    dataclasses.replace(TUNED_V3_PLAIN_STEP, counted_steps=True),
    # the partials' sums mapped to channels by the reduce (the split kernel's since the twenty-fifth
    # session): at the large launches' options, and at one sequence's
    # (the tuned configs map them in the split kernel: here the reduce does, as before)
    REDUCE_TRANSFORM,
    dataclasses.replace(K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")], transform_in_split=False),
    # no prologue: the split kernel transforms the query itself, at the large launches' options and
    # at one sequence's (the padding columns repeating the query rows)
    dataclasses.replace(TUNED_V3_PLAIN_STEP, query_in_split=True),
    dataclasses.replace(
        K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")], query_in_split=True, loads_before_pdl_wait=0
    ),
    # the tuned config (its value scales staged by lane in shared memory) with centred value sums,
    # and with the compiler's own conversion of the value scales
    dataclasses.replace(TUNED_V3_PLAIN_STEP, value_subnormals=False),
    dataclasses.replace(TUNED_V3_PLAIN_STEP, value_scales_staged=False),
    # the sixteenth session's tuned config: key words loaded in their step
    dataclasses.replace(
        TUNED_V3_PLAIN_STEP,
        key_word_pairs=False,
        keys_ahead=False,
        step_row_base=False,
        score_offset_in_mma=False,
        key_loads_l2_256b=False,
    ),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec,group,tq",
    [
        (UNIFORM_REAL, 4, 1),  # decode, 4 of the MMAs' 8 query rows real
        (UNIFORM_REAL, 8, 1),  # all 8 rows
        (UNIFORM_REAL, 1, 3),  # speculative decode: causal rows, one head
        ("default;window=0;sinks=0", 4, 2),  # causal rows inside the compressed range: masked steps
    ],
)
@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize("config", V3_GPU_CONFIGS, ids=lambda c: _config_id(c))
def test_gpu_v3_matches_reference(spec, group, tq, channel, config):
    # the Gluon kernel: ragged lengths (1, and lengths that are not multiples of the 64-token step),
    # garbage and NaN scales past each length, several split counts (empty splits included)
    seq_lens = [4096, tq, 1000, 2049, 133]  # tq: nothing before the new tokens
    codec, args = make_case(
        spec, 5, 2, group, tq, 128, seq_lens, 4096, torch.bfloat16, device="cuda", channel=channel
    )
    layout = ops.compressed_layout(codec.spec, 128)
    assert K.split_kernel_choice(config, layout, args[1], args[2]) == "v3"
    want = dense_reference(codec, args, 128**-0.5)
    for splits in (None, 1, 7, 70):
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
        assert rel_err(got, want) <= 1e-2, (config, splits)
    # v3 ran: a build or launch failure would have fallen back to v1 (correct, but not this test)
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("group,tq", [(4, 1), (8, 1), (1, 3)])
@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize("small", [False, True])
def test_gpu_v3_transform_in_split_matches_the_reduces_transform(group, tq, channel, small):
    # transform_in_split maps each split's sums to channels in fp16 on the tensor cores, where the
    # reduce's transform runs in tf32x3: the outputs may differ by that rounding only (far inside
    # the reference test's 1e-2), for every split count (empty splits included), both value-sum
    # modes and, at one sequence's options, the band-sharing columns; the offset channel too
    table = K.SMALL_LAUNCH_CONFIGS if small else K.TUNED_CONFIGS
    codec, args = make_case(
        UNIFORM_REAL, 5, 2, group, tq, 128, [4096, tq, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", channel
    )
    want = dense_reference(codec, args, 128**-0.5)
    for subnormals in (True, False):
        base = table[(128, 4, "affine")]
        # (token_sums_rows, tuned at the large launches since the forty-fourth session, needs the
        # value subnormals)
        base = dataclasses.replace(
            base,
            value_subnormals=subnormals,
            token_sums_rows=base.token_sums_rows and subnormals,
            transform_in_split=False,
        )
        for splits in (None, 1, 7, 70):
            plain = _run_triton(args, codec, 128**-0.5, config=base, num_splits=splits)
            config = dataclasses.replace(base, transform_in_split=True)
            got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
            assert not got.isnan().any()
            assert rel_err(got, plain.double()) <= 2e-3, (subnormals, splits, rel_err(got, plain.double()))
            assert rel_err(got, want) <= 1e-2
            assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("group,tq", [(4, 1), (8, 1), (1, 3)])
@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize("small", [False, True])
def test_gpu_v3_query_in_split_matches_the_prologue(group, tq, channel, small):
    # query_in_split computes the prologue's query slots in the split kernel from M_h s_k in fp16
    # (the prologue: M_h in fp32, through its tuned dot): the outputs may differ by that rounding
    # only, for every split count, and no prologue kernel may run; from a CUDA graph too, with a
    # fresh query
    table = K.SMALL_LAUNCH_CONFIGS if small else K.TUNED_CONFIGS
    base = dataclasses.replace(table[(128, 4, "affine")], loads_before_pdl_wait=0, query_in_split=False)
    config = dataclasses.replace(base, query_in_split=True, query_in_split_waves=0)
    codec, args = make_case(
        UNIFORM_REAL, 5, 2, group, tq, 128, [4096, tq, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", channel
    )
    want = dense_reference(codec, args, 128**-0.5)
    for splits in (None, 1, 7, 70):
        plain = _run_triton(args, codec, 128**-0.5, config=base, num_splits=splits)
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
        assert rel_err(got, plain.double()) <= 3e-3, (splits, rel_err(got, plain.double()))
        assert rel_err(got, want) <= 1e-2
    # (acc_events: torch's profiler warns, a UserWarning the attention target makes fatal, without it)
    cuda = dict(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True)
    with torch.profiler.profile(**cuda) as prof:
        _run_triton(args, codec, 128**-0.5, config=config)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    split_kernel = "split_kernel_cta" if small and group == 4 and tq == 1 else "split_kernel_v3"
    assert not any("prologue" in n for n in names) and any(split_kernel in n for n in names), names
    _replay_with_fresh_inputs(args, codec, config=config)
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
def test_gpu_v3_tuned_query_in_split_only_in_one_wave():
    # query_in_split_waves=1: a split launch of one wave of resident programs (12 a SM at 168
    # registers) transforms the query in its split kernel, a longer one runs the prologue; both right
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    assert tuned.query_in_split and tuned.query_in_split_waves == 1 and tuned.maxnreg == 168
    wave = 12 * torch.cuda.get_device_properties(0).multi_processor_count
    seq_lens = [4096, 1, 1000, 2049, 133, 4000, 64, 65, 3000, 2, 4095, 512, 511, 800, 131, 132, 4096]
    codec, args = make_case(UNIFORM_REAL, 17, 8, 4, 1, 128, seq_lens, 4096, torch.bfloat16, "cuda", "full")
    want = dense_reference(codec, args, 128**-0.5)
    programs = 17 * 8
    one_wave, two_waves = wave // programs, wave // programs + 1
    for splits, prologue in ((one_wave, False), (two_waves, True)):
        cuda = dict(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True)  # (no warning)
        with torch.profiler.profile(**cuda) as prof:
            got = _run_triton(args, codec, 128**-0.5, config=tuned, num_splits=splits)
            torch.cuda.synchronize()
        names = {e.name for e in prof.events()}
        assert any("prologue" in n for n in names) == prologue, (splits, names)
        assert not got.isnan().any() and rel_err(got, want) <= 1e-2, (splits, rel_err(got, want))
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("small", [True, False])
def test_gpu_v3_split_major_grid_changes_no_result(small, monkeypatch):
    # split_major_grid only reorders the split kernel's blocks: each still writes its own partial,
    # so the output is bit-identical for every split count; the grid is (programs, splits)
    tuned = (K.SMALL_LAUNCH_CONFIGS if small else K.TUNED_CONFIGS)[(128, 4, "affine")]
    assert tuned.split_major_grid == small  # (on at one sequence since the twenty-eighth session)
    config = dataclasses.replace(tuned, split_major_grid=False, cta_splits=0)  # one split a program
    reordered = dataclasses.replace(config, split_major_grid=True)
    seq_lens = [4096, 1, 1000, 2049, 133]
    codec, args = make_case(UNIFORM_REAL, 5, 2, 4, 1, 128, seq_lens, 4096, torch.bfloat16, "cuda", "full")
    grids = []
    launch = K.launch

    def spy(kernel, grid, *rest, **options):
        if "split_kernel_v3" in str(getattr(kernel, "fn", kernel)):
            grids.append((tuple(grid), options.get("SPLIT_MAJOR", False)))
        return launch(kernel, grid, *rest, **options)

    monkeypatch.setattr(K, "launch", spy)
    for splits in (1, 7, 70):
        plain = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
        got = _run_triton(args, codec, 128**-0.5, config=reordered, num_splits=splits)
        assert torch.equal(got, plain), splits
        assert grids[-2:] == [((splits, 10), False), ((10, splits), True)], grids
    assert not got.isnan().any() and rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize(
    "spec,group,tq",
    [
        (UNIFORM_REAL, 4, 1),  # decode
        (UNIFORM_REAL, 1, 3),  # speculative decode: causal rows
        ("default;window=0;sinks=0", 4, 2),  # causal rows inside the compressed range: masked steps
    ],
)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("variant", ["fenced", "unfenced", "early", "early_scales_two_ahead"])
def test_gpu_v3_tma_rows_change_no_result(spec, group, tq, stages, variant, monkeypatch):
    # tma_rows reads each step's code rows by TMA copies instead of loads and cp.async copies: the
    # same int16 elements reach the same MMA fragments, and the masked steps' rows past the range
    # (read unclamped) get p = 0, so the output is bit-identical to the same config without it,
    # for ragged lengths (1, off the step), empty splits (70) and every stage of the ring; with
    # tma_rows_unfenced and tma_rows_early (with scale_pairs_two_ahead or not) too (were a copy to
    # overwrite a stage before that stage's ldmatrix reads had returned, the result would differ)
    # (the tuned config without the forty-fourth session's step options: value_band2_half does not
    # combine with tma_rows)
    plain = dataclasses.replace(
        TUNED_V3_PLAIN_STEP, num_stages=stages, keys_ahead=False, key_word_pairs=False
    )
    unfenced = variant == "unfenced"
    config = dataclasses.replace(
        plain,
        tma_rows=True,
        tma_rows_unfenced=unfenced,
        tma_rows_early=variant.startswith("early"),
        scale_pairs_two_ahead=variant == "early_scales_two_ahead",
    )
    seq_lens = [4096, tq, 1000, 2049, 133]
    codec, args = make_case(spec, 5, 2, group, tq, 128, seq_lens, 4096, torch.bfloat16, "cuda", "full")
    assert K.tma_rows_reason(ops.compressed_layout(codec.spec, 128), args[1], args[3]) is None
    used, ptx = [], []
    launch = K.launch

    def spy(kernel, grid, *rest, **options):
        if "split_kernel_v3" in str(getattr(kernel, "fn", kernel)):
            used.append(options.get("TMA_ROWS", False))
            if options.get("TMA_ROWS_UNFENCED"):  # the same launch, its compiled kernel kept
                ptx.append(kernel[grid](*rest, **options).asm["ptx"])
                return None
        return launch(kernel, grid, *rest, **options)

    monkeypatch.setattr(K, "launch", spy)
    want = dense_reference(codec, args, 128**-0.5)
    for splits in (1, 7, 70):
        expected = _run_triton(args, codec, 128**-0.5, config=plain, num_splits=splits)
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
        assert torch.equal(got, expected), splits
        assert not got.isnan().any() and rel_err(got, want) <= 1e-2, splits
        assert used[-2:] == [False, True], used
    if unfenced:  # the launcher installed the PTX patch before the kernel compiled
        assert ptx and "no_async_proxy_fences" in ptx[-1] and "fence.proxy.async" not in ptx[-1]
    # captured in a CUDA graph (the descriptors' tensor maps are launch parameters)
    _replay_with_fresh_inputs(args, codec, config=config, num_splits=7)
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("channel", ["scale", "full"])
@pytest.mark.parametrize(
    "batch, hkv, seq_lens, capacity",
    [
        (5, 2, [4096, 1, 1000, 2049, 133], 4096),  # ragged: empty splits, CTAs of mixed lengths
        (1, 8, [31001], 32768),  # one sequence of the real shape, a length off the step
    ],
)
def test_gpu_v3_cta_splits_match_one_split_a_program_and_the_reference(
    batch, hkv, seq_lens, capacity, channel
):
    # LaunchConfig.cta_splits (the small-launch config's): four splits a CTA sharing the
    # transforms and merging into one partial. Its outputs differ from one split a program only
    # by where the means round to fp16 (once a CTA instead of once a split), for every split
    # count (a last CTA of 1-3 splits, empty ones); the CTA kernel must be what ran, its grid
    # (programs, CTAs); from a CUDA graph too, with a fresh query
    config = K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")]
    assert config.cta_splits == 4
    plain = dataclasses.replace(config, cta_splits=0)
    codec, args = make_case(
        UNIFORM_REAL, batch, hkv, 4, 1, 128, seq_lens, capacity, torch.bfloat16, "cuda", channel
    )
    want = dense_reference(codec, args, 128**-0.5)
    grids = []
    launch = K.launch

    def spy(kernel, grid, *rest, **options):
        grids.append((str(getattr(kernel, "fn", kernel)), tuple(grid)))
        return launch(kernel, grid, *rest, **options)

    K.launch = spy
    try:
        for splits in (None, 1, 3, 7, 70):
            got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
            ran = [grid for name, grid in grids if "split_kernel_cta" in name]
            grids.clear()
            one_split = _run_triton(args, codec, 128**-0.5, config=plain, num_splits=splits)
            assert not got.isnan().any(), splits
            assert rel_err(got, one_split.double()) <= 3e-3, (splits, rel_err(got, one_split.double()))
            assert rel_err(got, want) <= 1e-2, (splits, rel_err(got, want))
            if splits is not None:
                assert ran == [(batch * hkv, -(-splits // 4))], (splits, ran)
            assert not any("split_kernel_cta" in name for name, _ in grids), grids
            grids.clear()
    finally:
        K.launch = launch
    _replay_with_fresh_inputs(args, codec, config=config)
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("group, tq", [(8, 1), (4, 2)])
def test_gpu_v3_cta_splits_where_they_do_not_fit_run_one_split_a_program(group, tq):
    # another GQA group or several new tokens: the small-launch config runs one split a program
    # (cta_splits_reason says why), bit for bit as with cta_splits off
    config = K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")]
    shape = (group, tq, 1, K._block_m(group * tq), 128)
    layout = ops.compressed_layout(UNIFORM_REAL, 128)
    codec, args = make_case(
        UNIFORM_REAL, 2, 2, group, tq, 128, [3000, 77], 4096, torch.bfloat16, "cuda", "full"
    )
    assert K.cta_splits_reason(config, K.SplitPlan(7), shape, layout, args[2])
    got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=7)
    plain = _run_triton(
        args, codec, 128**-0.5, config=dataclasses.replace(config, cta_splits=0), num_splits=7
    )
    assert torch.equal(got, plain)
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("small", [True, False])
def test_gpu_v3_phase_clocks_stamp_every_program_in_order(small):
    # the probe's stamps (LaunchConfig.phase_clocks) change no output bit; every program writes its
    # wait, query, step, masked-step and epilogue stamps in time order, its SM and its full steps;
    # without the buffer the launch is refused before it runs
    table = K.SMALL_LAUNCH_CONFIGS if small else K.TUNED_CONFIGS
    config = table[(128, 4, "affine")]
    stamped = dataclasses.replace(config, phase_clocks=True)
    seq_lens = [4096, 1, 1000, 2049, 133]
    codec, args = make_case(UNIFORM_REAL, 5, 2, 4, 1, 128, seq_lens, 4096, torch.bfloat16, "cuda", "full")
    splits, programs = 7, 5 * 2
    plain = _run_triton(args, codec, 128**-0.5, config=config, num_splits=splits)
    K.phase_clock_buffer = None
    with pytest.raises(ValueError, match="phase_clock_buffer"):
        _run_triton(args, codec, 128**-0.5, config=stamped, num_splits=splits)
    buffer = torch.full((programs * splits * K.PHASE_SLOTS,), -1, dtype=torch.int64, device="cuda")
    K.phase_clock_buffer = buffer
    try:
        got = _run_triton(args, codec, 128**-0.5, config=stamped, num_splits=splits)
        torch.cuda.synchronize()
    finally:
        K.phase_clock_buffer = None
    assert torch.equal(got, plain)
    rows = buffer.view(programs * splits, K.PHASE_SLOTS).cpu()
    assert (rows[:, [0, 1, 6, 7]] > 0).all(), rows  # every program: wait, query, rest, epilogue
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sm, steps = rows[:, K.PHASE_SM], rows[:, K.PHASE_FULL_STEPS]
    assert ((sm >= 0) & (sm < sms)).all()
    # 4096 tokens less the window and sinks in 7 splits: at most 10 full 64-token steps a program
    assert ((steps >= 0) & (steps <= 10)).all() and steps.max() >= 4
    for row in rows:
        times = [t for t in row[: K.PHASE_TIMES].tolist() if t >= 0]
        assert times == sorted(times), row
        full = int(row[K.PHASE_FULL_STEPS])
        # full steps 0, 1, 2 stamp their own slot, the later ones slot 5
        assert [row[2 + k] >= 0 for k in range(4)] == [full > k for k in range(4)], row
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize(
    "option,tolerance",
    [
        ({"prologue_warps": 1}, 1e-3),
        ({"prologue_warps": 2}, 1e-3),
        ({"prologue_warps": 8}, 1e-3),
        ({"prologue_tile_rows": 16}, 1e-3),
        ({"prologue_tile_rows": 32}, 1e-3),
        # the tuned dot is one tf32 MMA: the query slots keep 10 mantissa bits before their fp16
        # rounding (as query_in_split's fp16 transform does), a few fp16 ulps from fp32's
        ({"prologue_precision": "tf32x3"}, 3e-3),
        ({"prologue_precision": "ieee"}, 3e-3),
    ],
)
@pytest.mark.parametrize("batch", [5, 17])  # the per-sequence prologue, the per-kv-head one
def test_gpu_v3_prologue_options_change_no_result(option, tolerance, batch):
    # the prologue's warps, rows a program (the per-kv-head prologue) and dot precision launch the
    # same query transform (summed in another order, or rounded once more for tf32), so the output
    # within rounding of the tuned launch's, and against the reference
    tuned = dataclasses.replace(TUNED_V3_PLAIN_STEP, query_in_split=False)
    lens = [4096, 1, 1000, 2049, 133] * 4
    codec, args = make_case(
        UNIFORM_REAL, batch, 2, 4, 1, 128, lens[:batch], 4096, torch.bfloat16, "cuda", "full"
    )
    want = _run_triton(args, codec, 128**-0.5, config=tuned)
    got = _run_triton(args, codec, 128**-0.5, config=dataclasses.replace(tuned, **option))
    assert not got.isnan().any()
    assert rel_err(got, want.double()) <= tolerance, rel_err(got, want.double())
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
def test_gpu_v3_key_word_pairs_on_a_cache_not_8_byte_aligned():
    # key_word_pairs loads 8 bytes at once; a key cache 4 bytes off 8-byte alignment (still int16-
    # aligned, so v3 runs) takes 4-byte loads instead: the same result as the unpaired launch, no
    # misaligned access
    codec, args = make_case(
        UNIFORM_REAL, 3, 2, 4, 1, 128, [2049, 1, 700], 2304, torch.bfloat16, "cuda", "full"
    )
    kc = args[1]
    storage = torch.empty(kc.numel() + 8, dtype=torch.uint8, device="cuda")
    shifted = storage[4 : 4 + kc.numel()].view(kc.shape)
    shifted.copy_(kc)
    layout = ops.compressed_layout(codec.spec, 128)
    assert shifted.data_ptr() % 8 == 4 and not K._key_pairs_aligned(shifted, layout)
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    assert tuned.key_word_pairs
    moved = (args[0], shifted, *args[2:])
    assert K.split_kernel_choice(tuned, layout, shifted, args[2]) == "v3"
    got = _run_triton(moved, codec, 128**-0.5, config=tuned, num_splits=7)
    unpaired = dataclasses.replace(tuned, key_word_pairs=False)
    assert torch.equal(got, _run_triton(args, codec, 128**-0.5, config=unpaired, num_splits=7))
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
def test_gpu_v3_layout_options_leave_the_result_bit_identical():
    # These options change only where values are computed or how they move, never what is computed:
    # copy_layout_tokens makes the value tiles' token indices in their copies' layout (the same
    # addresses), value_scales_in_b splits the value scales straight into fp16 B-layout vectors
    # (fp16 -> fp32 -> fp16 was exact), p_movmatrix moves p's fp16 values into the B layout by
    # movmatrix instead of shuffles, step_row_base forms the same addresses from a per-step scalar
    # pointer, keys_ahead loads each step's key words a step early (as int32 words). None may
    # change a bit of the output, tails included, with the score offset added
    # after the key MMAs or as their accumulator input (score_offset_in_mma changes the rounding,
    # so the reference test covers that one).
    codec, args = make_case(
        UNIFORM_REAL, 5, 2, 4, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    # zero_padding_p gives the MMAs' padding rows p = 0 (real rows untouched)
    layout_options = (
        "copy_layout_tokens",
        "value_scales_in_b",
        "p_movmatrix",
        "step_row_base",
        "keys_ahead",
        "zero_padding_p",
        "counted_steps",  # the full-step loop over step numbers: the same steps
    )
    # (key_word_pairs reorders the key MMAs' k slots, which changes the rounding: off here, the
    # reference test covers it)
    plain = dataclasses.replace(
        TUNED_V3_PLAIN_STEP,
        score_offset_in_mma=False,
        key_loads_l2_256b=False,
        key_word_pairs=False,
        packed_p_scaling=False,
        value_scales_staged=False,
        transform_in_split=False,
        **dict.fromkeys(layout_options, False),
    )
    # (transform_in_split off: band_columns sums each band's channels apart, in another order)
    # packed_p_scaling multiplies p by the value scales two halves at a time (the same products)
    packed = {"value_scales_in_b": True, "packed_p_scaling": True}
    for offset_in_mma in (False, True):
        base = dataclasses.replace(plain, score_offset_in_mma=offset_in_mma)
        want = _run_triton(args, codec, 128**-0.5, config=base, num_splits=7)
        assert rel_err(want, dense_reference(codec, args, 128**-0.5)) <= 1e-2
        singles = [{name: True} for name in layout_options]
        for changed in singles + [packed, {**dict.fromkeys(layout_options, True), **packed}]:
            config = dataclasses.replace(base, **changed)
            assert torch.equal(_run_triton(args, codec, 128**-0.5, config=config, num_splits=7), want), config
        # the key words loaded with an L2 prefetch-size hint (a step ahead or in-step), the next
        # value rows prefetched or filled into L2 by hinted loads, the copies and scale loads
        # hinted: the same words
        for keys_ahead in (False, True):
            options = {**dict.fromkeys(layout_options, True), **packed, "keys_ahead": keys_ahead}
            hinted = dataclasses.replace(base, **options, key_loads_l2_256b=True)
            for config in (
                hinted,
                dataclasses.replace(hinted, prefetch_value_rows=True),
                dataclasses.replace(hinted, fill_value_rows_l2=True),
                # the same hint added to the cp.async copies and plain loads by a PTX patch
                dataclasses.replace(hinted, value_copies_l2_256b=True, plain_loads_l2_256b=True),
            ):
                assert torch.equal(_run_triton(args, codec, 128**-0.5, config=config, num_splits=7), want)
        # band_columns computes each band's products in its own columns of one operand: the same
        # products and sums, uncentred or centred
        for sub in (False, True):
            fields = dict(value_scales_in_b=True, packed_p_scaling=True, value_subnormals=sub)
            two = dataclasses.replace(base, **fields)
            one = dataclasses.replace(two, band_columns=True)
            assert torch.equal(
                _run_triton(args, codec, 128**-0.5, config=one, num_splits=7),
                _run_triton(args, codec, 128**-0.5, config=two, num_splits=7),
            ), sub
        # row_copies reads the same code words through shared memory (keys too), two stages ahead
        rows = dataclasses.replace(ROW_COPIES_CONFIG, score_offset_in_mma=offset_in_mma)
        rows = dataclasses.replace(rows, transform_in_split=False)  # (as plain)
        assert torch.equal(_run_triton(args, codec, 128**-0.5, config=rows, num_splits=7), want)
    # value_scales_staged changes only how the value scales reach the B layout (two adjacent
    # tokens' scales a lane, through shared memory in the lanes' order): the same values, uncentred
    # and centred, with splits of one full step and of many, the masked tail after them
    # (from the tuned config without token_sums_rows, which needs the staged scales)
    tuned = TUNED_V3_PLAIN_STEP
    assert tuned.value_scales_staged
    for sub in (False, True):
        staged = dataclasses.replace(tuned, value_subnormals=sub)
        two = dataclasses.replace(staged, value_scales_staged=False)
        for splits in (7, 70):
            want = _run_triton(args, codec, 128**-0.5, config=two, num_splits=splits)
            got = _run_triton(args, codec, 128**-0.5, config=staged, num_splits=splits)
            assert torch.equal(got, want), (sub, splits)
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
def test_gpu_access_stream_probe_reads_every_step_of_every_split_once():
    # benchmarks/probe_access_stream.py's byte counts (its TB/s) assume each item reads its split's
    # steps exactly once: each item's sum of per-position XORs over its steps must equal the same
    # computed here from the caches, for the op's pattern (1 and 3 steps ahead), the 16-byte rows,
    # one program per item and a few programs taking the items in turn
    import importlib.util
    import pathlib
    import sys

    bench = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location("probe_access_stream", bench / "probe_access_stream.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    b, h, n, splits, chunk = 2, 3, 700, 3, 192  # 3 steps a split, tokens past the last split unread
    k_codes, v_codes = (torch.randint(0, 256, (b, h, n, 48), dtype=torch.uint8, device="cuda") for _ in "kv")
    k_scales, v_scales = (torch.randn(b, h, n, 2, device="cuda").half() for _ in "kv")

    def per_position_xor(x: torch.Tensor) -> torch.Tensor:  # [items, steps, ...] -> [items, ...]
        out = x[:, 0]
        for step in range(1, x.shape[1]):
            out = out ^ x[:, step]
        return out

    def steps(x: torch.Tensor, per_token: int, dtype) -> torch.Tensor:  # -> [items, steps, 64, words]
        x = x.reshape(b * h, n, -1)[:, : splits * chunk].contiguous().view(dtype)
        return x.reshape(b * h * splits, chunk // 64, 64, per_token)

    k_words = steps(k_codes, 12, torch.int32).long()
    keys = per_position_xor(k_words)  # the 4-bit band's 8 words a row once, the 2-bit band's 4 twice
    key_sum = keys[..., :8].sum((1, 2)) + 2 * keys[..., 8:].sum((1, 2))
    v = steps(v_codes, 24, torch.int16).long()
    values = per_position_xor(v[..., :16] ^ v[..., 16:24].repeat(1, 1, 1, 2))  # both band tiles folded
    rows = per_position_xor(v).sum((1, 2))
    s = per_position_xor((steps(k_scales, 2, torch.int16) ^ steps(v_scales, 2, torch.int16)).long()).sum(
        (1, 2)
    )
    for stages, rows16, programs in ((2, False, b * h * splits), (4, False, 5), (2, True, 7)):
        out = torch.zeros(b * h * splits, dtype=torch.int32, device="cuda")
        args = (k_codes, k_scales, v_codes, v_scales, out, splits, chunk, (0, 16), stages, True, True, True)
        probe.launch_stream(*args, programs, rows16)
        want = key_sum + s + (rows if rows16 else values.sum((1, 2)))
        want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)  # the kernel's int32 sums wrap
        assert torch.equal(out.cpu(), want.cpu()), (stages, rows16, programs)


@pytest.mark.gpu
@pytest.mark.parametrize("before_split", [False, True])
def test_gpu_exact_tokens_on_a_side_stream_equal_the_in_order_launch_also_in_a_cuda_graph(before_split):
    # overlap_exact forks the exact-token kernel onto a second stream and joins it before the
    # reduce: the result must be bit-identical to the in-order launch, eagerly and replayed from a
    # CUDA graph whose exact inputs and query changed after capture (a missing join would race the
    # reduce); enqueued there before the split kernel's launch (exact_before_split) or after it
    codec, args = make_case(
        UNIFORM_REAL, 5, 2, 4, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    in_order = K.LaunchConfig(kernel="v3", num_stages=1, cache_tiles=True, convert_p_once=True, maxnreg=168)
    overlap = dataclasses.replace(in_order, overlap_exact=True, exact_before_split=before_split)
    K._SIDE_STREAMS.clear()
    assert torch.equal(
        _run_triton(args, codec, 128**-0.5, config=overlap),
        _run_triton(args, codec, 128**-0.5, config=in_order),
    )
    assert K._SIDE_STREAMS, "overlap_exact made no side stream"
    # fresh exact keys and values and a fresh query in the captured tensors
    captured = _replay_with_fresh_inputs(args, codec, (5, 6, 0), dict(config=in_order), config=overlap)
    assert rel_err(captured, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("chunks,exact_block", [(3, 32), (5, 32), (9, 16)])
def test_gpu_v3_exact_tokens_in_chunks_match_one_exact_partial(chunks, exact_block):
    # exact_chunks cuts the exact-token kernel into several programs per (sequence, kv head), each
    # writing its own partial, which the reduce merges with the others (the same math in another
    # order): the result must match the single exact partial's to rounding and the reference as
    # closely, on the side stream, in order and in a CUDA graph with fresh exact tokens.
    codec, args = make_case(
        UNIFORM_REAL, 5, 2, 4, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    one = _run_triton(args, codec, 128**-0.5, config=tuned, num_splits=7)
    ref = dense_reference(codec, args, 128**-0.5)
    for overlap in (True, False):
        config = dataclasses.replace(
            tuned, exact_chunks=chunks, exact_block=exact_block, overlap_exact=overlap
        )
        got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=7)
        assert not torch.isnan(got).any()
        assert rel_err(got, one) <= 2e-3, (overlap, rel_err(got, one))
        assert rel_err(got, ref) <= rel_err(one, ref) * 1.1 + 1e-4, (rel_err(got, ref), rel_err(one, ref))
    # fresh exact keys and values in the captured tensors
    captured = _replay_with_fresh_inputs(args, codec, (5, 6), config=config, num_splits=7)
    assert rel_err(captured, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 5])
def test_gpu_v3_exact_tokens_in_the_pdl_chain_equal_the_in_order_launch_also_in_a_cuda_graph(batch):
    # exact_in_chain launches the exact-token kernel right after the split kernel with PDL: it runs
    # beside the split kernel, waits for it only before it ends, and the reduce waits for it. A
    # link that let the reduce read the split's partials or the exact partial early would differ
    # from the in-order launch here, eagerly or replayed from a CUDA graph with fresh exact tokens.
    lens = [4096, 1, 1000, 2049, 133][:batch] if batch > 1 else [4096]
    codec, args = make_case(UNIFORM_REAL, batch, 2, 4, 1, 128, lens, 4096, torch.bfloat16, "cuda", "full")
    in_order = dataclasses.replace(TUNED_V3_PLAIN_STEP, overlap_exact=False)
    chained = dataclasses.replace(in_order, exact_in_chain=True)
    want = _run_triton(args, codec, 128**-0.5, config=in_order)
    assert torch.equal(_run_triton(args, codec, 128**-0.5, config=chained), want)
    assert rel_err(want, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run_triton(args, codec, 128**-0.5, config=chained)
    for exact in (args[5], args[6]):  # k_exact, v_exact: fresh values in the captured tensors
        exact.copy_(torch.randn_like(exact))
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, _run_triton(args, codec, 128**-0.5, config=in_order))
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize(
    "batch, config",
    [
        (2, attention_config.SMALL_LAUNCH_V1_CONFIGS[(128, 4, "affine")]),  # v1 split, per-row reduce
        (1, K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")]),  # v3, 256-token splits, exact chunks in the chain
        (5, K.TUNED_CONFIGS[(128, 4, "affine")]),  # v3 (no prologue), exact kernel on the side stream
        (5, dataclasses.replace(TUNED_V3_PLAIN_STEP, query_in_split=False)),  # prologue
        (17, dataclasses.replace(TUNED_V3_PLAIN_STEP, query_in_split=False)),  # per kv head
        (5, dataclasses.replace(TUNED_V3_PLAIN_STEP, overlap_exact=False)),  # PDL reduce
        # (the reduce's own transform where the split kernel leaves coefficient sums:) the merge,
        # then the per-kv-head transform launched as its dependent
        (17, dataclasses.replace(REDUCE_TRANSFORM, reduce_gemm_min_rows=1)),
        (5, dataclasses.replace(REDUCE_TRANSFORM, overlap_exact=False)),  # the per-row reduce
        # the split kernel's first cache reads before its wait for the prologue, the query after it
        (5, dataclasses.replace(TUNED_V3_PLAIN_STEP, **EARLY_LOADS)),
        (
            5,
            dataclasses.replace(TUNED_V3_PLAIN_STEP, **EARLY_LOADS, overlap_exact=False),
        ),
        # one sequence without the exact-token kernel's shared-memory carveout (exact_carveout)
        (1, dataclasses.replace(K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")], exact_carveout=-1)),
        # the one-warp merge (the tuned reduce_merge_warps), then the transform, both as dependents
        (5, dataclasses.replace(REDUCE_TRANSFORM, reduce_gemm_min_rows=1, overlap_exact=False)),
        (17, dataclasses.replace(REDUCE_TRANSFORM, reduce_gemm_min_rows=1, reduce_merge_warps=4)),  # 4-warp
        # one sequence: the same, and each row's merge over 4 programs, then the per-kv-head transform
        (
            1,
            dataclasses.replace(
                K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")],
                **dict(EARLY_LOADS, loads_before_pdl_wait=2),
                reduce_gemm_min_rows=1,
                reduce_merge_channels=32,
                transform_in_split=False,
            ),
        ),
    ],
)
def test_gpu_programmatic_dependent_launch_equals_the_ordinary_launch_also_in_a_cuda_graph(batch, config):
    # LaunchConfig.pdl launches the split kernel (and the reduce, unless a stream join precedes it)
    # before the kernel ahead of it has finished; they wait for it in-kernel. A missing wait would
    # read the prologue's (or the split kernel's) buffers early: the result must be bit-identical to
    # the ordinary launch, eagerly and replayed from a CUDA graph whose query changed after capture
    lens = [4096, 1, 1000, 2049, 133] * 4
    codec, args = make_case(
        UNIFORM_REAL, batch, 2, 4, 1, 128, lens[:batch], 4096, torch.bfloat16, "cuda", "full"
    )
    # the tuned configs launch with PDL; the one-sequence config chains its exact-token kernel with
    # it (exact_in_chain), which without PDL runs in order after the split kernel
    chain = config.exact_in_chain
    config = dataclasses.replace(config, pdl=False, exact_in_chain=False, prologue_waits=False)
    pdl = dataclasses.replace(config, pdl=True, exact_in_chain=chain)
    assert K._pdl(pdl, args[0].device), "the H200 has programmatic dependent launch"
    ordinary = _run_triton(args, codec, 128**-0.5, config=config)
    assert torch.equal(_run_triton(args, codec, 128**-0.5, config=pdl), ordinary)
    assert rel_err(ordinary, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    # the early loads change no value; a row's merge in slices may sum in another order
    plain = _run_triton(
        args,
        codec,
        128**-0.5,
        config=dataclasses.replace(config, loads_before_pdl_wait=0, reduce_merge_channels=0),
    )
    if config.reduce_merge_channels:
        assert rel_err(ordinary, plain) <= 1e-3
    else:
        assert torch.equal(ordinary, plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _run_triton(args, codec, 128**-0.5, config=pdl)
    for round_ in range(3):
        args[0].copy_(torch.randn_like(args[0]))  # q: what the prologue reads and the split waits for
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, _run_triton(args, codec, 128**-0.5, config=config)), round_
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [5, 17])  # the per-sequence prologue; the per-kv-head one (68 rows)
def test_gpu_prologue_waits_for_the_kernel_that_writes_the_query_also_in_a_cuda_graph(batch):
    # LaunchConfig.prologue_waits launches the prologue before the kernel ahead of it has finished;
    # it waits in-kernel before reading the query. In a graph whose first kernel writes the query,
    # a missing wait would transform an old query: every replay must equal a plain launch on the new one
    lens = ([4096, 1, 1000, 2049, 133] * 4)[:batch]
    codec, args = make_case(UNIFORM_REAL, batch, 2, 4, 1, 128, lens, 4096, torch.bfloat16, "cuda", "full")
    tuned = dataclasses.replace(TUNED_V3_PLAIN_STEP, query_in_split=False)  # a prologue
    waits = dataclasses.replace(tuned, prologue_waits=True)
    want = _run_triton(args, codec, 128**-0.5, config=tuned)
    assert torch.equal(_run_triton(args, codec, 128**-0.5, config=waits), want)
    assert rel_err(want, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    source = torch.randn_like(args[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        args[0].copy_(source)  # the kernel before the prologue writes the query
        captured = _run_triton(args, codec, 128**-0.5, config=waits)
    for round_ in range(3):
        source.copy_(torch.randn_like(source))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(args[0], source)
        assert torch.equal(captured, _run_triton(args, codec, 128**-0.5, config=tuned)), round_
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan", [K.SplitPlan(7, 83, 510, split_major=True), K.SplitPlan(3, 5, 12, split_major=True)]
)
def test_gpu_v3_takes_a_split_plan_launched_split_major(plan):
    # LaunchConfig.remainder_split's launch (prepared in the twentieth session): v3 with long splits
    # and a shorter last one, its grid (programs, splits). Against fp32 SDPA and equal splits, on
    # ragged lengths (each sequence's own span is cut by the plan's fractions)
    lens = [4096, 1, 1000, 2049, 133]
    codec, args = make_case(UNIFORM_REAL, 5, 8, 4, 1, 128, lens, 4096, torch.bfloat16, "cuda", "full")
    config = dataclasses.replace(TUNED_V3_PLAIN_STEP, remainder_split=True)
    got = _run_triton(args, codec, 128**-0.5, config=config, num_splits=plan)
    assert not K._V3_FAILURE, K._V3_FAILURE
    assert torch.isfinite(got).all()
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    equal = _run_triton(args, codec, 128**-0.5, config=config, num_splits=plan.num_splits)
    assert rel_err(got, equal) <= 2e-3  # the same sums split elsewhere (bf16 outputs)
    # the package's own plan for a one-wave launch of this config, from a CUDA graph
    _replay_with_fresh_inputs(args, codec, config=config)


def _preferred_carveouts(kernel, percent: int) -> list[int]:
    """The preferred shared-memory carveout the driver holds for each kept compiled variant of
    `kernel` launched with CARVEOUT=percent (asserting there is one)."""
    import ctypes

    from wmoe_compile.kernels import fast_launch

    kept = fast_launch.kernel_info(kernel).compiled
    variants = [compiled for key, (compiled, _) in kept.items() if ("CARVEOUT", percent) in key[1]]
    assert variants, f"no variant of {kernel} was launched with CARVEOUT={percent}"
    values = []
    for compiled in variants[:1]:
        value = ctypes.c_int(-7)
        status = ctypes.CDLL("libcuda.so.1").cuFuncGetAttribute(
            ctypes.byref(value), 9, ctypes.c_void_p(compiled.function)
        )  # 9: CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        assert status == 0, status
        values.append(value.value)
    return values


@pytest.mark.gpu
def test_gpu_exact_carveout_is_set_on_its_own_variant_and_changes_no_value():
    # LaunchConfig.exact_carveout compiles the exact-token kernel as a variant of its own and sets
    # the preferred shared-memory carveout on it (read back from the driver here); the output must be
    # bit-identical to the driver's choice, on the first call and from the kept variant
    from wmoe_compile.kernels import fast_launch

    fast_launch.clear()  # a worker's earlier tests may have filled the kept variants (64 a kernel)
    codec, args = make_case(UNIFORM_REAL, 1, 8, 4, 1, 128, [3000], 3000, torch.bfloat16, "cuda", "full")
    carved = K.SMALL_LAUNCH_CONFIGS[(128, 4, "affine")]  # 44%, one sequence being one wave
    assert carved.exact_carveout == 44 and carved.exact_carveout_waves == 1
    want = _run_triton(args, codec, 128**-0.5, config=dataclasses.replace(carved, exact_carveout=-1))
    for _ in range(2):
        assert torch.equal(_run_triton(args, codec, 128**-0.5, config=carved), want)
    assert _preferred_carveouts(K._exact_kernel, 44) == [44]
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("tma_rows", [False, True])
def test_gpu_split_carveout_is_set_on_the_split_kernel_and_changes_no_value(tma_rows):
    # LaunchConfig.split_carveout (fortieth session): the v3 split kernel's preferred carveout, set
    # on its compiled function (read back from the driver); bit-identical to the driver's choice

    from wmoe_compile.kernels import fast_launch
    from wmoe_compile.kernels.wavelet_attention_gluon import split_kernel_v3

    fast_launch.clear()  # a worker's earlier tests may have filled the kept variants (64 a kernel)
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    base = (  # (tma_rows does not combine with the tuned value_band2_half)
        dataclasses.replace(
            TUNED_V3_PLAIN_STEP, num_stages=2, keys_ahead=False, key_word_pairs=False, tma_rows=True
        )
        if tma_rows
        else tuned
    )
    codec, args = make_case(
        UNIFORM_REAL, 5, 2, 4, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    want = _run_triton(args, codec, 128**-0.5, config=base, num_splits=7)
    carved = dataclasses.replace(base, split_carveout=100)
    for _ in range(2):
        assert torch.equal(_run_triton(args, codec, 128**-0.5, config=carved, num_splits=7), want)
    assert _preferred_carveouts(split_kernel_v3, 100) == [100]
    assert rel_err(want, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("copies", ["8_byte", "16_byte_l1"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("hkv, group", [(2, 4), (2, 8), (1, 16)])
def test_gpu_value_band2_half_is_bit_identical_to_the_doubled_tiles(copies, stages, hkv, group):
    # LaunchConfig.value_band2_half (forty-first session): the 2-bit value band's tiles hold its 8
    # elements once and the operand repeats them in registers, so every value MMA sees the same
    # operand as with the doubled tiles: bit for bit, at 1 and 2 ring stages, in the full steps and
    # the masked last ones (lengths off the 64-token step, 1), for GQA groups of 4, 8 and 16 (two
    # row blocks), at one split and several. Also with the tiles by 16-byte copies through L1
    # (value_copies_16b_l1, the PTX-patched cp.async.ca), which change no byte a tile receives
    tuned = dataclasses.replace(TUNED_V3_PLAIN_STEP, num_stages=stages)
    half = dataclasses.replace(tuned, value_band2_half=True)
    if copies == "16_byte_l1":
        sixteen = dict(cache_tiles=False, copy_layout_tokens=False, value_copies_16b_l1=True)
        half = dataclasses.replace(half, **sixteen)
    codec, args = make_case(
        UNIFORM_REAL, 5, hkv, group, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    for splits in (1, 7):
        want = _run_triton(args, codec, 128**-0.5, config=tuned, num_splits=splits)
        got = _run_triton(args, codec, 128**-0.5, config=half, num_splits=splits)
        assert not torch.isnan(got).any() and torch.equal(got, want), splits
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("half", [False, True])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("hkv, group", [(2, 4), (2, 8), (1, 16)])
def test_gpu_token_sums_rows_matches_the_three_ones_operand_mmas(half, stages, hkv, group):
    # LaunchConfig.token_sums_rows (forty-second session): the token sums come from one MMA whose
    # operand rows are ones and the tokens' two value scales (staged in shared memory in the full
    # steps, built in registers in the masked ones) instead of three ones-operand MMAs. Its sums of
    # p * scale take exact fp16 products where those MMAs summed them rounded to fp16, so the output
    # is not bit-identical. Full and masked steps (lengths 1, 133, 1000, 2049, 4096), 1 and 7
    # splits, GQA groups of 4, 8 and 16 (two row blocks), 1 and 2 ring stages, with and without
    # value_band2_half. The value sums keep p * scale rounded to fp16, so the centring's exact sums
    # leave an offset common to a band's slots (benchmarks/centring_rounding_model.py: mostly 1-3x
    # the rounded sums' error, 1e-5 to 8e-4 of the slot sums): within 1e-3 of the tuned output, and
    # no more than 1e-3 farther from the reference, where a wrong row (a band's sums for the
    # other's, p's for either) would be off by the scales' spread
    tuned = dataclasses.replace(TUNED_V3_PLAIN_STEP, num_stages=stages, value_band2_half=half)
    rows = dataclasses.replace(tuned, token_sums_rows=True)
    codec, args = make_case(
        UNIFORM_REAL, 5, hkv, group, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    want = dense_reference(codec, args, 128**-0.5)
    for splits in (1, 7):
        base = _run_triton(args, codec, 128**-0.5, config=tuned, num_splits=splits)
        got = _run_triton(args, codec, 128**-0.5, config=rows, num_splits=splits)
        assert torch.isfinite(got).all(), splits
        assert rel_err(got, base) <= 1e-3, (splits, rel_err(got, base))
        assert rel_err(got, want) <= rel_err(base, want) + 1e-3, (rel_err(got, want), rel_err(base, want))
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
@pytest.mark.parametrize("step", ["tuned", "half_and_rows"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("hkv, group", [(2, 4), (1, 16)])
def test_gpu_warp_barriers_are_bit_identical(step, stages, hkv, group):
    # LaunchConfig.warp_barriers (forty-second session): the one-warp split programs' CTA barriers
    # as warp barriers order the same shared-memory accesses, so the output is the same bit for
    # bit, in the full and masked steps, at 1 and 2 ring stages, at 1 and 7 splits, for the tuned
    # step and the one with value_band2_half and token_sums_rows
    base = dataclasses.replace(TUNED_V3_PLAIN_STEP, num_stages=stages)
    if step == "half_and_rows":
        base = dataclasses.replace(base, value_band2_half=True, token_sums_rows=True)
    warp = dataclasses.replace(base, warp_barriers=True)
    codec, args = make_case(
        UNIFORM_REAL, 5, hkv, group, 1, 128, [4096, 1, 1000, 2049, 133], 4096, torch.bfloat16, "cuda", "full"
    )
    for splits in (1, 7):
        want = _run_triton(args, codec, 128**-0.5, config=base, num_splits=splits)
        got = _run_triton(args, codec, 128**-0.5, config=warp, num_splits=splits)
        assert torch.isfinite(got).all() and torch.equal(got, want), splits
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
def test_gpu_token_sums_rows_is_dropped_with_value_subnormals_on_long_splits():
    # one split of 9,000 tokens is past value_subnormals_max_split_tokens: the launch centres the
    # magic fields every step, which reads the step's sums in every row, so token_sums_rows goes off
    # with value_subnormals (bit-identical to the tuned config, which drops value_subnormals alone)
    tuned = K.TUNED_CONFIGS[(128, 4, "affine")]
    rows = dataclasses.replace(tuned, token_sums_rows=True)
    codec, args = make_case(UNIFORM_REAL, 2, 2, 4, 1, 128, [9000, 8500], 9000, torch.bfloat16, "cuda", "full")
    want = _run_triton(args, codec, 128**-0.5, config=tuned, num_splits=1)
    got = _run_triton(args, codec, 128**-0.5, config=rows, num_splits=1)
    assert torch.equal(got, want)
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2
    assert not K._V3_FAILURE, K._V3_FAILURE


@pytest.mark.gpu
def test_gpu_repeated_calls_reuse_compiled_kernels_and_stay_correct():
    # the second call of a shape launches the kept CompiledKernels (kernels/fast_launch.py): fresh
    # inputs of the same shapes and alignment must give results as correct as the first call's
    from wmoe_compile.kernels import fast_launch

    # 1 sequence x 8 kv heads = 8 programs: the small-launch config (v3, shorter splits), the
    # per-row reduce; 2 sequences: v3 with the exact-token kernel beside it
    for lens, kernels in (
        ([3000], (K._exact_kernel, K._merge_channel_rows_kernel)),  # no prologue: query_in_split
        ([3000, 1234], (K._exact_kernel, K._merge_channel_rows_kernel)),
    ):
        fast_launch.clear()
        for round_ in range(3):
            codec, args = make_case(
                UNIFORM_REAL, len(lens), 8, 4, 1, 128, lens, 3000, torch.bfloat16, "cuda", "full"
            )
            got = _run_triton(args, codec, 128**-0.5)
            assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2, (lens, round_)
        for kernel in kernels:
            assert fast_launch.kernel_info(kernel).compiled, (lens, kernel.fn.__name__)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [UNIFORM_REAL, "lloyd"])
def test_gpu_full_channel_params(spec):
    codec, args = make_case(
        spec, 2, 8, 4, 1, 128, [3000, 1234], 3000, torch.bfloat16, device="cuda", channel="full"
    )
    want = dense_reference(codec, args, 128**-0.5)
    for config in (K.LaunchConfig(), K.LaunchConfig(row_reduce_max_programs=1e9)):
        got = _run_triton(args, codec, 128**-0.5, config=config)
        assert rel_err(got, want) <= 1e-2, config
    got = torch.ops.wmoe.wavelet_attention(*args, codec.spec, 128**-0.5)
    assert rel_err(got, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("spec", OTHER_SPECS)
def test_gpu_other_layouts(spec):
    codec, args = make_case(spec, 2, 8, 4, 1, 128, [3000, 777], 3000, torch.float16, device="cuda")
    got = _run_triton(args, codec, 128**-0.5)
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tq", [4, 300])
@pytest.mark.parametrize("spec", [UNIFORM_REAL, "lloyd"])
def test_gpu_multi_token_and_prefill(tq, spec):
    codec, args = make_case(spec, 2, 8, 4, tq, 128, [2500, tq], 2600, torch.bfloat16, device="cuda")
    got = torch.ops.wmoe.wavelet_attention(*args, codec.spec, 128**-0.5)
    assert rel_err(got, dense_reference(codec, args, 128**-0.5)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [UNIFORM_REAL, "lloyd"])
def test_gpu_long_split_precision(spec):
    # The benchmark's worst case: random codes (every bit pattern is a valid code), diffuse
    # attention and one split of 32k tokens. The tensor cores' fp32 accumulation truncates: value
    # operands must be offset-free (v2: fp16 subnormals, or 1024-offset fields centred to small
    # exact integers; v1: centred too), or the error grows with the split length.
    codec = get_codec(spec, 128)
    layout = ops.compressed_layout(codec.spec, 128)
    n, hkv = 32768, 8
    shape = (1, hkv, n, layout.n_code_bytes)
    kc, vc = (torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda") for _ in range(2))
    ks, vs = ((torch.rand(1, hkv, n, 2, device="cuda") + 0.5).half() for _ in range(2))
    ke, ve = (torch.randn(1, hkv, layout.n_exact, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(1, 4 * hkv, 1, 128, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    cs = torch.rand(hkv, 128, device="cuda") + 0.5
    args = (q, kc, ks, vc, vs, ke, ve, lens, cs, cs)
    want = K.wavelet_attention_reference(*args, layout, 128**-0.5).double()
    # (config, split counts): the subnormal encoding leaves the grid offset in the value sums,
    # which cancel at the end; measured 1.0e-2 at one 32k-token split, so it is held to the
    # split lengths the launch policy produces (min_split_tokens: ~500 tokens here)
    cases = [
        (K.LaunchConfig(subnormal=False), (1, 64)),
        (K.LaunchConfig(kernel="v1"), (1, 64)),
        (K.LaunchConfig(subnormal=True), (64,)),
        (K.LaunchConfig(centre_in_mma=True), (1, 64)),
        (K.LaunchConfig(kernel="v1", centre_in_mma=True), (1, 64)),
        (K.LaunchConfig(kernel="v3", num_stages=2), (1, 64)),
        # v3's uncentred value sums, at its bound's split length (8,192 tokens) and below
        (SUBNORMAL_V3, (4, 64)),
        # and with the padding columns serving the 2-bit band (one split: the centred step)
        (dataclasses.replace(SUBNORMAL_V3, band_columns=True), (1, 4, 64)),
    ]
    for config, split_counts in cases if spec == UNIFORM_REAL else cases[1:2] + cases[4:5]:
        for splits in split_counts:
            got = K.wavelet_attention_triton(*args, layout, 128**-0.5, config=config, num_splits=splits)
            assert rel_err(got, want) <= 1e-2, (config, splits)


SUBNORMAL_V3 = dataclasses.replace(TUNED_V3_PLAIN_STEP, packed_p_scaling=True, value_subnormals=True)


@pytest.mark.gpu
def test_gpu_v3_value_subnormals_run_the_centred_step_past_their_bound():
    # value_subnormals leave the centring to the store, whose uncentred sums lose precision with the
    # split's length: a launch with longer splits than value_subnormals_max_split_tokens must run the
    # centred step (bit for bit the config without the option), a shorter one the subnormal step
    lens = [32768, 20000]
    codec, args = make_case(UNIFORM_REAL, 2, 2, 4, 1, 128, lens, 32768, torch.bfloat16, "cuda", "full")
    want = dense_reference(codec, args, 128**-0.5)
    centred = dataclasses.replace(SUBNORMAL_V3, value_subnormals=False)
    for splits, active in ((1, False), (3, False), (4, True), (64, True)):
        got = _run_triton(args, codec, 128**-0.5, config=SUBNORMAL_V3, num_splits=splits)
        same = _run_triton(args, codec, 128**-0.5, config=centred, num_splits=splits)
        assert rel_err(got, want) <= 1e-2, splits
        assert torch.equal(got, same) is not active, splits
    assert not K._V3_FAILURE, K._V3_FAILURE


def test_prologue_warps_reach_the_prologue_launch(monkeypatch):
    # LaunchConfig.prologue_warps is the prologue's num_warps (the interpreter runs any count the
    # same way: the GPU test compares the results)
    codec, args = make_case("default;window=8;sinks=2", 3, 2, 4, 1, 64, [1, 41, 70], 70, torch.float16)
    launched = []
    real_launch = K.launch

    def recording_launch(kernel, *a, **kw):
        launched.append((kernel, kw.get("num_warps")))
        real_launch(kernel, *a, **kw)

    monkeypatch.setattr(K, "launch", recording_launch)
    got = _run_triton(
        args, codec, 64**-0.5, config=K.LaunchConfig(block_n=16, prologue_warps=2), num_splits=3
    )
    assert (K._prologue_kernel, 2) in launched, launched
    assert rel_err(got, dense_reference(codec, args, 64**-0.5)) <= 1e-2


def test_prologue_tile_rows_and_precision_reach_the_heads_prologue(monkeypatch):
    # LaunchConfig.prologue_tile_rows sets _prologue_heads_kernel's grid and ROWS (5 sequences x
    # 4-row blocks: two tiles of 16 rows, one of 32), prologue_precision its dot's precision
    codec, args = make_case("default;window=8;sinks=2", 5, 2, 4, 1, 64, [1, 41, 70, 9, 33], 70, torch.float16)
    monkeypatch.setattr(K, "PROLOGUE_HEADS_MIN_ROWS", 0)
    real_launch = K.launch
    launched = []

    def recording_launch(kernel, grid, *a, **kw):
        launched.append((kernel, grid, kw.get("ROWS"), kw.get("PRECISION")))
        real_launch(kernel, grid, *a, **kw)

    monkeypatch.setattr(K, "launch", recording_launch)
    for rows, tiles in [(16, 2), (32, 1)]:
        launched.clear()
        config = K.LaunchConfig(block_n=16, prologue_tile_rows=rows, prologue_precision="ieee")
        got = _run_triton(args, codec, 64**-0.5, config=config, num_splits=3)
        heads = [entry for entry in launched if entry[0] is K._prologue_heads_kernel]
        assert len(heads) == 1 and heads[0][2:] == (rows, "ieee"), launched
        assert heads[0][1][:2] == (2, tiles), heads
        assert rel_err(got, dense_reference(codec, args, 64**-0.5)) <= 1e-2


@pytest.mark.parametrize("group,tq", [(4, 1), (2, 1), (2, 2)])
def test_prologue_by_kv_head_equals_the_per_sequence_prologue(monkeypatch, group, tq):
    # decode launches with many sequences transform the query rows of all sequences that share a kv
    # head in one dot (_prologue_heads_kernel); tiles of 16 rows here, so 5 sequences x 4-row
    # blocks end in a partial tile, and group x tq < 4 leaves padding rows in every block
    lengths = [tq, 41, 70, 9, 33]
    codec, args = make_case("default;window=8;sinks=2", 5, 2, group, tq, 64, lengths, 70, torch.float16)
    sm_scale = 64**-0.5
    config = K.LaunchConfig(block_n=16, prologue_tile_rows=16)
    monkeypatch.setattr(K, "PROLOGUE_HEADS_MIN_ROWS", 10**9)
    per_sequence = _run_triton(args, codec, sm_scale, config=config, num_splits=3)
    monkeypatch.setattr(K, "PROLOGUE_HEADS_MIN_ROWS", 0)
    launched = []
    real_launch = K.launch

    def recording_launch(kernel, *a, **kw):
        launched.append(kernel)
        real_launch(kernel, *a, **kw)

    monkeypatch.setattr(K, "launch", recording_launch)
    by_head = _run_triton(args, codec, sm_scale, config=config, num_splits=3)
    assert K._prologue_heads_kernel in launched and K._prologue_kernel not in launched
    assert rel_err(by_head, per_sequence.double()) <= 1e-5
    assert rel_err(by_head, dense_reference(codec, args, sm_scale)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [UNIFORM_REAL, "lloyd"])
def test_gpu_kv_head_prologue_equals_the_per_sequence_prologue(monkeypatch, spec):
    # 17 sequences x 4 rows: _prologue_heads_kernel runs (64+ rows) with a partial second tile,
    # for the tuned v3 launch (uniform grids) and v1 (Lloyd grids)
    capacity = 1024
    seq_lens = [1, 1024, 700, 129, 1000, 64, 65, 900, 333, 2, 1023, 512, 511, 800, 131, 132, 1024]
    codec, args = make_case(spec, 17, 8, 4, 1, 128, seq_lens, capacity, torch.bfloat16, device="cuda")
    sm_scale = 128**-0.5
    assert K.PROLOGUE_HEADS_MIN_ROWS <= 17 * 4
    # the tuned v3 launch transforms the query in its split kernel (one wave): here the prologue does
    key = (128, 4, "affine")
    monkeypatch.setitem(K.TUNED_CONFIGS, key, dataclasses.replace(K.TUNED_CONFIGS[key], query_in_split=False))
    by_head = _run_triton(args, codec, sm_scale)
    monkeypatch.setattr(K, "PROLOGUE_HEADS_MIN_ROWS", 10**9)
    per_sequence = _run_triton(args, codec, sm_scale)
    # bf16 outputs: a query rounded one ulp apart may flip a few of them
    assert rel_err(by_head, per_sequence.double()) <= 1e-3
    assert rel_err(by_head, dense_reference(codec, args, sm_scale)) <= 1e-2
