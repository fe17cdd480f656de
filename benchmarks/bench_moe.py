"""MoE layer benchmark on the GPU: wmoe::tiled_moe against an HF-style per-expert loop,
torch._grouped_mm (HF transformers 5's "grouped_mm" experts) and, when its source is present in
third_party/vllm_fused_moe (git-ignored), vLLM's fused_moe Triton kernel with its H200 configs.

    python benchmarks/bench_moe.py --out DIR [--sweep [--sweep-tokens T ...]] [--precompile]
    python benchmarks/bench_moe.py --prewarm-offline DIR   # on a machine without a GPU, see below

Shapes: Mixtral-8x7B (H 4096, F 14336, E 8, k 2) and fine-grained (H 2048, F 1408, E 64, k 8);
T in {1, 8, 64, 256, 1024, 4096}; bf16. Routing: softmax over random router logits, top-k,
renormalised (Mixtral). Four routing/input sets rotate between calls.
`--shapes gpt-oss` (not run by default): gpt-oss-20b's experts (H 2880, F 2880, E 32, k 4) with expert
biases and the clamped SwiGLU (alpha 1.702, limit 7, up + 1); its peers are transformers'
GptOssExperts eager forward (the HF loop) and transformers' grouped_mm experts forward on that module
(replicas of both when transformers is absent); vLLM's copy here has no bias / clamp path (skipped).

Floors: weight bytes = (distinct experts hit) * 3 * H * F * 2 B over the copy bandwidth measured
in this run; FLOPs = 2 * T * k * 3 * H * F over the bf16 matmul rate measured in this run.

--sweep times candidate launch configs per kernel (gate_up, down) for every shape and T and
prints the per-bucket winners (the CONFIG_TABLE entries of kernels/tiled_moe.py); the benchmark
then uses them; --sweep-tokens limits the sweep to some T (the others keep CONFIG_TABLE's entry).
--precompile compiles every candidate first in parallel worker processes (Triton's on-disk cache
then serves the timing process). Before the shapes, the three token-grouping routes of
kernels/moe_align.py are timed alone at the benchmark's large pair counts, each also run under
torch.cuda.set_sync_debug_mode("error") to show whether it synchronises with the host.

Decode (T <= DECODE_MAX_TOKENS): a second table times ours and vLLM by one method, loop_ms (a loop of
back-to-back calls between two CUDA events), both as CUDA graph replays and as an eager host loop
(host launch work included), plus ours through the grouped path and with Triton's ordinary launches
where the direct decode path applies (what each saves). vLLM's token alignment stays outside its
timed call in both modes (favouring vLLM by its alignment op). Before each shape, the direct path's
launch configs (DIRECT_CONFIGS) are swept through the op (--no-direct-sweep keeps the table's).

--prewarm-offline DIR compiles, for an sm_90 target and with no GPU present, every kernel variant
the GPU run will launch (tests/test_tiled_moe.py's GPU tests, the sweep, the benchmark) into the
Triton cache DIR, and prints each kernel's registers, spills and shared memory. It fails here, at
no device time, on a config that does not compile. With --triton-key-of PATH (an unpacked triton
wheel for the GPU machine's Python), the cache entries carry that machine's cache key, so the GPU
run can load them instead of compiling (a miss just compiles, as without the cache).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing as mp
import os
import pathlib
import sys
import time
import traceback
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton
import triton.testing
from wmoe_compile.kernels import fast_launch, moe_align
from wmoe_compile.kernels import tiled_moe as tm

import wmoe_compile.ops.moe  # noqa: F401  (registers wmoe::tiled_moe)
from wmoe_compile.moe_packing import pack_expert_weights

ROOT = pathlib.Path(__file__).resolve().parent.parent
# gpt-oss's expert activation: (gate_alpha, clamp_limit, up_offset); a shape with a "swiglu" entry also
# has expert biases (gate_up_proj_bias, down_proj_bias), as GptOssExperts.
GPT_OSS_SWIGLU = (1.702, 7.0, 1.0)
SHAPES = {
    "mixtral": dict(num_experts=8, hidden=4096, ffn=14336, top_k=2),
    "fine": dict(num_experts=64, hidden=2048, ffn=1408, top_k=8),
    "gpt-oss": dict(num_experts=32, hidden=2880, ffn=2880, top_k=4, swiglu=GPT_OSS_SWIGLU),  # gpt-oss-20b
}
DEFAULT_SHAPES = ("mixtral", "fine")  # --shapes gpt-oss adds / selects gpt-oss
SHAPES_REAL = dict(SHAPES)  # SHAPES itself shrinks under --smoke
TOKENS = (1, 8, 64, 256, 1024, 4096)
SWEEP_TOKENS = (256, 1024, 4096)  # the prefill buckets; decode configs stay as CONFIG_TABLE has them
# (T, k, E) of the grouping-route comparison (the benchmark's pair counts above 4096), and of the GPU
# grouping test in tests/test_tiled_moe.py (keep in step); the single-launch route is timed up to
# SINGLE_LAUNCH_TIMED_UP_TO pairs (its cost grows as P^2).
GROUPING_CASES = ((4096, 2, 8), (1024, 8, 64), (4096, 8, 64))
TEST_GROUPING_CASES = ((3000, 2, 8), (4096, 8, 64), (16384, 8, 256))
SINGLE_LAUNCH_TIMED_UP_TO = 8192
ROTATE = 4
DECODE_MAX_TOKENS = 64  # T up to which the decode table times every path as graph and eager loops
DEV = "cuda"  # --smoke runs the whole script on the CPU (Triton interpreter, tiny shapes, fake timings)

# Sweep candidates: gate_up (up_n, up_k, warps, stages), down (down_n, down_k, split, warps, stages).
SMALL_M = dict(
    block_m=(16,),
    up=((64, 128, 4, 4), (32, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3), (64, 64, 4, 6), (32, 256, 4, 3)),
    down=(
        (64, 128, 4, 4, 4),
        (64, 128, 8, 4, 4),
        (32, 128, 8, 4, 4),
        (64, 256, 4, 4, 3),
        (128, 128, 2, 4, 4),
        (64, 128, 2, 4, 4),
    ),
)
MID_M = dict(
    block_m=(16, 32),
    up=((64, 128, 4, 4), (128, 128, 4, 3), (64, 64, 4, 4), (128, 64, 4, 4)),
    down=((64, 128, 2, 4, 4), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4), (128, 128, 2, 4, 3)),
)
# Large M (prefill): gate_up candidates carry a fifth field, 1 = gate and up as one dot of 2 * up_n
# columns (one N = 256 wgmma at up_n = 128, as vLLM's BLOCK_N 256), 0 = two dots of up_n.
LARGE_M = dict(
    block_m=(64, 128),
    up=((128, 64, 8, 4, 1), (128, 64, 8, 3, 1), (64, 64, 4, 4, 1), (128, 64, 8, 4, 0), (128, 64, 8, 3, 0)),
    down=((256, 64, 1, 8, 3), (256, 64, 1, 8, 4), (128, 64, 1, 8, 4), (128, 128, 1, 8, 3)),
)


def candidates_for(m: int) -> dict:
    return SMALL_M if m <= 8 else MID_M if m <= 32 else LARGE_M


def make_config(block_m: int, up: tuple, down: tuple, group_m: int = 8) -> tm.MoEConfig:
    fused = bool(up[4]) if len(up) > 4 else False
    return tm.MoEConfig(block_m, *up[:4], *down, group_m=group_m, fused=fused)


def bench_ms(fn, warmup: int = 25, rep: int = 100) -> float:
    if DEV == "cpu":  # --smoke: exercise the code path only
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def loop_ms(step, calls: int = 100, warmup: int = 10, repeats: int = 3) -> float:
    """Per-call time of `calls` back-to-back steps (median of `repeats` loops), CUDA events around the loop.

    The decode comparison's one method for every path: a step is one eager call (host launch work
    included: the time is max(host, GPU) per call, as in an eager decode loop) or one CUDA graph
    replay. Inputs rotate between steps (ROTATE sets); no cache flush between calls (every routed
    expert set is far larger than the L2).
    """
    if DEV == "cpu":  # --smoke: exercise the code path only
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    return ((got.float() - ref.float()).norm() / ref.float().norm()).item()


# ------------------------------------------------------------------ peers


def hf_loop_moe(x, topk_ids, topk_weights, gate_up_proj, down_proj):
    """transformers 5 MixtralExperts eager forward: loop over hit experts, index_add."""
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(topk_ids, num_classes=num_experts + 1).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        if e == num_experts:
            continue
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down_proj[e]) * topk_weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def grouped_mm_moe(x, topk_ids, topk_weights, gate_up_t, down_t):
    """transformers 5 grouped_mm experts: sort / histc / cumsum, two torch._grouped_mm, index_add."""
    num_experts = gate_up_t.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens = order // top_k
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[tokens], gate_up_t, offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down_t, offs=offs)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)


def gpt_oss_apply_gate(gate_up, alpha, limit):
    """GptOssExperts._apply_gate: gate/up columns interleaved, clamped; (up + 1) gate sigmoid(alpha gate)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_loop_moe(
    x, topk_ids, topk_weights, gate_up_proj, gate_up_bias, down_proj, down_bias, alpha, limit
):
    """transformers' GptOssExperts eager forward (its code; gate_up_proj [E, H, 2F], down_proj [E, F, H]),
    for when transformers is absent."""
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(topk_ids, num_classes=num_experts).permute(2, 1, 0)
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        slot, tok = torch.where(mask[e])
        gate_up = x[tok] @ gate_up_proj[e] + gate_up_bias[e]
        y = gpt_oss_apply_gate(gate_up, alpha, limit) @ down_proj[e] + down_bias[e]
        out.index_add_(0, tok, (y * topk_weights[tok, slot, None]).to(x.dtype))
    return out


