"""The pass manager, transform / export / prepare on the reference model, end to end.

The ops run their PyTorch reference implementations here (TRITON_INTERPRET=0 for these tests):
what is under test is the rewriting, not the kernels, which their own tests cover under the
Triton interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch
from wmoe_compile.passes import _context, find_sites, replace_moe_dispatch, swap_wavelet_attention

import wmoe_compile as wc
from wmoe_compile.codec import WaveletKVCodec
from wmoe_compile.models import build_model
from wmoe_compile.pipeline import PassVerificationError, example_inputs_for, run_passes

BATCH, CAPACITY, PROMPT = 2, 24, 6


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def attention_op_registered() -> bool:
    import wmoe_compile.ops  # noqa: F401

    return _context.op_available("wavelet_attention")


def fresh_model(layers: int = 2):
    model = build_model("tiny", num_layers=layers, seed=int(torch.randint(0, 2**31, ())))
    model.setup_cache(BATCH, CAPACITY)
    return model


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any(), "NaN in the rewritten graph's output"
    return float((got.double() - want.double()).norm() / want.double().norm())


def op_targets(program) -> set[str]:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


def decode_steps(program_module, model, tokens: torch.Tensor):
    """Feed tokens [B, N] one step at a time through both; yield (rewritten, original) logits."""
    for t in range(tokens.shape[1]):
        step = tokens[:, t : t + 1]
        positions = torch.tensor([t])
        with torch.no_grad():
            yield program_module(step, positions), model(step, positions)


@pytest.fixture(scope="module")
def default_export():
    """The reference model (2 layers) exported with every rewrite on; shared by tests that only read it."""
    model = fresh_model()
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    config = wc.CompileConfig(codec="default;window=8;sinks=2")
    return model, config, wc.export(model, args, config=config)


def test_export_rewrites_reference_model_and_allocates_compressed_cache(default_export):
    model, config, program = default_export
    report = program.wmoe_report
    counts = report.counts()
    assert counts["kv_write"] == {"rewritten": 4} and counts["moe"] == {"rewritten": 2}
    if attention_op_registered():
        assert counts["attention"] == {"rewritten": 2}
    else:
        assert all(
            s.reason == "op not registered (wmoe::wavelet_attention)" for s in report.skipped("attention")
        )
    targets = op_targets(program)
    assert "wmoe.tiled_moe.default" in targets and "aten.index_copy_.default" not in targets
    assert any("kv_compress_into_cache" in t for t in targets)
    # The dense caches and the per-expert weights are gone; the compressed cache is at compressed size.
    state = dict(program.named_buffers()) | dict(program.constants) | dict(program.state_dict)
    assert not any(name.endswith(("k_cache", "v_cache")) for name in state)
    assert not any("experts" in name for name in state)
    codec = WaveletKVCodec(config.codec, model.cfg.head_dim)
    codes = state["layers.0.attn.k_cache_codes"]
    scales = state["layers.0.attn.k_cache_scales"]
    exact = state["layers.0.attn.k_cache_exact"]
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float16
    assert codes.shape == (BATCH, model.cfg.num_kv_heads, CAPACITY, codec.n_code_bytes)
    assert codes.nbytes + scales.nbytes == BATCH * model.cfg.num_kv_heads * CAPACITY * codec.bytes_per_vector
    assert exact.shape == (BATCH, model.cfg.num_kv_heads, 2 + 8, model.cfg.head_dim)


def test_bypass_codec_matches_original_within_fp32_rounding_over_decode_steps():
    model = fresh_model(layers=1)
    args = (torch.randint(1, model.cfg.vocab_size, (BATCH, 1)), torch.tensor([0]))
    program = wc.export(model, args, config=wc.CompileConfig(bypass_codec=True, check_numerics=True))
    report = program.wmoe_report
    assert report.numerics["relative_error"] <= report.numerics["bound"]
    assert len(report.rewritten()) == len(report.sites)  # every site rewritten, none skipped
    model.setup_cache(BATCH, CAPACITY)  # fresh dense cache for the original
    module = program.module()
    tokens = torch.randint(1, model.cfg.vocab_size, (BATCH, 6))
    for got, want in decode_steps(module, model, tokens):
        assert relative_error(got, want) < 1e-5


def test_compressed_numerics_stay_within_the_codec_bound():
    model = fresh_model()
    args, _ = example_inputs_for(model, BATCH, 12)
    config = wc.CompileConfig(codec="default;window=0;sinks=0", check_numerics=True)
    program = wc.export(model, args, config=config)
    report = program.wmoe_report
    errors = [
        float(s.reason.split("measured relative error ")[1].split()[0]) for s in report.rewritten("kv_write")
    ]
    assert len(errors) == 4 and all(0 < e < 1 for e in errors)
    # Bound derived from the codec's measured error (see CompileConfig.codec_error_gain).
    bound = config.codec_error_gain * max(errors) * math.sqrt(2)
    assert 0 < report.numerics["relative_error"] <= report.numerics["bound"]
    # Fresh inputs of the same shape, both graphs from an empty cache.
    tokens = torch.randint(1, model.cfg.vocab_size, (BATCH, 12))
    model.setup_cache(BATCH, CAPACITY)
    with torch.no_grad():
        got, want = program.module()(tokens, torch.arange(12)), model(tokens, torch.arange(12))
    err = relative_error(got, want)
    assert 0 < err <= bound, (err, bound)


def test_pt2_save_and_load_round_trip(tmp_path, default_export):
    model, _, program = default_export
    path = tmp_path / "rewritten.pt2"
    torch.export.save(program, path)
    loaded = torch.export.load(path)
    assert op_targets(loaded) == op_targets(program)
    tokens = torch.randint(1, model.cfg.vocab_size, (BATCH, PROMPT))
    with torch.no_grad():  # both start from their saved (empty) compressed cache
        a = loaded.module()(tokens, torch.arange(PROMPT))
        b = program.module()(tokens, torch.arange(PROMPT))
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_switches_skip_each_rewrite_with_the_reason():
    model = fresh_model(layers=1)
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    config = wc.CompileConfig(compress_kv=False, swap_attention=False, replace_moe=False, fuse_linears=False)
    program = wc.export(model, args, config=config)
    reasons = {(s.kind, s.reason) for s in program.wmoe_report.sites}
    assert reasons == {
        ("kv_write", "compress_kv=False"),
        ("attention", "swap_attention=False"),
        ("moe", "replace_moe=False"),
    }
    assert not any(t.startswith("wmoe.") for t in op_targets(program))
    model.setup_cache(BATCH, CAPACITY)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*args), model(*args), rtol=0, atol=0)


def test_missing_op_keeps_the_site_with_reason(monkeypatch):
    monkeypatch.setattr(replace_moe_dispatch, "op_available", lambda name: False)
    model = fresh_model(layers=1)
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    program = wc.export(model, args, config=wc.CompileConfig(compress_kv=False))
    (moe,) = program.wmoe_report.skipped("moe")
    assert moe.reason == "op not registered (wmoe::tiled_moe)"
    assert "wmoe.tiled_moe.default" not in op_targets(program)


def test_transform_on_a_graph_module_leaves_the_input_unchanged():
    model = fresh_model(layers=1)
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    gm = torch.export.export(model, args).module()
    code_before = gm.code
    rewritten, report = wc.transform(gm, wc.CompileConfig(bypass_codec=True), example_inputs=args)
    assert gm.code == code_before and rewritten.code != code_before
    assert report.rewritten("moe") and report.rewritten("kv_write")
    with torch.no_grad():
        model.setup_cache(BATCH, CAPACITY)
        torch.testing.assert_close(rewritten(*args), model(*args), rtol=1e-5, atol=1e-5)


def test_prepare_makes_routed_dispatch_capturable():
    model = fresh_model(layers=1)
    for layer in model.layers:
        layer.moe.dispatch = "routed"
    prepared = wc.prepare(model, batch_size=1, max_cache_len=16)
    assert prepared is model and all(layer.moe.dispatch == "dense" for layer in model.layers)
    assert model.cache_capacity == 16


def _broken_shape_pass():
    """A pass that inserts a shape-invalid node at the first attention site."""

    class Broken:
        NAME = "broken_shapes"

        @staticmethod
        def run(ctx):
            site = ctx.sites.attention[0]
            graph = ctx.gm.graph
            with graph.inserting_after(site.node):
                _context.tag(
                    graph.call_function(torch.ops.aten.mm.default, (site.node, site.node)), site.report
                )
            return _context.PassResult(changed=True)

    return Broken


def _broken_numeric_pass():
    """A pass that doubles the first MoE site's output (shapes fine, numbers wrong)."""

    class Broken:
        NAME = "broken_numbers"

        @staticmethod
        def run(ctx):
            site = ctx.sites.moe[0]
            graph = ctx.gm.graph
            with graph.inserting_after(site.output):
                doubled = graph.call_function(torch.ops.aten.mul.Tensor, (site.output, 2.0))
            site.output.replace_all_uses_with(doubled)
            doubled.update_arg(0, site.output)
            _context.tag(doubled, site.report)
            return _context.PassResult(changed=True)

    return Broken


