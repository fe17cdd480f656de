"""The printed pass table: what each pass changed, as op counts (wmoe_compile.pipeline.PassRecord)."""

from wmoe_compile.pipeline import PassRecord


def _record(changed: bool, added: dict, removed: dict) -> PassRecord:
    return PassRecord(
        index=1,
        name="p",
        changed=changed,
        seconds=0.0,
        nodes_before=10,
        nodes_after=10,
        added=added,
        removed=removed,
    )


def test_an_unchanged_pass_says_so():
    assert _record(False, {}, {}).op_changes() == "unchanged"


def test_the_projects_ops_come_first_then_the_largest_changes():
    record = _record(
        True,
        {"aten.mul.Tensor": 5, "wmoe.wavelet_attention": 1, "aten.add.Tensor": 2},
        {"aten.scaled_dot_product_attention": 1, "aten.view": 7},
    )
    assert (
        record.op_changes() == "+1 wmoe.wavelet_attention, -7 aten.view, +5 aten.mul.Tensor, and 2 more ops"
    )
    assert record.op_changes(most=10).endswith("-1 aten.scaled_dot_product_attention")


def test_a_pass_that_changed_no_op_count_says_so():
    # e.g. a pass that only rewired arguments
    assert _record(True, {}, {}).op_changes() == "same op counts"
