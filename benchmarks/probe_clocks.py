"""Does the op's time follow the GPU's clock? Replay one shape's CUDA graph (ours, then SDPA, then
ours again) back to back for a few seconds each, timing every replay, while nvidia-smi samples
the SM clock, power draw and the active clock-event (throttle) reasons.

    python benchmarks/probe_clocks.py --out DIR [--shape 32,32768] [--seconds 3]
    python benchmarks/probe_clocks.py --out DIR --configs A_B_A_B.json   # sustained A/B, no SDPA

Why: bench_attention's alternating rounds (twenty-second session) saw our time rise 5% within
one shape's rounds (0.247 -> 0.260 ms at (8, 131072)) while SDPA's stayed within 0.5%. Writes
replays.csv (phase, seconds since start, ms per call) and clocks.csv (nvidia-smi), and prints each
phase's time per call over time next to the clock and power in the same windows.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_attention as ba  # noqa: E402
import torch  # noqa: E402
from wmoe_compile.kernels import wavelet_attention as wa  # noqa: E402

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active"


def replay_for(graph, calls_per_replay: int, seconds: float, t0: float, phase: str) -> list[tuple]:
    """Replay `graph` back to back for `seconds`, timing each replay with events."""
    rows = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stop = time.time() + seconds
    while time.time() < stop:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        rows.append((phase, round(time.time() - t0, 4), start.elapsed_time(end) / calls_per_replay))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--shape", default="32,32768", help="B,N")
    p.add_argument("--seconds", type=float, default=3.0, help="per phase")
    p.add_argument(
        "--configs",
        default="",
        help="JSON file of LaunchConfig dicts: one phase each, in order (list A, B, A, B); no SDPA",
    )
    a = p.parse_args()
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b, n = (int(x) for x in a.shape.split(","))
    setup = ba.Setup(b, n, ba.HQ, ba.HKV, "cuda", smoke=False)
    setup.use_codec(ba.CODECS["default"])

    def graph(config: wa.LaunchConfig) -> tuple:
        return ba.graph_of([lambda i=i: setup.call(i, config) for i in range(len(setup.copies))])

    if a.configs:
        # sustained A/B: a config's energy per call sets the clock it runs at, which an A/B that
        # alternates every few milliseconds would share between both sides
        configs = [wa.LaunchConfig(**c) for c in json.loads(pathlib.Path(a.configs).read_text())]
        graphs = {}
        phases = []
        for k, config in enumerate(configs):
            if config not in graphs:
                graphs[config] = graph(config)
            phases.append((f"config{configs.index(config)}_{k}", graphs[config]))
        for k, config in enumerate(configs[: len(graphs)]):
            print(f"config{k}: {config}")
    else:
        config = wa.tuned_config(setup.layout, ba.HEAD_DIM, 4, b * ba.HKV)
        print(f"config: {config}")
        ours = graph(config)
        phases = [("ours", ours), ("sdpa", ba.graph_of(ba.sdpa_calls(setup))), ("ours_again", ours)]
    log = open(out / "clocks.csv", "w")  # noqa: SIM115 - closed after the sampler stops
    sampler = subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,nounits", "-lms", "50"], stdout=log
    )
    time.sleep(1.0)  # the sampler's first lines: the idle state
    t0 = time.time()
    rows = []
    for phase, (replayed, per) in phases:
        rows += replay_for(replayed, per, a.seconds, t0, phase)
        time.sleep(0.5)  # idle between phases
    time.sleep(0.5)
    sampler.terminate()
    sampler.wait()
    log.close()
    with open(out / "replays.csv", "w", newline="") as f:
        csv.writer(f).writerows([("phase", "t_s", "ms_per_call"), *rows])
    samples = read_clocks(out / "clocks.csv", t0)
    # per phase and 0.5 s window: the median time per call, SM clock and power draw
    print(f"shape {a.shape}")
    for phase, _ in phases:
        times = [(t, ms) for ph, t, ms in rows if ph == phase]
        first, last = times[0][0], times[-1][0]
        print(f"{phase} (t = {first:.2f} .. {last:.2f} s): window | ms per call | SM MHz | W | reasons")
        k = 0
        while first + 0.5 * k < last:
            lo, hi = first + 0.5 * k, first + 0.5 * (k + 1)
            ms = [m for t, m in times if lo <= t < hi]
            inside = [c for c in samples if lo <= c[0] < hi]
            if ms and inside:
                clock = statistics.median(c[1] for c in inside)
                watts = statistics.median(c[2] for c in inside)
                reasons = sorted({c[3] for c in inside})
                cells = f"{statistics.median(ms):.4f} | {clock:.0f} | {watts:.0f} | {' '.join(reasons)}"
                print(f"  {lo:5.2f} | {cells}")
            k += 1
        steady = [m for t, m in times if t >= first + 1.0]
        if steady:
            print(f"  after the first second: median {statistics.median(steady):.4f} ms per call")
    idle = [c for c in samples if c[0] < 0]
    if idle:
        print(
            f"idle before: SM {statistics.median(c[1] for c in idle):.0f} MHz, "
            f"{statistics.median(c[2] for c in idle):.0f} W"
        )
    return 0


def read_clocks(path: pathlib.Path, t0: float) -> list[tuple[float, float, float, str]]:
    """(seconds since t0, SM MHz, W, active clock-event reasons) per nvidia-smi sample."""
    samples = []
    with open(path) as f:
        for row in csv.reader(f):
            if not row or row[0].startswith("timestamp"):
                continue
            try:
                stamp = time.mktime(time.strptime(row[0].strip().split(".")[0], "%Y/%m/%d %H:%M:%S"))
                stamp += float("0." + row[0].strip().split(".")[1])
                samples.append((stamp - t0, float(row[1]), float(row[3]), row[5].strip()))
            except (ValueError, IndexError):
                continue  # a sampler line cut off at terminate
    return samples


if __name__ == "__main__":
    sys.exit(main())
