"""Cache writes deferred to the attention's side stream: the pass overlap_cache_writes, the op
wmoe::kv_compress_into_cache_overlapped and the stream bookkeeping (kernels/side_stream.py).

On the CPU the overlapped op writes in order, so the CPU tests check what the pass rewrites and
leaves alone, that the op's contract equals kv_compress_into_cache's, and the bookkeeping. The GPU
tests check that deferred writes give bit-identical attention, eagerly and in a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch
from test_passes_find_sites import CachedAttention, attention_inputs
from test_passes_rewrites import run_fresh, transform_module
from wmoe_compile.kernels import side_stream
from wmoe_compile.passes import overlap_cache_writes
from wmoe_compile.passes._context import PassContext
from wmoe_compile.passes.find_sites import Sites

import wmoe_compile as wc
import wmoe_compile.ops  # noqa: F401  registers the ops
from wmoe_compile.codec import get_codec
from wmoe_compile.ops import kv_codec as ops

OVERLAPPED = "wmoe.kv_compress_into_cache_overlapped.default"
IN_ORDER = "wmoe.kv_compress_into_cache.default"


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the rewriting is under test, not the kernels


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _transform(config, module=None):
    inputs = attention_inputs("plain")
    _, rewritten, report = transform_module(module or CachedAttention("plain"), config, inputs)
    return rewritten, report, inputs


def _notes(report) -> str:
    return " ".join(n for p in report.passes if p.name == "overlap_cache_writes" for n in p.notes)


def test_both_writes_of_a_swapped_attention_are_overlapped_and_outputs_are_unchanged():
    config = wc.CompileConfig(codec="default;window=4;sinks=1")
    module = CachedAttention("plain")
    ordered, _, inputs = _transform(config.replace(overlap_cache_writes=False), module)
    overlapped, report, _ = _transform(config, module)
    assert _targets(overlapped).count(OVERLAPPED) == 2 and IN_ORDER not in _targets(overlapped)
    assert "2 cache writes overlapped" in _notes(report)
    # the node count stays; the printed pass table names the retargeted ops
    line = next(x for x in str(report).splitlines() if " overlap_cache_writes " in x)
    assert (
        "(+0)" in line and "-2 wmoe.kv_compress_into_cache, +2 wmoe.kv_compress_into_cache_overlapped" in line
    )
    assert _targets(ordered).count(IN_ORDER) == 2 and OVERLAPPED not in _targets(ordered)
    # on the CPU the overlapped op writes in order: the same caches, the same output
    assert torch.equal(run_fresh(overlapped, inputs), run_fresh(ordered, inputs))


def test_on_by_default_and_switched_off_by_its_option():
    config = wc.CompileConfig(codec="default;window=4;sinks=1")
    assert config.overlap_cache_writes
    _, report, _ = _transform(config.replace(overlap_cache_writes=False))
    assert "overlap_cache_writes=False" in _notes(report)


def test_writes_no_wavelet_attention_reads_stay_in_order():
    config = wc.CompileConfig(codec="default;window=4;sinks=1", swap_attention=False)
    rewritten, report, _ = _transform(config)
    assert OVERLAPPED not in _targets(rewritten)
    assert "no wavelet_attention reads these caches" in _notes(report)


def test_another_reader_between_the_write_and_the_attention_keeps_that_write_in_order():
    rewritten, _, _ = _transform(
        wc.CompileConfig(codec="default;window=4;sinks=1", overlap_cache_writes=False)
    )
    graph = rewritten.graph
    attention = next(n for n in graph.nodes if n.target == torch.ops.wmoe.wavelet_attention.default)
    k_codes = attention.args[1]
    with graph.inserting_before(attention):  # a second reader of the K codes, kept alive as an output
        peek = graph.call_function(torch.ops.aten.clone.default, (k_codes,))
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = (
        ((*output.args[0], peek),) if isinstance(output.args[0], tuple) else ((output.args[0], peek),)
    )
    rewritten.recompile()
    ctx = PassContext(gm=rewritten, config=wc.CompileConfig(overlap_cache_writes=True), sites=Sites())
    result = overlap_cache_writes.run(ctx)
    assert _targets(rewritten).count(OVERLAPPED) == 1  # V's write; K's has the reader in between
    k_write = next(
        n
        for n in graph.nodes
        if n.op == "call_function" and n.args[1:2] == (k_codes,) and "compress" in str(n.target)
    )
    assert str(k_write.target) == IN_ORDER
    assert any(f"uses {k_codes.name} between the write and {attention.name}" in n for n in result.notes)


@pytest.mark.parametrize("tokens", [1, 3, 40])  # 40 > the window: a prefill chunk
def test_the_overlapped_op_writes_what_the_ordinary_op_writes(tokens):
    spec = get_codec("default;window=32;sinks=4", 64).spec
    x = torch.randn(2, 3, tokens, 64)
    cs = torch.rand(3, 64) + 0.5
    positions = torch.arange(tokens) + 70
    want = ops.allocate_cache(spec, 2, 3, 160, 64, torch.float32)
    got = ops.allocate_cache(spec, 2, 3, 160, 64, torch.float32)
    for a, b in zip(want, got, strict=True):
        fill = (
            torch.randint(0, 255, a.shape, dtype=torch.uint8)
            if a.dtype == torch.uint8
            else torch.randn(a.shape)
        )
        a.copy_(fill.to(a.dtype))
        b.copy_(fill.to(b.dtype))
    torch.ops.wmoe.kv_compress_into_cache(x, *want, positions, cs, spec)
    torch.ops.wmoe.kv_compress_into_cache_overlapped(x, *got, positions, cs, spec)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    assert not any(side_stream.pending(c) for c in got)  # nothing deferred off the GPU
    torch.library.opcheck(
        torch.ops.wmoe.kv_compress_into_cache_overlapped.default, (x, *got, positions, cs, spec)
    )


def test_side_stream_bookkeeping():
    caches = (torch.zeros(4), torch.zeros(5))
    keep = (torch.ones(3),)
    side_stream.defer(caches, keep)
    assert all(side_stream.pending(c) for c in caches)
    assert not side_stream.pending(torch.zeros(4))
    side_stream.join(torch.device("cpu"), caches)  # no stream on the CPU: just forgets
    assert not any(side_stream.pending(c) for c in caches)


def _decode_case(batch: int, n: int):
    from test_wavelet_attention import UNIFORM_REAL, make_case

    codec, args = make_case(
        UNIFORM_REAL, batch, 2, 4, 1, 128, [n] * batch, n + 64, torch.bfloat16, "cuda", "full"
    )
    return codec, args


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [2, 9])  # 4 programs: v1 (joins first); 18: v3 and its side stream
def test_gpu_deferred_write_then_attention_equals_the_in_order_write_also_in_a_cuda_graph(batch):
    # One decode step: write the new token (position n - 1) into the compressed cache, then attend.
    # Deferred to the side stream, the write must land before the exact-token kernel reads it, and
    # the result must be bit-identical to the in-order write, eagerly and replayed from a CUDA
    # graph whose new token changed after capture.
    n = 3000
    codec, args = _decode_case(batch, n)
    q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_cs, v_cs = args
    positions = torch.tensor([n - 1], device="cuda")
    k_new = torch.randn(batch, 2, 1, 128, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    k_caches, v_caches = (k_codes, k_scales, k_exact), (v_codes, v_scales, v_exact)

    def step(write):
        write(k_new, *k_caches, positions, k_cs, codec.spec)
        write(v_new, *v_caches, positions, v_cs, codec.spec)
        return torch.ops.wmoe.wavelet_attention(*args, codec.spec, 128**-0.5)

    in_order = step(torch.ops.wmoe.kv_compress_into_cache)
    assert torch.equal(step(torch.ops.wmoe.kv_compress_into_cache_overlapped), in_order)
    assert side_stream.STREAMS and not any(side_stream.pending(c) for c in k_caches + v_caches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(torch.ops.wmoe.kv_compress_into_cache_overlapped)
    for round_ in range(3):
        k_new.copy_(torch.randn_like(k_new))
        v_new.copy_(torch.randn_like(v_new))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, step(torch.ops.wmoe.kv_compress_into_cache)), round_


@pytest.mark.gpu
def test_gpu_a_chunk_longer_than_the_window_is_written_in_order():
    codec, args = _decode_case(2, 3000)
    x = torch.randn(2, 2, 200, 128, device="cuda", dtype=torch.bfloat16)  # window 128
    caches = (args[1], args[2], args[5])
    torch.ops.wmoe.kv_compress_into_cache_overlapped(
        x, *caches, torch.arange(200, device="cuda") + 2800, args[8], codec.spec
    )
    assert not any(side_stream.pending(c) for c in caches)


def _channel_params(model) -> dict:
    """Fixed channel parameters per layer (full form [Hkv, D + 2, D]: rotation, scale, offset), so
    two compiles share them instead of calibrating each."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hkv, d = model.cfg.num_kv_heads, model.cfg.head_dim

    def one() -> torch.Tensor:
        g = torch.randn(hkv, d, d, device="cuda", generator=gen, dtype=torch.float64)
        rotation = torch.linalg.qr(g)[0]
        scale = torch.rand(hkv, 1, d, device="cuda", generator=gen) + 0.5
        offset = torch.randn(hkv, 1, d, device="cuda", generator=gen) * 0.1
        return torch.cat([rotation.float(), scale, offset], dim=1).contiguous()

    return {i: {"k": one(), "v": one()} for i in range(len(model.layers))}


