#!/usr/bin/env bash
# Measurements prepared on a CPU-only machine for the device, grouped so each part fits one
# 10-minute device call (RESULTS.md has what each earlier run found; rerun after a change to the
# kernels or passes it covers). Every command has its own time limit; results go under $OUT.
#
#   bash benchmarks/device_pending.sh tests       # every GPU test (pytest -m gpu tests/), six workers
#   bash benchmarks/device_pending.sh attention   # the attention GPU tests, then bench_attention
#   bash benchmarks/device_pending.sh decode      # bench_decode at the issue's target shapes
#                                                 # (8, 131072) and (32, 32768), every variant
#   bash benchmarks/device_pending.sh inductor PATCH...
#                                                 # the wmoe step with Inductor config patches
#                                                 # (JSON) against the default
#   bash benchmarks/device_pending.sh overlap     # the deferred cache writes' GPU tests, then the
#                                                 # wmoe step with and without them
#   bash benchmarks/device_pending.sh profile     # the replayed step's GPU time by part and its
#                                                 # timeline (profile_decode.py --graph)
#   bash benchmarks/device_pending.sh kvwarps     # the warp-specialized spike's kernel checked and
#                                                 # timed against v3's split kernel
#                                                 # (probe_kv_warps.py)
#   bash benchmarks/device_pending.sh grid FILE.json
#                                                 # the attention op under each launch config in
#                                                 # FILE (probe_attention.py grid, CUDA-graph
#                                                 # medians at the three large decode shapes)
#   bash benchmarks/device_pending.sh timeline FILE.json
#                                                 # when each kernel of a call starts and ends
#                                                 # (probe_attention.py timeline) under each
#                                                 # config in FILE ("auto": the package's choice),
#                                                 # at (8, 131072), (32, 32768) and (1, 32768)
#   bash benchmarks/device_pending.sh carveout    # LaunchConfig.exact_carveout (twentieth session:
#                                                 # tuned at small one-wave launches): its GPU
#                                                 # tests, then A/B at one sequence and the large
#                                                 # shapes (these JSONs set it where the tuned
#                                                 # config would not)
#   bash benchmarks/device_pending.sh reduce      # the reduce's GPU tests, then the grid A/B of
#                                                 # probe_reduce_merge.json (the one-warp merge at
#                                                 # B = 8, exact_carveout_programs) and timelines
#   bash benchmarks/device_pending.sh remainder   # LaunchConfig.remainder_split (prepared in the
#                                                 # twentieth session, not yet run): its GPU tests,
#                                                 # the grid A/B against the tuned config, timelines
#   bash benchmarks/device_pending.sh small_reduce
#                                                 # one sequence: the per-row reduce against each
#                                                 # row's merge in one-warp channel slices plus the
#                                                 # transform kernel (prepared, twentieth session)
#   bash benchmarks/device_pending.sh key_word_pairs
#                                                 # LaunchConfig.key_word_pairs (twenty-second
#                                                 # session): its GPU tests, then the grid A/B
#                                                 # against the tuned and the one-sequence configs
#   bash benchmarks/device_pending.sh zero_padding_p
#                                                 # LaunchConfig.zero_padding_p: the bit-identity
#                                                 # test, the grid A/B, then sustained A/B phases
#                                                 # (probe_clocks.py --configs)
#   bash benchmarks/device_pending.sh value_subnormals
#                                                 # packed_p_scaling and value_subnormals
#                                                 # (twenty-third session): GPU tests, error
#                                                 # against split length, grid A/B; then
#                                                 # value_subnormals_sustained: sustained A/B
#   bash benchmarks/device_pending.sh band_columns
#                                                 # LaunchConfig.band_columns: GPU tests, grid and
#                                                 # sustained A/B, one sequence
#   bash benchmarks/device_pending.sh value_scales_staged
#                                                 # LaunchConfig.value_scales_staged: GPU tests,
#                                                 # grid and sustained A/B
#   bash benchmarks/device_pending.sh counted_steps
#                                                 # LaunchConfig.counted_steps (prepared, not yet
#                                                 # timed): GPU tests, grid, sustained, one sequence
#   bash benchmarks/device_pending.sh transform_in_split
#                                                 # LaunchConfig.transform_in_split (twenty-fifth
#                                                 # session): GPU tests, grid, one sequence, timeline
#   bash benchmarks/device_pending.sh one_sequence_merge
#                                                 # with transform_in_split at one sequence: split
#                                                 # length and the merge's shape (grid), and the
#                                                 # package's timelines at (1, 32768), (32, 32768)
#   bash benchmarks/device_pending.sh query_in_split
#                                                 # LaunchConfig.query_in_split (prepared in the
#                                                 # twenty-fifth session, not yet timed): GPU tests,
#                                                 # grid, one sequence, timelines; then the split
#                                                 # plan counting the exact programs (32, 32768)
#   bash benchmarks/device_pending.sh sustained FILE.json [SHAPES]
#                                                 # sustained A/B: each config in FILE (list A, B,
#                                                 # A, B) replayed alone for 2.5 s, with the SM
#                                                 # clock and power (probe_clocks.py --configs)
#   bash benchmarks/device_pending.sh clocks      # the op's time per call over 3 s of back-to-back
#                                                 # replays against the SM clock, power draw and
#                                                 # throttle reasons, SDPA between (probe_clocks.py)
#   bash benchmarks/device_pending.sh stalls [tuned|keys_in_step]
#                                                 # where the v3 split kernel's warps wait, per SASS
#                                                 # instruction, plus the memory-throughput
#                                                 # breakdown (Nsight Compute)
#   bash benchmarks/device_pending.sh tma_rows    # LaunchConfig.tma_rows (and tma_rows_unfenced):
#                                                 # GPU tests, then the grid against the tuned config
#   bash benchmarks/device_pending.sh tma_spike   # the TMA spikes checked, their step loop timed
#                                                 # beside the tuned split kernel
#   bash benchmarks/device_pending.sh tma_phases  # phase stamps, tuned kernel against tma_rows
#   bash benchmarks/device_pending.sh l2_compare  # L2 / L1 counters: tuned kernel, tma_rows, SDPA
#   bash benchmarks/device_pending.sh gqa8        # a GQA group of 8 (Qwen3-MoE: 32 query / 4 kv
#                                                 # heads): the group of 4's tuned v3 configs it
#                                                 # takes since the thirty-ninth session against
#                                                 # the untuned v2 default it ran before (grid),
#                                                 # then bench_attention at those heads
#   bash benchmarks/device_pending.sh gqa         # one call for both: the GPU tests of v3 at groups
#                                                 # of 8 and of 16 (row blocks of 8, fortieth
#                                                 # session), the group-of-8 grid, the same grid at
#                                                 # 64 query / 4 kv heads (Qwen3-235B: v2 against v3
#                                                 # in two row blocks), then the bench at 32 / 4
#   bash benchmarks/device_pending.sh value_band2_half   # LaunchConfig.value_band2_half (forty-
#                                                 # first session, offline only): its GPU tests,
#                                                 # then a grid against the tuned config at three
#                                                 # carveout pairings
#   bash benchmarks/device_pending.sh token_sums_rows    # LaunchConfig.token_sums_rows (forty-
#                                                 # second session, offline only) and
#                                                 # value_band2_half (and warp_barriers): their GPU
#                                                 # tests, then a grid of them alone and together
#                                                 # against the tuned config (the next session's
#                                                 # first call)
#   bash benchmarks/device_pending.sh token_sums_rows_gqa8    # the same options at Qwen3-MoE's
#                                                 # 32 / 4 heads (GQA 8: every MMA column a row)
#   bash benchmarks/device_pending.sh head_dims   # the bench at head_dim 64 (gpt-oss's 64 / 8
#                                                 # heads) and 256 (32 / 8), which run the Triton
#                                                 # kernels (forty-first session)
#   bash benchmarks/device_pending.sh gpt_oss_moe # tiled_moe with gpt-oss's biases and clamped
#                                                 # SwiGLU: GPU tests, then bench_moe at its shape
#   bash benchmarks/device_pending.sh sinks       # learned sink logits (gpt-oss, forty-fifth session):
#                                                 # their GPU tests (every reduce mode, the split
#                                                 # kernel's channel merge) and the ring-window
#                                                 # kernel's (sliding layers), tiled_moe's biased
#                                                 # compiled launch, then bench_attention --sinks at
#                                                 # the issue's heads and at gpt-oss's 64 / 8, D 64,
#                                                 # bench_window (its sliding layers)
#   bash benchmarks/device_pending.sh window_suite     # the ring-window kernel's GPU tests and
#                                                 # bench_window (128-slot steps, 16-bit dots), then
#                                                 # the attention suite's GPU tests (`attention`
#                                                 # without its bench)
#   bash benchmarks/device_pending.sh bench_rounds     # bench_attention twice (the target's
#                                                 # robustness), then the ring-window kernel's GPU
#                                                 # tests and bench_window
#   bash benchmarks/device_pending.sh stacked     # v2 with stacked field operands (forty-sixth
#                                                 # session): the GPU tests that run v2 (head_dim 64
#                                                 # and 256, other layouts, prefill), then the bench at
#                                                 # gpt-oss's 64 / 8 heads, D 64, and the D 64 grid
#   bash benchmarks/device_pending.sh final46     # the issue's bench twice (sustained), then
#                                                 # gpt-oss's heads (64 / 8, D 64, sinks) at the
#                                                 # head_dim 64 config tuned this session, bench_window
#   bash benchmarks/device_pending.sh close3      # what issue 3 still waits on, in one call (about
#                                                 # 9 minutes): the bench twice on the H200, gpt-oss's
#                                                 # heads, then the attention suite with the tuned
#                                                 # config (its first run stopped on test configs,
#                                                 # mended in the forty-sixth session)
#   bash benchmarks/device_pending.sh one_sequence_d64   # gpt-oss's experts' direct path swept
#                                                 # at T = 1 / 2; its heads at one sequence: a
#                                                 # config grid
#   bash benchmarks/device_pending.sh next48      # the forty-seventh session's mended GPU tests,
#                                                 # bench_moe's decode rows, the head_dim-64 grid
#   bash benchmarks/device_pending.sh suite47     # head_dim 256's bench, then every GPU test on
#                                                 # eight workers (junit XML under $OUT)
#   bash benchmarks/device_pending.sh head_dim_grid    # Triton-kernel configs at head_dim 64
#                                                 # (64 / 8 heads) and 256 (32 / 8) against the
#                                                 # untuned default they run (forty-second session)
#   bash benchmarks/device_pending.sh split_carveout
#                                                 # LaunchConfig.split_carveout (fortieth session):
#                                                 # its GPU tests, then tma_rows at the split
#                                                 # kernel's full carveout against the tuned config
set -u
case "${1:-}" in
tests | attention | decode | inductor | overlap | profile | stalls | kvwarps | carveout | reduce | remainder | small_reduce | exact_remainder | key_word_pairs | clocks | zero_padding_p | value_subnormals | value_subnormals_sustained | band_columns | value_scales_staged | counted_steps | transform_in_split | one_sequence_merge | query_in_split | one_wave | merge_pass | final26 | small_bench | exact_tail_prologue | prologue_tiles | two_wave_tail | one_sequence_l2 | phases | one_sequence_28 | split_major_grid | tma_spike | tma_rows | tma_phases | l2_compare | gqa8 | gqa | split_carveout | head_dims | value_band2_half | token_sums_rows | token_sums_rows_gqa8 | head_dim_grid | gpt_oss_moe | sinks | window_suite | bench_rounds | stacked | final46 | close3 | suite47 | one_sequence_d64 | next48) ;;
grid | timeline | sustained)
    if [ ! -f "${2:-}" ]; then
        echo "$1 needs a JSON file of LaunchConfig dicts (e.g. benchmarks/configs/probe_one_block_step.json), got '${2:-}'" >&2
        exit 2
    fi
    ;;