def test_shape_failure_names_the_pass_and_the_site():
    model = fresh_model(layers=1)
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    gm = torch.export.export(model, args).module()
    with pytest.raises(PassVerificationError, match="broken_shapes") as info:
        run_passes(gm, wc.CompileConfig(), passes=(find_sites, _broken_shape_pass()))
    assert info.value.check == "fake-tensor shape propagation"
    assert info.value.site.startswith("layer 0 attention sdpa (layers.0.attn)")


def test_numeric_failure_names_the_pass_and_the_site():
    model = fresh_model(layers=1)
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    gm = torch.export.export(model, args).module()
    config = wc.CompileConfig(check_numerics=True)
    with pytest.raises(PassVerificationError, match="broken_numbers") as info:
        run_passes(gm, config, example_inputs=(args, {}), passes=(find_sites, _broken_numeric_pass()))
    assert info.value.check == "numeric check"
    assert info.value.site.startswith("layer 0 moe") and "layers.0.moe" in info.value.site


def test_swap_pass_reports_uncompressed_caches():
    model = fresh_model(layers=1)
    args, _ = example_inputs_for(model, BATCH, PROMPT)
    gm = torch.export.export(model, args).module()
    report = run_passes(gm, wc.CompileConfig(compress_kv=False), passes=(find_sites, swap_wavelet_attention))
    (attention,) = [s for s in report.sites if s.kind == "attention"]
    assert attention.status == "skipped" and "not compressed (compress_kv=False)" in attention.reason


def test_config_validates_its_fields():
    with pytest.raises(ValueError, match="unknown codec preset"):
        wc.CompileConfig(codec="nonsense")
    with pytest.raises(TypeError, match="compress_kv must be True or False"):
        wc.CompileConfig(compress_kv="yes")
    with pytest.raises(ValueError, match="MoE layout"):
        wc.CompileConfig(moe={"layout": "diagonal"})
    assert wc.CompileConfig(codec="default;window=4").codec.window == 4


def test_transform_rejects_non_graphs():
    with pytest.raises(TypeError, match="wmoe_compile.export"):
        wc.transform(torch.nn.Linear(2, 2))
