"""The pipeline on HF transformers 5.x models built from tiny random configs (nothing downloaded).

Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, GraniteMoE, PhiMoE (its routing reported, not rewritten),
ERNIE 4.5 MoE, DeepSeek-V3 (MoE), gpt-oss (reported), sliding-window layers and a dense Llama
(SmolLM2-like: only the KV and attention rewrites apply); sdpa and eager attention; grouped_mm
and batched_mm experts; StaticCache (rewritten) and DynamicCache (found, reported, left dense).
Ops run their PyTorch references (TRITON_INTERPRET=0): the rewriting is under test here, not the
kernels.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.export import ExportedProgram

import wmoe_compile as wc
from wmoe_compile.pipeline import HFStaticCacheLM, example_inputs_for, tiny_hf_model

pytest.importorskip("transformers")

BATCH, CAPACITY, PROMPT = 2, 16, 5


@pytest.fixture(autouse=True)
def _reference_ops(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def reset_cache(wrapped: HFStaticCacheLM) -> None:
    for name, buffer in wrapped.named_buffers(recurse=False):
        if name.startswith(("key_cache_", "value_cache_")):
            buffer.zero_()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.parametrize(
    ("kind", "attention", "experts"),
    [
        ("mixtral", "sdpa", "grouped_mm"),
        ("qwen3-moe", "sdpa", "grouped_mm"),
        ("qwen2-moe", "sdpa", "grouped_mm"),  # + a sigmoid-gated shared expert, no renormalisation
        ("olmoe", "sdpa", "grouped_mm"),  # q/k norms over the whole projections
        ("granitemoe", "sdpa", "grouped_mm"),  # top-k of the logits, then softmax over the k
        ("phimoe", "sdpa", "grouped_mm"),  # sparsemixer routing: experts reported and left
        # softmax scores plus a [1, E] choice bias, gathered weights renormalised by a clamped sum
        ("ernie4.5-moe", "sdpa", "grouped_mm"),
        ("llama", "sdpa", None),
        ("mixtral", "eager", "batched_mm"),
    ],
)
def test_static_cache_models_are_rewritten_and_exact_with_bypass(kind, attention, experts):
    model = tiny_hf_model(kind, attn_implementation=attention, experts_implementation=experts, num_layers=1)
    wrapped = wc.prepare(model, batch_size=BATCH, max_cache_len=CAPACITY)
    args, _ = example_inputs_for(wrapped, tokens=PROMPT)
    # The per-pass numeric check runs the graph after every pass: once is enough to cover it.
    check = (kind, attention) == ("mixtral", "sdpa")
    program = wc.export(wrapped, args, config=wc.CompileConfig(bypass_codec=True, check_numerics=check))
    report = program.wmoe_report
    counts = report.counts()
    assert counts["kv_write"] == {"rewritten": 2}, report
    assert counts["attention"] == {"rewritten": 1}, report
    if kind == "llama":
        assert "moe" not in counts  # dense model: no MoE site
    elif kind == "phimoe":
        assert counts["moe"] == {"skipped": 1}, report
        (moe,) = (r for r in report.sites if r.kind == "moe")
        assert "no router feeding them was recognised" in moe.reason and moe.layer == 0, moe
    else:
        assert counts["moe"] == {"rewritten": 1}, report
        (moe,) = report.rewritten("moe")
        # labelled by the block, found by dataflow
        assert moe.module_path.endswith(("layers.0.mlp", "layers.0.block_sparse_moe")), moe
    if check:
        assert report.numerics["relative_error"] <= report.numerics["bound"] <= 1e-3
    if attention == "eager":  # the swapped attention's dense path is gone (its dropout kept it alive)
        ops = [str(n.target) for n in program.graph_module.graph.nodes]
        assert "aten.dropout.default" not in ops and ops.count("aten.softmax.int") == 1, ops  # the router's
    # Prefill then one decode step on fresh tokens, against the original with a fresh cache.
    module = program.module()
    tokens = torch.randint(1, 256, (BATCH, PROMPT))
    reset_cache(wrapped)
    with torch.no_grad():
        got, want = module(tokens, torch.arange(PROMPT)), wrapped(tokens, torch.arange(PROMPT))
    assert relative_error(got, want) < 1e-5


def test_deepseek_v3_routed_experts_are_rewritten_and_its_latent_attention_skipped_with_the_reason():
    # DeepSeek-V3: experts chosen on sigmoid scores plus a bias, within the best expert group,
    # weights gathered from the scores, renormalised and scaled; attention from a cached latent
    model = tiny_hf_model("deepseek-v3", experts_implementation="grouped_mm", num_layers=2)
    wrapped = wc.prepare(model, batch_size=BATCH, max_cache_len=CAPACITY)
    args, _ = example_inputs_for(wrapped, tokens=PROMPT)
    program = wc.export(wrapped, args, config=wc.CompileConfig(check_numerics=True))
    report = program.wmoe_report
    counts = report.counts()
    assert counts["moe"] == {"rewritten": 1}, report  # layer 0 is dense (first_k_dense_replace)
    (moe,) = report.rewritten("moe")
    assert moe.module_path.endswith("layers.1.mlp") and moe.detail.endswith("sigmoid router"), moe
    assert counts["kv_write"] == {"skipped": 4} and counts["attention"] == {"skipped": 2}, report
    assert all("multi-head latent attention" in r.reason for r in report.sites if r.kind != "moe"), report
    assert report.numerics["relative_error"] <= report.numerics["bound"] <= 1e-3
    tokens = torch.randint(1, 256, (BATCH, PROMPT))
    reset_cache(wrapped)
    with torch.no_grad():
        got, want = program.module()(tokens, torch.arange(PROMPT)), wrapped(tokens, torch.arange(PROMPT))
    assert relative_error(got, want) < 1e-5


def export_compressed_and_check_the_bound(kind: str, codec: str, tokens: int) -> ExportedProgram:
    """Export a 2-layer model's program of `tokens` tokens with `codec` (caches compressed for real)
    and check its output against the model's stays within the codec's measured error."""
    model = tiny_hf_model(kind, num_layers=2)
    wrapped = wc.prepare(model, batch_size=BATCH, max_cache_len=CAPACITY)
    args, _ = example_inputs_for(wrapped, tokens=tokens)
    config = wc.CompileConfig(codec=codec)
    program = wc.export(wrapped, args, config=config)
    errors = [
        float(s.reason.split("measured relative error ")[1].split()[0])
        for s in program.wmoe_report.rewritten("kv_write")
    ]
    assert len(errors) == 4
    bound = config.codec_error_gain * max(errors) * math.sqrt(2)
    reset_cache(wrapped)
    ids = torch.randint(1, 256, (BATCH, tokens))
    with torch.no_grad():
        err = relative_error(program.module()(ids, torch.arange(tokens)), wrapped(ids, torch.arange(tokens)))
    assert 0 < err <= bound, (err, bound)
    return program


def test_compressed_qwen3_moe_stays_within_the_codec_bound():
    export_compressed_and_check_the_bound("qwen3-moe", "default;window=0;sinks=0", 8)


def test_compressed_gpt_oss_stays_within_the_codec_bound():
    # every attention rewritten (sink logits; the sliding layer's window of 8 inside the codec's
    # exact window of 8), the caches compressed for real: the program's error stays within the
    # codec's measured error, as for the models without sinks or windows
    program = export_compressed_and_check_the_bound("gpt-oss", "default;window=8;sinks=1", 12)
    assert program.wmoe_report.counts()["attention"] == {"rewritten": 2}, program.wmoe_report


def test_dynamic_cache_is_found_reported_and_left_dense():
    from transformers import DynamicCache
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    register_dynamic_cache_export_support()
    model = tiny_hf_model("mixtral", num_layers=1)
    ids = torch.randint(1, 256, (1, 4))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[:, :3], cache=cache, use_cache=True)
        captured = torch.export.export(
            model, (), dict(input_ids=ids[:, 3:], cache=cache, use_cache=True), strict=False
        )
    gm, report = wc.transform(captured.module(), wc.CompileConfig())
    kv = [s for s in report.sites if s.kind == "kv_write"]
    assert len(kv) == 2 and all(s.status == "skipped" and "DynamicCache" in s.reason for s in kv)
    (attention,) = [s for s in report.sites if s.kind == "attention"]
    assert attention.status == "skipped"
    assert report.counts()["moe"] == {"rewritten": 1}  # the MoE rewrite does not need a cache


def test_prepare_switches_eager_experts_to_a_capturable_implementation():
    model = tiny_hf_model("mixtral", experts_implementation="eager", num_layers=1)
    assert model.config._experts_implementation == "eager"
    prepared = wc.prepare(model)
    assert prepared is model and model.config._experts_implementation == "grouped_mm"
    wrapped = wc.prepare(model, batch_size=1, max_cache_len=8)
    assert isinstance(wrapped, HFStaticCacheLM) and wrapped.key_cache_0.shape[2] == 8
    with pytest.raises(ValueError, match="both batch_size and max_cache_len"):
        wc.prepare(model, batch_size=1)


def tiny_model(model_class: type, config_class: type, attention: str = "sdpa", **fields) -> torch.nn.Module:
    """A seeded, randomly initialised transformers model of a family tiny_hf_model does not build:
    2 layers, hidden 64, 4 query / 2 KV heads of 16 unless `fields` say otherwise."""
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    config = config_class(**{**common, "num_key_value_heads": 2, "head_dim": 16, **fields})
    config._attn_implementation = attention
    torch.manual_seed(0)
    return model_class(config).eval()


def decode_program(model: torch.nn.Module, batch: int = 1) -> torch.export.ExportedProgram:
    """prepare + export of a one-token (decode) program with the codec bypassed (exact caches)."""
    wrapped = wc.prepare(model, batch_size=batch, max_cache_len=CAPACITY)
    args, _ = example_inputs_for(wrapped, tokens=1)
    return wc.export(wrapped, args, config=wc.CompileConfig(bypass_codec=True))


def assert_decode_exact(
    program: torch.export.ExportedProgram, model: torch.nn.Module, tokens: torch.Tensor
) -> None:
    """The program run one token at a time from position 0 gives the model's own logits."""
    module = program.module()
    for name, buffer in module.named_buffers():
        if "cache" in name and not name.endswith("channel_scale"):  # the caches' state, not their params
            buffer.zero_()
    with torch.no_grad():
        steps = [module(tokens[:, p, None], torch.tensor([p]))[:, -1] for p in range(tokens.size(1))]
        want = model(tokens).logits
    assert relative_error(torch.stack(steps, dim=1), want) < 1e-5


