"""Launch a @triton.jit kernel again without JITFunction.run's per-call work.

Why: ``kernel[grid](*args, **constexprs)`` goes through JITFunction.run on every call, which binds
and specialises every argument, builds a cache key from the specialisation and the options, and
checks the kernel's globals. On the H200 machine's host that measured 20-155 us per launch for this
project's kernels (the attention split kernel 84-125 us, the KV-compress kernel 108-155 us; 16
launches per uncaptured two-layer decode step: 1.4 of its 5.4 ms). ``launch`` keeps the
CompiledKernel that the first ordinary launch of a specialisation returned and launches it through
``CompiledKernel[grid]`` afterwards.

The cache key is stricter than Triton's own specialisation, so a hit never runs a kernel compiled
for other arguments: every tensor's dtype and 16-byte alignment, every int's exact value (Triton
specialises ints on == 1 and % 16), a float's type (runtime fp32, never specialised), every
keyword (constexprs and launch options) and the current device. Off under the interpreter, where
nothing is compiled, and for kernels whose runtime parameters do not all precede their constexprs.

A kernel that declares a ``CARVEOUT`` constexpr gets, when launched with CARVEOUT >= 0, that
preferred shared-memory carveout (percent of the SM's most shared memory) set on the compiled
function it was launched with (``set_preferred_carveout``). Triton sets none, so the driver picks one
per kernel, and an SM running one kernel's programs takes no program of a kernel with another
carveout until it drains (nineteenth session: the attention's exact-token kernel waited that way
for the split kernel). The constexpr makes each carveout its own compiled variant: the attribute
belongs to the compiled function, not to one launch.
"""

from __future__ import annotations

import ctypes
import inspect
import os
from dataclasses import dataclass, field

import torch

ENABLED = True
MAX_ENTRIES_PER_KERNEL = 64  # ints that change every call would otherwise grow the cache forever
# Every kernel here was written, tuned and measured with fused multiply-adds, Triton's default
# through 3.9 (3.9 warns that 3.10 turns the default off; TRITON_DEFAULT_FP_FUSION changes it):
# asked for explicitly, so that neither changes their code. TRITON_FORCE_DISABLE_FP_FUSION still wins.
COMPILE_OPTIONS = {"enable_fp_fusion": True}


@dataclass
class _KernelInfo:
    n_runtime: int  # parameters before the constexprs
    constexpr_names: tuple[str, ...]
    defaults: dict
    supported: bool
    compiled: dict = field(default_factory=dict)  # key -> (CompiledKernel, constexpr values in order)


_INFO: dict[int, _KernelInfo] = {}


def kernel_info(kernel) -> _KernelInfo:
    """Parameter layout of a @triton.jit kernel (JITFunction or the interpreter's wrapper): the
    constexprs are the parameters annotated ``tl.constexpr``."""
    info = _INFO.get(id(kernel))
    if info is None:
        params = list(inspect.signature(kernel.fn).parameters.values())
        flags = ["constexpr" in str(p.annotation) for p in params]
        n_runtime = flags.index(True) if True in flags else len(flags)
        info = _KernelInfo(
            n_runtime=n_runtime,
            constexpr_names=tuple(p.name for p in params[n_runtime:]),
            defaults={
                p.name: p.default for p in params[n_runtime:] if p.default is not inspect.Parameter.empty
            },
            supported=all(flags[n_runtime:]),
        )
        _INFO[id(kernel)] = info
    return info


def interpreting() -> bool:
    """Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1): nothing is compiled."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def argument_key(args: tuple) -> tuple:
    """What a compiled kernel depends on in its runtime arguments (see the module docstring): a
    tensor descriptor by its dtype, block shape and layout (its shape and strides are runtime)."""
    return tuple(
        [
            (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, torch.Tensor)
            else (
                ("tensordesc", a.base.dtype, tuple(a.block_shape), repr(a.layout))
                if _is_tensor_descriptor(a)
                else (float if isinstance(a, float) else a)
            )
            for a in args
        ]
    )


def _is_tensor_descriptor(a) -> bool:
    """A Triton host tensor descriptor (Gluon's or Triton's), by shape rather than import."""
    return hasattr(a, "block_shape") and hasattr(a, "base") and hasattr(a, "layout")


_CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
_LIBCUDA: list = []


def set_preferred_carveout(compiled, percent: int) -> None:
    """cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, percent) on a launched CompiledKernel's
    function: every later launch of it asks the driver for that split of L1 and shared memory."""
    if not 0 <= percent <= 100:
        raise ValueError(f"a shared-memory carveout is a percent from 0 to 100, got {percent}")
    function = getattr(compiled, "function", None)
    if function is None:
        raise RuntimeError("the compiled kernel has no loaded function yet: launch it once first")
    if not _LIBCUDA:
        try:
            _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
        except OSError as exc:
            raise RuntimeError(
                f"setting a shared-memory carveout needs the CUDA driver library: {exc}"
            ) from exc
    status = _LIBCUDA[0].cuFuncSetAttribute(
        ctypes.c_void_p(function), _CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, int(percent)
    )
    if status != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred carveout {percent}%) failed: CUresult {status}")


def _carveout(compiled, kwargs: dict) -> None:
    """The preferred carveout a kernel's CARVEOUT constexpr asks for, on its freshly compiled function."""
    percent = kwargs.get("CARVEOUT", -1)
    if percent >= 0 and compiled is not None:
        set_preferred_carveout(compiled, percent)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: runtime arguments positional, constexprs and launch options
    (num_warps, num_stages, maxnreg) as keywords. Reuses the compiled kernel after the first call.
    A CARVEOUT constexpr >= 0 is set on the compiled function after its first launch (see above).
    COMPILE_OPTIONS apply unless the call gives its own."""
    kwargs = {**COMPILE_OPTIONS, **kwargs}
    if interpreting():
        kernel[grid](*args, **kwargs)
        return
    if not ENABLED:
        _carveout(kernel[grid](*args, **kwargs), kwargs)
        return
    info = kernel_info(kernel)
    if not info.supported or len(args) != info.n_runtime:
        _carveout(kernel[grid](*args, **kwargs), kwargs)
        return
    try:
        key = (argument_key(args), tuple(kwargs.items()), torch.cuda.current_device())
        hit = info.compiled.get(key)
    except TypeError:  # an unhashable keyword value: the ordinary path
        kernel[grid](*args, **kwargs)
        return
    if hit is not None:
        compiled, tail = hit
        # JITFunction.run pads the grid to three dimensions; CompiledKernel[grid] does not
        compiled[(*grid, 1, 1)[:3]](*args, *tail)
        return
    compiled = kernel[grid](*args, **kwargs)
    _carveout(compiled, kwargs)
    if hasattr(compiled, "packed_metadata") and len(info.compiled) < MAX_ENTRIES_PER_KERNEL:
        missing = [n for n in info.constexpr_names if n not in kwargs and n not in info.defaults]
        if not missing:
            tail = tuple(kwargs[n] if n in kwargs else info.defaults[n] for n in info.constexpr_names)
            info.compiled[key] = (compiled, tail)


def clear() -> None:
    """Forget every kept compiled kernel (tests; a changed Triton cache)."""
    for info in _INFO.values():
        info.compiled.clear()
