"""fuse_sibling_linears: live linears of one input become one linear over stacked weights, with the
same outputs; anything else is left alone with a reason."""

from __future__ import annotations

import torch
from torch import nn
from wmoe_compile.passes import find_sites, fuse_sibling_linears

import wmoe_compile as wc
from wmoe_compile.pipeline import run_passes

aten = torch.ops.aten


class Siblings(nn.Module):
    """q/k/v-like projections of one input and one linear of another input."""

    def __init__(self, bias: bool | tuple[bool, bool, bool] = False) -> None:
        super().__init__()
        biases = bias if isinstance(bias, tuple) else (bias,) * 3
        self.q = nn.Linear(32, 32, bias=biases[0])
        self.k = nn.Linear(32, 8, bias=biases[1])
        self.v = nn.Linear(32, 8, bias=biases[2])
        self.other = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return q.sum(-1, keepdim=True) * k + v + self.other(y)


def _run(module: nn.Module, config: wc.CompileConfig | None = None, dead_sibling: bool = False):
    """(graph after the pass, report, module outputs, graph outputs) on fresh random inputs."""
    args = (torch.randn(3, 5, 32), torch.randn(3, 5, 16))
    gm = torch.export.export(module, args).module()
    if dead_sibling:  # a linear of x that nothing reads (export itself would have dropped it)
        gm.register_buffer("dead_weight", torch.randn(64, 32))
        x = next(n for n in gm.graph.nodes if n.op == "placeholder")
        with gm.graph.inserting_after(x):
            weight = gm.graph.get_attr("dead_weight")
        with gm.graph.inserting_after(weight):
            gm.graph.call_function(aten.linear.default, (x, weight))
        gm.recompile()
    want = module(*args)
    report = run_passes(gm, config or wc.CompileConfig(), passes=(find_sites, fuse_sibling_linears))
    return gm, report, want, gm(*args)


def _linears(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.linear.default]


def test_three_projections_of_one_input_become_one_linear_with_the_same_outputs():
    torch.manual_seed(0)
    gm, report, want, got = _run(Siblings())
    linears = _linears(gm)
    assert len(linears) == 2  # q/k/v fused, the other input's linear alone
    fused = next(n for n in linears if n.args[1].target.startswith("wmoe_fused_linear"))
    assert tuple(getattr(gm, fused.args[1].target).shape) == (48, 32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    notes = report.passes[-1].notes
    assert notes[0] == "1 group(s) of sibling linears fused", notes


def _fused_weight(gm) -> torch.Tensor:
    fused = next(n for n in _linears(gm) if n.args[1].target.startswith("wmoe_fused_linear"))
    return getattr(gm, fused.args[1].target)


def test_the_fused_weight_holds_the_members_rows_once_and_follows_their_updates():
    torch.manual_seed(6)
    module = Siblings()
    gm, report, want, got = _run(module)
    fused = _fused_weight(gm)
    # the caller's parameters are now rows of the fused weight: one storage, not two copies
    for start, linear in zip((0, 32, 40), (module.q, module.k, module.v), strict=True):
        assert linear.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
        assert linear.weight.data_ptr() == fused[start].data_ptr()
    assert "weights held once" in report.passes[-1].notes[1]
    # an in-place update of a member (load_state_dict, an optimizer step) reaches the fused graph
    x, y = torch.randn(3, 5, 32), torch.randn(3, 5, 16)
    with torch.no_grad():
        module.k.weight.mul_(-2.0)
    torch.testing.assert_close(gm(x, y), module(x, y), rtol=1e-5, atol=1e-5)


def test_a_second_graph_of_the_same_module_reuses_the_stacked_rows():
    # e.g. the prefill graph compiled after the decode graph: no second fused copy
    torch.manual_seed(7)
    module = Siblings()
    first, _, _, _ = _run(module)
    second, report, want, got = _run(module)
    assert _fused_weight(second).data_ptr() == _fused_weight(first).data_ptr()
    assert "weights held once" in report.passes[-1].notes[1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _PinnedParameter(nn.Parameter):
    """A parameter whose storage cannot be re-pointed (as with some tensor subclasses)."""

    @property
    def data(self) -> torch.Tensor:
        return super().data

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        raise RuntimeError("this parameter's storage cannot be replaced")


def test_members_that_cannot_be_re_pointed_are_copied_and_the_pass_says_so():
    torch.manual_seed(8)
    module = Siblings()
    module.k.weight = _PinnedParameter(module.k.weight.detach().clone())
    gm, report, want, got = _run(module)
    assert "weights copied" in report.passes[-1].notes[1], report.passes[-1].notes
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_biases_are_stacked_too():
    torch.manual_seed(1)
    gm, _, want, got = _run(Siblings(bias=True))
    fused = [n for n in _linears(gm) if n.args[1].target.startswith("wmoe_fused_linear")]
    assert len(fused) == 1 and len(fused[0].args) == 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mixed_biases_are_left_unfused_with_the_reason():
    torch.manual_seed(2)
    gm, report, want, got = _run(Siblings(bias=(True, False, True)))
    assert len(_linears(gm)) == 4
    assert any("some have a bias and some do not" in note for note in report.passes[-1].notes)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_dead_sibling_is_not_fused_into_the_live_ones():
    # fusing it would keep its weight alive (e.g. an expert region replace_moe_dispatch replaced)
    torch.manual_seed(3)
    gm, _, want, got = _run(Siblings(), dead_sibling=True)
    fused = [n for n in _linears(gm) if n.args[1].target.startswith("wmoe_fused_linear")]
    assert len(fused) == 1 and getattr(gm, fused[0].args[1].target).shape[0] == 48  # not 48 + 64
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_switch_off_leaves_the_graph_alone():
    torch.manual_seed(4)
    gm, report, want, got = _run(Siblings(), wc.CompileConfig(fuse_linears=False))
    assert len(_linears(gm)) == 4 and not report.passes[-1].changed
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reference_model_fuses_qkv_per_layer_and_drops_the_original_weights(tiny_reference_program):
    program = tiny_reference_program
    record = next(p for p in program.wmoe_report.passes if p.name == "fuse_sibling_linears")
    assert record.notes[0] == "2 group(s) of sibling linears fused", record.notes
    state = program.state_dict | dict(program.named_buffers())
    assert not any(name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")) for name in state)
    assert record.numeric is not None and record.numeric["relative_error"] <= record.numeric["bound"]
