"""wmoe::tiled_moe with gpt-oss's experts: expert biases and the clamped SwiGLU.

    gate_up = x @ W_gu[e] + b_gu[e]; gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
    h = (up + 1) * gate * sigmoid(gate * alpha);  y = h @ W_down[e] + b_down[e]

Every numeric check compares against `gpt_oss_loop` below, a per-pair fp64 loop written like
transformers' GptOssExperts (interleaved gate/up columns, [E, H, 2F] storage), independent of the
package's reference. Sizes are not multiples of 64 (zero padding), the clamp limit is small enough
that the clamp changes values (asserted), biases are nonzero. The bias-free op is covered by
tests/test_tiled_moe.py. GPU test: `python -m pytest -m gpu tests/test_tiled_moe_gpt_oss.py`.
"""

from __future__ import annotations

import pytest
import torch
from test_tiled_moe import direct_down_flat
from torch import nn
from wmoe_compile.kernels import tiled_moe as tm

import wmoe_compile.ops.moe  # noqa: F401  (registers wmoe::tiled_moe)
from wmoe_compile.moe_packing import pack_expert_weights

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ALPHA = 1.702


class GptOssWeights:
    """Random gpt-oss expert tensors in transformers' storage (fp32, on `device`)."""

    def __init__(self, num_experts, hidden, ffn, device="cpu", bias_std=0.5, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.gate_up_proj = torch.randn(num_experts, hidden, 2 * ffn, generator=g) / hidden**0.5
        self.gate_up_bias = torch.randn(num_experts, 2 * ffn, generator=g) * bias_std
        self.down_proj = torch.randn(num_experts, ffn, hidden, generator=g) / ffn**0.5
        self.down_bias = torch.randn(num_experts, hidden, generator=g) * bias_std
        for name in ("gate_up_proj", "gate_up_bias", "down_proj", "down_bias"):
            setattr(self, name, getattr(self, name).to(device))

    def pack(self, limit, layout="tiles64", dtype=torch.float32):
        return pack_expert_weights(
            gate_up_proj=self.gate_up_proj,
            down_proj=self.down_proj,
            is_transposed=True,
            is_concatenated=False,
            b1=self.gate_up_bias[:, 0::2],
            b3=self.gate_up_bias[:, 1::2],
            b2=self.down_bias,
            gate_alpha=ALPHA,
            clamp_limit=limit,
            up_offset=1.0,
            layout=layout,
            dtype=dtype,
        )


def gpt_oss_loop(x, ids, weights, w: GptOssWeights, limit, dtype=torch.float32):
    """GptOssExperts' forward, one routed pair at a time, in fp64 on `dtype`-rounded weights and input
    (biases fp32, as packed). Returns (out, pre-clamp gate values, pre-clamp up values)."""
    gate_up_proj, down_proj = (t.to(dtype).double() for t in (w.gate_up_proj, w.down_proj))
    gate_up_bias, down_bias = w.gate_up_bias.double(), w.down_bias.double()
    x = x.to(dtype).double()
    out = torch.zeros_like(x)
    gates, ups = [], []
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gate_up_proj.shape[0]:
                continue
            gate_up = x[t] @ gate_up_proj[e] + gate_up_bias[e]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gates.append(gate)
            ups.append(up)
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
            out[t] += weights[t, j].double() * (h @ down_proj[e] + down_bias[e])
    return out, torch.cat(gates), torch.cat(ups)


def random_routing(num_tokens, top_k, num_experts, device="cpu"):
    ids = torch.stack([torch.randperm(num_experts)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k) + 0.05
    return ids.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


def rel_err(got, ref):
    assert torch.isfinite(got).all(), "NaN/inf in the output"
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def assert_clamp_triggers(gates, ups, limit):
    """The clamp must change some values, and leave others (else the test could not see it)."""
    assert (gates > limit).any() and (gates < limit).any(), "the gate clamp never (or always) triggers"
    assert (ups.abs() > limit).any() and (ups.abs() < limit).any(), "the up clamp never (or always) triggers"


# ---------------------------------------------------------------- the op against the loop

E, H, F, LIMIT = 4, 80, 72, 0.75  # H_PAD = F_PAD = 128: padded columns in both GEMMs


@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 21])  # direct by pair (P=2 <= E), direct by expert, grouped
def test_op_matches_gpt_oss_loop(num_tokens, dtype, layout):
    w = GptOssWeights(E, H, F, device=DEVICE)
    packed = w.pack(LIMIT, layout=layout, dtype=dtype)
    assert packed.b_gate_up.shape == (E, 2, 128) and packed.b_down.shape == (E, 128)
    x = torch.randn(num_tokens, H, device=DEVICE)
    ids, weights = random_routing(num_tokens, 2, E, device=DEVICE)
    assert (num_tokens * 2 <= tm.DIRECT_MAX_PAIRS) == (num_tokens < 21)
    got = packed(x.to(dtype), ids, weights)
    ref, gates, ups = gpt_oss_loop(x, ids, weights, w, LIMIT, dtype)
    assert_clamp_triggers(gates, ups, LIMIT)
    assert got.dtype == dtype and got.shape == (num_tokens, H)
    err = rel_err(got, ref)
    assert err < REL_TOL[dtype], f"relative error {err:.2e}"
    # Without the clamp (and through the op's positional arguments) it is another function: the
    # clamp above was live, and clamp_limit=None is not silently the same.
    no_clamp = (packed.b_gate_up, packed.b_down, ALPHA, None, 1.0)
    unclamped = torch.ops.wmoe.tiled_moe(
        x.to(dtype), ids, weights, packed.w_gate_up, packed.w_down, False, *no_clamp
    )
    assert rel_err(unclamped, gpt_oss_loop(x, ids, weights, w, float("inf"), dtype)[0]) < REL_TOL[dtype]
    assert rel_err(unclamped, ref) > 10 * REL_TOL[dtype]


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_direct_path_flat_down_loop(num_tokens):
    # The direct down kernel's other loop form (one loop over live expert and K block) adds biases too.
    w = GptOssWeights(E, H, F)
    packed = w.pack(LIMIT)
    x = torch.randn(num_tokens, H)
    ids, weights = random_routing(num_tokens, 2, E)
    with direct_down_flat(True):
        got = packed(x, ids, weights)
    assert rel_err(got, gpt_oss_loop(x, ids, weights, w, LIMIT)[0]) < 1e-5