*)
    echo "usage: bash benchmarks/device_pending.sh tests|attention|decode|inductor|overlap|profile|kvwarps|carveout|reduce|remainder|small_reduce|exact_remainder|key_word_pairs|clocks|zero_padding_p|value_subnormals|value_subnormals_sustained|band_columns|value_scales_staged|counted_steps|transform_in_split|one_sequence_merge|query_in_split|one_wave|merge_pass|final26|small_bench|exact_tail_prologue|prologue_tiles|two_wave_tail|one_sequence_l2|phases|one_sequence_28|split_major_grid|tma_spike|tma_rows|tma_phases|l2_compare|gqa8|gqa|split_carveout|head_dims|value_band2_half|token_sums_rows|token_sums_rows_gqa8|head_dim_grid|gpt_oss_moe|sinks|window_suite|bench_rounds|stacked|final46|close3|suite47|one_sequence_d64|next48|grid FILE.json|timeline FILE.json|sustained FILE.json|stalls [tuned|keys_in_step]" >&2
    exit 2
    ;;
esac
variant=tuned
if [ "$1" = stalls ]; then
    variant=${2:-tuned}
    case "$variant" in
    tuned | keys_in_step) ;;
    *)
        echo "stalls variant must be tuned or keys_in_step, got '$variant'" >&2
        exit 2
        ;;
    esac
fi
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/triton_cache}
# kernels/ and passes/ sit at the top level and are mapped into the package by pyproject's
# package-dir, so a PYTHONPATH entry cannot import wmoe_compile.kernels (and would shadow the
# install): install the checkout, offline (the device has no network, hence no build isolation).
python3 -c "import wmoe_compile.kernels" 2>/dev/null ||
    python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v -i warning

run() {
    local limit=$1
    shift
    echo "== $(date -u +%H:%M:%S) $*"
    # drop Python's warning lines, keep pytest's summary ("N passed, M warnings in ...")
    timeout "$limit" "$@" 2>&1 | grep -v -E "Warning: |warnings\.warn\(" | tail -40
}

# the attention GPU tests that -k "$1" selects, on six xdist workers where xdist is installed,
# within $2 seconds (240)
attention_tests() {
    local workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 6)
    # (-p no:benchmark: pytest-benchmark warns that xdist disables it)
    run "${2:-240}" python3 -P -m pytest -q -m gpu tests/test_wavelet_attention.py -p no:benchmark -k "$1" \
        ${workers[@]+"${workers[@]}"}
}

# probe_attention.py grid of the configs in $1 at the shapes $2, its JSON under $OUT/$3
probe_grid() {
    run "${4:-300}" python3 -P benchmarks/probe_attention.py grid --configs "$1" --shapes "$2" --out "$OUT/$3"
}

