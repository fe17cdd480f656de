"""GPU: the compiled model holds its KV cache at compressed size, and decodes with the fused ops.

Run on a CUDA machine: python -m pytest -m gpu tests/test_lowering_gpu.py
"""

import gc

import pytest
import torch

from wmoe_compile.codec import WaveletKVConfig
from wmoe_compile.lowering import GraphedDecodeStep, compile_backend
from wmoe_compile.models import build_model

pytestmark = pytest.mark.gpu


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def test_compiled_cache_is_allocated_at_compressed_size():
    # Mixtral layer shapes for attention (8 KV heads of 128), a long cache so the exact window
    # (sinks + window tokens per head) is a small share; experts shrunk: memory is about the cache.
    torch._dynamo.reset()
    batch, capacity, prompt_len, new_tokens = 2, 32768, 32, 8
    model = build_model(
        "mixtral-8x7b",
        num_layers=2,
        ffn_size=256,
        num_experts=4,
        vocab_size=512,
        max_seq_len=capacity,
        dtype=torch.bfloat16,
        device="cuda",
    )
    cfg = model.cfg
    before_cache = _allocated()
    model.setup_cache(batch, capacity)
    dense_bytes = _allocated() - before_cache
    assert dense_bytes == 2 * cfg.num_layers * batch * cfg.num_kv_heads * capacity * cfg.head_dim * 2

    codec = WaveletKVConfig()
    compiled = torch.compile(
        model, backend="wmoe", options={"codec": codec, "release_dense_cache": True, "replace_moe": False}
    )
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device="cuda")
    got = model.generate(prompt, new_tokens, step_fn=lambda tokens, positions: compiled(tokens, positions))
    assert got.shape == (batch, new_tokens)

    held = _allocated() - before_cache  # everything the cache costs now: dense released, compressed kept
    vectors = 2 * cfg.num_layers * batch * cfg.num_kv_heads * capacity  # K and V
    codes_bytes = codec.bytes_per_vector(cfg.head_dim) * vectors
    exact_bytes = (
        2 * cfg.num_layers * batch * cfg.num_kv_heads * (codec.sinks + codec.window) * cfg.head_dim * 2
    )
    # the default codec's calibrated channel parameters: [Hkv, D + 2, D] fp32 per cache
    channel_bytes = sum(
        compile_backend.compressed_state(c)["channel_scale"].nbytes
        for layer in model.layers
        for c in (layer.attn.k_cache, layer.attn.v_cache)
    )
    expected = codes_bytes + exact_bytes + channel_bytes
    state_bytes = sum(
        t.nbytes
        for layer in model.layers
        for c in (layer.attn.k_cache, layer.attn.v_cache)
        for t in compile_backend.compressed_state(c).values()
    )
    print(
        f"\ncache bytes: dense {dense_bytes / 2**20:.1f} MiB, compiled {held / 2**20:.2f} MiB held "
        f"(compressed state {state_bytes / 2**20:.2f} MiB: codes+scales {codes_bytes / 2**20:.2f} MiB at "
        f"{codec.bytes_per_vector(cfg.head_dim)} B/vector, exact window {exact_bytes / 2**20:.2f} MiB, "
        f"channel parameters {channel_bytes / 2**20:.2f} MiB)"
    )
    # The compressed state is exactly codes + exact ring + channel parameters, and everything the
    # compiled model holds beyond the weights stays far below the dense cache it replaced (the
    # dense cache is released; on the H200 ~33 MiB of other allocations, not cache-sized, were
    # seen next to the 108 MiB of state at this capacity, not identified)
    assert state_bytes == expected
    assert held < 0.3 * dense_bytes
    state = compile_backend.compressed_state(model.layers[0].attn.k_cache)
    assert state["codes"].dtype == torch.uint8 and state["codes"].is_cuda
    assert model.layers[0].attn.k_cache.untyped_storage().nbytes() == 0


def test_bypass_decoding_matches_eager_on_gpu():
    torch._dynamo.reset()
    model = build_model("tiny", dtype=torch.float32, device="cuda")
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 9), device="cuda")
    expected = model.generate(prompt, 16)
    compiled = torch.compile(model, backend="wmoe", options={"bypass_codec": True})
    got = model.generate(prompt, 16, step_fn=lambda tokens, positions: compiled(tokens, positions))
    assert torch.equal(got, expected)


def test_graphed_decode_step_matches_uncaptured_calls():
    # GraphedDecodeStep replays the compiled decode step from one CUDA graph: same tokens as the
    # uncaptured compiled calls (the warm-up repeats the first step's cache write with the same
    # values), prefill run as is. head_dim 64: the fused attention kernel (the reference fallback
    # for other head dims reads seq_lens on the host and cannot be captured)
    torch._dynamo.reset()
    model = build_model("tiny", head_dim=64, dtype=torch.float32, device="cuda")
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 40), device="cuda")
    compiled = torch.compile(model, backend="wmoe", options={"codec": "default;window=16;sinks=4"})
    expected = model.generate(prompt, 12, step_fn=compiled)
    graphed = GraphedDecodeStep(compiled)
    got = model.generate(prompt, 12, step_fn=graphed)
    assert graphed.graph is not None
    assert torch.equal(got, expected)