@pytest.mark.parametrize(
    "config",
    [
        tm.MoEConfig(16, 32, 64, 4, 2, 32, 64, 2, 4, 2),  # split-K 2: the bias is added by split 0 only
        tm.MoEConfig(16, 32, 64, 4, 2, 64, 64, 2, 4, 2, group_m=1, fused=True),  # gate and up as one dot
    ],
)
def test_grouped_split_k_and_fused_gate_up(config):
    w = GptOssWeights(E, H, F)
    x = torch.randn(9, H)
    ids, weights = random_routing(9, 2, E)
    for layout in tm.LAYOUTS:
        packed = w.pack(LIMIT, layout=layout)
        act = tm.swiglu(ALPHA, LIMIT, 1.0)
        biases = dict(b_gate_up=packed.b_gate_up, b_down=packed.b_down)
        got = tm.tiled_moe_triton(
            x, ids, weights, packed.w_gate_up, packed.w_down, config=config, **biases, act=act
        )
        assert rel_err(got, gpt_oss_loop(x, ids, weights, w, LIMIT)[0]) < 1e-5, layout


@pytest.mark.parametrize("num_tokens", [2, 9])  # direct, grouped
def test_out_of_range_ids_add_no_bias(num_tokens):
    # A pair routed to an id outside [0, E) contributes nothing: neither its GEMMs nor its down bias.
    w = GptOssWeights(E, H, F)
    packed = w.pack(LIMIT)
    x = torch.randn(num_tokens, H)
    ids, weights = random_routing(num_tokens, 2, E)
    ids[0, 1], ids[1, 0] = E + 5, -1
    got = packed(x, ids, weights)
    assert rel_err(got, gpt_oss_loop(x, ids, weights, w, LIMIT)[0]) < 1e-5


