#!/usr/bin/env bash
# One device call for the end-to-end checks: GPU smoke tests, the decode benchmark, the GPU demo.
# Usage (on the GPU machine, repository root): bash benchmarks/gpu_session.sh  (writes under $OUT)
set -u
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=$PWD/build/inductor_cache
if [ -d build/triton_cache ]; then export TRITON_CACHE_DIR=$PWD/build/triton_cache; fi
PY="python3 -P"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1
if ! $PY -c "import wmoe_compile.kernels, wmoe_compile.passes" 2>/dev/null; then
  # No editable install: map passes/ and kernels/ into the package by links instead.
  echo "editable install unavailable: using links"; tail -3 "$OUT/pip.log"
  ln -sfn ../kernels wmoe_compile/kernels; ln -sfn ../passes wmoe_compile/passes
  export PYTHONPATH=$PWD; PY=python3
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TESTS_S:-60}" $PY -m pytest -q -m gpu tests/test_model.py tests/test_lowering_gpu.py 2>&1 | tail -4
timeout "${BENCH_S:-300}" $PY benchmarks/bench_decode.py --out "$OUT" --shapes "${SHAPES:-8x131072,32x32768}" --codec "${CODEC:-default}" 2>&1 | tee "$OUT/bench_decode.log" | grep -v Warning
if [ -n "${DEMO_S:-}" ]; then timeout "$DEMO_S" $PY -m wmoe_compile.cli demo --dump-dir /tmp/wmoe_dumps --codec "${CODEC:-default}" 2>&1 | tail -12; fi
