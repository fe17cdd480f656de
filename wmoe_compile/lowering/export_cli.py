"""`wmoe-compile export`: capture, rewrite and write a model as .pt2, ONNX or TensorRT.

    wmoe-compile export --model tiny --format pt2 --out build/tiny.pt2
    wmoe-compile export --model tiny --format onnx --out build/tiny.onnx
    wmoe-compile export --model tiny --format onnx-plugin --out build/tiny_plugin.onnx
    wmoe-compile export --model tiny --format tensorrt --out build/tiny_trt.ep   (untested path)

The model is one of the reference configs (wmoe_compile.models), with random weights (seeded).
The example inputs are a prefill of --prompt-len tokens at positions 0.. (the compressed cache
starts empty); ONNX models carry the cache as past.* inputs and present.* outputs.
"""

from __future__ import annotations

import argparse
import os
import sys

FORMATS = ("pt2", "onnx", "onnx-plugin", "tensorrt")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..models.mixtral import CONFIGS

    parser.add_argument("--model", default="tiny", choices=sorted(CONFIGS), help="reference model config")
    parser.add_argument("--format", required=True, choices=FORMATS, help="what to write")
    parser.add_argument("--out", required=True, help="output file")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--batch", type=int, default=1, help="batch size of the static cache (default 1)")
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="cache capacity (default: the config's)"
    )
    parser.add_argument("--prompt-len", type=int, default=8, help="tokens in the example prefill (default 8)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--device", default="cpu", help="cpu or cuda (tensorrt needs cuda)")
    parser.add_argument("--codec", default=None, help="codec spec or preset (default: the default codec)")
    parser.add_argument("--bypass-codec", action="store_true", help="exact passthrough codec (for checks)")
    parser.add_argument("--no-compress-kv", action="store_true", help="leave the KV cache dense")
    parser.add_argument("--no-replace-moe", action="store_true", help="leave the expert dispatch as it is")


def run(args: argparse.Namespace) -> int:
    import torch

    from ..config import CompileConfig
    from ..models import build_model
    from ..pipeline import export as wmoe_export
    from .onnx_export import export_onnx
    from .tensorrt_export import TensorRTUnavailableError, export_tensorrt

    overrides = {} if args.layers is None else {"num_layers": args.layers}
    dtype = getattr(torch, args.dtype)
    model = build_model(args.model, dtype=dtype, device=args.device, **overrides)
    capacity = args.max_seq_len or model.cfg.max_seq_len
    if not 1 <= args.prompt_len <= capacity:
        print(f"--prompt-len must be in [1, {capacity}], got {args.prompt_len}", file=sys.stderr)
        return 2
    model.setup_cache(args.batch, capacity)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch, args.prompt_len), device=args.device)
    positions = torch.arange(args.prompt_len, device=args.device)
    fields: dict = {
        "bypass_codec": args.bypass_codec,
        "compress_kv": not args.no_compress_kv,
        "swap_attention": not args.no_compress_kv,
        "replace_moe": not args.no_replace_moe,
    }
    if args.codec:
        fields["codec"] = args.codec
    config = CompileConfig(**fields)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if args.format == "tensorrt":
        try:
            export_tensorrt(model, (tokens, positions), out, config=config)
        except TensorRTUnavailableError as exc:
            print(f"wmoe-compile export: {exc}", file=sys.stderr)
            return 2
    else:
        program = wmoe_export(model, (tokens, positions), config=config)
        report = program.wmoe_report
        if args.format == "pt2":
            torch.export.save(program, out)
        else:
            flavor = "plugin" if args.format == "onnx-plugin" else "portable"
            export_onnx(program, out, flavor, args=(tokens, positions), input_names=["tokens", "positions"])
        counts = ", ".join(
            f"{kind}: " + " ".join(f"{n} {status}" for status, n in sorted(by_status.items()))
            for kind, by_status in sorted(report.counts().items())
        )
        print(f"sites  {counts}")
    size = os.path.getsize(out) if os.path.exists(out) else 0
    print(f"wrote {out} ({args.format}, {size / 1e6:.2f} MB)")
    return 0
