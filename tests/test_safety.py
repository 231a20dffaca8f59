"""The drop-fraction safety net: a job whose rows would mostly train nothing stops, naming why (markers that match
nothing, truncation), and the row display that shows what trains."""

import pytest

from lossmask import Markers, OutcomeCounts, TooManyDroppedRows, check_drop_fraction, label_batch
from lossmask.jobs.display import format_row


def counts(trained=0, no_response=0, empty_response=0, empty=0):
    rows = trained + no_response + empty_response + empty
    by = {"trained": trained, "no_response": no_response, "empty_response": empty_response, "empty": empty}
    return OutcomeCounts(rows=rows, tokens=0, tokens_trained=0, by_outcome=by)


def test_within_the_threshold_passes():
    check_drop_fraction(counts(trained=7, no_response=3))  # exactly 30%
    check_drop_fraction(counts())  # no rows at all


def test_markers_that_match_nothing_are_named():
    with pytest.raises(TooManyDroppedRows, match="markers match nothing") as info:
        check_drop_fraction(counts(trained=1, no_response=9), example="a [b] c")
    assert "9 of 10 rows (90.0%)" in str(info.value)
    assert "a [b] c" in str(info.value)
    assert info.value.counts.rows_dropped == 9


def test_truncation_is_named():
    with pytest.raises(TooManyDroppedRows, match="truncation at the maximum length"):
        check_drop_fraction(counts(trained=5, empty_response=4, no_response=1), max_drop_fraction=0.2)


def test_threshold_is_checked():
    with pytest.raises(ValueError, match="fraction in"):
        check_drop_fraction(counts(trained=1), max_drop_fraction=30)


def test_format_row_marks_trained_tokens():
    m = Markers(response=[[1]], end=[[3]])
    result = label_batch([[0, 1, 2, 3, 4]], m)
    vocab = ["user", "assistant:", "hi", "</s>", "\n"]
    assert format_row([0, 1, 2, 3, 4], result.labels[0], vocab.__getitem__) == "user assistant: [hi] [</s>] \\n"
