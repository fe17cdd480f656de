"""Per-pass graph dumps a person can read: `dump_dir=` or `WMOE_DUMP_DIR`.

    DIR/00_input/  01_find_sites/  02_insert_dwt_quantize/  ...  index.html

Each NN_<pass>/ folder holds
  graph.py     the graph as readable Python (shapes and dtypes in annotations)
  nodes.txt    a node table: index, name, op, target, shape, dtype, site, module path, users
  graph.json   networkx node-link JSON (nodes with op/target/shape/dtype/site/module, edges = dataflow)
  diff.txt     unified diff of graph.py against the previous pass
  sites.json   every site and its state after this pass
  graph.dot    graphviz source; graph.svg next to it when the `dot` program is installed
index.html links them and shows, per pass, the node delta (ops added/removed) and the sites.
"""

from __future__ import annotations

import difflib
import html
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import networkx as nx
from torch import fx

from .passes._context import SITE_META_KEY
from .passes.find_sites import SiteReport

_MAX_SVG_NODES = 3000  # larger graphs render too slowly to be worth it


class GraphDumper:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._previous_code: str | None = None
        self._folders: list[str] = []

    def dump(
        self, index: int, name: str, gm: fx.GraphModule, *, sites: list[SiteReport], notes: list[str]
    ) -> str:
        folder = self.root / f"{index:02d}_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        code = readable_code(gm)
        (folder / "graph.py").write_text(code)
        (folder / "nodes.txt").write_text(node_table(gm))
        (folder / "graph.json").write_text(json.dumps(node_link(gm), indent=1, default=str))
        (folder / "sites.json").write_text(json.dumps([s.to_dict() for s in sites], indent=1))
        (folder / "notes.txt").write_text("\n".join(notes) + "\n")
        previous = self._previous_code if self._previous_code is not None else ""
        diff = difflib.unified_diff(
            previous.splitlines(keepends=True),
            code.splitlines(keepends=True),
            fromfile=self._folders[-1] + "/graph.py" if self._folders else "(nothing)",
            tofile=folder.name + "/graph.py",
        )
        (folder / "diff.txt").write_text("".join(diff))
        dot = to_dot(gm, name)
        (folder / "graph.dot").write_text(dot)
        if shutil.which("dot") and len(gm.graph.nodes) <= _MAX_SVG_NODES:
            try:
                subprocess.run(
                    ["dot", "-Tsvg", "-o", str(folder / "graph.svg"), str(folder / "graph.dot")],
                    check=True,
                    timeout=120,
                    capture_output=True,
                )
            except (subprocess.SubprocessError, OSError):
                pass  # the picture is optional; the text dumps are the record
        self._previous_code = code
        self._folders.append(folder.name)
        return folder.name

    def write_index(self, report: Any) -> Path:
        path = self.root / "index.html"
        path.write_text(index_html(report))
        (self.root / "report.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
        return path


_STACK_COMMENT = re.compile(r"^\s*# (File: |No stacktrace).*\n", re.MULTILINE)


def readable_code(gm: fx.GraphModule) -> str:
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    return _STACK_COMMENT.sub("", text)


def _shape_dtype(node: fx.Node) -> tuple[str, str]:
    value = node.meta.get("val")
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return "[" + ", ".join(str(s) for s in value.shape) + "]", str(value.dtype).replace("torch.", "")
    if isinstance(value, (tuple, list)):
        shapes = [("[" + ", ".join(str(s) for s in v.shape) + "]") for v in value if hasattr(v, "shape")]
        return "(" + ", ".join(shapes) + ")", ""
    return "", ""


def _target(node: fx.Node) -> str:
    if node.op == "call_function":
        name = getattr(node.target, "name", None)
        return name() if callable(name) else getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def node_table(gm: fx.GraphModule) -> str:
    header = ("#", "name", "op", "target", "shape", "dtype", "site", "module", "users")
    rows = [header]
    for i, node in enumerate(gm.graph.nodes):
        shape, dtype = _shape_dtype(node)
        users = ",".join(u.name for u in node.users)
        rows.append(
            (
                str(i),
                node.name,
                node.op,
                _target(node),
                shape,
                dtype,
                node.meta.get(SITE_META_KEY, ""),
                _module(node),
                users if len(users) < 80 else users[:77] + "...",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    widths[-1] = 0
    return (
        "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows)
        + "\n"
    )


def node_link(gm: fx.GraphModule) -> dict:
    graph = nx.DiGraph()
    for node in gm.graph.nodes:
        shape, dtype = _shape_dtype(node)
        graph.add_node(
            node.name,
            op=node.op,
            target=_target(node),
            shape=shape,
            dtype=dtype,
            site=node.meta.get(SITE_META_KEY, ""),
            module=_module(node),
        )
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            graph.add_edge(inp.name, node.name)
    try:
        return nx.node_link_data(graph, edges="edges")
    except TypeError:  # networkx < 3.4 has no `edges=` argument
        return nx.node_link_data(graph)


def to_dot(gm: fx.GraphModule, title: str) -> str:
    lines = [
        f'digraph "{title}" {{',
        "  rankdir=TB;",
        '  node [shape=box, fontname="monospace", fontsize=9];',
    ]
    for node in gm.graph.nodes:
        shape, dtype = _shape_dtype(node)
        label = f"{node.name}\\n{_target(node)}" + (f"\\n{shape} {dtype}" if shape else "")
        style = ""
        if node.meta.get(SITE_META_KEY):
            style = ', style=filled, fillcolor="#ffe9a8"'
        elif node.op in ("placeholder", "output"):
            style = ', style=filled, fillcolor="#d8e8ff"'
        elif node.op == "get_attr":
            style = ', style=filled, fillcolor="#eeeeee"'
        lines.append(f'  "{node.name}" [label="{label}"{style}];')
    for node in gm.graph.nodes:
        for inp in node.all_input_nodes:
            lines.append(f'  "{inp.name}" -> "{node.name}";')
    lines.append("}")
    return "\n".join(lines) + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
.rewritten { background: #e3f6e3; } .skipped { background: #fdeaea; } .found { background: #f6f6e3; }
code { font-size: 12px; } .ops { font-family: monospace; font-size: 12px; }
"""


def _ops_cell(ops: dict[str, int], sign: str) -> str:
    items = sorted(ops.items(), key=lambda kv: -kv[1])
    return "<br>".join(f"{sign}{count} {html.escape(op)}" for op, count in items[:12]) + (
        f"<br>... {len(items) - 12} more" if len(items) > 12 else ""
    )


def index_html(report: Any) -> str:
    esc = html.escape
    rows = []
    for p in report.passes:
        links = ""
        if p.dump:
            files = ["graph.py", "nodes.txt", "diff.txt", "graph.json", "sites.json", "graph.dot"]
            files += ["graph.svg"] if (Path(report.dump_dir or ".") / p.dump / "graph.svg").exists() else []
            links = " ".join(f'<a href="{esc(p.dump)}/{f}">{f}</a>' for f in files)
        numeric = ""
        if p.numeric:
            numeric = f"{p.numeric['relative_error']:.2e} (bound {p.numeric['bound']:.2e})"
        rows.append(
            "<tr>"
            f"<td>{p.index:02d}</td><td><b>{esc(p.name)}</b><br>{links}</td>"
            f"<td>{p.nodes_before} &rarr; {p.nodes_after} ({p.nodes_after - p.nodes_before:+d})</td>"
            f"<td class=ops>{_ops_cell(p.added, '+')}</td><td class=ops>{_ops_cell(p.removed, '-')}</td>"
            f"<td>{'<br>'.join(esc(d) for d in p.decided[:20])}"
            f"{'<br>...' if len(p.decided) > 20 else ''}</td>"
            f"<td>{'<br>'.join(esc(n) for n in p.notes)}</td><td>{numeric}</td>"
            f"<td>{p.seconds * 1e3:.1f} ms</td></tr>"
        )

    def node_list(site) -> str:
        return ", ".join(f"{k}={v}" for k, v in site.nodes.items() if k != "weights")

    site_rows = [
        f'<tr class="{esc(s.status)}"><td>{s.layer}</td><td>{esc(s.kind)}</td><td>{esc(s.detail)}</td>'
        f"<td>{esc(s.status)}</td><td>{esc(s.decided_by)}</td><td>{esc(s.reason)}</td>"
        f"<td><code>{esc(s.module_path)}</code></td>"
        f"<td><code>{esc(node_list(s))}</code></td></tr>"
        for s in report.sites
    ]
    counts = report.counts()
    summary = ", ".join(
        f"{kind}: " + ", ".join(f"{n} {st}" for st, n in c.items()) for kind, c in counts.items()
    )
    numerics = ""
    if report.numerics:
        numerics = (
            f"<p>Final graph vs captured graph on the sample inputs: relative error "
            f"{report.numerics['relative_error']:.3e} (bound {report.numerics['bound']:.3e}).</p>"
        )
    config = esc(json.dumps(report.config, indent=1))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>wmoe_compile pass dumps</title><style>{_CSS}</style></head>
<body>
<h1>wmoe_compile: graph after every pass</h1>
<p>{esc(summary) or "no sites found"}</p>
{numerics}
<h2>Passes</h2>
<p>Folder <code>00_input</code> is the captured graph: <a href="00_input/graph.py">graph.py</a>,
<a href="00_input/nodes.txt">nodes.txt</a>.</p>
<table>
<tr><th>#</th><th>pass and files</th><th>nodes</th><th>ops added</th><th>ops removed</th>
<th>sites decided</th><th>notes</th><th>numeric check</th><th>time</th></tr>
{"".join(rows)}
</table>
<h2>Sites</h2>
<table>
<tr><th>layer</th><th>kind</th><th>detail</th><th>status</th><th>by</th><th>reason / note</th><th>module</th>
<th>nodes</th></tr>
{"".join(site_rows)}
</table>
<h2>Config</h2>
<pre>{config}</pre>
</body></html>
"""


# ----------------------------------------------------------------------------------------------
# `wmoe-compile dump`

REFERENCE_ALIASES = {"tiny-mixtral": "tiny"}


def add_arguments(parser) -> None:
    """Arguments of `wmoe-compile dump`."""
    parser.add_argument(
        "--model",
        default="tiny-mixtral",
        help="tiny-mixtral (the reference model, default), a reference config name (tiny, mixtral-8x7b), "
        "hf-tiny-KIND (random tiny HF models; KIND: mixtral, qwen3-moe, qwen2-moe, olmoe, granitemoe, "
        "phimoe, deepseek-v3, llama), "
        "or a path to an HF config.json (random weights) or model directory (its weights)",
    )
    parser.add_argument("--out", required=True, help="folder for the dumps (NN_<pass>/ and index.html)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=8, help="prompt length of the sample inputs")
    parser.add_argument("--max-cache-len", type=int, default=64, help="static cache capacity")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument(
        "--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention implementation"
    )
    parser.add_argument("--experts", default="grouped_mm", choices=["grouped_mm", "batched_mm"])
    parser.add_argument("--codec", default=None, help="codec spec or preset (default: the default preset)")
    parser.add_argument("--bypass-codec", action="store_true", help="ops swapped, codec an exact passthrough")
    parser.add_argument("--no-compress-kv", action="store_true")
    parser.add_argument("--no-swap-attention", action="store_true")
    parser.add_argument("--no-replace-moe", action="store_true")
    parser.add_argument("--check-numerics", action="store_true", help="numeric check after every pass")


def build_for_dump(args) -> tuple[Any, tuple]:
    """(capturable model, example args) for the --model choice."""
    from .models import CONFIGS, build_model
    from .pipeline import HF_TINY, example_inputs_for, prepare, tiny_hf_model

    name = REFERENCE_ALIASES.get(args.model, args.model)
    if name in CONFIGS:
        overrides = {"num_layers": args.layers} if args.layers else {}
        model = build_model(name, **overrides)
        model = prepare(model, batch_size=args.batch, max_cache_len=args.max_cache_len)
    elif name.startswith("hf-tiny-") and name[len("hf-tiny-") :] in HF_TINY:
        hf = tiny_hf_model(
            name[len("hf-tiny-") :],
            attn_implementation=args.attn,
            experts_implementation=args.experts if "llama" not in name else None,
            num_layers=args.layers or 2,
        )
        model = prepare(hf, batch_size=args.batch, max_cache_len=args.max_cache_len)
    elif Path(name).exists():
        model = prepare(_load_hf(Path(name), args), batch_size=args.batch, max_cache_len=args.max_cache_len)
    else:
        valid = ["tiny-mixtral", *CONFIGS, *(f"hf-tiny-{k}" for k in HF_TINY)]
        raise ValueError(
            f"unknown --model {args.model!r}; valid: {', '.join(valid)}, or an HF config/model path"
        )
    example_args, _ = example_inputs_for(model, batch=args.batch, tokens=args.tokens)
    return model, example_args


def _load_hf(path: Path, args):
    import transformers

    config_path = path if path.is_file() else path / "config.json"
    if not config_path.exists():
        raise ValueError(f"{path} is neither an HF config.json nor a model directory with one")
    config = transformers.AutoConfig.from_pretrained(str(config_path))
    if args.layers:
        config.num_hidden_layers = args.layers
    config._attn_implementation = args.attn
    has_weights = path.is_dir() and (any(path.glob("*.safetensors")) or any(path.glob("*.bin")))
    if has_weights:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), config=config, attn_implementation=args.attn
        )
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.eval()


def main(args) -> int:
    """Run `wmoe-compile dump`: capture, run every pass, write the dumps; print the report."""
    from .config import CompileConfig
    from .pipeline import export

    try:
        model, example_args = build_for_dump(args)
    except ValueError as exc:
        print(f"wmoe-compile dump: {exc}", file=sys.stderr)
        return 2
    fields = dict(
        compress_kv=not args.no_compress_kv,
        swap_attention=not args.no_swap_attention,
        replace_moe=not args.no_replace_moe,
        bypass_codec=args.bypass_codec,
        check_numerics=args.check_numerics,
    )
    if args.codec:
        fields["codec"] = args.codec
    program = export(model, example_args, config=CompileConfig(**fields), dump_dir=args.out)
    print(program.wmoe_report)
    print(f"open {Path(args.out).resolve() / 'index.html'}")
    return 0
