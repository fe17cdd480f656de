set -u
export TRITON_CACHE_DIR=$PWD/build/triton_cache
python3 -c "import wmoe_compile.kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning
date -u +%H:%M:%S
timeout 150 python3 -P -m pytest -q -m gpu tests/test_wavelet_attention.py -n 6 -p no:benchmark -k "side_stream_equal or programmatic_dependent" 2>&1 | tail -3
date -u +%H:%M:%S
timeout 100 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/probe_exact_before_split_one_sequence.json --shapes "1,32768" --out $OUT/one 2>&1 | grep -E "failed|Error" | head -3
timeout 100 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/probe_exact_before_split.json --shapes "8,131072;32,32768;8,32768" --out $OUT/big 2>&1 | grep -E "failed|Error" | head -3
date -u +%H:%M:%S
timeout 100 python3 -P benchmarks/probe_attention.py timeline --configs benchmarks/probe_timeline_exact_before_split.json --shapes "1,32768" 2>&1 | grep -v -i warn | grep -v "^{" | tail -12
date -u +%H:%M:%S
