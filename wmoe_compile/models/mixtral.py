"""A Mixtral-style decoder written plainly: the readable specification of what the passes rewrite.

RMSNorm -> grouped-query attention (RoPE, static preallocated KV cache) -> RMSNorm -> top-k softmax
router over SwiGLU experts. Shapes are in the comments: B batch, T new tokens, S cache capacity,
H hidden, Hq / Hkv query / key-value heads, D head_dim, E experts, K experts per token, F expert ffn.

The cache is written with `index_copy_` at the step's positions (the same pattern as HF's
StaticCache), and attention runs over the whole preallocated cache with a mask that hides slots
not yet written and future tokens. Experts run as a loop over experts with dense masking (no
data-dependent shapes), so the model captures with torch.export and torch.compile without graph
breaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    ffn_size: int = 14336
    num_layers: int = 32
    num_q_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    num_experts: int = 8
    experts_per_token: int = 2
    max_seq_len: int = 4096
    rope_theta: float = 1e6
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token must be in [1, num_experts={self.num_experts}], "
                f"got {self.experts_per_token}"
            )


CONFIGS: dict[str, ModelConfig] = {
    # CPU tests: runs in well under a second per forward.
    "tiny": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        ffn_size=128,
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=4,
        experts_per_token=2,
        max_seq_len=128,
        rope_theta=1e4,
    ),
    # Mixtral-8x7B layer shapes (random init); override num_layers to fit a GPU.
    "mixtral-8x7b": ModelConfig(),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """Look up a named config (`tiny`, `mixtral-8x7b`) and apply field overrides."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; valid: {sorted(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability in bf16/fp16, like Llama/Mixtral reference code.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(max_seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, D] for rotate-half RoPE (the HF Llama/Mixtral convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # [S, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [S, D]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, heads, T, D]; cos/sin: [B, 1, T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_q_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_q_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        # Static KV cache [B, Hkv, S, D], allocated by MixtralModel.setup_cache. Non-persistent
        # buffers, so torch.export sees them as mutable state rather than constants.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [B, T, H]
        cos: torch.Tensor,  # [B, 1, T, D]
        sin: torch.Tensor,
        positions: torch.Tensor,  # [T] cache slots written this step
        mask: torch.Tensor,  # [B, 1, T, S] bool, True = attend
    ) -> torch.Tensor:
        cfg = self.cfg
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, cfg.num_q_heads, cfg.head_dim).transpose(1, 2)  # [B, Hq, T, D]
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.k_cache is None:
            raise RuntimeError("KV cache not allocated: call model.setup_cache(batch_size) first")
        # Static cache write (HF StaticCache does the same): slots `positions` along dim 2.
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        out = F.scaled_dot_product_attention(
            q, self.k_cache, self.v_cache, attn_mask=mask, enable_gqa=True
        )  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, cfg.num_q_heads * cfg.head_dim))


