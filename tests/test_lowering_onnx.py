"""export_onnx: single-op graphs and the rewritten reference model, portable and plugin flavours,
run in onnxruntime against PyTorch."""

import numpy as np
import onnx
import pytest
import torch

import wmoe_compile  # noqa: F401  (registers the wmoe ops)
from wmoe_compile.lowering import export_onnx
from wmoe_compile.lowering.onnx_functions import WMOE_DOMAIN
from wmoe_compile.ops.kv_codec import allocate_cache

ort = pytest.importorskip("onnxruntime")

FLAVORS = ["portable", "plugin"]
CODEC = "default;window=4;sinks=2"


def _run(proto: onnx.ModelProto, inputs: list) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.asarray(v) for i, v in zip(session.get_inputs(), inputs, strict=True)}
    return session.run(None, feeds)


def _check_flavor(proto: onnx.ModelProto, flavor: str, op_types: set[str]) -> None:
    domains = {n.domain for n in proto.graph.node}
    if flavor == "portable":
        assert domains <= {"", "ai.onnx"}, domains
        assert not proto.functions
        assert all(o.domain in ("", "ai.onnx") for o in proto.opset_import)
        return
    wmoe_nodes = [n for n in proto.graph.node if n.domain == WMOE_DOMAIN]
    assert {n.op_type for n in wmoe_nodes} == op_types
    for node in wmoe_nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if "codec" in attrs:
            spec = attrs["codec"].decode()
            assert wmoe_compile.WaveletKVConfig.from_spec(spec).to_spec() == spec
        functions = {(f.domain, f.name, f.overload) for f in proto.functions}
        assert (WMOE_DOMAIN, node.op_type, node.overload) in functions
        assert onnx.defs.has(node.op_type, WMOE_DOMAIN)


def _codes_mostly_equal(got: np.ndarray, want: torch.Tensor) -> None:
    # Coefficients within float rounding of a decision boundary may land one level over
    # (summation order differs); anything beyond a few such cases is a real mismatch.
    mismatch = float((got != want.numpy()).mean())
    assert mismatch <= 0.01, mismatch


class _Compress(torch.nn.Module):
    def forward(self, x, channel_scale):
        return torch.ops.wmoe.kv_compress(x, channel_scale, CODEC)


class _Decompress(torch.nn.Module):
    def forward(self, codes, scales, channel_scale):
        return torch.ops.wmoe.kv_decompress(codes, scales, channel_scale, CODEC, torch.float32)


def _channel_params(form: str, heads: int, head_dim: int) -> torch.Tensor:
    """The ops' channel parameter forms (docs/CONTRACTS.md): none, s, s + offset, rotation + s + m."""
    scale = torch.rand(heads, head_dim) + 0.5
    offset = torch.randn(heads, head_dim)
    if form == "none":
        return torch.empty(0)
    if form == "s":
        return scale
    if form == "sm":
        return torch.stack([scale, offset])
    rotation, _ = torch.linalg.qr(torch.randn(heads, head_dim, head_dim))
    return wmoe_compile.codec.pack_channel_params(head_dim, heads, scale, offset, rotation)


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("form", ["none", "s", "sm", "rsm"])
def test_kv_compress_and_decompress(flavor, form):
    x = torch.randn(2, 2, 5, 16) * torch.linspace(0.5, 3.0, 16) + torch.randn(16)
    channel_scale = _channel_params(form, 2, 16)
    program = torch.export.export(_Compress(), (x, channel_scale))
    proto = export_onnx(program, None, flavor)
    _check_flavor(proto, flavor, {"KvCompress"})
    codes, scales = _run(proto, [x, channel_scale])
    want_codes, want_scales = torch.ops.wmoe.kv_compress(x, channel_scale, CODEC)
    _codes_mostly_equal(codes, want_codes)
    np.testing.assert_allclose(scales.astype(np.float32), want_scales.float().numpy(), rtol=1e-3)

    program = torch.export.export(_Decompress(), (want_codes, want_scales, channel_scale))
    proto = export_onnx(program, None, flavor)
    _check_flavor(proto, flavor, {"KvDecompress"})
    (restored,) = _run(proto, [want_codes, want_scales, channel_scale])
    want = torch.ops.wmoe.kv_decompress(want_codes, want_scales, channel_scale, CODEC, torch.float32)
    np.testing.assert_allclose(restored, want.numpy(), rtol=1e-5, atol=1e-6)


