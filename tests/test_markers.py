"""``Markers``: how patterns are normalised, compared, written as JSON and read back, and which marker sets are
refused with a message that says why."""

import json

import numpy as np
import pytest

from lossmask import Markers


def test_patterns_are_normalised_to_tuples_and_deduplicated():
    m = Markers(response=[[1, 2], (1, 2)], instruction=[[3]], end=[[4]])
    assert m.response == ((1, 2),)
    assert m.instruction == ((3,),)
    assert m.mask_out == ()


def test_immutable_hashable_and_equal_by_value():
    a = Markers(response=[[1, 2]], end=[[4]])
    b = Markers(response=((1, 2),), end=((4,),))
    assert a == b and hash(a) == hash(b)
    a.compiled()  # the cached kernel form does not take part in equality
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.response = ((9,),)


def test_repr_is_readable():
    assert repr(Markers(response=[[1, 2]], end=[[4]])) == "Markers(response=[[1, 2]], end=[[4]])"


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(response=[]), ValueError, "at least one response pattern"),
        (dict(response=[[1], []]), ValueError, "response[1] is an empty pattern"),
        (dict(response=[[1, -2]]), ValueError, "negative id -2"),
        (dict(response=[[1]], end=[[1.5]]), TypeError, "must be integers"),
        (dict(response=[[1]], end=[[True]]), TypeError, "must be integers"),
        (dict(response="<|im_start|>"), TypeError, "list of token-id sequences"),
        (dict(response=[1, 2]), TypeError, "wrap a single pattern"),
    ],
)
def test_bad_markers_are_refused_with_a_clear_message(kwargs, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        Markers(**kwargs)


def test_json_round_trip_string_and_file(tmp_path):
    m = Markers(response=[[1, 2], [1, 5]], instruction=[[1]], end=[[4]], mask_out=[[7, 8]])
    assert Markers.from_json(m.to_json()) == m
    path = tmp_path / "markers.json"
    m.to_json(path)
    assert json.loads(path.read_text()) == {
        "response": [[1, 2], [1, 5]], "instruction": [[1]], "end": [[4]], "mask_out": [[7, 8]],
    }
    assert Markers.from_json(path) == m
    assert Markers.from_json(str(path)) == m


def test_json_missing_kinds_default_to_empty_and_unknown_keys_are_refused():
    assert Markers.from_json('{"response": [[3]]}') == Markers(response=[[3]])
    with pytest.raises(ValueError, match="unknown keys"):
        Markers.from_json('{"response": [[3]], "ends": [[4]]}')
    with pytest.raises(ValueError, match="not valid JSON"):
        Markers.from_json("{response")


def test_compiled_form_classes_quiet_tokens_first():
    c = Markers(response=[[1, 2]], instruction=[[3]], end=[[4, 5]], mask_out=[[6]]).compiled()
    assert c.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert c.offsets.tolist() == [0, 2, 3, 5, 6]
    assert c.kinds.tolist() == [0, 1, 2, 3]
    a = c.automaton
    # 2 and 5 never start a pattern: quiet classes 1, 2 (0 is every other id); 1, 3, 4, 6 start one.
    assert a.n_quiet == 3 and a.n_classes == 7
    assert a.class_of(np.arange(9)).tolist() == [0, 3, 1, 4, 5, 2, 6, 0, 0]
    assert a.classes.shape == (8,) and a.big_ids.size == 0  # one slot past the largest id


@pytest.mark.parametrize("big", [2**40, 2**63 - 1])
def test_huge_marker_ids_cost_no_huge_table(big):
    a = Markers(response=[[5, big]], end=[[7]]).compiled().automaton
    assert a.classes.shape == (9,) and a.big_ids.tolist() == [big]  # the dense table stops past 7
    assert a.class_of(np.array([big, big - 1, 5, 7])).tolist() == [1, 0, 2, 3]


@pytest.mark.parametrize("big", [10**30, 2**63, 2**64 - 100])
def test_marker_ids_beyond_int64_are_refused_naming_the_id(big):
    with pytest.raises(ValueError, match=rf"Markers.end\[0\] holds the id {big}, beyond"):
        Markers(response=[[1]], end=[[big]])


def test_marker_sets_too_large_for_the_automaton_are_refused_when_the_engine_needs_it():
    m = Markers(response=[[t] for t in range(1000, 7000)])  # 6,000 distinct one-token patterns
    assert m.compiled().tokens.size == 6000  # the pattern arrays (torch, MLX) are still built
    with pytest.raises(ValueError, match="above the engine's limit"):
        m.compiled().automaton
