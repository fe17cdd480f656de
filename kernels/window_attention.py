"""Sliding-window decode attention over the codec's exact ring (`wmoe::wavelet_attention`, window > 0).

Why: gpt-oss (and Mistral-, Cohere2-, Llama-4-style configs) alternate full layers with layers that
attend the last W positions only (gpt-oss: W = 128). The codec keeps the last `layout.window`
positions exactly, in a ring (position p at exact slot sinks + p % window). When a query's W
positions all lie in that ring (W + Tq - 1 <= layout.window: the oldest position the first new
token sees is still there), the layer's attention reads the ring alone: a few KB per (sequence,
kv head), no codes, no transform. Wider windows take the reference (wavelet_attention.py).

Slot j of the ring holds position p_j = L - 1 - ((L - 1 - j) mod R) for a sequence of L positions
and a ring of R (negative: never written). Query t (of Tq new tokens; its position P_t = L - Tq + t)
attends p_j when P_t - W < p_j <= P_t. The exact copies are stored centred (x - m): the scores lack
sm_scale q . m_k, which softmax ignores (a learned sink's logit moves by it instead), and the value
offset is added at the weights' sum. Learned sink logits (gpt-oss) join the softmax as in
attention_reduce.kept_mass.

`ring_window_reason` says when the ring does not cover the window; `window_attention_triton` is the
kernel (CUDA, or the CPU under TRITON_INTERPRET=1). Its reference is wavelet_attention_reference
with the same window; tests/test_window_attention.py compares them with a float64 decompress-and-
attend reference.
"""

from __future__ import annotations

import torch

from .attention_layout import CompressedLayout, _on, attention_channel_params
from .fast_launch import interpreting, launch

try:  # Triton is optional: the reference runs anywhere.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

LOG2E = 1.4426950408889634
# ring slots per step of the online softmax: the default codec's whole ring of 128 in one step
# (64-slot steps and fp32 dots: 14.2 us at gpt-oss's shape and B = 1 on an H100, 3.5x SDPA's over
# a dense 128-token window)
RING_TILE = 128


def ring_window_reason(layout: CompressedLayout, window: int, tq: int) -> str | None:
    """Why the exact ring cannot serve a sliding window of `window` for Tq new tokens, or None."""
    if layout.window == 0:
        return "the codec keeps no exact window (window=0)"
    if window + tq - 1 > layout.window:
        return (
            f"a sliding window of {window} tokens for {tq} new token(s) reaches {window + tq - 1} positions "
            f"back, past the codec's exact window of {layout.window}"
        )
    return None