class _WriteCache(torch.nn.Module):
    def __init__(self, batch: int, heads: int, capacity: int, head_dim: int) -> None:
        super().__init__()
        codes, scales, exact = allocate_cache(CODEC, batch, heads, capacity, head_dim, torch.float32)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("exact", exact, persistent=False)

    def forward(self, x, positions, channel_params):
        torch.ops.wmoe.kv_compress_into_cache(
            x, self.codes, self.scales, self.exact, positions, channel_params, CODEC
        )
        return self.exact.sum(-1)


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("steps,start,form", [(7, 0, "none"), (1, 9, "s"), (6, 3, "rsm")])
def test_kv_compress_into_cache_state_io(flavor, steps, start, form):
    # A chunk longer than the window (ring overwrite), a single decode step, and an offset (the
    # exact copies are stored centred) with a rotation.
    module = _WriteCache(2, 2, 16, 16)
    x = torch.randn(2, 2, steps, 16) + torch.randn(16)
    positions = torch.arange(start, start + steps)
    channel_params = _channel_params(form, 2, 16)
    program = torch.export.export(module, (x, positions, channel_params))
    proto = export_onnx(program, None, flavor)
    _check_flavor(proto, flavor, {"KvCompressIntoCache"})
    names = [i.name for i in proto.graph.input]
    assert names == ["x", "positions", "channel_params", "past.codes", "past.scales", "past.exact"]
    assert [o.name for o in proto.graph.output][1:] == ["present.codes", "present.scales", "present.exact"]
    state = [
        torch.randint(0, 256, module.codes.shape, dtype=torch.uint8),
        torch.rand(module.scales.shape).half(),
        torch.randn(module.exact.shape),
    ]
    out, codes, scales, exact = _run(proto, [x, positions, channel_params, *state])
    for buffer, value in zip((module.codes, module.scales, module.exact), state, strict=True):
        buffer.copy_(value)
    want = module(x, positions, channel_params)
    # out sums 16 exact values of magnitude ~3: onnxruntime adds them in another order than torch,
    # a few fp32 ulps of the terms (1.2e-6 seen on a sum of 0.095); the exact cache itself is equal
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-6, atol=1e-5)
    _codes_mostly_equal(codes, module.codes)
    np.testing.assert_allclose(scales.astype(np.float32), module.scales.float().numpy(), rtol=1e-3)
    np.testing.assert_allclose(exact, module.exact.numpy(), rtol=1e-6, atol=1e-6)


class _Attention(torch.nn.Module):
    def forward(self, q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_cs, v_cs):
        return torch.ops.wmoe.wavelet_attention(
            q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_cs, v_cs, CODEC, 0.25
        )


def _attention_case(new_tokens: int, k_form: str, v_form: str, hq: int = 4) -> tuple:
    """The op's arguments over caches of 12 written positions (two sequences: 12 and 7 valid)."""
    batch, hkv, capacity, head_dim = 2, 2, 16, 16
    caches, params = {}, {}
    for role, form in (("k", k_form), ("v", v_form)):
        codes, scales, exact = allocate_cache(CODEC, batch, hkv, capacity, head_dim, torch.float32)
        x = torch.randn(batch, hkv, 12, head_dim) + torch.randn(head_dim)
        params[role] = _channel_params(form, hkv, head_dim)
        torch.ops.wmoe.kv_compress_into_cache(x, codes, scales, exact, torch.arange(12), params[role], CODEC)
        caches[role] = (codes, scales, exact)
    q = torch.randn(batch, hq, new_tokens, head_dim)
    k, v = caches["k"], caches["v"]
    # ragged: sequence 1 holds fewer positions
    return (q, k[0], k[1], v[0], v[1], k[2], v[2], torch.tensor([12, 7]), params["k"], params["v"])


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("new_tokens,k_form,v_form", [(1, "s", "none"), (3, "rsm", "sm")])
def test_wavelet_attention(flavor, new_tokens, k_form, v_form):
    args = _attention_case(new_tokens, k_form, v_form)
    want = _Attention()(*args)
    program = torch.export.export(_Attention(), args)
    proto = export_onnx(program, None, flavor)
    _check_flavor(proto, flavor, {"WaveletAttention"})
    (out,) = _run(proto, list(args))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-4, atol=1e-5)


