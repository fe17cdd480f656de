"""How the attention kernels turn a code field into an fp16 MMA operand, and the PTX that does it.

A compressed token's codes are packed fields of 2, 4 or 8 bits. The kernels never convert a field
to a float arithmetically: they mask it into the mantissa of an fp16 whose bits make its value
known, and fold the encoding's offset and power of two into per-slot factors on the host:

- magic (``MODE_MAGIC``): ``0x6400 | field`` reads as fp16 ``1024 + field`` (the field, shifted to
  bit ``pos``, is worth ``2**pos`` a unit), one LOP3 per register of two fields;
- centred (``MODE_MAGIC_CENTRED``): the same minus ``1024 + mid`` (``field_centre``), exact small
  integers, for value fields whose fp32 token sums would lose the field beside 1024;
- subnormal (``MODE_SUBNORMAL``): the field in place, read as ``field * 2**-24`` (one AND).

``field_layout`` says where a field of an int16 code element sits (a shift of 0 or 8, then a
position that keeps it inside the 10-bit mantissa); the v2 and v3 kernels and their host plans
share it, so the slot factors the host computes match the operands the kernels build. v1 reads
code bytes instead (``magic_asm``, ``byte_field_asm``).
"""

from __future__ import annotations

import struct

# code 0 in magic mode reads as fp16 1024.0: (0x6400 | code) reinterpreted as fp16 == 1024 + code
MAGIC_OFFSET = 1024.0
# operand encodings of a code field (kernel constexpr MODE; one asm table row per mode)
MODE_SUBNORMAL = 0  # fp16 bits = field in place: value field * 2**-24 (keys and values)
MODE_MAGIC = 1  # fp16 bits = 0x6400 | field: value 1024 + field (keys)
MODE_MAGIC_CENTRED = 2  # 1024 + field - (1024 + mid): exact small integers (values)
SUBNORMAL_UNIT = 2.0**-24  # the fp16 value of bit pattern 1
FIELD_BITS = (2, 4, 8)


def field_layout(bits: int, field_index: int) -> tuple[int, int]:
    """(shift, pos) of field `field_index` of an int16 code element: fields are read as
    ``(x >> shift) & (mask << pos)``, and pos + bits stays <= 10 so the field lies inside the fp16
    mantissa (the magic 1024 exponent and the subnormal encodings both need that)."""
    offset = field_index * bits
    if offset + bits <= 10:
        return 0, offset
    return 8, offset - 8


def stacked_shift(bits: int, first_field: int, count: int) -> int | None:
    """The shift shared by fields [first_field, first_field + count) of an int16 element when one
    MMA operand stacks them (each in its own rows or columns, so only a per-row mask differs), or
    None where no one shift keeps them all inside the mantissa (an 8-bit band's two fields). For
    one field it is field_layout's shift."""
    offsets = [f * bits for f in range(first_field, first_field + count)]
    if all(offset + bits <= 10 for offset in offsets):
        return 0
    if all(offset >= 8 for offset in offsets):
        return 8
    return None