if HAS_TRITON:
    from .attention_reduce import kept_mass, sink_logits_of_rows

    @triton.jit
    def _ring_window_kernel(
        q_ptr,  # [B, Hq, Tq, D] the new tokens' queries
        q_stride_b,
        q_stride_h,
        q_stride_t,
        k_exact_ptr,  # [B, Hkv, sinks + R, D] exact keys, centred; the ring from slot SINKS on
        k_stride_b,
        k_stride_h,
        k_stride_s,
        v_exact_ptr,  # the same for values (per-token stride k_stride_s, as checked on the host)
        v_stride_b,
        v_stride_h,
        seq_lens_ptr,  # [B] positions in the cache, the Tq new ones included
        v_offset_ptr,  # [Hkv, D] value offsets m_v (OFFSET)
        v_offset_stride_h,
        k_offset_ptr,  # [Hkv, D] key offsets m_k (SINK_KEY_OFFSET)
        k_offset_stride_h,
        sink_ptr,  # [Hq] learned sink logits, natural units (SINK_LOGITS)
        out_ptr,  # [B, Hq, Tq, D] in q's dtype
        out_stride_b,
        out_stride_h,
        out_stride_t,
        n_kv_heads,
        group,
        n_new,
        window,  # W: query t attends positions P_t - W < p <= P_t
        qk_scale,  # sm_scale * log2(e)
        D: tl.constexpr,
        SINKS: tl.constexpr,  # the codec's exact sink slots before the ring
        RING: tl.constexpr,  # R, the ring's slots
        BLOCK_M: tl.constexpr,  # query rows (group * Tq, padded to a power of two >= 16)
        BLOCK_N: tl.constexpr,  # ring slots per step
        OFFSET: tl.constexpr,
        SINK_LOGITS: tl.constexpr,
        SINK_KEY_OFFSET: tl.constexpr,
        HALF_DOTS: tl.constexpr,  # the exact cache is fp16 / bf16: its own type in the dots
    ):
        """One (sequence, kv head): its group's query rows against the ring, online softmax."""
        pid = tl.program_id(0)
        kv_head = pid % n_kv_heads
        batch = pid // n_kv_heads
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < group * n_new
        head = kv_head * group + rows // n_new
        token = rows % n_new
        d = tl.arange(0, D)
        length = tl.load(seq_lens_ptr + batch).to(tl.int32)
        position = length - n_new + token  # P_t per row
        q = tl.load(
            q_ptr
            + batch * q_stride_b
            + head[:, None] * q_stride_h
            + token[:, None] * q_stride_t
            + d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        k_base = k_exact_ptr + batch * k_stride_b + kv_head * k_stride_h + SINKS * k_stride_s
        v_base = v_exact_ptr + batch * v_stride_b + kv_head * v_stride_h + SINKS * k_stride_s
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: exp2 of a difference stays defined
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for first in range(0, RING, BLOCK_N):
            slot = first + tl.arange(0, BLOCK_N)
            slot_ok = slot < RING
            held = length - 1 - ((length - 1 - slot + RING) % RING)  # the position slot j holds
            k = tl.load(k_base + slot[:, None] * k_stride_s + d[None, :], mask=slot_ok[:, None], other=0.0)
            v = tl.load(v_base + slot[:, None] * k_stride_s + d[None, :], mask=slot_ok[:, None], other=0.0)
            if HALF_DOTS:  # the exact cache's 16-bit type on the tensor cores, fp32 accumulation
                scores = tl.dot(q.to(k.dtype), tl.trans(k)) * qk_scale
            else:
                scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * qk_scale
            seen = (
                (slot_ok & (held >= 0))[None, :]
                & (held[None, :] <= position[:, None])
                & (held[None, :] > position[:, None] - window)
            )
            scores = tl.where(seen, scores, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            p = tl.where(seen, tl.exp2(scores - m_new[:, None]), 0.0)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if HALF_DOTS:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # every real row sees its own position
        if OFFSET:
            o = o + tl.load(v_offset_ptr + kv_head * v_offset_stride_h + d).to(tl.float32)[None, :]
        if SINK_LOGITS:  # the positions keep L / (L + e^s) of the mass, as in the reduces
            q_rows = q_ptr + batch * q_stride_b + head * q_stride_h + token * q_stride_t
            sink = sink_logits_of_rows(
                sink_ptr,
                head,
                row_ok,
                q_rows,
                k_offset_ptr,
                k_offset_stride_h,
                qk_scale,
                kv_head,
                D,
                SINK_KEY_OFFSET,
            )
            o = o * kept_mass(l_i, m_i, sink)[:, None]
        out = out_ptr + batch * out_stride_b + head[:, None] * out_stride_h + token[:, None] * out_stride_t
        tl.store(out + d[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def window_attention_triton(
    q: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    seq_lens: torch.Tensor,
    k_channel_scale: torch.Tensor,
    v_channel_scale: torch.Tensor,
    layout: CompressedLayout,
    sm_scale: float,
    window: int,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sliding-window attention of q over the exact ring (inputs checked by the caller: the op runs
    check_attention_inputs first). Raises ValueError where the ring does not cover the window."""
    if not HAS_TRITON:
        raise ValueError("the ring-window kernel needs Triton")
    batch, hq, tq, d = q.shape
    hkv = k_exact.shape[1]
    group = hq // hkv
    reason = ring_window_reason(layout, window, tq)
    if reason:
        raise ValueError(f"sliding window over the exact ring: {reason}")
    if k_exact.stride(2) != v_exact.stride(2) or k_exact.stride(3) != 1 or v_exact.stride(3) != 1:
        raise ValueError(
            "k_exact and v_exact must share their per-token stride and be contiguous along D, got "
            f"{k_exact.stride()} and {v_exact.stride()}"
        )
    k_params = attention_channel_params(k_channel_scale, hkv, d, "k_channel_scale", copy=False)
    v_params = attention_channel_params(v_channel_scale, hkv, d, "v_channel_scale", copy=False)
    v_offset = None if v_params.offset is None else _on(v_params.offset, q.device)
    k_offset = None if sinks is None or k_params.offset is None else _on(k_params.offset, q.device)
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    rows = group * tq
    launch(
        _ring_window_kernel,
        (batch * hkv,),
        q,
        *q.stride()[:3],
        k_exact,
        *k_exact.stride()[:3],
        v_exact,
        *v_exact.stride()[:2],
        seq_lens,
        out if v_offset is None else v_offset,
        0 if v_offset is None else v_offset.stride(0),
        out if k_offset is None else k_offset,
        0 if k_offset is None else k_offset.stride(0),
        out if sinks is None else sinks.contiguous(),
        out,
        *out.stride()[:3],
        hkv,
        group,
        tq,
        int(window),
        float(sm_scale) * LOG2E,
        D=d,
        SINKS=layout.sinks,
        RING=layout.window,
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=min(RING_TILE, max(16, triton.next_power_of_2(layout.window))),
        OFFSET=v_offset is not None,
        SINK_LOGITS=sinks is not None,
        SINK_KEY_OFFSET=k_offset is not None,
        # (the interpreter's bf16 dots give garbage: fp32 there)
        HALF_DOTS=k_exact.dtype == torch.float16 or (k_exact.dtype == torch.bfloat16 and not interpreting()),
        num_warps=4,
    )
    return out
