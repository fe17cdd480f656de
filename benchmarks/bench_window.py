"""Sliding-window decode attention (gpt-oss's sliding layers) on the GPU: wmoe::wavelet_attention
with window=W, which reads the codec's exact ring of recent tokens (kernels/window_attention.py),
against the two ways a dense or decompressed cache serves the same layer, measured in the same run.

    python benchmarks/bench_window.py --out DIR [--smoke]

Shapes: gpt-oss-20b's attention (64 query / 8 kv heads, D 64, a window of W = 128, learned sink
logits), one new token, B in {1, 8, 32}, every sequence CAPACITY positions long (the ring full).
Columns:
- ours: the op, ms per call (CUDA graph of calls rotating over enough input copies to exceed L2);
- bytes: what a call must read and write (the ring's K and V in bf16 per sequence and kv head, the
  query, the output), floor = bytes / 4.25 TB/s; at these sizes a launch's fixed cost dominates;
- SDPA window: torch SDPA (bf16, enable_gqa) over a dense bf16 cache of the last W tokens only
  (k[:, :, L - W:]: what a dedicated sliding cache costs; SDPA has no sink logits, so it does
  less work than ours);
- before: what the rewritten graph did before this kernel, wmoe::kv_decompress of the whole
  compressed cache then SDPA under the window mask (B <= 8: it decompresses CAPACITY tokens;
  triton.testing.do_bench, no CUDA graph: that path copies its grids to the device per call).
Accuracy: ours against wavelet_attention_reference with the same sinks and window.
--smoke runs on the CPU (Triton interpreter, tiny shapes, meaningless timings).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
HQ, HKV, HEAD_DIM, WINDOW = 64, 8, 64, 128
BATCHES = (1, 8, 32)
CAPACITY = 8192
COPY_TBPS = 4.25  # the H200's measured copy bandwidth (bench_attention.py)
L2_BYTES = 60e6  # rotate over more input bytes than the 50 MB L2


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/out/window")
    p.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    return p.parse_args()


ARGS = _parse() if __name__ == "__main__" else None
if ARGS is not None and ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton.testing  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402  (its CUDA-graph timing)
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402

import wmoe_compile.ops  # noqa: E402,F401  registers the ops
from wmoe_compile.codec import allocate_compressed_cache  # noqa: E402
from wmoe_compile.ops import attention as ops  # noqa: E402


def make_inputs(batch: int, capacity: int, device: str, hq: int, hkv: int, head_dim: int) -> tuple:
    """One copy of the op's inputs: random codes (any bytes are valid codes), random exact sinks and
    ring, full sequences, full-form channel parameters (offsets: the sink logit's key shift runs)."""
    layout = ops.compressed_layout("default", head_dim)
    caches = []
    for _ in range(2):
        codes, scales = allocate_compressed_cache(
            batch, hkv, capacity, layout.n_code_bytes, layout.n_bands, device
        )
        caches += [codes.random_(0, 256), scales.uniform_(0.5, 1.5)]
    exact = [
        torch.randn(batch, hkv, layout.n_exact, head_dim, device=device, dtype=torch.bfloat16)
        for _ in range(2)
    ]
    q = torch.randn(batch, hq, 1, head_dim, device=device, dtype=torch.bfloat16)
    lens = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    params = [ba._channel_params(hkv, head_dim, device) for _ in range(2)]
    return (q, *caches, *exact, lens, *params)


def main() -> int:
    args = ARGS
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    hq, hkv, head_dim, window = (8, 2, HEAD_DIM, 64) if smoke else (HQ, HKV, HEAD_DIM, WINDOW)
    capacity = 256 if smoke else CAPACITY
    batches = (1, 2) if smoke else BATCHES
    if smoke:
        ops.set_backend("triton")
    ops.set_value_checks(False)  # no host sync per call (CUDA-graph capture skips it anyway)
    layout = ops.compressed_layout("default", head_dim)
    sm_scale = head_dim**-0.5
    sinks = torch.randn(hq, device=device) + math.log(window)
    op = torch.ops.wmoe.wavelet_attention
    rows = []
    for batch in batches:
        first = make_inputs(batch, capacity, device, hq, hkv, head_dim)
        ring_bytes = 2 * batch * hkv * window * head_dim * 2
        moved = ring_bytes + 2 * batch * hq * head_dim * 2  # + the query and the output
        copies = [first] + [
            make_inputs(batch, capacity, device, hq, hkv, head_dim)
            for _ in range(0 if smoke else max(0, math.ceil(L2_BYTES / ring_bytes) - 1))
        ]
        got = op(*first, "default", sm_scale, sinks, window)
        want = wa.wavelet_attention_reference(*first, layout, sm_scale, sinks, window)
        rel_err = float((got.float() - want.float()).norm() / want.float().norm())
        ours = ba.time_calls([lambda c=c: op(*c, "default", sm_scale, sinks, window) for c in copies], smoke)
        # SDPA over dense bf16 windows of W tokens (as many copies, for the same L2 rotation)
        dense = [
            (
                torch.randn(batch, hq, 1, head_dim, device=device, dtype=torch.bfloat16),
                torch.randn(batch, hkv, window, head_dim, device=device, dtype=torch.bfloat16),
                torch.randn(batch, hkv, window, head_dim, device=device, dtype=torch.bfloat16),
            )
            for _ in copies
        ]
        sdpa = ba.time_calls(
            [lambda d=d: F.scaled_dot_product_attention(*d, enable_gqa=True) for d in dense], smoke
        )
        before = None
        if batch <= 8:
            # the graph's path before the ring-window kernel: decompress the whole cache, masked SDPA
            slots = torch.arange(capacity, device=device)
            mask = (slots > capacity - 1 - window)[None, None, None, :]

            def previous(c=first, mask=mask):
                q, kc, ks, vc, vs = c[:5]
                k = torch.ops.wmoe.kv_decompress(kc, ks, c[8], "default", torch.bfloat16)
                v = torch.ops.wmoe.kv_decompress(vc, vs, c[9], "default", torch.bfloat16)
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

            # (no CUDA graph: kv_decompress's path copies its grids to the device per call)
            before = ba.time_calls([previous], True) if smoke else triton.testing.do_bench(previous)
        row = dict(
            B=batch,
            window=window,
            ms=ours,
            bytes=moved,
            floor_ms=moved / (COPY_TBPS * 1e12) * 1e3,
            sdpa_window_ms=sdpa,
            before_ms=before,
            rel_err=rel_err,
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu="cpu (smoke)" if smoke else torch.cuda.get_device_name(),
        torch=torch.__version__,
        command="python benchmarks/bench_window.py " + " ".join(sys.argv[1:]),
        heads=dict(q=hq, kv=hkv),
        head_dim=head_dim,
        capacity=capacity,
    )
    lines = [
        f"{info['date']}, {info['gpu']}, torch {info['torch']}; {hq} query / {hkv} kv heads, D {head_dim}, "
        f"window {window}, sink logits, caches of {capacity} positions",
        "",
        "| B | ms | bytes | floor ms | x floor | SDPA window ms | vs SDPA window | before ms | vs before "
        "| rel err |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        before = "-" if r["before_ms"] is None else f"{r['before_ms']:.4f}"
        gain = "-" if r["before_ms"] is None else f"{r['before_ms'] / r['ms']:.1f}x"
        lines.append(
            f"| {r['B']} | {r['ms']:.4f} | {r['bytes'] / 1e6:.2f} MB | {r['floor_ms']:.4f} | "
            f"{r['ms'] / r['floor_ms']:.1f} | {r['sdpa_window_ms']:.4f} | "
            f"{r['sdpa_window_ms'] / r['ms']:.2f}x | "
            f"{before} | {gain} | {r['rel_err']:.1e} |"
        )
    (out / "window.json").write_text(json.dumps(dict(info=info, results=rows), indent=1))
    (out / "window.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