class Expert(nn.Module):
    """SwiGLU FFN: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router
        # "dense": static-shape masked loop (capturable); "routed": sparse loop (eager baseline).
        self.dispatch = "dense"
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, H = x.shape
        flat = x.reshape(B * T, H)  # [N, H]
        logits = self.gate(flat)  # [N, E]
        # Mixtral routing: softmax over all experts, keep top-k, renormalise the kept weights.
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(probs, self.cfg.experts_per_token, dim=-1)  # [N, K]
        topk_weights = (topk_weights / topk_weights.sum(-1, keepdim=True)).to(x.dtype)
        if self.dispatch == "routed":
            return self._routed(flat, topk_ids, topk_weights).view(B, T, H)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            # Dense masking keeps shapes static: every expert sees every token, weighted by 0
            # when unrouted. This is the capturable reference the MoE pass replaces.
            weight_e = (topk_weights * (topk_ids == e)).sum(-1, keepdim=True)  # [N, 1]
            out = out + weight_e * expert(flat)
        return out.view(B, T, H)

    def _routed(self, flat: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        # HF-style sparse loop: each expert runs only on its routed tokens. Data-dependent shapes
        # (nonzero) make it uncapturable by torch.export, but it reads only the experts that are hit,
        # so it is the fair eager baseline for decode benchmarks.
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token_idx, slot = torch.nonzero(topk_ids == e, as_tuple=True)
            if token_idx.numel() == 0:
                continue
            weighted = expert(flat[token_idx]) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, weighted)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.moe = MoE(cfg)

    def forward(self, x, cos, sin, positions, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, positions, mask)
        return x + self.moe(self.moe_norm(x))


def _seeded_normal_(weight: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    """Fill ``weight`` in place (on its device, one parameter at a time, so big configs init fast)
    from N(0, std) drawn in fp32, then rounded to its dtype: one seed gives one model in every
    dtype. (torch 2.11's CPU normal_ draws bf16 / fp16 tensors of 16+ elements from another stream
    than fp32's; 2.13 and 2.14 draw the same values.)"""
    if weight.dtype == torch.float32:
        weight.normal_(0.0, std, generator=generator)
        return
    drawn = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
    weight.copy_(drawn.normal_(0.0, std, generator=generator))


class MixtralModel(nn.Module):
    """Decoder-only MoE LM. forward(tokens [B, T], positions [T]) -> logits [B, T, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # [S, D]
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int | None = None) -> None:
        """Random init with std 1/sqrt(fan_in), so activations stay O(1) at any depth or dtype."""
        device = self.lm_head.weight.device
        gen = torch.Generator(device).manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                _seeded_normal_(module.weight, 1.0 / math.sqrt(module.in_features), gen)
            elif isinstance(module, nn.Embedding):
                _seeded_normal_(module.weight, 1.0, gen)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def setup_cache(self, batch_size: int, max_seq_len: int | None = None) -> None:
        """Preallocate the static KV cache [B, Hkv, S, D] in every layer (zeros = empty)."""
        cfg = self.cfg
        max_seq_len = max_seq_len or cfg.max_seq_len
        if max_seq_len > cfg.max_seq_len:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the RoPE table size {cfg.max_seq_len}")
        dtype, device = self.lm_head.weight.dtype, self.lm_head.weight.device
        shape = (batch_size, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
        for layer in self.layers:
            layer.attn.register_buffer(
                "k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
            )
            layer.attn.register_buffer(
                "v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False
            )

    @property
    def cache_capacity(self) -> int:
        cache = self.layers[0].attn.k_cache
        return 0 if cache is None else cache.shape[2]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape  # positions: [T], the cache slots of these tokens (same for the batch)
        capacity = self.cache_capacity
        x = self.embed(tokens)  # [B, T, H]
        cos = self.rope_cos[positions].to(x.dtype)[None, None]  # [1, 1, T, D]
        sin = self.rope_sin[positions].to(x.dtype)[None, None]
        # Causal over absolute positions: slot j is visible to the token at position p iff j <= p.
        slots = torch.arange(capacity, device=tokens.device)
        mask = (slots[None, :] <= positions[:, None])[None, None]  # [1, 1, T, S]
        for layer in self.layers:
            x = layer(x, cos, sin, positions, mask)
        return self.lm_head(self.norm(x))  # [B, T, vocab]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, step_fn=None) -> torch.Tensor:
        """Greedy decoding: prefill the prompt [B, T0], then one token per step.

        `step_fn(tokens, positions) -> logits` replaces `self.forward` (e.g. a compiled model).
        Returns the generated tokens [B, max_new_tokens].
        """
        B, T0 = prompt.shape
        total = T0 + max_new_tokens
        if total > self.cfg.max_seq_len:
            raise ValueError(
                f"prompt ({T0}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len "
                f"{self.cfg.max_seq_len}"
            )
        if self.cache_capacity < total or self.layers[0].attn.k_cache.shape[0] != B:
            self.setup_cache(B, total)
        step = self.forward if step_fn is None else step_fn
        device = prompt.device
        logits = step(prompt, torch.arange(T0, device=device))
        next_token = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        generated = [next_token]
        for pos in range(T0, total - 1):
            logits = step(next_token, torch.tensor([pos], device=device))
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            generated.append(next_token)
        return torch.cat(generated, dim=1)


def build_model(
    name: str = "tiny",
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides,
) -> MixtralModel:
    """Build a reference model from a named config with random weights (seeded)."""
    cfg = get_config(name, **overrides)
    with torch.device("meta"):
        model = MixtralModel(cfg)
    # Materialise directly on the target device and dtype: no full-size fp32 copy on the host.
    model = model.to_empty(device=device).to(dtype)
    cos, sin = rope_tables(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # kept fp32
    model.reset_parameters(seed)
    return model.eval().requires_grad_(False)