# probe_attention.py timeline of the configs in $1 at the shapes $2
probe_timeline() {
    run "${3:-150}" python3 -P benchmarks/probe_attention.py timeline --configs "$1" --shapes "$2"
}

# sustained A/B (probe_clocks.py --configs): each config of $1 (list A, B, A, B) replayed alone for
# 2.5 s at each shape of $2 ("B,N;B,N"), with the SM clock and power; JSON under $OUT/$3_BxN
probe_sustained() {
    local shape
    for shape in $(echo "$2" | tr ';' ' '); do
        run 120 python3 -P benchmarks/probe_clocks.py --out "$OUT/$3_${shape/,/x}" --shape "$shape" \
            --seconds 2.5 --configs "$1"
    done
}

case "${1:-}" in
tests)
    # six xdist workers share the GPU (the tests are small; their time is mostly compiling): the
    # attention suite's 91 GPU tests took 113 s this way (thirteenth session), over 10 minutes in
    # one process
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 6)
    run 560 python3 -P -m pytest -q -m gpu tests/ ${workers[@]+"${workers[@]}"}
    ;;
attention)
    # the suite's decode-shaped half (76 tests took 281 s in one process in the fifteenth session;
    # 90 now), on six xdist workers as `tests` runs them, then bench_attention (about 40 s)
    workers=()
    python3 -c "import xdist" 2>/dev/null && workers=(-n 6)
    # (-p no:benchmark: pytest-benchmark warns that xdist disables it, which -W error would make fatal)
    run 420 python3 -P -m pytest -q -m gpu tests/test_wavelet_attention.py ${workers[@]+"${workers[@]}"} \
        -p no:benchmark -k "real_shapes or v3 or kv_head or side_stream or long_split or repeated or layouts" \
        -W error::UserWarning
    run 180 python3 -P benchmarks/bench_attention.py --out "$OUT" --codec default --sustained 3
    ;;
decode)
    run 560 python3 -P benchmarks/bench_decode.py --codec default --shapes 8x131072,32x32768 --out "$OUT"
    ;;
inductor)
    # The wmoe step under Inductor config patches for the wmoe graph's generated code (the
    # baselines stay default torch.compile), in the order given, with the default first and last:
    #   bash benchmarks/device_pending.sh inductor '{"max_autotune_gemm": true}' ...
    # Measured (thirteenth session): triton.enable_pdl within noise (-0.2% / +0.3%), not kept.
    shift
    i=0
    for patch in '{}' "$@" '{}'; do
        run 200 python3 -P benchmarks/bench_decode.py --codec default --shapes 8x131072,32x32768 \
            --skip eager,inductor --out "$OUT/inductor_$i" --wmoe-inductor-config "$patch"
        i=$((i + 1))
    done
    ;;
overlap)
    # CompileConfig.overlap_cache_writes (on by default since the thirteenth session, -0.5 to
    # -0.9% a step): the decode step's KV cache writes on the attention's side stream. Tests first
    # (bit-identical results, eagerly and in CUDA graphs), then the step on / off / on.
    # with the seed that failed the compiled-model comparison in the fourteenth session (before its
    # compiles ran in Inductor's deterministic mode), then with a fresh one
    run 240 env WMOE_TEST_SEED=3830984124 python3 -P -m pytest -q -m gpu tests/test_overlap_cache_writes.py
    run 240 python3 -P -m pytest -q -m gpu tests/test_overlap_cache_writes.py -k compiled
    for on in on off on; do
        if [ "$on" = off ]; then extra=(--wmoe-off overlap_cache_writes); else extra=(); fi
        run 130 python3 -P benchmarks/bench_decode.py --codec default --shapes 8x131072,32x32768 \
            --skip eager,inductor --out "$OUT/overlap_$on" ${extra[@]+"${extra[@]}"}
    done
    ;;
profile)
    # from CUDA-graph replays, with the replayed step's timeline (idle gaps, back-to-back replays):
    # the whole report and the traces in $OUT, here the breakdown and the timeline
    echo "== $(date -u +%H:%M:%S) profile_decode.py --batch 8 --context 131072 --graph"
    timeout 400 python3 -P benchmarks/profile_decode.py --batch 8 --context 131072 --graph \
        --trace-dir "$OUT" > "$OUT/profile.txt" 2>&1
    echo "rc=$?"
    grep -A 12 "^| part" "$OUT/profile.txt"
    sed -n '/replay timeline/,$p' "$OUT/profile.txt" | head -45
    ;;
key_word_pairs)
    # a lane's two 4-bit key words by one 8-byte load: the v3 reference tests of its three configs
    # (a step ahead hinted, in-step hinted, a step ahead unhinted), then A/B in alternating rounds
    attention_tests "key_word_pairs"
    probe_grid benchmarks/configs/probe_key_word_pairs.json "8,131072;32,32768;8,32768" key_word_pairs 330
    probe_grid benchmarks/configs/probe_key_word_pairs_one_sequence.json "1,32768" key_word_pairs_one_sequence 120
    ;;
zero_padding_p)
    # twenty-second session: p = 0 in the MMAs' padding rows, for less tensor-core switching at the
    # power cap; an A/B that alternates every few ms shares the clock between both sides, so also
    # 2.5 s phases of each (A, B, A, B)
    attention_tests "bit_identical"
    probe_grid benchmarks/configs/probe_zero_padding_p.json "8,131072;32,32768;8,32768" zero_padding_p 200
    probe_sustained benchmarks/configs/probe_zero_padding_p_sustained.json "32,32768;8,131072" zero_padding_p
    ;;
value_subnormals)
    # twenty-third session: p scaled by packed fp16 multiplies (packed_p_scaling) and the value
    # fields as subnormals centred once at the store (value_subnormals): their GPU tests, the error
    # against the split's length, then A/B in alternating rounds and sustained phases
    attention_tests "v3_matches_reference or bit_identical or long_split or value_subnormals"
    run 120 python3 -P benchmarks/probe_value_precision.py --out "$OUT/value_precision"
    probe_grid benchmarks/configs/probe_value_subnormals.json "8,131072;32,32768;8,32768" value_subnormals 240
    probe_grid benchmarks/configs/probe_value_subnormals_one_sequence.json "1,32768" value_subnormals_one_sequence 90
    ;;
value_subnormals_sustained)
    # value_subnormals without packed_p_scaling, in alternating rounds; the tuned config (both)
    # against the twenty-second session's in sustained phases; then the bench
    attention_tests "bit_identical or value_subnormals"
    probe_grid benchmarks/configs/probe_value_subnormals_alone.json "8,131072;32,32768;8,32768" value_subnormals_alone 240
    probe_sustained benchmarks/configs/probe_value_subnormals_sustained.json "32,32768;8,131072" value_subnormals
    run 420 python3 -P benchmarks/bench_attention.py --out "$OUT" --codec default --sustained 3
    ;;
band_columns)
    # twenty-third session: the MMAs' padding columns serving the 2-bit band (band_columns): the
    # GPU tests, then A/B in alternating rounds and sustained phases, and at one sequence
    attention_tests "v3_matches_reference or bit_identical or long_split or value_subnormals"
    probe_grid benchmarks/configs/probe_band_columns.json "8,131072;32,32768;8,32768" band_columns 240
    probe_grid benchmarks/configs/probe_band_columns_one_sequence.json "1,32768" band_columns_one_sequence 90
    probe_sustained benchmarks/configs/probe_band_columns_sustained.json "32,32768;8,131072" band_columns
    ;;
