"""The PTX patches (kernels/ptx_patches.py) on hand-written PTX: what they rewrite, what they leave,
and the errors for a marker without a known patch or without an instruction to apply to. The
patched kernel itself is compiled for sm_90 in test_attention_v3_plan.py and checked bit-identical
on the GPU in test_wavelet_attention.py."""

import pytest
from wmoe_compile.kernels import ptx_patches

COPIES = """
	mov.u32 %r1, 0; // wmoe-ptx-patch: cp_async_l2_256b
	cp.async.ca.shared.global [ %r194 + 0 ], [ %rd106 + 0 ], 0x8, 0x8;
	cp.async.cg.shared.global [ %r195 + 0 ], [ %rd107 + 0 ], 0x10, 0x10;
	cp.async.commit_group;
	cp.async.wait_group 0;
	@%p1 ld.global.b32 { %r950 }, [ %rd18 + 0 ];
"""

LOADS = """
	mov.u32 %r1, 0; // wmoe-ptx-patch: ld_global_l2_256b
	@%p1 ld.global.b32 { %r950 }, [ %rd18 + 0 ];
	ld.global.v2.b32 { %r1, %r2 }, [ %rd19 + 0 ];
	ld.global.L2::256B.b32 %r1621, [%rd72];
	ld.global.nc.b32 %r3, [%rd20];
	ld.shared.v4.b32 { %r4, %r5, %r6, %r7 }, [ %r8 + 0 ];
	cp.async.ca.shared.global [ %r194 + 0 ], [ %rd106 + 0 ], 0x8, 0x8;
"""


def test_copies_get_the_hint_and_nothing_else_changes():
    got = ptx_patches.patch_ptx(COPIES)
    assert "cp.async.ca.shared.global.L2::256B [ %r194" in got
    assert "cp.async.cg.shared.global.L2::256B [ %r195" in got
    assert "cp.async.commit_group;" in got and "cp.async.wait_group 0;" in got
    assert "@%p1 ld.global.b32 { %r950 }" in got  # a load: not this patch's
    assert got.count("L2::256B") == 2


def test_16_byte_copies_go_through_l1_and_keep_the_l2_hint():
    # cp_async_ca (value_copies_16b_l1): every .cg copy becomes .ca, 8-byte .ca copies and other
    # instructions stay; with cp_async_l2_256b marked too, the hint lands once on each copy
    marked = COPIES.replace("cp_async_l2_256b", "cp_async_ca")
    got = ptx_patches.patch_ptx(marked)
    assert "cp.async.ca.shared.global [ %r195 + 0 ], [ %rd107 + 0 ], 0x10, 0x10;" in got
    assert "cp.async.cg" not in got and got.count("cp.async.ca.shared.global [") == 2
    assert "cp.async.commit_group;" in got and "@%p1 ld.global.b32 { %r950 }" in got
    both = "\tmov.u32 %r2, 0; // wmoe-ptx-patch: cp_async_ca\n" + COPIES
    got = ptx_patches.patch_ptx(both)
    assert "cp.async.ca.shared.global.L2::256B [ %r195" in got and got.count("L2::256B") == 2
    assert "cp.async.cg" not in got
    with pytest.raises(ValueError, match="'cp_async_ca'.*no instruction it applies to"):
        ptx_patches.patch_ptx(marked.replace("cp.async.cg", "cp.async.ca"))  # nothing to send


def test_plain_loads_get_the_hint_qualified_ones_keep_theirs():
    got = ptx_patches.patch_ptx(LOADS)
    assert "@%p1 ld.global.L2::256B.b32 { %r950 }" in got
    assert "ld.global.L2::256B.v2.b32 { %r1, %r2 }" in got
    assert "ld.global.L2::256B.b32 %r1621" in got  # already hinted: once, not twice
    assert "L2::256B.L2::256B" not in got
    assert "ld.global.nc.b32 %r3" in got  # a cache qualifier: left alone
    assert "ld.shared.v4.b32" in got
    assert "cp.async.ca.shared.global [ %r194" in got  # a copy: not this patch's


