"""FX passes (installed as wmoe_compile.passes): one pass per file, named verb_object.

Passes know the op contracts in wmoe_compile.ops, never kernel code.
"""
