"""Launch configurations of the decode attention op (`wmoe::wavelet_attention`) and how a launch is
sized: which kernel and options run, measured on an H200 (benchmarks/bench_attention.py,
probe_attention.py; no per-call autotune), and how the compressed range is cut into splits.

Why a module of its own: the tuned configs carry the measurement history that chose them, and the
split count is pure arithmetic that tests check without a GPU; neither needs the kernels.
(``tuned_config``, which also reads the layout's grids, stays beside the kernels.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from .attention_plans import V3_MAX_ROWS

if TYPE_CHECKING:
    from .wavelet_attention import CompressedLayout


@dataclass(frozen=True)
class LaunchConfig:
    block_n: int = 64  # compressed tokens per loop step
    num_warps: int = 1
    num_stages: int = 2
    use_asm: bool = True  # field extraction in inline PTX (GPU only, never interpreted)
    ctas_per_sm: float = 16.0  # flash-decoding splits: aim for this many programs per SM ...
    min_split_tokens: int = 512  # ... but give each split at least this many compressed tokens
    exact_block: int = 32  # exact sink/window tokens per step (64 spills v2's registers)
    # v3: the exact sink/window tokens' kernel cut into this many programs per (sequence, kv head),
    # each writing its own partial. One program per pair runs 132 tokens in 5 serial steps: 6.8 us
    # alone at one sequence, and beside the split kernel's last programs (sharing their SMs' issue
    # slots) it ended 2.7-5.9 us after them at the large decode shapes (eighteenth session)
    exact_chunks: int = 1
    # "v1": byte planes (every layout); "v2": int16 field planes (affine layouts; else v1 runs);
    # "v3": the Gluon kernel (kernels/wavelet_attention_gluon.py; its layout family on CUDA, else v1)
    kernel: str = "v2"
    # v2 operand encoding. False: 1024-offset "magic" fields, values centred to small exact integers
    # (one packed subtract per pair). True: fields as fp16 subnormals (no offset, no subtract; ~4%
    # faster measured), but the value sums then carry the grid offset and cancel against it at the
    # end: with diffuse attention over one 32k-token split the error reached 1.0e-2 on the H200.
    subnormal: bool = False
    # rescale the accumulators only when a running max grows (a branch in the loop); the tuned v3
    # rescales every step instead (one basic block, fifteenth session)
    lazy_rescale: bool = True
    row_reduce_max_programs: float = 1.0  # per-row reduce while query rows <= this x SMs
    # per-row reduce: split partials merged per wide load (power of 2); a launch with fewer splits
    # merges the next power of two above its count (a wider load would only carry masked lanes)
    reduce_split_chunk: int = 16
    # decode (one row block per sequence and kv head) with the per-row reduce and at least this many
    # query rows: merge per row, then the inverse transform as one dot per kv head over the rows of
    # all sequences (_transform_heads_kernel), instead of every row's program reading the whole
    # transform; 0: never
    reduce_gemm_min_rows: int = 0
    # with reduce_gemm_min_rows: each merge program takes this many of a row's D sums (a power of
    # two), so a row's merge spreads over D / this programs instead of one; 0: all D. Nineteenth
    # session: at one sequence merge 3.9 + transform 3.1 us against the per-row reduce's 6.1, the op
    # 3-5% slower (a second kernel's fixed cost): off
    reduce_merge_channels: int = 0
    reduce_warps: int = 4  # per-row reduce: warps per program
    # with reduce_gemm_min_rows: the per-row merge's warps per program (0: reduce_warps). One warp
    # sums a row's partials in its own registers; four split them across warps and meet through
    # shared memory (10 barriers). Twentieth session (H200): the merge at (32, 32768) 8.2 -> 4.2 us,
    # the op 0.2596 / 0.2593 -> 0.2549 / 0.2549 ms (two warps 0.2558 / 0.2553). A kernel merging and
    # transforming 16-row tiles of one kv head in one launch took 10.9 us there against 8.3 for
    # this merge and the transform kernel (64 programs, each waiting on its partials in turn): dropped
    reduce_merge_warps: int = 0
    # with reduce_gemm_min_rows: _transform_heads_kernel's output channels and warps per program.
    # Twentieth session (H200, (32, 32768), two rounds): 32 and 4 0.2502 / 0.2508 ms; 8 warps
    # 0.2536 / 0.2543, 64 channels 0.2519 / 0.2515, both 0.2508 / 0.2513
    transform_channels: int = 32
    transform_warps: int = 4
    # per-row reduce: the transform loaded before the partials are merged (overlapping the loads)
    reduce_transform_first: bool = False
    maxnreg: int | None = None  # split kernel register cap: 168 -> 12 one-warp programs per SM
    # affine value fields centred through the MMA's accumulator input (see _band_values) instead of
    # one packed subtract per operand pair
    centre_in_mma: bool = False
    # v2: a stacked value chunk's int16 words loaded once ([n_elems, tokens]) and repeated for its
    # stacked fields by a reshape (through shared memory) instead of loaded once per field group
    # (offline, head_dim 64: 158 registers instead of 185, 102 cp.async instead of 132; 66 more
    # shared-memory stores)
    value_words_once: bool = False
    keys_via_smem: bool = False  # v3: key code tiles through the cp.async ring (else loaded per step)
    # v3: the next step's key words are loaded into registers (as int32 words) as soon as this step's
    # scores have used theirs, so their latency overlaps this step's value work (24 more live
    # registers; tuned since the seventeenth session, with step_row_base and score_offset_in_mma)
    keys_ahead: bool = False
    cache_tiles: bool = False  # v3: the ring's copies through L1 (cp.async.ca)
    convert_p_once: bool = False  # v3: p to the value MMAs' layout once, scales applied after
    # v3 with cache_tiles: the value tiles' token indices made in their copies' layout instead of
    # shuffled into it each step (offline: 912 loop instructions instead of 928)
    copy_layout_tokens: bool = False
    # v3 with convert_p_once: the value scales split straight into the value MMAs' K layout in fp16
    # (one conversion instead of two; offline 919 loop instructions instead of 928, 904 with
    # copy_layout_tokens)
    value_scales_in_b: bool = False
    # v3: each band's score offset as its first key MMA's accumulator input instead of an add per
    # score (offline 882 loop instructions instead of 904; sixteenth session: no faster, alone or
    # with p_movmatrix; eleventh session, with the branchy step and alone: 6-12% slower; tuned with
    # keys_ahead, where it leaves ptxas room enough to spill nothing)
    score_offset_in_mma: bool = False
    # v3 with convert_p_once: p taken to the value MMAs' B layout by one movmatrix.trans per 8 x 8
    # block instead of a shuffle conversion (offline 886 instead of 904; -1.0 to -1.6%, tuned)
    p_movmatrix: bool = False
    # v3, keys loaded from global memory: the key words' loads ask L2 to fetch the 256-byte block on
    # a miss (ld.global.L2::256B), so the next rows' requests find it there (seventeenth session:
    # -4%, tuned)
    key_loads_l2_256b: bool = False
    # v3, keys loaded from global memory: a lane's two 4-bit-band key words sit side by side in
    # memory (the plan orders that band's key slots so: slots 2t, 2t + 1 take elements 4t, 4t + 1
    # and slots 2t + 8, 2t + 9 take 4t + 2, 4t + 3), so they arrive by one 8-byte load instead of
    # two 4-byte ones: 16 key loads a step instead of 24, and one request per row for the band
    key_word_pairs: bool = False
    # v3: the MMAs' padding rows (a GQA group of 4 fills 4 of N's 8) start at a running max of +1e30,
    # so their p is exactly 0 every step and the value MMAs multiply zeros there instead of p = 1:
    # the same instructions, less switching in the tensor cores (the op runs at the power cap).
    # Twenty-second session: +4.5% / -0.1% / +0.8% in the grid, -0.5% in sustained 2.5 s phases
    # (power and clock unchanged at the cap): within the spread, not tuned
    zero_padding_p: bool = False
    # v3: p times the value scales (VALUE_SCALES_IN_B) by one packed fp16 multiply per register and
    # band (inline mul.f16x2); as plain fp16 products of broadcast vectors the compiler multiplies
    # each element alone and packs the pairs again: 48 instructions a step against 32, the same
    # IEEE products bit for bit (twenty-third session, offline: 772 -> 756 loop instructions)
    packed_p_scaling: bool = False
    # v3: the value fields as fp16 subnormals (field in place x 2**-24, no 1024 offset), summed
    # uncentred and centred once when the split stores its partial, instead of centring through
    # every step's accumulator inputs (the step's 32 FFMAs and 8 FADDs of the centring; offline
    # 756 -> 738 with packed_p_scaling). The uncentred sums grow with the split, and the tensor
    # cores' fp32 accumulation truncates (v2's subnormals reached 1.0e-2 at one 32k-token split,
    # second session), so a launch whose longest split exceeds value_subnormals_max_split_tokens
    # runs the centred step instead
    value_subnormals: bool = False
    value_subnormals_max_split_tokens: int = 8192
    # v3, GQA groups of at most 4 query rows (half of the MMAs' N of 8 was padding): columns 4-7
    # repeat the query rows, and the value MMAs' B operand is p times the 4-bit band's scales in
    # columns 0-3 and the 2-bit band's in 4-7, so one B operand (one PRMT and one mul.f16x2 a
    # register) and one token-sum MMA of p * scale serve both bands; each field's MMA keeps the
    # columns of its band (offline: 738 -> 711 loop instructions with value_subnormals). Larger
    # groups, or scale rows other than two fp16 a token, run without it
    band_columns: bool = False
    # v3: the value scales' layout change through shared memory ordered so that each lane's 16
    # tokens of a band are 32 contiguous bytes: two 16-byte loads a band give the B layout's packed
    # token pairs (the compiler's own conversion took 16 PRMTs after its loads), the scale pairs
    # loaded two adjacent tokens a lane (offline, Triton 3.6: 738 -> 732 loop instructions, 168 ->
    # 166 registers; the same values). Under band_columns, which reads each token's two scales as
    # one word, it changes nothing
    value_scales_staged: bool = False
    # v3: the full-step loop over step numbers (start = lo + step * block_n) instead of over token
    # positions, and the scale pairs addressed from a scalar pointer per step: at the register cap
    # ptxas recomputes fewer loop bounds and addresses every step (offline, Triton 3.6: 732 -> 721
    # loop instructions with the tuned options; 739 -> 728 on 3.9); the same loads, bit for bit.
    # Prepared in the twenty-fourth session after its device budget was spent: not yet timed
    counted_steps: bool = False
    # v3: the split kernel maps each partial's coefficient sums to centred channels itself (T x
    # (sums / l) on the tensor cores in fp16, T = W R_h at the value slots, then times s and l),
    # so the reduce is one merge of channel-domain partials under one softmax
    # (_merge_channel_rows_kernel): no transform kernel, no [D, D] product per row. Offline (Triton
    # 3.6): the loop as before, the epilogue 248 instructions more (64 16-byte loads of T in
    # fragment order, 64 MMAs, 16 movmatrix)
    transform_in_split: bool = False
    # v3: no prologue kernel; each split program transforms the query itself (M_h s_k in fp16 as
    # fragment-ordered words, 64 MMAs; the slot factors and qk_scale in fp32), so it starts on
    # the cache at once instead of waiting for the prologue (4.6 us at every shape; a quarter of
    # one sequence's call). Offline (Triton 3.6): the loop unchanged, 416 more instructions per
    # program. Needs loads_before_pdl_wait=0 (the query is read after the wait). Twenty-sixth
    # session (H200, 4 interleaved grid rounds): -0.1% at (32, 32768), -2.6% at (8, 32768), +2.0%
    # (+0.9 .. +8.7) at (8, 131072) (two waves: each slot pays the 416 instructions twice and
    # saves the wait once); at one sequence -5.6%, with 256-token splits -8.5%
    query_in_split: bool = False
    # with query_in_split: take it only where the split launch is at most this many waves of
    # resident programs (0: always); elsewhere the prologue transforms the query
    query_in_split_waves: int = 0
    # the prologue kernel's warps (either prologue; 4 in every measurement so far). Twenty-sixth
    # session: where it runs ((8, 131072), (32, 32768)) the split programs wait for it from 1.0 to
    # 4.4-4.6 us for what is one round of loads and a small dot. Twenty-seventh session (4 rounds) at
    # (32, 32768): 1 / 2 / 8 warps +14.4% (the prologue 30.8 us) / +2.5% / +0.3%: 4
    prologue_warps: int = 4
    # with pdl: the prologue itself launched as a programmatic dependent of the kernel before it in
    # the stream (the previous op, or the previous call's merge), waiting in-kernel before it reads
    # the query, so its launch overlaps that kernel's end instead of following it. Thirty-first
    # session (H200, probe_prologue_waits_31.json, 4 grid rounds against the tuned config, two
    # machines): -0.9% (-1.7 .. +0.5) / -0.4% (-1.8 .. +3.4) / -1.6% (-2.4 .. +3.6) at (8, 131072) /
    # (32, 32768) / (8, 32768), then +0.1% / +0.0% / -0.3% on a steadier machine: no measurable
    # gain, off
    prologue_waits: bool = False
    # _prologue_heads_kernel's query rows a program (the dot's M: 16 sequences' 4-row blocks at
    # 64). Measured 2026-12-01 (H200, torch.profiler): one program per sequence took 12.8 us at
    # (32, 32768), 64-row tiles 4.8 us (the op 0.3150 -> 0.3064 ms). Twenty-seventh session (4
    # rounds): 16- or 32-row tiles (256 or 128 programs, a quarter or half the dot each) -0.1% /
    # +0.9% at (32, 32768), the prologue 4.6 -> 4.8 us: 64
    prologue_tile_rows: int = 64
    # the prologue's fp32 dot: "tf32x3" (three tf32 MMAs, about fp32's accuracy), "tf32" (one:
    # the query keeps 10 mantissa bits before its fp16 rounding; query_in_split's fp16 transform
    # keeps as many) or "ieee" (FMAs). Tuned "tf32": -1.4% / -1.2% at (32, 32768) / (8, 131072)
    # (twenty-seventh session, 4 rounds), the prologue 4.6 -> 3.9 us
    prologue_precision: str = "tf32x3"
    # a probe, not a speed option: v3's split programs write globaltimer stamps (after the PDL
    # wait, after the query's transform, after each full step, after the masked steps, after the
    # epilogue) into wavelet_attention.phase_clock_buffer (benchmarks/probe_attention.py phases).
    # The stamps' reductions add instructions to the step: a stamped launch is a little slower
    phase_clocks: bool = False
    # v3: the split kernel's blocks go out split by split (all programs' first splits, then their
    # second ...), as a remainder plan's do, for equal splits too. Blocks are dealt to the SMs in
    # order, so at one sequence (8 programs, one a kv head) an SM's 7-8 resident blocks then hold
    # 2-4 kv heads instead of 6-8 (the stamps' SM ids, twenty-eighth session), and their query- and
    # epilogue-transform words (32 + 32 KB a head, read by every block) can hit L1 instead of L2:
    # the phase stamps put those two at 3.1 and 2.3 us of a block's 13.8
    split_major_grid: bool = False
    # v3: each step's key and value code rows by one TMA copy a cache (a [64, 32] int16 box over
    # the codes viewed as [rows, 24]) into num_stages-deep rings in shared memory, the bands read
    # from there by ldmatrix, instead of the key words loaded into registers and the value tiles
    # copied 8 bytes a lane (benchmarks/spike_tma_step.py: 682-685 loop instructions against the
    # tuned 728 offline, thirty-seventh session). Needs num_stages >= 2, keys_ahead and
    # key_word_pairs off, the default codec's 48-byte rows and contiguous codes (else the launch
    # runs without it: wavelet_attention.tma_rows_reason). Prepared, not yet run on a GPU. With
    # exact_carveout, set that to 100: 12 programs of about 17.9 KB take the SM's whole 228 KB, and
    # the exact-token kernel runs beside them only at the same carveout (the tuned 44 is the
    # carveout of the 4.6 KB programs without it)
    tma_rows: bool = False
    # with tma_rows: the loops' TMA copies issued without the proxy fence Triton puts before each
    # (fence.proxy.async: MEMBAR.ALL.CTA, which may wait for the warp's memory operations in
    # flight, the scale loads among them, then FENCE.VIEW.ASYNC.S), by a PTX patch (ptx_patches.py).
    # The stage a copy overwrites was last read by ldmatrix whose results the previous step's MMAs
    # consumed, so those reads are complete when the copy issues; CUTLASS's TMA pipelines release a
    # stage without the fence too. Offline 703 loop instructions against 705 (thirty-eighth session)
    tma_rows_unfenced: bool = False
    # v3's split kernel: its preferred shared-memory carveout in percent of the SM's most (set on
    # the compiled function, as exact_carveout is on the exact-token kernel's), -1 for the driver's
    # choice. With tma_rows every program holds 16.9 KB (2 stages) or 25.1 KB (3), so 12 resident
    # programs need the SM's whole 228 KB; the driver already gives them that: every tma_rows
    # variant ran +54 to +57% at its choice (fortieth session) and at 100% alike (forty-first),
    # and the tuned config at 100% ran +17.6% (L1 down to 28 KB, the exact kernel off its SMs).
    # Ignored by v1 and v2
    split_carveout: int = -1
    # with tma_rows (and its fences): each full step's stage gets its next copy, num_stages steps
    # ahead, right after the step has read its operands from it into registers (ordered behind
    # those ldmatrix reads by Triton's proxy fence), instead of at the next step's start: two
    # stages then give two steps of lead at two stages' shared memory (thirty-eighth session)
    tma_rows_early: bool = False
    # with tma_rows_early, whose next scale loads follow the copy (mid-step, 238 instructions before
    # their use offline): the scale pairs loaded two steps ahead instead, carried in registers
    # (719 loop instructions against 700; thirty-eighth session)
    scale_pairs_two_ahead: bool = False
    # v3's split kernel: the 2-bit value band's ring tile holds its 8 elements once ([64, 8] int16)
    # instead of twice (the operand's rows 8-15 repeat rows 0-7), the repeat made in registers at
    # no cost: 4 of a step's 16 value copies and 2 of its 8 ldmatrix fewer, and 1 KB less shared
    # memory a stage (3.5 KB a program with the tuned config instead of 4.5, where 12 resident
    # programs then fit the 64 KB carveout and leave L1 192 KB instead of 156). Needs 64-token
    # steps, not row_copies, tma_rows or cta_splits (forty-first session)
    value_band2_half: bool = False
    # v3's split kernel without cache_tiles, whose value (and keys_via_smem key) tiles come by
    # 16-byte copies (two lanes a 4-bit band row, 16 rows an instruction) that Triton issues as
    # cp.async.cg, L2 only: the same copies through L1 (cp.async.ca, by a PTX patch,
    # kernels/ptx_patches.py), so the bands' requests for the sectors they share meet in L1 as
    # cache_tiles' 8-byte copies do, with half the copy instructions (6 a step instead of the
    # tuned 16 with value_band2_half). Not with row_copies, tma_rows or cta_splits (forty-first
    # session)
    value_copies_16b_l1: bool = False
    # v3's split kernel: the token sums (p for the softmax denominator, p times each band's value
    # scale for the store's centring) from one MMA a 16 tokens whose A operand's rows 8 and 9 are
    # the tokens' two scales and the others ones (a 512-byte buffer beside value_scales_staged's,
    # four 16-byte loads a step that give the operand's registers in place), into one accumulator's
    # rows 0, 8, 9, instead of three ones-operand MMAs into three accumulators whose rows all repeat
    # one sum: 8 MMAs and 8 of the every-step rescale's multiplies fewer a step (offline, Triton
    # 3.6: 727 loop instructions against 728 alone, 710 against 725 with value_band2_half;
    # forty-second session). Not bit-identical: the centring then takes the exact sums of p * scale
    # while the value sums take p * scale rounded to fp16, an offset common to a band's slots
    # (benchmarks/centring_rounding_model.py: 1e-5 to 8e-4 of a band's slot sums, mostly 1-3x the
    # rounded sums' error; tests/test_wavelet_attention.py bounds the op on the GPU). Needs
    # value_subnormals (the centring of the magic fields reads every step's sums in every row) and
    # value_scales_staged, not band_columns or cta_splits; a launch whose splits are too long for
    # value_subnormals runs without both
    token_sums_rows: bool = False
    # v3's split kernel (one warp a program): every CTA barrier a warp barrier (bar.warp.sync, by
    # the PTX patch the CTA kernel's warps already take), which orders the warp's shared-memory
    # accesses as bar.sync does but lets ptxas schedule across it. Offline (Triton 3.6, with
    # value_band2_half and token_sums_rows): the 5 BAR.SYNC of a step go, 711 loop instructions
    # against 710 (a divergence check comes in), key-load distances median 395 / min 357 against
    # 328 / 276 (forty-second session). Needs num_warps=1, not cta_splits
    warp_barriers: bool = False
    # v3: this many consecutive equal splits of one (sequence, kv head) in one CTA, a warp each,
    # sharing the query's transform and the epilogue's T and merging their partials into one
    # (kernels/wavelet_attention_cta.py; 0: one split a program). It implements the small-launch
    # config's path only; elsewhere the launch runs one split a program
    # (wavelet_attention.cta_splits_reason says why)
    cta_splits: int = 0
    # with transform_in_split: a row's channels per merge program (a power of two; grid (rows, D /
    # this)), and its warps
    channel_merge_channels: int = 32
    channel_merge_warps: int = 1
    # v3: each step prefetches the next step's value rows into L2 (prefetch.global.L2, one 128-byte
    # line a lane), so the next step's copies find them there
    prefetch_value_rows: bool = False
    # v3: each step loads one word per 256-byte block of the next step's value rows with the
    # L2::256B hint (so a miss fills the block for the next step's copies) and folds the previous
    # step's words into a sink kept alive by a store no run makes (prepared in the seventeenth
    # session, not yet timed)
    fill_value_rows_l2: bool = False
    # v3: the code tiles' cp.async copies ask L2 for the 256-byte block on a miss, like the key-word
    # loads (Triton has no operand for it: the kernel's PTX is patched, kernels/ptx_patches.py)
    value_copies_l2_256b: bool = False
    # v3: the same for every plain global load of the kernel (in the loop: the scale pairs)
    plain_loads_l2_256b: bool = False
    # v3: full steps address their code rows from a scalar pointer to the step's first row, so the
    # per-lane token offsets are loop-invariant and, since the seventeenth session, fold into the
    # loads' immediates (offline 770 loop instructions with the layout options, 886 without it;
    # sixteenth session, before the immediates: 7-9% slower alone, since ptxas then reads the key
    # words sooner after their loads; with keys_ahead, which keeps them a step away, tuned)
    step_row_base: bool = False
    # v3 with keys_via_smem: the key and value code rows through one [tokens, 32] ring each by
    # 16-byte copies, 4 lanes a token row, so a warp's copies cover whole 32-byte sectors of the
    # 48-byte rows and need no L1 to merge them (cache_tiles does that with 8-byte copies); both
    # operands then come from shared memory by ldmatrix, the keys a stage ahead like the values.
    # Sixteenth session: 797 loop instructions instead of 886 but 35% slower (Nsight: the 16-byte
    # copies' half-sector requests are not merged, L2 88% busy at 52% of DRAM; 5.5x the ideal
    # shared-memory wavefronts for the copies' stores); not tuned
    row_copies: bool = False
    # v3: the exact-token kernel runs on a second stream, beside the split kernel
    # (it reads the raw query and writes its own partial slot; the reduce waits for both)
    overlap_exact: bool = False
    # v3 with pdl: the exact-token kernel runs beside the split kernel in the same stream, as a
    # link of the PDL chain (prologue -> split -> exact -> reduce): the split kernel lets it launch
    # at once, it waits for the split kernel only before it ends, and the reduce keeps its PDL
    # wait (after overlap_exact's stream join it cannot). Sixteenth session, tuned splits: within
    # 1% at one to four sequences, 0.8% slower at the large decode shapes. Twenty-ninth session, at
    # one sequence with the small-launch config: -3.4% (5 rounds): on in SMALL_LAUNCH_CONFIGS
    exact_in_chain: bool = False
    # v3 with overlap_exact: the exact-token kernel is enqueued on its stream before the split kernel
    # is launched, not after. Nineteenth session: at one sequence the exact kernel, enqueued after,
    # starts only at 13 of 26 us though the split kernel leaves SMs free; enqueued before, it started
    # no sooner (the op within the spread): off
    exact_before_split: bool = False
    # v3 (overlap_exact or exact_in_chain: the exact-token kernel beside the split kernel either
    # way): the exact-token kernel's preferred shared-memory carveout, in percent of
    # the SM's most shared memory (-1: the driver's choice). The driver picks one per kernel, and an
    # SM running split programs takes no exact program of another carveout until it drains: at one
    # sequence the exact kernel started at 13 of 26 us. Nineteenth session, set through the driver
    # API by probe_attention.py timeline --carveouts at 44% (the split kernel's): it ran at 5.5-10.8
    # us and the call took 24.8 us instead of 25.5-25.7; at (32, 32768) 1.2% longer, at (8, 131072)
    # the same. This option sets it from the launcher (kernels/fast_launch.py). Twentieth session,
    # through the launcher: see exact_carveout_waves (tuned: 44 in one wave)
    exact_carveout: int = -1
    # with exact_carveout: set it only where the split launch takes at most this many waves of
    # resident programs (0: always) and the exact-token kernel has at most exact_carveout_programs
    # programs (0: any number). Twentieth session (H200, grid, interleaved, two calls): 44% made the
    # op 3.9% faster at one sequence (40 exact programs) and 1.4-2.6% at (8, 32768) (320), both one
    # wave; 0.5-0.8% slower at (32, 32768) (one wave, 1,280: they then run beside the whole split
    # kernel and take its issue slots, where otherwise they fill its tail) and 1-2% at (8, 131072)
    # (two waves: they take slots the second wave needs). A remainder plan's waves are those of its
    # long splits (carveout_split_programs). Twenty-seventh session, at (32, 32768)'s remainder plan
    # with 1,280 exact programs: -0.9% and -0.5% in two grids (they end 5.5 us before the split
    # kernel instead of 3.0 after), in two waves at (8, 131072) +4.0%: tuned 1 wave, 2,048 programs
    exact_carveout_waves: int = 0
    exact_carveout_programs: int = 0
    # the split count set so the launch fills a whole number of waves of resident programs
    # (residency from maxnreg and num_warps, so it needs maxnreg; see split_count): a last, partial
    # wave leaves SMs idle while its programs finish (twelfth session: 2 whole waves 2-3% faster
    # than 2.6)
    whole_waves: bool = False
    # with whole_waves: of 1 .. the wave count ctas_per_sm asks for, take the one whose launch costs
    # the fewest steps per program slot, waves x (the longest split's steps + this): each program
    # costs about this many steps more than its steps (its setup, its partial and the reduce's
    # share of it). 0: the ctas_per_sm count. Nineteenth session (H200, interleaved A/B, 4 rounds):
    # one wave instead of two -1.7% at (32, 32768) (6 splits of 85 steps against 12 of 43) and -5.2%
    # at (8, 32768) (24 of 22 against 49 of 11), +0.5% at (8, 131072) (24 of 85 against 49 of 42); a
    # cost of 1 step per program chose each shape's faster count. Thirty-second session: a program's
    # stamps (probe_attention.py phases) at (8, 131072) put its own cost at about 2.5 steps (the
    # query 1.0 us, the first three steps 3.8 / 2.6 / 2.6 us against 2.3 later, the epilogue 2.6),
    # and with 2.5 one wave (24 splits of 86 steps) replaced two of 42 at (8, 131072) -1.4% (-2.0 ..
    # -0.6) and -0.2% (-0.7 .. +0.2) on two machines, (10, 131072) -1.7%, (5, 131072) -4.8%,
    # (8, 65536) -4.2% (4 rounds each); tuned 2.5
    wave_program_steps: float = 0.0
    # with whole_waves and wave_program_steps, in one wave: cut each (sequence, kv head)'s range into
    # splits of L steps and a shorter last one, launched split by split, so every long split starts
    # in the first wave and the short ones fill the wave's free slots one after another, where it
    # costs fewer steps per slot than equal splits (see split_plan). At (32, 32768) 6 splits of 85
    # steps (86 a slot) become 6 of 83 and one of 12 in 48 free slots (84 a slot). v3 launches it
    # split by split; v1 and v2 take the same cut in their usual block order. Only where equal
    # splits are one wave too, and with at least remainder_split_min_programs programs.
    # Twenty-first session (H200, grid, 3 rounds interleaved, each against equal splits in its
    # round): -2.4% at (32, 32768) (256 programs; timeline period 250.2 -> 246.5 us), +2.1% at
    # (8, 32768) (64 programs: there the exact-token kernel's 320 programs run in the wave's free
    # slots from the start, beside the short splits) and +4.8% at (8, 131072) (two waves of equal
    # splits became one of 24 long and a short one). Tuned: on, from 128 programs ((16, 32768), 128
    # programs, takes it by this rule unmeasured: benchmarks/configs/probe_remainder_sixteen.json)
    remainder_split: bool = False
    remainder_split_min_programs: int = 0
    # with remainder_split: the exact-token kernel's work per (sequence, kv head), in split steps,
    # counted in the wave's free slots beside the short splits (its programs run there). 0: not
    # counted. Twenty-fifth session: at (32, 32768) the exact programs end 3.2 us (about 1.2 steps)
    # after the long splits, so the free slots are overloaded; counting them gives shorter short
    # splits and longer long ones (prepared, not yet timed: probe_remainder_exact.json)
    remainder_exact_steps: float = 0.0
    # with remainder_split: the steps a program costs beyond its own in split_plan's comparison of
    # a remainder cut with equal splits (and in choosing its cut); < 0: wave_program_steps. Kept
    # apart since the thirty-second session raised wave_program_steps to 2.5 for the wave count
    # alone: the remainder cut it gives at (32, 32768) (6 long splits of 84 steps and one of 6
    # instead of 83 and 12) measured +1.0% (-0.7 .. +1.1, 4 rounds), so the tuned cut keeps 1.0
    remainder_program_steps: float = -1.0
    # programmatic dependent launch (sm_90+): the split kernel and the reduce are launched while the
    # kernel before them finishes and wait for it in-kernel (griddepcontrol.wait), hiding the launch
    # gap; the prologue lets the split kernel launch as soon as it starts
    pdl: bool = False
    # v3 with pdl: the split kernel's programs, resident while the prologue runs, first issue the
    # cache reads of their first steps (this many steps prefetched into L2, the first one's key
    # words and scales into registers), then wait for the prologue and load the query; 0: every
    # load after the wait. (Only the query comes from the prologue; everything the caches hold
    # was written before the prologue started, which is a plain launch.)
    loads_before_pdl_wait: int = 0

    @property
    def needs_ptx_patches(self) -> bool:
        """Whether the split kernel this config launches carries a PTX patch marker
        (kernels/ptx_patches.py), whose hook must be installed before it compiles."""
        return (
            self.value_copies_l2_256b
            or self.plain_loads_l2_256b
            or self.tma_rows_unfenced
            or self.value_copies_16b_l1
            or self.warp_barriers
        )

    def __post_init__(self) -> None:
        for name in ("block_n", "reduce_split_chunk", "transform_channels"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a power of two >= 1, got {value}")
        if self.loads_before_pdl_wait < 0 or (self.loads_before_pdl_wait and self.kernel != "v3"):
            raise ValueError(
                "LaunchConfig.loads_before_pdl_wait is a v3 option, a step count >= 0: got "
                f"{self.loads_before_pdl_wait} with kernel={self.kernel!r}"
            )
        if not -1 <= self.split_carveout <= 100:
            raise ValueError(
                "LaunchConfig.split_carveout is a percent from 0 to 100 of the SM's most shared memory, "
                f"or -1 for the driver's choice: got {self.split_carveout}"
            )
        if not -1 <= self.exact_carveout <= 100:
            raise ValueError(
                "LaunchConfig.exact_carveout is a percent from 0 to 100 of the SM's most shared memory, "
                f"or -1 for the driver's choice: got {self.exact_carveout}"
            )
        if self.transform_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"LaunchConfig.transform_warps must be 1, 2, 4, 8 or 16, got {self.transform_warps}"
            )
        if self.reduce_merge_warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(
                "LaunchConfig.reduce_merge_warps must be 0 (reduce_warps), 1, 2, 4, 8 or 16, got "
                f"{self.reduce_merge_warps}"
            )
        if not self.remainder_exact_steps >= 0:
            raise ValueError(
                "LaunchConfig.remainder_exact_steps is the exact tokens' work per (sequence, kv head) "
                f"in split steps, >= 0, got {self.remainder_exact_steps}"
            )
        merge = self.channel_merge_channels
        if merge < 1 or merge & (merge - 1):
            raise ValueError(
                "LaunchConfig.channel_merge_channels must be a power of two (a row's channels per merge "
                f"program), got {merge}"
            )
        if self.channel_merge_warps not in (1, 2, 4, 8, 16):
            raise ValueError(
                f"LaunchConfig.channel_merge_warps must be 1, 2, 4, 8 or 16, got {self.channel_merge_warps}"
            )
        channels = self.reduce_merge_channels
        if channels < 0 or channels & (channels - 1):
            raise ValueError(
                f"LaunchConfig.reduce_merge_channels must be 0 (whole rows) or a power of two, got {channels}"
            )
        if self.kernel not in ("v1", "v2", "v3"):
            raise ValueError(f"LaunchConfig.kernel must be 'v1', 'v2' or 'v3', got {self.kernel!r}")
        if self.value_words_once and self.kernel != "v2":
            raise ValueError(
                "LaunchConfig.value_words_once is a v2 option (its stacked value operands), "
                f"got kernel={self.kernel!r}"
            )
        if self.keys_ahead and (self.kernel != "v3" or self.keys_via_smem):
            raise ValueError(
                "LaunchConfig.keys_ahead is a v3 option for keys loaded straight into registers: it "
                f"needs kernel='v3' and keys_via_smem=False, got kernel={self.kernel!r}, "
                f"keys_via_smem={self.keys_via_smem}"
            )
        if self.key_loads_l2_256b and (self.kernel != "v3" or self.keys_via_smem):
            raise ValueError(
                "LaunchConfig.key_loads_l2_256b hints v3's key-word loads from global memory: it "
                f"needs kernel='v3' and keys_via_smem=False, got kernel={self.kernel!r}, "
                f"keys_via_smem={self.keys_via_smem}"
            )
        if self.key_word_pairs and (self.kernel != "v3" or self.keys_via_smem):
            raise ValueError(
                "LaunchConfig.key_word_pairs pairs v3's key-word loads from global memory: it needs "
                f"kernel='v3' and keys_via_smem=False, got kernel={self.kernel!r}, "
                f"keys_via_smem={self.keys_via_smem}"
            )
        if self.packed_p_scaling and not (self.kernel == "v3" and self.value_scales_in_b):
            raise ValueError(
                "LaunchConfig.packed_p_scaling multiplies p by the value scales in the B layout: it "
                f"needs kernel='v3' and value_scales_in_b=True, got kernel={self.kernel!r}, "
                f"value_scales_in_b={self.value_scales_in_b}"
            )
        if self.band_columns and not (self.kernel == "v3" and self.convert_p_once):
            raise ValueError(
                "LaunchConfig.band_columns scales p in the value MMAs' B layout: it needs kernel='v3' "
                f"and convert_p_once=True, got kernel={self.kernel!r}, convert_p_once={self.convert_p_once}"
            )
        if self.value_scales_staged and not (
            self.kernel == "v3" and self.value_scales_in_b and self.block_n == 64
        ):
            raise ValueError(
                "LaunchConfig.value_scales_staged stages v3's value scales for the B layout of 64-token "
                "steps: it needs kernel='v3', value_scales_in_b=True and block_n=64, got "
                f"kernel={self.kernel!r}, value_scales_in_b={self.value_scales_in_b}, block_n={self.block_n}"
            )
        if self.value_subnormals_max_split_tokens < self.block_n:
            raise ValueError(
                "LaunchConfig.value_subnormals_max_split_tokens must be at least one step "
                f"(block_n={self.block_n}), got {self.value_subnormals_max_split_tokens}"
            )
        hints = ("value_copies_l2_256b", "plain_loads_l2_256b")
        if self.prologue_waits and not self.pdl:
            raise ValueError(
                "LaunchConfig.prologue_waits launches the prologue with programmatic dependent launch: "
                "it needs pdl=True"
            )
        if self.query_in_split and self.loads_before_pdl_wait:
            raise ValueError(
                "LaunchConfig.query_in_split reads the query after the PDL wait: it needs "
                f"loads_before_pdl_wait=0, got {self.loads_before_pdl_wait}"
            )
        if self.tma_rows:
            clashes = [
                name
                for name in ("keys_ahead", "key_word_pairs", "keys_via_smem", "row_copies", "counted_steps")
                + ("prefetch_value_rows", "fill_value_rows_l2", "band_columns")
                if getattr(self, name)
            ]
            if self.num_stages < 2 or self.loads_before_pdl_wait or self.cta_splits or clashes:
                raise ValueError(
                    "LaunchConfig.tma_rows reads the keys and values from a ring of TMA copies: it needs "
                    f"num_stages >= 2 (got {self.num_stages}), loads_before_pdl_wait=0 (got "
                    f"{self.loads_before_pdl_wait}), cta_splits=0 (got {self.cta_splits}) and none of "
                    f"{clashes} on"
                )
        if self.tma_rows_unfenced and not self.tma_rows:
            raise ValueError(
                "LaunchConfig.tma_rows_unfenced drops the proxy fences before tma_rows' TMA copies: it "
                "needs tma_rows=True"
            )
        if self.scale_pairs_two_ahead and not self.tma_rows_early:
            raise ValueError(
                "LaunchConfig.scale_pairs_two_ahead is tma_rows_early's way of loading the scale pairs: "
                "it needs tma_rows_early=True"
            )
        if self.tma_rows_early and not (self.tma_rows and not self.tma_rows_unfenced):
            raise ValueError(
                "LaunchConfig.tma_rows_early issues a stage's next TMA copy right after its ldmatrix "
                "reads, ordered by the proxy fence: it needs tma_rows=True and tma_rows_unfenced=False, "
                f"got tma_rows={self.tma_rows}, tma_rows_unfenced={self.tma_rows_unfenced}"
            )
        # the split kernel's ring-tile options (not the row rings', the TMA rows' or the CTA kernel's)
        for name, what, needs, ok in (
            ("value_band2_half", "halves the 2-bit value band's tiles", "block_n=64", self.block_n == 64),
            (
                "value_copies_16b_l1",
                "sends v3's 16-byte tile copies through L1",
                "cache_tiles=False (whose copies are 16 bytes)",
                not self.cache_tiles,
            ),
        ):
            if getattr(self, name) and not (
                self.kernel == "v3" and ok and not (self.row_copies or self.tma_rows or self.cta_splits)
            ):
                raise ValueError(
                    f"LaunchConfig.{name} {what} in v3's split kernel: it needs kernel='v3', {needs} "
                    "and row_copies, tma_rows and cta_splits off; got "
                    f"kernel={self.kernel!r}, block_n={self.block_n}, cache_tiles={self.cache_tiles}, "
                    f"row_copies={self.row_copies}, tma_rows={self.tma_rows}, cta_splits={self.cta_splits}"
                )
        if self.warp_barriers and not (self.kernel == "v3" and self.num_warps == 1 and not self.cta_splits):
            raise ValueError(
                "LaunchConfig.warp_barriers makes the CTA barriers of v3's one-warp split programs warp "
                f"barriers: it needs kernel='v3', num_warps=1 and cta_splits=0; got kernel={self.kernel!r}, "
                f"num_warps={self.num_warps}, cta_splits={self.cta_splits}"
            )
        if self.token_sums_rows and not (
            self.kernel == "v3"
            and self.value_subnormals
            and self.value_scales_staged
            and not (self.band_columns or self.cta_splits)
        ):
            raise ValueError(
                "LaunchConfig.token_sums_rows takes v3's token sums from one MMA whose operand rows "
                "are staged with the value scales: it needs kernel='v3', value_subnormals=True and "
                "value_scales_staged=True, with band_columns and cta_splits off; got "
                f"kernel={self.kernel!r}, value_subnormals={self.value_subnormals}, "
                f"value_scales_staged={self.value_scales_staged}, band_columns={self.band_columns}, "
                f"cta_splits={self.cta_splits}"
            )
        extras = ("zero_padding_p", "value_subnormals", "counted_steps")
        extras += ("transform_in_split", "query_in_split", "phase_clocks", "split_major_grid", "tma_rows")
        for name in ("prefetch_value_rows", "fill_value_rows_l2", *extras, *hints):
            if getattr(self, name) and self.kernel != "v3":
                raise ValueError(
                    f"LaunchConfig.{name} is a v3 option: it needs kernel='v3', got {self.kernel!r}"
                )
        if self.copy_layout_tokens and not (self.kernel == "v3" and self.cache_tiles):
            raise ValueError(
                "LaunchConfig.copy_layout_tokens is a v3 option for cache_tiles (the 8-byte copies' "
                f"layout): got kernel={self.kernel!r}, cache_tiles={self.cache_tiles}"
            )
        if self.value_scales_in_b and not (self.kernel == "v3" and self.convert_p_once):
            raise ValueError(
                "LaunchConfig.value_scales_in_b is a v3 option for convert_p_once (the scales applied in "
                f"the B layout): got kernel={self.kernel!r}, convert_p_once={self.convert_p_once}"
            )
        if self.row_copies and not (
            self.kernel == "v3"
            and self.keys_via_smem
            and not self.cache_tiles
            and not self.copy_layout_tokens
            and not self.step_row_base
        ):
            raise ValueError(
                "LaunchConfig.row_copies is a v3 option with keys_via_smem, instead of cache_tiles, "
                f"copy_layout_tokens and step_row_base: got kernel={self.kernel!r}, "
                f"keys_via_smem={self.keys_via_smem}, cache_tiles={self.cache_tiles}, "
                f"copy_layout_tokens={self.copy_layout_tokens}, step_row_base={self.step_row_base}"
            )
        for name in ("score_offset_in_mma", "step_row_base"):
            if getattr(self, name) and self.kernel != "v3":
                raise ValueError(f"LaunchConfig.{name} is a v3 option, got kernel={self.kernel!r}")
        if self.p_movmatrix and not (self.kernel == "v3" and self.convert_p_once):
            raise ValueError(
                "LaunchConfig.p_movmatrix is a v3 option for convert_p_once (p converted once): "
                f"got kernel={self.kernel!r}, convert_p_once={self.convert_p_once}"
            )
        if self.exact_in_chain and (self.kernel != "v3" or self.overlap_exact or not self.pdl):
            raise ValueError(
                "LaunchConfig.exact_in_chain is a v3 option for programmatic dependent launch, instead "
                f"of overlap_exact: got kernel={self.kernel!r}, overlap_exact={self.overlap_exact}, "
                f"pdl={self.pdl}"
            )
        if self.reduce_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"LaunchConfig.reduce_warps must be 1, 2, 4, 8 or 16, got {self.reduce_warps}")
        if self.exact_chunks < 1:
            raise ValueError(f"LaunchConfig.exact_chunks must be >= 1, got {self.exact_chunks}")
        if self.remainder_split_min_programs < 0:
            raise ValueError(
                "LaunchConfig.remainder_split_min_programs must be >= 0 (0: any launch), got "
                f"{self.remainder_split_min_programs}"
            )
        if self.prologue_warps not in (1, 2, 4, 8):
            raise ValueError(f"LaunchConfig.prologue_warps must be 1, 2, 4 or 8, got {self.prologue_warps}")
        if self.prologue_tile_rows not in (16, 32, 64):
            raise ValueError(
                "LaunchConfig.prologue_tile_rows must be 16, 32 or 64 (a dot's M on the tensor "
                f"cores), got {self.prologue_tile_rows}"
            )
        if self.prologue_precision not in ("tf32x3", "tf32", "ieee"):
            raise ValueError(
                "LaunchConfig.prologue_precision must be 'tf32x3', 'tf32' or 'ieee', got "
                f"{self.prologue_precision!r}"
            )
        if self.query_in_split_waves < 0:
            raise ValueError(
                "LaunchConfig.query_in_split_waves must be >= 0 (0: any launch), got "
                f"{self.query_in_split_waves}"
            )
        if self.whole_waves and self.maxnreg is None:
            raise ValueError(
                "LaunchConfig.whole_waves needs maxnreg: the register cap fixes how many programs an "
                "SM holds at once, which sets the size of a wave"
            )
        if self.kernel == "v3" and (self.num_warps != 1 or self.num_stages not in (1, 2, 3, 4)):
            raise ValueError(
                "LaunchConfig for v3 needs num_warps=1 and num_stages 1-4 (its cp.async ring: 4 KB of "
                "value tiles per stage, 8 KB with keys_via_smem), "
                f"got num_warps={self.num_warps}, num_stages={self.num_stages}"
            )


# (head_dim, block_m, grids) -> config, from the sweep of benchmarks/bench_attention.py --sweep on an
# H200 (2026-11-30 12:05 UTC, torch 2.11, triton 3.6; benchmarks/RESULTS.md has the numbers).
# grids: "affine" when every band's grid is code * step + offset (v2 can run), else "table" (e.g.
# the codec's Lloyd default). block_m: query rows (q heads of a group x new tokens) per program.
# Measured: on affine grids v1 and v2 tie within ~3% at equal settings (v2 issues ~25% fewer
# instructions; the loop is not issue-bound), v1 with a 168-register cap (12 programs per SM) and
# ~32 programs per SM was best; on Lloyd grids (table lookups) 32-token steps and 3 stages.
# Fourth session (17:20 UTC, probe_attention.py grid): the per-row reduce with 64 splits per load
# beat the block reduce at every decode shape with 4 rows per program: (8, 131072) 0.3909 ->
# 0.3694-0.3706 ms, (32, 32768) 0.4028 -> 0.3955-0.3959, (8, 32768) 0.1334 -> 0.1141; aiming the
# splits at whole waves of resident programs (36, 48, 60, 72 per SM) did not beat 32 (within +-3%).
# Fifth session (19:55 UTC, probe_attention.py grid): the Gluon v3 kernel with its value tiles
# through L1 (cache_tiles) and one stage beat v1 at every large decode shape: (8, 131072) 0.3702 ->
# 0.3021 ms, (32, 32768) 0.3956 -> 0.3238, (8, 32768) 0.114 -> 0.1045. Without cache_tiles v3 was
# 0.349 / 0.368 (ncu: L2 throughput 83% busy at 56% of DRAM bandwidth: the bands' separate
# requests for shared 32-byte sectors); keys through the cp.async ring too: 0.49 (L2 90% busy);
# two or three stages, 24/40/48 splits per SM, 32-token steps and a 160-register cap were slower.
# 20:17 UTC, same grid: p converted to the value MMAs' layout once (convert_p_once) 0.3031 ->
# 0.2924 ms at (8, 131072), 0.3246 -> 0.3155 at (32, 32768), 0.1049 -> 0.1034 at (8, 32768).
# Seventh session (2026-12-01 00:13 UTC, same grid, tuned config twice each): the exact-token
# kernel on a second stream, enqueued after the split kernel (overlap_exact) 0.2894-0.2942 ->
# 0.2865-0.2872 ms at (8, 131072), 0.3120-0.3125 -> 0.3070-0.3081 at (32, 32768), 0.1020-0.1022 ->
# 0.0951-0.0957 at (8, 32768); forked before the prologue instead it was 4% slower at the first two.
# Twelfth session (2026-12-01 11:42 UTC, same grid, A/B/A/B): split counts in two whole waves of the
# 12 resident programs per SM (whole_waves, ctas_per_sm 24) instead of 2.6 waves: (8, 131072)
# 0.2921 / 0.2858 -> 0.2838 / 0.2762 ms, (32, 32768) 0.3041 / 0.2983 -> 0.2979 / 0.2932, (8, 32768)
# 0.0971 / 0.0951 -> 0.0953 / 0.0928; 1, 3 or 4 whole waves were slower than 2, partial ones more so.
# 11:54 UTC: programmatic dependent launch (pdl) 0.2830 / 0.2805 -> 0.2802 / 0.2783 ms, 0.2928 /
# 0.2930 -> 0.2936 / 0.2919, 0.0932 / 0.0930 -> 0.0926 / 0.0920.
# Fourteenth session (2026-12-01 14:19-14:23 UTC, same grid): at >= 512 query rows the reduce merges
# per row and runs the inverse transform as one dot per kv head (reduce_gemm_min_rows): (32, 32768)
# 0.2965 / 0.2916 / 0.2900 / 0.2919 / 0.2925 -> 0.2874 / 0.2856 / 0.2882 / 0.2895 / 0.2870 ms (the
# reduce 14.1 -> 5.7 + 4.0 us); at B = 8 (256 rows) it was 1-2% slower, and 6% at one sequence.
# Fifteenth session (2026-12-01 15:49 UTC, same grid, A/B x3): v3 rescales every step instead of
# only when a running max grows (lazy_rescale=False; alpha is exactly 1 otherwise, so the results
# are the same): one basic block per step, 928 loop instructions instead of 969 with the branch,
# (8, 131072) 0.2773 -> 0.2754 ms, (32, 32768) 0.2876 -> 0.2843, (8, 32768) 0.0928 -> 0.0913 (means);
# for v1 at one sequence no difference (0.0281-0.0287 either way), so SMALL_LAUNCH_CONFIGS keep it.
# Sixteenth session (2026-12-01 16:34-16:35 UTC, same grid, two calls, interleaved): the value tiles'
# token indices in their copies' layout plus the value scales split straight into the B layout
# (copy_layout_tokens + value_scales_in_b, 904 loop instructions) 0.2773 / 0.2847 / 0.0915 ->
# 0.2734 / 0.2806 / 0.0915 ms (means of 7 and 6 runs; copy_layout_tokens alone 0.2749 / 0.2812 /
# 0.0913, value_scales_in_b alone 0.2761 / 0.2849 / 0.0922); register caps of 152 and 144 with the
# one-block step were 45-55% slower at 13-14 programs per SM (0.4035 / 0.4273 ms at (8, 131072)).
# 16:41-16:42 UTC (device clock), same grid, two calls, interleaved: p to the value MMAs' B layout by
# movmatrix (p_movmatrix, 886 loop instructions instead of 904) 0.2731 / 0.2824 / 0.0920 ->
# 0.2693 / 0.2783 / 0.0909 ms (means of 6 runs each; faster in 6 of 6 rounds at the first two
# shapes); the score offset as the key MMAs' accumulator input (882; 867 with p_movmatrix) made no
# difference alone or with p_movmatrix, and per-step scalar row pointers (876; 833 with both) were
# 7-9% slower.
# Seventeenth session (2026-12-01 17:54-17:57 UTC, same grid, two calls, interleaved): the next
# step's key words loaded a step ahead as int32 words (keys_ahead; carried as int16 elements they
# took 40 more loop instructions of repacking) with per-step scalar row pointers and the score offset
# in the key MMAs (858 loop instructions, the key words read about 370 instructions after their
# loads instead of 112): 0.2822 / 0.2761 / 0.0896 -> 0.2586 / 0.2655 / 0.0853 ms (means of 3 and 2
# runs, second call; the first call 0.2668 / 0.2773 / 0.0905 -> 0.2600 / 0.2684 / 0.0854 without the
# score offset change); keys_ahead alone (914) was 1-3% slower, and caps of 160 or 152 registers
# with it 4-30% slower. 18:15 UTC, same grid, interleaved: the step's rows addressed from one 64-bit
# register per lane plus immediates (_row_offsets; 787 loop instructions instead of 858) against the
# sixteenth session's tuned step (886): 0.2652 / 0.2738 / 0.0891 -> 0.2542 / 0.2636 / 0.0871 ms
# (means of 2 and 3 runs); the same step with the keys in-step (770) 0.2600 / 0.2651 / 0.0874, and
# at 152 registers (820, 13 programs per SM, 26 per SM a launch) 0.2860 / 0.2979 / 0.0935.
# 18:29 UTC, same grid, interleaved: the key words' loads with the L2::256B prefetch-size hint
# (key_loads_l2_256b; 778 loop instructions) 0.2608 / 0.2671 / 0.0876 -> 0.2497 / 0.2561 / 0.0843
# ms (means of 4 and 3 runs; faster in every round but the first at (8, 131072)). 18:36 UTC: the next
# step's value rows prefetched into L2 as well (prefetch_value_rows) +0.5% at the first two shapes,
# -1.3% at (8, 32768): off.
# Eighteenth session (2026-12-01 19:33-19:41 UTC, same grid, two calls, interleaved): the exact-token
# kernel in 5 programs per (sequence, kv head), one 32-token step each (exact_chunks; one program
# ran 132 tokens in 5 serial steps and, sharing the SMs' issue slots with the split kernel's last
# programs, ended 2.7-5.9 us after them): 0.2502 / 0.2575 / 0.2592 -> 0.2465 / 0.2473 ms at
# (8, 131072), 0.2614 / 0.2588 / 0.2625 -> 0.2598 / 0.2625 at (32, 32768), 0.0868 / 0.0873 / 0.0877
# -> 0.0831 / 0.0833 at (8, 32768); 3 programs of 16-token steps or 9 of one step each within the
# same spread. The L2::256B hint on the value copies or the scale loads (a PTX patch), and
# fill_value_rows_l2, were within the spread (0.2455-0.2526 ms tuned at (8, 131072)): off.
# Twentieth session (2026-12-01 22:01-22:39 UTC, same grid and probe_attention.py timeline): the
# per-row merge of the large decode launches in one warp (reduce_merge_warps; 8.2 -> 4.2 us at
# (32, 32768)) 0.2596 / 0.2593 -> 0.2549 / 0.2549 ms there; the exact-token kernel's carveout at
# 44% where the split launch is one wave with at most 512 exact programs (exact_carveout) -3.9% at
# one sequence and -2.6% at (8, 32768), the target shapes keeping the driver's choice.
# Twenty-second session (2026-12-02 02:40 UTC, same grid, 3 interleaved rounds,
# probe_key_word_pairs.json): a lane's two 4-bit key words by one 8-byte load (key_word_pairs; 16
# key loads a step instead of 24, 772 loop instructions instead of 778 on Triton 3.6) -0.5% (-0.8 ..
# +0.1) at (8, 131072), -0.5% (-0.8 .. -0.2) at (32, 32768), -0.8% (-2.2 .. -0.4) at (8, 32768);
# +0.4% (+0.2 .. +0.5) at one sequence, whose small-launch config keeps the 4-byte loads.
# Twenty-third session (2026-12-02 04:12 UTC, same grid, 2 interleaved rounds,
# probe_value_subnormals.json): p times the value scales by packed multiplies (packed_p_scaling;
# 756 loop instructions) +4.6% (+0.6 .. +8.6) / -1.1% / +0.2% at (8, 131072) / (32, 32768) /
# (8, 32768); with the value fields as subnormals centred once at the store (value_subnormals; 738)
# -4.1% (-7.1 .. -1.0) / -4.2% (-4.9 .. -3.4) / -3.2% (-4.1 .. -2.3), and the op's error 7.5e-4 ->
# 2.7e-4 (probe_value_precision.py: at most the centred step's error up to 8,192-token splits).
# 04:35 UTC (3 rounds, probe_band_columns.json): the MMAs' padding columns serving the 2-bit band
# (band_columns; 711 loop instructions) +0.3% (-6.7 .. +1.6) / +1.0% (+0.0 .. +1.4) / -0.7% (-1.9
# .. +0.4), and in sustained 2.5 s phases +2.3% / +1.5% at (32, 32768) / (8, 131072), at a lower
# SM clock under the same power cap (1545-1605 against 1605-1650 MHz): off here, on for small
# launches (one sequence, not at the cap: -2.7%).
# Twenty-fourth session (2026-12-02 05:51-05:56 UTC, probe_value_scales_staged*.json): the value
# scales staged by lane (value_scales_staged; 732 loop instructions, 166 registers) in sustained
# 2.5 s phases (A, B, A, B) 0.2657 / 0.2669 against 0.2684 / 0.2676 ms at (32, 32768) (-0.6%) and
# 0.2587 / 0.2625 against 0.2650 / 0.2639 at (8, 131072) (-1.4%); in 4 interleaved grid rounds
# (06:22 UTC) -1.2% (-4.7 .. +0.1) at (8, 131072) and -1.1% (-1.6 .. -0.6) at (32, 32768).
# The loop turned by half a step, the rescale behind a branch at the iteration's end (725 loop
# instructions on the path without it; 716 with the staged scales), ran +6.7% / +2.6% / +2.2% at
# (8, 131072) / (32, 32768) / (8, 32768) in the grid, +13.5% / +6.9% / +6.4% with the staged scales
# (05:48 UTC, one round): not kept (RESULTS.md, twenty-fourth session).
# Twenty-fifth session (2026-12-02 07:09-07:25 UTC): the full-step loop over step numbers
# (counted_steps; 721 loop instructions) +1.5% (-8.1 .. +7.9) / +0.3% / +0.6% in 4 grid rounds,
# sustained +0.3% / +0.6%, one sequence -0.1%: off. The partial's sums mapped to channels in the
# split kernel and one merge of channel partials (transform_in_split; 4 interleaved grid rounds,
# probe_transform_in_split*.json) -0.5% (-0.9 .. +1.2) / -1.4% (-1.5 .. -0.9) / -3.0% (-3.4 ..
# -0.7) at (8, 131072) / (32, 32768) / (8, 32768), -11.2% (-11.3 .. -10.7, 3 rounds) at one
# sequence; timeline periods 235.4 -> 232.3 us at (32, 32768) (merge 3.9 + transform 4.1 us ->
# one merge of 4.5) and 233.2 -> 230.4 at (8, 131072) (the per-row reduce 6.7 -> 3.5 us): on.
# About 07:40 UTC (3 rounds, probe_channel_merge.json): the merge's channels per program 64 instead of 32
# -0.7% (-3.1 .. -0.6) / -0.8% (-0.8 .. -0.2) / +0.3% (+0.1 .. +0.6), 16 -1.2% (-5.2 .. +1.9) /
# +0.9% / +1.5%; the exact tokens in 9 programs of 16 -0.4% / +0.7% / +7.1%: 64 channels.
# Twenty-sixth session (09:29 UTC, 4 rounds, probe_query_in_split.json): the query transformed in
# the split kernel, no prologue (query_in_split) -0.1% (-0.6 .. +0.5) at (32, 32768), -2.6% (-4.2
# .. +0.5) at (8, 32768), both one wave, +2.0% (+0.9 .. +8.7) at (8, 131072), two: on in one wave.
# The remainder plan with the exact programs' work in the free slots (remainder_exact_steps=6)
# +0.5% (+0.3 .. +0.6) at (32, 32768): off.
# Twenty-seventh session (20:00 UTC, 4 rounds, probe_exact_tail_prologue.json): the exact kernel's
# carveout at any program count in up to two waves -0.9% (-1.8 .. -0.6) at (32, 32768), +4.0% (+0.1
# .. +7.2) at (8, 131072); 3 or 2 exact programs a pair -0.6% / -0.1% at (32, 32768) and +7.4% /
# +3.1% at (8, 131072); the prologue on 1 / 2 / 8 warps +14.4% / +2.5% / +0.3% at (32, 32768); the
# merge at 128 channels +0.0%. 20:11 UTC (another machine, 4 rounds in rotated order,
# probe_prologue_tiles.json), with a remainder plan's wave counted by its long splits
# (carveout_split_programs): the carveout up to 2,048 exact programs (so at (32, 32768), not in
# (8, 131072)'s two waves) -0.5% (-8.6 .. -0.3) / -0.1% / +0.3% at (32, 32768) / (8, 131072) / (8,
# 32768), the exact kernel ending 5.5 us before the split kernel instead of 3.0 after (timeline,
# period 226.7 -> 224.8 us); the prologue's dot in one tf32 MMA (prologue_precision) -1.4% (-9.1 ..
# -0.4) / -1.2% (-2.1 .. -0.3) / +0.7% (no prologue there), its kernel 4.6 -> 3.9 us, error against
# fp32 decompress + SDPA 4.1e-4 -> 5.0e-4; 16- or 32-row prologue tiles -0.1% / +0.9%; all three
# -1.4% / -0.4% / +0.3%: the carveout to 2,048 and tf32.
# Where v3 cannot run (no Gluon, the interpreter) this entry runs v1 with these settings.
TUNED_CONFIGS: dict[tuple[int, int, str], LaunchConfig] = {
    (128, 4, "affine"): LaunchConfig(
        block_n=64,
        num_stages=1,
        ctas_per_sm=24.0,  # two whole waves of 12 resident programs per SM (whole_waves) ...
        whole_waves=True,
        wave_program_steps=2.5,  # ... or one, where it takes fewer steps per slot
        remainder_program_steps=1.0,
        pdl=True,
        min_split_tokens=512,
        kernel="v3",
        cache_tiles=True,
        convert_p_once=True,
        overlap_exact=True,
        maxnreg=168,
        row_reduce_max_programs=64.0,
        reduce_split_chunk=64,
        reduce_gemm_min_rows=512,
        reduce_merge_warps=1,
        lazy_rescale=False,
        copy_layout_tokens=True,
        value_scales_in_b=True,
        p_movmatrix=True,
        keys_ahead=True,
        step_row_base=True,
        score_offset_in_mma=True,
        key_loads_l2_256b=True,
        key_word_pairs=True,
        exact_chunks=5,
        exact_carveout=44,  # the split kernel's carveout, in one wave (a remainder plan's long splits)
        exact_carveout_waves=1,
        exact_carveout_programs=2048,
        prologue_precision="tf32",  # where the prologue runs: one tf32 MMA per product
        remainder_split=True,  # long splits and a short last one, in one wave of 128+ programs
        remainder_split_min_programs=128,
        packed_p_scaling=True,
        value_subnormals=True,  # where no split is longer than 8,192 tokens
        value_subnormals_max_split_tokens=8192,
        value_scales_staged=True,
        transform_in_split=True,  # the reduce is one merge of channel-domain partials
        channel_merge_channels=64,
        query_in_split=True,  # no prologue where the split launch is one wave
        query_in_split_waves=1,
        # forty-fourth session (2026-12-05 10:28 UTC, probe_token_sums_rows.json, 3 rounds):
        # -3.3% at (8, 131072), -0.9% at (32, 32768) against the config without these four
        value_band2_half=True,
        token_sums_rows=True,
        warp_barriers=True,
        split_carveout=44,
    ),
    (128, 4, "table"): LaunchConfig(
        block_n=32, num_stages=3, ctas_per_sm=32.0, min_split_tokens=512, kernel="v1"
    ),
}


# Launches with few (sequence, kv head, row block) programs, e.g. one sequence: each split is a
# lone warp on its scheduler and the loop's latency, not issue, bounds it. Measured 2026-11-30
# (H200, probe_attention.py grid) at (B, N) = (1, 32768), ms: one-warp 64-token steps v2 0.0308-0.0323
# (v1 0.0346-0.0370 in the third session); two-warp 128-token steps v1 0.0285, v2 0.0296; four
# warps 0.040-0.061; three or more pipeline stages and shorter splits (128-384 tokens) were slower.
# 2026-12-01 11:54 UTC: programmatic dependent launch (pdl) 0.0284 / 0.0282 -> 0.0273 / 0.0272 ms.
# Sixteenth session (about 16:50 UTC, probe_attention.py grid, benchmarks/configs/probe_v3_few_sequences.json,
# two rounds): at (1, 32768) v1 0.0281 / 0.0288 ms, tuned v3 0.0354 / 0.0355, 0.0316 / 0.0317 with
# 256-token splits (the exact kernel in the PDL chain instead of on a side stream, exact_in_chain,
# did not close the gap); at (2, 32768), 16 programs, v1 0.0458 / 0.0462, v3 0.0405 / 0.0405; at
# (4, 32768) v1 0.0798 / 0.0796, v3 0.0557 / 0.0560. So only one sequence (8 programs with 8 kv
# heads) kept v1. Eighteenth session (19:38-19:43 UTC, two calls): with the exact tokens in 5
# programs (exact_chunks) v3 overtook v1 at one sequence: (1, 32768) v1 0.0279 / 0.0283 / 0.0283 /
# 0.0288 ms, v3 with 256-token splits 0.0258 / 0.0258 / 0.0259 (128 / 192 / 384 / 512-token splits
# 0.0281 / 0.0271-0.0276 / 0.0272 / 0.0284); the single exact program had cost v3 6.8 us there.
# 19:52 UTC, after the reduce merged the exact partials in the same loads: 256-token splits 0.0276
# / 0.0269 ms with 64 partials per reduce load (133 partials: three serial loads, the reduce 6.1-7.2
# us), 0.0259 with 128 per load (384-token splits 0.0271-0.0279 / 0.0261, 512 0.0293-0.0296).
# Nineteenth session (2026-12-01 20:44-20:49 UTC, two calls, probe_early_loads_one_sequence.json):
# the first step's cache reads issued before the split kernel's wait for the prologue
# (loads_before_pdl_wait=1) 0.0269 / 0.0260 / 0.0265 / 0.0264 / 0.0264 -> 0.0262 / 0.0254 / 0.0258
# / 0.0259 / 0.0259 ms; two steps 0.0265. At the large shapes within the spread (not tuned there).
SMALL_LAUNCH_PROGRAMS = 8
SMALL_LAUNCH_CONFIGS: dict[tuple[int, int, str], LaunchConfig] = {
    (128, 4, "affine"): replace(
        TUNED_CONFIGS[(128, 4, "affine")],
        min_split_tokens=256,  # 384 in the twenty-fifth session, 256 before (see below)
        reduce_split_chunk=128,
        loads_before_pdl_wait=0,  # 1 until query_in_split (see below)
        key_word_pairs=False,  # +0.4% at one sequence (twenty-second session)
        # twenty-third session at one sequence (2 rounds each): packed_p_scaling -0.5% (-0.8 ..
        # -0.2), with value_subnormals +0.2% (+0.1 .. +0.4); then band_columns -1.6% (-2.7 ..
        # -0.5), and with value_subnormals as well -2.7% (-3.8 .. -1.7)
        band_columns=True,
        # twenty-fifth session, with transform_in_split (3 rounds each, probe_channel_merge_one_
        # sequence*.json): 384-token splits -1.1% / -1.4%, 512 +7.6%; 16 channels a merge program
        # -1.2% / -1.6%, both -2.0% (-2.1 .. -1.6); two-warp merge programs +1.9%
        channel_merge_channels=16,
        # twenty-sixth session (3 rounds, probe_query_in_split_one_sequence.json): no early loads
        # +3.9%; with query_in_split (no prologue; it needs no early loads) -5.6% at 384-token
        # splits, -8.5% (-10.2 .. -8.0) at 256, -7.3% at 512: query_in_split (from the tuned
        # entry) and 256. Then (probe_one_sequence_26.json, probe_merge_pass_one_sequence.json,
        # probe_one_sequence_merge_26.json): 192-token splits +4.8%, 320 +0.4% / -1.1%, 8 or 32
        # channels a merge program +1.9% / +1.4%, the carveout off +16.2%; the exact tokens in 3
        # programs instead of 5 -1.0% (3 rounds) and -1.2% (-1.6 .. -0.2, 4 rounds); the merge in
        # one pass of 256 partials -0.5% / -0.7%, with 3 exact programs -1.0%: 3 exact programs
        exact_chunks=3,
        # twenty-eighth session (H200, 5 rounds, probe_split_major_one_sequence.json): the blocks
        # split-major, so an SM's 7-8 blocks hold 2-4 kv heads instead of 6-8 and share their
        # transform words in L1: -3.0% (-5.8 .. -1.6); the phase stamps' medians: the query's
        # transform 3.07 -> 2.82 us, the epilogue 2.30 -> 1.79. (At the large shapes -0.1 / +1.5 /
        # +0.5% at (8, 32768) / (8, 131072) / (32, 32768), 4 rounds: off there.) 2 ring stages
        # +1.5%, register caps of 232 / 255 +18.7% / +17.1% (4 rounds, probe_one_sequence_28.json);
        # the transform words prefetched into L1 (prefetch.global.L1, removed) +14.7%; 192- / 320-
        # token splits, split-major, +7.9% / +3.5%
        split_major_grid=True,
        # the one-warp split kernel's options, which the CTA kernel (cta_splits, below) does not
        # implement: off here whichever the tuned entry takes
        value_band2_half=False,
        value_copies_16b_l1=False,
        token_sums_rows=False,
        warp_barriers=False,
        split_carveout=-1,
        # twenty-ninth session (H200, 5 rounds, probe_exact_in_chain_29.json): the exact-token
        # kernel as a link of the PDL chain instead of on a side stream, so the merge keeps its
        # programmatic launch after it: -3.4% (-6.1 .. -3.2), 0.0196-0.0198 -> 0.0186-0.0190 ms
        # (in the sixteenth session, with the reduce and splits of then, within 1-2%). Clusters of 2 /
        # 4 / 8 split programs sharing the query's transform (cluster_query, removed: commit
        # 6649def) +7.3% / +44%; the split kernel's carveout at 28% / 64% (removed: ad99814) +14% /
        # +19.5%
        overlap_exact=False,
        exact_in_chain=True,
        # thirty-fifth session (H200, 4 rounds, grid of diag configs): four splits a CTA sharing the
        # query's transform and T, one merged partial a CTA (kernels/wavelet_attention_cta.py):
        # -6.0% (-7.0 .. -4.6); the phase stamps' medians: the query's transform 3.07 -> 1.79-2.05
        # us, the loops' end 11.26 -> 9.98, the epilogue's 13.31 -> 12.29. Thirty-sixth session (4
        # rounds): with it 192- / 320-token splits +4.3% / +11.1%; at the large shapes, on this
        # path, four splits a CTA +1.3% / +8.2% at (8, 131072) / (8, 32768) against one split a
        # program (+4.2% / +11.0% against the tuned config there), so they keep TUNED_CONFIGS
        cta_splits=4,
    ),
}
# where v3 cannot run a small launch (other layouts, no Gluon, the interpreter): v1's own best
SMALL_LAUNCH_V1_CONFIGS: dict[tuple[int, int, str], LaunchConfig] = {
    (128, 4, "affine"): LaunchConfig(
        block_n=128,
        num_warps=2,
        num_stages=2,
        ctas_per_sm=32.0,
        min_split_tokens=512,
        kernel="v1",
        reduce_split_chunk=64,
        pdl=True,
    ),
}

# A GQA group of 5-8 query rows a program (block_m 8: Qwen3-MoE's 32 query / 4 kv heads,
# Mixtral-8x22B's 48 / 8, or a group of 4 with two new tokens) takes the group of 4's configs
# (thirty-ninth session); until then it ran default_config (v2, untuned). Why they hold: v3's MMAs
# have 8 query columns either way, so the tuned loop compiles to the same 728 instructions of the
# same mix at 8 rows as at 4 (tests/test_attention_v3_plan.py; Triton 3.6, scheduled a little
# differently), and a kv head's byte stream does not depend on its group. band_columns and
# cta_splits need 4 rows. A group of 9-16 rows (block_m 16: Qwen3-235B's 64 / 4 heads) takes the
# same configs since the fortieth session, v3 running it in two row blocks of 8. Measured
# (2026-12-05 03:3x UTC, H200, probe_attention.py grid, 3 rounds, benchmarks/RESULTS.md) at
# (8, 131072) / (32, 32768) / (1, 32768), the old default against these:
#   32 / 4 heads: v2 0.269 / 0.243 / 0.031 ms -> 0.125 / 0.127 (tuned) / 0.015 (small launch)
#   64 / 4 heads: v2 0.81 / 0.82 / 0.046 ms -> 0.225 / 0.231 (tuned) / 0.019 (small launch)
# (the forty-fourth session's four options are timed at groups of 4 only: not taken here yet)
TUNED_CONFIGS[(128, 8, "affine")] = replace(
    TUNED_CONFIGS[(128, 4, "affine")],
    value_band2_half=False,
    token_sums_rows=False,
    warp_barriers=False,
    split_carveout=-1,
)
SMALL_LAUNCH_CONFIGS[(128, 8, "affine")] = replace(
    SMALL_LAUNCH_CONFIGS[(128, 4, "affine")], band_columns=False, cta_splits=0
)
SMALL_LAUNCH_V1_CONFIGS[(128, 8, "affine")] = SMALL_LAUNCH_V1_CONFIGS[(128, 4, "affine")]
TUNED_CONFIGS[(128, 16, "affine")] = TUNED_CONFIGS[(128, 8, "affine")]
SMALL_LAUNCH_CONFIGS[(128, 16, "affine")] = SMALL_LAUNCH_CONFIGS[(128, 8, "affine")]

# head_dim 64 with a GQA group of 5-8 rows (gpt-oss's 64 query / 8 kv heads: the Gluon v3 kernel takes
# head_dim 128 only, so v2). Measured (forty-sixth session, 2026-12-05 15:10-15:11 UTC, an H100:
# no H200 came; probe_attention.py grid, 2 rounds each, with v2's stacked field operands) against
# default_config at (8, 131072) / (32, 32768) / (1, 32768) / (8, 32768): 32 programs an SM -16.5 /
# -14.8 / -9.2 / -20.8%, + 3 stages -18.2 / -17.8 / -11.4 / -19.3%, + the every-step rescale -20.7 /
# -20.5 / -15.0 / -21.1% (second grid: -20.2 / -20.0 / -10.6 / -20.6%); 64 programs an SM, 4 stages,
# 32- or 128-token steps and 2 warps were no better.
TUNED_CONFIGS[(64, 8, "affine")] = LaunchConfig(
    ctas_per_sm=32.0,
    num_stages=3,
    lazy_rescale=False,
    pdl=True,
    row_reduce_max_programs=64.0,
    reduce_split_chunk=64,
    reduce_gemm_min_rows=512,
    reduce_merge_warps=1,
)


def v1_fallback(config: LaunchConfig, block_m: int = V3_MAX_ROWS) -> LaunchConfig:
    """What runs where `config` asks for v3 and v3 cannot run: for a small-launch config, the v1
    settings tuned for small launches; else the same settings on v1, without v3's options.
    block_m: the call's query rows a program outside v3; for more than v3's row block, the
    untuned default that ran such groups before v3 took them (v2, one block of up to 16 rows
    on 4 warps), not v3's one-warp settings on v1."""
    if block_m > V3_MAX_ROWS:
        return default_config(128, block_m)
    for key, small in SMALL_LAUNCH_CONFIGS.items():
        if config == small and key in SMALL_LAUNCH_V1_CONFIGS:
            return SMALL_LAUNCH_V1_CONFIGS[key]
    return replace(config, kernel="v1", **dict.fromkeys(V3_ONLY_OPTIONS, False))