BARRIERS = """
	mov.u32 %r1, 0; // wmoe-ptx-patch: warp_barriers
	bar.sync 	0;
	st.shared.v2.b32 	[%r24+16384], {%r2139, %r2138};
	bar.warp.sync 	-1;
	bar.sync 1, 128; // the kernel's own meeting of its four warps
	bar.sync 	0;
"""


def test_cta_barriers_become_warp_barriers_named_ones_stay():
    # kernels/wavelet_attention_cta.py: Triton's barrier-0 barriers guard each warp's own shared
    # memory there, so a warp barrier does; the warps' exchanges use named barrier 1
    got = ptx_patches.patch_ptx(BARRIERS)
    assert "bar.sync \t0;" not in got and got.count("bar.warp.sync -1;") == 2
    assert "bar.sync 1, 128;" in got and "st.shared.v2.b32" in got
    assert got.count("bar.warp.sync") == 3  # (the one there already, unchanged)


FENCES = """
	mov.u32 %r1, 0; // wmoe-ptx-patch: no_async_proxy_fences
	@%p16 mbarrier.arrive.expect_tx.shared.b64 _, [%r719], 8192;
	fence.proxy.async.shared::cta;
	bar.sync 	0;
	cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2}], [%r7];
	fence.proxy.async.global;
		fence.proxy.async.shared::cta;
	mbarrier.try_wait.parity.shared.b64 complete, [%r729], %r730;
"""


def test_shared_proxy_fences_go_whole_lines_and_nothing_else():
    # LaunchConfig.tma_rows_unfenced: the fences before the ring's TMA copies go, lines and all;
    # the copy, its barrier and a fence of another state space stay
    got = ptx_patches.patch_ptx(FENCES)
    assert "fence.proxy.async.shared::cta" not in got
    assert got.count("\n") == FENCES.count("\n") - 2
    assert "fence.proxy.async.global;" in got
    for kept in ("mbarrier.arrive.expect_tx", "bar.sync \t0;", "cp.async.bulk.tensor.2d", "try_wait"):
        assert kept in got, kept


def test_unmarked_ptx_comes_back_unchanged():
    unmarked = COPIES.replace("// wmoe-ptx-patch: cp_async_l2_256b", "")
    assert ptx_patches.patch_ptx(unmarked) == unmarked


def test_unknown_or_idle_markers_are_errors():
    with pytest.raises(ValueError, match="unknown patch 'l2_everything'"):
        ptx_patches.patch_ptx(COPIES.replace("cp_async_l2_256b", "l2_everything"))
    idle = "\tmov.u32 %r1, 0; // wmoe-ptx-patch: cp_async_l2_256b\n\tret;\n"
    with pytest.raises(ValueError, match="no instruction it applies to"):
        ptx_patches.patch_ptx(idle)
    with pytest.raises(ValueError, match="known:"):
        ptx_patches.marker_asm("l2_everything")


def test_marker_asm_names_its_patch():
    assert ptx_patches.marker_asm("cp_async_l2_256b").endswith("// wmoe-ptx-patch: cp_async_l2_256b")


def test_the_hook_chains_a_previous_one_and_rewrites_the_ptx_stage(monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    if not hasattr(knobs.runtime, "add_stages_inspection_hook"):
        pytest.skip("this Triton has no stages hook")
    calls = []

    def previous(*args):
        if not args:
            return "prev", "h"
        calls.append(args[1])

    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", previous)
    monkeypatch.setattr(ptx_patches, "_installed", False)
    assert ptx_patches.install()
    hook = knobs.runtime.add_stages_inspection_hook
    assert hook is not previous
    key, digest = hook()
    assert key.startswith("prev") and ptx_patches.VERSION in key and ptx_patches.VERSION in digest
    stages = {"ptx": lambda src, metadata: COPIES, "cubin": lambda src, metadata: b""}
    hook(object(), stages, None, None, 90)
    assert calls == [stages]
    assert "cp.async.ca.shared.global.L2::256B" in stages["ptx"](None, None)