def stack_count(bits: int, elements: int, fields: int, shifted: bool) -> int:
    """How many bit fields one 16-row MMA operand stacks for a chunk of `elements` code words (int16
    elements, or bytes for `shifted` False): as many as fill its 16 rows, halved until every group
    of consecutive fields shares one shift. A narrow chunk without stacking pads each field's
    operand with zero rows, so the MMAs and dequantisation run 2-4x the work its bytes need."""
    if elements >= 16:
        return 1
    count = min(16 // elements, fields)
    while (
        count > 1
        and shifted
        and any(stacked_shift(bits, first, count) is None for first in range(0, fields, count))
    ):
        count //= 2
    return count


def field_centre(bits: int, field_index: int) -> float:
    """1024 + mid of a magic value field at its fp16 position (what centring subtracts; the plan's
    v_shift adds mid back, see attention_plans._plan_v3)."""
    _, pos = field_layout(bits, field_index)
    return MAGIC_OFFSET + float(1 << (pos + bits - 1))


def _fp16_bits(value: float) -> int:
    """The bit pattern of `value` rounded to fp16."""
    return int.from_bytes(struct.pack("<e", value), "little")


def _field_ptx(mode: int, shift: int, mask: str, centre: str) -> str:
    """PTX turning two packed int16 elements ($1) into two fp16 ($0): shift, mask (an immediate or
    an operand) and the encoding; centred mode subtracts `centre` (an fp16 pair register)."""
    src, pre = "$1", ""
    if shift:
        pre, src = f"shr.u32 s, $1, {shift}; ", "s"
    if mode == MODE_SUBNORMAL:
        body = f"and.b32 $0, {src}, {mask};"
    elif mode == MODE_MAGIC:
        body = f"lop3.b32 $0, {src}, {mask}, 0x64006400, 0xEA;"
    else:
        body = f"lop3.b32 t, {src}, {mask}, 0x64006400, 0xEA; sub.f16x2 $0, t, {centre};"
    return "{ .reg .b32 s, t, c; " + pre + body + " }"


def field_asm(mode: int, bits: int, field_index: int) -> str:
    """PTX for one field of two packed int16 elements -> two fp16 (one or two ALU ops)."""
    shift, pos = field_layout(bits, field_index)
    pair_mask = (((1 << bits) - 1) << pos) * 0x10001
    ptx = _field_ptx(mode, shift, f"{pair_mask:#x}", "c")
    if mode == MODE_MAGIC_CENTRED:  # the centre pair as an immediate moved into c
        pair = _fp16_bits(field_centre(bits, field_index)) * 0x10001
        ptx = ptx.replace(" sub.f16x2", f" mov.b32 c, {pair:#x}; sub.f16x2")
    return ptx


# every mode's fields of an int16 element, rows of 14 (2-bit fields 0-7, 4-bit 8-11, 8-bit 12-13):
# the v2 kernel picks entry MODE * 14 + base + field
FIELD_ASMS = tuple(
    field_asm(mode, bits, f) for mode in range(3) for bits in FIELD_BITS for f in range(16 // bits)
)


def stacked_field_asm(mode: int, shift: int) -> str:
    """PTX for a stacked operand (stacked_shift): two packed int16 elements -> two fp16, the field
    mask a second operand ($2, one per row: the rows of an operand hold different fields) and, for
    centred values, the fp16 centres a third ($3)."""
    return _field_ptx(mode, shift, "$2", "$3")


# a stacked operand's PTX per (mode, shift 0 / 8): entry MODE * 2 + shift // 8
STACKED_FIELD_ASMS = tuple(stacked_field_asm(mode, shift) for mode in range(3) for shift in (0, 8))


def stacked_byte_field_asm(mode: int) -> str:
    """PTX for four packed code bytes of a stacked key operand -> four fp16, the 16-bit field masks
    of the four columns in $3 and $4 (spread like the bytes: column pairs 0-1, 2-3)."""
    op = (
        "and.b32 {out}, {src}, {mask};"
        if mode == MODE_SUBNORMAL
        else ("lop3.b32 {out}, {src}, {mask}, 0x64006400, 0xEA;")
    )
    return (
        "{ .reg .b32 t0, t1, z; mov.b32 z, 0; prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342; "
        + op.format(out="$0", src="t0", mask="$3")
        + " "
        + op.format(out="$1", src="t1", mask="$4")
        + " }"
    )


STACKED_BYTE_FIELD_ASMS = tuple(stacked_byte_field_asm(mode) for mode in range(2))


def byte_field_asm(mode: int, bits: int, field_index: int) -> str:
    """PTX for one field of four packed code bytes -> four fp16 (keys of narrow chunks): spread the
    bytes to 16-bit lanes (two PRMT, shared by the fields after ptxas CSE), mask each pair."""
    pair_mask = (((1 << bits) - 1) << (field_index * bits)) * 0x10001
    if mode == MODE_SUBNORMAL:
        ops = [f"and.b32 $0, t0, {pair_mask:#x};", f"and.b32 $1, t1, {pair_mask:#x};"]
    else:
        ops = [
            f"lop3.b32 $0, t0, {pair_mask:#x}, 0x64006400, 0xEA;",
            f"lop3.b32 $1, t1, {pair_mask:#x}, 0x64006400, 0xEA;",
        ]
    return (
        "{ .reg .b32 t0, t1, z; mov.b32 z, 0; prmt.b32 t0, $2, z, 0x4140; prmt.b32 t1, $2, z, 0x4342; "
        + " ".join(ops)
        + " }"
    )


# the subnormal and magic modes' fields of a code byte, rows of 7 (2-bit 0-3, 4-bit 4-5, 8-bit 6)
BYTE_FIELD_ASMS = tuple(
    byte_field_asm(mode, bits, f) for mode in range(2) for bits in FIELD_BITS for f in range(8 // bits)
)


def magic_asm(mask: int) -> str:
    """PTX (v1): 4 packed code bytes -> 4 fp16 (1024 + byte & mask), one PRMT and one LOP3 per pair."""
    pair_mask = mask * 0x10001
    return (
        "{ .reg .b32 t0, t1, z;\n mov.b32 z, 0;\n"
        " prmt.b32 t0, $2, z, 0x4140;\n prmt.b32 t1, $2, z, 0x4342;\n"
        f" lop3.b32 $0, t0, {pair_mask:#x}, 0x64006400, 0xEA;\n"
        f" lop3.b32 $1, t1, {pair_mask:#x}, 0x64006400, 0xEA;\n}}"
    )