def gpt_oss_grouped_mm_moe(
    x, topk_ids, topk_weights, gate_up_proj, gate_up_bias, down_proj, down_bias, alpha, limit
):
    """transformers 5 grouped_mm experts with gpt-oss's biases and gate (for when transformers is absent)."""
    num_experts = gate_up_proj.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    expert_ids, order = torch.sort(flat)
    tokens = order // top_k
    counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    h = torch._grouped_mm(x[tokens], gate_up_proj, offs=offs) + gate_up_bias[expert_ids]
    y = torch._grouped_mm(gpt_oss_apply_gate(h, alpha, limit), down_proj, offs=offs) + down_bias[expert_ids]
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))


def gpt_oss_module(
    num_experts, hidden, ffn, top_k, alpha, limit, gate_up_proj, gate_up_bias, down_proj, down_bias
):
    """transformers' GptOssExperts holding these tensors (built on the meta device, then assigned), or
    None when transformers (or its gpt-oss model) is absent."""
    try:
        import transformers
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except Exception:  # noqa: BLE001
        return None
    config = transformers.GptOssConfig(
        hidden_size=hidden,
        intermediate_size=ffn,
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        swiglu_alpha=alpha,
        swiglu_limit=limit,
    )
    config._experts_implementation = "eager"
    with torch.device("meta"):
        experts = GptOssExperts(config)
    for name, tensor in (
        ("gate_up_proj", gate_up_proj),
        ("gate_up_proj_bias", gate_up_bias),
        ("down_proj", down_proj),
        ("down_proj_bias", down_bias),
    ):
        setattr(experts, name, torch.nn.Parameter(tensor, requires_grad=False))
    return experts


def load_vllm():
    path = ROOT / "third_party"
    if not (path / "vllm_fused_moe" / "fused_moe.py").exists():
        return None
    sys.path.insert(0, str(path))
    from vllm_fused_moe import fused_moe

    return fused_moe


# ------------------------------------------------------------------ precompile in worker processes


def _precompile_worker(task):
    config, layout = task
    try:
        dev = "cuda"
        hidden = ffn = 1024
        for num_experts, top_k in ((8, 2), (64, 8)):
            gate = torch.randn(num_experts, ffn, hidden, device=dev, dtype=torch.bfloat16) * 0.03
            packed = pack_expert_weights(w1=gate, w3=gate, w2=gate.transpose(1, 2), layout=layout)
            x = torch.randn(4, hidden, device=dev, dtype=torch.bfloat16)
            ids = torch.stack([torch.randperm(num_experts, device=dev)[:top_k] for _ in range(4)])
            weights = torch.rand(4, top_k, device=dev)
            tm.tiled_moe_triton(x, ids, weights, packed.w_gate_up, packed.w_down, config=config)
        torch.cuda.synchronize()
        return None
    except Exception as exc:  # noqa: BLE001  (report, keep the other configs)
        return f"{config} {layout}: {type(exc).__name__}: {str(exc)[:300]}"


def precompile(tasks, workers: int) -> dict:
    t0 = time.time()
    ctx = mp.get_context("spawn")
    with ctx.Pool(min(workers, len(tasks))) as pool:
        errors = pool.map(_precompile_worker, tasks, chunksize=1)
    failed = {t: e for t, e in zip(tasks, errors, strict=True) if e}
    print(f"precompiled {len(tasks)} configs in {time.time() - t0:.1f} s; {len(failed)} failed", flush=True)
    for e in failed.values():
        print("  compile failure:", e, flush=True)
    return failed


def all_tasks(shapes, tokens, sweep_tokens) -> list:
    tasks = set()
    for shape in shapes.values():
        e, h, f, k = shape["num_experts"], shape["hidden"], shape["ffn"], shape["top_k"]
        hp, fp = tm.round_up(h), tm.round_up(f)
        for t in tokens:
            table_cfg = tm.lookup_config(t, k, e, hp, fp)
            tasks.add((table_cfg, "tiles64"))
            tasks.add((table_cfg, "rows"))
            if t not in sweep_tokens:
                continue
            cands = candidates_for(tm.pairs_per_expert(t, k, e))
            for bm in cands["block_m"]:
                ups, downs = cands["up"], cands["down"]
                for i in range(max(len(ups), len(downs))):
                    cfg = make_config(bm, ups[min(i, len(ups) - 1)], downs[min(i, len(downs) - 1)])
                    tasks.add((cfg.fitted(fp, hp), "tiles64"))
    return sorted(tasks, key=str)


# ------------------------------------------------------------------ offline prewarm (no GPU here)