@pytest.mark.parametrize("window", [4, 32])
def test_sliding_window_layers_are_exact_past_the_window(window):
    # transformers' sliding-window cache layer holds the last `window` tokens and branches on, and
    # sizes its mask from, a Python count: an exported program used to write past its buffer once a
    # sequence outgrew the window (4), and to attend to the wrong slots even inside it (32 > the
    # capacity). prepare gives those layers full-length caches; the model's mask keeps them exact.
    from transformers import MixtralConfig, MixtralForCausalLM

    fields = dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=window)
    model = tiny_model(MixtralForCausalLM, MixtralConfig, **fields)
    wrapped = wc.prepare(model, batch_size=1, max_cache_len=CAPACITY)
    assert [wrapped.get_buffer(f"key_cache_{i}").shape[2] for i in range(2)] == [CAPACITY, CAPACITY]
    program = decode_program(model)
    report = program.wmoe_report
    assert report.counts()["kv_write"] == {"rewritten": 4}, report
    # the window masks slots (4): the op takes it and reads the exact ring; one covering the cache
    # masks nothing (32): the plain op
    assert report.counts()["attention"] == {"rewritten": 2}, report
    reasons = [s.reason for s in report.sites if s.kind == "attention"]
    ring = f"sliding window of {window} over the exact ring"
    assert all((ring in reason) == (window < CAPACITY) for reason in reasons), reasons
    assert_decode_exact(program, model, torch.randint(1, 256, (1, 11)))