value_scales_staged)
    # twenty-fourth session: the value scales staged by lane (value_scales_staged): GPU tests
    # (bit-identical, and against the reference), then the grid A/B and sustained phases
    attention_tests "bit_identical or (v3_matches_reference and staged)"
    probe_grid benchmarks/configs/probe_value_scales_staged.json "8,131072;32,32768" value_scales_staged 300
    probe_sustained benchmarks/configs/probe_value_scales_staged_sustained.json "32,32768;8,131072" value_scales_staged
    ;;
counted_steps)
    # prepared in the twenty-fourth session after its device budget was spent: the full-step loop
    # over step numbers (counted_steps; offline 8 fewer loop instructions): the GPU tests
    # (bit-identical, and against the reference), then 4 interleaved grid rounds, sustained phases
    # and 3 rounds at one sequence
    attention_tests "bit_identical or (v3_matches_reference and counted)"
    probe_grid benchmarks/configs/probe_counted_steps.json "8,131072;32,32768;8,32768" counted_steps 300
    probe_sustained benchmarks/configs/probe_counted_steps_sustained.json "32,32768;8,131072" counted_steps
    probe_grid benchmarks/configs/probe_counted_steps_one_sequence.json "1,32768" counted_steps_one_sequence 90
    ;;
transform_in_split)
    # twenty-fifth session: the split kernel maps its partial's sums to channels (fp16 MMAs with T
    # in fragment order) and the reduce is one merge: the GPU tests (against the reduce's own
    # transform and the reference), 4 interleaved grid rounds, one sequence (32 and 16 channels a
    # merge program), and the timeline of the call's tail
    attention_tests "transform_in_split"
    probe_grid benchmarks/configs/probe_transform_in_split.json "8,131072;32,32768;8,32768" transform_in_split 300
    probe_grid benchmarks/configs/probe_transform_in_split_one_sequence.json "1,32768" transform_in_split_one_sequence 120
    probe_timeline benchmarks/configs/probe_transform_in_split_timeline.json "32,32768;8,131072"
    ;;
one_sequence_merge)
    # twenty-fifth session, after transform_in_split took the transform out of the reduce: at one
    # sequence, longer splits (fewer partials and epilogues) and the merge's warps and channels
    probe_grid benchmarks/configs/probe_channel_merge_one_sequence.json "1,32768" channel_merge_one_sequence 150
    probe_timeline benchmarks/configs/probe_timeline_auto.json "1,32768;32,32768"
    ;;
query_in_split)
    # prepared in the twenty-fifth session after its device budget was spent: no prologue, the
    # split kernel transforms the query (offline +416 instructions a program, the loop unchanged).
    # The GPU tests (against the prologue's path and the reference, no prologue launched, a CUDA
    # graph), 4 grid rounds at the large shapes, one sequence (the tuned small config, the same
    # without its early loads, and with query_in_split at 384-, 256- and 512-token splits), then
    # both timelines
    attention_tests "query_in_split"
    probe_grid benchmarks/configs/probe_query_in_split.json "8,131072;32,32768;8,32768" query_in_split 300
    probe_grid benchmarks/configs/probe_query_in_split_one_sequence.json "1,32768" query_in_split_one_sequence 120
    probe_timeline benchmarks/configs/probe_query_in_split_timeline.json "32,32768"
    probe_timeline benchmarks/configs/probe_query_in_split_one_sequence_timeline.json "1,32768"
    # and (LaunchConfig.remainder_exact_steps, also prepared then) the plan at (32, 32768) with the
    # exact programs' work counted in the free slots: 6 splits of 84 steps and a short 7th of 6
    probe_grid benchmarks/configs/probe_remainder_exact.json "32,32768" remainder_exact 120
    ;;
one_wave)
    # twenty-sixth session, with query_in_split on in one wave (query_in_split_waves=1) and at one
    # sequence with 256-token splits: the GPU tests that name the prologue or the tuned configs,
    # one sequence's neighbours (split length, merge channels, exact chunks, carveout, key word
    # pairs; 3 rounds), (8, 131072) in one wave (equal or remainder splits, so no prologue) and
    # query_in_split in both waves, then the package's choice on the timeline at three shapes
    attention_tests "query_in_split or tuned or programmatic or repeated_calls or prologue"
    probe_grid benchmarks/configs/probe_one_sequence_26.json "1,32768" one_sequence_26 120
    probe_grid benchmarks/configs/probe_one_wave_26.json "8,131072;8,32768" one_wave_26 300
    probe_timeline benchmarks/configs/probe_timeline_auto.json "1,32768;8,32768;32,32768"
    ;;
merge_pass)
    # twenty-sixth session: at one sequence the merge took 2.7 us of 18.6 (133 partials: two
    # passes of 128) and 192-token splits cost +4.8%; merges in one pass (256 partials a load,
    # 320-token splits: 108 partials), 3 rounds; at the large shapes the exact-token kernel
    # enqueued before the split kernel (at (32, 32768) it ended 3.9 us after it) and
    # query_in_split in every launch (the remainder plan at (32, 32768) is 1,792 programs, over
    # one wave), 4 rounds
    probe_grid benchmarks/configs/probe_merge_pass_one_sequence.json "1,32768" merge_pass_one_sequence 120
    probe_grid benchmarks/configs/probe_exact_first.json "8,131072;32,32768;8,32768" exact_first 300
    ;;
final26)
    # the twenty-sixth session's last call: the attention target (its GPU tests, then the bench),
    # then at one sequence the exact tokens in 3 chunks and the merge in one pass of 256 partials
    # (-1.0% and -0.5% in 3 rounds of the merge_pass grid, within its spread), 4 rounds
    OUT="$OUT" bash "$0" attention
    probe_grid benchmarks/configs/probe_one_sequence_merge_26.json "1,32768" one_sequence_merge_26 120
    ;;
small_bench)
    # after final26: the small-launch config with 3 exact programs; the GPU tests that run it, then
    # the bench
    attention_tests "repeated or programmatic or matches_the_prologue or real_shapes"
    run 180 python3 -P benchmarks/bench_attention.py --out "$OUT" --codec default --sustained 3
    ;;
exact_tail_prologue)
    # prepared in the twenty-sixth session for the next: at (32, 32768) the exact-token programs
    # (1,280, 5 a pair) end 3.9 us after the split kernel, and where the prologue runs the split
    # programs wait for it from 1.0 to 4.4-4.6 us. Fewer exact programs (3, 2), the exact kernel's
    # carveout at any program count in up to two waves, the prologue on 1, 2 or 8 warps
    # (LaunchConfig.prologue_warps), and the merge (3.4-4.4 us) at 128 channels a program, on one
    # warp or two; its GPU tests first, 4 grid rounds, then timelines at (32, 32768)
    attention_tests "prologue_warps"
    probe_grid benchmarks/configs/probe_exact_tail_prologue.json "8,131072;32,32768;8,32768" exact_tail_prologue 300
    probe_timeline benchmarks/configs/probe_exact_tail_prologue_timeline.json "32,32768"
    ;;
