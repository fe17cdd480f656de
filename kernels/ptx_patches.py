"""Instruction qualifiers Triton cannot express, added to a kernel's PTX after Triton writes it.

Why: the L2 prefetch-size hint (`.L2::256B`: a miss fills the whole 256-byte block, so the
neighbouring requests find it in L2) gained 4% on the v3 split kernel's key loads, which are inline
asm. Its value tiles arrive by `cp.async`, which Triton emits itself with no way to add the hint, and
Gluon gives inline asm no shared-memory address to issue the copies itself. So a kernel opts in by
emitting a marker (`marker_asm(name)`, one `mov` in inline asm), and a Triton stages hook rewrites
the PTX of every kernel that carries the marker, and no other.

The hook is installed on first need (`install()`: the attention launcher calls it before it
launches a kernel with a marker, so processes that never ask for a patch get no hook) and chains
any hook installed before it. The marker's kernel is compiled with the flag that emits it as a
constexpr, so its cache entry differs from the unpatched kernel's; on Triton versions whose cache
key takes the hook's key (3.9), the hook adds its version to every kernel's key compiled after it.
A marked kernel compiled without the hook (launched directly, not through the launcher) simply
lacks the qualifiers: the patches change no result.
"""

from __future__ import annotations

import re
from collections.abc import Callable

MARKER = "wmoe-ptx-patch:"
VERSION = "wmoe-ptx-patches-1"

# name -> (pattern, replacement) applied to the whole PTX of a kernel that carries the marker
PATCHES: dict[str, tuple[re.Pattern, str]] = {
    # 16-byte cp.async copies through L1 (Triton emits every 16-byte copy as .cg, L2 only, cache
    # modifier or not; PTX allows .ca for 4, 8 and 16 bytes): for tiles whose rows share sectors
    # with rows other copies ask for, which L1 then serves (listed before cp_async_l2_256b, whose
    # hint then lands on the .ca copy)
    "cp_async_ca": (
        re.compile(r"\bcp\.async\.cg\.shared(::cta)?\.global(?=[\s.])"),
        r"cp.async.ca.shared\1.global",
    ),
    # cp.async copies (either cache level) ask L2 for 256-byte blocks on a miss
    "cp_async_l2_256b": (
        re.compile(r"\b(cp\.async\.c[ag]\.shared(?:::cta)?\.global)(?=\s)"),
        r"\1.L2::256B",
    ),
    # every CTA barrier Triton emits becomes a warp barrier: for a kernel whose warps share nothing
    # but what it exchanges behind named barriers of its own (kernels/wavelet_attention_cta.py)
    "warp_barriers": (re.compile(r"\bbar\.sync\s+0;"), "bar.warp.sync -1;"),
    # every generic-to-async proxy fence goes (the whole line): for a kernel whose only async-proxy
    # writes are TMA copies into ring stages last read by ldmatrix, whose results the kernel had
    # consumed before it issues the copy, so the reads are complete, as in CUTLASS's TMA pipelines,
    # which release a stage without a proxy fence. Triton puts one before each copy it cannot prove
    # free of such a read (fence.proxy.async: MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S in the SASS)
    "no_async_proxy_fences": (re.compile(r"^[ \t]*fence\.proxy\.async\.shared::cta;[ \t]*\n", re.M), ""),
    # plain global loads (no cache or eviction qualifier yet) ask the same
    "ld_global_l2_256b": (
        re.compile(r"\bld\.global\.((?:v[248]\.)?[bfsu](?:8|16|32|64))(?=\s)"),
        r"ld.global.L2::256B.\1",
    ),
}


def marker_asm(name: str) -> str:
    """Inline asm (one output, no inputs) that marks its kernel for patch `name`."""
    if name not in PATCHES:
        raise ValueError(f"unknown PTX patch {name!r}; known: {sorted(PATCHES)}")
    return f"mov.u32 $0, 0; // {MARKER} {name}"


def patch_ptx(ptx: str) -> str:
    """Apply every patch whose marker the PTX carries; other PTX comes back unchanged.

    Raises ValueError when a marker names no known patch, or a patch matches nothing (the
    instructions it targets are gone, so the kernel would silently run without it)."""
    names = re.findall(re.escape(MARKER) + r"\s*(\w+)", ptx)
    for name in dict.fromkeys(names):
        if name not in PATCHES:
            raise ValueError(f"PTX marker names an unknown patch {name!r}; known: {sorted(PATCHES)}")
        pattern, replacement = PATCHES[name]
        ptx, count = pattern.subn(replacement, ptx)
        if count == 0:
            raise ValueError(
                f"PTX patch {name!r}: the kernel carries its marker but has no instruction it applies to"
            )
    return ptx


_installed = False


def install() -> bool:
    """Install the stages hook that patches marked kernels' PTX (idempotent). False where this
    Triton has no stages hook: marked kernels then compile unpatched (the hints change no result)."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        return False
    previous: Callable | None = knobs.runtime.add_stages_inspection_hook

    def hook(*args):
        if not args:  # Triton 3.9+: the key this hook adds to the kernel's cache key
            key, digest = previous() if previous is not None else ("", "")
            return key + VERSION, f"{digest}{VERSION}"
        if previous is not None:
            previous(*args)
        stages = args[1]
        if "ptx" in stages:
            make_ptx = stages["ptx"]
            stages["ptx"] = lambda src, metadata: patch_ptx(make_ptx(src, metadata))

    knobs.runtime.add_stages_inspection_hook = hook
    _installed = True
    return True