class _OfflineCudaDriver:
    """Stands in for Triton's CUDA driver without a GPU: kernels compile for sm_90, nothing launches."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def triton_key_of(triton_dir: pathlib.Path) -> str:
    """triton.runtime.cache.triton_key() as computed by the Triton installed at `triton_dir`.

    Same recipe (Triton's own Python sources, then libtriton, then triton.language), with the files
    read from `triton_dir`: the wheel for another Python differs only in its shared libraries.
    """
    import hashlib
    import pkgutil

    import triton.runtime.cache as cache

    local = pathlib.Path(cache.__file__).resolve().parent.parent

    def digest(origin) -> str:
        return hashlib.sha256(
            (triton_dir / pathlib.Path(origin).resolve().relative_to(local)).read_bytes()
        ).hexdigest()

    contents = [digest(cache.__file__)]
    for sub, prefix in (("compiler", "triton.compiler."), ("backends", "triton.backends.")):
        for lib in pkgutil.walk_packages([str(local / sub)], prefix=prefix):
            contents.append(digest(lib.module_finder.find_spec(lib.name).origin))
    contents.append(digest(local / "_C" / "libtriton.so"))
    for lib in pkgutil.walk_packages([str(local / "language")], prefix="triton.language."):
        contents.append(digest(lib.module_finder.find_spec(lib.name).origin))
    return f"{triton.__version__}" + "-".join(contents)


def _resource_usage(kernel) -> str:
    import re
    import subprocess
    import tempfile

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    regs = f"regs {m.group(1)} stack {m.group(2)} local {m.group(3)}" if m else "regs ?"
    return f"{regs}, smem {kernel.metadata.shared} B, HGMMA {sass.count('HGMMA')}"


def offline_cases(shapes, tokens, sweep_tokens):
    """What the GPU run launches: (label, shape, T, dtype, layout, config or None = table lookup)."""
    mixtral, fine = SHAPES_REAL["mixtral"], SHAPES_REAL["fine"]
    bf16 = torch.bfloat16
    # tests/test_tiled_moe.py's GPU tests (keep in step with them).
    cases = [("test", mixtral, t, bf16, "tiles64", None) for t in (1, 64, 300)]
    cases += [("test", fine, t, bf16, "tiles64", None) for t in (1, 4096)]
    cases += [("test", mixtral, 40, torch.float16, "rows", None), ("test", fine, 1024, bf16, "rows", None)]
    prefill = tm.lookup_config(1000, 2, 8, 4096, 14336)
    cases += [("test", mixtral, 1000, bf16, "tiles64", replace(prefill, fused=f)) for f in (True, False)]
    # The direct decode path: pairs sharing experts, expert slots (Mixtral T = 8), 16 pairs of 64 experts.
    cases += [("test", mixtral, t, bf16, "tiles64", None) for t in (3, 8)]
    cases += [("test", fine, 2, bf16, "tiles64", None)]
    # tests/test_tiled_moe_gpt_oss.py: gpt-oss-20b's experts with biases and the clamped SwiGLU.
    gpt_oss = SHAPES_REAL["gpt-oss"]
    cases += [("test", gpt_oss, t, bf16, layout, None) for t in (1, 4, 64) for layout in ("tiles64", "rows")]
    # The benchmark: CONFIG_TABLE entries (both layouts), and every sweep composition.
    for shape in shapes.values():
        e, k = shape["num_experts"], shape["top_k"]
        for t in tokens:
            cases += [("bench", shape, t, bf16, layout, None) for layout in ("tiles64", "rows")]
            if t not in sweep_tokens:
                continue
            cands = candidates_for(tm.pairs_per_expert(t, k, e))
            for bm in cands["block_m"]:
                for up in cands["up"]:
                    cases.append(("sweep", shape, t, bf16, "tiles64", make_config(bm, up, cands["down"][0])))
                for down in cands["down"]:
                    cases.append(("sweep", shape, t, bf16, "tiles64", make_config(bm, cands["up"][0], down)))
    return cases


def prewarm_offline(cache_dir: str, shapes, tokens, sweep_tokens, foreign_triton: str | None) -> int:
    """Compile every kernel variant of the GPU run for sm_90 into `cache_dir`; print resources."""
    import hashlib

    import triton.runtime.cache as cache
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    os.environ["TRITON_CACHE_DIR"] = cache_dir
    pathlib.Path(cache_dir).mkdir(parents=True, exist_ok=True)
    own_key = cache.triton_key()
    if foreign_triton:
        local = pathlib.Path(cache.__file__).resolve().parent.parent
        assert triton_key_of(local) == own_key, "triton_key_of does not reproduce triton_key()"
        key = triton_key_of(pathlib.Path(foreign_triton))
        cache.triton_key = lambda: key  # get_cache_key reads the module global at call time
    else:
        key = own_key
    (pathlib.Path(cache_dir) / "triton_key.sha256").write_text(
        hashlib.sha256(key.encode()).hexdigest() + "\n"
    )
    driver.set_active(_OfflineCudaDriver())
    tm.FAST_LAUNCH = False  # nothing can launch here: keep every call on JITFunction.run (compile only)
    fast_launch.ENABLED = False  # (its key asks torch.cuda for the current device: none here)
    compiled = {}

    def compile_only(self, grid):
        def launch(*args, **kwargs):
            kernel = self.run(*args, grid=grid, warmup=True, **kwargs)
            consts = {k: v for k, v in kwargs.items() if k.isupper()}
            compiled.setdefault(kernel.hash, (self.__name__, consts, kernel))

        return launch

    JITFunction.__getitem__ = compile_only
    torch.cuda.get_device_name = lambda *a: "NVIDIA H200"  # vLLM's config lookup asks for it
    vllm = load_vllm()
    failures = 0
    t0 = time.time()
    seen = set()
    for label, shape, t, dtype, layout, cfg in offline_cases(shapes, tokens, sweep_tokens):
        e, h, f, k = shape["num_experts"], shape["hidden"], shape["ffn"], shape["top_k"]
        key_case = (tuple(shape.values()), t, dtype, layout, cfg)
        if key_case in seen:
            continue
        seen.add(key_case)
        hp, fp = tm.round_up(h), tm.round_up(f)
        if layout == "tiles64":
            w_gate_up = torch.empty(e, fp // 64, hp // 64, 2, 64, 64, dtype=dtype)
            w_down = torch.empty(e, hp // 64, fp // 64, 64, 64, dtype=dtype)
        else:
            w_gate_up = torch.empty(e, 2 * fp, hp, dtype=dtype)
            w_down = torch.empty(e, hp, fp, dtype=dtype)
        x = torch.empty(t, h, dtype=dtype)
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        weights = torch.rand(t, k)
        extra = {}  # gpt-oss: biases and the activation, constexprs of their own variants
        if shape.get("swiglu"):
            act = tm.swiglu(*shape["swiglu"])
            extra = dict(b_gate_up=torch.empty(e, 2, fp), b_down=torch.empty(e, hp), act=act)
        try:
            run_cfg = cfg or tm.lookup_config(t, k, e, hp, fp)
            tm.tiled_moe_triton(x, ids, weights, w_gate_up, w_down, config=run_cfg, **extra)
            if cfg is None and t * k <= tm.DIRECT_MAX_PAIRS:
                # The op's decode path (the grouped path above is timed beside it), and in the
                # benchmark every direct-sweep candidate.
                dims = tm.packed_dims(w_gate_up, w_down)
                candidates = [None]
                if layout == "tiles64":  # (a test case of the same T comes first and dedups the bench's)
                    swept = direct_candidates(tm.direct_config(hp, fp))
                    candidates += [c for cs in swept.values() for c in cs]
                for candidate in dict.fromkeys(candidates):
                    table = {**tm.DIRECT_CONFIGS, (hp, fp): candidate} if candidate else tm.DIRECT_CONFIGS
                    with _patched(tm, "DIRECT_CONFIGS", table):
                        tm._direct_plan.cache_clear()
                        tm.tiled_moe_direct(x, ids, weights, w_gate_up, w_down, dims, *extra.values())
                tm._direct_plan.cache_clear()
            # The grouping route the GPU takes for this many pairs (the CPU op above took torch's).
            if t * k <= moe_align.TRITON_MAX_PAIRS:
                moe_align.group_by_expert_triton(ids, e, run_cfg.block_m)
            else:
                moe_align.group_by_expert_blocked(ids, e, run_cfg.block_m)
            if label == "bench" and layout == "tiles64" and vllm is not None and not extra:
                gate_up_proj = torch.empty(e, 2 * f, h, dtype=dtype)
                down_proj = torch.empty(e, h, f, dtype=dtype)
                prepared = vllm.prepare(ids, gate_up_proj, down_proj)
                vllm.fused_experts(x, gate_up_proj, down_proj, weights, ids, prepared)
        except Exception as exc:  # noqa: BLE001  (report every failing variant, then fail)
            failures += 1
            print(
                f"FAILED {label} E={e} T={t} {dtype} {layout} {cfg}: {type(exc).__name__}: {str(exc)[:400]}"
            )
    # The grouping comparison before the shapes, and the grouping GPU test, run these routes too.
    for t, k, e in GROUPING_CASES + TEST_GROUPING_CASES:
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        moe_align.group_by_expert_blocked(ids, e, 128)
        if t * k <= SINGLE_LAUNCH_TIMED_UP_TO:
            moe_align.group_by_expert_triton(ids, e, 128)
    # The direct path at the small shape of test_gpu_direct_path_compiled_launches (tests/), the
    # hidden state 16-byte aligned and not (each its own specialisation).
    e, h, f, k, t = 8, 128, 192, 2, 2
    w_gate_up = torch.empty(e, f // 64, h // 64, 2, 64, 64, dtype=torch.bfloat16)
    w_down = torch.empty(e, h // 64, f // 64, 64, 64, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    shifted = torch.empty(t * h + 1, dtype=torch.bfloat16)[1:].view(t, h)
    dims = tm.packed_dims(w_gate_up, w_down)
    for hidden in (torch.empty(t, h, dtype=torch.bfloat16), shifted):
        tm.tiled_moe_direct(hidden, ids, torch.rand(t, k), w_gate_up, w_down, dims)
    print(f"compiled {len(compiled)} kernels for sm_90 in {time.time() - t0:.0f} s into {cache_dir}")
    for name, consts, kernel in sorted(compiled.values(), key=lambda c: (c[0], str(c[1]))):
        if name.startswith(("_gate_up", "_down", "fused_moe")):
            print(f"  {name} {consts}: {_resource_usage(kernel)}")
    return 1 if failures else 0


# ------------------------------------------------------------------ per-shape work


class Problem:
    def __init__(self, name, shape, dtype=torch.bfloat16, layouts=("tiles64", "rows")):
        dev = DEV
        self.name = name
        self.E, self.H, self.F, self.k = shape["num_experts"], shape["hidden"], shape["ffn"], shape["top_k"]
        g = torch.Generator(dev).manual_seed(0)
        # HF 5.x storage: gate_up_proj [E, 2F, H] (gate rows, then up rows), down_proj [E, H, F].
        self.gate_up_proj = torch.randn(self.E, 2 * self.F, self.H, device=dev, dtype=dtype, generator=g)
        self.gate_up_proj *= self.H**-0.5
        self.down_proj = torch.randn(self.E, self.H, self.F, device=dev, dtype=dtype, generator=g)
        self.down_proj *= self.F**-0.5
        self.router = torch.randn(self.H, self.E, device=dev, dtype=torch.float32, generator=g)
        self.swiglu = shape.get("swiglu")  # gpt-oss: biases and the clamped SwiGLU
        self.expert_bytes = 3 * self.H * self.F * self.gate_up_proj.element_size()
        if self.swiglu is None:
            self.packed = {
                layout: pack_expert_weights(
                    gate_up_proj=self.gate_up_proj, down_proj=self.down_proj, layout=layout
                )
                for layout in layouts
            }
        else:
            self._init_gpt_oss(g, layouts)
        self.dims = {layout: tm.packed_dims(p.w_gate_up, p.w_down) for layout, p in self.packed.items()}

    def _init_gpt_oss(self, g, layouts):
        """GptOssExperts' storage of the same weights (gate_up_proj [E, H, 2F] with gate and up columns
        interleaved, down_proj [E, F, H]), random biases of its dtype, the module (or replicas) as peers."""
        alpha, limit, _ = self.swiglu
        dtype = self.gate_up_proj.dtype
        gate, up = self.gate_up_proj[:, : self.F], self.gate_up_proj[:, self.F :]
        self.hf_gate_up = torch.stack([gate, up], dim=2).reshape(self.E, 2 * self.F, self.H).transpose(1, 2)
        self.hf_gate_up = self.hf_gate_up.contiguous()
        self.hf_down = self.down_proj.transpose(1, 2).contiguous()
        self.gate_up_bias = torch.randn(self.E, 2 * self.F, device=DEV, generator=g).to(dtype) * 0.5
        self.down_bias = torch.randn(self.E, self.H, device=DEV, generator=g).to(dtype) * 0.5
        self.expert_bytes += (2 * self.F + self.H) * 4  # the packed fp32 biases
        tensors = (self.hf_gate_up, self.gate_up_bias, self.hf_down, self.down_bias)
        self.module = gpt_oss_module(self.E, self.H, self.F, self.k, alpha, limit, *tensors)
        if self.module is not None:
            from transformers.integrations.moe import grouped_mm_experts_forward

            self.packed = {layout: pack_expert_weights(self.module, layout=layout) for layout in layouts}
            self.hf_loop = self.module  # GptOssExperts' own eager loop
            self.grouped_mm = lambda x, ids, w: grouped_mm_experts_forward(self.module, x, ids, w)
        else:
            self.packed = {
                layout: pack_expert_weights(
                    gate_up_proj=self.hf_gate_up,
                    down_proj=self.hf_down,
                    is_transposed=True,
                    is_concatenated=False,
                    b1=self.gate_up_bias[:, 0::2],
                    b3=self.gate_up_bias[:, 1::2],
                    b2=self.down_bias,
                    gate_alpha=alpha,
                    clamp_limit=limit,
                    up_offset=1.0,
                    layout=layout,
                )
                for layout in layouts
            }
            self.hf_loop = lambda x, ids, w: gpt_oss_loop_moe(x, ids, w, *tensors, alpha, limit)
            self.grouped_mm = lambda x, ids, w: gpt_oss_grouped_mm_moe(x, ids, w, *tensors, alpha, limit)
        self.peers = "transformers GptOssExperts" if self.module is not None else "replicas (no transformers)"

    def op(self, x, ids, w, layout="tiles64"):
        """The public op on this problem's packed weights (biases and activation when gpt-oss)."""
        p = self.packed[layout]
        if p.is_plain_swiglu:
            return torch.ops.wmoe.tiled_moe(x, ids, w, p.w_gate_up, p.w_down)
        return torch.ops.wmoe.tiled_moe(x, ids, w, p.w_gate_up, p.w_down, False, *p.op_extra_args())

    def inputs(self, num_tokens, seed):
        g = torch.Generator(DEV).manual_seed(1000 + seed)
        x = torch.randn(num_tokens, self.H, device=DEV, dtype=torch.bfloat16, generator=g)
        logits = x.float() @ self.router
        probs = logits.softmax(-1)
        weights, ids = probs.topk(self.k, dim=-1)
        return x, ids, (weights / weights.sum(-1, keepdim=True)).contiguous()

    def reference(self, x, ids, weights):
        gate, up = self.gate_up_proj[:, : self.F], self.gate_up_proj[:, self.F :]
        if self.swiglu is None:
            return tm.moe_reference(x.float(), ids, weights, gate, up, self.down_proj)
        biases = dict(
            b_gate=self.gate_up_bias[:, 0::2], b_up=self.gate_up_bias[:, 1::2], b_down=self.down_bias
        )
        act = tm.swiglu(*self.swiglu)
        return tm.moe_reference(x.float(), ids, weights, gate, up, self.down_proj, **biases, act=act)


