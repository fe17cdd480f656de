"""Channel parameters in rewritten graphs (passes/_channel_params.py) and fake-mode verification.

The default codec needs per-(layer, kv head) offsets and a PCA rotation. The passes calibrate
them on the calibration / example inputs (keys RoPE-aware), take precomputed ones from
CompileConfig.channel_params, or fall back to the codec without them, loudly. Ops run their
PyTorch references here (TRITON_INTERPRET=0): the rewriting is under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from wmoe_compile.passes import _channel_params

import wmoe_compile as wc
from wmoe_compile import codec as codec_mod
from wmoe_compile.pipeline import _FakeProp, _verify, example_inputs_for, tiny_hf_model

pytest.importorskip("transformers")

BATCH, CAPACITY, PROMPT = 2, 32, 16
CODEC = "default;window=4;sinks=2"


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def wrapped_llama(layers: int = 2):
    model = tiny_hf_model("llama", num_layers=layers, seed=int(torch.randint(0, 2**31, ())))
    return wc.prepare(model, batch_size=BATCH, max_cache_len=CAPACITY)


def program_tensors(program) -> dict[str, torch.Tensor]:
    return dict(program.named_buffers()) | dict(program.constants)


def dense_kv_after(wrapped, args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE keys and values [B, Hkv, T, D] per layer, read back from the original model's
    StaticCache after a prefill from an empty cache (independent of the passes' recording)."""
    for name, buffer in wrapped.named_buffers(recurse=False):
        if name.startswith(("key_cache_", "value_cache_")):
            buffer.zero_()
    with torch.no_grad():
        wrapped(*args)
    tokens = args[0].shape[1]
    layers = len([n for n, _ in wrapped.named_buffers(recurse=False) if n.startswith("key_cache_")])
    return [
        (
            getattr(wrapped, f"key_cache_{i}")[:, :, :tokens].clone(),
            getattr(wrapped, f"value_cache_{i}")[:, :, :tokens].clone(),
        )
        for i in range(layers)
    ]


def test_default_codec_gets_calibrated_offsets_and_rotations_rope_aware():
    wrapped = wrapped_llama()
    args, _ = example_inputs_for(wrapped, tokens=PROMPT)
    config = wc.CompileConfig(codec=CODEC)
    program = wc.export(wrapped, args, config=config)
    report = program.wmoe_report
    assert report.counts()["kv_write"] == {"rewritten": 4} and report.counts()["attention"] == {
        "rewritten": 2
    }
    tensors = program_tensors(program)
    expected_config = config.codec
    head_dim = wrapped.model.config.head_dim
    theta = codec_mod.rope_theta_per_pair(head_dim, wrapped.model.config.rope_parameters["rope_theta"])
    for layer, (keys, values) in enumerate(dense_kv_after(wrapped, args)):
        rope = codec_mod.RopeSpec(theta, torch.arange(PROMPT), CAPACITY)
        want_k = codec_mod.calibrate_channel_params(expected_config, "k", keys, rope=rope)
        want_v = codec_mod.calibrate_channel_params(expected_config, "v", values)
        got_k = tensors[f"key_cache_{layer}_channel_scale"]
        got_v = tensors[f"value_cache_{layer}_channel_scale"]
        assert got_k.shape == (2, head_dim + 2, head_dim)  # rotation, scale, offset
        torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_v, want_v, rtol=1e-4, atol=1e-4)
        rotation = got_k[:, :head_dim]
        eye = torch.eye(head_dim).expand_as(rotation)
        torch.testing.assert_close(rotation @ rotation.transpose(1, 2), eye, atol=1e-4, rtol=0)
        assert got_k[:, head_dim + 1].abs().sum() > 0  # offsets calibrated, not zero
    for site in report.rewritten("kv_write"):
        assert "calibrated on 28 vectors from the example inputs" in site.reason, site.reason
        assert "k_offset=calibrated" in site.nodes["codec"] and "rotation=pca" in site.nodes["codec"]
        if site.detail.startswith("K"):
            assert "RoPE base 10000" in site.reason


