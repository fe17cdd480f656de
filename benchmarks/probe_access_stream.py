"""How fast does the memory system deliver the v3 split kernel's own loads, with no math between them?

The split kernel reads its 871 MB at (8, 131072) at about 3.9 TB/s, 1.10x the time of a coalesced
read of the same bytes (benchmarks/read_floor.py: 4.4 TB/s). Its value copies were the warps' largest
wait in the thirty-second session's Nsight Compute samples (20% at the cp.async wait), yet issuing
them a step earlier (num_stages=2) gained nothing: that points at the loads' pattern capping the
bandwidth, not their latency. This probe separates the two. One-warp programs on the op's split grid
issue exactly the kernel's loads through the kernel's own Gluon helpers (key words into A fragments
with the L2::256B hint, a lane's two 4-bit-band words as one 8-byte load; value rows by 8-byte
cp.async.ca copies; the scale pairs, 4 bytes a token) and fold them into XORs, the values `stages` - 1
steps ahead and the keys one step ahead. Variants drop parts of the stream, copy the value rows as
16-byte whole rows instead, or run 12 programs an SM (a grid of 12 x SMs programs taking the op's
blocks in turn: the op's residency at its 168 registers).

    python benchmarks/probe_access_stream.py [--shapes "8,131072;32,32768"] [--out DIR]
    python benchmarks/probe_access_stream.py --sass --out DIR   # no GPU: each variant's loads

If the op's pattern streams at ~4.4 TB/s here, the op's own issue and latency are what is left; if it
caps near the op's 3.9, the pattern is, and a different layout of loads is what would pay. (It
streamed at 4.29-4.30 TB/s: RESULTS.md, thirty-second session.)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
import read_floor  # noqa: E402
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402
from wmoe_compile.kernels import wavelet_attention_gluon as G  # noqa: E402

if not G.HAS_GLUON:
    raise SystemExit(f"probe_access_stream needs Gluon: {G.gluon_reason()}")

from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.ampere import async_copy  # noqa: E402

_async_load = G._async_load

_A = G._A
_TOKEN_ROWS_8B = G._TOKEN_ROWS_8B
_TILE = G._TILE
_SCALE_PAIRS = G._SCALE_PAIRS
_ROW_COPY = G._ROW_COPY  # [tokens, 32 int16]: 16 bytes a lane, 4 lanes a row
_ROW_TILE = G._ROW_TILE


@gluon.jit
def _issue_values(
    ring,
    stage,
    first,
    vt,
    rt,
    rc,
    in_row,
    CODE_ROW: gl.constexpr,
    E4: gl.constexpr,
    E2: gl.constexpr,
    ROWS16: gl.constexpr,
):
    """The value rows of the step at `first` into ring stage `stage`: by _copy_rows (ROWS16) or as
    the op issues them (G._issue_stage: 8-byte cp.async.ca band copies)."""
    if ROWS16:
        _copy_rows(ring[1], stage, first, rt, rc, in_row, CODE_ROW)
    else:
        G._issue_stage(ring, stage, first, first, vt, CODE_ROW, E4, E2, False, True, False, True)


@gluon.jit
def _copy_rows(vrows, stage, first, rt, rc, in_row, CODE_ROW: gl.constexpr):
    """ROWS16: BLOCK_N whole code rows from `first` into stage `stage` of vrows ([STAGES, tokens, 32]
    int16) by 16-byte cp.async (L2 only), lanes along (row, 16-byte chunk): each warp instruction
    covers 8 contiguous rows, every sector requested once; the fourth chunk of a 64-byte smem row
    has no source (masked)."""
    _async_load(vrows.index(stage), first + rt[:, None] * CODE_ROW + rc[None, :], mask=in_row)
    async_copy.commit_group()


@gluon.jit
def _stream_kernel(
    kc_ptr,  # uint8 key codes [pairs, tokens, CODE_ROW * 2 bytes]
    ks_ptr,  # fp16 key scales [pairs, tokens, SCALE_ROW]
    vc_ptr,
    vs_ptr,
    out_ptr,  # int32 [pairs, splits]: the sum of each position's XOR over the steps (keeps loads live)
    n_tokens,  # token stride between (sequence, kv head) pairs
    chunk,  # tokens per split, a multiple of BLOCK_N
    splits,  # splits per pair
    n_items,  # pairs x splits
    CODE_ROW: gl.constexpr,  # int16 elements per code row
    SCALE_ROW: gl.constexpr,  # fp16 scales per token
    E4: gl.constexpr,  # first int16 element of the 4-bit band
    E2: gl.constexpr,  # first int16 element of the 2-bit band
    BLOCK_N: gl.constexpr,  # tokens per step
    STAGES: gl.constexpr,  # value ring stages: the copies of STAGES - 1 steps ahead in flight
    KEYS: gl.constexpr,  # the key words, a step ahead (as KEYS_AHEAD, with pairs and the hint)
    VALUES: gl.constexpr,  # the value rows by 8-byte cp.async.ca into the ring
    SCALES: gl.constexpr,  # both scale pairs, a step ahead
    ROWS16: gl.constexpr,  # the value rows by 16-byte copies of whole rows instead (no L1)
):
    unused = gl.allocate_shared_memory(gl.int16, [1, BLOCK_N, 16], _TILE)  # the ring's key slots
    if ROWS16:
        vrows = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 32], _ROW_TILE)
        v4s = unused
        v2s = unused
    else:
        vrows = unused
        v4s = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 16], _TILE)
        v2s = gl.allocate_shared_memory(gl.int16, [STAGES, BLOCK_N, 16], _TILE)
    # the op's blocks in its order (consecutive blocks: consecutive splits of a pair), taken in
    # turn by a grid of as many programs as the launch keeps resident
    for item in range(gl.program_id(0), n_items, gl.num_programs(0)):
        split = item % splits
        pair = item // splits
        ring = (unused, vrows, v4s, v2s)
        pair = pair.to(gl.int64)
        kcodes = (kc_ptr + pair * n_tokens * CODE_ROW * 2).to(gl.pointer_type(gl.int16), bitcast=True)
        vcodes = (vc_ptr + pair * n_tokens * CODE_ROW * 2).to(gl.pointer_type(gl.int16), bitcast=True)
        kscales = ks_ptr + pair * n_tokens * SCALE_ROW
        vscales = vs_ptr + pair * n_tokens * SCALE_ROW
        lo = split * chunk
        hi = lo + chunk
        last = hi - BLOCK_N
        kt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _A))
        vt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _TOKEN_ROWS_8B))
        rt = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _ROW_COPY))
        rc = gl.arange(0, 32, layout=gl.SliceLayout(0, _ROW_COPY))
        rc = gl.max_contiguous(gl.multiple_of(rc, 8), 8)
        in_row = (rc < CODE_ROW)[None, :] & (rt >= 0)[:, None]  # a 48-byte row: 3 of a row's 4 lane chunks
        st = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _SCALE_PAIRS))
        total = split * 0
        if VALUES:
            for i in gl.static_range(STAGES - 1):
                _issue_values(
                    ring,
                    i,
                    vcodes + gl.minimum(lo + i * BLOCK_N, last) * CODE_ROW,
                    vt,
                    rt,
                    rc,
                    in_row,
                    CODE_ROW,
                    E4,
                    E2,
                    ROWS16,
                )
            xv = gl.zeros([BLOCK_N, 16], gl.int16, layout=_TOKEN_ROWS_8B)
            xr = gl.zeros([BLOCK_N, 32], gl.int16, layout=_ROW_COPY)
        if KEYS:
            k4, k2 = G._load_key_words(kcodes + lo * CODE_ROW, kt, CODE_ROW, E4, E2, True, True, True)
            xk4 = k4 ^ k4
            xk2 = k2 ^ k2
        if SCALES:
            kp = G._load_scale_pairs(kscales, lo + st, SCALE_ROW)
            vp = G._load_scale_pairs(vscales, lo + st, SCALE_ROW)
            xs = kp.to(gl.int16, bitcast=True) ^ kp.to(gl.int16, bitcast=True)
        for start in range(lo, hi, BLOCK_N):
            step = (start - lo) // BLOCK_N
            nxt = gl.minimum(start + BLOCK_N, last)
            if VALUES:  # (the op issues its copies at the step's start too)
                ahead = gl.minimum(start + (STAGES - 1) * BLOCK_N, last)
                slot = (step + STAGES - 1) % STAGES
                _issue_values(
                    ring, slot, vcodes + ahead * CODE_ROW, vt, rt, rc, in_row, CODE_ROW, E4, E2, ROWS16
                )
            if SCALES:  # this step's pairs are folded, the next step's loaded
                xs = xs ^ kp.to(gl.int16, bitcast=True) ^ vp.to(gl.int16, bitcast=True)
                kp = G._load_scale_pairs(kscales, nxt + st, SCALE_ROW)
                vp = G._load_scale_pairs(vscales, nxt + st, SCALE_ROW)
            if KEYS:
                xk4 = xk4 ^ k4
                xk2 = xk2 ^ k2
                k4, k2 = G._load_key_words(kcodes + nxt * CODE_ROW, kt, CODE_ROW, E4, E2, True, True, True)
            if VALUES:
                async_copy.wait_group(STAGES - 1)
                cur = step % STAGES
                if ROWS16:
                    xr = xr ^ vrows.index(cur).load(_ROW_COPY)
                else:
                    xv = xv ^ v4s.index(cur).load(_TOKEN_ROWS_8B) ^ v2s.index(cur).load(_TOKEN_ROWS_8B)
        async_copy.wait_group(0)
        # (the loads after the last step repeat it, clamped: left out of the sums, so each position's
        # XOR over the split's steps is what is summed; tests/test_wavelet_attention.py checks it)
        if KEYS:
            total += gl.sum(gl.sum(xk4, axis=1), axis=0) + gl.sum(gl.sum(xk2, axis=1), axis=0)
        if SCALES:
            total += gl.sum(gl.sum(xs.to(gl.int32), axis=1), axis=0)
        if VALUES:
            total += gl.sum(gl.sum(xv.to(gl.int32), axis=1), axis=0) + gl.sum(
                gl.sum(xr.to(gl.int32), axis=1), axis=0
            )
        gl.store(out_ptr + item, total)  # the XOR of what this (split, pair) read


def launch_stream(
    k_codes: torch.Tensor,
    k_scales: torch.Tensor,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor,
    out: torch.Tensor,
    splits: int,
    chunk: int,
    band_elements: tuple[int, int],
    stages: int,
    keys: bool,
    values: bool,
    scales: bool,
    programs: int,
    rows16: bool = False,
):
    """One _stream_kernel launch over caches [B, H, tokens, row bytes] (codes) and [B, H, tokens, 2]
    (fp16 scales): `splits` splits of `chunk` tokens (a multiple of 64) per (sequence, kv head),
    taken in turn by `programs` programs; out (int32, B * H * splits) gets each item's sum."""
    b, h, n, row = k_codes.shape
    if not all(x.is_contiguous() for x in (k_codes, k_scales, v_codes, v_scales)):
        raise ValueError("probe_access_stream reads contiguous caches")
    if chunk % 64 or chunk * splits > n:
        raise ValueError(f"{splits} splits of {chunk} tokens (whole 64-token steps) must fit {n} tokens")
    return _stream_kernel[(programs,)](
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        out,
        n,
        chunk,
        splits,
        splits * b * h,
        CODE_ROW=row // 2,
        SCALE_ROW=k_scales.shape[-1],
        E4=band_elements[0],
        E2=band_elements[1],
        BLOCK_N=64,
        STAGES=stages,
        KEYS=keys,
        VALUES=values,
        SCALES=scales,
        ROWS16=rows16,
        num_warps=1,
    )


