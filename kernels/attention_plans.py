"""Host plans of the decode attention's split kernels: how a compressed layout maps onto each
kernel's constexprs and its small device tables (slot order, per-slot factors and shifts).

Each kernel visits the coefficients in the order it builds its operands (fields of code bytes for
v1, of int16 elements for v2 and v3); that permutation and each field's power of two are folded into
the rows of W and per-slot factors here, so nothing is shuffled in the kernel. A layout a kernel
cannot run raises ``UnsupportedLayout`` with the reason (wavelet_attention turns it into a fallback).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_fields import MAGIC_OFFSET, SUBNORMAL_UNIT, field_layout, stack_count, stacked_shift
from .attention_layout import SUPPORTED_HEAD_DIMS, CompressedLayout

MAX_KERNEL_BANDS = 4


# ------------------------------------------------------------------------------------------------
# host-side plan: how the layout maps onto the kernel's constexprs and small device tensors


class UnsupportedLayout(ValueError):
    """The Triton kernel cannot run this layout; the message says why (callers fall back)."""


@dataclass(frozen=True)
class _KernelBand:
    coef_start: int  # first coefficient (and first kernel slot) of this chunk
    size: int  # coefficients: a power of two >= 16
    bits: int
    byte_offset: int
    scale_index: int  # which of the vector's fp16 scales applies
    affine: bool
    grid_step: float
    grid_offset: float
    grid: tuple[float, ...]

    @property
    def per_byte(self) -> int:
        return 8 // self.bits

    @property
    def n_bytes(self) -> int:
        return self.size // self.per_byte


def _is_affine(grid: tuple[float, ...]) -> tuple[bool, float, float]:
    """grid[v] == offset + step * v for every code v (to fp32 precision)?"""
    offset, step = grid[0], (grid[-1] - grid[0]) / (len(grid) - 1)
    tol = 1e-6 * max(1.0, max(abs(g) for g in grid))
    affine = step != 0 and all(abs(g - (offset + step * v)) <= tol for v, g in enumerate(grid))
    return affine, step, offset


def _kernel_bands(layout: CompressedLayout) -> list[_KernelBand]:
    """Cut each codec band into power-of-two chunks (each bit plane of a chunk is one tl.dot;
    planes narrower than 16 bytes are zero-padded to 16 in the kernel)."""
    if layout.head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedLayout(f"head_dim {layout.head_dim} (the kernel supports {SUPPORTED_HEAD_DIMS})")
    if layout.n_bands > MAX_KERNEL_BANDS:
        raise UnsupportedLayout(f"{layout.n_bands} bands, the kernel handles {MAX_KERNEL_BANDS}")
    chunks = []
    for index, ((start, size, bits), offset) in enumerate(
        zip(layout.bands, layout.band_byte_offsets, strict=True)
    ):
        per_byte = 8 // bits
        affine, step, grid_offset = _is_affine(layout.grids[index])
        remaining, coef, byte = size // per_byte, start, offset  # in bytes
        while remaining:
            chunk_bytes = 1 << (remaining.bit_length() - 1)
            chunks.append(
                _KernelBand(
                    coef,
                    chunk_bytes * per_byte,
                    bits,
                    byte,
                    index,
                    affine,
                    step,
                    grid_offset,
                    tuple(layout.grids[index]),
                )
            )
            remaining -= chunk_bytes
            coef += chunk_bytes * per_byte
            byte += chunk_bytes
    if len(chunks) > MAX_KERNEL_BANDS:
        raise UnsupportedLayout(
            f"bands {layout.bands} need {len(chunks)} power-of-two chunks, "
            f"the kernel handles {MAX_KERNEL_BANDS}"
        )
    return chunks


def _slot_order(chunks: list[_KernelBand]) -> list[int]:
    """Coefficient index held by each kernel slot (see the module docstring)."""
    order = []
    for kb in chunks:
        order += [kb.coef_start + k * kb.per_byte + j for j in range(kb.per_byte) for k in range(kb.n_bytes)]
    return order


@dataclass
class _Plan:
    bands: list[_KernelBand]
    constexprs: dict[str, int]
    transform_slots: torch.Tensor  # [D, D] fp32, row s = W[coefficient held by slot s]
    col_step: torch.Tensor  # [D] fp32: coefficient = scale * step * (mma value + shift)
    col_shift: torch.Tensor  # [D] fp32, keys (MMA value 1024 + field)
    col_vshift: torch.Tensor  # [D] fp32, values (MMA value field - mid, see _plane)
    col_band: torch.Tensor  # [D] int32: kernel band of each slot
    lut: torch.Tensor  # [4 * 256] fp16 grids of table (non-affine) bands


_PLANS: dict[tuple, _Plan] = {}


def _plan(layout: CompressedLayout, device: torch.device) -> _Plan:
    cache_key = (layout.key or id(layout), str(device))
    plan = _PLANS.get(cache_key)
    if plan is not None:
        return plan
    chunks = _kernel_bands(layout)
    d = layout.head_dim
    col_step = torch.ones(d, dtype=torch.float64)
    col_shift = torch.zeros(d, dtype=torch.float64)
    col_vshift = torch.zeros(d, dtype=torch.float64)
    col_band = torch.zeros(d, dtype=torch.int32)
    lut = torch.zeros(MAX_KERNEL_BANDS * 256, dtype=torch.float16)
    constexprs: dict[str, int] = {}
    for i in range(MAX_KERNEL_BANDS):
        if i < len(chunks):
            kb = chunks[i]
            col_band[kb.coef_start : kb.coef_start + kb.size] = i
            if kb.affine:
                # plane j holds code << (bits * j) in place: the MMA sees 1024 + 2**(bits*j) * code
                for j in range(kb.per_byte):
                    plane = slice(kb.coef_start + j * kb.n_bytes, kb.coef_start + (j + 1) * kb.n_bytes)
                    step = kb.grid_step / 2 ** (kb.bits * j)
                    col_step[plane] = step
                    col_shift[plane] = kb.grid_offset / step - MAGIC_OFFSET
                    col_vshift[plane] = kb.grid_offset / step + 2 ** (kb.bits * (j + 1) - 1)
            else:
                lut[i * 256 : i * 256 + len(kb.grid)] = torch.tensor(kb.grid, dtype=torch.float32).half()
            values = (kb.coef_start, kb.size, kb.bits, kb.byte_offset, kb.scale_index, int(kb.affine))
        else:
            values = (0, 0, 8, 0, 0, 0)
        for name, value in zip(("START", "SIZE", "BITS", "BYTE", "SCALE", "AFFINE"), values, strict=True):
            constexprs[f"KB{i}_{name}"] = value
    plan = _Plan(
        bands=chunks,
        constexprs=constexprs,
        transform_slots=layout.transform.to(torch.float32)[_slot_order(chunks)].contiguous().to(device),
        col_step=col_step.float().to(device),
        col_shift=col_shift.float().to(device),
        col_vshift=col_vshift.float().to(device),
        col_band=col_band.to(device),
        lut=lut.to(device),
    )
    _PLANS[cache_key] = plan
    return plan


# ------------------------------------------------------------------------------------------------
# v2 plan: int16 element views, one MMA operand per bit field (see the module docstring)

# how a field becomes an fp16 operand (magic, centred, subnormal) and the PTX that builds it:
# kernels/attention_fields.py


@dataclass(frozen=True)
class _FieldChunk:
    """A power-of-two run of int16 code elements of one band. Values: an MMA operand of
    max(n_elems, 16) slot rows per bit field of the int16 elements; a narrow chunk stacks
    `v_stack` fields in one operand (rows r: element r % n_elems, field r // n_elems of the
    operand's group), so its rows are not zero padding. Keys: the same for chunks of >= 16
    elements; narrower chunks are read as bytes (one operand per field of the 2 * n_elems bytes,
    `k_stack` fields stacked in its 16 columns where the bytes are fewer)."""

    elem_offset: int  # first int16 element of the chunk in the code row
    n_elems: int
    bits: int
    scale_index: int
    k_slot0: int  # first key slot
    v_slot0: int  # first value slot
    coef_start: int  # coefficient held by field 0 of byte 0
    grid_step: float
    grid_offset: float

    @property
    def v_fields(self) -> int:
        return 16 // self.bits

    @property
    def v_stack(self) -> int:
        return stack_count(self.bits, self.n_elems, self.v_fields, shifted=True)

    @property
    def v_operands(self) -> int:
        return self.v_fields // self.v_stack

    @property
    def v_padded(self) -> int:
        return max(self.n_elems, 16)

    @property
    def k_bytes(self) -> bool:
        return self.n_elems < 16

    @property
    def k_fields(self) -> int:
        return 8 // self.bits if self.k_bytes else 16 // self.bits

    @property
    def k_stack(self) -> int:
        return stack_count(self.bits, 2 * self.n_elems, self.k_fields, shifted=False) if self.k_bytes else 1

    @property
    def k_operands(self) -> int:
        return self.k_fields // self.k_stack

    @property
    def k_padded(self) -> int:
        return max(2 * self.n_elems, 16) if self.k_bytes else self.n_elems

    def coef_of_byte_field(self, byte: int, bit_offset: int) -> int:
        return self.coef_start + byte * (8 // self.bits) + bit_offset // self.bits

    def v_slots(self):
        """(slot, coefficient, pos) of each value slot: row r of operand o holds field
        o * v_stack + r // n_elems of int16 element r % n_elems, at the operand's shift."""
        stack = self.v_stack
        for operand in range(self.v_operands):
            shift = stacked_shift(self.bits, operand * stack, stack)
            for row in range(self.n_elems * stack):
                element, f = row % self.n_elems, operand * stack + row // self.n_elems
                offset = f * self.bits
                coef = self.coef_of_byte_field(2 * element + offset // 8, offset % 8)
                yield self.v_slot0 + operand * self.v_padded + row, coef, offset - shift

    def k_slots(self):
        """(slot, coefficient, pos) of each key slot."""
        if not self.k_bytes:  # >= 16 elements: the value layout (flat field planes)
            for slot, coef, pos in self.v_slots():
                yield slot - self.v_slot0 + self.k_slot0, coef, pos
            return
        n_bytes, stack = 2 * self.n_elems, self.k_stack
        for operand in range(self.k_operands):
            for column in range(n_bytes * stack):
                pos = (operand * stack + column // n_bytes) * self.bits
                slot = self.k_slot0 + operand * self.k_padded + column
                yield slot, self.coef_of_byte_field(column % n_bytes, pos), pos


def _field_chunks(layout: CompressedLayout) -> list[_FieldChunk]:
    """Cut the layout into v2 chunks; UnsupportedLayout when v2 cannot run it (v1 then does)."""
    if layout.head_dim not in SUPPORTED_HEAD_DIMS:
        raise UnsupportedLayout(f"head_dim {layout.head_dim} (the kernel supports {SUPPORTED_HEAD_DIMS})")
    chunks: list[_FieldChunk] = []
    k_slot = v_slot = 0
    for index, ((start, size, bits), offset) in enumerate(
        zip(layout.bands, layout.band_byte_offsets, strict=True)
    ):
        affine, step, grid_offset = _is_affine(layout.grids[index])
        if not affine:
            raise UnsupportedLayout(f"band {index}: grid is not affine (v2 needs code * step + offset)")
        n_bytes = size * bits // 8
        if offset % 2 or n_bytes % 2:
            raise UnsupportedLayout(
                f"band {index}: bytes [{offset}, {offset + n_bytes}) are not int16-aligned"
            )
        remaining, elem, coef = n_bytes // 2, offset // 2, start
        while remaining:
            n = 1 << (remaining.bit_length() - 1)
            chunk = _FieldChunk(elem, n, bits, index, k_slot, v_slot, coef, step, grid_offset)
            chunks.append(chunk)
            k_slot += chunk.k_operands * chunk.k_padded
            v_slot += chunk.v_operands * chunk.v_padded
            remaining -= n
            elem += n
            coef += 2 * n * (8 // bits)
    if len(chunks) > MAX_KERNEL_BANDS:
        raise UnsupportedLayout(f"{len(chunks)} int16 chunks, the v2 kernel handles {MAX_KERNEL_BANDS}")
    return chunks


@dataclass
class _PlanV2:
    chunks: list[_FieldChunk]
    chunk_constexpr: tuple  # per chunk (see _split_kernel_v2's CHUNKS)
    k_slots: int
    v_slots: int
    transform_slots: torch.Tensor  # [k_slots, D] fp32, row s = W[coefficient of key slot s] (0: padding)
    k_factor: torch.Tensor  # [k_slots]: q slot = (W q)[coef] * qk_scale * k_factor
    k_shift: torch.Tensor  # [k_slots]: per-chunk score offset = sum_s q_slot * k_shift
    slot_chunk: torch.Tensor  # [k_slots] int32
    v_step: torch.Tensor  # [v_slots]: coefficient sum = v_step * (acc + v_shift * sum(p * scale))
    v_shift: torch.Tensor  # [v_slots]
    slot_coef: torch.Tensor  # [v_slots] int32, -1 for padding
    transform: torch.Tensor  # [D, D] fp32 W (the reduce's inverse transform)


@dataclass
class _SlotTables:
    """A slot plan's tables on the host (float64 while filled slot by slot; see _PlanV2)."""

    rows: torch.Tensor  # [k_slots, D]: W's row of each key slot's coefficient
    k_factor: torch.Tensor  # [k_slots]
    k_shift: torch.Tensor  # [k_slots]
    slot_chunk: torch.Tensor  # [k_slots] int32
    v_step: torch.Tensor  # [v_slots]
    v_shift: torch.Tensor  # [v_slots]
    slot_coef: torch.Tensor  # [v_slots] int32, -1 for padding

    @classmethod
    def zeros(cls, k_slots: int, v_slots: int, d: int) -> _SlotTables:
        f64 = dict(dtype=torch.float64)
        return cls(
            rows=torch.zeros(k_slots, d, **f64),
            k_factor=torch.zeros(k_slots, **f64),
            k_shift=torch.zeros(k_slots, **f64),
            slot_chunk=torch.zeros(k_slots, dtype=torch.int32),
            v_step=torch.zeros(v_slots, **f64),
            v_shift=torch.zeros(v_slots, **f64),
            slot_coef=torch.full((v_slots,), -1, dtype=torch.int32),
        )

    def plan(
        self, layout: CompressedLayout, device: torch.device, chunks: list, chunk_constexpr: tuple
    ) -> _PlanV2:
        """The device plan: fp32 tables (int32 maps) on `device`."""
        return _PlanV2(
            chunks=chunks,
            chunk_constexpr=chunk_constexpr,
            k_slots=self.rows.shape[0],
            v_slots=self.v_step.shape[0],
            transform_slots=self.rows.float().contiguous().to(device),
            k_factor=self.k_factor.float().to(device),
            k_shift=self.k_shift.float().to(device),
            slot_chunk=self.slot_chunk.to(device),
            v_step=self.v_step.float().to(device),
            v_shift=self.v_shift.float().to(device),
            slot_coef=self.slot_coef.to(device),
            transform=layout.transform.to(torch.float32).contiguous().to(device),
        )


_PLANS_V2: dict[tuple, _PlanV2] = {}


def _plan_v2(layout: CompressedLayout, device: torch.device, subnormal: bool) -> _PlanV2:
    cache_key = (layout.key or id(layout), str(device), subnormal)
    plan = _PLANS_V2.get(cache_key)
    if plan is not None:
        return plan
    chunks = _field_chunks(layout)
    k_slots = sum(c.k_operands * c.k_padded for c in chunks)
    v_slots = sum(c.v_operands * c.v_padded for c in chunks)
    transform = layout.transform.to(torch.float64)
    t = _SlotTables.zeros(k_slots, v_slots, layout.head_dim)
    # the MMA sees unit * code * 2**pos (subnormal), or 1024 + code * 2**pos (keys) and
    # code * 2**pos - mid (values) in magic mode; coefficient = scale * (offset + step * code)
    unit = SUBNORMAL_UNIT if subnormal else 1.0
    for ci, c in enumerate(chunks):
        t.slot_chunk[c.k_slot0 : c.k_slot0 + c.k_operands * c.k_padded] = ci
        for slot, coef, pos in c.k_slots():
            t.rows[slot] = transform[coef]
            t.k_factor[slot] = c.grid_step / 2**pos
            if subnormal:  # score = scale / unit * (dot + sum_s q_s * k_shift_s)
                t.k_shift[slot] = c.grid_offset * unit * 2**pos / c.grid_step
            else:  # score = scale * (dot + sum_s q_s * k_shift_s)
                t.k_shift[slot] = c.grid_offset * 2**pos / c.grid_step - MAGIC_OFFSET
        for slot, coef, pos in c.v_slots():
            per_value = c.grid_step / (2**pos * unit)
            t.slot_coef[slot] = coef
            t.v_step[slot] = per_value
            if subnormal:
                t.v_shift[slot] = c.grid_offset / per_value
            else:
                t.v_shift[slot] = 2 ** (pos + c.bits - 1) + c.grid_offset / per_value
    chunk_constexpr = tuple(
        (
            c.elem_offset,
            c.n_elems,
            c.bits,
            c.scale_index,
            c.k_slot0,
            c.v_slot0,
            c.v_padded,
            int(c.k_bytes),
            c.k_padded,
            c.v_stack,
            c.k_stack,
        )
        for c in chunks
    )
    plan = t.plan(layout, device, chunks, chunk_constexpr)
    _PLANS_V2[cache_key] = plan
    return plan


# ------------------------------------------------------------------------------------------------
# v3 plan: the Gluon kernel's slots (kernels/wavelet_attention_gluon.py). One layout family: head_dim
# 128, a 4-bit band of 64 coefficients then a 2-bit band of 64, affine grids (the codec's default).
# Each band is 4 MMA operands of 16 slots: the 4-bit band's operand f is field f of its 16 int16
# elements; the 2-bit band's operand o holds field 2o of its 8 elements in slots 0-7 and field
# 2o + 1 in slots 8-15. Keys and values share the slot order (128 slots, no padding).

V3_BANDS = ((0, 64, 4), (64, 64, 2))
V3_MAX_ROWS = 8  # query rows per program: the key MMAs' N


def v3_operand_fields(band: int, operand: int) -> tuple[int, int]:
    """(field of slots 0-7, field of slots 8-15) of operand `operand` of v3 band `band`."""
    return (operand, operand) if band == 0 else (2 * operand, 2 * operand + 1)


def _v3_layout_check(layout: CompressedLayout) -> None:
    if layout.head_dim != 128 or tuple(layout.bands) != V3_BANDS:
        raise UnsupportedLayout(
            f"v3 runs head_dim 128 with bands {V3_BANDS}, "
            f"got head_dim {layout.head_dim}, bands {layout.bands}"
        )
    for index, grid in enumerate(layout.grids):
        if not _is_affine(grid)[0]:
            raise UnsupportedLayout(f"band {index}: grid is not affine (v3 needs code * step + offset)")


def v3_key_pair_element(j: int) -> int:
    """LaunchConfig.key_word_pairs: the 4-bit band's int16 element in key slot j (0-15) of an
    operand. Lane (g, t) of an m16n8k16 A fragment holds slots 2t, 2t + 1 and 2t + 8, 2t + 9;
    giving them elements 4t, 4t + 1 and 4t + 2, 4t + 3 puts its two words side by side in
    memory, for one 8-byte load (the kernel's _pair_elements)."""
    return (j % 8) // 2 * 4 + j % 2 + j // 8 * 2


def _v3_coefficient(start: int, bits: int, offset: int, element: int) -> int:
    """The coefficient of the field at bit `offset` of int16 element `element` of the band that
    starts at coefficient `start` with `bits`-bit codes."""
    byte = 2 * element + offset // 8  # within the band (int16 elements are little-endian)
    return start + byte * (8 // bits) + (offset % 8) // bits


def _plan_v3(layout: CompressedLayout, device: torch.device, key_word_pairs: bool = False) -> _PlanV2:
    """v3's slot maps in _PlanV2's form (the prologue and reduce read them alike; v3 has no
    chunk constexprs: its two bands are fixed). key_word_pairs: the 4-bit band's key slots in
    v3_key_pair_element's order (the value slots keep theirs: values come through shared memory)."""
    cache_key = (layout.key or id(layout), str(device), "v3", key_word_pairs)
    plan = _PLANS_V2.get(cache_key)
    if plan is not None:
        return plan
    _v3_layout_check(layout)
    d = layout.head_dim
    transform = layout.transform.to(torch.float64)
    t = _SlotTables.zeros(d, d, d)
    key_coef = torch.full((d,), -1, dtype=torch.int64)
    for band, (start, size, bits) in enumerate(layout.bands):
        _, step, grid_offset = _is_affine(layout.grids[band])
        n_elems = size * bits // 16
        for operand in range(4):
            fields = v3_operand_fields(band, operand)
            for j in range(16):
                # the 2-bit band's 8 elements appear twice per operand, the second time as field 2o + 1
                field_index = fields[j // n_elems] if n_elems == 8 else fields[0]
                offset = field_index * bits
                _, pos = field_layout(bits, field_index)
                per_value = step / 2**pos
                slot = 16 * (4 * band + operand) + j
                paired = key_word_pairs and n_elems == 16  # (the 2-bit band has one word a lane)
                key_coef[slot] = _v3_coefficient(
                    start, bits, offset, v3_key_pair_element(j) if paired else j % n_elems
                )
                t.rows[slot] = transform[key_coef[slot]]
                # keys: the MMA sees 1024 + code * 2**pos; values: code * 2**pos - mid once centred
                t.k_factor[slot] = per_value
                t.k_shift[slot] = grid_offset / per_value - MAGIC_OFFSET
                t.slot_chunk[slot] = band
                t.v_step[slot] = per_value
                t.v_shift[slot] = 2 ** (pos + bits - 1) + grid_offset / per_value
                t.slot_coef[slot] = _v3_coefficient(start, bits, offset, j % n_elems)
    if sorted(t.slot_coef.tolist()) != list(range(d)) or sorted(key_coef.tolist()) != list(range(d)):
        raise AssertionError("v3 slots must hold every coefficient once")  # a bug in this plan
    plan = t.plan(layout, device, [], ())
    _PLANS_V2[cache_key] = plan
    return plan