def timed_rotation(fn, sets):
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def cuda_graph_rotation(fn, sets):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for args in sets:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(*args)
        graphs.append(graph)
    cycle = itertools.cycle(graphs)
    return lambda: next(cycle).replay()


def sweep_shape(prob: Problem, tokens, failed, log):
    """Per T: time every candidate of each kernel alone. Returns {T: {(bm, 'up'|'down', cand): ms}}."""
    dims = prob.dims["tiles64"]
    packed = prob.packed["tiles64"]
    act = tm.swiglu(packed.gate_alpha, packed.clamp_limit, packed.up_offset)
    results = {}
    for t in tokens:
        sets = [prob.inputs(t, s) for s in range(ROTATE)]
        cands = candidates_for(tm.pairs_per_expert(t, prob.k, prob.E))
        res = {}
        for bm in cands["block_m"]:
            groupings = [moe_align.group_by_expert(ids, prob.E, bm) for _, ids, _ in sets]
            base = make_config(bm, cands["up"][0], cands["down"][0]).fitted(dims.ffn_pad, dims.hidden_pad)
            hs = [
                tm.launch_gate_up(x, packed.w_gate_up, gr, dims, prob.k, base, packed.b_gate_up, act)
                for (x, _, _), gr in zip(sets, groupings, strict=True)
            ]
            outs = [torch.zeros(t, prob.H, device=DEV) for _ in sets]
            flat_w = [w.reshape(-1) for _, _, w in sets]
            for up in cands["up"]:
                cfg = make_config(bm, up, cands["down"][0]).fitted(dims.ffn_pad, dims.hidden_pad)
                if any(cfg == c for c, _ in failed):
                    continue
                args = [(x, gr) for (x, _, _), gr in zip(sets, groupings, strict=True)]
                fn = timed_rotation(
                    lambda x, gr, cfg=cfg: tm.launch_gate_up(
                        x, packed.w_gate_up, gr, dims, prob.k, cfg, packed.b_gate_up, act
                    ),
                    args,
                )
                try:
                    res[(bm, "up", up)] = bench_ms(fn, warmup=10, rep=40)
                except Exception as exc:  # noqa: BLE001
                    log(f"  sweep {prob.name} T={t} bm={bm} up={up}: {type(exc).__name__} {str(exc)[:200]}")
            for down in cands["down"]:
                cfg = make_config(bm, cands["up"][0], down).fitted(dims.ffn_pad, dims.hidden_pad)
                if any(cfg == c for c, _ in failed):
                    continue
                args = list(zip(hs, outs, flat_w, groupings, strict=True))
                fn = timed_rotation(
                    lambda h, o, w, gr, cfg=cfg: tm.launch_down(
                        h, packed.w_down, o, w, gr, dims, prob.k, cfg, packed.b_down
                    ),
                    args,
                )
                try:
                    res[(bm, "down", down)] = bench_ms(fn, warmup=10, rep=40)
                except Exception as exc:  # noqa: BLE001
                    msg = f"{type(exc).__name__} {str(exc)[:200]}"
                    log(f"  sweep {prob.name} T={t} bm={bm} down={down}: {msg}")
        results[t] = res
        best_up = min((v, k) for k, v in res.items() if k[1] == "up")
        best_down = min((v, k) for k, v in res.items() if k[1] == "down")
        log(
            f"  sweep {prob.name} T={t}: best gate_up {best_up[1]} {best_up[0] * 1e3:.1f} us, "
            f"best down {best_down[1]} {best_down[0] * 1e3:.1f} us"
        )
    return results