def test_gpt_oss_experts_and_full_attention_with_sinks_are_rewritten_exact():
    # gpt-oss: learned sink logits in every attention's softmax, sliding-window and full layers in
    # turn, experts with biases and a clamped SwiGLU. The caches are found and compressed (here
    # bypassed, so the program is exact); both layers' attention becomes wmoe::wavelet_attention
    # with the layer's sink logits, the sliding layer's with its window of 8 (shorter than the
    # cache) too; the experts become wmoe::tiled_moe with their biases and activation.
    model = tiny_hf_model("gpt-oss", num_layers=2)
    assert model.config._attn_implementation == "eager"  # (transformers has no SDPA path for it)
    program = decode_program(model, batch=BATCH)
    report = program.wmoe_report
    counts = report.counts()
    assert counts["kv_write"] == {"rewritten": 4}, report
    assert counts["attention"] == {"rewritten": 2} and counts["moe"] == {"rewritten": 2}, report
    attention = {s.layer: s.reason for s in report.sites if s.kind == "attention"}
    assert all("learned sink logits" in reason for reason in attention.values()), attention
    assert "sliding window of 8 over the exact ring" in attention[0], attention
    assert "sliding window" not in attention[1], attention
    calls = [
        n for n in program.graph_module.graph.nodes if n.target is torch.ops.wmoe.wavelet_attention.default
    ]
    assert [len(n.args) for n in calls] == [14, 13], calls
    assert all("sinks" in str(n.args[12].target) for n in calls) and calls[0].args[13] == 8
    # nothing of the eager attentions' dense path is left: their weights' dropout (train=False)
    # used to keep it alive, decompressing the key caches every step for nothing
    left = {str(n.target) for n in program.graph_module.graph.nodes}
    assert not left & {"wmoe.kv_decompress.default", "aten.dropout.default"}, left
    moe = [s.reason for s in report.sites if s.kind == "moe"]
    form = "biases b_gate_up, b_down; gate * sigmoid(1.702 gate) * (up + 1), clamped to 7"
    assert all(form in reason for reason in moe), moe
    calls = [n for n in program.graph_module.graph.nodes if n.target is torch.ops.wmoe.tiled_moe.default]
    assert len(calls) == 2 and all(len(n.args) == 11 for n in calls), calls
    assert_decode_exact(program, model, torch.randint(1, 256, (BATCH, 12)))  # past the window of 8


