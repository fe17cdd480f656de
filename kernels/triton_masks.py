"""Mask helpers shared by the Triton kernels (imported only where Triton is installed)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mask_and(mask, flag):
    """mask & flag for a tensor mask and a scalar flag, as a boolean tensor (Triton 3.9's
    interpreter widens `tensor & scalar` to int64, which it then refuses as a load/store mask)."""
    return (mask.to(tl.int32) * flag.to(tl.int32)) != 0