def choose_bucket_configs(prob: Problem, sweep: dict) -> dict:
    """Winners per CONFIG_TABLE bucket: minimise the summed ratio to each T's best time."""
    dims = prob.dims["tiles64"]
    by_bucket: dict[int, list[int]] = {}
    for t in sweep:
        m = tm.pairs_per_expert(t, prob.k, prob.E)
        by_bucket.setdefault(next(b for b in tm.BUCKETS if m <= b), []).append(t)
    chosen = {}
    for bucket, ts in by_bucket.items():
        bms = sorted({key[0] for t in ts for key in sweep[t]})

        def score(kind, bm, cand, ts=ts):
            total = 0.0
            for t in ts:
                best = min(v for k, v in sweep[t].items() if k[1] == kind)
                total += sweep[t].get((bm, kind, cand), math.inf) / best
            return total

        best = None
        for bm in bms:
            ups = {k[2] for t in ts for k in sweep[t] if k[0] == bm and k[1] == "up"}
            downs = {k[2] for t in ts for k in sweep[t] if k[0] == bm and k[1] == "down"}
            if not ups or not downs:
                continue
            up = min(ups, key=lambda c, bm=bm: score("up", bm, c))
            down = min(downs, key=lambda c, bm=bm: score("down", bm, c))
            total = sum(
                sweep[t].get((bm, "up", up), math.inf) + sweep[t].get((bm, "down", down), math.inf)
                for t in ts
            )
            if best is None or total < best[0]:
                best = (total, make_config(bm, up, down).fitted(dims.ffn_pad, dims.hidden_pad))
        if best:
            chosen[(tm.shape_class(dims.hidden_pad, dims.ffn_pad), bucket)] = best[1]
    return chosen


class _patched:
    """Set a module attribute for the duration of a with-block (graph capture, timing)."""

    def __init__(self, module, name, value):
        self.module, self.name, self.value = module, name, value

    def __enter__(self):
        self.saved = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.saved)


def decode_timings(row, prob, t, sets, ours, vllm_fn, log):
    """Decode T: ours and vLLM each as CUDA graph replays and as an eager host loop, one method (loop_ms).

    Also ours through the grouped path (grouping launch + GEMMs + zero-fill + cast) where the direct
    path applies, and ours eager with Triton's ordinary launches (FAST_LAUNCH off): what each saves.
    vLLM's token alignment is outside its timed call in both modes (its prepared tensors, as above).
    """
    paths = {"ours": (ours, ())}
    if t * prob.k <= tm.DIRECT_MAX_PAIRS:
        paths["ours_grouped"] = (ours, ((tm, "DIRECT_MAX_PAIRS", 0),))
        paths["ours_jit_launch"] = (ours, ((tm, "FAST_LAUNCH", False),))
    if vllm_fn is not None and math.isfinite(row.get("vllm_ms", float("nan"))):
        paths["vllm"] = (vllm_fn, ())
    for name, (fn, patches) in paths.items():
        modes = ("eager",) if name == "ours_jit_launch" else ("graph", "eager")
        for mode in modes:
            try:
                with contextlib.ExitStack() as stack:
                    for patch in patches:
                        stack.enter_context(_patched(*patch))
                    if name == "ours_jit_launch":
                        for launch in (tm._gate_up_direct_launches, tm._down_direct_launches):
                            launch.compiled.clear()
                    if mode == "graph" and DEV == "cuda":
                        step = cuda_graph_rotation(fn, sets)
                    else:
                        step = timed_rotation(fn, sets)
                    row[f"{name}_{mode}_loop_ms"] = loop_ms(step)
            except Exception as exc:  # noqa: BLE001
                log(f"  {prob.name} T={t} {name} {mode} loop failed: {type(exc).__name__}: {str(exc)[:200]}")


