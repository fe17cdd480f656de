"""Kernels (installed as wmoe_compile.kernels): a PyTorch reference and a Triton implementation
side by side, one concern per file. Kernels know nothing of FX.
"""