class _AttentionSinks(torch.nn.Module):
    def __init__(self, sinks: torch.Tensor, window: int = 0):
        super().__init__()
        self.sinks = torch.nn.Parameter(sinks)
        self.window = window

    def forward(self, q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_cs, v_cs):
        args = (q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_cs, v_cs)
        return torch.ops.wmoe.wavelet_attention(*args, CODEC, 0.25, self.sinks, self.window)


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize(
    "new_tokens,k_form,v_form,window", [(1, "s", "none", 0), (3, "rsm", "sm", 0), (2, "rsm", "sm", 3)]
)
def test_wavelet_attention_with_sinks(flavor, new_tokens, k_form, v_form, window):
    # gpt-oss's learned sink logits: their own function (an extra input); key offsets ("rsm") move
    # each query's logit, value offsets ("sm") are weighted by the mass the positions keep; with
    # its sliding window (3 of the 12 positions: the `window` attribute masks the others)
    hq = 4
    args = _attention_case(new_tokens, k_form, v_form, hq)
    module = _AttentionSinks(torch.randn(hq) + 2, window)
    with torch.no_grad():
        want = module(*args)
        assert not torch.allclose(want, _Attention()(*args), rtol=1e-2, atol=1e-3)  # the sinks matter
        if window:
            assert not torch.allclose(want, _AttentionSinks(module.sinks.data)(*args), rtol=1e-2, atol=1e-3)
    proto = export_onnx(torch.export.export(module, args), None, flavor)
    _check_flavor(proto, flavor, {"WaveletAttentionSinks"})
    (out,) = _run(proto, list(args))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-4, atol=1e-5)


class _TiledMoE(torch.nn.Module):
    def __init__(self, w_gate_up, w_down):
        super().__init__()
        self.register_buffer("w_gate_up", w_gate_up)
        self.register_buffer("w_down", w_down)

    def forward(self, hidden, topk_ids, topk_weights):
        return torch.ops.wmoe.tiled_moe(hidden, topk_ids, topk_weights, self.w_gate_up, self.w_down)


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("layout", ["tiles64", "rows"])
def test_tiled_moe(flavor, layout):
    from wmoe_compile.kernels.tiled_moe import moe_reference, pack_down, pack_gate_up

    experts, hidden_size, ffn, tokens, k = 4, 40, 72, 5, 2
    w_gate = torch.randn(experts, ffn, hidden_size) / hidden_size**0.5
    w_up = torch.randn(experts, ffn, hidden_size) / hidden_size**0.5
    w_down = torch.randn(experts, hidden_size, ffn) / ffn**0.5
    module = _TiledMoE(pack_gate_up(w_gate, w_up, layout), pack_down(w_down, layout))
    hidden = torch.randn(tokens, hidden_size)
    topk_ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    topk_weights = torch.softmax(torch.randn(tokens, k), -1)
    program = torch.export.export(module, (hidden, topk_ids, topk_weights))
    proto = export_onnx(program, None, flavor)
    _check_flavor(proto, flavor, {"TiledMoe"})
    (out,) = _run(proto, [hidden, topk_ids, topk_weights])
    want = moe_reference(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, torch.float64).float()
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-4, atol=1e-5)


class _BiasedMoE(torch.nn.Module):
    def __init__(self, packed, clamp_limit):
        super().__init__()
        for name in ("w_gate_up", "w_down", "b_gate_up", "b_down"):
            self.register_buffer(name, getattr(packed, name))
        self.clamp_limit = clamp_limit

    def forward(self, hidden, topk_ids, topk_weights):
        return torch.ops.wmoe.tiled_moe(
            hidden, topk_ids, topk_weights, self.w_gate_up, self.w_down, False,
            self.b_gate_up, self.b_down, 1.702, self.clamp_limit, 1.0,
        )  # fmt: skip


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize(("layout", "clamp_limit"), [("tiles64", 2.0), ("rows", None)])
def test_tiled_moe_with_biases_and_clamped_activation(flavor, layout, clamp_limit):
    # gpt-oss's experts: a bias per projection, (u + 1) g sigmoid(1.702 g), g and u clamped
    experts, hidden_size, ffn, tokens, k = 4, 40, 72, 5, 2
    w_gate = torch.randn(experts, ffn, hidden_size) / hidden_size**0.5
    w_up = torch.randn(experts, ffn, hidden_size) / hidden_size**0.5
    w_down = torch.randn(experts, hidden_size, ffn) / ffn**0.5
    b_gate, b_up = torch.randn(experts, ffn), torch.randn(experts, ffn)
    b_down = torch.randn(experts, hidden_size)
    packed = wmoe_compile.pack_expert_weights(
        w1=w_gate, w3=w_up, w2=w_down, b1=b_gate, b3=b_up, b2=b_down, layout=layout
    )
    hidden = torch.randn(tokens, hidden_size) * 2
    topk_ids = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    topk_weights = torch.softmax(torch.randn(tokens, k), -1)
    program = torch.export.export(_BiasedMoE(packed, clamp_limit), (hidden, topk_ids, topk_weights))
    proto = export_onnx(program, None, flavor)
    _check_flavor(proto, flavor, {"TiledMoeBiased"})
    (out,) = _run(proto, [hidden, topk_ids, topk_weights])
    want = torch.zeros(tokens, hidden_size, dtype=torch.float64)
    for t in range(tokens):
        for j, e in enumerate(topk_ids[t].tolist()):
            x = hidden[t].double()
            g, u = w_gate[e].double() @ x + b_gate[e], w_up[e].double() @ x + b_up[e]
            if clamp_limit is not None:
                g, u = g.clamp(max=clamp_limit), u.clamp(-clamp_limit, clamp_limit)
            h = (u + 1) * g * torch.sigmoid(1.702 * g)
            want[t] += topk_weights[t, j].double() * (w_down[e].double() @ h + b_down[e])
    assert clamp_limit is None or (w_gate.double() @ hidden.double().T).max() > clamp_limit
    np.testing.assert_allclose(out, want.float().numpy(), rtol=1e-4, atol=1e-4)


