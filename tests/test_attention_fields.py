"""kernels/attention_fields.py: where each code field sits in an int16 element, and the PTX the
kernels build their fp16 operands with (checked here as text and by the fp16 values it encodes; the
kernels that run it are checked against the reference in test_wavelet_attention.py)."""

import re

import pytest
import torch
from wmoe_compile.kernels import attention_fields as F


@pytest.mark.parametrize("bits", F.FIELD_BITS)
def test_every_field_of_an_element_lies_inside_the_fp16_mantissa_once(bits):
    covered = []
    for f in range(16 // bits):
        shift, pos = F.field_layout(bits, f)
        assert shift in (0, 8) and pos >= 0 and pos + bits <= 10, (bits, f, shift, pos)
        covered += [shift + pos + b for b in range(bits)]
    assert sorted(covered) == list(range(16)), bits  # the element's 16 bits, each in one field


def test_the_magic_encoding_reads_as_1024_plus_the_field_at_its_position():
    # 0x6400 | (field << pos) is fp16 1024 + field * 2**pos for every field a 10-bit mantissa holds
    for bits in F.FIELD_BITS:
        for f in range(16 // bits):
            _, pos = F.field_layout(bits, f)
            for field in (0, 1, (1 << bits) - 1):
                word = torch.tensor([0x6400 | (field << pos)], dtype=torch.int16)
                assert word.view(torch.float16).item() == F.MAGIC_OFFSET + field * 2**pos


def test_centred_asm_subtracts_the_fields_centre_in_fp16():
    # the centred value fields subtract 1024 + mid: the constant in the PTX is field_centre's fp16
    for bits in F.FIELD_BITS:
        for f in range(16 // bits):
            asm = F.field_asm(F.MODE_MAGIC_CENTRED, bits, f)
            pair = int(re.search(r"mov\.b32 c, (0x[0-9a-f]+);", asm).group(1), 16)
            low = torch.tensor([pair & 0xFFFF], dtype=torch.int32).to(torch.int16)
            assert pair >> 16 == pair & 0xFFFF  # the same constant in both halves
            assert low.view(torch.float16).item() == F.field_centre(bits, f), (bits, f)
            assert "sub.f16x2" in asm


def test_tables_hold_every_mode_and_field_in_the_kernels_order():
    # the v2 kernel indexes FIELD_ASMS[MODE * 14 + base + field] (base 0 / 8 / 12 for 2 / 4 / 8
    # bits) and BYTE_FIELD_ASMS[MODE * 7 + base + field] (base 0 / 4 / 6)
    for mode in range(3):
        for bits, base in ((2, 0), (4, 8), (8, 12)):
            for f in range(16 // bits):
                assert F.FIELD_ASMS[mode * 14 + base + f] == F.field_asm(mode, bits, f)
    for mode in range(2):
        for bits, base in ((2, 0), (4, 4), (8, 6)):
            for f in range(8 // bits):
                assert F.BYTE_FIELD_ASMS[mode * 7 + base + f] == F.byte_field_asm(mode, bits, f)
    assert len(F.FIELD_ASMS) == 42 and len(F.BYTE_FIELD_ASMS) == 14
    # a field's mask: subnormal mode ANDs it in place, magic mode ORs in the 0x6400 exponent too
    assert "and.b32 $0, $1, 0xf000f;" in F.field_asm(F.MODE_SUBNORMAL, 4, 0)
    assert "lop3.b32 $0, s, 0xc000c, 0x64006400, 0xEA;" in F.field_asm(F.MODE_MAGIC, 2, 5)