def test_biases_alone_and_activation_alone():
    # Each new piece on its own: only b_down (no gate/up bias), only the gate bias, and the activation
    # without biases, against the package's reference on the same packed weights.
    gate, up, down = (
        torch.randn(E, F, H) / H**0.5,
        torch.randn(E, F, H) / H**0.5,
        torch.randn(E, H, F) / F**0.5,
    )
    b_gate, b_down = torch.randn(E, F), torch.randn(E, H)
    x = torch.randn(3, H)
    ids, weights = random_routing(3, 2, E)
    cases = [
        (dict(b2=b_down), dict(b_down=b_down), tm.DEFAULT_SWIGLU),
        (dict(b1=b_gate), dict(b_gate=b_gate), tm.DEFAULT_SWIGLU),
        (dict(gate_alpha=ALPHA, clamp_limit=0.5, up_offset=1.0), {}, tm.SwiGLU(ALPHA, 0.5, 1.0)),
    ]
    for pack_kwargs, ref_kwargs, act in cases:
        packed = pack_expert_weights(w1=gate, w3=up, w2=down, **pack_kwargs)
        assert not packed.is_plain_swiglu
        ref = tm.moe_reference(x, ids, weights, gate, up, down, **ref_kwargs, act=act)
        plain = tm.moe_reference(x, ids, weights, gate, up, down)
        for t in (1, 3):  # direct, direct by expert slot; the grouped path is covered above
            got = packed(x[:t], ids[:t], weights[:t])
            assert rel_err(got, ref[:t]) < 1e-5, pack_kwargs
            assert rel_err(got, plain[:t]) > 1e-3, pack_kwargs


def test_reference_path_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the op's CPU fallback: fp32 per-expert loop
    w = GptOssWeights(E, H, F)
    packed = w.pack(LIMIT, layout="rows")
    x = torch.randn(6, H)
    ids, weights = random_routing(6, 2, E)
    assert rel_err(packed(x, ids, weights), gpt_oss_loop(x, ids, weights, w, LIMIT)[0]) < 1e-5


def test_opcheck_with_biases():
    w = GptOssWeights(E, H, F)
    packed = w.pack(LIMIT)
    x = torch.randn(2, H)
    ids, weights = random_routing(2, 2, E)
    args = (x, ids, weights, packed.w_gate_up, packed.w_down, False, *packed.op_extra_args())
    torch.library.opcheck(torch.ops.wmoe.tiled_moe.default, args)


# ---------------------------------------------------------------- the direct path's launch plans


def test_direct_plans_and_compiled_launches_keyed_by_bias_and_activation(monkeypatch):
    # As on a GPU (not interpreting): every variant gets its own plan key, so a compiled kernel of one
    # is never relaunched for another; the bias-free call keeps the plan it had before biases existed.
    calls = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, key, grid, args, constants, tail):
            calls.append((self.kernel, key, args, constants, tail))

    monkeypatch.setattr(tm, "interpreting", lambda: False)
    monkeypatch.setattr(tm, "_gate_up_direct_launches", Recorder("up"))
    monkeypatch.setattr(tm, "_down_direct_launches", Recorder("down"))
    w = GptOssWeights(E, H, F)
    packed = w.pack(LIMIT)
    plain = pack_expert_weights(w1=torch.randn(E, F, H), w3=torch.randn(E, F, H), w2=torch.randn(E, H, F))
    x = torch.randn(2, H)
    ids, weights = random_routing(2, 2, E)
    dims = tm.packed_dims(packed.w_gate_up, packed.w_down)
    act = tm.swiglu(ALPHA, LIMIT, 1.0)
    variants = [
        (plain.b_gate_up, plain.b_down, tm.DEFAULT_SWIGLU),
        (packed.b_gate_up, packed.b_down, act),
        (None, packed.b_down, tm.DEFAULT_SWIGLU),
        (None, None, act),
        (None, None, tm.swiglu(ALPHA, 2 * LIMIT, 1.0)),
    ]
    for b_gate_up, b_down, variant_act in variants:
        tm.tiled_moe_direct(
            x, ids, weights, packed.w_gate_up, packed.w_down, dims, b_gate_up, b_down, variant_act
        )
    tm.tiled_moe_direct(x, ids, weights, packed.w_gate_up, packed.w_down, dims)  # the six-argument call
    up_calls = [c for c in calls if c[0] == "up"]
    down_calls = [c for c in calls if c[0] == "down"]
    assert len({c[1] for c in up_calls[:5]}) == 5 and len({c[1] for c in down_calls[:3]}) == 3
    assert up_calls[5][1] == up_calls[0][1] and down_calls[5][1] == down_calls[0][1]
    _, _, args, constants, tail = up_calls[1]
    assert args[-1] is packed.b_gate_up and len(args) == tm._UP_RUNTIME_ARGS
    assert constants["HAS_BIAS"] and (constants["GATE_ALPHA"], constants["CLAMP_LIMIT"]) == (ALPHA, LIMIT)
    assert tail[-4:] == (True, ALPHA, LIMIT, 1.0)  # the constexprs in the kernel's parameter order
    _, _, args, constants, tail = down_calls[1]
    assert args[-1] is packed.b_down and len(args) == tm._DOWN_RUNTIME_ARGS and tail[-1] is True
    _, _, args, constants, tail = up_calls[0]
    assert args[-1] is None and tail[-4:] == (False, 1.0, None, 0.0)