def test_rope_frequencies_are_measured_on_a_graph_without_model_config():
    wrapped = wrapped_llama(layers=1)
    args, _ = example_inputs_for(wrapped, tokens=PROMPT)
    gm = torch.export.export(wrapped, args).module()
    _, measured = wc.transform(gm, wc.CompileConfig(codec=CODEC), example_inputs=args)
    rewritten, given = wc.transform(
        gm, wc.CompileConfig(codec=CODEC, rope_theta=10000.0), example_inputs=args
    )
    (k_site,) = [s for s in measured.rewritten("kv_write") if s.detail.startswith("K")]
    assert "RoPE frequencies measured on the graph" in k_site.reason
    # The same statistics as with the base given explicitly.
    gm_measured, _ = wc.transform(gm, wc.CompileConfig(codec=CODEC), example_inputs=args)
    torch.testing.assert_close(
        gm_measured.key_cache_0_channel_scale, rewritten.key_cache_0_channel_scale, atol=1e-4, rtol=1e-4
    )


def test_measure_rope_recovers_frequencies_and_refuses_other_maps():
    head_dim, positions = 16, torch.arange(10)
    theta = codec_mod.rope_theta_per_pair(head_dim, 500.0).float()
    pre = torch.randn(2, 3, 10, head_dim)
    angles = torch.cat([theta, theta]) * positions[:, None]
    rotated = torch.cat([-pre[..., head_dim // 2 :], pre[..., : head_dim // 2]], dim=-1)
    post = pre * angles.cos() + rotated * angles.sin()
    got, why = _channel_params.measure_rope(pre, post, positions)
    assert why == "" and torch.allclose(got.float(), theta, atol=1e-5)
    refused, why = _channel_params.measure_rope(pre, post * 1.5 + 0.1, positions)
    assert refused is None and "not recognised" in why
    refused, why = _channel_params.measure_rope(pre, post, positions + 5)
    assert refused is None and "position 1" in why


def test_precomputed_channel_params_are_used_as_given():
    wrapped = wrapped_llama()
    head_dim, heads = 16, 2
    given = {}
    for layer in range(2):
        rotation = torch.linalg.qr(torch.randn(heads, head_dim, head_dim))[0]
        given[layer] = {
            kind: codec_mod.pack_channel_params(
                head_dim, heads, offset=torch.randn(heads, head_dim), rotation=rotation
            )
            for kind in "kv"
        }
    args, _ = example_inputs_for(wrapped, tokens=3)  # too short to calibrate: must not be needed
    program = wc.export(wrapped, args, config=wc.CompileConfig(codec=CODEC, channel_params=given))
    tensors = program_tensors(program)
    for layer in range(2):
        assert torch.equal(tensors[f"key_cache_{layer}_channel_scale"], given[layer]["k"])
        assert torch.equal(tensors[f"value_cache_{layer}_channel_scale"], given[layer]["v"])
    assert all("channel params given" in s.reason for s in program.wmoe_report.rewritten("kv_write"))
    with pytest.raises(ValueError, match="both caches of the layer"):
        wc.CompileConfig(channel_params={0: {"k": given[0]["k"]}})
    bad = {0: {"k": torch.ones(3, 5), "v": torch.ones(3, 5)}, 1: given[1]}
    with pytest.raises(ValueError, match="layer 0 K: shape"):
        wc.export(wrapped, args, config=wc.CompileConfig(codec=CODEC, channel_params=bad))


def test_separate_calibration_inputs_are_used():
    wrapped = wrapped_llama(layers=1)
    args, _ = example_inputs_for(wrapped, tokens=PROMPT)
    calibration, _ = example_inputs_for(wrapped, tokens=PROMPT)
    config = wc.CompileConfig(codec=CODEC, calibration_inputs=calibration)
    program = wc.export(wrapped, args, config=config)
    site = program.wmoe_report.rewritten("kv_write")[1]  # V: no RoPE involved
    assert "from calibration_inputs" in site.reason
    ((keys, values),) = dense_kv_after(wrapped, calibration)
    want = codec_mod.calibrate_channel_params(config.codec, "v", values)
    torch.testing.assert_close(
        program_tensors(program)["value_cache_0_channel_scale"], want, atol=1e-4, rtol=1e-4
    )


def test_fallback_without_enough_samples_is_reported_and_warned():
    wrapped = wrapped_llama(layers=1)
    args, _ = example_inputs_for(wrapped, tokens=3)  # 2 x (3 - 2 sinks) = 2 vectors < 8
    with pytest.warns(UserWarning, match="channel parameters missing for layer"):
        program = wc.export(wrapped, args, config=wc.CompileConfig(codec=CODEC))
    report = program.wmoe_report
    for site in report.rewritten("kv_write"):
        assert "FALLBACK" in site.reason and "only 2 vectors" in site.reason
        assert "k_offset=none" in site.nodes["codec"] and "rotation=none" in site.nodes["codec"]
    assert report.counts()["attention"] == {"rewritten": 1}  # K and V still share one spec
    insert = next(p for p in report.passes if p.name == "insert_dwt_quantize")
    assert any("channel parameters missing" in note for note in insert.notes)


def test_wavelet_attention_fake_impl_reads_no_tensor_values():
    # Issue 5: a spec seen for the first time under fake tracing must not build lookup tables
    # (which read values with tolist()); the fake impl needs shapes only.
    from torch._subclasses.fake_tensor import FakeTensorMode

    import wmoe_compile.ops  # noqa: F401
    from wmoe_compile.ops import attention as attention_op

    window = int(torch.randint(1000, 10**6, ()))  # a spec no other test has used
    spec = wc.WaveletKVConfig.from_spec(f"default;window={window};sinks=1").to_spec()
    d, hkv, capacity = 16, 2, 8
    n_bytes = codec_mod.codec_layout(spec, d).n_code_bytes
    layouts_before = attention_op.compressed_layout.cache_info()
    codecs_before = codec_mod.get_codec.cache_info()
    with FakeTensorMode():
        out = torch.ops.wmoe.wavelet_attention(
            torch.empty(1, 4, 1, d),
            torch.empty(1, hkv, capacity, n_bytes, dtype=torch.uint8),
            torch.empty(1, hkv, capacity, 2, dtype=torch.float16),
            torch.empty(1, hkv, capacity, n_bytes, dtype=torch.uint8),
            torch.empty(1, hkv, capacity, 2, dtype=torch.float16),
            torch.empty(1, hkv, window + 1, d),
            torch.empty(1, hkv, window + 1, d),
            torch.empty(1, dtype=torch.int64),
            torch.empty(0),
            torch.empty(hkv, d + 2, d),
            spec,
            0.25,
        )
    assert tuple(out.shape) == (1, 4, 1, d)
    # no codec and no kernel layout (both build lookup tables from tensor values) for the fake call
    assert attention_op.compressed_layout.cache_info() == layouts_before
    assert codec_mod.get_codec.cache_info() == codecs_before
    # the ones cached for the empty channel argument are real tensors
    from wmoe_compile.kernels import attention_layout

    assert all(type(t) is torch.Tensor for t in attention_layout._ONES.values())


def test_fake_propagation_converts_module_state_and_leaves_it_untouched():
    class Writer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.randn(4, 3))
            self.weight = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x, index):
            self.cache.index_copy_(0, index, x @ self.weight)
            return self.cache.sum(0)

    module = Writer()
    args = (torch.randn(2, 3), torch.tensor([0, 2]))
    gm = torch.export.export(module, args).module()
    before = {name: t.clone() for name, t in gm.named_buffers()}
    _verify(gm, "probe")  # lint + fake propagation
    for name, t in gm.named_buffers():
        assert torch.equal(t, before[name]), f"fake propagation wrote real buffer {name}"
    # Every module tensor a get_attr reads enters the fake mode; no real tensor reaches an op.
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode()
    prop = _FakeProp(gm, mode)
    seen = {}
    original = prop.fetch_attr

    def spy(target):
        seen[target] = original(target)
        return seen[target]

    prop.fetch_attr = spy
    with mode:
        fakes = [mode.from_tensor(a) for a in args]
        prop.run(*fakes, enable_io_processing=False)
    tensors = {k: v for k, v in seen.items() if isinstance(v, torch.Tensor)}
    assert set(tensors) == {"cache", "weight"}
    assert all(isinstance(v, FakeTensor) and v.fake_mode is mode for v in tensors.values())
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.Tensor):
            assert isinstance(node.meta["val"], FakeTensor)
    assert math.isfinite(float(gm.cache.sum()))
