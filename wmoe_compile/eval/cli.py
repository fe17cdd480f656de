"""`wmoe-compile eval`: KV codec quality on a real model (see harness.py)."""

from __future__ import annotations

import argparse
import sys

# Methods run by default: the codec's default and high-quality presets against the baselines.
DEFAULT_METHODS = ("wavelet", "wavelet-hq", "int4", "kivi2", "fp8")
# --rd adds budgets from ~20 to ~70 bytes per 64-d vector for the rate-distortion picture.
RD_METHODS = (
    "int2",
    "int3",
    "int4",
    "int8",
    "kivi2",
    "kivi4",
    "fp8",
    "wavelet-lo",
    "wavelet",
    "wavelet-hq",
    "wavelet-hq8",
    "wavelet-max",
    "wavelet-wht",
    "wavelet-haar",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M)"
    )
    parser.add_argument("--text", default=None, help="text file to evaluate on (default: pydoc_data.topics)")
    parser.add_argument(
        "--tokens", type=int, default=4096, help="next-token predictions to score (default 4096)"
    )
    parser.add_argument(
        "--context", type=int, default=2048, help="tokens per evaluation window (default 2048)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=None,
        metavar="METHOD",
        help="methods: wavelet, wavelet-<preset>, 'wavelet:<spec>', fp8, int2..int8, kivi2, kivi4 "
        f"(default: {' '.join(DEFAULT_METHODS)})",
    )
    parser.add_argument("--rd", action="store_true", help="add the rate-distortion sweep methods")
    parser.add_argument(
        "--window", type=int, default=None, help="exact recent tokens for every method (default 128)"
    )
    parser.add_argument(
        "--sinks", type=int, default=None, help="exact leading tokens for every method (default 4)"
    )
    parser.add_argument(
        "--calib-tokens", type=int, default=512, help="calibration tokens for smoothing (default 512)"
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write the full report as JSON")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the rate-distortion picture")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also measure each wavelet method through the compiled model (rewritten graph, HF static "
        "cache, decoded token by token after a prefill chunk) with the harness's calibration, and "
        "print both drifts (see wmoe_compile/eval/compiled.py); default method: wavelet",
    )
    parser.add_argument(
        "--driver",
        choices=("export", "compile"),
        default="export",
        help="with --compiled: the rewritten ExportedProgram run eagerly (export) or "
        "torch.compile(backend='wmoe') (compile)",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from .harness import run_eval

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.compiled:
        return _run_compiled(args)
    methods = list(args.methods) if args.methods else list(DEFAULT_METHODS)
    if args.rd:
        methods += [m for m in RD_METHODS if m not in methods]
    try:
        report = run_eval(
            methods,
            tokens=args.tokens,
            context=args.context,
            model=args.model,
            text=args.text,
            window=args.window,
            sinks=args.sinks,
            calib_tokens=args.calib_tokens,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"wmoe-compile eval: {exc}", file=sys.stderr)
        return 2
    print(report.table())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(report.to_json())
        print(f"wrote {args.json}")
    if args.plot:
        from .plot import plot_rate_distortion

        plot_rate_distortion(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _run_compiled(args: argparse.Namespace) -> int:
    from .compiled import run_compiled_eval

    reports = []
    for method in args.methods or ["wavelet"]:
        try:
            report = run_compiled_eval(
                method,
                tokens=args.tokens,
                context=args.context,
                model=args.model,
                text=args.text,
                window=args.window,
                sinks=args.sinks,
                calib_tokens=args.calib_tokens,
                driver=args.driver,
                progress=not args.no_progress,
            )
        except (ValueError, FileNotFoundError, RuntimeError) as exc:
            print(f"wmoe-compile eval --compiled: {exc}", file=sys.stderr)
            return 2
        print(report.table())
        reports.append(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write("[" + ",\n".join(r.to_json() for r in reports) + "]")
        print(f"wrote {args.json}")
    return 0