# LaunchConfig fields that only v3 accepts: off when a failed v3 launch falls back to v1
V3_ONLY_OPTIONS = (
    "keys_ahead",
    "key_loads_l2_256b",
    "key_word_pairs",
    "zero_padding_p",
    "packed_p_scaling",
    "value_subnormals",
    "band_columns",
    "value_scales_staged",
    "counted_steps",
    "transform_in_split",
    "query_in_split",
    "phase_clocks",
    "split_major_grid",
    "tma_rows",
    "tma_rows_unfenced",
    "tma_rows_early",
    "scale_pairs_two_ahead",
    "value_band2_half",
    "value_copies_16b_l1",
    "token_sums_rows",
    "warp_barriers",
    "prefetch_value_rows",
    "fill_value_rows_l2",
    "value_copies_l2_256b",
    "plain_loads_l2_256b",
    "copy_layout_tokens",
    "value_scales_in_b",
    "score_offset_in_mma",
    "p_movmatrix",
    "step_row_base",
    "exact_in_chain",
    "row_copies",
    "loads_before_pdl_wait",
    "exact_before_split",
    "cta_splits",
)


def default_config(head_dim: int, block_m: int) -> LaunchConfig:
    """Untuned shapes: one warp per program while its registers suffice (more warps split the
    tiny MMAs and duplicate the dequantisation, but avoid spills), more warps for wide heads or
    many query rows (prefill chunks; v2 then runs them in blocks of V2_MAX_BLOCK_M rows)."""
    if block_m <= 8 and head_dim <= 128:
        return LaunchConfig()
    if block_m <= 8:
        return LaunchConfig(num_warps=2, ctas_per_sm=8.0)
    return LaunchConfig(num_warps=4, ctas_per_sm=2.0)


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits exercise the split/merge logic
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


