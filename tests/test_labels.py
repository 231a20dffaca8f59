"""Hand-written cases from SPEC.md, run on every CPU backend."""

import numpy as np
import pyarrow as pa
import pytest

import lossmask
from lossmask import Markers, Outcome

BACKENDS = ["numba", "numpy"]

# A tiny ChatML vocabulary: the worked example of SPEC.md, token for token.
S, E, NL, SYSTEM, USER, ASSISTANT, TOOL = 100, 101, 10, 1, 2, 3, 4
HI, YO, CALL, RESULT, OK = 20, 21, 22, 23, 24
CHATML = Markers(response=[[S, ASSISTANT, NL]], instruction=[[S]], end=[[E]])
X = -100


def labels(rows, markers=CHATML, **options):
    return lossmask.make_labels(rows, markers, **options)


@pytest.mark.parametrize("backend", BACKENDS)
def test_spec_worked_example(backend):
    row = [S, USER, NL, HI, E, NL, S, ASSISTANT, NL, YO, E, NL]
    assert labels([row], backend=backend) == [[X, X, X, X, X, X, X, X, X, YO, E, X]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tool_turn_is_masked_and_the_call_trains(backend):
    row = [S, USER, NL, HI, E, NL, S, ASSISTANT, NL, CALL, E, NL, S, TOOL, NL, RESULT, E, NL, S, ASSISTANT, NL, OK, E, NL]
    expected = [X] * 9 + [CALL, E] + [X] * 10 + [OK, E, X]
    assert labels([row], backend=backend) == [expected]


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_rows(backend):
    mid_answer = [S, USER, NL, HI, E, NL, S, ASSISTANT, NL, YO, YO]
    after_header = [S, USER, NL, HI, E, NL, S, ASSISTANT, NL]
    inside_header = [S, USER, NL, HI, E, NL, S, ASSISTANT]
    result = lossmask.label_batch([mid_answer, after_header, inside_header], CHATML, backend=backend)
    assert result.labels[0] == [X] * 9 + [YO, YO]
    assert result.outcomes.tolist() == [Outcome.TRAINED, Outcome.EMPTY_RESPONSE, Outcome.NO_RESPONSE]
    assert result.trained_tokens.tolist() == [2, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_tie_is_masked(backend):
    # The response pattern ends where an instruction pattern starts: open(i) == close(i) at that token.
    m = Markers(response=[[1, 2]], instruction=[[3]])
    assert labels([[1, 2, 3, 5, 1, 2, 5]], m, backend=backend) == [[X, X, X, X, X, X, 5]]
    # ... and where an end pattern ends at the same token as a response pattern: the end closes at i too.
    m = Markers(response=[[1, 2]], end=[[2]])
    assert labels([[1, 2, 5, 6]], m, backend=backend) == [[X, X, X, X]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_matches_all_count(backend):
    m = Markers(response=[[7, 7]], end=[[9]])
    # 7 7 7: two overlapping response matches, opens at 2 and 3; token 2 (a 7) is trained.
    assert labels([[7, 7, 7, 5, 9, 5]], m, backend=backend) == [[X, X, 7, 5, 9, X]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mask_out_inside_a_span(backend):
    THINK_END = 50
    m = Markers(response=[[S, ASSISTANT, NL]], instruction=[[S]], end=[[E]], mask_out=[[THINK_END, NL]])
    row = [S, ASSISTANT, NL, HI, THINK_END, NL, YO, E]
    assert labels([row], m, backend=backend) == [[X, X, X, HI, X, X, YO, E]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_last_turn_only(backend):
    row = [S, USER, NL, HI, E, S, ASSISTANT, NL, YO, E, S, USER, NL, HI, E, S, ASSISTANT, NL, OK, E]
    expected = [X] * 18 + [OK, E]
    assert labels([row], backend=backend, last_turn_only=True) == [expected]
    # The last open wins even when the last turn is cut right after its header.
    cut = row[:18]
    result = lossmask.label_batch([cut], CHATML, backend=backend, last_turn_only=True)
    assert result.labels == [[X] * 18]
    assert result.outcomes.tolist() == [Outcome.EMPTY_RESPONSE]


@pytest.mark.parametrize("backend", BACKENDS)
def test_outcome_counts_and_keep(backend):
    rows = [
        [S, USER, NL, HI, E, S, ASSISTANT, NL, YO, E],  # trained
        [S, USER, NL, HI, E],  # no_response
        [S, ASSISTANT, NL],  # empty_response
        [],  # empty
        None,  # null: counts as empty
        [S, ASSISTANT, NL, YO],  # trained
    ]
    result = lossmask.label_batch(rows, CHATML, backend=backend)
    assert result.outcomes.tolist() == [0, 1, 2, 3, 3, 0]
    assert result.keep.tolist() == [True, False, False, False, False, True]
    assert result.counts.by_outcome == {"trained": 2, "no_response": 1, "empty_response": 1, "empty": 2}
    assert result.counts.dropped == {"no_response": 1, "empty_response": 1, "empty": 2}
    assert result.counts.rows == 6 and result.counts.rows_dropped == 4
    assert result.counts.tokens == 10 + 5 + 3 + 4 and result.counts.tokens_trained == 2 + 1
    assert result.labels[4] is None


def test_trainable_mask_matches_labels():
    row = [S, USER, NL, HI, E, NL, S, ASSISTANT, NL, YO, E, NL]
    mask = lossmask.trainable_mask(pa.array([row]), CHATML)
    assert mask.type == pa.list_(pa.int8())
    assert mask.to_pylist() == [[0] * 9 + [1, 1, 0]]


def test_ignore_index_and_int32_labels():
    row = [S, ASSISTANT, NL, YO, E]
    out = lossmask.make_labels(pa.array([row], pa.list_(pa.int32())), CHATML, ignore_index=-1, dtype="int32")
    assert out.type == pa.list_(pa.int32())
    assert out.to_pylist() == [[-1, -1, -1, YO, E]]
    with pytest.raises(ValueError, match="'int64'"):
        lossmask.make_labels([row], CHATML, dtype="float32")
    with pytest.raises(ValueError, match="fits int32"):
        lossmask.make_labels([row], CHATML, dtype="int32", ignore_index=2**40)


def test_padded_numpy_input():
    rows = np.array([[S, ASSISTANT, NL, YO, E, 0], [S, ASSISTANT, NL, YO, YO, YO]], dtype=np.int32)
    out = lossmask.make_labels(rows, CHATML, lengths=np.array([5, 4]))
    assert out.dtype == np.int64 and out.shape == rows.shape
    assert out.tolist() == [[X, X, X, YO, E, X], [X, X, X, YO, X, X]]
    mask = lossmask.trainable_mask(rows, CHATML, lengths=[5, 4])
    assert mask.tolist() == [[0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 0, 0]]