# Direct decode path (kernels/tiled_moe.py DIRECT_CONFIGS): candidates timed through the op, per shape
# class, at the decode T whose T k <= DIRECT_MAX_PAIRS. down: (down_n, down_k, warps, stages, flat)
# with gate_up kept (flat: one loop over (live expert, K block)); gate_up: (up_n, up_k, warps,
# stages) with down kept.
DIRECT_DOWN_CANDIDATES = (
    (16, 256, 4, 4, False),
    (16, 128, 4, 4, False),
    (16, 512, 4, 3, False),
    (32, 256, 4, 3, False),
    (32, 128, 4, 4, False),
    (64, 128, 4, 4, False),
    (16, 128, 4, 4, True),
    (16, 256, 4, 4, True),
    (16, 512, 4, 3, True),
    (32, 256, 4, 3, True),
)
DIRECT_UP_CANDIDATES = (
    (128, 128, 4, 3),
    (64, 256, 4, 3),
    (64, 128, 4, 4),
    (128, 64, 4, 4),
    # narrow column blocks: more programs where few experts' F columns leave SMs idle (gpt-oss-20b at
    # T = 1: 4 experts x 2880 / 64 = 180 programs, 1.4 waves of 132 SMs)
    (32, 128, 4, 4),
    (32, 64, 4, 4),
    (32, 64, 2, 4),
    (64, 64, 4, 4),
)


def direct_candidates(base: tm.DirectConfig) -> dict[str, list[tm.DirectConfig]]:
    """Candidates varying one kernel's fields each (the kernels are separate launches: times add)."""
    downs = [
        replace(base, down_n=n, down_k=k, down_warps=w, down_stages=st, down_flat=flat)
        for n, k, w, st, flat in DIRECT_DOWN_CANDIDATES
    ]
    ups = [replace(base, up_n=n, up_k=k, up_warps=w, up_stages=st) for n, k, w, st in DIRECT_UP_CANDIDATES]
    return {"down": list(dict.fromkeys([base, *downs])), "up": list(dict.fromkeys([base, *ups]))}


def sweep_direct(prob: Problem, tokens, log) -> dict:
    """Time the direct path's candidate configs (CUDA graph loop of the whole op); set the winner.

    Down candidates keep the table's gate_up and gate_up candidates its down; the winner combines the
    best of each (scored by the summed ratio to each T's best) and is timed once more.
    """
    dims = prob.dims["tiles64"]
    key = (dims.hidden_pad, dims.ffn_pad)  # swept at this shape's own dims (tm.direct_config)
    ts = [t for t in tokens if t * prob.k <= tm.DIRECT_MAX_PAIRS]
    if not ts:
        return {}
    sets = {t: [prob.inputs(t, s) for s in range(ROTATE)] for t in ts}

    def op(x, ids, w):
        return prob.op(x, ids, w)

    def time_config(cfg):
        tm.DIRECT_CONFIGS[key] = cfg
        tm._direct_plan.cache_clear()
        rotation = cuda_graph_rotation if DEV == "cuda" else timed_rotation
        return [loop_ms(rotation(op, sets[t])) for t in ts]

    original = tm.direct_config(*key).fitted(dims.ffn_pad, dims.hidden_pad)
    results, winners = {}, {}
    for kind, cands in direct_candidates(original).items():
        # as they run: block sizes that do not divide the dims shrink (2880 takes 64-wide K tiles)
        cands = list(dict.fromkeys(c.fitted(dims.ffn_pad, dims.hidden_pad) for c in cands))
        for cfg in cands:
            try:
                if cfg not in results:
                    results[cfg] = time_config(cfg)
            except Exception as exc:  # noqa: BLE001
                log(f"  direct sweep {prob.name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}")
        timed = [c for c in cands if c in results]
        if timed:
            best = [min(results[c][i] for c in timed) for i in range(len(ts))]
            winners[kind] = min(timed, key=lambda c: sum(results[c][i] / best[i] for i in range(len(ts))))
    chosen = original
    if "up" in winners:
        up = winners["up"]
        chosen = replace(chosen, up_n=up.up_n, up_k=up.up_k, up_warps=up.up_warps, up_stages=up.up_stages)
    if "down" in winners:
        down = winners["down"]
        chosen = replace(
            chosen,
            down_n=down.down_n,
            down_k=down.down_k,
            down_warps=down.down_warps,
            down_stages=down.down_stages,
            down_flat=down.down_flat,
        )
    try:
        if chosen not in results:
            results[chosen] = time_config(chosen)
    except Exception as exc:  # noqa: BLE001
        msg = f"{type(exc).__name__}: {str(exc)[:200]}"
        log(f"  direct sweep {prob.name} chosen {chosen}: {msg}; keeping the table's")
        chosen = original
    tm.DIRECT_CONFIGS[key] = chosen
    tm._direct_plan.cache_clear()
    for cfg, ms in sorted(results.items(), key=lambda kv: sum(kv[1])):
        log(f"  direct sweep {prob.name} T={ts}: {cfg} {[round(m * 1e3, 1) for m in ms]} us")
    log(f"  direct sweep {prob.name}: chose {chosen} (table had {original})")
    return dict(
        dims=list(key),
        T=ts,
        results={str(c): v for c, v in results.items()},
        chosen=str(chosen),
        table=str(original),
    )


