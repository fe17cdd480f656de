"""Sketch of a whole Gluon split-kernel step (not used by the package; compile-only).

    python benchmarks/spike_gluon_step.py [MAXNREG] [--out DIR]

One warp, 64 tokens per step, 8 query rows (4 real ones pad the MMAs' N), the default layout
(48-byte code rows: a 4-bit band of 16 int16 elements, then a 2-bit band of 8; two fp16 scales per
row). Keys load straight into mma_v2 A fragments (benchmarks/spike_gluon_operands.py); the 2-bit
band takes two bit fields per 16-wide operand; online softmax with lazy rescaling; value tiles
through cp.async and ldmatrix.trans; magic value fields centred through the MMA accumulator input.
It is compiled offline for sm_90 to count one step's instructions and registers; its numbers have
NOT been checked (no Gluon interpreter, no GPU run): no tail masks on the code loads, no exact
tokens, no split bounds or partial outputs in the reduce's format. Measured 2026-11-30, Triton
3.6.0: 918 instructions per step at 128 registers, against 1,402 at 168 for the Triton v1 kernel
(benchmarks/RESULTS.md).
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
import pathlib
import subprocess

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from spike_gluon_operands import loop_mix  # noqa: E402

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
TOKEN_MAJOR = gl.constexpr(gl.BlockedLayout([1, 8], [16, 2], [1, 1], [1, 0]))
TILE = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))
SCALES = gl.constexpr(gl.BlockedLayout([1, 2], [32, 1], [1, 1], [1, 0]))


def _field_asm(bits: int, field: int) -> str:
    """PTX for bit field `field` (of `bits` bits) of two int16 elements -> two magic fp16
    (1024 + field value << position); fields in the upper byte are shifted down by 8 first."""
    pos = field * bits
    shift, pos = (8, pos - 8) if pos >= 8 else (0, pos)
    mask = ((1 << bits) - 1) << pos
    lop = f"lop3.b32 $0, {{src}}, 0x{mask:04X}{mask:04X}, 0x64006400, 0xea;"
    if not shift:
        return lop.format(src="$1")
    return "{ .reg .b32 t; shr.b32 t, $1, 8; " + lop.format(src="t") + " }"


LO4 = gl.constexpr(_field_asm(4, 0))
HI4 = gl.constexpr(_field_asm(4, 1))
LO4S = gl.constexpr(_field_asm(4, 2))
HI4S = gl.constexpr(_field_asm(4, 3))
F2_0, F2_1, F2_2, F2_3, F2_4, F2_5, F2_6, F2_7 = (gl.constexpr(_field_asm(2, f)) for f in range(8))


@gluon.jit
def _f(raw, ASM: gl.constexpr):
    return gl.inline_asm_elementwise(ASM, "=r,r", [raw], dtype=gl.float16, is_pure=True, pack=2)


@gluon.jit
def _pair(raw, upper, ASM_LO: gl.constexpr, ASM_HI: gl.constexpr):
    # rows/cols of the operand's upper half take the next field of the same elements
    return gl.where(upper, _f(raw, ASM_HI), _f(raw, ASM_LO))


@gluon.jit
def step_kernel(kc_ptr, ks_ptr, vc_ptr, vs_ptr, qw_ptr, acc_ptr, n_tokens, BLOCK_N: gl.constexpr):
    # ---- loop invariants: query slices per key operand ([16 slots, 8 rows] fp16 B operands)
    qs = gl.arange(0, 16, layout=gl.SliceLayout(1, B_OP))
    qr = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
    qoff = qs[:, None] * 8 + qr[None, :]
    q0 = gl.load(qw_ptr + 0 * 128 + qoff)
    q1 = gl.load(qw_ptr + 1 * 128 + qoff)
    q2 = gl.load(qw_ptr + 2 * 128 + qoff)
    q3 = gl.load(qw_ptr + 3 * 128 + qoff)
    q4 = gl.load(qw_ptr + 4 * 128 + qoff)
    q5 = gl.load(qw_ptr + 5 * 128 + qoff)
    q6 = gl.load(qw_ptr + 6 * 128 + qoff)
    q7 = gl.load(qw_ptr + 7 * 128 + qoff)
    # key operand index: tokens x 16 (4-bit: element j; 2-bit: element j % 8, field + j // 8)
    kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, A_OP))
    kj = gl.arange(0, 16, layout=gl.SliceLayout(0, A_OP))
    k_upper = (kj >= 8)[None, :]
    codes = kc_ptr.to(gl.pointer_type(gl.int16), bitcast=True)
    vcodes = vc_ptr.to(gl.pointer_type(gl.int16), bitcast=True)
    # value tiles: [BLOCK_N tokens, 24 elements + 8 duplicated 2-bit elements] in shared memory
    vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, TOKEN_MAJOR))
    ve = gl.arange(0, 16, layout=gl.SliceLayout(0, TOKEN_MAJOR))
    tile4 = gl.allocate_shared_memory(gl.int16, [BLOCK_N, 16], TILE)
    tile2 = gl.allocate_shared_memory(gl.int16, [BLOCK_N, 16], TILE)
    slot = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
    v_upper = (slot >= 8)[:, None]
    st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    sb = gl.arange(0, 2, layout=gl.SliceLayout(0, SCALES))
    stt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALES))
    # accumulators: 4 fields of the 4-bit band + 4 two-field operands of the 2-bit band
    a0 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a1 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a2 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a3 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a4 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a5 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a6 = gl.zeros([16, 8], gl.float32, layout=MMA)
    a7 = gl.zeros([16, 8], gl.float32, layout=MMA)
    m_i = gl.full([8], -1.0e30, gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([8], gl.float32, layout=gl.SliceLayout(0, MMA))
    centre = gl.full([16, 8], 1026.0, gl.float32, layout=MMA)
    for start in range(0, n_tokens, BLOCK_N):
        # values: cp.async this step's tiles (4-bit elements 0..15; 2-bit elements 16..23 twice)
        async_copy.async_copy_global_to_shared(tile4, vcodes + (start + vt)[:, None] * 24 + ve[None, :])
        async_copy.async_copy_global_to_shared(
            tile2, vcodes + (start + vt)[:, None] * 24 + 16 + (ve % 8)[None, :]
        )
        async_copy.commit_group()
        # keys straight into A fragments
        rows = codes + (start + kt)[:, None] * 24
        raw4 = gl.load(rows + kj[None, :])
        raw2 = gl.load(rows + 16 + (kj % 8)[None, :])
        z = gl.zeros([BLOCK_N, 8], gl.float32, layout=MMA)
        sa = mma_v2(_f(raw4, LO4), q0, z)
        sa = mma_v2(_f(raw4, HI4), q1, sa)
        sa = mma_v2(_f(raw4, LO4S), q2, sa)
        sa = mma_v2(_f(raw4, HI4S), q3, sa)
        sbb = mma_v2(_pair(raw2, k_upper, F2_0, F2_1), q4, z)
        sbb = mma_v2(_pair(raw2, k_upper, F2_2, F2_3), q5, sbb)
        sbb = mma_v2(_pair(raw2, k_upper, F2_4, F2_5), q6, sbb)
        sbb = mma_v2(_pair(raw2, k_upper, F2_6, F2_7), q7, sbb)
        ksc = gl.load(ks_ptr + (start + stt)[:, None] * 2 + sb[None, :]).to(gl.float32)
        k0, k1 = gl.split(ksc)
        k0 = gl.convert_layout(k0, gl.SliceLayout(1, MMA))
        k1 = gl.convert_layout(k1, gl.SliceLayout(1, MMA))
        s = sa * k0[:, None] + sbb * k1[:, None]
        s = gl.where((start + st < n_tokens)[:, None], s, -1.0e30)
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        if gl.max(m_new - m_i, axis=0) > 0:
            alpha = gl.exp2(m_i - m_new)
            a0 = a0 * alpha[None, :]
            a1 = a1 * alpha[None, :]
            a2 = a2 * alpha[None, :]
            a3 = a3 * alpha[None, :]
            a4 = a4 * alpha[None, :]
            a5 = a5 * alpha[None, :]
            a6 = a6 * alpha[None, :]
            a7 = a7 * alpha[None, :]
            l_i = l_i * alpha
            m_i = m_new
        p = gl.exp2(s - m_i[None, :])
        l_i = l_i + gl.sum(p, axis=0)
        vsc = gl.load(vs_ptr + (start + stt)[:, None] * 2 + sb[None, :]).to(gl.float32)
        w0, w1 = gl.split(vsc)
        w0 = gl.convert_layout(w0, gl.SliceLayout(1, MMA))
        w1 = gl.convert_layout(w1, gl.SliceLayout(1, MMA))
        pa = gl.convert_layout((p * w0[:, None]).to(gl.float16), B_OP)
        pb = gl.convert_layout((p * w1[:, None]).to(gl.float16), B_OP)
        # token sums of the scaled weights, for centring the magic fields through the MMA input
        suma = gl.sum(p * w0[:, None], axis=0)
        sumb = gl.sum(p * w1[:, None], axis=0)
        ca = centre * suma[None, :]
        cb = centre * sumb[None, :]
        async_copy.wait_group(0)
        r4 = tile4.permute([1, 0]).load(A_OP)
        r2 = tile2.permute([1, 0]).load(A_OP)
        a0 = mma_v2(_f(r4, LO4), pa, a0 - ca)
        a1 = mma_v2(_f(r4, HI4), pa, a1 - ca)
        a2 = mma_v2(_f(r4, LO4S), pa, a2 - ca)
        a3 = mma_v2(_f(r4, HI4S), pa, a3 - ca)
        a4 = mma_v2(_pair(r2, v_upper, F2_0, F2_1), pb, a4 - cb)
        a5 = mma_v2(_pair(r2, v_upper, F2_2, F2_3), pb, a5 - cb)
        a6 = mma_v2(_pair(r2, v_upper, F2_4, F2_5), pb, a6 - cb)
        a7 = mma_v2(_pair(r2, v_upper, F2_6, F2_7), pb, a7 - cb)
    o_s = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))
    o_r = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
    off = o_s[:, None] * 8 + o_r[None, :]
    gl.store(acc_ptr + 0 * 128 + off, a0)
    gl.store(acc_ptr + 1 * 128 + off, a1)
    gl.store(acc_ptr + 2 * 128 + off, a2)
    gl.store(acc_ptr + 3 * 128 + off, a3)
    gl.store(acc_ptr + 4 * 128 + off, a4)
    gl.store(acc_ptr + 5 * 128 + off, a5)
    gl.store(acc_ptr + 6 * 128 + off, a6)
    gl.store(acc_ptr + 7 * 128 + off, a7)
    gl.store(acc_ptr + 1024 + o_r, l_i / 1.0)
    gl.store(acc_ptr + 1032 + o_r, m_i)


def main() -> None:
    sig = {
        "kc_ptr": "*u8",
        "ks_ptr": "*fp16",
        "vc_ptr": "*u8",
        "vs_ptr": "*fp16",
        "qw_ptr": "*fp16",
        "acc_ptr": "*fp32",
        "n_tokens": "i32",
        "BLOCK_N": "constexpr",
    }
    al = [["tt.divisibility", 16]]
    src = GluonASTSource(
        fn=step_kernel, signature=sig, constexprs={(7,): 64}, attrs={(i,): al for i in range(6)}
    )
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = (
        pathlib.Path(sys.argv[sys.argv.index("--out") + 1])
        if "--out" in sys.argv
        else pathlib.Path("build/gluon")
    )
    out.mkdir(parents=True, exist_ok=True)
    maxnreg = int(args[0]) if args and args[0].isdigit() else 0
    opts = dict(num_warps=1)
    if maxnreg:
        opts["maxnreg"] = maxnreg
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    (out / "step.cubin").write_bytes(k.asm["cubin"])
    (out / "step.ttgir").write_text(k.asm["ttgir"])
    nvd = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run(
        [str(nvd / "nvdisasm"), "-c", str(out / "step.cubin")], capture_output=True, text=True, check=True
    ).stdout
    (out / "step.sass").write_text(sass)
    res = subprocess.run(
        [str(nvd / "cuobjdump"), "-res-usage", str(out / "step.cubin")], capture_output=True, text=True
    ).stdout
    print(res.strip().splitlines()[-1])
    mix = loop_mix(sass)
    print(sum(mix.values()), mix.most_common(40))


if __name__ == "__main__":
    main()
