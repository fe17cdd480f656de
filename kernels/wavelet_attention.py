"""Decode attention over the wavelet-compressed KV cache: the PyTorch reference, and the fused
kernels' host side (which kernel runs, the transforms, the launches).

Where the parts live: this module holds the reference, which split kernel a call can run and why
not, the query and value transforms, and the launches (``wavelet_attention_triton``). The
compressed layout and the input checks every path shares are kernels/attention_layout.py; the
host plans that map a layout onto each kernel's constexprs and tables kernels/attention_plans.py;
how a code field becomes an fp16 operand kernels/attention_fields.py; the launch configs
kernels/attention_config.py. The kernels: the prologue, v1 and v2 split and exact-token kernels in
kernels/wavelet_attention_kernels.py, v3's split kernel in kernels/wavelet_attention_gluon.py
(several splits a CTA, a warp each: kernels/wavelet_attention_cta.py), the reduce in
kernels/attention_reduce.py.

The compressed format (docs/CONTRACTS.md): a key or value vector x of head_dim D is stored as
coefficients ``c = W R ((x - m) / s)`` (W a D x D orthonormal wavelet matrix; channel parameters:
offset m, smoothing s, per-kv-head rotation R, each optional) cut into contiguous bands; band b
keeps ``bits_b``-bit codes and one fp16 scale per vector, ``c_j ~= grid_b[code_j] * scale_b``.
Beside the codes an ``exact`` cache holds full-precision centred copies (x - m) of the first
``sinks`` positions and, in a ring, the last ``window`` positions.

Why attention can run on coefficients (W R orthonormal):
    q . (k - m_k)  = (W R (q * s_k)) . c_k          -> transform the query once, not every key
    sum_i p_i v_i  = (R^T W^T sum_i p_i c_v,i) * s_v + m_v  -> accumulate coefficients, inverse once
(the key offset shifts every score of a query equally: softmax drops it; the weights sum to 1).

The Triton path (``wavelet_attention_triton``) is three launches (four with v3, below):
  1. prologue: per (sequence, kv head, row block) and chunk of 32 kernel slots, transform the q
     rows of the GQA group (``q_w = M_h (q * s_k) * sm_scale * log2(e)`` with ``M_h = W_slots R_h``
     folded once per channel tensor and cached, see ``query_transform``), stored in fp16 in the
     kernel's slot order;
  2. split kernel (flash-decoding): the compressed positions of each sequence are cut into
     ``num_splits`` ranges, one program (one warp) per (range, sequence, kv head, row block). A
     program reads each compressed token's code bytes once for *all* q heads of the group,
     dequantizes them in registers and keeps an online softmax and a coefficient-domain
     accumulator. Tokens are the key MMAs' M dimension and the few query rows their N (padded to
     8): scores^T = K_field @ q^T; values put slots on M: acc^T += V_field^T @ p^T. One more program
     per (sequence, kv head, row block) handles the exact sink/window tokens in the channel domain;
  3. reduce (kernels/attention_reduce.py): merges the compressed ranges, applies W, R and s once
     (one folded matrix per kv head, see value_transform) and m, merges the exact part under the
     same softmax, writes the output in q's dtype (one program per query row for decode launches,
     whose few rows per program would leave most SMs idle; one per row block for long prefill
     chunks).

Three split kernels decode the codes:

v1 (``_split_kernel``, every layout): code bytes as MMA operands per bit plane; affine grids via the
fp16 magic number (``0x6400 | field`` is ``1024 + field``; one PRMT + LOP3 per pair), value planes
centred to small exact integers before their MMA (the tensor cores' fp32 accumulation over
thousands of tokens would lose the field against the 1024); other grids gather from a
2**bits-entry fp16 table per element (correct, ~4x slower).

v2 (``_split_kernel_v2``, affine grids only): code rows read as int16 elements, one MMA operand
per bit field of the element, ``(x >> 8?) & mask`` in place (one LOP3 per pair, the shift shared by
the fields); keys of narrow chunks (< 16 elements) as byte fields instead, so their MMAs need no
padding; values transposed through ldmatrix.trans on the int16 view (token pairs in one register,
no byte gathers). Token sums (softmax denominator, sum of p * scale) come out of the tensor cores
(ones @ p); accumulators are rescaled only when a running max grows. Field operands are either
magic (default: values centred as in v1) or fp16 subnormals (``field * 2**-24``, no offset and no
subtract, but the value sums then keep the grid offset and cancel against it at the end: measured
1.0e-2 error on one 32k-token split of random codes). On the H200 v2 issues ~17% fewer
instructions per token than v1 yet runs 5-7% slower on large launches: the loop is bound by
latency with ~3 warps per scheduler, not by issue slots or L2 (profiles in
benchmarks/RESULTS.md). The tuned tables keep the measured winners: v1 with one-warp 64-token steps
for large launches, v1 with two-warp 128-token steps for one sequence (0.0285 ms at (1, 32768)
against v2's 0.0296 and one-warp v2's 0.0308-0.0323).

v3 (kernels/wavelet_attention_gluon.py, Gluon, one layout family: head_dim 128 with a 4-bit band
of 64 coefficients then a 2-bit band of 64, affine grids): keys load from global memory straight
into MMA A fragments, value tiles go through cp.async (8-byte copies through L1) and
ldmatrix.trans, the 2-bit band fills each operand with two fields of its 8 int16 elements; exact
tokens in a separate small kernel (``_exact_kernel``). The tuned table runs it on large decode
launches: 0.303 ms at (8, 131072) against v1's 0.370 (benchmarks/RESULTS.md, fifth session).
Where it cannot run (CPU, the interpreter, no Gluon, other layouts) the call runs v1.

Kernel slot order: each kernel visits coefficients in the order its operands are built (fields of
bytes or int16 elements); that permutation (and each field's power of two) is folded into the
rows of W and per-slot factors on the host, so nothing is shuffled in the kernel.

Long prefill chunks appended to a compressed history use the same kernels with several row blocks
(causal per row); the full-precision cache is never materialised.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import replace

import torch

from . import side_stream as _side
from .fast_launch import interpreting as _interpreting
from .fast_launch import launch
from .wavelet_attention_kernels import HAS_TRITON  # (Triton is optional: the reference runs anywhere)

LOG2E = 1.4426950408889634

# LaunchConfig.phase_clocks (a probe): v3's split programs write int64 globaltimer stamps (ns) into
# this buffer, PHASE_SLOTS a program, program (pid, split) at row pid * num_splits + split. Slots:
# 0 after the PDL wait, 1 after the query's transform, 2-5 after full steps 0, 1, 2 and the last
# (3 onwards share slot 5), 6 after the masked steps, 7 after the epilogue's transform, 8 the SM
# (%smid), 9 the program's full steps. benchmarks/probe_attention.py phases sets and reads it.
PHASE_SLOTS = 10
PHASE_TIMES = 8  # slots 0-7 hold times
PHASE_SM, PHASE_FULL_STEPS = 8, 9
phase_clock_buffer: torch.Tensor | None = None


# the compressed layout, the input checks and the channel parameters: kernels/attention_layout.py
from .attention_layout import (  # noqa: E402
    ChannelParams,
    CompressedLayout,
    _on,
    _ones,
    attention_channel_params,
    channel_scale_2d,
    check_attention_inputs,
    check_sink_logits,
)

# ------------------------------------------------------------------------------------------------
# reference (pure PyTorch, fp32 math; CPU or CUDA)


def decode_coefficients(codes: torch.Tensor, scales: torch.Tensor, layout: CompressedLayout) -> torch.Tensor:
    """codes uint8 [..., n_code_bytes], scales fp16 [..., n_bands] -> fp32 coefficients [..., D]."""
    parts = []
    for i, ((_, size, bits), offset) in enumerate(zip(layout.bands, layout.band_byte_offsets, strict=True)):
        per_byte = 8 // bits
        packed = codes[..., offset : offset + size // per_byte].to(torch.int32)
        shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
        idx = ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)
        grid = torch.tensor(layout.grids[i], dtype=torch.float32, device=codes.device)
        parts.append(grid[idx.long()] * scales[..., i : i + 1].float())
    return torch.cat(parts, dim=-1)


def _gather_cache(
    codes: torch.Tensor,
    scales: torch.Tensor,
    exact: torch.Tensor,
    params: ChannelParams,
    seq_len: int,
    layout: CompressedLayout,
) -> torch.Tensor:
    """fp32 [Hkv, seq_len, D] for one sequence, centred (x - m): exact positions from `exact`
    (stored centred), the rest decoded: x - m = (R^T W^T c) * s."""
    coef = decode_coefficients(codes[:, :seq_len], scales[:, :seq_len], layout)
    x = coef @ layout.transform.to(coef.device)
    if params.rotation is not None:
        x = x @ params.rotation.to(x.device)
    x = x * params.scale.to(x.device)[:, None, :]
    pos = torch.arange(seq_len, device=codes.device)
    ring_lo = max(seq_len - layout.window, layout.sinks)
    sink_pos = pos[: min(layout.sinks, seq_len)]
    if sink_pos.numel():
        x[:, sink_pos] = exact[:, sink_pos].float()
    if layout.window > 0 and ring_lo < seq_len:
        ring_pos = pos[ring_lo:]
        x[:, ring_pos] = exact[:, layout.sinks + ring_pos % layout.window].float()
    return x


def wavelet_attention_reference(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    seq_lens: torch.Tensor,
    k_channel_scale: torch.Tensor,
    v_channel_scale: torch.Tensor,
    layout: CompressedLayout,
    sm_scale: float,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Decompress each sequence's valid positions and attend in fp32 (causal over the Tq new tokens).

    ``sinks``: a learned logit per query head [Hq] (gpt-oss), in the scaled scores' units: the
    softmax runs over the scores and that logit, whose weight is then dropped (it attends to
    nothing), so a row's weights sum to less than 1. ``window`` > 0: a sliding window, query t
    (position P_t = seq_len - Tq + t) attends positions P_t - window < p <= P_t only.

    Materialises one sequence's K/V at a time; meant for CPU, tests and unsupported layouts.
    """
    batch, hq, tq, d = q.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    k_params = attention_channel_params(k_channel_scale, hkv, d, "k_channel_scale")
    v_params = attention_channel_params(v_channel_scale, hkv, d, "v_channel_scale")
    sink_rows = None if sinks is None else sink_logit_rows(q, sinks, k_params, sm_scale)
    out = torch.empty_like(q)
    for b, seq_len in enumerate(seq_lens.tolist()):
        # centred keys shift each query's scores by the constant q . m_k, which softmax ignores
        # (sink_logit_rows moves a sink logit by the same constant)
        k = _gather_cache(k_codes[b], k_scales[b], k_exact[b], k_params, seq_len, layout)
        v = _gather_cache(v_codes[b], v_scales[b], v_exact[b], v_params, seq_len, layout)
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        scores = (q[b].float() @ k.transpose(-1, -2)) * sm_scale  # [Hq, Tq, seq_len]
        limits = seq_len - tq + 1 + torch.arange(tq, device=q.device)
        slots = torch.arange(seq_len, device=q.device)[None, :]
        allowed = slots < limits[:, None]
        if window > 0:
            allowed = allowed & (slots >= limits[:, None] - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sink_rows is None:
            weights = torch.softmax(scores, dim=-1)
        else:  # the sink's column joins the softmax, then is dropped
            logits = torch.cat([scores, sink_rows[b].expand(hq, tq)[..., None]], dim=-1)
            weights = torch.softmax(logits, dim=-1)[..., :-1]
        o = weights @ v
        if v_params.offset is not None:  # the values are centred: add the offset at the weights' sum
            offset = v_params.offset.to(o.device).repeat_interleave(group, dim=0)[:, None, :]
            o = o + (offset if sink_rows is None else offset * weights.sum(-1, keepdim=True))
        out[b] = o.to(q.dtype)
    return out


def sink_logit_rows(
    q: torch.Tensor, sinks: torch.Tensor, k_params: ChannelParams, sm_scale: float
) -> torch.Tensor:
    """The reference's fp32 sink logits per (sequence, query head, new token) [B, Hq, Tq] (a
    broadcast view without a key offset): scores from centred keys lack each query's
    sm_scale * q . m_k, a constant softmax over the positions ignores but the sink's logit does
    not, so it moves by the same amount (the reduce kernels do the same per row in-kernel:
    attention_reduce._sink_logit_row)."""
    batch, hq, tq, _ = q.shape
    logits = sinks.to(torch.float32)[None, :, None]
    if k_params.offset is not None:
        group = hq // k_params.offset.shape[0]
        offset = k_params.offset.to(device=q.device, dtype=torch.float32).repeat_interleave(group, dim=0)
        logits = logits - float(sm_scale) * torch.einsum("bhtd,hd->bht", q.float(), offset)
    return logits.expand(batch, hq, tq)


# the host plans of the split kernels (slot orders, factors, constexprs): kernels/attention_plans.py
from .attention_plans import (  # noqa: E402
    V3_MAX_ROWS,
    UnsupportedLayout,
    _field_chunks,
    _kernel_bands,
    _plan,
    _plan_v2,
    _plan_v3,
    _PlanV2,
    _v3_layout_check,
)

# per-layout answers of the support checks: layouts with a key (every op call's) are fixed, and
# the op asks on every call, where host time is the decode budget
_LAYOUT_REASONS: dict[tuple[str, str], str | None] = {}


def _layout_reason(layout: CompressedLayout, which: str, check) -> str | None:
    cache_key = (which, layout.key) if layout.key else None
    if cache_key is not None and cache_key in _LAYOUT_REASONS:
        return _LAYOUT_REASONS[cache_key]
    try:
        check(layout)
        reason = None
    except UnsupportedLayout as exc:
        reason = str(exc)
    if cache_key is not None:
        _LAYOUT_REASONS[cache_key] = reason
    return reason


def _v2_layout_reason(layout: CompressedLayout) -> str | None:
    """None when the v2 kernel can run this layout, else why not."""
    return _layout_reason(layout, "v2", _field_chunks)


def _v2_reason(layout: CompressedLayout, k_codes: torch.Tensor, k_scales: torch.Tensor) -> str | None:
    """None when the v2 kernel can run this layout and these cache strides, else why not."""
    reason = _v2_layout_reason(layout)
    if reason is not None:
        return reason
    if any(st % 2 for st in k_codes.stride()[:3]) or k_codes.data_ptr() % 2:
        return "code cache strides are not int16-aligned"
    return None


# set when the v3 kernel failed to build or launch on this Triton (its Gluon API moves between
# releases): every later call runs v1, and the first failure is reported once as a warning
_V3_FAILURE = ""


def _v3_reason(layout: CompressedLayout, k_codes: torch.Tensor, k_scales: torch.Tensor) -> str | None:
    """None when the Gluon v3 kernel can run this call, else why not (the call then runs v1). Any
    GQA group: the launcher runs more than V3_MAX_ROWS query rows in row blocks of that many."""
    reason = _layout_reason(layout, "v3", _v3_layout_check)
    if reason is not None:
        return reason
    if _V3_FAILURE:
        return _V3_FAILURE
    if _interpreting() or not k_codes.is_cuda:
        return "v3 is a Gluon kernel: CUDA only, no interpreter"
    if torch.cuda.get_device_capability(k_codes.device) < (8, 0):
        return "v3 needs sm_80 or newer (mma.sync m16n8k16, cp.async)"
    if any(st % 2 for st in k_codes.stride()[:3]) or k_codes.data_ptr() % 2:
        return "code cache strides are not int16-aligned"
    if any(st % 2 for st in k_scales.stride()[:3]) or k_scales.data_ptr() % 4:
        return "scale rows are not 4-byte aligned pairs"
    from .wavelet_attention_gluon import gluon_reason  # Gluon only where v3 can run

    return gluon_reason()


def _key_pairs_aligned(k_codes: torch.Tensor, layout: CompressedLayout) -> bool:
    """Whether every 4-bit-band key word pair LaunchConfig.key_word_pairs loads (8 bytes at byte
    8t of the band, t < 4) is 8-byte aligned in this cache."""
    strides = k_codes.stride()[:3]  # uint8 codes: bytes
    return (
        k_codes.data_ptr() % 8 == 0
        and all(st % 8 == 0 for st in strides)
        and layout.band_byte_offsets[0] % 8 == 0
    )


def _band_columns_fit(k_scales: torch.Tensor, v_scales: torch.Tensor, block_m: int) -> bool:
    """Whether LaunchConfig.band_columns can run: a GQA block of at most 4 rows (the MMAs' columns
    4-7 repeat them) and scale rows of exactly two fp16 scales (the kernel's row stride is the key
    scales'), the value scales read as one 4-byte word per token (4-byte aligned rows)."""
    strides = v_scales.stride()[:3]  # fp16 elements
    return (
        block_m <= 4
        and k_scales.stride(2) == 2
        and v_scales.shape[-1] == 2
        and v_scales.stride(-1) == 1
        and v_scales.stride(2) == 2
        and v_scales.data_ptr() % 4 == 0
        and all(st % 2 == 0 for st in strides)
    )


def split_kernel_choice(
    config: LaunchConfig,
    layout: CompressedLayout,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
) -> str:
    """The split kernel a call runs: the config's where it can run, else v1 (every layout the
    Triton path accepts, and the faster Triton kernel on large launches: v2 is the fallback only
    of configs that ask for v2)."""
    if config.kernel == "v3" and _v3_reason(layout, k_codes, k_scales) is None:
        return "v3"
    if config.kernel == "v2" and _v2_reason(layout, k_codes, k_scales) is None:
        return "v2"
    return "v1"


def triton_support(layout: CompressedLayout) -> str | None:
    """None when the Triton kernel handles `layout`, else the reason it does not."""
    if not HAS_TRITON:
        return "triton is not installed"
    return _layout_reason(layout, "v1", _kernel_bands)


# the reduce's kernels and sizing: kernels/attention_reduce.py
from .attention_reduce import REDUCE_GEMM_TILE, reduce_split_chunk, uses_reduce_gemm  # noqa: E402

if HAS_TRITON:
    from .attention_reduce import (  # noqa: E402
        _merge_channel_rows_kernel,
        _reduce_kernel,
        _reduce_rows_kernel,
        _transform_heads_kernel,
    )

# launch configurations and launch sizing: kernels/attention_config.py
from .attention_config import (  # noqa: E402
    SMALL_LAUNCH_CONFIGS,
    SMALL_LAUNCH_PROGRAMS,
    TUNED_CONFIGS,
    LaunchConfig,
    SplitPlan,
    _sm_count,
    carveout_split_programs,
    choose_num_splits,
    choose_split_plan,
    default_config,
    exact_carveout,
    query_in_split_apply,
    resident_programs_per_sm,
    split_count,
    v1_fallback,
    value_subnormals_apply,
)


def tuned_config(
    layout: CompressedLayout, head_dim: int, block_m: int, programs: int | None = None
) -> LaunchConfig:
    """The tuned launch config for this layout's grids (affine: v2 could run it) and launch size
    (programs = sequences x kv heads x row blocks; None: a large launch), else the untuned default."""
    grids = "affine" if _v2_layout_reason(layout) is None else "table"
    key = (head_dim, block_m, grids)
    if programs is not None and programs <= SMALL_LAUNCH_PROGRAMS and key in SMALL_LAUNCH_CONFIGS:
        return SMALL_LAUNCH_CONFIGS[key]
    return TUNED_CONFIGS.get(key) or default_config(head_dim, block_m)


V2_MAX_BLOCK_M = 16  # v2 accumulators are [slots, rows] per field: more rows would spill


# Query rows (q heads of a group x new tokens) per program, by size. They are the N dimension of
# the MMAs (padded to 8 by Triton), so small groups waste little.
_BLOCK_M_STEPS = (4, 8, 16, 32, 64)


def _block_m(rows: int) -> int:
    for step in _BLOCK_M_STEPS:
        if rows <= step:
            return step
    return _BLOCK_M_STEPS[-1]


# ------------------------------------------------------------------------------------------------
# the query transform: kernel slot rows of W times the kv head's rotation, cached per channel tensor

# id(channel tensor) -> (weak reference to it, its version, slot rows, composite [Hkv, S, D] fp32).
# The weak reference proves the entry belongs to that very tensor (a freed tensor's id can be
# reused) and drops the entry when the tensor dies.
_COMPOSITES: dict[int, tuple] = {}


def _tensor_version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: never cache them
        return None


def _cached_product(cache: dict, channel_tensor: torch.Tensor, source: torch.Tensor, build) -> torch.Tensor:
    """build() cached while ``channel_tensor`` lives and is not modified in place (its version
    counter) and ``source`` is the same tensor; never stored during CUDA graph capture (a product
    computed there would only run at replay)."""
    version = _tensor_version(channel_tensor)
    key = id(channel_tensor)
    hit = cache.get(key) if version is not None else None
    if hit is not None and hit[0]() is channel_tensor and hit[1] == version and hit[2] is source:
        return hit[3]
    product = build()
    capturing = product.is_cuda and torch.cuda.is_current_stream_capturing()
    if version is not None and not capturing:
        ref = weakref.ref(channel_tensor, lambda _, key=key: cache.pop(key, None))
        cache[key] = (ref, version, source, product)
    return product


_VALUE_COMPOSITES: dict[int, tuple] = {}


def value_transform(
    inverse: torch.Tensor, rotation: torch.Tensor, scale: torch.Tensor, channel_tensor: torch.Tensor
) -> torch.Tensor:
    """[Hkv, D, D] fp32 C_h = W R_h diag(s_h): the reduce's whole way back from coefficient sums to
    centred channels (x - m = (c W R_h) * s_h) as one matrix per kv head, so the reduce reads one
    [D, D] matrix instead of two and runs one product. Computed in fp64, cached like
    query_transform (on the value channel tensor)."""

    def build() -> torch.Tensor:
        composite = torch.matmul(inverse.to(torch.float64), rotation.to(torch.float64))
        return (composite * scale.to(torch.float64)[:, None, :]).float().contiguous()

    return _cached_product(_VALUE_COMPOSITES, channel_tensor, inverse, build)


def fragment_words(matrix: torch.Tensor) -> torch.Tensor:
    """[H, M, K] (M and K multiples of 16) in fp16 as int32 words in the order of the Gluon v3
    kernel's m16n8k16 A fragments: [H, K / 16 column blocks, M / 16 row tiles, 32 lanes, 4 words],
    word w of lane 4g + t in a tile holding rows g + 8 (w % 2) and columns 8 (w // 2) + 2t, + 1 of
    it, so a lane loads a tile's 4 words as 16 contiguous bytes (_fragment_tiles)."""
    h, m, k = matrix.shape
    if m % 16 or k % 16:
        raise ValueError(f"fragment_words needs rows and columns in multiples of 16, got {m} x {k}")
    t = matrix.to(torch.float16)
    # [H, tile, row-hi w0, g, block, column-hi w1, t, half] -> [H, block, tile, g, t, w1, w0, half]
    parts = t.reshape(h, m // 16, 2, 8, k // 16, 2, 4, 2).permute(0, 4, 1, 3, 6, 5, 2, 7)
    words = parts.contiguous().view(torch.int16).view(torch.int32)
    return words.reshape(h, k // 16, m // 16, 32, 4)


_VALUE_SLOT_WORDS: dict[int, tuple] = {}


def value_slot_transform_words(
    inverse: torch.Tensor,
    rotation: torch.Tensor | None,
    slot_coef: torch.Tensor,
    channel_tensor: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """(words, head stride) for LaunchConfig.transform_in_split: per kv head the [D channels, S value
    slots] matrix T[c, j] = (W R_h)[coefficient of slot j, c] (0 for padding slots) in fp16, which
    maps a split's value-slot sums to centred channels before s, as fragment_words: [Hkv, S / 16
    operands, D / 16 row tiles, 32 lanes, 4 words]. One matrix, head stride 0, without a rotation.
    Built in fp64, cached like value_transform (on the value channel tensor)."""

    def build() -> torch.Tensor:
        composite = inverse.to(torch.float64)  # [D coefficients, D channels]
        if rotation is not None:
            composite = torch.matmul(composite, rotation.to(torch.float64))  # [Hkv, D, D]
        heads = composite.reshape(-1, *composite.shape[-2:])
        padding = slot_coef < 0
        rows = heads[:, slot_coef.clamp(min=0).long(), :]  # [H, S, D]
        rows[:, padding] = 0.0
        return fragment_words(rows.transpose(1, 2))  # T: [H, D channels, S slots]

    words = _cached_product(_VALUE_SLOT_WORDS, channel_tensor, slot_coef, build)
    return words, (words.stride(0) if rotation is not None else 0)


_QUERY_SLOT_WORDS: dict[int, tuple] = {}


def query_slot_transform_words(
    slot_rows: torch.Tensor,
    rotation: torch.Tensor | None,
    k_scale: torch.Tensor,
    channel_tensor: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """(words, head stride) for LaunchConfig.query_in_split: per kv head the prologue's [S slots, D
    channels] matrix M_h = W_slots R_h with the key channel scale folded in (M_h diag(s_k,h)), in
    fp16, as fragment_words ([Hkv, D / 16 channel blocks, S / 16 slot tiles, 32 lanes, 4 words]).
    The slots' factors and qk_scale stay out (in fp32 in the kernel): a 2-bit field's factor is
    2**-14 of its step, where fp16 would go subnormal. Built in fp64, cached on the key channel
    tensor."""

    def build() -> torch.Tensor:
        m = slot_rows.to(torch.float64)  # [S, D]
        if rotation is not None:
            m = torch.matmul(m, rotation.to(torch.float64))  # [Hkv, S, D]
        return fragment_words(m * k_scale.to(torch.float64)[:, None, :])

    words = _cached_product(_QUERY_SLOT_WORDS, channel_tensor, slot_rows, build)
    return words, words.stride(0)


def query_transform(
    slot_rows: torch.Tensor, rotation: torch.Tensor | None, channel_tensor: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """(M, head stride) with q_slots = M_h (q * s): M_h = W_slots R_h [S, D] fp32 for each kv head
    h (one matrix for all heads, stride 0, without a rotation). Folding R into W once per channel
    tensor lets the prologue run one [rows, D] x [D, S] product instead of two dependent ones
    (measured 13 us of a 44 us call at B = 1 before). Computed in fp64; cached while
    ``channel_tensor`` lives and is not modified in place (its version counter), never during CUDA
    graph capture (the product would only run at replay)."""
    if rotation is None:
        return slot_rows, 0
    composite = _cached_product(
        _COMPOSITES,
        channel_tensor,
        slot_rows,
        lambda: torch.matmul(slot_rows.to(torch.float64), rotation.to(torch.float64)).float().contiguous(),
    )
    return composite, composite.stride(0)


# ------------------------------------------------------------------------------------------------
# the Triton kernels this module launches (v3's split kernel: kernels/wavelet_attention_gluon.py)

if HAS_TRITON:
    from .wavelet_attention_kernels import (  # noqa: E402
        _exact_kernel,
        _prologue_heads_kernel,
        _prologue_kernel,
        _split_kernel,
        _split_kernel_v2,
    )


# _prologue_heads_kernel (LaunchConfig.prologue_tile_rows query rows a program) runs for decode
# launches with at least PROLOGUE_HEADS_MIN_ROWS query rows in all. Measured 2026-12-01 (H200,
# torch.profiler): at B = 8 (32 rows) 4.6 -> 4.7 us and the op no faster, so smaller launches keep
# one program per sequence.
PROLOGUE_HEADS_MIN_ROWS = 64


def exact_chunks(config: LaunchConfig, layout: CompressedLayout) -> tuple[int, int]:
    """(programs per (sequence, kv head, row block), slots each) of the exact-token kernel: the
    config's exact_chunks, in whole EXACT_BLOCK steps, none of them empty."""
    slots = layout.sinks + layout.window
    per_chunk = max(1, -(-slots // max(1, config.exact_chunks)))
    per_chunk = -(-per_chunk // config.exact_block) * config.exact_block
    return max(1, -(-slots // per_chunk)), per_chunk


def _pdl(config: LaunchConfig, device: torch.device) -> bool:
    """Whether this call launches with programmatic dependent launch: the config asks, on a GPU
    that has it (sm_90+), compiled (never under the interpreter)."""
    return (
        config.pdl
        and device.type == "cuda"
        and not _interpreting()
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def _dependent(pdl: bool) -> dict:
    """Launch keywords of a kernel that waits in-kernel for the one before it (its PDL constexpr
    makes it call griddepcontrol.wait before any read)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}


def _prologue_pdl(pdl: bool, config: LaunchConfig) -> dict:
    """Launch keywords of the prologue: with PDL it lets the split kernel launch at once, and with
    LaunchConfig.prologue_waits it is itself launched early and waits for the kernel before it."""
    if not pdl:
        return {}
    return {"PDL": True, "WAIT": True, "launch_pdl": True} if config.prologue_waits else {"PDL": True}


_SIDE_STREAMS = _side.STREAMS  # the shared second stream (kernels/side_stream.py)
_side_stream = _side.side_stream


def _launch_exact(
    q: torch.Tensor,
    common_exact: tuple,
    parts: tuple[torch.Tensor, ...],
    dims: tuple,
    layout: CompressedLayout,
    config: LaunchConfig,
    chain: bool = False,
    carveout: int = -1,
) -> None:
    """The exact sink/window tokens' partials (slots num_splits onwards, one per exact program:
    exact_chunks) for the v3 split kernel, on the current stream (arguments as for _launch_v3; dims
    end with n_parts and the exact slots per program). chain: launched with PDL right after the
    split kernel (LaunchConfig.exact_in_chain). carveout: its preferred shared-memory carveout in
    percent (attention_config.exact_carveout), -1 for the driver's choice."""
    _, _, m_part, l_part, acc_part = parts
    hkv, group, tq, n_row_blocks, num_splits, _, block_m, d, programs, qk_scale, n_parts, chunk_slots = dims
    chunks = n_parts - num_splits
    launch(
        _exact_kernel,
        (programs, chunks),
        q,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        *common_exact,
        m_part,
        l_part,
        acc_part,
        hkv,
        group,
        tq,
        n_row_blocks,
        num_splits,
        n_parts,
        qk_scale,
        D=d,
        BLOCK_M=block_m,
        EXACT_BLOCK=config.exact_block,
        SINKS=layout.sinks,
        WINDOW=layout.window,
        EXACT_SPLIT=common_exact[0].dtype in (torch.float16, torch.bfloat16),
        CHUNK_SLOTS=chunk_slots,
        num_warps=1,
        **({"PDL_CHAIN": True, "launch_pdl": True} if chain else {}),
        **({"CARVEOUT": carveout} if carveout >= 0 and q.is_cuda else {}),
    )


def _phase_clock_buffer(config: LaunchConfig, programs: int, device: torch.device) -> torch.Tensor | None:
    """With config.phase_clocks, phase_clock_buffer checked for a launch of `programs` split
    programs (else None)."""
    if not config.phase_clocks:
        return None
    need = programs * PHASE_SLOTS
    buffer = phase_clock_buffer
    if buffer is None or buffer.dtype != torch.int64 or buffer.numel() < need or buffer.device != device:
        raise ValueError(
            "LaunchConfig.phase_clocks needs wavelet_attention.phase_clock_buffer: an int64 tensor "
            f"on {device} of at least {need} elements (split programs x PHASE_SLOTS)"
        )
    return buffer


def _cache_operands(k_codes, k_scales, v_codes, v_scales) -> tuple:
    """The split kernels' cache arguments: each of the four tensors with its sequence and kv-head
    strides."""
    return tuple(x for t in (k_codes, k_scales, v_codes, v_scales) for x in (t, t.stride(0), t.stride(1)))


def _launch_v3(
    q: torch.Tensor,
    common_exact: tuple,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    seq_lens: torch.Tensor,
    plan2: _PlanV2,
    parts: tuple[torch.Tensor, ...],
    dims: tuple,
    layout: CompressedLayout,
    config: LaunchConfig,
    split_options: dict,
    side: torch.cuda.Stream | None = None,
    carveout: int = -1,
    plan: SplitPlan | None = None,
    value_channels: tuple | None = None,
    query_args: tuple | None = None,
) -> None:
    """The exact-token kernel and the Gluon split kernel v3 (wavelet_attention_triton's v3 branch;
    parts: its qw, qc and partial buffers; dims: its launch sizes, in the order unpacked below).
    value_channels: with config.transform_in_split, (T words, head stride, s, head stride) of
    value_slot_transform_words and the value channel scale. query_args: with config.query_in_split
    (no prologue ran), (q, its 3 strides, M s_k words, head stride, slot factors, slot shifts,
    qk_scale).
    side: a stream ordered after the prologue, to run the exact-token kernel on once the split
    kernel is enqueued (the caller joins it back before the reduce), else None. carveout: the
    exact-token kernel's (_launch_exact). plan: how the splits cut each span (equal splits of
    dims' num_splits when None)."""
    qw, qc, m_part, l_part, acc_part = parts
    hkv, group, tq, n_row_blocks, num_splits, n_qc, block_m, d, programs, qk_scale, n_parts, _ = dims
    if config.needs_ptx_patches:
        from . import ptx_patches

        ptx_patches.install()  # before the marked kernel compiles
    chain = config.exact_in_chain and _pdl(config, q.device)
    if side is None and not config.exact_in_chain:
        _launch_exact(q, common_exact, parts, dims, layout, config, carveout=carveout)
    if side is not None and config.exact_before_split:
        with torch.cuda.stream(side):
            _launch_exact(q, common_exact, parts, dims, layout, config, carveout=carveout)
    plan = plan or SplitPlan(num_splits)
    # a remainder plan's short splits go out last; split_major_grid: neighbouring blocks take
    # neighbouring programs (kv heads) instead of a program's neighbouring splits
    split_major = plan.split_major or config.split_major_grid
    clocks = _phase_clock_buffer(config, programs * plan.num_splits, q.device)
    if clocks is None:  # unread
        clocks = m_part
    if config.transform_in_split:
        if value_channels is None:
            raise ValueError("transform_in_split needs the value channels' transform (value_channels)")
    else:  # unread: any int32 and fp32 tensors
        value_channels = (plan2.slot_coef, 0, plan2.v_step, 0)
    if config.query_in_split:
        if query_args is None:
            raise ValueError("query_in_split needs the query and its slot transform (query_args)")
    else:  # unread
        query_args = (qw, 0, 0, 0, plan2.slot_coef, 0, plan2.v_step, plan2.v_step, 1.0)
    # what both split kernels take alike: the cache, each operand with its sequence and kv-head
    # strides, the lengths, the value slots' step and shift, and the cache rows' geometry
    cache = _cache_operands(k_codes, k_scales, v_codes, v_scales)
    cache_args = (*cache, seq_lens, plan2.v_step, plan2.v_shift)
    cache_constants = dict(
        CODE_ROW=k_codes.stride(2) // 2,
        E4=layout.band_byte_offsets[0] // 2,
        E2=layout.band_byte_offsets[1] // 2,
        D=d,
        BLOCK_N=config.block_n,
        SINKS=layout.sinks,
        WINDOW=layout.window,
    )
    if config.cta_splits:  # (checked by the caller: cta_splits_reason) a CTA of splits, a warp each
        from . import ptx_patches
        from .wavelet_attention_cta import WARPS, split_kernel_cta

        ptx_patches.install()  # its warp-barrier patch, before the kernel compiles

        _, q_sb, q_sh, _, qt_words, qt_stride, k_factor, k_shift, q_scale = query_args  # (q itself)
        vt_words, vt_stride, v_cs, v_cs_stride = value_channels
        launch(
            split_kernel_cta,
            (programs, -(-plan.num_splits // WARPS)),
            *cache_args,
            vt_words,
            vt_stride,
            v_cs,
            v_cs_stride,
            q,
            q_sb,
            q_sh,
            qt_words,
            qt_stride,
            k_factor,
            k_shift,
            q_scale,
            m_part,
            l_part,
            acc_part,
            hkv,
            plan.num_splits,  # (dims carry the CTAs' partials, one a CTA)
            n_parts,
            clocks,
            **cache_constants,
            TRIGGER_DEPENDENTS=chain,
            VALUE_SUBNORMALS=config.value_subnormals,
            PHASE_CLOCKS=config.phase_clocks,
            num_warps=WARPS,
            **split_options,
            **_dependent(_pdl(config, k_codes.device)),
        )
    else:
        from .wavelet_attention_gluon import split_kernel_v3

        launch(
            split_kernel_v3,
            (programs, num_splits) if split_major else (num_splits, programs),
            qw,
            qc,
            *cache_args,
            plan2.slot_coef,
            *value_channels,
            *query_args,
            m_part,
            l_part,
            acc_part,
            hkv,
            group,
            tq,
            n_row_blocks,
            num_splits,
            n_parts,
            plan.split_num,
            plan.split_den,
            clocks,
            *(
                _tma_row_descriptors(k_codes, v_codes) if config.tma_rows else (seq_lens, seq_lens)
            ),  # else unread
            **cache_constants,
            SCALE_ROW=k_scales.stride(2),
            BLOCK_M=block_m,
            N_QC=n_qc,
            **v3_option_constexprs(config, split_major),
            TRIGGER_DEPENDENTS=chain,
            num_warps=1,
            **split_options,
            **_dependent(_pdl(config, k_codes.device)),
        )
    if config.exact_in_chain:  # in order after the split kernel (beside it with PDL)
        _launch_exact(q, common_exact, parts, dims, layout, config, chain=chain, carveout=carveout)
    if side is not None and not config.exact_before_split:
        with torch.cuda.stream(side):
            _launch_exact(q, common_exact, parts, dims, layout, config, carveout=carveout)


def v3_option_constexprs(config: LaunchConfig, split_major: bool) -> dict:
    """split_kernel_v3's constexprs that follow from `config` (and the grid's order, split_major:
    a remainder plan's or split_major_grid). The launch and benchmarks/sass_attention_v3.py both
    take them from here, so the offline SASS is the launched kernel's. Options added late are
    passed only when on, so the kernels launched without them keep their JIT keys."""
    return dict(
        STAGES=config.num_stages,
        KEYS_VIA_SMEM=config.keys_via_smem,
        KEYS_AHEAD=config.keys_ahead,
        CACHE_TILES=config.cache_tiles,
        P_ONCE=config.convert_p_once,
        LAZY_RESCALE=config.lazy_rescale,
        COPY_LAYOUT_TOKENS=config.copy_layout_tokens,
        VALUE_SCALES_IN_B=config.value_scales_in_b,
        SCORE_OFFSET_IN_MMA=config.score_offset_in_mma,
        P_MOVMATRIX=config.p_movmatrix,
        STEP_ROW_BASE=config.step_row_base,
        ROW_COPIES=config.row_copies,
        KEY_LOADS_L2_256B=config.key_loads_l2_256b,
        KEY_WORD_PAIRS=config.key_word_pairs,
        ZERO_PADDING_P=config.zero_padding_p,
        VALUE_SUBNORMALS=config.value_subnormals,
        PACKED_P_SCALING=config.packed_p_scaling,
        BAND_COLUMNS=config.band_columns,
        VALUE_SCALES_STAGED=config.value_scales_staged,
        COUNTED_STEPS=config.counted_steps,
        TRANSFORM_IN_SPLIT=config.transform_in_split,
        QUERY_IN_SPLIT=config.query_in_split,
        PHASE_CLOCKS=config.phase_clocks,
        PREFETCH_VALUE_ROWS=config.prefetch_value_rows,
        FILL_VALUE_ROWS_L2=config.fill_value_rows_l2,
        VALUE_COPIES_L2_256B=config.value_copies_l2_256b,
        PLAIN_LOADS_L2_256B=config.plain_loads_l2_256b,
        **({"LOADS_BEFORE_WAIT": config.loads_before_pdl_wait} if config.loads_before_pdl_wait else {}),
        **({"SPLIT_MAJOR": True} if split_major else {}),
        **({"TMA_ROWS": True} if config.tma_rows else {}),
        **({"TMA_ROWS_UNFENCED": True} if config.tma_rows_unfenced else {}),
        **({"TMA_ROWS_EARLY": True} if config.tma_rows_early else {}),
        **({"SCALES_TWO_AHEAD": True} if config.scale_pairs_two_ahead else {}),
        **({"CARVEOUT": config.split_carveout} if config.split_carveout >= 0 else {}),
        **({"VALUE_BAND2_HALF": True} if config.value_band2_half else {}),
        **({"VALUE_COPIES_16B_L1": True} if config.value_copies_16b_l1 else {}),
        **({"TOKEN_SUMS_ROWS": True} if config.token_sums_rows else {}),
        **({"WARP_BARRIERS": True} if config.warp_barriers else {}),
    )


def tma_rows_reason(layout: CompressedLayout, k_codes: torch.Tensor, v_codes: torch.Tensor) -> str | None:
    """None when LaunchConfig.tma_rows can run on these caches, else what stands in the way: the
    kernel reads the default codec's 48-byte rows (the 4-bit band's 32 bytes, then the 2-bit
    band's 16) through a tensor descriptor of every row of a cache in turn, which Hopper's TMA unit
    copies (16-byte aligned, contiguous codes)."""
    needs = [
        (
            layout.n_code_bytes == 48 and tuple(layout.band_byte_offsets) == (0, 32),
            "48-byte code rows, bands at 0 and 32",
        ),
        (
            k_codes.is_cuda and torch.cuda.get_device_capability(k_codes.device)[0] >= 9,
            "a GPU with TMA (sm_90+)",
        ),
        (
            all(c.is_contiguous() and c.data_ptr() % 16 == 0 for c in (k_codes, v_codes)),
            "contiguous, 16-byte aligned codes",
        ),
    ]
    missing = [what for ok, what in needs if not ok]
    return None if not missing else "tma_rows needs " + ", ".join(missing)


def _tma_row_descriptors(k_codes: torch.Tensor, v_codes: torch.Tensor) -> tuple:
    """TMA_ROWS' tensor descriptors: each cache's codes as [rows, 24] int16 (every (sequence, kv
    head)'s rows in turn), [64, 32] blocks (the box's columns 24-31 fall outside: zero-filled)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from .wavelet_attention_gluon import TMA_ROWS_LAYOUT

    def rows(codes: torch.Tensor):
        view = codes.view(torch.int16).view(-1, codes.shape[-1] // 2)
        return TensorDescriptor.from_tensor(view, [64, 32], TMA_ROWS_LAYOUT)

    return rows(k_codes), rows(v_codes)


def cta_splits_reason(
    config: LaunchConfig, plan: SplitPlan, shape: tuple, layout: CompressedLayout, k_scales: torch.Tensor
) -> str | None:
    """None when LaunchConfig.cta_splits can run this launch (kernels/wavelet_attention_cta.py
    implements the small-launch config's path only), else what stands in the way. shape: (GQA
    group, new tokens, row blocks, rows a block, head_dim)."""
    from .wavelet_attention_cta import WARPS

    group, tq, n_row_blocks, block_m, d = shape
    num_splits = plan.num_splits
    needs = [
        (config.cta_splits == WARPS, f"{WARPS} splits a CTA (the kernel's warps)"),
        (
            d == 128 and config.block_n == 64 and config.num_stages == 1,
            "head_dim 128, 64-token steps, one stage",
        ),
        (
            group == 4 and tq == 1 and n_row_blocks == 1 and block_m == 4,
            "a GQA group of 4 rows, one new token",
        ),
        (
            config.band_columns and config.query_in_split and config.transform_in_split,
            "band_columns, query_in_split, transform_in_split",
        ),
        (
            config.keys_ahead and config.key_loads_l2_256b and not config.keys_via_smem,
            "keys a step ahead, L2::256B loads",
        ),
        (
            not config.key_word_pairs and not config.row_copies and config.cache_tiles,
            "no key_word_pairs, row_copies; cache_tiles",
        ),
        (
            config.score_offset_in_mma and config.p_movmatrix and config.convert_p_once,
            "score_offset_in_mma, p_movmatrix",
        ),
        (not config.lazy_rescale, "no lazy_rescale"),
        (plan.split_num == 1 and plan.split_den == num_splits and not plan.split_major, "equal splits"),
        (k_scales.stride(2) == 2 and layout.n_bands == 2, "two fp16 scales a row"),
    ]
    missing = [what for ok, what in needs if not ok]
    return "needs " + "; ".join(missing) if missing else None


def wavelet_attention_triton(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    k_exact: torch.Tensor,
    v_exact: torch.Tensor,
    seq_lens: torch.Tensor,
    k_channel_scale: torch.Tensor,
    v_channel_scale: torch.Tensor,
    layout: CompressedLayout,
    sm_scale: float,
    config: LaunchConfig | None = None,
    num_splits: int | SplitPlan | None = None,
    validate: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1).

    Raises ValueError on bad input and UnsupportedLayout when the layout is outside the kernel.
    ``config``/``num_splits`` override the tuned launch parameters (benchmarks and tests):
    ``num_splits`` an int for that many equal splits, or a SplitPlan. ``sinks``: a learned sink
    logit per query head (gpt-oss), as in wavelet_attention_reference.
    """
    if not HAS_TRITON:
        raise UnsupportedLayout("triton is not installed")
    if validate:
        check_attention_inputs(
            q,
            k_codes,
            k_scales,
            v_codes,
            v_scales,
            k_exact,
            v_exact,
            seq_lens,
            k_channel_scale,
            v_channel_scale,
            layout,
        )
        check_sink_logits(sinks, q)
    reason = triton_support(layout)
    if reason is not None:
        raise UnsupportedLayout(f"wavelet_attention Triton kernel: unsupported {reason}")
    interpreting = _interpreting()
    if not (q.is_cuda or interpreting):
        raise ValueError("the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
    for name, t in (
        ("k_codes", k_codes),
        ("v_codes", v_codes),
        ("k_scales", k_scales),
        ("v_scales", v_scales),
    ):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    if k_codes.stride(2) != v_codes.stride(2) or k_scales.stride(2) != v_scales.stride(2):
        raise ValueError("k and v caches must share their per-token strides")
    batch, hq, tq, d = q.shape
    hkv, capacity = k_codes.shape[1], k_codes.shape[2]
    group = hq // hkv
    rows = group * tq
    block_m = _block_m(rows)
    n_row_blocks = -(-rows // block_m)
    if config is None:
        config = tuned_config(layout, d, block_m, batch * hkv * n_row_blocks)
    kernel = split_kernel_choice(config, layout, k_codes, k_scales)
    if config.kernel == "v3" and kernel != "v3":
        config = v1_fallback(config, block_m)
    use_v3, use_v2 = kernel == "v3", kernel == "v2"
    if use_v3 and config.key_word_pairs and not _key_pairs_aligned(k_codes, layout):
        # the paired loads read 8 bytes at once: rows that are not 8-byte aligned take the same
        # kernel with one 4-byte load per word
        config = replace(config, key_word_pairs=False)
    if use_v3 and config.band_columns and not _band_columns_fit(k_scales, v_scales, block_m):
        # GQA groups of more than 4 rows fill the MMAs' columns; other scale rows: the two B operands
        config = replace(config, band_columns=False)
    if use_v2 and block_m > V2_MAX_BLOCK_M:
        block_m = V2_MAX_BLOCK_M
        n_row_blocks = -(-rows // block_m)
    if use_v3 and block_m > V3_MAX_ROWS:
        # the MMAs take 8 query rows: a larger group runs in row blocks of 8, each program reading
        # its kv head's codes (a row block's programs are neighbours in the grid, so they read the
        # same rows at about the same time: the second read can find them in L2; not measured)
        block_m = V3_MAX_ROWS
        n_row_blocks = -(-rows // block_m)
    programs = batch * hkv * n_row_blocks
    if num_splits is None:
        plan = choose_split_plan(programs, capacity, layout, config, q.device)
    elif isinstance(num_splits, SplitPlan):
        plan = num_splits
    else:  # equal splits, as given
        plan = SplitPlan(num_splits)
    num_splits, split_num, split_den = plan.num_splits, plan.split_num, plan.split_den
    if use_v3 and config.query_in_split and not query_in_split_apply(config, programs * num_splits, q.device):
        # a launch of more waves than config.query_in_split_waves: the prologue transforms the query
        config = replace(config, query_in_split=False)
    if config.value_subnormals and not value_subnormals_apply(config, capacity - layout.n_exact, plan):
        # uncentred value sums lose precision with the split's length: past the bound (from the
        # capacity, so no host sync), the centred step
        # (token_sums_rows reads the sums that value_subnormals leaves to the store: off with it)
        config = replace(config, value_subnormals=False, token_sums_rows=False)
    # partials per program: the compressed splits, then the exact tokens' (v3: exact_chunks of them,
    # from their own kernel; v1 and v2: one, from the split kernel's last split)
    exact_programs, exact_slots = exact_chunks(config, layout) if use_v3 else (1, 0)
    # the compressed partials: one a split, or with cta_splits one a CTA (its warps' splits merged)
    compressed_parts = num_splits
    if use_v3 and config.cta_splits:
        # where the CTA kernel's path does not fit (cta_splits_reason says why: another GQA group,
        # several new tokens, a launch of more waves than query_in_split takes ...), one split a
        # program, as query_in_split and value_subnormals apply where they fit
        if cta_splits_reason(config, plan, (group, tq, n_row_blocks, block_m, d), layout, k_scales):
            config = replace(config, cta_splits=0)
        else:
            compressed_parts = -(-num_splits // config.cta_splits)
    if use_v3 and config.tma_rows and tma_rows_reason(layout, k_codes, v_codes):
        # (the same step, its rows by loads and copies)
        config = replace(
            config, tma_rows=False, tma_rows_unfenced=False, tma_rows_early=False, scale_pairs_two_ahead=False
        )
    n_parts = compressed_parts + exact_programs
    device = q.device
    if use_v3 or use_v2:
        plan2 = (
            _plan_v3(layout, device, config.key_word_pairs)
            if use_v3
            else _plan_v2(layout, device, config.subnormal)
        )
        n_slots = plan2.k_slots
        slot_rows, slot_factor, slot_shift, slot_band = (
            plan2.transform_slots,
            plan2.k_factor,
            plan2.k_shift,
            plan2.slot_chunk,
        )
        inverse = plan2.transform
    else:
        plan = _plan(layout, device)
        n_slots = d
        slot_rows, slot_factor, slot_shift, slot_band = (
            plan.transform_slots,
            plan.col_step,
            plan.col_shift,
            plan.col_band,
        )
        inverse = plan.transform_slots
    # the prologue's slot chunks: D_CHUNK divides the slots (a power of two times the plane width)
    d_chunk = min(32, n_slots & -n_slots)
    n_qc = n_slots // d_chunk
    qw = torch.empty(programs, block_m, n_slots, device=device, dtype=torch.float16)
    qc = torch.empty(programs, n_qc, block_m, 4, device=device, dtype=torch.float32)
    m_part = torch.empty(programs, n_parts, block_m, device=device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(programs, n_parts, block_m, d, device=device, dtype=torch.float32)
    out = torch.empty(q.shape, device=device, dtype=q.dtype)
    qk_scale = float(sm_scale) * LOG2E
    # views into the caller's channel tensors (no per-call copies): kernels read them with a
    # per-kv-head stride and rows contiguous in D
    k_params = attention_channel_params(k_channel_scale, hkv, d, "k_channel_scale", copy=False)
    v_params = attention_channel_params(v_channel_scale, hkv, d, "v_channel_scale", copy=False)
    k_cs, v_cs = _on(k_params.scale, device), _on(v_params.scale, device)
    k_rotation = None if k_params.rotation is None else _on(k_params.rotation, device)
    v_rotation = None if v_params.rotation is None else _on(v_params.rotation, device)
    v_offset = None if v_params.offset is None else _on(v_params.offset, device)
    pdl = _pdl(config, device)  # the prologue lets the split kernel launch early; see LaunchConfig.pdl
    # overlap_exact: the exact-token kernel runs on the side stream (forked after the prologue);
    # deferred cache writes of this step's tokens (kernels/side_stream.py) are queued there ahead of
    # it. Without that ordering, the current stream waits for them before anything reads the caches.
    side = _side_stream(device) if use_v3 and config.overlap_exact and q.is_cuda else None
    caches = (k_codes, k_scales, v_codes, v_scales, k_exact, v_exact)
    if q.is_cuda and side is None and any(_side.pending(c) for c in caches):
        _side.join(device, caches)
    query_in_split = use_v3 and config.query_in_split
    query_args = None
    # the prologue's fp32 transform: not needed (nor built) where the split kernel transforms the query
    if not query_in_split:
        q_transform, q_transform_stride_h = query_transform(slot_rows, k_rotation, k_channel_scale)
    if query_in_split:
        # no prologue: the split kernel transforms the query itself (LaunchConfig.query_in_split)
        words, stride = query_slot_transform_words(slot_rows, k_rotation, k_cs, k_channel_scale)
        query_args = (q, *q.stride()[:3], words, stride, slot_factor, slot_shift, qk_scale)
    elif n_row_blocks == 1 and batch * block_m >= PROLOGUE_HEADS_MIN_ROWS and d <= 128:
        # decode with many sequences: the rows that share a kv head's transform in one dot (head_dim
        # 256 would hold a [64, 256] fp32 query tile per program: not measured, so not taken)
        launch(
            _prologue_heads_kernel,
            (hkv, -(-batch * block_m // config.prologue_tile_rows), n_qc),
            q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cs,
            k_cs.stride(0),
            q_transform,
            q_transform_stride_h,
            slot_factor,
            slot_shift,
            slot_band,
            qw,
            qc,
            batch,
            hkv,
            group,
            tq,
            qk_scale,
            D=d,
            S=n_slots,
            BLOCK_M=block_m,
            D_CHUNK=d_chunk,
            ROWS=config.prologue_tile_rows,
            PRECISION=config.prologue_precision,
            num_warps=config.prologue_warps,
            **_prologue_pdl(pdl, config),
        )
    else:
        launch(
            _prologue_kernel,
            (programs, n_qc),
            q,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cs,
            k_cs.stride(0),
            q_transform,
            q_transform_stride_h,
            slot_factor,
            slot_shift,
            slot_band,
            qw,
            qc,
            hkv,
            group,
            tq,
            n_row_blocks,
            qk_scale,
            D=d,
            S=n_slots,
            BLOCK_M=block_m,
            D_CHUNK=d_chunk,
            PRECISION=config.prologue_precision,
            num_warps=config.prologue_warps,
            **_prologue_pdl(pdl, config),
        )
    # overlap_exact: the exact-token kernel's stream forks after the prologue and joins back
    # before the reduce; the kernel is enqueued after the split kernel, so the split's programs
    # take the SMs first and the exact ones fill the slots its last, partial wave leaves free
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    # ptxas register cap for the split kernel (more resident programs per SM; GPU compile only)
    split_options = {} if config.maxnreg is None or interpreting else {"maxnreg": config.maxnreg}
    common_exact = (
        k_exact,
        *k_exact.stride()[:3],
        v_exact,
        *v_exact.stride()[:3],
        seq_lens,
    )
    value_channels = None
    if use_v3 and config.transform_in_split:
        words, stride = value_slot_transform_words(inverse, v_rotation, plan2.slot_coef, v_channel_scale)
        value_channels = (words, stride, v_cs, v_cs.stride(0))
    if use_v3:
        _phase_clock_buffer(config, programs * num_splits, device)  # (refused here, not by falling back)
        try:
            try:
                _launch_v3(
                    q,
                    common_exact,
                    k_codes,
                    k_scales,
                    v_codes,
                    v_scales,
                    seq_lens,
                    plan2,
                    (qw, qc, m_part, l_part, acc_part),
                    (hkv, group, tq, n_row_blocks, compressed_parts, n_qc, block_m, d, programs, qk_scale)
                    + (n_parts, exact_slots),
                    layout,
                    config,
                    split_options,
                    side,
                    exact_carveout(
                        config, carveout_split_programs(programs, plan), programs * exact_programs, device
                    ),
                    plan,
                    value_channels,
                    query_args,
                )
            finally:  # the reduce (or the fallback below) runs after the exact tokens' partial
                if side is not None:
                    torch.cuda.current_stream(device).wait_stream(side)
                    _side.forget(caches)  # deferred writes into them came before it
        except Exception as exc:  # noqa: BLE001 - any build or launch failure: run v1 instead
            global _V3_FAILURE
            _V3_FAILURE = f"v3 failed on this Triton ({type(exc).__name__}: {str(exc)[:300]})"
            warnings.warn(f"wavelet_attention: {_V3_FAILURE}; the v1 kernel runs instead", stacklevel=2)
            return wavelet_attention_triton(
                q,
                k_codes,
                k_scales,
                v_codes,
                v_scales,
                k_exact,
                v_exact,
                seq_lens,
                k_channel_scale,
                v_channel_scale,
                layout,
                sm_scale,
                v1_fallback(config, _block_m(rows)),
                plan,
                validate=False,
                sinks=sinks,
            )
    else:
        # what the v1 and v2 split kernels take alike; they differ in their slot tables (v1: the
        # plane lookup, step and value shift per column; v2: the value slots' step, shift and
        # coefficient) and in a few constexprs
        query_and_cache = (qw, qc, q, *q.stride()[:3], *_cache_operands(k_codes, k_scales, v_codes, v_scales))
        partials_and_sizes = (m_part, l_part, acc_part, hkv, group, tq, n_row_blocks, num_splits)
        common_constants = dict(
            CODE_STRIDE=k_codes.stride(2),
            SCALE_STRIDE=k_scales.stride(2),
            N_SCALES=layout.n_bands,
            D=d,
            BLOCK_M=block_m,
            N_QC=n_qc,
            BLOCK_N=config.block_n,
            EXACT_BLOCK=config.exact_block,
            SINKS=layout.sinks,
            WINDOW=layout.window,
            USE_ASM=config.use_asm and not interpreting,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            **split_options,
        )
        if use_v2:
            slot_tables = (plan2.v_step, plan2.v_shift, plan2.slot_coef)
            kernel = _split_kernel_v2
            options = dict(
                S=n_slots,
                SUBNORMAL=config.subnormal,
                LAZY_RESCALE=config.lazy_rescale,
                CHUNKS=plan2.chunk_constexpr,
                EXACT_SPLIT=k_exact.dtype in (torch.float16, torch.bfloat16) and not interpreting,
                CENTRE_IN_MMA=config.centre_in_mma and not config.subnormal,
                VALUE_WORDS_ONCE=config.value_words_once,
            )
        else:
            slot_tables = (plan.lut, plan.col_step, plan.col_vshift)
            kernel = _split_kernel
            options = dict(CENTRE_IN_MMA=config.centre_in_mma, **plan.constexprs, **_dependent(pdl))
        launch(
            kernel,
            (num_splits + 1, programs),
            *query_and_cache,
            *common_exact,
            *slot_tables,
            *partials_and_sizes,
            split_num,
            split_den,
            qk_scale,
            **common_constants,
            **options,
        )
    # W, R and s as one matrix per kv head: the reduces apply no R (channel partials need none)
    if v_rotation is not None and value_channels is None:
        inverse = value_transform(inverse, v_rotation, v_cs, v_channel_scale)
        v_cs = _ones(hkv, d, device)
    # the way back to channels and out: what the reduces and _transform_heads_kernel all take
    output_args = (
        inverse,
        inverse.stride(0) if inverse.dim() == 3 else 0,
        v_cs,
        v_cs.stride(0),
        v_cs if v_offset is None else v_offset,  # unread without OFFSET
        0 if v_offset is None else v_offset.stride(0),
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    # learned sink logits (natural units) per query head: the reduces scale each row by the mass
    # the positions keep next to it (attention_reduce.kept_mass), moving the logit by q . m_k
    # where the keys are stored centred; unread placeholders without
    k_offset = None if sinks is None or k_params.offset is None else _on(k_params.offset, device)
    sink_args = (
        out if sinks is None else sinks.contiguous(),
        q,
        *q.stride()[:3],
        out if k_offset is None else k_offset,
        0 if k_offset is None else k_offset.stride(0),
        qk_scale,
    )
    reduce_args = (
        m_part,
        l_part,
        acc_part,
        *output_args,
        *sink_args,
        hkv,
        group,
        tq,
        n_row_blocks,
        num_splits,
        n_parts,
    )
    channel_flags = dict(OFFSET=v_offset is not None)
    sink_flags = {} if sinks is None else {"SINK_LOGITS": True, "SINK_KEY_OFFSET": k_offset is not None}
    # the reduce waits in-kernel for the split kernel (PDL) unless a stream join comes between them
    if value_channels is not None:
        # every partial in the channel domain: one merge, no transform (LaunchConfig.transform_in_split)
        channels = min(config.channel_merge_channels, d)
        launch(
            _merge_channel_rows_kernel,
            (programs * block_m, d // channels),
            m_part,
            l_part,
            acc_part,
            *output_args[4:],
            *sink_args,
            hkv,
            group,
            tq,
            n_row_blocks,
            n_parts,
            D=d,
            BLOCK_M=block_m,
            SPLIT_CHUNK=reduce_split_chunk(config, n_parts),
            CHANNELS=channels,
            num_warps=config.channel_merge_warps,
            **channel_flags,
            **sink_flags,
            **_dependent(pdl and side is None),
        )
    elif programs * block_m <= config.row_reduce_max_programs * _sm_count(device):
        # few (sequence, kv head) pairs and many splits: one program per query row
        gemm = uses_reduce_gemm(config, programs * block_m, n_row_blocks)
        merge_warps = config.reduce_merge_warps if gemm and config.reduce_merge_warps else config.reduce_warps
        # the merge of each row over several programs, a slice of its D sums each
        channels = min(config.reduce_merge_channels, d) if gemm else 0
        launch(
            _reduce_rows_kernel,
            (programs * block_m, d // channels) if channels else (programs * block_m,),
            *reduce_args,
            D=d,
            BLOCK_M=block_m,
            SPLIT_CHUNK=reduce_split_chunk(config, n_parts),
            num_warps=merge_warps,
            **({"TRANSFORM_FIRST": True} if config.reduce_transform_first else {}),
            **channel_flags,
            **sink_flags,
            **_dependent(pdl and side is None),
            **({"MERGE_ONLY": True} if gemm else {}),
            **({"CHANNELS": channels} if channels else {}),
        )
        if gemm:
            tile = REDUCE_GEMM_TILE
            launch(
                _transform_heads_kernel,
                (hkv * -(-batch * block_m // tile), d // min(d, config.transform_channels)),
                acc_part,
                *output_args,
                hkv,
                group,
                tq,
                batch,
                num_splits,
                n_parts,
                D=d,
                BLOCK_M=block_m,
                TILE=tile,
                D_CHUNK=min(d, config.transform_channels),
                num_warps=config.transform_warps,
                # with sink logits the merge weighted the offset into the exact part already
                OFFSET=v_offset is not None and sinks is None,
                **_dependent(pdl),
            )
    else:
        launch(
            _reduce_kernel,
            (programs,),
            *reduce_args,
            D=d,
            BLOCK_M=block_m,
            D_CHUNK=min(d, 32),
            num_warps=4,
            **channel_flags,
            **sink_flags,
            **_dependent(pdl and side is None),
        )
    return out


def bytes_read(
    layout: CompressedLayout, batch: int, n_kv_heads: int, seq_len: int, exact_itemsize: int
) -> int:
    """Bytes a decode step must read: compressed K and V of every non-exact position plus the exact
    sink/window tokens (the floor the benchmark divides by bandwidth)."""
    n_exact = min(seq_len, layout.n_exact)
    n_comp = seq_len - n_exact
    per_head = 2 * n_comp * layout.bytes_per_vector + 2 * n_exact * layout.head_dim * exact_itemsize
    return batch * n_kv_heads * per_head


__all__ = [
    "CompressedLayout",
    "LaunchConfig",
    "TUNED_CONFIGS",
    "UnsupportedLayout",
    "bytes_read",
    "ChannelParams",
    "attention_channel_params",
    "channel_scale_2d",
    "check_attention_inputs",
    "choose_num_splits",
    "choose_split_plan",
    "decode_coefficients",
    "default_config",
    "resident_programs_per_sm",
    "split_count",
    "split_kernel_choice",
    "triton_support",
    "tuned_config",
    "wavelet_attention_reference",
    "wavelet_attention_triton",
]