prologue_tiles)
    # twenty-seventh session: after exact_tail_prologue (the exact kernel's carveout at any program
    # count -0.9% at (32, 32768), +4.0% at (8, 131072) in two waves): the carveout up to 2,048 exact
    # programs in one wave (so at (32, 32768), not in two waves), with 3 exact programs a pair; the
    # per-kv-head prologue in 16- or 32-row tiles (4 or 2x its 64 programs), its dot in one tf32
    # MMA; the GPU tests of those options, 4 rounds (each round's order rotated), timelines
    attention_tests "prologue_options"
    probe_grid benchmarks/configs/probe_prologue_tiles.json "32,32768;8,131072;8,32768" prologue_tiles 300
    probe_timeline benchmarks/configs/probe_prologue_tiles_timeline.json "32,32768"
    ;;
two_wave_tail)
    # twenty-seventh session, after the tf32 prologue: at (8, 131072) (two waves, the per-sequence
    # prologue, 320 exact programs without the carveout) the prologue on 2 or 8 warps, the merge at
    # 32 channels a program, 4 or 6 exact programs a pair; 5 rounds in rotated order, (32, 32768)
    # beside it
    probe_grid benchmarks/configs/probe_two_wave_tail.json "8,131072;32,32768" two_wave_tail 300
    ;;
tma_spike)
    # thirty-seventh session, prepared: the code rows by TMA copies (benchmarks/spike_tma_rows.py,
    # spike_tma_step.py; docs/ATTENTION.md, "One bulk copy per step and cache"). First whether the
    # copy and the band reads return the rows, then the step loop alone at (8, 131072)'s size with
    # two and three stages, against the tuned op's split kernel in the same call
    run 120 python3 -P benchmarks/spike_tma_rows.py --check
    for stages in 2 3; do
        run 180 python3 -P benchmarks/spike_tma_step.py --time --stages "$stages"
    done
    python3 -c "import dataclasses, json
from wmoe_compile.kernels import wavelet_attention as K
print(json.dumps([dataclasses.asdict(K.TUNED_CONFIGS[(128, 4, 'affine')])]))" > "$OUT/tuned.json"
    run 300 python3 -P benchmarks/probe_attention.py kernels --configs "$OUT/tuned.json" --shapes "8,131072" |
        sed -E 's/\{[^}]*\}/tuned/'
    ;;
tma_rows)
    # the split kernel with LaunchConfig.tma_rows (prepared in the thirty-seventh session): its GPU
    # tests (bit-identical to the same config without it, also with tma_rows_unfenced or
    # tma_rows_early, with or without scale_pairs_two_ahead: thirty-eighth session), and a grid
    # against the tuned config: [tuned, tma_rows at 2 stages, the same unfenced, early, early with
    # the scales two steps ahead, 3 stages unfenced] x 3 rounds
    attention_tests "tma_rows" 260
    run 320 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_tma_rows.json \
        --shapes "8,131072;32,32768;8,32768" --out "$OUT/tma_rows" | grep -v "^\["
    ;;
gqa8)
    # thirty-ninth session: a GQA group of 8 query rows (block_m 8) ran LaunchConfig() (v2,
    # untuned) until this session put the group of 4's tuned configs in for it (v3; GPU-tested
    # correct at a group of 8, the same loop offline, not timed). Grid: [the old default, the large
    # launches' config, the one-sequence config (band_columns and cta_splits off: both need 4
    # rows)] x 3 rounds at 32 query / 4 kv heads; then the bench at those heads with the package's
    # own choice, SDPA beside it: the speedup a Qwen3-MoE user sees
    run 300 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_gqa8.json \
        --heads 32,4 --shapes "8,131072;32,32768;8,32768;1,32768" --out "$OUT/gqa8" | grep -v "^\["
    run 200 python3 -P benchmarks/bench_attention.py --out "$OUT/gqa8_bench" --codec default --heads 32,4
    ;;
gqa)
    # fortieth session: the gqa8 grid and bench (above) in one call with the group of 16: v3 takes
    # more than 8 rows in row blocks of 8 (before, a v3 config fell back to v1 there, and the
    # package's own choice at 16 rows is still the untuned v2 default). The grids' per-config lines
    # are kept, so a grid stopped by its limit still reports what it measured.
    attention_tests "group_of_8_rows or more_than_8_rows" 150
    run 170 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_gqa8.json \
        --heads 32,4 --shapes "8,131072;32,32768;1,32768" --out "$OUT/gqa8"
    run 170 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_gqa16.json \
        --heads 64,4 --shapes "8,131072;32,32768;1,32768" --out "$OUT/gqa16"
    run 100 python3 -P benchmarks/bench_attention.py --out "$OUT/gqa8_bench" --codec default --heads 32,4
    ;;
value_band2_half)
    # forty-first session, offline: the 2-bit value band's tiles [64, 8] (4 fewer copies, 2 fewer
    # ldmatrix a step, 3.5 KB of shared memory a program instead of 4.5, where 12 programs fit the
    # 64 KB carveout: L1 192 KB instead of 156), and the tiles by 16-byte copies through L1
    # (value_copies_16b_l1: 6 copies a step with the half tiles, 719 loop instructions against
    # 728). Bit-identity tests, then [tuned, half at the driver's split carveout, half at 44%
    # (tuned's 100 KB), half with the split and exact kernels at 28% (64 KB), half at 2 ring
    # stages (7.5 KB a program: 12 still fit 100 KB), half + 16-byte copies through L1, 16-byte
    # copies through L1 alone] x 3 rounds
    attention_tests "value_band2_half" 240
    run 330 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_value_band2_half.json \
        --shapes "8,131072;32,32768;8,32768" --out "$OUT/value_band2_half" | grep -v "^\["
    ;;
token_sums_rows)
    # forty-second session, offline: the token sums (p, p * each band's scale) from one MMA whose
    # operand rows are ones and the staged scales (8 MMAs and 8 rescale multiplies fewer a step;
    # 727 loop instructions against 728 alone, 710 with value_band2_half against its 725, Triton
    # 3.6). The GPU tests of it and of value_band2_half (neither has run on a GPU), then [tuned,
    # half, rows, half + rows, half + rows with the split and exact kernels at 28% (12 programs of
    # 5 KB in 64 KB: L1 192 KB), half + rows at a 152-register cap (13 programs an SM; 704 loop
    # instructions and no spill on Triton 3.6, where the tuned step spills there), half + rows with
    # warp barriers (warp_barriers: no BAR.SYNC in the step)] x 3 rounds. The half tiles' 12
    # programs fit 64 KB, where the driver would put the split kernel and the exact kernel (44%,
    # 100 KB) could no longer share its SMs: so the half-tile configs run at 44% too (the tuned
    # kernel's carveout), and one at 28% with the exact kernel beside it
    attention_tests "value_band2_half or token_sums_rows or warp_barriers" 270
    run 240 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_token_sums_rows.json \
        --shapes "8,131072;32,32768" --out "$OUT/token_sums_rows" | grep -v "^\["
    ;;
gpt_oss_moe)
    # forty-fourth session: wmoe::tiled_moe with gpt-oss's expert biases and clamped SwiGLU (never
    # run on a GPU): its GPU tests (every kernel path at gpt-oss-20b's shape against the fp32
    # reference), then bench_moe at that shape against transformers' GptOssExperts loop and its
    # grouped_mm forward, and the mixtral shape's decode rows (the bias-free kernels unchanged)
    run 200 python3 -P -m pytest -q -m gpu tests/test_tiled_moe_gpt_oss.py -p no:benchmark
    run 240 python3 -P benchmarks/bench_moe.py --out "$OUT/gpt_oss_moe" --shapes gpt-oss mixtral \
        --tokens 1 8 64 256 --no-direct-sweep
    ;;
