#!/usr/bin/env bash
# Nsight Compute warp samples of one split-kernel launch at (8, 131072) for a LaunchConfig given as
# a JSON dict (device_pending.sh stalls profiles the tuned config only):
#   bash benchmarks/stalls_config.sh NAME '{"num_stages": 2}'   # overrides of the tuned config
# Writes $OUT/NAME_stalls.ncu-rep, NAME_stalls_sass.csv (benchmarks/stall_summary.py reads it) and
# NAME_details.txt, and prints the memory throughput lines.
set -eu
name=$1
overrides=${2:-"{}"}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
config=$(python3 -c "import dataclasses, json, sys
from wmoe_compile.kernels import wavelet_attention as K
c = dataclasses.asdict(K.TUNED_CONFIGS[(128, 4, 'affine')])
c.update(json.loads(sys.argv[1]))
print(json.dumps(c))" "$overrides")
timeout 420 ncu --clock-control none -k regex:split_kernel_v3 --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --import-source yes -f -o "$OUT/${name}_stalls" \
    python3 -P benchmarks/probe_attention.py once --shape 8,131072 --config "$config" >/dev/null 2>&1
ncu -i "$OUT/${name}_stalls.ncu-rep" --page source --csv --print-source sass > "$OUT/${name}_stalls_sass.csv"
ncu -i "$OUT/${name}_stalls.ncu-rep" --page details --print-details all > "$OUT/${name}_details.txt" 2>&1
grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Hit Rate|Issue Slots" "$OUT/${name}_details.txt" | head -8
