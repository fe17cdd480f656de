"""The `wmoe-compile` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

# Subcommands register here: name -> (help, add_arguments(parser), run(args) -> exit code).
# A subcommand whose capability has not landed yet stays listed and exits 2 with a clear message.
_Subcommand = tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _not_implemented(name: str, issue: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        print(
            f"wmoe-compile {name}: not implemented yet ({issue}); see the README's status table.",
            file=sys.stderr,
        )
        return 2

    return run


def _no_args(parser: argparse.ArgumentParser) -> None:
    pass


def _demo_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="reference model config (default: tiny on CPU, mixtral-8x7b shapes on a GPU)",
    )
    parser.add_argument("--layers", type=int, default=2, help="layers for mixtral-8x7b shapes (default 2)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--codec",
        default=None,
        help="KV codec spec or preset (default: 'default', with a 16-token window on tiny)",
    )
    parser.add_argument("--dump-dir", default="wmoe_dumps", help="where the per-pass dumps go")


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


BENCHMARKS = ("attention", "moe", "decode")


def _bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "which",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, any of {', '.join(BENCHMARKS)} (default: all)",
    )
    parser.add_argument("--out", default="benchmarks/out", help="folder for JSON and markdown tables")


def _bench(args: argparse.Namespace) -> int:
    import os
    import pathlib
    import subprocess

    import torch

    unknown = sorted(set(args.which) - set(BENCHMARKS))
    if unknown:
        print(
            f"wmoe-compile bench: unknown benchmark(s) {unknown}; valid: {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    if not torch.cuda.is_available():
        print(
            "wmoe-compile bench: needs a CUDA GPU (timings on the CPU mean nothing for these kernels)",
            file=sys.stderr,
        )
        return 2
    bench_dir = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
    if not bench_dir.is_dir():
        print(
            f"wmoe-compile bench: benchmark scripts not found at {bench_dir}; run from a source checkout "
            "installed with `pip install -e .`",
            file=sys.stderr,
        )
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in args.which or BENCHMARKS:
        script = bench_dir / f"bench_{name}.py"
        print(f"== {script.name} -> {out}", flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if subprocess.run([sys.executable, str(script), "--out", str(out)], env=env).returncode != 0:
            failed.append(name)
    if failed:
        print(f"wmoe-compile bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _dump_args(parser: argparse.ArgumentParser) -> None:
    from .dump import add_arguments

    add_arguments(parser)


def _dump(args: argparse.Namespace) -> int:
    from .dump import main as run_dump

    return run_dump(args)


def _eval_args(parser: argparse.ArgumentParser) -> None:
    from .eval.cli import add_arguments

    add_arguments(parser)


def _eval(args: argparse.Namespace) -> int:
    from .eval.cli import run

    return run(args)


def _export_cli():
    from .lowering import export_cli

    return export_cli


SUBCOMMANDS: dict[str, _Subcommand] = {
    "demo": ("run the reference model end to end and report what was rewritten", _demo_args, _demo),
    "dump": ("dump the graph after every pass", _dump_args, _dump),
    "export": (
        "export a rewritten model (pt2, onnx, onnx-plugin, tensorrt)",
        lambda parser: _export_cli().add_arguments(parser),
        lambda args: _export_cli().run(args),
    ),
    "eval": ("measure KV codec quality on a real model", _eval_args, _eval),
    "bench": ("run the GPU benchmarks and write their tables", _bench_args, _bench),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wmoe-compile",
        description="Compile Mixture-of-Experts models for fast GPU serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add_arguments, run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