def bench_shape(prob: Problem, tokens, bw, flops_rate, vllm, configs, log, layouts):
    rows = []
    if prob.swiglu is None:
        gate_up_t = prob.gate_up_proj.transpose(1, 2)  # [E, H, 2F] view, as HF passes it
        down_t = prob.down_proj.transpose(1, 2)  # [E, F, H]
        try:
            grouped_mm_moe(*prob.inputs(4, 0), gate_up_t, down_t)
        except RuntimeError as exc:
            log(f"  grouped_mm on transposed views failed ({str(exc)[:120]}); using contiguous copies")
            gate_up_t, down_t = gate_up_t.contiguous(), down_t.contiguous()
        hf_loop = lambda x, ids, w: hf_loop_moe(x, ids, w, prob.gate_up_proj, prob.down_proj)  # noqa: E731
        grouped_mm = lambda x, ids, w: grouped_mm_moe(x, ids, w, gate_up_t, down_t)  # noqa: E731
    else:  # gpt-oss: biases and the clamped SwiGLU; vLLM's copy here has neither
        hf_loop, grouped_mm = prob.hf_loop, prob.grouped_mm
        log(f"  {prob.name}: peers are {prob.peers}; vLLM skipped (no expert biases / clamped SwiGLU)")
        vllm = None
    for t in tokens:
        sets = [prob.inputs(t, s) for s in range(ROTATE)]
        hit = sum(len(torch.unique(ids)) for _, ids, _ in sets) / len(sets)
        weight_bytes = hit * prob.expert_bytes
        floor_bytes_ms = weight_bytes / bw * 1e3
        floor_flops_ms = 2 * t * prob.k * prob.expert_bytes / 2 / flops_rate * 1e3
        row = dict(
            shape=prob.name,
            T=t,
            experts_hit=hit,
            weight_MB=weight_bytes / 1e6,
            floor_bytes_ms=floor_bytes_ms,
            floor_flops_ms=floor_flops_ms,
        )
        m = tm.pairs_per_expert(t, prob.k, prob.E)
        dims = prob.dims["tiles64"]
        key = (tm.shape_class(dims.hidden_pad, dims.ffn_pad), next(b for b in tm.BUCKETS if m <= b))
        cfg = configs.get(key) or tm.lookup_config(t, prob.k, prob.E, dims.hidden_pad, dims.ffn_pad)
        row["config"] = str(cfg)

        # Through the public op (its host-side checks and dispatch included); the config comes from
        # CONFIG_TABLE, which holds this run's sweep winners when --sweep ran.
        tm.CONFIG_TABLE[key] = cfg

        def ours(x, ids, w, layout="tiles64"):
            return prob.op(x, ids, w, layout)

        x0, ids0, w0 = sets[0]
        with torch.no_grad():
            ref = prob.reference(x0, ids0, w0) if t <= 1024 else hf_loop(x0, ids0, w0)
        row["ref"] = "fp32 loop" if t <= 1024 else "bf16 HF loop"
        methods = {"ours": ours, "hf_loop": hf_loop, "grouped_mm": grouped_mm}
        for layout in layouts:
            if layout != "tiles64":
                methods[f"ours_{layout}"] = lambda x, ids, w, layout=layout: ours(x, ids, w, layout)
        if vllm is not None:
            try:  # token alignment + config lookup, not timed (vLLM runs them in CUDA ops)
                prepared = {
                    id(ids): vllm.prepare(ids, prob.gate_up_proj, prob.down_proj) for _, ids, _ in sets
                }
                row["vllm_config"] = prepared[id(ids0)][0]
            except Exception as exc:  # noqa: BLE001
                prepared = {}
                log(f"  vLLM prepare failed: {type(exc).__name__}: {str(exc)[:200]}")
            methods["vllm"] = lambda x, ids, w, prepared=prepared: vllm.fused_experts(
                x, prob.gate_up_proj, prob.down_proj, w, ids, prepared[id(ids)]
            )
        for name, fn in methods.items():
            try:
                with torch.no_grad():  # (the gpt-oss peers are nn.Parameters' modules)
                    row[f"{name}_err"] = rel_err(fn(x0, ids0, w0), ref)
                    row[f"{name}_ms"] = bench_ms(timed_rotation(fn, sets))
            except Exception as exc:  # noqa: BLE001
                row[f"{name}_ms"] = float("nan")
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"  {prob.name} T={t} {name} failed: {row[f'{name}_error']}")
        if t <= DECODE_MAX_TOKENS:
            decode_timings(row, prob, t, sets, ours, methods.get("vllm"), log)
        row["ours_TBps"] = weight_bytes / row["ours_ms"] / 1e9
        row["ours_x_floor"] = row["ours_ms"] / floor_bytes_ms
        row["ours_x_roofline"] = row["ours_ms"] / max(floor_bytes_ms, floor_flops_ms)
        for peer in ("hf_loop", "grouped_mm", "vllm"):
            if f"{peer}_ms" in row:
                row[f"speedup_vs_{peer}"] = row[f"{peer}_ms"] / row["ours_ms"]
        log(
            f"  {prob.name} T={t}: ours {row['ours_ms']:.3f} ms ({row['ours_x_floor']:.2f}x floor, "
            f"err {row['ours_err']:.1e}), hf {row['hf_loop_ms']:.3f}, grouped_mm {row['grouped_mm_ms']:.3f}, "
            f"vllm {row.get('vllm_ms', float('nan')):.3f}"
            + "".join(f", {k} {v:.3f}" for k, v in row.items() if k.startswith("ours_") and k.endswith("_ms"))
        )
        rows.append(row)
    return rows


