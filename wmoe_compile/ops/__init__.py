"""torch.library ops in the `wmoe` namespace.

Each op module registers a schema, a fake (meta) implementation, a pure-PyTorch reference and,
on CUDA, a Triton implementation. Importing this package registers all of them.
"""

from . import (
    attention,  # noqa: F401  (wmoe::wavelet_attention)
    kv_codec,  # noqa: F401  (wmoe::kv_compress, kv_decompress, kv_compress_into_cache)
    moe,  # noqa: F401  (wmoe::tiled_moe)
)
