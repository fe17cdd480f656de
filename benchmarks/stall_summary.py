"""Summarise Nsight Compute's per-SASS-line warp samples of one kernel: where its warps wait.

    python benchmarks/stall_summary.py OUT/tuned_stalls_sass.csv [--top 12]

Input: `ncu -i REPORT --page source --csv --print-source sass` (what `device_pending.sh stalls`
writes). Prints the share of every stall reason over all samples, the hot loop (the instructions
executed most often: the v3 split kernel's full-step loop), its samples by opcode (instructions /
share) and its lines holding the most samples.
Why: the device's time is scarce, so a report is read here, and the same reading is applied to
every variant (the tenth session's RESULTS.md section used it on the tuned and keys_ahead runs).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import pathlib

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclasses.dataclass
class SassLine:
    index: int  # position in the kernel's SASS listing
    source: str  # the instruction text
    executed: int  # warp-level executions
    samples: int  # warp samples taken at this instruction
    stalls: dict[str, int]  # samples per stall reason ("long_sb", "wait", ...)


def read_source_csv(path: pathlib.Path) -> list[SassLine]:
    """The SASS lines of the first kernel in an ncu source-page CSV export."""
    rows = list(csv.reader(path.open()))
    header_at = next((i for i, r in enumerate(rows) if "Source" in r and SAMPLES in r), None)
    if header_at is None:
        raise ValueError(
            f"{path}: no header with 'Source' and '{SAMPLES}': expected the CSV of "
            "`ncu -i REPORT --page source --csv --print-source sass`"
        )
    header = rows[header_at]
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "(Not Issued)" not in h]

    def number(row: list[str], name: str) -> int:
        text = row[col[name]].replace(",", "") if col[name] < len(row) else ""
        return int(float(text)) if text not in ("", "-") else 0

    lines = []
    for row in rows[header_at + 1 :]:
        if len(row) < len(header) or not row[col["Source"]].strip():
            continue
        if row[0] == header[0]:  # the next kernel's header: one kernel per summary
            break
        lines.append(
            SassLine(
                index=len(lines),
                source=row[col["Source"]].strip(),
                executed=number(row, EXECUTED),
                samples=number(row, SAMPLES),
                stalls={r.removeprefix("stall_"): number(row, r) for r in reasons},
            )
        )
    if not lines:
        raise ValueError(f"{path}: the CSV has a header but no SASS lines")
    return lines


def reason_shares(lines: list[SassLine]) -> list[tuple[str, float]]:
    """Each stall reason's share of all samples, largest first."""
    total = sum(line.samples for line in lines)
    counts: collections.Counter = collections.Counter()
    for line in lines:
        counts.update(line.stalls)
    return [(name, n / total) for name, n in counts.most_common() if n] if total else []


def hot_loop(lines: list[SassLine]) -> list[SassLine]:
    """The lines executed as often as the most executed line (a loop body runs them equally)."""
    most = max(line.executed for line in lines)
    return [line for line in lines if line.executed == most]


def opcode(source: str) -> str:
    """The base opcode of a SASS line: 'LOP3' for '@!P2 LOP3.LUT R88, ...'."""
    words = source.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def opcode_shares(lines: list[SassLine], total: int) -> list[tuple[str, int, float]]:
    """(opcode, instructions, share of all samples) over the given lines, most samples first: a
    warp's time by kind of work (a sample counts against the instruction the warp waits to issue,
    so a load's latency shows at its first use)."""
    count: collections.Counter = collections.Counter()
    samples: collections.Counter = collections.Counter()
    for line in lines:
        count[opcode(line.source)] += 1
        samples[opcode(line.source)] += line.samples
    return [(op, count[op], n / total) for op, n in samples.most_common()] if total else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv", type=pathlib.Path)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    lines = read_source_csv(a.csv)
    total = sum(line.samples for line in lines)
    if total == 0:
        raise SystemExit(f"{a.csv}: no warp samples (profile with ncu --section SourceCounters)")
    print(f"{a.csv}: {len(lines)} SASS lines, {total} warp samples")
    print("all samples: " + ", ".join(f"{name} {share:.3f}" for name, share in reason_shares(lines)))
    loop = hot_loop(lines)
    in_loop = sum(line.samples for line in loop)
    print(
        f"hot loop: {len(loop)} instructions executed {loop[0].executed:,} times each, "
        f"{in_loop / total:.3f} of the samples"
    )
    print(
        "hot loop by opcode: "
        + ", ".join(f"{op} {n}/{share:.3f}" for op, n, share in opcode_shares(loop, total)[: a.top])
    )
    for line in sorted(loop, key=lambda x: -x.samples)[: a.top]:
        worst = sorted(line.stalls.items(), key=lambda kv: -kv[1])[:3]
        reasons = " ".join(f"{name}:{n}" for name, n in worst if n)
        share = line.samples / total
        print(f"  {line.index:5d} {line.samples:6d} {share:6.3f}  {line.source[:60]:60s} {reasons}")


if __name__ == "__main__":
    main()
