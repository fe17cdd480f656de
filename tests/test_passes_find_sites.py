"""find_sites on small hand-built graphs: what is found, and why a site is skipped.

Every graph here is captured with torch.export (ATen level), like the pipeline's input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from wmoe_compile.passes import _matching as m
from wmoe_compile.passes import find_sites as fs

aten = torch.ops.aten
B, T, S, H, HQ, HKV, D = 2, 3, 16, 32, 4, 2, 16


class CachedAttention(nn.Module):
    """Reference-style attention: static cache written with index_copy_, masked sdpa over it.

    variant: "plain" | "cache_reader" (the K cache is also returned) | "proj_reader" (the K
    projection is also returned) | "bshd" (cache [B, S, Hkv, D] written along dim 1) |
    "mask_input" (mask passed in, not built from positions) | "window" (sliding-window mask, a
    window of 4 < S) | "wide_window" (a window of S tokens: it masks nothing) |
    "causal_flag" (is_causal=True, no mask) | "eager" (matmul/softmax/matmul) | "shifted" (eager,
    the softmax's input less its row max) | "sinks" (eager with a learned sink logit per head, as
    gpt-oss: softmax over cat(scores, sinks), the sinks' column sliced off) | "token_sinks" (the
    same with a sink logit computed per token from q: no per-head constant) | "first_column_dropped"
    (the same, but the slice drops the first column: not a sink pattern) | "einsum" (attention
    written with einsum, not recognised) | "dynamic" (cache passed in and grown with cat).
    """

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.variant = variant
        self.q_proj = nn.Linear(H, HQ * D, bias=False)
        self.k_proj = nn.Linear(H, HKV * D, bias=False)
        self.v_proj = nn.Linear(H, HKV * D, bias=False)
        shape = (B, S, HKV, D) if variant == "bshd" else (B, HKV, S, D)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)
        self.sinks = nn.Parameter(torch.randn(HQ))

    def forward(self, x, positions, mask=None, past_k=None, past_v=None):
        q = self.q_proj(x).view(B, -1, HQ, D).transpose(1, 2)
        k_flat = self.k_proj(x)
        k = k_flat.view(B, -1, HKV, D).transpose(1, 2)
        v = self.v_proj(x).view(B, -1, HKV, D).transpose(1, 2)
        if self.variant == "dynamic":
            keys, values = torch.cat([past_k, k], dim=-2), torch.cat([past_v, v], dim=-2)
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=False, enable_gqa=True)
            return out, keys, values
        if self.variant == "bshd":
            self.k_cache.index_copy_(1, positions, k.transpose(1, 2))
            self.v_cache.index_copy_(1, positions, v.transpose(1, 2))
            keys, values = self.k_cache.transpose(1, 2), self.v_cache.transpose(1, 2)
        else:
            self.k_cache.index_copy_(2, positions, k)
            self.v_cache.index_copy_(2, positions, v)
            keys, values = self.k_cache, self.v_cache
        slots = torch.arange(S)
        causal = slots[None, :] <= positions[:, None]
        if self.variant in ("window", "wide_window"):
            window = 4 if self.variant == "window" else S
            causal = causal & (slots[None, :] > positions[:, None] - window)
        if self.variant == "mask_input":
            causal = mask
        if self.variant == "causal_flag":
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        elif self.variant in ("eager", "shifted", "sinks", "token_sinks", "first_column_dropped"):
            rep_k = keys.repeat_interleave(HQ // HKV, dim=1)
            rep_v = values.repeat_interleave(HQ // HKV, dim=1)
            scores = torch.matmul(q, rep_k.transpose(2, 3)) * D**-0.5
            scores = scores + torch.where(causal[None, None], 0.0, torch.finfo(torch.float32).min)
            if self.variant == "eager":
                probs = torch.softmax(scores, dim=-1)
            elif self.variant == "shifted":
                probs = torch.softmax(scores - scores.max(dim=-1, keepdim=True).values, dim=-1)
            else:  # gpt-oss: [B, HQ, T, S + 1] logits, the sink last
                sinks = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, q.shape[2], -1)
                if self.variant == "token_sinks":
                    sinks = q.mean(dim=-1, keepdim=True)
                logits = torch.cat([scores, sinks], dim=-1)
                logits = logits - logits.max(dim=-1, keepdim=True).values
                probs = torch.softmax(logits, dim=-1)
                probs = probs[..., 1:] if self.variant == "first_column_dropped" else probs[..., :-1]
            out = torch.matmul(probs, rep_v)
        elif self.variant == "einsum":
            rep_k = keys.repeat_interleave(HQ // HKV, dim=1)
            rep_v = values.repeat_interleave(HQ // HKV, dim=1)
            scores = torch.einsum("bhtd,bhsd->bhts", q, rep_k) * D**-0.5
            scores = scores.masked_fill(~causal[None, None], float("-inf"))
            out = torch.einsum("bhts,bhsd->bhtd", torch.softmax(scores, dim=-1), rep_v)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=causal[None, None], enable_gqa=True
            )
        if self.variant == "cache_reader":
            return out, self.k_cache.sum()
        if self.variant == "proj_reader":
            return out, k_flat * 2
        return out


def capture(module: nn.Module, *args) -> torch.fx.GraphModule:
    with torch.no_grad():
        return torch.export.export(module, args).module()


def attention_inputs(variant: str):
    x, positions = torch.randn(B, T, H), torch.arange(T)
    if variant == "mask_input":
        return x, positions, torch.ones(T, S, dtype=torch.bool)
    if variant == "dynamic":
        return x, positions, None, torch.randn(B, HKV, 5, D), torch.randn(B, HKV, 5, D)
    return x, positions


def sites_of(variant: str) -> fs.Sites:
    return fs.find_sites(capture(CachedAttention(variant), *attention_inputs(variant)))


def by_role(sites: fs.Sites, role: str) -> fs.KVWriteSite:
    (kv,) = [kv for kv in sites.kv if kv.role == role]
    return kv


@pytest.mark.parametrize("variant", ["plain", "eager", "shifted", "proj_reader", "wide_window"])
def test_static_cache_attention_is_found_by_dataflow(variant):
    sites = sites_of(variant)
    (attention,) = sites.attention
    assert attention.variant == ("eager" if variant in ("eager", "shifted") else "sdpa")
    assert attention.blocker is None, attention.blocker
    for role, weight in (("K", "k_proj"), ("V", "v_proj")):
        kv = by_role(sites, role)
        assert kv.cache_kind == "static" and kv.blocker is None and kv.report.status == "found"
        # The projection is reached by walking back from the cached tensor; its weight is the module's.
        assert kv.projection is not None and weight in str(kv.projection.args[1].target)
        assert kv.report.nodes["cache"].endswith(f"{role.lower()}_cache")
    if variant in ("eager", "shifted"):
        assert attention.scale == pytest.approx(D**-0.5)


def test_learned_attention_sinks_are_found_with_their_per_head_logits():
    # gpt-oss: the softmax runs over the scores and a learned logit per head, broadcast from the
    # module's [Hq] parameter; the site keeps that parameter for the op
    sites = sites_of("sinks")
    (attention,) = sites.attention
    assert attention.variant == "eager" and attention.report.status == "found", attention.blocker
    assert attention.blocker is None
    assert attention.sinks is not None and m.shape(attention.sinks) == (HQ,)
    assert "sinks" in str(attention.sinks.target)
    assert attention.scale == pytest.approx(D**-0.5)
    for role in ("K", "V"):
        kv = by_role(sites, role)
        assert kv.cache_kind == "static" and kv.blocker is None and kv.report.status == "found"


def test_sink_logits_that_vary_per_token_are_skipped_with_the_reason():
    # the op takes one logit per query head; a sink column computed from the query is no such thing
    sites = sites_of("token_sinks")
    (attention,) = sites.attention
    assert attention.report.status == "skipped" and attention.sinks is None
    assert "not broadcast from one logit per query head" in attention.blocker


@pytest.mark.parametrize("variant", ["einsum", "first_column_dropped"])
def test_caches_of_an_unrecognised_attention_are_reported_as_skipped(variant):
    # no attention matched (einsum; a slice that drops the first column is no sink pattern), but the
    # caches it reads are module buffers written in place: each is reported, left dense
    sites = sites_of(variant)
    assert sites.attention == []
    assert sorted(kv.report.nodes["cache"] for kv in sites.kv) == ["k_cache", "v_cache"]
    for kv in sites.kv:
        assert kv.report.status == "skipped" and kv.report.kind == "kv_write"
        assert "no attention reading it was recognised" in kv.report.reason
        assert kv.report.reason.startswith(f"cache {kv.report.nodes['cache']} is written by")


def test_caches_read_by_a_recognised_attention_are_not_reported_twice():
    for variant in ("plain", "eager", "sinks", "window"):
        sites = sites_of(variant)
        assert len(sites.kv) == 2 and {kv.role for kv in sites.kv} == {"K", "V"}, variant


def test_second_reader_of_the_cache_blocks_compression():
    sites = sites_of("cache_reader")
    k, v = by_role(sites, "K"), by_role(sites, "V")
    assert k.report.status == "skipped" and "also read by" in k.report.reason
    assert v.report.status == "found"  # only K has the extra reader
    (attention,) = sites.attention
    assert attention.blocker and attention.blocker.startswith("K:")


def test_unusual_cache_layout_is_skipped_with_the_layout():
    sites = sites_of("bshd")
    k = by_role(sites, "K")
    assert k.report.status == "skipped"
    assert "unusual cache layout" in k.report.reason and "dim 1" in k.report.reason


def test_a_sliding_window_shorter_than_the_cache_is_found_with_its_length():
    # slot > position - 4 ANDed with the causal mask: the site carries W = 4 for the op's window
    (attention,) = sites_of("window").attention
    assert attention.blocker is None and attention.window == 4
    (wide,) = sites_of("wide_window").attention  # a window of the whole cache masks nothing
    assert wide.blocker is None and wide.window == 0


@pytest.mark.parametrize(
    ("variant", "reason"),
    [
        ("mask_input", "not a plain causal mask"),
        ("causal_flag", "no attention mask"),
    ],
)
def test_unknown_attention_variants_are_reported_not_rewritten(variant, reason):
    (attention,) = sites_of(variant).attention
    assert attention.blocker is not None and reason in attention.blocker


def test_dynamic_cache_is_found_and_skipped_with_reason():
    sites = sites_of("dynamic")
    k = by_role(sites, "K")
    assert k.cache_kind == "dynamic" and k.report.status == "skipped"
    assert "DynamicCache" in k.report.reason and "static cache" in k.report.reason
    assert k.projection is not None  # still traced to k_proj


def test_reports_carry_layer_and_module_labels():
    sites = sites_of("plain")
    for report in sites.reports():
        assert report.layer == 0  # no `layers.N` in the path: ordinal
        assert report.to_dict()["kind"] in ("kv_write", "attention")


# ----------------------------------------------------------------------------------------------
# MoE

E, K, FF = 4, 2, 24


class StackedMoE(nn.Module):
    """HF-style experts: gate_up_proj [E, 2F, H], down_proj [E, H, F], gathered per token pair.

    router: "softmax" | "sigmoid" (weights: the top-k values) | "logits-softmax" (top-k of the
    logits, softmax over the k values) | "deepseek" (DeepSeek-V3: experts chosen on sigmoid scores
    plus a per-expert bias within the best of two groups, weights the scores gathered at the ids,
    renormalised and scaled) | "deepseek-logits" (the same choice, but weights gathered from the
    logits: not found, so skipped) | "ernie" (ERNIE 4.5: experts chosen on softmax scores plus a
    [1, E] bias squeezed to [E], weights the scores gathered at the ids, divided by their sum
    clamped to at least 1e-12) | "ernie-capped" (the same, the sum clamped to at most 0.5: not a
    renormalisation, so the experts' region does not match and the site is skipped). act: "silu" |
    "gelu" | "gpt-oss" (gpt-oss's experts: gate and up interleaved, a bias per projection,
    (u + 1) * g * sigmoid(1.702 g) with g clamped from above at 7 and u at +-7) |
    "gpt-oss-up-from-above" (u clamped from above only: not the form the op takes) |
    "gpt-oss-two-limits" (g at 7, u at 5: neither). transposed: store [E, H, 2F] / [E, F, H].
    capacity: per-expert token limit (tokens past it are dropped), 0 = none.
    """

    def __init__(
        self, router: str = "softmax", act: str = "silu", transposed: bool = False, capacity: int = 0
    ) -> None:
        super().__init__()
        self.router, self.act, self.transposed, self.capacity = router, act, transposed, capacity
        self.gate = nn.Linear(H, E, bias=False)
        self.register_buffer("score_bias", torch.randn(E) * 0.1)
        self.register_buffer("score_bias_row", torch.randn(1, E) * 0.1)
        gate_up = torch.randn(E, 2 * FF, H) / H**0.5
        down = torch.randn(E, H, FF) / FF**0.5
        if transposed:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        self.gate_up_proj = nn.Parameter(gate_up)
        self.down_proj = nn.Parameter(down)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(E, 2 * FF))
        self.down_proj_bias = nn.Parameter(torch.randn(E, H))

    def _gpt_oss(self, h: torch.Tensor) -> torch.Tensor:
        g, u = h[..., ::2], h[..., 1::2]
        g = g.clamp(max=7.0)
        if self.act == "gpt-oss-two-limits":
            u = u.clamp(min=-5.0, max=5.0)
        else:
            u = u.clamp(max=7.0) if self.act == "gpt-oss-up-from-above" else u.clamp(-7.0, 7.0)
        return (u + 1) * (g * torch.sigmoid(g * 1.702))

    def forward(self, x):
        flat = x.reshape(-1, H)
        logits = self.gate(flat)
        if self.router == "logits-softmax":  # Granite / JetMoE: top-k of the logits, then softmax
            top_logits, ids = torch.topk(logits, K, dim=-1)
            weights = torch.softmax(top_logits, dim=-1)
        elif self.router.startswith("deepseek"):
            scores = torch.sigmoid(logits)
            choice = scores + self.score_bias
            group_scores = choice.view(-1, 2, E // 2).topk(2, dim=-1)[0].sum(-1)  # [N, 2 groups]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(1, dim=-1)[1], 1)
            allowed = group_mask.unsqueeze(-1).expand(-1, 2, E // 2).reshape(-1, E).bool()
            ids = torch.topk(choice.masked_fill(~allowed, float("-inf")), K, dim=-1)[1]
            weights = (scores if self.router == "deepseek" else logits).gather(1, ids)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * 2.5
        elif self.router.startswith("ernie"):
            probs = torch.softmax(logits, dim=1)
            ids = torch.topk(probs + self.score_bias_row.squeeze(), K, dim=-1)[1]
            weights = torch.gather(probs, dim=-1, index=ids)
            total = weights.sum(dim=-1, keepdim=True)
            capped = total.clamp(max=0.5) if self.router == "ernie-capped" else torch.clamp(total, min=1e-12)
            weights = weights / capped
        else:
            probs = torch.softmax(logits, -1) if self.router == "softmax" else torch.sigmoid(logits)
            weights, ids = torch.topk(probs, K, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
        if self.capacity:  # Switch-style capacity: an expert takes its first `capacity` tokens only
            onehot = F.one_hot(ids, E).sum(1)  # [N, E]
            earlier = torch.cumsum(onehot, 0) - onehot
            weights = weights * (earlier.gather(1, ids) < self.capacity).to(weights.dtype)
        tokens = flat.repeat_interleave(K, dim=0)
        gate_up = self.gate_up_proj[ids.reshape(-1)]
        down = self.down_proj[ids.reshape(-1)]
        if self.transposed:
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        h = torch.bmm(gate_up, tokens.unsqueeze(-1)).squeeze(-1)
        if self.act.startswith("gpt-oss"):
            h = h + self.gate_up_proj_bias[ids.reshape(-1)]
            y = torch.bmm(down, self._gpt_oss(h).unsqueeze(-1)).squeeze(-1)
            y = y + self.down_proj_bias[ids.reshape(-1)]
        else:
            g, u = h.chunk(2, dim=-1)
            act = F.silu(g) if self.act == "silu" else F.gelu(g)
            y = torch.bmm(down, (act * u).unsqueeze(-1)).squeeze(-1)
        y = y * weights.reshape(-1, 1)
        return y.view(-1, K, H).sum(1).view_as(x)


def moe_sites(module: nn.Module) -> list[fs.MoESite]:
    return fs.find_sites(capture(module, torch.randn(B, T, H))).moe


@pytest.mark.parametrize(
    ("transposed", "router"),
    [
        (False, "softmax"),
        (True, "softmax"),
        (False, "sigmoid"),
        (False, "logits-softmax"),
        (False, "deepseek"),
        (False, "ernie"),
    ],
)
def test_stacked_experts_are_verified_and_their_layout_resolved(transposed, router):
    module = StackedMoE(transposed=transposed, router=router)
    (site,) = moe_sites(module)  # DeepSeek's per-group top-2 and group top-1 are not routers
    assert site.blocker is None, site.blocker
    assert site.num_experts == E and site.top_k == K
    scoring = {"logits-softmax": "top-k logits, then softmax", "deepseek": "sigmoid", "ernie": "softmax"}
    scoring = scoring.get(router, router)
    assert site.report.detail.endswith(f"; {scoring} router"), site.report.detail
    # the weights the experts read: after renormalisation (and DeepSeek's scale)
    want = {"deepseek": (aten.mul,), "logits-softmax": (aten.softmax, aten._softmax)}.get(router, (aten.div,))
    assert m.is_op(site.topk_weights, *want), site.topk_weights
    w_gate, w_up, w_down = site.expert_weights()
    gate_up = module.gate_up_proj.transpose(1, 2) if transposed else module.gate_up_proj
    down = module.down_proj.transpose(1, 2) if transposed else module.down_proj
    assert torch.equal(w_gate, gate_up[:, :FF]) and torch.equal(w_up, gate_up[:, FF:])
    assert torch.equal(w_down, down)


@pytest.mark.parametrize("transposed", [False, True])
def test_gpt_oss_experts_biases_and_clamped_activation_are_read(transposed):
    module = StackedMoE(router="logits-softmax", act="gpt-oss", transposed=transposed)
    (site,) = moe_sites(module)
    assert site.blocker is None, site.blocker
    assert site.activation == fs.ExpertActivation(gate_alpha=1.702, clamp_limit=7.0, up_offset=1.0)
    assert "interleaved" in site.report.detail and "clamped to 7" in site.report.detail
    w_gate, w_up, _ = site.expert_weights()
    gate_up = module.gate_up_proj.transpose(1, 2) if transposed else module.gate_up_proj
    assert torch.equal(w_gate, gate_up[:, 0::2]) and torch.equal(w_up, gate_up[:, 1::2])
    b_gate, b_up, b_down = site.expert_biases()
    assert torch.equal(b_gate, module.gate_up_proj_bias[:, 0::2])
    assert torch.equal(b_up, module.gate_up_proj_bias[:, 1::2])
    assert torch.equal(b_down, module.down_proj_bias)


@pytest.mark.parametrize("act", ["gpt-oss-up-from-above", "gpt-oss-two-limits"])
def test_clamps_the_op_does_not_take_are_skipped_even_where_samples_stay_inside_them(act):
    # Random samples rarely reach the limit 7 here, so only the check with inputs scaled past it
    # tells these clamps from gpt-oss's.
    (site,) = moe_sites(StackedMoE(router="logits-softmax", act=act))
    assert site.report.status == "skipped"
    assert "does not match" in site.report.reason and "clamped activations" in site.report.reason


def test_activation_formula():
    gate, up = torch.randn(6, 5) * 10, torch.randn(6, 5) * 10
    gate[0, 0], up[0, 1], up[1, 2] = 9.0, -9.0, 9.0  # the clamps exercised whatever the draw
    torch.testing.assert_close(fs.ExpertActivation().apply(gate, up), F.silu(gate) * up)
    oss = fs.ExpertActivation(1.702, 7.0, 1.0)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    torch.testing.assert_close(oss.apply(gate, up), (u + 1) * g * torch.sigmoid(1.702 * g))
    assert (gate > 7).any() and (up.abs() > 7).any()  # the clamps were exercised


def test_reference_model_dense_loop_is_found():
    from wmoe_compile.models import build_model

    model = build_model("tiny", num_layers=1)
    model.setup_cache(B, S)
    gm = capture(model, torch.randint(1, 256, (B, T)), torch.arange(T))
    (site,) = fs.find_sites(gm).moe
    assert site.blocker is None and "dense masked loop" in site.report.detail
    w_gate, w_up, w_down = site.expert_weights()
    experts = model.layers[0].moe.experts
    assert all(torch.equal(w_gate[e], experts[e].w1.weight) for e in range(len(experts)))
    assert all(torch.equal(w_down[e], experts[e].w2.weight) for e in range(len(experts)))


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(act="gelu"), "does not match a top-k SwiGLU mixture"),
        (dict(router="deepseek-logits"), "routing weights not found"),
        (dict(capacity=2), "does not match a top-k SwiGLU mixture"),
        (dict(router="ernie-capped"), "does not match a top-k SwiGLU mixture"),
    ],
)
def test_moe_that_is_not_softmax_topk_swiglu_is_skipped(kwargs, reason):
    (site,) = moe_sites(StackedMoE(**kwargs))
    assert site.report.status == "skipped" and reason in site.report.reason


def test_reference_moe_formula_matches_a_per_token_loop():
    w_gate, w_up, w_down = torch.randn(E, FF, H), torch.randn(E, FF, H), torch.randn(E, H, FF)
    x = torch.randn(5, H)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(5)])
    w = torch.rand(5, K)
    got = fs.reference_moe(x, ids, w, w_gate, w_up, w_down)
    for n in range(5):
        want = sum(
            w[n, k] * (w_down[e] @ (F.silu(w_gate[e] @ x[n]) * (w_up[e] @ x[n])))
            for k, e in enumerate(ids[n].tolist())
        )
        torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-4)


def test_lifted_graph_reports_why_nothing_can_be_rewritten():
    # ExportedProgram.graph_module (not .module()): parameters and caches are graph inputs.
    from wmoe_compile.models import build_model

    model = build_model("tiny", num_layers=1)
    model.setup_cache(B, S)
    with torch.no_grad():
        program = torch.export.export(model, (torch.randint(1, 256, (B, T)), torch.arange(T)))
    sites = fs.find_sites(program.graph_module)
    reasons = {r.kind: r.reason for r in sites.reports()}
    assert {r.status for r in sites.reports()} == {"skipped"}
    assert "cache is a graph input" in reasons["kv_write"]
    assert reasons["attention"].startswith("K: cache is a graph input")
    assert "expert weights are graph inputs" in reasons["moe"]


class FusedCpuAttention(nn.Module):
    """Attention through the fused CPU flash kernel op: a variant the passes do not rewrite."""

    def forward(self, q, k, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0]


def test_unknown_attention_op_is_reported_with_its_name():
    q, k, v = (torch.randn(B, HQ, T, D) for _ in range(3))
    (attention,) = fs.find_sites(capture(FusedCpuAttention(), q, k, v)).attention
    assert attention.report.status == "skipped"
    assert "_scaled_dot_product_flash_attention_for_cpu" in attention.report.reason
    assert "not supported" in attention.report.reason


class LatentAttention(nn.Module):
    """Multi-head latent attention in the shape HF DeepSeek-V3 runs it: the cache holds a latent
    [B, 1, S, R] written with index_copy_, and K/V are projected from the whole cached latent every
    step (latent=False: the same attention with no cache at all, K/V straight from x)."""

    def __init__(self, latent: bool = True) -> None:
        super().__init__()
        self.latent = latent
        self.q_proj = nn.Linear(H, HQ * D, bias=False)
        self.down = nn.Linear(H, 8, bias=False)  # x -> latent
        self.up = nn.Linear(8, 2 * HQ * D, bias=False)  # latent -> K and V of every head
        self.register_buffer("latent_cache", torch.zeros(B, 1, S, 8), persistent=False)

    def forward(self, x, positions):
        q = self.q_proj(x).view(B, -1, HQ, D).transpose(1, 2)
        latent = self.down(x).unsqueeze(1)  # [B, 1, T, 8]
        if self.latent:
            self.latent_cache.index_copy_(2, positions, latent)
            latent = self.latent_cache
        kv = self.up(latent.squeeze(1)).view(B, -1, HQ, 2 * D).transpose(1, 2)
        k, v = kv.split(D, dim=-1)
        return F.scaled_dot_product_attention(q, k, v)


@pytest.mark.parametrize(
    ("latent", "reason"),
    [(True, "computed from cache latent_cache"), (False, "no KV cache: attention reads K/V straight")],
)
def test_attention_over_a_cached_latent_is_skipped_with_its_own_reason(latent, reason):
    sites = fs.find_sites(capture(LatentAttention(latent), torch.randn(B, T, H), torch.arange(T)))
    (attention,) = sites.attention
    assert attention.report.status == "skipped" and reason in attention.report.reason, attention.report
    assert len(sites.kv) == 2 and all(reason in kv.report.reason for kv in sites.kv)


class MaxRoutedMoE(nn.Module):
    """Top-1 routing through max() instead of topk (as PhiMoE's sparsemixer selects), with
    experts under an `experts` module: no router is recognised, so the block must be reported."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(nn.Linear(H, H, bias=False) for _ in range(E))

    def forward(self, x):
        flat = x.reshape(-1, H)
        weight, chosen = torch.softmax(self.gate(flat), -1).max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out = out + (chosen == e).unsqueeze(-1) * weight.unsqueeze(-1) * expert(flat)
        return out.view_as(x)


def test_experts_without_a_recognised_router_are_reported_not_left_silently():
    (site,) = moe_sites(MaxRoutedMoE())
    assert site.report.status == "skipped" and site.blocker == site.report.reason
    assert "expert weights under experts, but no router feeding them was recognised" in site.report.reason
    assert not moe_sites(StackedMoE())[0].blocker  # a recognised router covers its experts