def test_bad_flavor_and_state_are_rejected():
    program = torch.export.export(_Compress(), (torch.randn(1, 1, 2, 16), torch.empty(0)))
    with pytest.raises(ValueError, match="portable"):
        export_onnx(program, None, "tensorrt")
    with pytest.raises(ValueError, match="state"):
        export_onnx(program, None, "portable", state="mutable")
    with pytest.raises(TypeError, match="ExportedProgram"):
        export_onnx("model.pt2", None)


# ----------------------------------------------------------------------------------------------
# the rewritten reference model: prefill program then decode program, cache carried in ONNX


@pytest.fixture(scope="module")
def reference_programs():
    from wmoe_compile.config import CompileConfig
    from wmoe_compile.models import build_model

    model = build_model("tiny", num_layers=1, seed=int(torch.randint(0, 1000, ())))
    model.setup_cache(2, 24)
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 6))
    config = CompileConfig(codec=CODEC)
    prefill = wmoe_compile.export(model, (prompt, torch.arange(6)), config=config)
    step = (prompt[:, :1], torch.tensor([6]))
    decode = wmoe_compile.export(model, step, config=config)
    return prefill, decode, prompt


@pytest.mark.parametrize("flavor", FLAVORS)
def test_reference_model_prefill_then_decode(reference_programs, flavor, tmp_path):
    prefill, decode, prompt = reference_programs
    names = ["tokens", "positions"]
    prefill_onnx = export_onnx(prefill, tmp_path / "prefill.onnx", flavor, input_names=names)
    decode_onnx = export_onnx(decode, tmp_path / "decode.onnx", flavor, input_names=names)
    assert onnx.load(str(tmp_path / "prefill.onnx")).graph.input[0].name == "tokens"
    _check_flavor(prefill_onnx, flavor, {"KvCompressIntoCache", "WaveletAttention", "TiledMoe"})
    state_names = [i.name.removeprefix("past.") for i in prefill_onnx.graph.input[2:]]
    assert state_names and all(i.name.startswith("past.") for i in decode_onnx.graph.input[2:])

    torch_prefill, torch_decode = prefill.module(), decode.module()
    prefill_buffers = dict(torch_prefill.named_buffers())
    decode_buffers = dict(torch_decode.named_buffers())
    for name in state_names:
        prefill_buffers[name].zero_()
    state = [prefill_buffers[name].numpy().copy() for name in state_names]
    positions = torch.arange(prompt.shape[1])
    outputs = _run(prefill_onnx, [prompt, positions, *state])
    want = torch_prefill(prompt, positions)
    np.testing.assert_allclose(outputs[0], want.numpy(), rtol=1e-4, atol=1e-4)
    for name in state_names:  # the decode program starts from the prefill's cache
        decode_buffers[name].copy_(prefill_buffers[name])
    tokens = torch.from_numpy(outputs[0][:, -1].argmax(-1))[:, None]
    for step in range(3):
        position = torch.tensor([prompt.shape[1] + step])
        state = outputs[1:]
        outputs = _run(decode_onnx, [tokens, position, *state])
        want = torch_decode(tokens, position)
        assert np.isfinite(outputs[0]).all()
        np.testing.assert_allclose(outputs[0], want.numpy(), rtol=1e-4, atol=1e-4)
        tokens = want[:, -1].argmax(-1, keepdim=True)