sinks)
    # forty-fifth session: wmoe::wavelet_attention's learned sink logits (never run on a GPU)
    # and its sliding windows over the exact ring (kernels/window_attention.py)
    run 240 python3 -P -m pytest -q -m gpu tests/test_attention_sinks.py tests/test_window_attention.py \
        tests/test_tiled_moe_gpt_oss.py -p no:benchmark -k "sinks or window or compiled_launches"
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/sinks" --codec default --sinks
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/sinks_d64" --codec default --sinks \
        --heads 64,8 --head-dim 64
    run 120 python3 -P benchmarks/bench_window.py --out "$OUT/window"
    ;;
window_suite)
    # forty-fifth session: the ring-window kernel after its first timing (3.5x SDPA over a dense
    # window on an H100: latency), then the attention GPU suite with the forty-fourth session's
    # tuned default (never run on a GPU with it)
    run 150 python3 -P -m pytest -q -m gpu tests/test_window_attention.py -p no:benchmark
    run 120 python3 -P benchmarks/bench_window.py --out "$OUT/window"
    attention_tests "real_shapes or v3 or kv_head or side_stream or long_split or repeated or layouts" 330
    ;;
bench_rounds)
    # forty-sixth session: the issue's target met in one H200 run (forty-fourth session); two more
    # rounds of the bench, then the ring-window kernel's second version (both ran on an H100 at
    # 15:05-15:07: RESULTS.md, forty-sixth session)
    run 170 python3 -P benchmarks/bench_attention.py --out "$OUT/round1" --codec default --sustained 3
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/round2" --codec default --sustained 3
    run 120 python3 -P -m pytest -q -m gpu tests/test_window_attention.py -p no:benchmark
    run 100 python3 -P benchmarks/bench_window.py --out "$OUT/window"
    ;;
stacked)
    # forty-sixth session: narrow chunks' operands stack bit fields (head_dim 64: 8 MMAs a step in
    # place of 18); before it, 4.3-9.6x the floor, 0.86-1.43x SDPA (H100, forty-fifth session)
    attention_tests "real_shapes or other_layouts or multi_token or full_channel or long_split" 240
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/d64" --codec default --heads 64,8 --head-dim 64
    run 200 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_head_dim64.json \
        --head-dim 64 --heads 64,8 --shapes "8,131072;32,32768;1,32768" --out "$OUT/head_dim64" | grep -v "^\["
    ;;
final46)
    # forty-sixth session: the H200 rounds of the target (two ran on an H100 at 15:05-15:07) and
    # head_dim 64's tuned v2 config (timed on an H100 only)
    run 170 python3 -P benchmarks/bench_attention.py --out "$OUT/round1" --codec default --sustained 3
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/round2" --codec default --sustained 3
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/d64" --codec default --heads 64,8 --head-dim 64 --sinks
    run 100 python3 -P benchmarks/bench_window.py --out "$OUT/window"
    # v2 at head_dim 64 holds 185 registers (10 one-warp programs an SM; 3 stages' 18 KB of shared
    # memory allow 12): caps of 96-160 (offline: 128 spills 9 words, 96 36) at 2 and 3 stages, and
    # value_words_once (158 registers offline)
    run 150 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_head_dim64_regs.json \
        --head-dim 64 --heads 64,8 --shapes "8,131072;32,32768;1,32768;8,32768" --out "$OUT/regs" | grep -v "^\["
    attention_tests "real_shapes or other_layouts" 120
    ;;
close3)
    # forty-seventh session on: run on an H200 (the reply's device must say so)
    run 150 python3 -P benchmarks/bench_attention.py --out "$OUT/round1" --codec default --sustained 3
    run 120 python3 -P benchmarks/bench_attention.py --out "$OUT/round2" --codec default --sustained 3
    run 80 python3 -P benchmarks/bench_attention.py --out "$OUT/d64" --codec default --heads 64,8 --head-dim 64 --sinks
    attention_tests "real_shapes or v3 or kv_head or side_stream or long_split or repeated or layouts" 330
    ;;
suite47)
    # forty-seventh session: close3's suite stopped at its 330 s limit after 323 of 326 tests (all
    # passed): head_dim 256's first timing, then every GPU test of the package on eight workers,
    # each test's result in $OUT/gpu_suite.xml
    run 80 python3 -P benchmarks/bench_attention.py --out "$OUT/d256" --codec default --head-dim 256
    run 500 python3 -P -m pytest -q -m gpu -p no:benchmark -n 8 --junitxml "$OUT/gpu_suite.xml"
    ;;
next48)
    # what the forty-seventh session left unrun (about 7 minutes): the GPU tests mended after its
    # device time ran out (the carveout tests' kept-variant reset), the MoE, overlap, window and
    # lowering ones (cleanup_graph now drops eager attentions' unused dropouts), then
    # bench_moe's decode rows (direct and grouped paths, graph and eager) at the three shapes and
    # T = 1 / 2 / 8, then gpt-oss's heads at one sequence, two more rounds of its grid
    run 150 python3 -P -m pytest -q -m gpu tests/test_tiled_moe_gpt_oss.py tests/test_tiled_moe.py \
        tests/test_overlap_cache_writes.py tests/test_window_attention.py tests/test_lowering_gpu.py -p no:benchmark
    attention_tests "carveout" 90
    run 200 python3 -P benchmarks/bench_moe.py --out "$OUT/moe_decode" --shapes mixtral fine gpt-oss --tokens 1 2 8 \
        --no-grouping --no-direct-sweep
    run 90 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_head_dim64_one_sequence.json \
        --head-dim 64 --heads 64,8 --shapes "1,32768;1,8192" --out "$OUT/one_sequence_d64"
    ;;
one_sequence_d64)
    # forty-seventh session: gpt-oss's experts at T = 1 / 2 ran the direct path at 1.96x the
    # weight-read floor (the "small" class's config, 180 / 90 programs on 132 SMs): its candidates
    # swept at gpt-oss-20b's own dims, then the benchmark rows. gpt-oss's heads at one sequence ran
    # 0.93x SDPA on the H200 with the large launches' config (split 15.3 us, reduce 4.6, prologue
    # 2.8): split lengths, stages, the merge's warps and step shapes against it, one round (the
    # session's device time was short)
    run 90 python3 -P benchmarks/bench_moe.py --out "$OUT/moe_direct" --shapes gpt-oss --tokens 1 2 --no-grouping
    run 60 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_head_dim64_one_sequence.json \
        --head-dim 64 --heads 64,8 --shapes "1,32768" --out "$OUT/one_sequence_d64"
    ;;
token_sums_rows_gqa8)
    # forty-second session: the group of 8's configs are the group of 4's (thirty-ninth session),
    # with every MMA column a query row; [tuned, half, half + rows, half + rows with warp
    # barriers] x 3 rounds at 32 / 4 heads (the GPU tests of the token_sums_rows case cover
    # groups of 8)
    run 200 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_token_sums_rows_gqa8.json \
        --heads 32,4 --shapes "8,131072;32,32768" --out "$OUT/token_sums_rows_gqa8" | grep -v "^\["
    ;;