class _CompiledRuns:
    """Generate with freshly compiled copies of one Mixtral-shaped model (2 layers, batch 3, a
    1,100-token prompt: longer than the exact window, so the split kernel reads compressed
    positions; 24 programs: the v3 split kernel, the exact-token kernel and deferred writes on the
    side stream) and return the tokens and every compressed-cache tensor. Each run compiles anew
    under Inductor's deterministic mode: otherwise Inductor picks among its reduction kernels'
    configs by timing them, so two compiles of one graph may sum in different orders.
    replace_moe off: the MoE op's split-K sums need not be bitwise repeatable, and the MoE is not
    under test."""

    def __init__(self) -> None:
        import torch._inductor.config as inductor_config

        from wmoe_compile.models import build_model

        if not hasattr(inductor_config, "deterministic"):
            pytest.skip("this torch's Inductor has no deterministic mode: two compiles need not sum alike")
        self.inductor_config = inductor_config
        self.model = build_model(
            "mixtral-8x7b",
            num_layers=2,
            ffn_size=256,
            num_experts=4,
            vocab_size=512,
            max_seq_len=1152,
            dtype=torch.bfloat16,
            device="cuda",
        )
        self.params = _channel_params(self.model)
        self.prompt = torch.randint(0, self.model.cfg.vocab_size, (3, 1100), device="cuda")

    def run(self, overlap: bool, graphed: bool) -> tuple[torch.Tensor, list[torch.Tensor], str]:
        """(tokens, caches, the compile's overlap_cache_writes notes)."""
        from wmoe_compile.lowering import GraphedDecodeStep, compile_backend

        model = self.model
        torch._dynamo.reset()
        options = {"channel_params": self.params, "replace_moe": False, "overlap_cache_writes": overlap}
        with self.inductor_config.patch(deterministic=True):
            compiled = torch.compile(model, backend="wmoe", options=options)
            step = GraphedDecodeStep(compiled) if graphed else compiled
            model.setup_cache(3, 1120)
            tokens = model.generate(self.prompt, 12, step_fn=step)
        torch.cuda.synchronize()
        caches = [
            t.clone()
            for layer in model.layers
            for cache in (layer.attn.k_cache, layer.attn.v_cache)
            for t in compile_backend.compressed_state(cache).values()
        ]
        return tokens, caches, _notes(compile_backend.compile_reports()[-1])


