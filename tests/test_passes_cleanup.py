"""cleanup_graph on hand-built graphs: what it removes, and what it must keep."""

from __future__ import annotations

import torch
from torch import fx
from wmoe_compile.passes import cleanup_graph
from wmoe_compile.passes._context import PassContext
from wmoe_compile.passes.find_sites import Sites

aten = torch.ops.aten


def _graph_with_dropouts(train_flags: tuple[bool, ...]) -> fx.GraphModule:
    """x -> out = x * 2; beside it, for each flag, an unused dropout(softmax(x), 0.1, train) branch
    (what a swapped eager attention leaves: its weights' dropout, nothing reading it)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    out = graph.call_function(aten.mul.Tensor, (x, 2.0))
    for train in train_flags:
        weights = graph.call_function(aten.softmax.int, (x, -1))
        graph.call_function(aten.dropout.default, (weights, 0.1, train))
    graph.output(out)
    return fx.GraphModule(torch.nn.Module(), graph)


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_an_unused_inference_dropout_and_the_branch_it_kept_are_removed():
    gm = _graph_with_dropouts((False,))
    x = torch.randn(3, 4)
    result = cleanup_graph.run(PassContext(gm=gm, config=None, sites=Sites()))
    assert result.changed and _targets(gm) == [aten.mul.Tensor]  # the softmax went with it
    torch.testing.assert_close(gm(x), x * 2)


def test_an_unused_training_dropout_is_kept():
    # train=True draws random numbers: removing it would change the generator's state for what follows
    gm = _graph_with_dropouts((True, False))
    cleanup_graph.run(PassContext(gm=gm, config=None, sites=Sites()))
    dropouts = [n for n in gm.graph.nodes if n.target == aten.dropout.default]
    assert [n.args[2] for n in dropouts] == [True]
    assert _targets(gm).count(aten.softmax.int) == 1