def stream_calls(
    setup: ba.Setup,
    splits: int,
    stages: int,
    keys: bool,
    values: bool,
    scales: bool,
    per_sm: int,
    rows16: bool = False,
) -> tuple[list, int]:
    """One closure per cache copy of setup (rotated, as the op's timing does), each streaming
    whole 64-token steps of every (sequence, kv head) over `splits` splits, with per_sm programs an
    SM (0: one per split and pair, as many resident as fit); and the bytes one call reads."""
    sms = torch.cuda.get_device_properties(setup.copies[0][1].device).multi_processor_count
    calls = []
    bands = tuple(o // 2 for o in setup.layout.band_byte_offsets)
    read = 0
    for _, k_codes, k_scales, v_codes, v_scales, *_ in setup.copies:
        b, h, n, row = k_codes.shape
        chunk = n // splits // 64 * 64
        if chunk == 0:
            raise ValueError(f"{splits} splits of {n} tokens leave no whole 64-token step a split")
        out = torch.empty(splits * b * h, dtype=torch.int32, device=k_codes.device)
        per_token = (row if keys else 0) + (row if values else 0) + (8 if scales else 0)
        read = splits * chunk * b * h * per_token
        items = splits * b * h
        programs = items if per_sm == 0 else min(items, per_sm * sms)

        def call(caches=(k_codes, k_scales, v_codes, v_scales), out=out, chunk=chunk, programs=programs):
            opts = (stages, keys, values, scales, programs, rows16)
            return launch_stream(*caches, out, splits, chunk, bands, *opts)

        calls.append(call)
    return calls, read


# (name, stages, keys, values, scales, programs per SM: 12 is the op's count at 168 registers, 0 as
# many as fit, value rows by 16-byte copies of whole rows instead of the op's 8-byte band copies; a
# value stage takes 4 KB of shared memory)
VARIANTS = [
    ("op's loads, values 1 step ahead", 2, True, True, True, 12, False),
    ("op's loads, values 3 steps ahead", 4, True, True, True, 12, False),
    ("op's loads, values 1 step ahead", 2, True, True, True, 0, False),
    ("op's loads, 16-byte value rows 1 step ahead", 2, True, True, True, 12, True),
    ("op's loads, 16-byte value rows 3 steps ahead", 4, True, True, True, 12, True),
    ("keys + scales", 2, True, False, True, 12, False),
    ("values + scales, 1 step ahead", 2, False, True, True, 12, False),
    ("values + scales, 3 steps ahead", 4, False, True, True, 12, False),
    ("values + scales, 16-byte rows 1 step ahead", 2, False, True, True, 12, True),
    ("values + scales, 16-byte rows 3 steps ahead", 4, False, True, True, 12, True),
    ("values, 1 step ahead", 2, False, True, False, 0, False),
    ("values, 16-byte rows 1 step ahead", 2, False, True, False, 0, True),
    ("keys", 2, True, False, False, 0, False),
]


LOADS = ("LDG.E.LTC256B.64", "LDG.E.LTC256B", "LDGSTS.E.64", "LDGSTS.E.BYPASS.128", "LDG.E")


def sass_loads(out: pathlib.Path) -> None:
    """Compile every variant for sm_90 here (no GPU) and print its step loop's global loads, so a
    test can hold them to the split kernel's own (benchmarks/sass_attention_v3.py --tuned)."""
    import sass_attention_v3 as sass
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = _stream_kernel
    pointers = dict(kc_ptr="*u8", vc_ptr="*u8", ks_ptr="*fp16", vs_ptr="*fp16", out_ptr="*i32")
    for name, stages, keys, values, scales, _, rows16 in VARIANTS:
        constexprs = dict(CODE_ROW=24, SCALE_ROW=2, E4=0, E2=16, BLOCK_N=64, STAGES=stages)
        constexprs.update(KEYS=keys, VALUES=values, SCALES=scales, ROWS16=rows16)
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "i32") for a in fn.arg_names}
        source = GluonASTSource(
            fn=fn,
            signature=signature,
            constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
            attrs={(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a in pointers},
        )
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
        _, code = sass.disassemble(kernel, out, "stream_kernel")
        mix = sass.loop_mix(code)
        print(f"{name}, stages {stages}: " + ", ".join(f"{op} {mix.get(op, 0)}" for op in LOADS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="8,131072;32,32768")
    p.add_argument("--out", default="benchmarks/out")
    p.add_argument(
        "--sass", action="store_true", help="only compile each variant for sm_90 and print its loads"
    )
    a = p.parse_args()
    if a.sass:
        sass_loads(pathlib.Path(a.out))
        return
    rows = []
    print("| B | N | variant | ms | bytes read (MB) | TB/s |\n|---|---|---|---|---|---|")
    for shape in a.shapes.split(";"):
        b, n = map(int, shape.split(","))
        s = ba.Setup(b, n, ba.HQ, ba.HKV, "cuda", smoke=False)
        s.use_codec(ba.CODECS["default"])
        s.dense.clear()
        config = wa.tuned_config(s.layout, ba.HEAD_DIM, ba.HQ // ba.HKV, programs=b * ba.HKV)
        splits = wa.choose_num_splits(b * ba.HKV, n, s.layout, config, torch.device("cuda"))
        ba.time_ours(s, config, False)  # warm: compile, and the first timing after it is slow
        measured = {"op (tuned)": (lambda s=s, config=config: ba.time_ours(s, config, False), s.bytes)}
        _, k_codes, k_scales, *_ = s.copies[0]
        whole = k_codes.shape[0] * k_codes.shape[1] * k_codes.shape[2] * 2 * (k_codes.shape[3] + 4)
        floor_calls = read_floor.read_calls(s, splits, 1, 512)  # every token of both caches
        measured[f"coalesced read, {splits} splits"] = (lambda c=floor_calls: ba.time_calls(c, False), whole)
        for name, stages, keys, values, scales, per_sm, rows16 in VARIANTS:
            calls, nbytes = stream_calls(s, splits, stages, keys, values, scales, per_sm, rows16)
            name = f"{name}, {per_sm}/SM" if per_sm else f"{name}, every block launched"
            measured[name] = (lambda calls=calls: ba.time_calls(calls, False), nbytes)
        for rnd in range(2):  # two rounds, the order unchanged: the spread between them shows
            for name, (timer, nbytes) in measured.items():
                ms = timer()
                tbps = nbytes / ms / 1e9
                rows.append(dict(B=b, N=n, round=rnd, variant=name, ms=ms, bytes=nbytes, tbps=tbps))
                print(f"| {b} | {n} | {name} | {ms:.4f} | {nbytes / 1e6:.0f} | {tbps:.2f} |", flush=True)
        s.free()
        torch.cuda.empty_cache()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "access_stream.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