head_dims)
    # forty-first session: no bench had timed head_dim 64 or 256 (the Gluon split kernel takes 128
    # only; these run Triton v1 / v2 at the package's default configs)
    run 240 python3 -P benchmarks/bench_attention.py --out "$OUT/d64" --codec default --heads 64,8 --head-dim 64
    run 240 python3 -P benchmarks/bench_attention.py --out "$OUT/d256" --codec default --head-dim 256
    ;;
head_dim_grid)
    # forty-second session: head_dim 64 (gpt-oss's 64 / 8 heads) and 256 run the Triton kernels at
    # default_config, never tuned. Grids of [the default, + PDL and the large launches' reduce, +
    # 128-token steps / 3 stages / more splits / every-step rescale / 2 warps, v1] x 2 rounds; the
    # configs pass the interpreter at those head_dims (tests/test_probe_configs.py)
    run 280 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_head_dim64.json \
        --head-dim 64 --heads 64,8 --shapes "8,131072;32,32768;1,32768" --out "$OUT/head_dim64" | grep -v "^\["
    run 280 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_head_dim256.json \
        --head-dim 256 --shapes "8,131072;32,32768;1,32768" --out "$OUT/head_dim256" | grep -v "^\["
    ;;
split_carveout)
    # fortieth session: every tma_rows variant ran +54 to +57% at the driver's carveout (grid,
    # 04:16 UTC); 12 resident programs of 16.9 KB need the SM's whole 228 KB. Grid: [tuned, tma_rows
    # unfenced / early / 3 stages unfenced at split_carveout=100, unfenced at the driver's choice,
    # tuned at 100] x 2 rounds at the two target shapes
    attention_tests "split_carveout" 100
    run 300 python3 -P benchmarks/probe_attention.py grid --configs benchmarks/configs/probe_tma_split_carveout.json \
        --shapes "8,131072;32,32768" --out "$OUT/split_carveout" | grep -v "^\["
    ;;
tma_phases)
    # thirty-eighth session, prepared: where a split program's time goes with the code rows by TMA
    # (tma_rows at 2 stages, unfenced; early; early with the scales two ahead) against the tuned
    # kernel, all stamped
    # (phase_clocks), at the large shapes: each full step's time, and when the programs end
    run 300 python3 -P benchmarks/probe_attention.py phases --configs benchmarks/configs/probe_tma_rows_phases.json \
        --shapes "8,131072;32,32768" --out "$OUT"
    ;;
l2_compare)
    # thirty-seventh session, prepared: Nsight Compute put the tuned split kernel at (8, 131072) at
    # 79% of DRAM's peak and 88.5% of L2's (L1 hits 38.7%); the same counters for bf16 SDPA's
    # kernel at the same shape say how much of L2's load is the decode stream itself (SDPA reads
    # 4.3 GB at about 4.6 TB/s) and how much our small requests add
    config=$(python3 -c "import dataclasses, json
from wmoe_compile.kernels import wavelet_attention as K
print(json.dumps(dataclasses.asdict(K.TUNED_CONFIGS[(128, 4, 'affine')])))")
    metrics=lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_requests_srcunit_tex.sum
    metrics=$metrics,dram__bytes_read.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
    metrics=$metrics,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,sm__inst_executed.sum
    sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --print-details all)
    run 180 ncu --clock-control none -k regex:split_kernel_v3 --launch-skip 1 --launch-count 1 \
        "${sections[@]}" --metrics "$metrics" \
        python3 -P benchmarks/probe_attention.py once --shape 8,131072 --config "$config" |
        grep -E "lts__|dram__|l1tex__|sm__inst|Duration|Throughput|L2:|DRAM:|L1:"
    # thirty-eighth session: the same counters with the code rows by TMA copies (tma_rows at two
    # stages, unfenced), whose whole-row copies should ask L2 for fewer, fuller requests
    config=$(python3 -c "import dataclasses, json
from wmoe_compile.kernels import wavelet_attention as K
tuned = K.TUNED_CONFIGS[(128, 4, 'affine')]
tma = dataclasses.replace(tuned, num_stages=2, keys_ahead=False, key_word_pairs=False, tma_rows=True,
                          tma_rows_unfenced=True)
print(json.dumps(dataclasses.asdict(tma)))")
    echo "== tma_rows, 2 stages, unfenced"
    run 180 ncu --clock-control none -k regex:split_kernel_v3 --launch-skip 1 --launch-count 1 \
        "${sections[@]}" --metrics "$metrics" \
        python3 -P benchmarks/probe_attention.py once --shape 8,131072 --config "$config" |
        grep -E "lts__|dram__|l1tex__|sm__inst|Duration|Throughput|L2:|DRAM:|L1:"
    cat > "$OUT/sdpa_once.py" <<'PY'
import torch
import torch.nn.functional as F

q = torch.randn(8, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
k = torch.randn(8, 8, 131072, 128, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
for _ in range(3):
    F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
PY
    run 180 ncu --clock-control none -k regex:"flash|fmha|attention|sdpa|cutlass" --launch-skip 1 \
        --launch-count 1 "${sections[@]}" --metrics "$metrics" python3 -P "$OUT/sdpa_once.py" |
        grep -E "lts__|dram__|l1tex__|sm__inst|Duration|Throughput|L2:|DRAM:|L1:"
    ;;
one_sequence_l2)
    # twenty-seventh session: at one sequence each of the split kernel's 1,024 programs reads 32 KB
    # of query-transform and 32 KB of epilogue-transform words from L2 (64 MB a call, beside 27.7 MB
    # of cache from DRAM). Nsight Compute's throughputs for one launch of the small-launch config
    # say whether L2 or DRAM is near its peak
    config=$(python3 -c "import dataclasses, json
from wmoe_compile.kernels import wavelet_attention as K
print(json.dumps(dataclasses.asdict(K.SMALL_LAUNCH_CONFIGS[(128, 4, 'affine')])))")
    run 300 ncu --clock-control none -k regex:split_kernel_v3 --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
        --section LaunchStats --section Occupancy --section WarpStateStats \
        -f -o "$OUT/one_sequence_l2" python3 -P benchmarks/probe_attention.py once --shape 1,32768 --config "$config"
    timeout 120 ncu -i "$OUT/one_sequence_l2.ncu-rep" --page details --print-details all \
        > "$OUT/one_sequence_l2_details.txt" 2>&1
    grep -E "Duration|Throughput|Hit Rate|Busy|Achieved Occupancy|Stall|Warp Cycles|Elapsed Cycles|SM Frequency" \
        "$OUT/one_sequence_l2_details.txt" | head -60
    ;;
phases)
    # twenty-eighth session: where a split program's time goes (LaunchConfig.phase_clocks: each
    # program stamps the globaltimer after the wait, its query transform, each full step, its
    # masked steps and its epilogue). The stamps' GPU test, then one sequence at 256- (the tuned),
    # 512- and 128-token splits, and the package's configs at (8, 32768) and (32, 32768)
    attention_tests phase_clocks
    run 200 python3 -P benchmarks/probe_attention.py phases --configs benchmarks/configs/probe_phases_one_sequence.json \
        --shapes "1,32768" --out "$OUT"
    echo '["auto"]' > /tmp/auto.json
    run 150 python3 -P benchmarks/probe_attention.py phases --configs /tmp/auto.json \
        --shapes "8,32768;32,32768" --out "$OUT"
    ;;
one_sequence_28)
    # twenty-eighth session: one sequence is latency-bound with 7.75 programs an SM, so the
    # large launches' limits need not hold there: value tiles a step ahead (2 stages), and register
    # caps of 232 / 255 (8 programs an SM, still one wave; ptxas then issues 41-46 of the query
    # transform's 64 tile loads before its first MMA instead of 26), and both. 4 rounds, base first
    probe_grid benchmarks/configs/probe_one_sequence_28.json "1,32768" one_sequence_28 200
    ;;
split_major_grid)
    # twenty-eighth session: LaunchConfig.split_major_grid (an SM's resident blocks hold 2 kv heads
    # instead of 8 at one sequence, so their transform words may hit L1). GPU tests, one sequence
    # (5 rounds) with the phase stamps, then (8, 32768), the other launch that transforms the query
    # in its split kernel, and the large shapes (4 rounds)
    attention_tests split_major_grid
    probe_grid benchmarks/configs/probe_split_major_one_sequence.json "1,32768" split_major_one_sequence 150
    run 120 python3 -P benchmarks/probe_attention.py phases --configs benchmarks/configs/probe_phases_split_major.json \
        --shapes "1,32768" --out "$OUT/split_major_phases"
    probe_grid benchmarks/configs/probe_split_major.json "8,32768;8,131072;32,32768" split_major 240
    ;;
