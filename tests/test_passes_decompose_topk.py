"""decompose_router_topk: a router's top-k becomes max-and-mask rounds that select the same experts
with the same weights (over probabilities, logits, and scores with -inf and NaN entries); a top-k
it cannot express that way is left alone with a reason."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from wmoe_compile.passes import decompose_router_topk, find_sites

import wmoe_compile as wc
from wmoe_compile.pipeline import run_passes

aten = torch.ops.aten


class Router(nn.Module):
    """Mixtral-style routing of `x` [tokens, experts] logits (or another top-k, for the negatives)."""

    def __init__(self, k: int, softmax: bool = True, dim: int = -1, largest: bool = True) -> None:
        super().__init__()
        self.k, self.softmax, self.dim, self.largest = k, softmax, dim, largest

    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32) if self.softmax else logits
        weights, ids = torch.topk(probs, self.k, dim=self.dim, largest=self.largest)
        return weights / weights.sum(-1, keepdim=True), ids


def _run(module: nn.Module, logits: torch.Tensor, config: wc.CompileConfig | None = None):
    gm = torch.export.export(module, (logits,)).module()
    report = run_passes(gm, config or wc.CompileConfig(), passes=(find_sites, decompose_router_topk))
    return gm, report.passes[-1]


def _topks(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.topk.default)


@pytest.mark.parametrize("experts,k", [(8, 2), (64, 6), (128, 8), (5, 5)])
def test_router_topk_selects_the_same_experts_and_weights(experts, k):
    logits = torch.randn(37, experts)
    gm, record = _run(Router(k), logits)
    assert _topks(gm) == 0 and record.changed, record.notes
    want_w, want_ids = Router(k)(logits)
    got_w, got_ids = gm(logits)
    assert torch.equal(got_ids, want_ids)  # distinct random values: one right answer, in order
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32


def test_ties_pick_distinct_experts_with_the_top_values():
    # equal logits (bf16 routers tie often): topk leaves the order open; the rewrite takes the lower
    # index first, and never takes an expert twice
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    gm, _ = _run(Router(3), logits)
    got_w, got_ids = gm(logits)
    assert got_ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    torch.testing.assert_close(got_w, torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize(
    "module,reason",
    [
        (Router(2, largest=False), "smallest"),
        (Router(2, dim=0), "not the last"),
        (Router(20), "outside k <="),
    ],
)
def test_other_topks_are_left_with_the_reason(module, reason):
    logits = torch.randn(24, 24)
    gm, record = _run(module, logits)
    assert _topks(gm) == 1 and not record.changed
    assert any(reason in note for note in record.notes), record.notes
    want = module(logits)
    got = gm(logits)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("experts,k", [(8, 2), (64, 6), (5, 5)])
def test_topk_of_logits_selects_the_same_experts_and_values(experts, k):
    # no softmax before it (Granite-style routers): taken experts tracked by index
    logits = torch.randn(37, experts) * 3
    gm, record = _run(Router(k, softmax=False), logits)
    assert _topks(gm) == 0 and record.changed, record.notes
    want_w, want_ids = Router(k, softmax=False)(logits)
    got_w, got_ids = gm(logits)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)


class RawTopk(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(scores, self.k, dim=-1)


def test_minus_inf_and_nan_entries_select_distinct_experts_like_topk():
    # DeepSeek masks the experts of unchosen groups with -inf: a row with fewer finite values than
    # k must still give k distinct experts; NaN is taken first, as topk takes it
    scores = torch.tensor(
        [
            [0.3, float("-inf"), 0.9, float("-inf"), float("-inf"), 0.1],
            [float("-inf")] * 6,
            [0.2, float("nan"), 0.5, 0.5, float("-inf"), 0.7],
        ]
    )
    gm, record = _run(RawTopk(4), scores)
    assert _topks(gm) == 0 and record.changed, record.notes
    values, ids = gm(scores)
    assert ids.tolist() == [[2, 0, 5, 1], [0, 1, 2, 3], [1, 5, 2, 3]]
    # the same values as topk (ties among -inf may pick other indices), each the input's value
    # at its index, no index twice
    want_values, _ = torch.topk(scores, 4, dim=-1)
    assert torch.equal(values.nan_to_num(), want_values.nan_to_num())
    assert torch.equal(scores.gather(-1, ids).nan_to_num(), values.nan_to_num())
    assert all(len(set(row)) == 4 for row in ids.tolist())


def test_deepseek_router_top_ks_are_all_rewritten_and_choose_the_same_experts():
    from test_passes_find_sites import StackedMoE

    module = StackedMoE(router="deepseek")
    x = torch.randn(2, 3, 32)
    gm = torch.export.export(module, (x,)).module()
    record = run_passes(gm, wc.CompileConfig(), passes=(find_sites, decompose_router_topk)).passes[-1]
    assert record.notes[0] == "3 router top-k(s) rewritten", record.notes  # group top-2, group, final
    assert _topks(gm) == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(x), module(x), rtol=1e-6, atol=1e-6)


def test_switch_off_leaves_the_graph_alone():
    gm, record = _run(Router(2), torch.randn(4, 8), wc.CompileConfig(decompose_topk=False))
    assert _topks(gm) == 1 and record.notes == ["decompose_topk=False: nothing rewritten"]


def test_reference_model_routers_are_rewritten_through_the_pipeline_with_the_numeric_check(
    tiny_reference_program,
):
    program = tiny_reference_program
    record = next(p for p in program.wmoe_report.passes if p.name == "decompose_router_topk")
    assert record.notes[0] == "2 router top-k(s) rewritten", record.notes
    assert record.numeric is not None and record.numeric["relative_error"] <= record.numeric["bound"]
    assert not any(n.target == aten.topk.default for n in program.graph_module.graph.nodes)


def test_inductor_fuses_the_rewritten_router_into_one_kernel_on_the_cpu():
    # the point of the rewrite: softmax, selection and renormalisation become one generated kernel
    # and the extern top-k call is gone (before: topk between two generated kernels)
    from torch._inductor.utils import run_and_get_code

    logits = torch.randn(8, 8)
    codes = {}
    for on in (False, True):
        gm, _ = _run(Router(2), logits, wc.CompileConfig(decompose_topk=on))
        torch._dynamo.reset()
        (weights, ids), code = run_and_get_code(torch.compile(gm), logits)
        want_w, want_ids = Router(2)(logits)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w)
        codes[on] = "\n".join(code)
    kernels = {on: re.findall(r"^(cpp_fused_\w+) = ", code, re.M) for on, code in codes.items()}
    assert "aten.topk" in codes[False] and len(kernels[False]) >= 2, kernels
    assert "aten.topk" not in codes[True] and len(kernels[True]) == 1, kernels
    assert "softmax" in kernels[True][0] and "max" in kernels[True][0].replace("softmax", ""), kernels
