"""benchmarks/bench_decode.py's host side (the run itself needs a GPU): its arguments are checked
before anything runs, and its table renders rows whose eager variants were skipped."""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_benchmark


@pytest.mark.parametrize(
    "argv",
    [
        ["--skip", "eagr"],
        ["--wmoe-inductor-config", "[1, 2]"],
        ["--wmoe-inductor-config", "{not json"],
        ["--wmoe-off", "decompose_topk,fuse_linear"],
    ],
)
def test_bad_arguments_are_refused_by_name(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark("bench_decode").main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert argv[0].lstrip("-") in err, err


def test_rows_without_eager_render_with_dashes_and_the_options_in_the_header():
    bench = load_benchmark("bench_decode")
    env = dict(
        layers=2,
        gpu="H200",
        torch="2.11",
        triton="3.6",
        date="2026-11-30",
        codec="default",
        wmoe_off=["decompose_topk", "fuse_linears"],
        wmoe_inductor_config={"max_autotune_gemm": True},
    )
    row = dict(B=8, N=131072, wmoe_ms=1.9, inductor_ms=3.6, wmoe={"call_ms": 3.0, "graph_ms": 1.9})
    capacity = bench.kv_capacity("default", 80.0)
    table = bench.render(env, [row], capacity)
    assert "wmoe with decompose_topk, fuse_linears off" in table and "max_autotune_gemm" in table
    line = next(x for x in table.splitlines() if x.startswith("| 8 | 131072 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:4] == ["-", "-"]  # eager routed / dense skipped
    assert cells[10] == "1.89x"  # vs inductor still computed


def _tiny_decode_step():
    """bench_decode, the tiny 2-layer model with a cache for 3 sequences, and one decode step's tokens."""
    from wmoe_compile.models import build_model

    bench = load_benchmark("bench_decode")
    model = build_model("tiny", num_layers=2)
    model.setup_cache(3, 16)
    return bench, model, model.cfg, torch.randint(0, model.cfg.vocab_size, (3, 1))


def test_step_read_bytes_counts_the_routed_experts_and_every_other_weight():
    # the read floor's byte count, by hand on the tiny model: experts of the hit count per layer,
    # every other weight in full, the embedding only at the step's token rows, plus the KV bytes
    bench, model, cfg, tokens = _tiny_decode_step()
    hit = bench.experts_hit(model, tokens, torch.tensor([5]))
    assert len(hit) == 2 and all(
        cfg.experts_per_token <= n <= min(cfg.num_experts, 3 * cfg.experts_per_token) for n in hit
    )
    expert = 3 * cfg.hidden_size * cfg.ffn_size * 4  # w1, w3, w2 in fp32
    layer_other = sum(
        p.numel() for name, p in model.layers[0].named_parameters() if ".experts." not in f".{name}"
    )
    other = 2 * layer_other + cfg.hidden_size + cfg.vocab_size * cfg.hidden_size  # final norm, lm_head
    read = bench.step_read_bytes(model, 3, [2, 5], kv_bytes=1000)
    assert read["experts"] == 7 * expert
    assert read["other_weights"] == 4 * other + 3 * cfg.hidden_size * 4
    assert read["kv"] == 1000
    assert read["total"] == read["experts"] + read["other_weights"] + 1000
    with pytest.raises(ValueError, match="2 layers"):
        bench.step_read_bytes(model, 3, [2], kv_bytes=0)


def test_router_choices_are_the_models_own_routing():
    # the breakdown times each layer's MoE with the step's routing: per layer the top-k ids the
    # model's MoE computes and their renormalised weights
    bench, model, cfg, tokens = _tiny_decode_step()
    seen = []
    hooks = [
        layer.moe.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0]))
        for layer in model.layers
    ]
    choices = bench.router_choices(model, tokens, torch.tensor([5]))
    for hook in hooks:
        hook.remove()
    assert len(choices) == 2
    for (ids, weights), x in zip(choices, seen, strict=True):
        assert ids.shape == weights.shape == (3, cfg.experts_per_token)
        assert weights.dtype == x.dtype
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(3))
    for layer, (ids, _), x in zip(model.layers, choices, seen, strict=True):
        want = torch.softmax(layer.moe.gate(x.reshape(3, -1)).float(), -1).topk(cfg.experts_per_token, -1)
        assert torch.equal(ids, want.indices)
    assert bench.experts_hit(model, tokens, torch.tensor([5])) == bench.distinct_experts(choices)
    assert bench.distinct_experts([(torch.tensor([[0, 3], [3, 1]]), None)]) == [3]


def test_floor_table_divides_each_baseline_by_the_floor():
    bench = load_benchmark("bench_decode")
    row = dict(
        B=8,
        N=131072,
        copy_TBps=4.0,
        experts_hit=[8, 7],
        wmoe_step_read_bytes=dict(experts=4.0e9, other_weights=0.4e9, kv=1.6e9, total=6.0e9),
        wmoe_floor_ms=1.5,
        wmoe_ms=1.8,
        inductor_ms=3.3,
    )
    lines = bench.render_floor([row, dict(B=1, N=8, error="out of memory")])
    line = next(x for x in lines if x.startswith("| 8 | 131072 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:9] == ["8, 7", "4.00 / 0.40 / 1.60", "1.500", "1.800", "1.20", "2.20x", "-"]
    assert not any(x.startswith("| 1 | 8 |") for x in lines)  # a failed shape has no floor row
    assert bench.render_floor([dict(B=1, N=8, error="x")]) == []


def test_back_to_back_table_compares_graph_replays_only_and_skips_rows_without_them():
    bench = load_benchmark("bench_decode")
    timed = dict(
        B=8,
        N=131072,
        **{"eager-dense-graph_ms": 4.0, "eager-dense-graph_b2b_ms": 3.9},
        **{"inductor-dense": {"call_ms": 3.0, "graph_ms": 3.6, "graph_b2b_ms": 3.5}},
        wmoe={"call_ms": 4.0, "graph_ms": 1.85, "graph_b2b_ms": 1.75},
    )
    untimed = dict(B=32, N=32768, wmoe={"call_ms": 4.0, "graph_ms": 2.0})  # an older JSON row
    lines = bench.render_back_to_back([timed, untimed])
    rows = [x for x in lines if x.startswith("| 8 |") or x.startswith("| 32 |")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[2:7] == ["3.900", "3.500", "1.750", "2.23x", "2.00x"]  # 3.5 / 1.75, not 3.0 (a call)
    assert cells[7] == "4.000 / 3.600 / 1.850"
    assert bench.render_back_to_back([untimed]) == []


def test_back_to_back_ms_is_the_median_of_mean_replay_times(monkeypatch):
    bench = load_benchmark("bench_decode")
    clock = {"now": 0.0}
    durations = iter([1.0] * 5 + [2.0] * 5 + [9.0] * 5)  # ms per replay in three repeats

    class FakeEvent:
        def __init__(self, enable_timing):
            self.at = None

        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.at - self.at

    def replay():
        clock["now"] += next(durations)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert bench.back_to_back_ms(replay, replays=5, repeats=3) == 2.0


def test_graph_times_report_a_failed_capture_as_none_not_an_error(monkeypatch, capsys):
    bench = load_benchmark("bench_decode")

    def no_stream(*args, **kwargs):
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(torch.cuda, "Stream", no_stream)
    assert bench.graph_times(lambda: None) == (None, None)
    assert bench.graph_ms(lambda: None) is None
    assert "CUDA graph capture failed: RuntimeError: no CUDA here" in capsys.readouterr().out