sustained)
    # an A/B that alternates every few milliseconds shares one clock between both sides; at the
    # power cap a config's energy per call sets its clock, so each config also runs alone
    probe_sustained "$2" "${3:-32,32768;8,131072}" sustained
    ;;
clocks)
    # twenty-second session: under sustained load the op ran at the power cap (SW power cap
    # throttle reason, SM clock 1730-1880 MHz instead of 1980) and slowed 3-5%; SDPA did not
    for shape in 32x32768 8x131072; do
        run 120 python3 -P benchmarks/probe_clocks.py --out "$OUT/clocks_$shape" --shape "${shape/x/,}"
    done
    ;;
grid)
    # (an optional third argument: the shapes, "B,N;B,N")
    run 400 python3 -P benchmarks/probe_attention.py grid --configs "$2" \
        --shapes "${3:-8,131072;32,32768;8,32768}" --out "$OUT"
    ;;
timeline)
    # eighteenth session: the exact-token kernel's tail and the reduce, outside the split kernel
    run 300 python3 -P benchmarks/probe_attention.py timeline --configs "$2" \
        --shapes "8,131072;32,32768;1,32768"
    ;;
carveout)
    # nineteenth session: the exact-token kernel waited for SMs of the split kernel's carveout to
    # drain; measured through probe_attention.py timeline --carveouts (one sequence -3%, (32, 32768)
    # +1.2%). The launcher's option: the variant's attribute read back, bit-identical outputs (also
    # from a CUDA graph), then the op A/B'd, interleaved
    attention_tests "carveout or programmatic_dependent"
    probe_grid benchmarks/configs/probe_exact_carveout_one_sequence.json "1,32768" carveout_one 120
    probe_grid benchmarks/configs/probe_exact_carveout.json "8,131072;32,32768;8,32768" carveout 200
    ;;
reduce)
    # twentieth session: at (32, 32768) the per-row merge took 8.2 us with four warps a row, 4.2 with
    # one (reduce_merge_warps, tuned); here the same merge and the transform kernel at B = 8 too
    # (reduce_gemm_min_rows 256, where the per-row reduce with the transform runs now), and the
    # exact kernel's carveout with 1,280 exact programs (exact_carveout_programs 0)
    attention_tests "carveout or programmatic_dependent"
    probe_grid benchmarks/configs/probe_reduce_merge.json "8,131072;32,32768;8,32768" reduce
    probe_timeline benchmarks/configs/probe_reduce_merge_timeline.json "8,131072;8,32768"
    ;;
remainder)
    # twentieth session, prepared: one-wave launches cut into long splits and a short last one,
    # launched split-major (SplitPlan); modelled 86 -> 84 steps a slot at (32, 32768), 23 -> 22 at
    # (8, 32768), 86 -> 85 at (8, 131072) (one wave instead of two). The v3 tests first (the plan
    # against fp32 SDPA and equal splits, from a CUDA graph; the compile-time constexpr SPLIT_MAJOR).
    # The grid's third config keeps the exact kernel's carveout at (8, 32768), which the plan's
    # 1,600 split programs (more than a wave) would turn off
    attention_tests "split_major or programmatic_dependent"
    probe_grid benchmarks/configs/probe_remainder_split.json "8,131072;32,32768;8,32768" remainder
    probe_timeline benchmarks/configs/probe_remainder_split_timeline.json "32,32768;8,32768"
    ;;
small_reduce)
    # twentieth session, prepared: at one sequence the per-row reduce (32 programs, each merging 133
    # partials and reading the whole transform) took 6.3 us. Each row's merge in 4 or 8 slices of
    # channels then the transform kernel cost 3.9 + 3.1 us with four-warp merges (nineteenth
    # session); one-warp merges (no barriers in the sum; 207 / 124 registers offline) may change that
    probe_grid benchmarks/configs/probe_small_reduce.json "1,32768" small_reduce 200
    probe_timeline benchmarks/configs/probe_small_reduce_timeline.json "1,32768" 120
    ;;
exact_remainder)
    # twenty-first session: with the remainder split at (32, 32768) the exact-token kernel's
    # programs start at 198 us and end 2.3 us after the split kernel (timeline), on the critical
    # path: 3 or 8 exact programs per pair instead of 5, or the exact kernel enqueued first
    probe_grid benchmarks/configs/probe_exact_with_remainder.json "32,32768;8,131072" exact_remainder 240
    ;;
kvwarps)
    # fifteenth session: partials bit-identical to v3's, 0.79x its token rate (RESULTS.md, issue 3)
    run 300 python3 -P benchmarks/probe_kv_warps.py
    ;;
stalls)
    # One launch of the v3 split kernel at (8, 131072), tuned or with the key words loaded in
    # their own step (RESULTS.md, sixteenth and seventeenth sessions: loaded in-step, the warps wait
    # on the key words' first use; the tuned step loads them a step ahead).
    # (the tuned config as the package has it now, not a copy that goes stale)
    config=$(python3 -c "import dataclasses, json
from wmoe_compile.kernels import wavelet_attention as K
c = dataclasses.asdict(K.TUNED_CONFIGS[(128, 4, 'affine')])
v = '$variant'
print(json.dumps(c if v == 'tuned' else {**c, 'keys_ahead': False}))")
    run 420 ncu --clock-control none -k regex:split_kernel_v3 --launch-skip 1 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section SourceCounters \
        --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --import-source yes -f -o "$OUT/${variant}_stalls" \
        python3 -P benchmarks/probe_attention.py once --shape 8,131072 --config "$config"
    timeout 120 ncu -i "$OUT/${variant}_stalls.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/${variant}_stalls_sass.csv" 2> "$OUT/${variant}_stalls_sass.err"
    timeout 120 ncu -i "$OUT/${variant}_stalls.ncu-rep" --page details --print-details all \
        > "$OUT/${variant}_details.txt" 2>&1
    echo "per-SASS-line samples: $OUT/${variant}_stalls_sass.csv ($(wc -l < "$OUT/${variant}_stalls_sass.csv") lines)"
    grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Issue Slots|lts__|Hit Rate" \
        "$OUT/${variant}_details.txt" | head -40
    ;;
esac