# ---------------------------------------------------------------- packing


def test_pack_gpt_oss_experts_module_reproduces_its_forward():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=F, num_local_experts=E, num_experts_per_tok=2, swiglu_limit=1.5
    )
    config._experts_implementation = "eager"  # the module's own loop (the transformers reference)
    experts = GptOssExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, H**-0.5)
        experts.down_proj.normal_(0, F**-0.5)
        experts.gate_up_proj_bias.normal_(0, 0.5)
        experts.down_proj_bias.normal_(0, 0.5)
    for layout in tm.LAYOUTS:
        packed = pack_expert_weights(experts, layout=layout)
        assert (packed.gate_alpha, packed.clamp_limit, packed.up_offset) == (ALPHA, 1.5, 1.0)
        assert torch.equal(packed.b_gate_up[:, 0, :F], experts.gate_up_proj_bias[:, 0::2].detach())
        assert torch.equal(packed.b_gate_up[:, 1, :F], experts.gate_up_proj_bias[:, 1::2].detach())
        assert torch.equal(packed.b_down[:, :H], experts.down_proj_bias.detach())
        assert packed.b_gate_up[:, :, F:].abs().sum() == 0 and packed.b_down[:, H:].abs().sum() == 0
        for num_tokens in (3, 7):  # direct path, grouped path
            x = torch.randn(num_tokens, H) * 2
            ids, weights = random_routing(num_tokens, 2, E)
            with torch.no_grad():
                want = experts(x, ids, weights)
                gate_up = torch.einsum("th,ehf->tef", x, experts.gate_up_proj) + experts.gate_up_proj_bias
            assert (gate_up[..., ::2] > 1.5).any() and (gate_up[..., 1::2].abs() > 1.5).any()
            assert rel_err(packed(x, ids, weights), want) < 1e-5, (layout, num_tokens)


def test_pack_biases_from_tensors_and_linear_experts():
    gate, up, down = torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F)
    b1, b3, b2 = torch.randn(E, F), torch.randn(E, F), torch.randn(E, H)
    packed = pack_expert_weights(w1=gate, w3=up, w2=down, b1=b1, b3=b3, b2=b2, dtype=torch.bfloat16)
    assert packed.b_gate_up.dtype == packed.b_down.dtype == torch.float32  # biases stay fp32
    assert torch.equal(packed.b_gate_up[:, 0, :F], b1) and torch.equal(packed.b_gate_up[:, 1, :F], b3)
    assert torch.equal(packed.b_down[:, :H], b2)
    assert (packed.gate_alpha, packed.clamp_limit, packed.up_offset) == (1.0, None, 0.0)
    only_up = pack_expert_weights(w1=gate, w3=up, w2=down, b3=list(b3))  # per-expert vectors
    assert only_up.b_down is None and only_up.b_gate_up[:, 0].abs().sum() == 0
    assert torch.equal(only_up.b_gate_up[:, 1, :F], b3)
    moved = packed.to("cpu")
    assert moved.b_gate_up is not None and moved.b_down is not None and moved.clamp_limit is None
    assert pack_expert_weights(w1=gate, w3=up, w2=down).is_plain_swiglu
    # Per-expert nn.Linear modules with biases (formerly refused).
    experts = nn.ModuleList()
    for _ in range(E):
        expert = nn.Module()
        expert.w1, expert.w3, expert.w2 = nn.Linear(H, F), nn.Linear(H, F), nn.Linear(F, H)
        experts.append(expert)
    packed = pack_expert_weights(experts)
    x = torch.randn(5, H)
    ids, weights = random_routing(5, 2, E)
    with torch.no_grad():
        want = torch.zeros_like(x)
        for t in range(5):
            for j in range(2):
                m = experts[int(ids[t, j])]
                want[t] += weights[t, j] * m.w2(nn.functional.silu(m.w1(x[t])) * m.w3(x[t]))
    assert rel_err(packed(x, ids, weights), want) < 1e-5


