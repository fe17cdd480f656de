"""The `wmoe` ONNX domain: operator schemas and their bodies in standard ONNX ops.

Every wmoe op exported to ONNX becomes one node in the `wmoe` domain (opset version 1) whose
attributes carry everything that fixes its maths (the codec spec string, head_dim, ...). A
TensorRT plugin or another runtime can implement the node directly; for everyone else the model
carries a model-local FunctionProto per node variant, built here from standard ops, so
onnxruntime runs it and the portable flavour is just these functions inlined.

The bodies follow the PyTorch reference (wmoe_compile/codec.py, kernels/) step by step: the same
fp32 operations, the scale rounded to fp16 before coding, a code counted as the number of grid
midpoints strictly below c / scale, the same candidate order for the `mse` scale rule. The only
expected difference is the summation order inside MatMul / ReduceSum, so a coefficient lying
within rounding of a decision boundary can land one level over (as between the reference and the
Triton kernel).

A variant is one distinct attribute set: nodes that share it call one function; different
variants use FunctionProto overloads (ONNX IR >= 10), so one op name serves every codec.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import defs

WMOE_DOMAIN = "wmoe"
WMOE_OPSET_VERSION = 1

_FLOAT = ir.DataType.FLOAT
_FLOAT16 = ir.DataType.FLOAT16
_INT64 = ir.DataType.INT64
_INT32 = ir.DataType.INT32
_UINT8 = ir.DataType.UINT8
_BOOL = ir.DataType.BOOL

_FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


# ----------------------------------------------------------------------------------------------
# schemas


def _schema(
    name: str,
    doc: str,
    inputs: Sequence[tuple[str, str]],
    outputs: Sequence[tuple[str, str]],
    attributes: Sequence[tuple[str, defs.OpSchema.AttrType, str]],
    type_constraints: Sequence[tuple[str, list[str]]],
) -> defs.OpSchema:
    return defs.OpSchema(
        name,
        WMOE_DOMAIN,
        WMOE_OPSET_VERSION,
        doc=doc,
        inputs=[defs.OpSchema.FormalParameter(n, t) for n, t in inputs],
        outputs=[defs.OpSchema.FormalParameter(n, t) for n, t in outputs],
        type_constraints=[(n, types, "") for n, types in type_constraints],
        attributes=[defs.OpSchema.Attribute(n, kind, d, required=True) for n, kind, d in attributes],
    )


_STR = defs.OpSchema.AttrType.STRING
_INT = defs.OpSchema.AttrType.INT
_FLT = defs.OpSchema.AttrType.FLOAT
_CODEC_ATTRS = [
    ("codec", _STR, "canonical codec spec (WaveletKVConfig.to_spec())"),
    ("head_dim", _INT, "head dimension D"),
]
_CHANNEL_DOC = (
    "form of the channel parameters input (docs/CONTRACTS.md): s ([Hkv|1, D] smoothing), "
    "sm ([2, Hkv|1, D] smoothing and offset), rsm ([Hkv|1, D + 2, D] rotation, smoothing, offset)"
)

# wmoe::wavelet_attention's inputs, attributes and type constraints (both of its functions)
_ATTENTION_INPUTS = [
    ("q", "T"),
    ("k_codes", "tensor(uint8)"),
    ("k_scales", "tensor(float16)"),
    ("v_codes", "tensor(uint8)"),
    ("v_scales", "tensor(float16)"),
    ("k_exact", "E"),
    ("v_exact", "E"),
    ("seq_lens", "I"),
    ("k_channel_scale", "S"),
    ("v_channel_scale", "S"),
]
_ATTENTION_ATTRS = [
    *_CODEC_ATTRS,
    ("k_channel_params", _STR, _CHANNEL_DOC),
    ("v_channel_params", _STR, _CHANNEL_DOC),
    ("sm_scale", _FLT, "softmax scale"),
    ("window", _INT, "sliding window: query t attends positions above its own less window; 0: none"),
]
_ATTENTION_TYPES = [
    ("T", _FLOAT_TYPES),
    ("E", _FLOAT_TYPES),
    ("S", _FLOAT_TYPES),
    ("I", ["tensor(int64)", "tensor(int32)"]),
]

SCHEMAS: dict[str, defs.OpSchema] = {
    "KvCompress": _schema(
        "KvCompress",
        "wmoe::kv_compress: x [..., Hkv, T, D] -> codes uint8 [..., n_code_bytes], "
        "scales fp16 [..., n_bands]",
        [("x", "T"), ("channel_scale", "S")],
        [("codes", "tensor(uint8)"), ("scales", "tensor(float16)")],
        [*_CODEC_ATTRS, ("channel_params", _STR, _CHANNEL_DOC)],
        [("T", _FLOAT_TYPES), ("S", _FLOAT_TYPES)],
    ),
    "KvDecompress": _schema(
        "KvDecompress",
        "wmoe::kv_decompress: codes, scales -> x [..., D] in the element type `dtype`",
        [("codes", "tensor(uint8)"), ("scales", "tensor(float16)"), ("channel_scale", "S")],
        [("x", "T")],
        [
            *_CODEC_ATTRS,
            ("channel_params", _STR, _CHANNEL_DOC),
            ("dtype", _INT, "ONNX element type of the output"),
        ],
        [("T", _FLOAT_TYPES), ("S", _FLOAT_TYPES)],
    ),
    "KvCompressIntoCache": _schema(
        "KvCompressIntoCache",
        "wmoe::kv_compress_into_cache, functional: returns the updated codes, scales and exact caches",
        [
            ("x", "T"),
            ("codes_cache", "tensor(uint8)"),
            ("scales_cache", "tensor(float16)"),
            ("exact_cache", "E"),
            ("positions", "I"),
            ("channel_scale", "S"),
        ],
        [
            ("codes_cache_out", "tensor(uint8)"),
            ("scales_cache_out", "tensor(float16)"),
            ("exact_cache_out", "E"),
        ],
        [*_CODEC_ATTRS, ("channel_params", _STR, _CHANNEL_DOC)],
        [
            ("T", _FLOAT_TYPES),
            ("E", _FLOAT_TYPES),
            ("S", _FLOAT_TYPES),
            ("I", ["tensor(int64)", "tensor(int32)"]),
        ],
    ),
    "WaveletAttention": _schema(
        "WaveletAttention",
        "wmoe::wavelet_attention: causal GQA attention of q over the compressed cache plus the exact "
        "sink/window tokens",
        _ATTENTION_INPUTS,
        [("out", "T")],
        _ATTENTION_ATTRS,
        _ATTENTION_TYPES,
    ),
    "WaveletAttentionSinks": _schema(
        "WaveletAttentionSinks",
        "wmoe::wavelet_attention with learned sink logits (gpt-oss): one logit per query head joins "
        "the softmax and attends to nothing",
        [*_ATTENTION_INPUTS, ("sinks", "F")],
        [("out", "T")],
        _ATTENTION_ATTRS,
        [*_ATTENTION_TYPES, ("F", _FLOAT_TYPES)],
    ),
    "TiledMoe": _schema(
        "TiledMoe",
        "wmoe::tiled_moe: top-k SwiGLU experts over packed weights, weighted combine fused",
        [("hidden", "T"), ("topk_ids", "I"), ("topk_weights", "W"), ("w_gate_up", "T"), ("w_down", "T")],
        [("out", "T")],
        [
            ("layout", _STR, "packed weight layout: tiles64 | rows"),
            ("num_experts", _INT, "E"),
            ("ffn_pad", _INT, "expert ffn size rounded up to 64"),
            ("hidden_pad", _INT, "hidden size rounded up to 64"),
        ],
        [("T", _FLOAT_TYPES), ("W", _FLOAT_TYPES), ("I", ["tensor(int64)", "tensor(int32)"])],
    ),
    "TiledMoeBiased": _schema(
        "TiledMoeBiased",
        "wmoe::tiled_moe with expert biases and a clamped SwiGLU (gpt-oss): "
        "g * sigmoid(gate_alpha g) * (u + up_offset), g and u clamped when clamped = 1",
        [
            ("hidden", "T"),
            ("topk_ids", "I"),
            ("topk_weights", "W"),
            ("w_gate_up", "T"),
            ("w_down", "T"),
            ("b_gate_up", "tensor(float)"),
            ("b_down", "tensor(float)"),
        ],
        [("out", "T")],
        [
            ("layout", _STR, "packed weight layout: tiles64 | rows"),
            ("num_experts", _INT, "E"),
            ("ffn_pad", _INT, "expert ffn size rounded up to 64"),
            ("hidden_pad", _INT, "hidden size rounded up to 64"),
            ("gate_alpha", _FLT, "the gate's sigmoid slope"),
            ("clamped", _INT, "1: gate clamped from above, up on both sides, at clamp_limit"),
            ("clamp_limit", _FLT, "the clamp's limit (read when clamped = 1)"),
            ("up_offset", _FLT, "added to the up projection"),
        ],
        [("T", _FLOAT_TYPES), ("W", _FLOAT_TYPES), ("I", ["tensor(int64)", "tensor(int32)"])],
    ),
}


def register_schemas() -> None:
    """Register the wmoe-domain schemas with onnx.defs (idempotent), so checkers know them."""
    for name, schema in SCHEMAS.items():
        if not defs.has(name, WMOE_DOMAIN):
            defs.register_schema(schema)


# ----------------------------------------------------------------------------------------------
# a small builder over onnx_ir's tape


class _Body:
    """Builds one function body: `op` appends a node, `const` a Constant node."""

    def __init__(self, opset_version: int) -> None:
        self.tape = ir.tape.Tape()
        self.opset_version = opset_version

    def op(self, op_type: str, *inputs: ir.Value | None, **attributes: Any) -> ir.Value:
        return self.tape.op(op_type, list(inputs), attributes or None)

    def ops(
        self, op_type: str, *inputs: ir.Value | None, num_outputs: int, **attributes: Any
    ) -> list[ir.Value]:
        return list(
            self.tape.op_multi_out(op_type, list(inputs), attributes or None, num_outputs=num_outputs)
        )

    def const(self, value: Any, dtype: Any = None) -> ir.Value:
        array = np.asarray(value, dtype=dtype)
        return self.op("Constant", value=ir.tensor(array))

    def i64(self, *values: int) -> ir.Value:
        return self.const(list(values), np.int64)

    def range_to(self, count: ir.Value) -> ir.Value:
        """0, 1, ..., count - 1 for a 1-element int64 tensor `count` (Range takes scalars)."""
        zero, one = self.const(0, np.int64), self.const(1, np.int64)
        return self.op("Range", zero, self.op("Squeeze", count, self.i64(0)), one)

    def f32(self, value: Any) -> ir.Value:
        return self.const(value, np.float32)

    def reshape_last(self, x: ir.Value, last_dims: Sequence[int], drop_last: int = 1) -> ir.Value:
        """Reshape x keeping all but its `drop_last` trailing dims and appending `last_dims`."""
        lead = self.op("Shape", x, end=-drop_last)
        return self.op("Reshape", x, self.op("Concat", lead, self.i64(*last_dims), axis=0))

    def function(
        self,
        name: str,
        overload: str,
        inputs: Sequence[ir.Value],
        outputs: Sequence[ir.Value],
        attribute_names: Sequence[str],
    ) -> ir.Function:
        graph = ir.Graph(
            list(inputs),
            list(outputs),
            nodes=self.tape.nodes,
            opset_imports={"": self.opset_version},
            name=f"{name}_{overload}",
        )
        # The attributes are declared so nodes may carry them (plugins read them); the body has
        # their values baked in (one overload per distinct attribute set).
        attributes = [ir.Attr(a, ir.AttributeType.UNDEFINED, None) for a in attribute_names]
        return ir.Function(WMOE_DOMAIN, name, overload, graph=graph, attributes=attributes)


# ----------------------------------------------------------------------------------------------
# codec maths in ONNX


def _codec(spec: str, head_dim: int):
    from ..codec import get_codec

    return get_codec(spec, head_dim)


CHANNEL_FORMS = ("s", "sm", "rsm")


class _Channel:
    """The channel parameters of one K or V cache as graph values: smoothing s [Hkv|1, 1, D],
    offset m (same shape, or None) and the transform M = W R ([D, D], or [Hkv|1, D, D] with a
    rotation R): coefficients c = ((x - m) / s) @ M^T, reconstruction (c @ M) * s + m."""

    def __init__(self, b: _Body, codec, params: ir.Value, form: str) -> None:
        if form not in CHANNEL_FORMS:
            raise ValueError(f"channel parameter form must be one of {CHANNEL_FORMS}, got {form!r}")
        d = codec.head_dim
        params = b.op("Cast", params, to=_FLOAT)
        self.offset: ir.Value | None = None
        w = b.const(codec.transform.numpy(), np.float32)
        self.transform, self.transform_t = w, b.const(codec.transform.numpy().T, np.float32)
        if form == "s":
            self.scale = b.op("Reshape", params, b.i64(-1, 1, d))
        elif form == "sm":  # [2, Hkv|1, D]: row 0 s, row 1 m
            self.scale = b.op("Reshape", b.op("Slice", params, b.i64(0), b.i64(1), b.i64(0)), b.i64(-1, 1, d))
            self.offset = b.op(
                "Reshape", b.op("Slice", params, b.i64(1), b.i64(2), b.i64(0)), b.i64(-1, 1, d)
            )
        else:  # [Hkv|1, D + 2, D]: rows [0, D) R, row D s, row D + 1 m
            rotation = b.op("Slice", params, b.i64(0), b.i64(d), b.i64(1))
            self.scale = b.op("Slice", params, b.i64(d), b.i64(d + 1), b.i64(1))
            self.offset = b.op("Slice", params, b.i64(d + 1), b.i64(d + 2), b.i64(1))
            self.transform = b.op("MatMul", w, rotation)  # M = W R per kv head
            self.transform_t = b.op("Transpose", self.transform, perm=[0, 2, 1])

    def coefficients(self, b: _Body, x: ir.Value) -> ir.Value:
        y = b.op("Cast", x, to=_FLOAT)
        if self.offset is not None:
            y = b.op("Sub", y, self.offset)
        return b.op("MatMul", b.op("Div", y, self.scale), self.transform_t)

    def centred(self, b: _Body, x: ir.Value) -> ir.Value:
        """x - m in fp32 (what the exact cache holds)."""
        y = b.op("Cast", x, to=_FLOAT)
        return y if self.offset is None else b.op("Sub", y, self.offset)

    def reconstruct(self, b: _Body, coefficients: ir.Value, with_offset: bool = True) -> ir.Value:
        x = b.op("Mul", b.op("MatMul", coefficients, self.transform), self.scale)
        return b.op("Add", x, self.offset) if with_offset and self.offset is not None else x


def _quantize(b: _Body, cb: ir.Value, scale16: ir.Value, mids: np.ndarray) -> ir.Value:
    """Codes (int64) = number of midpoints strictly below cb / scale; a zero scale codes u = 0."""
    s = b.op("Cast", scale16, to=_FLOAT)
    positive = b.op("Greater", s, b.f32(0.0))
    safe = b.op("Where", positive, s, b.f32(1.0))
    u = b.op("Where", positive, b.op("Div", cb, safe), b.f32(0.0))
    below = b.op("Less", b.const(mids, np.float32), b.op("Unsqueeze", u, b.i64(-1)))
    return b.op("ReduceSum", b.op("Cast", below, to=_INT64), b.i64(-1), keepdims=0)


def _to_fp16_scale(b: _Body, scale: ir.Value) -> ir.Value:
    return b.op("Cast", b.op("Min", scale, b.f32(65504.0)), to=_FLOAT16)


def _encode_band(b: _Body, codec, index: int, cb: ir.Value) -> tuple[ir.Value, ir.Value]:
    """One band [..., size] -> (codes int64 [..., size], scale fp16 [..., 1])."""
    grid = codec.grids[index].numpy().astype(np.float32)
    mids = codec.midpoints[index].numpy().astype(np.float32)
    rule = codec.scale_rules[index]
    if rule not in ("absmax", "mse", "absmax-ub", "mse-ub"):
        raise NotImplementedError(f"ONNX export: scale rule {rule!r} has no ONNX body yet")
    grid_value = b.const(grid, np.float32)
    absmax = b.op("ReduceMax", b.op("Abs", cb), b.i64(-1), keepdims=1)
    if rule.startswith("absmax"):
        scale16 = _to_fp16_scale(b, absmax)
        codes = _quantize(b, cb, scale16, mids)
    else:
        codes, scale16 = _mse_search(b, codec, cb, grid_value, absmax, mids)
    if rule.endswith("-ub"):
        scale16 = _unbiased_scale(b, cb, b.op("Gather", grid_value, codes), scale16)
    return codes, scale16


def _unbiased_scale(b: _Body, cb: ir.Value, levels: ir.Value, scale16: ir.Value) -> ir.Value:
    """scale = |c|^2 / <grid[code], c> (no gain bias), the coding scale when <grid[code], c> <= 0."""
    energy = b.op("ReduceSum", b.op("Mul", cb, cb), b.i64(-1), keepdims=1)
    projection = b.op("ReduceSum", b.op("Mul", levels, cb), b.i64(-1), keepdims=1)
    positive = b.op("Greater", projection, b.f32(0.0))
    ratio = b.op("Div", energy, b.op("Where", positive, projection, b.f32(1.0)))
    return b.op("Where", positive, _to_fp16_scale(b, ratio), scale16)


def _mse_search(
    b: _Body, codec, cb: ir.Value, grid_value: ir.Value, absmax: ir.Value, mids: np.ndarray
) -> tuple[ir.Value, ir.Value]:
    """Candidate scales absmax * f (f in SCALE_FRACTIONS, largest first): keep the least error."""
    best = None
    for fraction in codec.scale_fractions.numpy().astype(np.float32):
        scale16 = _to_fp16_scale(b, b.op("Mul", absmax, b.f32(fraction)))
        codes = _quantize(b, cb, scale16, mids)
        diff = b.op(
            "Sub", cb, b.op("Mul", b.op("Gather", grid_value, codes), b.op("Cast", scale16, to=_FLOAT))
        )
        err = b.op("ReduceSum", b.op("Mul", diff, diff), b.i64(-1), keepdims=1)
        if best is None:
            best = (err, codes, scale16)
            continue
        # Strictly better only: ties keep the earlier (larger) scale, as the reference does.
        better = b.op("Less", err, best[0])
        best = (
            b.op("Where", better, err, best[0]),
            b.op("Where", better, codes, best[1]),
            b.op("Where", better, scale16, best[2]),
        )
    assert best is not None
    return best[1], best[2]


def _pack(b: _Body, codes: ir.Value, size: int, bits: int) -> ir.Value:
    per_byte = 8 // bits
    grouped = b.reshape_last(codes, [size // per_byte, per_byte])
    weights = b.const([1 << (bits * i) for i in range(per_byte)], np.int64)
    return b.op("Cast", b.op("ReduceSum", b.op("Mul", grouped, weights), b.i64(-1), keepdims=0), to=_UINT8)


def _unpack(b: _Body, packed: ir.Value, n_bytes: int, bits: int) -> ir.Value:
    per_byte = 8 // bits
    divisors = b.const([1 << (bits * i) for i in range(per_byte)], np.int32)
    wide = b.op("Unsqueeze", b.op("Cast", packed, to=_INT32), b.i64(-1))
    values = b.op("Mod", b.op("Div", wide, divisors), b.const(1 << bits, np.int32))
    return b.reshape_last(values, [n_bytes * per_byte], drop_last=2)


def encode(b: _Body, codec, x: ir.Value, channel: _Channel) -> tuple[ir.Value, ir.Value]:
    """x [..., D] (any float type) -> (codes uint8 [..., n_code_bytes], scales fp16 [..., n_bands])."""
    c = channel.coefficients(b, x)
    nonfinite = b.op("Or", b.op("IsNaN", c), b.op("IsInf", c))
    any_nonfinite = b.op("ReduceMax", b.op("Cast", nonfinite, to=_INT32), b.i64(-1), keepdims=1)
    finite = b.op("Equal", any_nonfinite, b.const(0, np.int32))  # [..., 1]
    c = b.op("Where", finite, c, b.f32(0.0))
    code_parts, scale_parts = [], []
    for index, band in enumerate(codec.bands):
        cb = b.op("Slice", c, b.i64(band.start), b.i64(band.start + band.size), b.i64(-1))
        codes, scale16 = _encode_band(b, codec, index, cb)
        code_parts.append(_pack(b, codes, band.size, band.bits))
        scale_parts.append(scale16)
    codes = code_parts[0] if len(code_parts) == 1 else b.op("Concat", *code_parts, axis=-1)
    scales = scale_parts[0] if len(scale_parts) == 1 else b.op("Concat", *scale_parts, axis=-1)
    # A vector with a non-finite coefficient stores codes 0 and NaN scales (decodes to NaN).
    codes = b.op("Where", finite, codes, b.const(0, np.uint8))
    scales = b.op("Where", finite, scales, b.const(math.nan, np.float16))
    return codes, scales


def decode_coefficients(b: _Body, codec, codes: ir.Value, scales: ir.Value) -> ir.Value:
    """(codes, scales) -> fp32 coefficients [..., D]."""
    parts = []
    for index, band in enumerate(codec.bands):
        offset = codec.band_byte_offsets[index]
        n_bytes = band.size * band.bits // 8
        packed = b.op("Slice", codes, b.i64(offset), b.i64(offset + n_bytes), b.i64(-1))
        levels = _unpack(b, packed, n_bytes, band.bits)
        grid = b.const(codec.grids[index].numpy(), np.float32)
        scale = b.op("Cast", b.op("Slice", scales, b.i64(index), b.i64(index + 1), b.i64(-1)), to=_FLOAT)
        parts.append(b.op("Mul", b.op("Gather", grid, levels), scale))
    return parts[0] if len(parts) == 1 else b.op("Concat", *parts, axis=-1)


# ----------------------------------------------------------------------------------------------
# function bodies, one per op


def _kv_compress(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    codec = _codec(attrs["codec"], attrs["head_dim"])
    x, channel_scale = ir.Value(name="x"), ir.Value(name="channel_scale")
    codes, scales = encode(b, codec, x, _Channel(b, codec, channel_scale, attrs["channel_params"]))
    return [x, channel_scale], [b.op("Identity", codes), b.op("Identity", scales)]


def _kv_decompress(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    codec = _codec(attrs["codec"], attrs["head_dim"])
    codes, scales, channel_scale = (
        ir.Value(name="codes"),
        ir.Value(name="scales"),
        ir.Value(name="channel_scale"),
    )
    channel = _Channel(b, codec, channel_scale, attrs["channel_params"])
    x = channel.reconstruct(b, decode_coefficients(b, codec, codes, scales))
    return [codes, scales, channel_scale], [b.op("Cast", x, to=int(attrs["dtype"]))]


def _scatter_slots(b: _Body, cache: ir.Value, slots: ir.Value, updates: ir.Value) -> ir.Value:
    """cache [B, H, S, N] with updates [B, H, T, N] written at slots [B, T] along dim 2."""
    batch = b.op("Shape", slots, start=0, end=1)
    steps = b.op("Shape", slots, start=1, end=2)
    batch_index = b.op(
        "Expand",
        b.op("Unsqueeze", b.range_to(batch), b.i64(1)),
        b.op("Concat", batch, steps, axis=0),
    )
    index = b.op(
        "Concat",
        b.op("Unsqueeze", batch_index, b.i64(-1)),
        b.op("Unsqueeze", slots, b.i64(-1)),
        axis=-1,
    )  # [B, T, 2]
    cache_bshn = b.op("Transpose", cache, perm=[0, 2, 1, 3])
    updates_bthn = b.op("Transpose", updates, perm=[0, 2, 1, 3])
    written = b.op("ScatterND", cache_bshn, index, updates_bthn)
    return b.op("Transpose", written, perm=[0, 2, 1, 3])


def _kv_compress_into_cache(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    codec = _codec(attrs["codec"], attrs["head_dim"])
    sinks, window = codec.config.sinks, codec.config.window
    names = ("x", "codes_cache", "scales_cache", "exact_cache", "positions", "channel_scale")
    x, codes_cache, scales_cache, exact_cache, positions, channel_scale = (ir.Value(name=n) for n in names)
    channel = _Channel(b, codec, channel_scale, attrs["channel_params"])
    codes, scales = encode(b, codec, x, channel)
    # positions [T] or [B, T] -> [B, T] int64
    batch_steps = b.op("Concat", b.op("Shape", x, start=0, end=1), b.op("Shape", x, start=2, end=3), axis=0)
    slots = b.op("Expand", b.op("Cast", positions, to=_INT64), batch_steps)
    new_codes = _scatter_slots(b, codes_cache, slots, codes)
    new_scales = _scatter_slots(b, scales_cache, slots, scales)
    new_exact = b.op("Identity", exact_cache)
    if sinks + window > 0:
        # Writes that do not apply go to one extra trash slot, cut off afterwards: positions p <
        # sinks land at slot p; the chunk's last `window` tokens at sinks + p % window.
        trash = sinks + window
        # The exact copies are stored centred (x - m) like every other key/value of the sequence.
        xe = b.op("CastLike", channel.centred(b, x), exact_cache)
        extended = b.op(
            "Concat", exact_cache, b.op("Slice", exact_cache, b.i64(0), b.i64(1), b.i64(2)), axis=2
        )
        if sinks > 0:
            sink_slots = b.op("Where", b.op("Less", slots, b.i64(sinks)), slots, b.i64(trash))
            extended = _scatter_slots(b, extended, sink_slots, xe)
        if window > 0:
            n_steps = b.op("Shape", slots, start=1, end=2)
            step = b.range_to(n_steps)  # [T]
            in_ring = b.op("GreaterOrEqual", step, b.op("Sub", n_steps, b.i64(window)))
            ring = b.op("Add", b.op("Mod", slots, b.i64(window)), b.i64(sinks))
            ring_slots = b.op("Where", in_ring, ring, b.i64(trash))
            extended = _scatter_slots(b, extended, ring_slots, xe)
        new_exact = b.op("Slice", extended, b.i64(0), b.i64(trash), b.i64(2))
    return [x, codes_cache, scales_cache, exact_cache, positions, channel_scale], [
        new_codes,
        new_scales,
        new_exact,
    ]


def _wavelet_attention(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    return _wavelet_attention_body(b, attrs, with_sinks=False)


def _wavelet_attention_sinks(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    """_wavelet_attention with a sink logit per query head (input `sinks` [Hq]) in the softmax."""
    return _wavelet_attention_body(b, attrs, with_sinks=True)


def _wavelet_attention_body(
    b: _Body, attrs: Mapping[str, Any], with_sinks: bool
) -> tuple[list[ir.Value], list[ir.Value]]:
    codec = _codec(attrs["codec"], attrs["head_dim"])
    sinks, window = codec.config.sinks, codec.config.window
    names = (
        "q",
        "k_codes",
        "k_scales",
        "v_codes",
        "v_scales",
        "k_exact",
        "v_exact",
        "seq_lens",
        "k_channel_scale",
        "v_channel_scale",
    ) + (("sinks",) if with_sinks else ())
    inputs = [ir.Value(name=n) for n in names]
    q, k_codes, k_scales, v_codes, v_scales, k_exact, v_exact, seq_lens, k_cs, v_cs = inputs[:10]
    n_slots = b.op("Shape", k_codes, start=2, end=3)  # [1] = S
    slot = b.range_to(n_slots)  # [S]
    lengths = b.op("Reshape", b.op("Cast", seq_lens, to=_INT64), b.i64(-1, 1, 1, 1))  # [B, 1, 1, 1]

    def keys_or_values(codes: ir.Value, scales: ir.Value, exact: ir.Value, channel: _Channel) -> ir.Value:
        # Centred (no offset added): the exact copies are centred too. For keys the offset only
        # shifts every score of a query by q . m (softmax ignores it); values add m to the output.
        full = channel.reconstruct(b, decode_coefficients(b, codec, codes, scales), with_offset=False)
        if sinks + window == 0:
            return full
        # Position p is read exactly if p < sinks or p >= seq_len - window (docs/CONTRACTS.md).
        if window > 0:
            exact_slot = b.op(
                "Where",
                b.op("Less", slot, b.i64(sinks)),
                slot,
                b.op("Add", b.op("Mod", slot, b.i64(window)), b.i64(sinks)),
            )
        else:
            exact_slot = b.op("Min", slot, b.i64(sinks - 1))
        exact_at_slot = b.op("Cast", b.op("Gather", exact, exact_slot, axis=2), to=_FLOAT)
        slot_4d = b.op("Reshape", slot, b.i64(1, 1, -1, 1))
        use_exact = b.op("Less", slot_4d, b.i64(sinks))
        if window > 0:
            recent = b.op("GreaterOrEqual", slot_4d, b.op("Sub", lengths, b.i64(window)))
            use_exact = b.op("Or", use_exact, recent)
        return b.op("Where", use_exact, exact_at_slot, full)

    k_channel = _Channel(b, codec, k_cs, attrs["k_channel_params"])
    v_channel = _Channel(b, codec, v_cs, attrs["v_channel_params"])
    keys = keys_or_values(k_codes, k_scales, k_exact, k_channel)
    values = keys_or_values(v_codes, v_scales, v_exact, v_channel)
    # Grouped-query attention: q head h reads kv head h // G, so [B, Hq, Tq, D] regroups to
    # [B, Hkv, G * Tq, D] by a plain reshape.
    q_shape = b.op("Shape", q)
    n_kv = b.op("Shape", k_codes, start=1, end=2)
    n_steps = b.op("Shape", q, start=2, end=3)
    qf = b.op("Cast", q, to=_FLOAT)
    grouped = b.op("Reshape", qf, b.op("Concat", b.i64(0), n_kv, b.i64(-1, attrs["head_dim"]), axis=0))
    scores = b.op("MatMul", grouped, b.op("Transpose", keys, perm=[0, 1, 3, 2]))  # [B, Hkv, G*Tq, S]
    scores = b.op("Mul", scores, b.f32(attrs["sm_scale"]))
    # Causal over the cache: query t (of Tq new tokens) sees slots p < seq_len - Tq + t + 1.
    scores = b.op("Reshape", scores, b.op("Concat", b.i64(0, 0, -1), n_steps, n_slots, axis=0))
    step = b.range_to(n_steps)  # [Tq]
    relative = b.op("Sub", b.op("Unsqueeze", slot, b.i64(0)), b.op("Unsqueeze", step, b.i64(1)))  # [Tq, S]
    limit = b.op("Add", b.op("Sub", lengths, n_steps), b.i64(1))  # [B, 1, 1, 1]
    visible = b.op("Less", relative, b.op("Unsqueeze", limit, b.i64(-1)))  # [B, 1, 1, Tq, S]
    if attrs.get("window", 0) > 0:  # and slots > the query's position - window
        first = b.op("Unsqueeze", b.op("Sub", limit, b.i64(attrs["window"])), b.i64(-1))
        visible = b.op("And", visible, b.op("GreaterOrEqual", relative, first))
    scores = b.op("Where", visible, scores, b.f32(-math.inf))  # [B, Hkv, G, Tq, S]
    if with_sinks:
        # one column of the head's logit joins the softmax, then is dropped; the scores of centred
        # keys lack sm_scale * q . m_k, so the logit moves by as much instead
        sinks = b.op(
            "Reshape",
            b.op("Cast", inputs[10], to=_FLOAT),
            b.op("Concat", b.i64(1), n_kv, b.i64(-1, 1, 1), axis=0),
        )
        column = b.op("Concat", b.op("Shape", scores, start=0, end=4), b.i64(1), axis=0)
        sinks = b.op("Expand", sinks, column)  # [B, Hkv, G, Tq, 1]
        if k_channel.offset is not None:
            shift = b.op(
                "MatMul", grouped, b.op("Transpose", k_channel.offset, perm=[0, 2, 1])
            )  # [B, Hkv, G*Tq, 1]
            shift = b.op("Reshape", b.op("Mul", shift, b.f32(attrs["sm_scale"])), column)
            sinks = b.op("Sub", sinks, shift)
        probs = b.op("Softmax", b.op("Concat", scores, sinks, axis=-1), axis=-1)
        probs = b.op("Slice", probs, b.i64(0), n_slots, b.i64(-1))
    else:
        probs = b.op("Softmax", scores, axis=-1)
    probs = b.op("Reshape", probs, b.op("Concat", b.i64(0, 0, -1), n_slots, axis=0))
    out = b.op("MatMul", probs, values)  # [B, Hkv, G*Tq, D]
    if v_channel.offset is not None:
        # the values are centred: add m at the weights' sum (1 without sinks)
        weight = b.op("ReduceSum", probs, b.i64(-1), keepdims=1) if with_sinks else None
        out = b.op("Add", out, v_channel.offset if weight is None else b.op("Mul", v_channel.offset, weight))
    out = b.op("Reshape", out, q_shape)
    return inputs, [b.op("CastLike", out, q)]


def _tiled_moe(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    """Every expert on every token (dense, static shapes), combined with the routing weights:
    the portable form of the grouped GEMM; in fp32 like the reference."""
    return _tiled_moe_body(b, attrs, biased=False)


def _tiled_moe_biased(b: _Body, attrs: Mapping[str, Any]) -> tuple[list[ir.Value], list[ir.Value]]:
    """_tiled_moe with the packed biases (b_gate_up [E, 2, F_PAD], b_down [E, H_PAD], fp32) and
    the clamped activation."""
    return _tiled_moe_body(b, attrs, biased=True)


def _tiled_moe_body(
    b: _Body, attrs: Mapping[str, Any], biased: bool
) -> tuple[list[ir.Value], list[ir.Value]]:
    names = ("hidden", "topk_ids", "topk_weights", "w_gate_up", "w_down")
    names += ("b_gate_up", "b_down") if biased else ()
    inputs = [ir.Value(name=n) for n in names]
    hidden, topk_ids, topk_weights, w_gate_up, w_down = inputs[:5]
    experts, ffn_pad, hidden_pad = attrs["num_experts"], attrs["ffn_pad"], attrs["hidden_pad"]
    tile = 64
    if attrs["layout"] == "rows":
        blocks = b.op("Reshape", w_gate_up, b.i64(experts, ffn_pad // tile, 2, tile, hidden_pad))
        down = w_down
    elif attrs["layout"] == "tiles64":
        # [E, F/64, H/64, 2, 64, 64] -> [E, F/64, 2, 64, H/64, 64] -> [E, F/64, 2, 64, H]
        blocks = b.op("Transpose", w_gate_up, perm=[0, 1, 3, 4, 2, 5])
        blocks = b.op("Reshape", blocks, b.i64(experts, ffn_pad // tile, 2, tile, hidden_pad))
        # [E, H/64, F/64, 64, 64] -> [E, H/64, 64, F/64, 64] -> [E, H, F]
        down = b.op("Transpose", w_down, perm=[0, 1, 3, 2, 4])
        down = b.op("Reshape", down, b.i64(experts, hidden_pad, ffn_pad))
    else:
        raise ValueError(f"unknown packed layout {attrs['layout']!r}; valid: tiles64, rows")

    def half(index: int) -> ir.Value:  # gate (0) or up (1) rows, [E, F_PAD, H_PAD] fp32
        part = b.op("Slice", blocks, b.i64(index), b.i64(index + 1), b.i64(2))
        return b.op("Cast", b.op("Reshape", part, b.i64(experts, ffn_pad, hidden_pad)), to=_FLOAT)

    x = b.op("Cast", hidden, to=_FLOAT)
    hidden_size = b.op("Shape", hidden, start=1, end=2)
    padding = b.op("Concat", b.i64(0, 0, 0), b.op("Sub", b.i64(hidden_pad), hidden_size), axis=0)
    x = b.op("Pad", x, padding)  # [T, H_PAD]
    gate = b.op("MatMul", x, b.op("Transpose", half(0), perm=[0, 2, 1]))  # [E, T, F_PAD]
    up = b.op("MatMul", x, b.op("Transpose", half(1), perm=[0, 2, 1]))
    if biased:
        b_gate_up, b_down = inputs[5:]

        def bias_row(index: int) -> ir.Value:  # [E, 1, F_PAD]: one row per expert, all tokens
            part = b.op("Slice", b_gate_up, b.i64(index), b.i64(index + 1), b.i64(1))
            return b.op("Reshape", part, b.i64(experts, 1, ffn_pad))

        gate, up = b.op("Add", gate, bias_row(0)), b.op("Add", up, bias_row(1))
        if attrs["clamped"]:
            limit = float(attrs["clamp_limit"])
            gate = b.op("Min", gate, b.f32(limit))
            up = b.op("Max", b.op("Min", up, b.f32(limit)), b.f32(-limit))
        slope = b.op("Sigmoid", b.op("Mul", gate, b.f32(float(attrs["gate_alpha"]))))
        act = b.op("Mul", b.op("Mul", gate, slope), b.op("Add", up, b.f32(float(attrs["up_offset"]))))
    else:
        act = b.op("Mul", b.op("Mul", gate, b.op("Sigmoid", gate)), up)
    y = b.op("MatMul", act, b.op("Transpose", b.op("Cast", down, to=_FLOAT), perm=[0, 2, 1]))  # [E, T, H]
    if biased:
        y = b.op("Add", y, b.op("Reshape", b_down, b.i64(experts, 1, hidden_pad)))
    # Routing weight of (token, expert): sum over the k slots that chose the expert; ids outside
    # [0, E) match no expert and contribute nothing, as in the op.
    expert_ids = b.op("Range", b.const(0, np.int64), b.const(experts, np.int64), b.const(1, np.int64))
    chosen = b.op("Equal", b.op("Unsqueeze", b.op("Cast", topk_ids, to=_INT64), b.i64(-1)), expert_ids)
    weights = b.op(
        "Mul",
        b.op("Cast", chosen, to=_FLOAT),
        b.op("Unsqueeze", b.op("Cast", topk_weights, to=_FLOAT), b.i64(-1)),
    )
    per_expert = b.op("ReduceSum", weights, b.i64(1), keepdims=0)  # [T, E]
    per_expert = b.op("Unsqueeze", b.op("Transpose", per_expert, perm=[1, 0]), b.i64(-1))  # [E, T, 1]
    out = b.op("ReduceSum", b.op("Mul", y, per_expert), b.i64(0), keepdims=0)  # [T, H_PAD]
    out = b.op("Slice", out, b.i64(0), hidden_size, b.i64(1))
    return inputs, [b.op("CastLike", out, hidden)]


BODIES: dict[str, Callable[[_Body, Mapping[str, Any]], tuple[list[ir.Value], list[ir.Value]]]] = {
    "KvCompress": _kv_compress,
    "KvDecompress": _kv_decompress,
    "KvCompressIntoCache": _kv_compress_into_cache,
    "WaveletAttention": _wavelet_attention,
    "WaveletAttentionSinks": _wavelet_attention_sinks,
    "TiledMoe": _tiled_moe,
    "TiledMoeBiased": _tiled_moe_biased,
}


# ----------------------------------------------------------------------------------------------
# attaching functions to a model


def _attribute_values(node: ir.Node) -> dict[str, Any]:
    return {name: attr.value for name, attr in node.attributes.items()}


def variant_key(op_type: str, attributes: Mapping[str, Any]) -> str:
    """Overload name of a node variant: readable head_dim plus a hash of all attributes."""
    text = op_type + "|" + "|".join(f"{k}={attributes[k]!r}" for k in sorted(attributes))
    digest = hashlib.sha1(text.encode()).hexdigest()[:10]
    head_dim = attributes.get("head_dim")
    return f"d{head_dim}_{digest}" if head_dim is not None else digest


def _all_nodes(graph: ir.Graph):
    yield from ir.traversal.RecursiveGraphIterator(graph)


def attach_functions(model: ir.Model) -> int:
    """Give every wmoe-domain node an overload and the model a FunctionProto for it.

    Returns the number of functions attached.
    """
    opset_version = model.opset_imports.get("", 18)
    made = 0
    for node in _all_nodes(model.graph):
        if node.domain != WMOE_DOMAIN:
            continue
        if node.op_type not in BODIES:
            raise ValueError(f"no ONNX body for wmoe-domain op {node.op_type!r}; known: {sorted(BODIES)}")
        attributes = _attribute_values(node)
        overload = variant_key(node.op_type, attributes)
        node.overload = overload
        if (WMOE_DOMAIN, node.op_type, overload) in model.functions:
            continue
        body = _Body(opset_version)
        inputs, outputs = BODIES[node.op_type](body, attributes)
        for index, value in enumerate(outputs):
            value.name = f"{node.op_type.lower()}_out_{index}"
        function = body.function(node.op_type, overload, inputs, outputs, list(attributes))
        model.functions[function.identifier()] = function
        made += 1
    model.opset_imports.setdefault(WMOE_DOMAIN, WMOE_OPSET_VERSION)
    return made


def inline_functions(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The portable flavour: wmoe-domain function calls inlined into standard ops."""
    import onnx.inliner

    inlined = onnx.inliner.inline_local_functions(proto)
    leftover = {n.domain for n in inlined.graph.node if n.domain not in ("", "ai.onnx")}
    if leftover:
        raise RuntimeError(f"portable ONNX still has nodes of domain(s) {sorted(leftover)} after inlining")
    kept = [o for o in inlined.opset_import if o.domain in ("", "ai.onnx")]
    del inlined.opset_import[:]
    inlined.opset_import.extend(kept)
    del inlined.functions[:]
    return inlined
