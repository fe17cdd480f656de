"""The rewrite passes on small hand-built graphs (the modules from test_passes_find_sites):
what each rewrites, what it leaves alone, and that outputs it must not touch stay bit-identical."""

from __future__ import annotations

import pytest
import torch
from test_passes_find_sites import HKV, CachedAttention, S, StackedMoE, attention_inputs, capture

import wmoe_compile as wc
from wmoe_compile.codec import WaveletKVCodec


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the rewriting is under test, not the kernels


def transform_module(module, config, inputs):
    gm = capture(module, *inputs)
    rewritten, report = wc.transform(gm, config, example_inputs=inputs)
    return gm, rewritten, report


def run_fresh(gm, inputs):
    """Run from empty caches (every buffer that holds cache state zeroed), restoring nothing."""
    for name, buffer in gm.named_buffers():
        if "cache" in name and "channel_scale" not in name:
            buffer.zero_()
    with torch.no_grad():
        return gm(*inputs)


def targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_plain_attention_bypass_is_exact_and_dense_cache_is_deleted():
    inputs = attention_inputs("plain")
    gm, rewritten, report = transform_module(
        CachedAttention("plain"), wc.CompileConfig(bypass_codec=True), inputs
    )
    assert {s.status for s in report.sites} == {"rewritten"}
    assert "wmoe.wavelet_attention.default" in targets(rewritten)
    assert "aten.scaled_dot_product_attention.default" not in targets(rewritten)
    names = dict(rewritten.named_buffers())
    assert "k_cache" not in names and "v_cache" not in names  # cleanup deleted the dense caches
    torch.testing.assert_close(run_fresh(rewritten, inputs), run_fresh(gm, inputs), rtol=1e-5, atol=1e-6)


def test_compressed_cache_buffers_have_compressed_size():
    inputs = attention_inputs("plain")
    config = wc.CompileConfig(codec="default;window=4;sinks=1")
    _, rewritten, _ = transform_module(CachedAttention("plain"), config, inputs)
    codec = WaveletKVCodec(config.codec, 16)
    buffers = dict(rewritten.named_buffers())
    for role in ("k", "v"):
        codes, scales = buffers[f"{role}_cache_codes"], buffers[f"{role}_cache_scales"]
        assert codes.shape[:3] == scales.shape[:3] == (2, HKV, S)
        assert codes[0, 0, 0].nbytes + scales[0, 0, 0].nbytes == codec.bytes_per_vector
        assert buffers[f"{role}_cache_exact"].shape[2] == 1 + 4


def test_second_consumer_of_the_k_projection_keeps_exact_values():
    inputs = attention_inputs("proj_reader")
    config = wc.CompileConfig(codec="default;window=0;sinks=0")
    gm, rewritten, report = transform_module(CachedAttention("proj_reader"), config, inputs)
    assert {s.status for s in report.sites} == {"rewritten"}
    (out_new, proj_new), (out_old, proj_old) = run_fresh(rewritten, inputs), run_fresh(gm, inputs)
    assert torch.equal(proj_new, proj_old)  # the other reader of k_proj still gets exact K
    assert not torch.equal(out_new, out_old)  # while attention reads the (lossy) compressed cache


def test_second_reader_of_the_cache_keeps_that_cache_dense():
    inputs = attention_inputs("cache_reader")
    gm, rewritten, report = transform_module(CachedAttention("cache_reader"), wc.CompileConfig(), inputs)
    by_detail = {s.detail: s for s in report.sites}
    assert by_detail["K static cache"].status == "skipped"
    assert by_detail["V static cache"].status == "rewritten"  # V has no other reader
    assert by_detail["sdpa"].status == "skipped"
    assert "k_cache" in dict(rewritten.named_buffers())
    (_, k_sum_new), (_, k_sum_old) = run_fresh(rewritten, inputs), run_fresh(gm, inputs)
    assert torch.equal(k_sum_new, k_sum_old)


@pytest.mark.parametrize("variant", ["bshd", "mask_input"])
def test_patterns_not_understood_are_left_as_they_were(variant):
    inputs = attention_inputs(variant)
    config = wc.CompileConfig(compress_kv=True)
    gm, rewritten, report = transform_module(CachedAttention(variant), config, inputs)
    attention = [s for s in report.sites if s.kind == "attention"]
    assert attention and all(s.status == "skipped" and s.reason for s in attention)
    assert "wmoe.wavelet_attention.default" not in targets(rewritten)
    out_new, out_old = run_fresh(rewritten, inputs), run_fresh(gm, inputs)
    if variant == "bshd":  # nothing understood: graph unchanged
        torch.testing.assert_close(out_new, out_old, rtol=0, atol=0)