class _Experts(nn.Module):
    """An HF-style fused experts module whose class overrides `_apply_gate`."""

    def __init__(self, apply_gate, limit=2.0):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * F, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, F))
        self.limit = limit
        type(self)._apply_gate = apply_gate


def test_pack_reads_or_refuses_custom_gates():
    def clamp_then_silu(self, gate_up):  # DeepSeek-V4's: an activation the op has
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate.clamp(max=self.limit)) * up.clamp(-self.limit, self.limit)

    def silu_then_clamp(self, gate_up):  # Step3p7's: the clamp after the activation, which the op has not
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate).clamp(max=self.limit) * up.clamp(-self.limit, self.limit)

    ok = type("ClampThenSilu", (_Experts,), {})(clamp_then_silu)
    packed = pack_expert_weights(ok)
    assert (packed.gate_alpha, packed.clamp_limit, packed.up_offset) == (1.0, 2.0, 0.0)
    assert packed.b_gate_up is None and packed.b_down is None
    with pytest.raises(ValueError, match="computes an activation wmoe::tiled_moe does not have"):
        pack_expert_weights(type("SiluThenClamp", (_Experts,), {})(silu_then_clamp))


def test_pack_rejects_bad_biases_and_activation():
    gate, up, down = torch.randn(E, F, H), torch.randn(E, F, H), torch.randn(E, H, F)
    with pytest.raises(ValueError, match=r"bias b1 \(gate\) must be floating point \[num_experts=4, 72\]"):
        pack_expert_weights(w1=gate, w3=up, w2=down, b1=torch.randn(E, H))
    with pytest.raises(ValueError, match=r"bias b2 \(down\) must be floating point \[num_experts=4, 80\]"):
        pack_expert_weights(w1=gate, w3=up, w2=down, b2=torch.randn(E, F))
    with pytest.raises(ValueError, match=r"b2 must be stacked \[num_experts, size\]"):
        pack_expert_weights(w1=gate, w3=up, w2=down, b2=torch.randn(E, H, 1))
    with pytest.raises(ValueError, match="clamp_limit must be None .* or a finite number > 0"):
        pack_expert_weights(w1=gate, w3=up, w2=down, clamp_limit=0.0)
    experts = nn.ModuleList()
    for _ in range(E):
        expert = nn.Module()
        expert.w1, expert.w3, expert.w2 = nn.Linear(H, F), nn.Linear(H, F), nn.Linear(F, H)
        experts.append(expert)
    with pytest.raises(ValueError, match="b2, clamp_limit go with tensor sources only"):
        pack_expert_weights(experts, b2=torch.randn(E, H), clamp_limit=1.0)


# ---------------------------------------------------------------- op input checks


def test_op_rejects_bad_biases_and_activation():
    w = GptOssWeights(E, H, F)
    packed = w.pack(LIMIT)
    x = torch.randn(3, H)
    ids, weights = random_routing(3, 2, E)

    def op(b_gate_up=packed.b_gate_up, b_down=packed.b_down, alpha=ALPHA, limit=LIMIT, offset=1.0):
        return torch.ops.wmoe.tiled_moe(
            x, ids, weights, packed.w_gate_up, packed.w_down, False, b_gate_up, b_down, alpha, limit, offset
        )

    with pytest.raises(ValueError, match=r"b_gate_up must be float32 \[4, 2, 128\] \(\[E, 2, F_PAD\]"):
        op(b_gate_up=packed.b_gate_up[:, :, :F].contiguous())  # not padded
    with pytest.raises(ValueError, match=r"b_gate_up must be float32 \[4, 2, 128\]"):
        op(b_gate_up=packed.b_gate_up.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"b_down must be float32 \[4, 128\] \(\[E, H_PAD\]"):
        op(b_down=packed.b_down[:, :H])
    with pytest.raises(ValueError, match=r"b_down must be float32 \[4, 128\]"):
        op(b_down=packed.b_gate_up)
    with pytest.raises(ValueError, match="b_down is on meta but hidden is on cpu"):
        op(b_down=packed.b_down.to("meta"))
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(ValueError, match="clamp_limit must be None .* or a finite number > 0"):
            op(limit=bad)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gate_alpha must be a finite number"):
            op(alpha=bad)
    with pytest.raises(ValueError, match="up_offset must be a finite number"):
        op(offset=float("nan"))
    op()  # the good call passes


