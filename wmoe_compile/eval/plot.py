"""Rate-distortion picture: bytes per vector against CE drift, one curve per method family."""

from __future__ import annotations

from .harness import EvalReport


def _family(method: str, spec: str = "") -> str:
    if method.startswith("wavelet"):
        return "wavelet codec, fixed transform" if "rotation=none" in spec else "wavelet codec"
    if method.startswith("int"):
        return "INT per token"
    if method.startswith("kivi"):
        return "KIVI"
    if method.startswith("fp8"):
        return "FP8 e4m3 per token"
    return method


def _label(method: str, head_dim: int) -> str:
    """Short point label: `wavelet:<spec>` methods as their bands, e.g. `16@4+48@2`."""
    if not method.startswith("wavelet:"):
        return method
    from ..codec import WaveletKVConfig

    try:
        config = WaveletKVConfig.from_spec(method[len("wavelet:") :])
    except ValueError:
        return method
    return " + ".join(f"{b.fraction * head_dim}@{b.bits}" for b in config.bands)


def plot_rate_distortion(report: EvalReport, path: str) -> None:
    """Write a PNG: x = bytes per vector, y = CE drift (log scale; drifts <= 1e-4, including
    negative ones, are drawn at 1e-4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-4
    families: dict[str, list[tuple[float, float, str]]] = {}
    for r in report.results:
        if r.method == "none":
            continue
        families.setdefault(_family(r.method, r.spec), []).append(
            (r.bytes_per_vector, max(r.drift, floor), _label(r.method, report.head_dim))
        )
    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = {
        "wavelet codec": "o",
        "wavelet codec, fixed transform": "v",
        "INT per token": "s",
        "KIVI": "^",
        "FP8 e4m3 per token": "D",
    }
    for family, pts in sorted(families.items()):
        pts.sort()
        xs, ys, names = zip(*pts, strict=True)
        ax.plot(xs, ys, marker=markers.get(family, "x"), label=family, linewidth=1.5)
        for x, y, name in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel(f"bytes per {report.head_dim}-d vector (scales included)")
    ax.set_ylabel("CE drift vs uncompressed (nats/token)")
    windows = sorted({(r.window, r.sinks) for r in report.results if r.method != "none"})
    exact = ", ".join(f"window {w}, sinks {s}" for w, s in windows)
    ax.set_title(
        f"KV compression rate-distortion\n{report.tokens} tokens, context {report.context}; exact {exact}",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