def _assert_same(got: tuple, want: tuple, label: str) -> None:
    tokens, caches, _ = got
    assert torch.equal(tokens, want[0]), label
    assert len(caches) == len(want[1])
    for i, (g, w) in enumerate(zip(caches, want[1], strict=True)):
        assert torch.equal(g, w), f"{label}: cache tensor {i}"


@pytest.mark.gpu
def test_gpu_two_in_order_compiles_generate_the_same_tokens_and_caches():
    # the control for the test below: two compiles of the same graph, both in order, must agree
    # bitwise in Inductor's deterministic mode. (The test below failed with WMOE_TEST_SEED=3830984124
    # before that mode was set, with this session's and the thirteenth session's kernels, once in
    # its uncaptured run and once in its replayed one: equal tokens, some cache bytes not. If this
    # test fails too, the compiled model is not repeatable; if only the one below does, the deferred
    # writes race.)
    runs = _CompiledRuns()
    first = runs.run(overlap=False, graphed=False)
    _assert_same(runs.run(overlap=False, graphed=False), first, "second in-order compile")


@pytest.mark.gpu
def test_gpu_compiled_model_generates_the_same_tokens_and_caches_with_overlapped_writes():
    # The default compile (overlap_cache_writes on) against the in-order one: tokens and every byte
    # of the compressed caches must be equal, uncaptured and replayed from a CUDA graph.
    runs = _CompiledRuns()
    want = runs.run(overlap=False, graphed=False)
    assert "overlap_cache_writes=False" in want[2]
    for graphed in (False, True):
        got = runs.run(overlap=True, graphed=graphed)
        assert "cache writes overlapped" in got[2]
        _assert_same(got, want, f"overlapped, graphed={graphed}")