# ---------------------------------------------------------------- GPU, gpt-oss-20b's experts

GPT_OSS_20B = dict(num_experts=32, hidden=2880, ffn=2880, top_k=4, limit=7.0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", tm.LAYOUTS)
@pytest.mark.parametrize("num_tokens", [1, 4, 64])
def test_gpu_gpt_oss_20b_experts(num_tokens, layout):
    # T = 1: direct path by pair; T = 4: 16 pairs, grouped decode bucket; T = 64: grouped. bf16 against
    # the fp32 reference on the same rounded weights; inputs scaled so that the 7.0 clamp triggers.
    s = GPT_OSS_20B
    e, h, f, k, limit = s["num_experts"], s["hidden"], s["ffn"], s["top_k"], s["limit"]
    w = GptOssWeights(e, h, f, device="cuda", bias_std=1.0)
    packed = w.pack(limit, layout=layout, dtype=torch.bfloat16)
    x = (torch.randn(num_tokens, h, device="cuda") * 4).to(torch.bfloat16)
    ids, weights = random_routing(num_tokens, k, e, device="cuda")
    got = packed(x, ids, weights)
    gate = w.gate_up_proj[:, :, 0::2].to(torch.bfloat16).float().transpose(1, 2)
    up = w.gate_up_proj[:, :, 1::2].to(torch.bfloat16).float().transpose(1, 2)
    down = w.down_proj.to(torch.bfloat16).float().transpose(1, 2)
    act = tm.swiglu(ALPHA, limit, 1.0)
    biases = dict(b_gate=w.gate_up_bias[:, 0::2], b_up=w.gate_up_bias[:, 1::2], b_down=w.down_bias)
    ref = tm.moe_reference(x.float(), ids, weights, gate, up, down, **biases, act=act)
    pre = torch.einsum("th,ehf->tef", x.float(), w.gate_up_proj[ids.unique()].to(torch.bfloat16).float())
    assert (pre[..., 0::2] > limit).any(), "the clamp never triggers"
    err = rel_err(got, ref)
    assert err < REL_TOL[torch.bfloat16], f"relative error {err:.2e}"


@pytest.mark.gpu
def test_gpu_direct_path_compiled_launches_with_biases():
    # The direct path's kept compiled kernels (tm.FAST_LAUNCH): a call with biases and the clamped
    # activation compiles kernels of its own (a None bias pointer is a constexpr of the bias-free ones),
    # its relaunch through the kept kernel gives the same bits, and the bias-free call reuses nothing of it.
    w = GptOssWeights(8, 128, 192, device="cuda")
    packed = w.pack(LIMIT, dtype=torch.bfloat16)
    plain = pack_expert_weights(
        w1=torch.randn(8, 192, 128),
        w3=torch.randn(8, 192, 128),
        w2=torch.randn(8, 128, 192),
        dtype=torch.bfloat16,
    )
    plain = plain.to("cuda")
    x = torch.randn(2, 128, device="cuda")
    ids, weights = random_routing(2, 2, 8, device="cuda")
    launches = (tm._gate_up_direct_launches, tm._down_direct_launches)
    for launch in launches:
        launch.compiled.clear()
    first = packed(x.to(torch.bfloat16), ids, weights)
    assert [len(launch.compiled) for launch in launches] == [1, 1]
    assert torch.equal(packed(x.to(torch.bfloat16), ids, weights), first)
    plain(x.to(torch.bfloat16), ids, weights)
    assert [len(launch.compiled) for launch in launches] == [2, 2]
    assert torch.equal(packed(x.to(torch.bfloat16), ids, weights), first)
    ref, gates, ups = gpt_oss_loop(x.cpu(), ids.cpu(), weights.cpu(), w_cpu(w), LIMIT, torch.bfloat16)
    assert_clamp_triggers(gates, ups, LIMIT)
    assert rel_err(first.cpu(), ref) < REL_TOL[torch.bfloat16]


def w_cpu(w: GptOssWeights) -> GptOssWeights:
    out = object.__new__(GptOssWeights)
    for name in ("gate_up_proj", "gate_up_bias", "down_proj", "down_bias"):
        setattr(out, name, getattr(w, name).cpu())
    return out