# per-SM limits of the H100 / H200 (sm_90), where device properties do not say
_REGS_PER_SM = 65536
_WARPS_PER_SM = 64
_PROGRAMS_PER_SM = 32
_SHARED_PER_SM = 228 * 1024
_SHARED_RESERVED_PER_PROGRAM = 1024  # the driver's per-block reservation
# v3's shared memory beside its ring: the value scales' staging buffers, mbarriers and layout
# conversions' scratch, 512-536 bytes in the offline builds (sass_attention_v3.py: the tuned kernel
# 4,608 bytes against its 4,096-byte ring, tma_rows 16,912 / 25,112 at 2 / 3 stages against 16,384 /
# 24,576); without it 3-stage tma_rows was counted 9 an SM where 8 fit (thirty-eighth session)
_V3_SHARED_BESIDE_RING = 1024
_REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256


def resident_programs_per_sm(
    config: LaunchConfig,
    regs_per_sm: int = _REGS_PER_SM,
    warps_per_sm: int = _WARPS_PER_SM,
    shared_per_sm: int = _SHARED_PER_SM,
) -> int | None:
    """How many split-kernel programs one SM holds at once under ``config``'s register cap (None
    without a cap: the compiler's register count is not known before the launch). v3's shared
    memory (its cp.async ring of code tiles) is counted too; v1/v2 configs count registers only.
    The limits default to the H100 / H200's; choose_num_splits passes the device's."""
    if config.maxnreg is None:
        return None
    regs_per_warp = -(-config.maxnreg * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
    resident = min(
        regs_per_sm // (regs_per_warp * config.num_warps),
        warps_per_sm // config.num_warps,
        _PROGRAMS_PER_SM,
    )
    if config.kernel == "v3":
        tiles = 2 if config.keys_via_smem else 1  # value tiles, plus key tiles through the ring
        ring = config.num_stages * tiles * 2 * config.block_n * 16 * 2  # two bands, 16 int16 a row
        if config.value_band2_half:  # the 2-bit value band's tiles hold 8 int16 a row
            ring -= config.num_stages * config.block_n * 8 * 2
        if config.tma_rows:  # both caches' [block_n, 32] int16 row tiles a stage instead
            ring = config.num_stages * 2 * config.block_n * 32 * 2
        per_program = ring + _V3_SHARED_BESIDE_RING + _SHARED_RESERVED_PER_PROGRAM
        resident = min(resident, shared_per_sm // per_program)
    return max(resident, 1)


def split_count(
    programs: int, tokens: int, config: LaunchConfig, sms: int, resident_per_sm: int | None
) -> int:
    """Splits of the compressed range (pure arithmetic; see choose_num_splits).

    programs * splits ~ ctas_per_sm * sms, with at least min_split_tokens (and one block) per split.
    With ``config.whole_waves`` the launch then takes the nearest whole number of waves of
    ``resident_per_sm * sms`` programs (at least one; no more than the cap's splits fill), as
    many splits as fill them without going over (the last wave at most one program per split
    short), still within the cap; with ``config.wave_program_steps``, fewer whole waves where their
    launch takes fewer steps per program slot (see LaunchConfig.wave_program_steps)."""
    programs = max(programs, 1)
    cap = max(min(-(-tokens // max(config.min_split_tokens, 1)), -(-tokens // config.block_n)), 1)
    splits = int(min(max(round(config.ctas_per_sm * sms / programs), 1), cap))
    if not config.whole_waves or resident_per_sm is None:
        return splits
    wave = resident_per_sm * sms
    waves = max(min(round(programs * splits / wave), programs * cap // wave), 1)
    best = int(min(max(waves * wave // programs, 1), cap))
    if config.wave_program_steps <= 0:
        return best

    def steps_per_slot(splits: int) -> float:
        split_tokens = -(-tokens // splits)
        longest = -(-split_tokens // config.block_n)  # the kernel's split: whole steps
        return -(-programs * splits // wave) * (longest + config.wave_program_steps)

    for fewer in range(waves - 1, 0, -1):  # a tie keeps the larger count
        splits = int(min(max(fewer * wave // programs, 1), cap))
        if steps_per_slot(splits) < steps_per_slot(best):
            best = splits
    return best


_RESIDENT: dict[tuple, int | None] = {}


def _device_resident_per_sm(config: LaunchConfig, device: torch.device) -> int | None:
    """resident_programs_per_sm with ``device``'s limits (the sm_90 figures off CUDA), cached by the
    fields resident_programs_per_sm reads: every call sizes its launch with it, and hashing a whole
    LaunchConfig (or reading the device's properties) each time would cost host time for nothing."""
    key = (config.maxnreg, config.num_warps, config.kernel, config.keys_via_smem, config.num_stages)
    key += (config.block_n, device)
    if key in _RESIDENT:
        return _RESIDENT[key]
    limits = {}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        for name, prop, scale in (
            ("regs_per_sm", "regs_per_multiprocessor", 1),
            ("warps_per_sm", "max_threads_per_multi_processor", 32),
            ("shared_per_sm", "shared_memory_per_multiprocessor", 1),
        ):
            value = getattr(props, prop, None)
            if value:  # older torch lacks some: the sm_90 figure stands in
                limits[name] = int(value) // scale
    _RESIDENT[key] = resident_programs_per_sm(config, **limits)
    return _RESIDENT[key]


@dataclass(frozen=True)
class SplitPlan:
    """How a launch cuts each program's compressed span into splits: num_splits ranges of
    ceil(span * split_num / split_den) tokens rounded up to whole steps, the last one what is left
    (it may be empty). Equal splits: split_num 1, split_den num_splits. split_major: the split
    kernel's blocks go out split by split (all programs' first splits, then their second ...)."""

    num_splits: int
    split_num: int = 1
    split_den: int = 0  # 0: num_splits
    split_major: bool = False

    def __post_init__(self) -> None:
        if self.split_den == 0:
            object.__setattr__(self, "split_den", self.num_splits)
        if self.num_splits < 1 or self.split_num < 1 or self.split_den < 1:
            raise ValueError(f"a split plan needs positive counts, got {self}")
        if self.num_splits * self.split_num < self.split_den:
            raise ValueError(
                f"{self.num_splits} splits of {self.split_num} / {self.split_den} of the span each leave "
                "part of it uncovered (need num_splits * split_num >= split_den)"
            )


def split_bounds(span: int, plan: SplitPlan, block_n: int) -> list[tuple[int, int]]:
    """The [lo, hi) token ranges, counted from the first compressed position, that the split
    kernels give each split of a program whose compressed span is ``span`` tokens under ``plan``
    (the kernels compute the same from the sequence length; an empty range has lo == hi)."""
    share = -(-span * plan.split_num // plan.split_den)
    chunk = -(-share // block_n) * block_n
    return [(min(i * chunk, span), min((i + 1) * chunk, span)) for i in range(plan.num_splits)]


def value_subnormals_apply(config: LaunchConfig, tokens: int, plan: SplitPlan) -> bool:
    """Whether a v3 launch of ``config`` runs the value_subnormals step: asked for, and no split of
    a ``tokens``-position compressed span under ``plan`` longer than
    ``config.value_subnormals_max_split_tokens`` (the uncentred sums' error grows with the split)."""
    if not config.value_subnormals:
        return False
    longest = max(hi - lo for lo, hi in split_bounds(max(tokens, 1), plan, config.block_n))
    return longest <= config.value_subnormals_max_split_tokens


def split_plan(
    programs: int, tokens: int, config: LaunchConfig, sms: int, resident_per_sm: int | None
) -> SplitPlan:
    """split_count's equal splits, or with ``config.remainder_split`` (where equal splits are one
    wave of at least ``remainder_split_min_programs`` programs) n long splits of L
    steps and a last one of R = steps - n * L, launched split-major: the n x programs long splits
    fill the wave but for ``free`` slots, where the programs' short splits run one after another,
    ceil(programs / free) each. The cost per slot, with c = config.remainder_program_steps (or, where
    that is negative, config.wave_program_steps) per program:
    max(L + c, ceil(programs / free) x (R + c) + X / free) against equal splits' waves x (steps +
    c) (at least X over their free slots), X = programs x ``config.remainder_exact_steps`` the
    exact-token programs' work; the lower wins (a tie keeps equal splits). Pure arithmetic, like
    split_count."""
    splits = split_count(programs, tokens, config, sms, resident_per_sm)
    equal = SplitPlan(splits)
    wanted = config.remainder_split and config.whole_waves and config.wave_program_steps > 0
    if not wanted or not resident_per_sm or programs < config.remainder_split_min_programs:
        return equal
    programs = max(programs, 1)
    wave = resident_per_sm * sms
    if programs * splits > wave:  # equal splits in two waves or more: measured slower as one
        return equal
    steps = -(-tokens // config.block_n)
    c = config.remainder_program_steps if config.remainder_program_steps >= 0 else config.wave_program_steps
    split_tokens = -(-tokens // splits)
    split_steps = -(-split_tokens // config.block_n)
    exact = programs * config.remainder_exact_steps  # the exact programs' work, in slot-steps
    equal_free = wave - programs * splits
    equal_exact = exact / equal_free if equal_free > 0 else 0.0
    best_cost, best = max(-(-programs * splits // wave) * (split_steps + c), equal_exact), equal
    for n_long in range(max((wave - 1) // programs - 1, 1), (wave - 1) // programs + 1):
        free = wave - programs * n_long  # > 0
        rounds = -(-programs // free)
        # max(L + c, rounds x (steps - n_long L + c) + exact / free) is lowest where the two meet
        meet = (rounds * (steps + c) + exact / free - c) / (1 + rounds * n_long)
        for long_steps in {int(meet), int(meet) + 1}:
            rest = steps - n_long * long_steps
            if long_steps < 1 or not 0 < rest <= long_steps:
                continue
            cost = max(long_steps + c, rounds * (rest + c) + exact / free)
            if cost < best_cost:
                best_cost = cost
                best = SplitPlan(n_long + 1, long_steps, steps, split_major=True)
    return best


def choose_split_plan(
    programs: int, capacity: int, layout: CompressedLayout, config: LaunchConfig, device: torch.device
) -> SplitPlan:
    """split_plan for a launch of ``programs`` (sequence, kv head, row block) programs over caches
    of ``capacity`` positions on ``device``. From the capacity, so no host sync on seq_lens."""
    tokens = max(capacity - layout.n_exact, 1)
    resident = _device_resident_per_sm(config, device)
    return split_plan(programs, tokens, config, _sm_count(device), resident)


def choose_num_splits(
    programs: int, capacity: int, layout: CompressedLayout, config: LaunchConfig, device: torch.device
) -> int:
    """Split the compressed range so programs * splits ~ ctas_per_sm * SMs, with at least
    min_split_tokens (and one block) per split, in whole waves if the config asks (choose_split_plan's
    count)."""
    return choose_split_plan(programs, capacity, layout, config, device).num_splits


def query_in_split_apply(config: LaunchConfig, split_programs: int, device: torch.device) -> bool:
    """Whether a v3 launch of ``split_programs`` split programs under ``config`` transforms the
    query in the split kernel: asked for, and the launch at most config.query_in_split_waves waves
    of resident programs (0: any; unknown residency, no maxnreg: only with 0)."""
    if not config.query_in_split:
        return False
    if not config.query_in_split_waves:
        return True
    resident = _device_resident_per_sm(config, device)
    if resident is None:
        return False
    return split_programs <= config.query_in_split_waves * resident * _sm_count(device)


def carveout_split_programs(programs: int, plan: SplitPlan) -> int:
    """The split programs whose waves exact_carveout counts: every split's, but for a remainder
    plan (split_major) only the long splits', since its short splits run in their wave's free slots
    (beside the exact programs, which the carveout lets in too)."""
    return programs * (plan.num_splits - 1 if plan.split_major else plan.num_splits)


def exact_carveout(
    config: LaunchConfig, split_programs: int, exact_programs: int, device: torch.device
) -> int:
    """The exact-token kernel's preferred shared-memory carveout beside a split launch of
    ``split_programs`` programs: config.exact_carveout, or -1 (the driver's choice) where the launch
    takes more waves of resident split programs than exact_carveout_waves (or the residency is
    unknown: no maxnreg), or the exact kernel has more than exact_carveout_programs programs."""
    if config.exact_carveout < 0:
        return -1
    if config.exact_carveout_programs and exact_programs > config.exact_carveout_programs:
        return -1
    if not config.exact_carveout_waves:
        return config.exact_carveout
    resident = _device_resident_per_sm(config, device)
    wave = None if resident is None else resident * _sm_count(device)
    fits = wave is not None and split_programs <= config.exact_carveout_waves * wave
    return config.exact_carveout if fits else -1