def random_ids(num_tokens: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Distinct experts per token (top-k of random scores), int64 as torch.topk returns them."""
    return torch.rand(num_tokens, num_experts, device=DEV).topk(top_k, dim=-1).indices


def synchronises(fn) -> bool:
    """Whether fn makes a host synchronisation (torch's sync debug mode raises on one)."""
    if DEV != "cuda":
        return False
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(0)


def bench_grouping(log) -> list[dict]:
    """Time the grouping routes of moe_align alone at the benchmark's pair counts above 4096."""
    rows = []
    for t, k, e in GROUPING_CASES:
        sets = [random_ids(t, k, e) for _ in range(ROTATE)]
        block_m = 128
        routes = {
            "torch": moe_align.group_by_expert_torch,
            "blocked": moe_align.group_by_expert_blocked,
        }
        if t * k <= SINGLE_LAUNCH_TIMED_UP_TO:
            routes["single"] = moe_align.group_by_expert_triton
        row = dict(T=t, k=k, E=e, pairs=t * k)
        ref = moe_align.group_by_expert_torch(sets[0], e, block_m)
        for name, route in routes.items():
            got = route(sets[0], e, block_m)
            row[f"{name}_equal"] = bool(
                torch.equal(got.sorted_pairs, ref.sorted_pairs) and torch.equal(got.tiles, ref.tiles)
            )
            args = [(ids, e, block_m) for ids in sets]
            row[f"{name}_syncs"] = synchronises(lambda route=route, args=args: route(*args[1]))
            row[f"{name}_us"] = 1e3 * bench_ms(timed_rotation(route, args))
        log(f"  grouping {row}")
        rows.append(row)
    return rows


def grouping_markdown(rows) -> str:
    lines = [
        "| T | k | E | pairs | torch route us (syncs?) | single-launch us | blocked us | blocked == torch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        single = f"{r['single_us']:.1f}" if "single_us" in r else "-"
        lines.append(
            f"| {r['T']} | {r['k']} | {r['E']} | {r['pairs']} | {r['torch_us']:.1f} "
            f"({'yes' if r['torch_syncs'] else 'no'}) | {single} | {r['blocked_us']:.1f} "
            f"| {'yes' if r['blocked_equal'] else 'NO'} |"
        )
    return "\n".join(lines)


def markdown(rows, has_vllm, layouts) -> str:
    head = (
        "| shape | T | experts hit | weight MB | floor ms (bytes / flops) | ours ms | TB/s | x floor "
        "| HF loop ms | grouped_mm ms |"
        + (" vLLM ms |" if has_vllm else "")
        + "".join(f" ours {layout} ms |" for layout in layouts if layout != "tiles64")
        + " vs HF loop | vs grouped_mm |"
        + (" vs vLLM |" if has_vllm else "")
        + " rel err |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [
            r["shape"],
            str(r["T"]),
            f"{r['experts_hit']:.2f}",
            f"{r['weight_MB']:.0f}",
            f"{r['floor_bytes_ms']:.3f} / {r['floor_flops_ms']:.3f}",
            f"{r['ours_ms']:.3f}",
            f"{r['ours_TBps']:.2f}",
            f"{r['ours_x_floor']:.2f}",
            f"{r['hf_loop_ms']:.3f}",
            f"{r['grouped_mm_ms']:.3f}",
        ]
        if has_vllm:
            cells.append(f"{r.get('vllm_ms', float('nan')):.3f}")
        cells += [
            f"{r.get(f'ours_{layout}_ms', float('nan')):.3f}" for layout in layouts if layout != "tiles64"
        ]
        cells += [f"{r['speedup_vs_hf_loop']:.2f}x", f"{r['speedup_vs_grouped_mm']:.2f}x"]
        if has_vllm:
            cells.append(f"{r.get('speedup_vs_vllm', float('nan')):.2f}x")
        cells.append(f"{r['ours_err']:.1e}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


DECODE_COLUMNS = (
    ("ours graph", "ours_graph_loop_ms"),
    ("ours eager", "ours_eager_loop_ms"),
    ("vLLM graph", "vllm_graph_loop_ms"),
    ("vLLM eager", "vllm_eager_loop_ms"),
    ("ours grouped graph", "ours_grouped_graph_loop_ms"),
    ("ours grouped eager", "ours_grouped_eager_loop_ms"),
    ("ours eager, Triton JIT launches", "ours_jit_launch_eager_loop_ms"),
)


def decode_markdown(rows) -> str:
    """Decode T: every path timed by loop_ms, as CUDA graph replays and as an eager host loop."""
    head = "| shape | T | floor ms | " + " | ".join(f"{c} ms" for c, _ in DECODE_COLUMNS)
    head += " | ours eager x floor | vs vLLM graph | vs vLLM eager |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def cell(r, key):
        return f"{r[key]:.3f}" if key in r and math.isfinite(r[key]) else ""

    def ratio(r, num, den):
        ok = num in r and den in r and math.isfinite(r[num]) and math.isfinite(r[den])
        return f"{r[num] / r[den]:.2f}x" if ok else ""

    for r in rows:
        if "ours_eager_loop_ms" not in r:
            continue
        cells = [r["shape"], str(r["T"]), f"{r['floor_bytes_ms']:.3f}"]
        cells += [cell(r, key) for _, key in DECODE_COLUMNS]
        cells.append(f"{r['ours_eager_loop_ms'] / r['floor_bytes_ms']:.2f}")
        cells.append(ratio(r, "vllm_graph_loop_ms", "ours_graph_loop_ms"))
        cells.append(ratio(r, "vllm_eager_loop_ms", "ours_eager_loop_ms"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def measure_ceilings() -> tuple[float, float]:
    """Device-to-device copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s)."""
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() / (bench_ms(lambda: dst.copy_(src)) * 1e-3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    flops_rate = 2 * 8192**3 / (bench_ms(lambda: a @ a) * 1e-3)
    return bw, flops_rate


def main() -> int:
    global DEV, SHAPES, GROUPING_CASES
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--sweep", action="store_true", help="tune launch configs per bucket first")
    parser.add_argument("--sweep-tokens", nargs="*", type=int, default=list(SWEEP_TOKENS))
    parser.add_argument("--no-grouping", action="store_true", help="skip the grouping-route comparison")
    parser.add_argument("--prewarm-offline", metavar="CACHE_DIR", help="compile for sm_90 without a GPU")
    parser.add_argument("--triton-key-of", metavar="TRITON_DIR", help="with --prewarm-offline: see above")
    parser.add_argument("--precompile", action="store_true", help="compile all configs in worker processes")
    parser.add_argument("--precompile-only", action="store_true")
    parser.add_argument("--workers", type=int, default=14)
    parser.add_argument(
        "--shapes", nargs="*", default=list(DEFAULT_SHAPES), choices=list(SHAPES), help="default: %(default)s"
    )
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    parser.add_argument("--layouts", nargs="*", default=list(tm.LAYOUTS))
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--no-direct-sweep", action="store_true", help="keep DIRECT_CONFIGS (no direct-path config sweep)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1 check of this script")
    args = parser.parse_args()
    shapes = {k: SHAPES[k] for k in args.shapes}
    if args.prewarm_offline:
        return prewarm_offline(
            args.prewarm_offline, shapes, args.tokens, set(args.sweep_tokens), args.triton_key_of
        )
    if args.smoke:
        DEV = "cpu"
        GROUPING_CASES = ((700, 8, 16),)
        SHAPES = {
            "mixtral": dict(num_experts=8, hidden=128, ffn=192, top_k=2),
            "fine": dict(num_experts=16, hidden=64, ffn=64, top_k=4),
            "gpt-oss": dict(num_experts=8, hidden=80, ffn=72, top_k=4, swiglu=GPT_OSS_SWIGLU),
        }
    elif not torch.cuda.is_available():
        print("bench_moe: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    shapes = {k: SHAPES[k] for k in args.shapes}
    sweep_tokens = [t for t in args.tokens if t in args.sweep_tokens]
    failed = {}
    if args.precompile or args.precompile_only:
        failed = precompile(all_tasks(shapes, args.tokens, sweep_tokens if args.sweep else []), args.workers)
        if args.precompile_only:
            return 0

    info = dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)",
        torch=torch.__version__,
        triton=triton.__version__,
        command=" ".join(sys.argv),
    )
    # Ceilings measured in this run.
    bw, flops_rate = measure_ceilings() if DEV == "cuda" else (4.25e12, 686e12)
    info.update(copy_TBps=bw / 1e12, bf16_TFLOPs=flops_rate / 1e12)
    log(f"{info}")

    vllm = None if args.no_vllm else load_vllm()
    log(f"vLLM fused_moe peer: {'present' if vllm else 'absent'}")
    all_rows, chosen_all, sweeps, grouping_rows, direct_sweeps = [], {}, {}, [], {}

    def save():  # after every part, so a run cut short still leaves its numbers
        result = dict(
            info=info,
            grouping=grouping_rows,
            rows=all_rows,
            sweep=sweeps,
            chosen={str(k): str(v) for k, v in chosen_all.items()},
            direct_sweep=direct_sweeps,
            direct_configs={str(k): str(v) for k, v in tm.DIRECT_CONFIGS.items()},
        )
        (out / "bench_moe.json").write_text(json.dumps(result, indent=1, default=str))
        text = markdown(all_rows, vllm is not None, args.layouts) if all_rows else ""
        if any("ours_eager_loop_ms" in r for r in all_rows):
            text += "\n\nDecode, one method for every path (loop_ms):\n\n" + decode_markdown(all_rows)
        if grouping_rows:
            text += "\n\nGrouping routes alone:\n\n" + grouping_markdown(grouping_rows)
        (out / "bench_moe.md").write_text(text + "\n")
        (out / "bench_moe.log").write_text("\n".join(log_lines) + "\n")

    if not args.no_grouping:
        try:
            grouping_rows = bench_grouping(log)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
        save()
    for name, shape in shapes.items():
        t0 = time.time()
        prob = Problem(name, shape, layouts=tuple(args.layouts))
        chosen = {}
        if not args.no_direct_sweep:
            try:
                direct_sweeps[name] = sweep_direct(prob, args.tokens, log)
            except Exception:  # noqa: BLE001
                log(traceback.format_exc())
        if args.sweep:
            try:
                sweep = sweep_shape(prob, sweep_tokens, failed, log)
                sweeps[name] = {str(t): {str(k): v for k, v in r.items()} for t, r in sweep.items()}
                chosen = choose_bucket_configs(prob, sweep)
                chosen_all.update(chosen)
            except Exception:  # noqa: BLE001
                log(traceback.format_exc())
        try:
            all_rows += bench_shape(prob, args.tokens, bw, flops_rate, vllm, chosen, log, args.layouts)
        except Exception:  # noqa: BLE001
            log(traceback.format_exc())
        log(f"{name}: {time.time() - t0:.0f} s")
        save()
        del prob
        if DEV == "cuda":
            torch.cuda.empty_cache()

    table = markdown(all_rows, vllm is not None, args.layouts)
    save()
    if chosen_all:
        print("\nCONFIG_TABLE entries from this sweep:")
        for key, cfg in sorted(chosen_all.items(), key=str):
            fields = [getattr(cfg, f) for f in tm.MoEConfig.__dataclass_fields__]
            print(f"    {key!r}: _cfg({', '.join(map(str, fields))}),")
    print()
    print(
        f"{info['date']}  {info['gpu']}  torch {info['torch']}  triton {info['triton']}  "
        f"copy {info['copy_TBps']:.2f} TB/s  bf16 {info['bf16_TFLOPs']:.0f} TFLOP/s"
    )
    print(table)
    print()
    print(decode_markdown(all_rows))
    if direct_sweeps:
        print("\nDIRECT_CONFIGS after the direct sweep:")
        for key, cfg in tm.DIRECT_CONFIGS.items():
            print(f"    {key!r}: {cfg},")
    if grouping_rows:
        print(grouping_markdown(grouping_rows))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