def test_eager_attention_is_swapped():
    inputs = attention_inputs("eager")
    gm, rewritten, report = transform_module(
        CachedAttention("eager"), wc.CompileConfig(bypass_codec=True), inputs
    )
    (attention,) = [s for s in report.sites if s.kind == "attention"]
    assert attention.status == "rewritten" and attention.detail == "eager"
    assert "aten.softmax.int" not in targets(rewritten)
    torch.testing.assert_close(run_fresh(rewritten, inputs), run_fresh(gm, inputs), rtol=1e-5, atol=1e-6)


def test_sliding_window_attention_is_swapped_where_the_exact_ring_holds_it():
    # a window of 4 < the cache's 16 slots: the op takes window=4 and reads the exact ring (bypassed
    # here: exact); a codec keeping only 2 exact recent tokens cannot serve it, so the attention
    # stays on the decompressed cache with the reason
    inputs = attention_inputs("window")
    gm, rewritten, report = transform_module(
        CachedAttention("window"), wc.CompileConfig(bypass_codec=True), inputs
    )
    (attention,) = [s for s in report.sites if s.kind == "attention"]
    assert attention.status == "rewritten" and "sliding window of 4 over the exact ring" in attention.reason
    (call,) = [n for n in rewritten.graph.nodes if n.target is torch.ops.wmoe.wavelet_attention.default]
    assert call.args[12:] == (None, 4)
    torch.testing.assert_close(run_fresh(rewritten, inputs), run_fresh(gm, inputs), rtol=1e-5, atol=1e-6)
    config = wc.CompileConfig(codec="default;window=2;sinks=1")
    _, narrow, report = transform_module(CachedAttention("window"), config, inputs)
    (attention,) = [s for s in report.sites if s.kind == "attention"]
    assert attention.status == "skipped"
    assert "a window of 4 tokens, longer than the codec's exact window of 2" in attention.reason
    assert "wmoe.wavelet_attention.default" not in targets(narrow)


def test_eager_attention_with_learned_sinks_is_swapped_with_them():
    # gpt-oss's sink logits go to the op as its `sinks`: bypassed, the rewrite is exact, and the
    # sinks are large enough here that dropping them would change the output
    inputs = attention_inputs("sinks")
    module = CachedAttention("sinks")
    with torch.no_grad():
        module.sinks.copy_(torch.randn(module.sinks.shape) * 2 + 2)
    gm, rewritten, report = transform_module(module, wc.CompileConfig(bypass_codec=True), inputs)
    (attention,) = [s for s in report.sites if s.kind == "attention"]
    assert attention.status == "rewritten" and "learned sink logits" in attention.reason
    (call,) = [n for n in rewritten.graph.nodes if n.target is torch.ops.wmoe.wavelet_attention.default]
    assert len(call.args) == 13 and "sinks" in str(call.args[12].target)
    want = run_fresh(gm, inputs)
    torch.testing.assert_close(run_fresh(rewritten, inputs), want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        module.sinks.fill_(-1.0e4)  # (the rewritten module holds the same parameter)
    assert not torch.allclose(run_fresh(gm, inputs), want, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("transposed", [False, True])
def test_stacked_moe_is_replaced_and_its_weights_dropped(transposed):
    module = StackedMoE(transposed=transposed)
    inputs = (torch.randn(2, 3, 32),)
    gm, rewritten, report = transform_module(module, wc.CompileConfig(), inputs)
    (moe,) = report.sites
    assert moe.status == "rewritten"
    assert targets(rewritten).count("wmoe.tiled_moe.default") == 1
    assert "aten.bmm.default" not in targets(rewritten)
    params = dict(rewritten.named_parameters())
    assert "gate_up_proj" not in params and "down_proj" not in params
    torch.testing.assert_close(run_fresh(rewritten, inputs), run_fresh(gm, inputs), rtol=1e-5, atol=1e-5)


def test_moe_that_does_not_verify_is_left_unchanged():
    module = StackedMoE(act="gelu")
    inputs = (torch.randn(2, 3, 32),)
    # decompose_topk off: it would rewrite the router's top-k (exactly) even so
    gm, rewritten, report = transform_module(module, wc.CompileConfig(decompose_topk=False), inputs)
    (moe,) = report.sites
    assert moe.status == "skipped"
    assert targets(rewritten) == targets(gm)
    torch.testing.assert_close(run_fresh(rewritten, inputs), run_fresh(gm, inputs), rtol=0, atol=0)