def test_prepare_refuses_linear_attention_layers_naming_them():
    # Qwen3-Next / Qwen3.5-MoE: three Gated DeltaNet layers (recurrent state, no K/V) per attention layer
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    linear = dict(
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16
    )
    experts = dict(
        moe_intermediate_size=48, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2
    )
    model = tiny_model(
        Qwen3NextForCausalLM, Qwen3NextConfig, num_hidden_layers=4, intermediate_size=48, **linear, **experts
    )
    with pytest.raises(
        ValueError, match=r"recurrent state instead of a K/V cache \(linear attention, layers \[0, 1, 2\]\)"
    ):
        wc.prepare(model, batch_size=1, max_cache_len=CAPACITY)


def test_data_dependent_scalars_pass_the_checks_and_every_site_is_reported():
    # JetMoE routes its attention heads and experts through aten.item (expert counts): the passes'
    # fake-tensor check propagates those as unbacked symbols instead of failing the pipeline
    from transformers import JetMoeConfig, JetMoeForCausalLM

    fields = dict(kv_channels=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    model = tiny_model(JetMoeForCausalLM, JetMoeConfig, **fields)
    program = decode_program(model)
    report = program.wmoe_report
    assert {s.kind for s in report.sites} == {"kv_write", "attention", "moe"}, report
    assert all(s.status == "rewritten" or (s.status == "skipped" and s.reason) for s in report.sites), report
    assert_decode_exact(program, model, torch.randint(1, 256, (1, 6)))


def test_llama4_chunked_attention_and_all_expert_matmul_are_reported_and_exact():
    # Llama 4: chunked-attention cache layers (sliding layers to transformers' cache) and experts
    # computed for every expert by one batched matmul, on inputs scaled by their sigmoid scores
    # (no switchable experts implementation, so prepare leaves them): reported, the program exact
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    experts = dict(intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4, num_experts_per_tok=1)
    model = tiny_model(Llama4ForCausalLM, Llama4TextConfig, pad_token_id=0, **experts)
    program = decode_program(model)
    counts = program.wmoe_report.counts()
    assert counts["moe"] == {"skipped": 2} and counts["attention"] == {"skipped": 2}, program.wmoe_report
    assert_decode_exact(program, model, torch.randint(1, 256, (1, 8)))


@pytest.mark.parametrize("kind", ["deepseek-v3", "ernie4.5-moe", "qwen3-moe"])
def test_bf16_models_whose_router_runs_in_fp32_are_rewritten(kind):
    # DeepSeek-V3 and ERNIE 4.5 cast the router's weight to fp32 (F.linear(x.float(), w.float())):
    # in a bf16 model the router is a linear of a cast parameter, and must still be found
    model = tiny_hf_model(kind, experts_implementation="grouped_mm", num_layers=2).to(torch.bfloat16)
    wrapped = wc.prepare(model, batch_size=BATCH, max_cache_len=CAPACITY)
    args, _ = example_inputs_for(wrapped, tokens=PROMPT)
    program = wc.export(wrapped, args, config=wc.CompileConfig(bypass_codec=True))
    moe = [s for s in program.wmoe_report.sites if s.kind == "moe"]
    assert moe and all(s.status == "rewritten" for s in moe), program.wmoe_report
    # as close to the same weights in fp32 as the bf16 model itself is (bf16 sums in another order)
    fp32 = tiny_hf_model(kind, experts_implementation="grouped_mm", num_layers=2)
    reference = wc.prepare(fp32, batch_size=BATCH, max_cache_len=CAPACITY)
    tokens, positions = torch.randint(1, 256, (BATCH, PROMPT)), torch.arange(PROMPT)
    reset_cache(wrapped)
    with torch.no_grad():
        got, bf16, want = (
            program.module()(tokens, positions),
            wrapped(tokens, positions),
            reference(tokens, positions),
        )
    assert relative_error(got, want) <= 2 * relative_error(bf16, want) + 1e-3
