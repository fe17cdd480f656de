"""torch.library ops in the `wmoe` namespace.

Each op module registers a schema, a fake (meta) implementation, a pure-PyTorch reference and,
on CUDA, a Triton implementation. Importing this package registers all of them.
"""
