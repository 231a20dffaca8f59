"""The automaton engine against the reference, on the marker sets that stress it.

``test_properties.py`` draws small random marker sets; here the sets look like what
``detect_markers`` returns and like what breaks a lagged scan: many patterns sharing a prefix and
differing in the last token (whitespace variants), patterns that are prefixes, suffixes and
sub-strings of each other, mask_out patterns overlapping opens and closes, ids beyond the dense
class table; each with its patterns anchored on their first tokens or at offsets drawn at random (the
anchors change where the engine stops, never the labels). Both drivers (serial and parallel) are called
directly on the same flat buffers.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lossmask import Markers
from lossmask.engine.automaton import DENSE_IDS, choose_anchors
from lossmask.engine.kernels import numba_kernel, reference

DRIVERS = {"serial": numba_kernel._label_rows_serial, "parallel": numba_kernel._label_rows_parallel}
DIRECT_DRIVERS = {"serial": numba_kernel._direct_rows_serial, "parallel": numba_kernel._direct_rows_parallel}
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def rows_from(draw, markers: Markers, alphabet: st.SearchStrategy, *, max_rows: int = 12) -> list[list[int]]:
    """Rows of random tokens and whole or cut copies of the markers' own patterns, back to back."""
    patterns = [list(p) for kind in ("response", "instruction", "end", "mask_out") for p in getattr(markers, kind)]
    piece = st.one_of(
        st.lists(alphabet, max_size=6),
        st.sampled_from(patterns),
        st.sampled_from(patterns).flatmap(lambda p: st.integers(1, len(p)).map(lambda k: p[:k])),
        st.sampled_from(patterns).flatmap(lambda p: st.integers(0, len(p) - 1).map(lambda k: p[k:])),
    )
    return draw(st.lists(st.lists(piece, max_size=10).map(lambda ps: [t for p in ps for t in p]), max_size=max_rows))


@st.composite
def shared_prefix_cases(draw):
    """Patterns over a tiny vocabulary that share prefixes and suffixes and overlap every way."""
    token = st.integers(0, 5)
    prefix = draw(st.lists(token, max_size=3))
    variants = draw(st.lists(token, min_size=1, max_size=6, unique=True))
    response = [prefix + [v] for v in variants] + draw(st.lists(st.lists(token, min_size=1, max_size=4), max_size=2))
    pool = response + draw(st.lists(st.lists(token, min_size=1, max_size=4), max_size=3))
    cut = st.sampled_from(pool).flatmap(  # a piece of another pattern: prefix, suffix or middle
        lambda p: st.integers(0, len(p) - 1).flatmap(lambda a: st.integers(a + 1, len(p)).map(lambda b: p[a:b]))
    )
    markers = Markers(
        response=response,
        instruction=draw(st.lists(st.one_of(cut, st.lists(token, min_size=1, max_size=4)), max_size=3)),
        end=draw(st.lists(st.one_of(cut, st.lists(token, min_size=1, max_size=3)), max_size=3)),
        mask_out=draw(st.lists(st.one_of(cut, st.lists(token, min_size=1, max_size=3)), max_size=3)),
    )
    return markers, rows_from(draw, markers, token)


@st.composite
def whitespace_variant_cases(draw):
    """A two-token header followed by one of dozens of 'whitespace' tokens that fill the content too."""
    header = [100, 101]
    variants = draw(st.lists(st.integers(0, 59), min_size=10, max_size=40, unique=True))
    markers = Markers(
        response=[header + [v] for v in variants],
        instruction=draw(st.sampled_from([[], [[100]], [[100, 102]]])),
        end=draw(st.sampled_from([[[103]], [[103], [103, variants[0]]], [[variants[0], 103]]])),
        mask_out=draw(st.sampled_from([[], [[104, 105]], [[101, variants[-1]]], [[variants[-1]]]])),
    )
    return markers, rows_from(draw, markers, st.one_of(st.integers(0, 59), st.sampled_from([100, 101, 103, 104, 105])))


def flat(rows: list[list[int]], dtype=np.int64):
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    ends = np.cumsum(lengths)
    values = np.array([t for r in rows for t in r], dtype=dtype)
    return values, ends - lengths, ends


def anchors_for(data, markers: Markers):
    """Anchor offsets for the markers' patterns: their first tokens (None) or one drawn per pattern."""
    lengths = [len(p) for kind in ("response", "instruction", "end", "mask_out") for p in getattr(markers, kind)]
    drawn = st.tuples(*(st.integers(0, n - 1) for n in lengths))
    return data.draw(st.one_of(st.none(), drawn), label="anchors")


def assert_drivers_equal_reference(rows, markers, last_turn_only, dtype=np.int64, anchors=None):
    values, starts, ends = flat(rows, dtype)
    expected = np.full(values.shape, 12345, dtype=np.int64)
    ref = reference.label_rows(values, starts, ends, markers, last_turn_only=last_turn_only, ignore_index=-100,
                               out=expected, write_mask=False)
    automaton = markers.compiled().anchored(anchors)
    auto, ring_size = numba_kernel.automaton_args(automaton)
    prefilter, usable = numba_kernel.prefilter_ids(automaton.anchor_ids, values.dtype)
    # the block prefilter where it can hold the anchor ids, and the token-at-a-time scan always
    scans = {"blocks": (prefilter, True)} if usable else {}
    scans["tokens"] = (prefilter, False)
    runs = {}
    for name, driver in DRIVERS.items():
        for scan, (ids, use) in scans.items():
            runs[f"{name} driver, {scan}"] = lambda out, wm, driver=driver, ids=ids, use=use: driver(
                values, starts, ends, auto, ring_size, last_turn_only, out.dtype.type(0 if wm else -100), out, wm, ids, use)
    if usable and not last_turn_only:  # each pattern checked at its anchor
        direct = numba_kernel.direct_args(automaton)
        groups = numba_kernel.direct_groups(automaton, values.dtype, prefilter)
        for name, driver in DIRECT_DRIVERS.items():
            runs[f"{name} direct driver"] = lambda out, wm, driver=driver: driver(
                values, starts, ends, direct, groups, prefilter, out.dtype.type(0 if wm else -100), out, wm)
    for run_name, run in runs.items():
        for write_mask in (False, True):
            where = f"{run_name}, write_mask={write_mask}"
            out = np.full(values.shape, 99, dtype=np.int8 if write_mask else np.int64)
            got = run(out, write_mask)
            want = (expected != -100).astype(np.int8) if write_mask else expected
            np.testing.assert_array_equal(out, want, err_msg=where)
            for a, b in zip(got, ref):
                np.testing.assert_array_equal(a, b, err_msg=where)


@SETTINGS
@given(case=shared_prefix_cases(), last_turn_only=st.booleans(), data=st.data())
def test_overlapping_patterns_sharing_prefixes_and_suffixes(case, last_turn_only, data):
    markers, rows = case
    assert_drivers_equal_reference(rows, markers, last_turn_only, anchors=anchors_for(data, markers))


@SETTINGS
@given(case=whitespace_variant_cases(), last_turn_only=st.booleans(), data=st.data())
def test_dozens_of_variants_differing_in_the_last_token(case, last_turn_only, data):
    markers, rows = case
    assert_drivers_equal_reference(rows, markers, last_turn_only, anchors=anchors_for(data, markers))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=shared_prefix_cases(), last_turn_only=st.booleans(), data=st.data())
def test_ids_beyond_the_dense_table(case, last_turn_only, data):
    """The same case with its ids moved far apart (some past DENSE_IDS, up to 2**62): same labels."""
    markers, rows = case
    places = data.draw(st.permutations([3, 2**20, DENSE_IDS, DENSE_IDS + 1, 2**40, 2**62, 17, 0]))
    move = dict(enumerate(places))

    def moved(patterns):
        return [[move[t] for t in p] for p in patterns]

    big = Markers(**{kind: moved(getattr(markers, kind)) for kind in ("response", "instruction", "end", "mask_out")})
    assert_drivers_equal_reference(moved(rows), big, last_turn_only, anchors=anchors_for(data, big))


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64])
def test_a_marker_id_of_2_to_the_40_neither_overflows_nor_allocates(dtype):
    big = 2**40
    markers = Markers(response=[[7, big]], end=[[8]])
    assert markers.compiled().automaton.classes.nbytes < 64
    rows = [[1, 7, 2, 3, 8, 9], [7, 8, 2**31 - 1, 8]]
    assert_drivers_equal_reference(rows, markers, False, dtype)
    if dtype is np.int64:
        assert_drivers_equal_reference([[1, 7, big, 3, 8, 7, big]], markers, True, dtype)


def test_hundreds_of_distinct_marker_tokens_use_a_wider_class_table():
    rng = np.random.default_rng(3)
    response = [[1000, int(v)] for v in rng.choice(np.arange(2000, 2600), 300, replace=False)]
    markers = Markers(response=response, end=[[5]])
    assert markers.compiled().automaton.classes.dtype == np.uint16
    tokens = np.concatenate([[1000], rng.choice(np.arange(1990, 2610), 30), [5]])
    rows = [rng.choice(tokens, 200).tolist() for _ in range(20)]
    for last_turn_only in (False, True):
        assert_drivers_equal_reference(rows, markers, last_turn_only)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), last_turn_only=st.booleans(), dtype=st.sampled_from([np.int32, np.int64, np.uint16]))
def test_candidates_on_the_edges_of_the_prefilter_blocks(data, last_turn_only, dtype):
    """Long rows of filler with markers, decoy anchors (an anchor id no pattern goes on from) and
    negative-free ids placed just before, on and after the edges of the scan's blocks, and at row ends:
    the block prefilter must neither miss a stop nor copy a block across one."""
    block = numba_kernel._BLOCK
    markers = Markers(response=[[50, 51, 52]], instruction=[[50, 53]], end=[[54]], mask_out=[[55, 56]])
    pieces = [[50, 51, 52], [50, 53], [54], [55, 56], [50], [50, 50, 51, 52], [52], [51, 52]]
    rows = []
    for _ in range(data.draw(st.integers(1, 6), label="rows")):
        length = data.draw(st.integers(0, 5 * block), label="length")
        row = (np.arange(length) % 7 + 1).tolist()  # filler: ids 1..7, in no pattern
        edges = sorted({e + d for e in range(0, length + block, block) for d in (-3, -2, -1, 0, 1)} & set(range(length)))
        for at in data.draw(st.lists(st.sampled_from(edges), max_size=8), label="at") if edges else []:
            piece = data.draw(st.sampled_from(pieces), label="piece")
            row[at:at + len(piece)] = piece
        rows.append(row[:length])
    assert_drivers_equal_reference(rows, markers, last_turn_only, dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), last_turn_only=st.booleans(), dtype=st.sampled_from([np.int32, np.int64]))
def test_matches_longer_than_a_block_and_anchored_far_inside_them(data, last_turn_only, dtype):
    """Patterns longer than the scan's block (a mask_out of 150 tokens, a response of 70) put their events
    and covers blocks away from their anchor; anchored on their last tokens, their blocks are written two
    or three blocks behind the scan. A dozen variants sharing one anchor are found by stepping the automaton.
    Pieces sit on block edges and at row ends, rows lie back to back (the scan of a row's last block reads
    the next row's ids), and the labels are the reference's."""
    block = numba_kernel._BLOCK
    long_mask = [60 + k % 5 for k in range(150)]  # ids 60..64
    long_response = [70] + [71] * 68 + [72]
    variants = [[80, 81, v] for v in range(1, 13)]  # their last ids are the filler's
    markers = Markers(response=[long_response] + variants, instruction=[[80, 82]], end=[[83], [72, 83]],
                      mask_out=[long_mask, [83, 85]])
    # anchored far inside the long patterns: anchor ids 72, 80, 83 and 60 (the mask's 141st token)
    far = (69,) + (0,) * 12 + (0,) + (0, 1) + (140, 0)
    anchors = data.draw(st.one_of(st.none(), st.just(far), st.just(anchors_for(data, markers))), label="anchors")
    pieces = [long_mask, long_response, long_mask[:100], long_response[:-1], long_response + [83], [80, 81, 3],
              [80, 81, 12], [80, 82], [83], [83, 85], [80], [72]]
    rows = []
    for _ in range(data.draw(st.integers(1, 5), label="rows")):
        length = data.draw(st.integers(0, 6 * block), label="length")
        row = (np.arange(length) % 7 + 1).tolist()  # filler: ids 1..7
        edges = sorted({e + d for e in range(0, length + block, block) for d in (-2, -1, 0, 1)} & set(range(length)))
        for at in data.draw(st.lists(st.sampled_from(edges), max_size=6), label="at") if edges else []:
            piece = data.draw(st.sampled_from(pieces), label="piece")
            row[at:at + len(piece)] = piece
        rows.append(row[:length])
    assert_drivers_equal_reference(rows, markers, last_turn_only, dtype, anchors=anchors)


def test_a_large_group_compares_its_shared_prefix_and_steps_the_automaton_over_the_rest():
    """Qwen's shape: 32 ``<|im_start|>assistant`` + whitespace variants anchored on ``assistant``. The direct
    kernel compares the two tokens they all begin with and steps the automaton from the state after them;
    a header cut by the row's start or end, or followed by no variant, matches nothing."""
    start, assistant, user, end = 151644, 77091, 872, 151645
    variants = [[start, assistant, w] for w in range(198, 230)]
    markers = Markers(response=variants, instruction=[[start, user, 198]], end=[[end]])
    anchors = (1,) * 32 + (1,) + (0,)
    automaton = markers.compiled().anchored(anchors)
    lengths, _ = numba_kernel.group_prefixes(automaton, automaton.group_lengths)
    assert sorted(lengths.tolist()) == [0, 0, 2]  # a one-pattern group's prefix is the whole pattern: none
    rows = [
        [assistant, 198, 5, 6, end, start, assistant, 199, 7, end],  # the first header cut by the row's start
        [start, user, 198, 5, start, assistant, 229, 8, 9, end, start, assistant],  # the last cut by its end
        [start, assistant, 300, 5, start, assistant, 210, 6, start, start, assistant, 211, 7, end, 8],
        [start, assistant], [assistant], [start, assistant, 198],
    ]
    for dtype in (np.int32, np.int64):
        assert_drivers_equal_reference(rows * 3, markers, False, dtype, anchors=anchors)


def test_the_prefilter_holds_at_most_four_anchor_ids_and_the_values_dtype():
    ids, usable = numba_kernel.prefilter_ids(np.array([3, 70000], np.int64), np.dtype(np.int16))
    assert usable and ids.dtype == np.int16 and ids.tolist() == [3, 3, 3, 3, 0]  # 70000 cannot occur in int16
    ids, usable = numba_kernel.prefilter_ids(np.arange(5, dtype=np.int64), np.dtype(np.int32))
    assert not usable  # five anchor ids: every token is classified by the table instead
    rows = [list(range(40)) * 3 + [0, 1, 2, 3, 4]]
    markers = Markers(response=[[0, 9]], instruction=[[1, 9]], end=[[2]], mask_out=[[3, 9], [4, 9]])
    assert markers.compiled().automaton.anchor_ids.size == 5
    assert_drivers_equal_reference(rows, markers, False)


def test_a_row_that_ends_inside_a_pending_match_and_rows_after_it():
    """The event ring is left clean between rows: a row that ends mid-pattern does not leak into the next."""
    markers = Markers(response=[[1, 2, 3, 4]], instruction=[[1, 2]], end=[[5]], mask_out=[[2, 3, 4, 9]])
    rows = [[1, 2, 3], [4, 6, 5], [1, 2, 3, 4], [6, 6, 5, 1], [2, 3, 4, 9, 6], [1, 2, 3, 4, 9, 6, 5]] * 30
    for last_turn_only in (False, True):
        assert_drivers_equal_reference(rows, markers, last_turn_only)


def test_anchors_are_the_tokens_the_data_holds_least():
    """Falcon's shape: headers open with the newlines that fill content, so they are anchored on the
    role words; a larger sample chooses again; the labels are the reference's whatever the anchors."""
    nl, assistant, user, colon = 193, 44295, 7932, 37
    markers = Markers(response=[[nl, nl, assistant, colon], [nl, assistant, colon], [assistant, colon]],
                      instruction=[[nl, nl, user, colon]])
    content = [5, nl, nl, 6, colon, nl, 7, nl, nl, colon]
    row = [nl, nl, user, colon] + content + [nl, nl, assistant, colon] + content * 3 + [nl, assistant, colon, 8]
    compiled = markers.compiled()
    assert compiled.automaton_for(np.array(row * 3)) is compiled.anchored((2, 1, 0, 2))
    # A smaller sample keeps the choice, though on its own it would choose otherwise.
    smaller = np.array([user] * 10)
    alone = Markers(response=markers.response, instruction=markers.instruction).compiled()
    assert alone.automaton_for(smaller) is not alone.anchored((2, 1, 0, 2))
    assert compiled.automaton_for(smaller) is compiled.anchored((2, 1, 0, 2))
    # Where the role word is common, the colon every pattern ends with stops least.
    assert compiled.automaton_for(np.array([assistant] * 200 + row)) is compiled.anchored((3, 2, 1, 3))
    # The sample is spread over the batch: 70,000 role words at its start do not decide alone.
    fresh = Markers(response=markers.response, instruction=markers.instruction).compiled()
    batch = np.array([assistant] * 70_000 + row * 10_000)
    assert fresh.automaton_for(batch) is fresh.anchored((2, 1, 0, 2))
    for anchors in (None, (2, 1, 0, 2), (3, 2, 1, 3)):
        assert_drivers_equal_reference([row, row[3:], row[::-1], row * 2], markers, False, anchors=anchors)
        assert_drivers_equal_reference([row, row[5:]], markers, True, anchors=anchors)


def test_anchors_outside_a_pattern_are_refused():
    with pytest.raises(ValueError, match="one offset inside each of the 2 patterns"):
        Markers(response=[[1, 2]], end=[[3]]).compiled().anchored((1, 1))


def test_a_stop_inside_a_match_anchored_further_on():
    """The scan stops at 2 (the anchor of [2, 1]) inside a match of [1, 2, 1, 3] anchored on its 3: the
    automaton must take over from where that match starts, not from the stop."""
    markers = Markers(response=[[1, 2, 1, 3]], instruction=[[2, 1]], end=[[4]])
    rows = [[5, 1, 2, 1, 3, 6, 4, 7], [1, 2, 1, 3, 6, 2, 1, 6, 1, 2, 1, 3, 4], [9, 9, 1, 2, 1, 2, 1, 3, 8, 4]]
    for anchors in [(3, 0, 0), (0, 0, 0), (2, 1, 0), (1, 0, 0)]:
        for last_turn_only in (False, True):
            assert_drivers_equal_reference(rows, markers, last_turn_only, anchors=anchors)


def test_anchor_choice_shares_one_token_between_variants():
    """Qwen's shape: 35 variants differing in a whitespace token, some never seen in the sample; one
    ``assistant`` anchors them all (each unseen whitespace alone would look free, and the seen ones
    would cost more than the token they share)."""
    start, assistant, user = 151644, 77091, 872
    spaces = list(range(198, 233))
    patterns = [[start, assistant, w] for w in spaces] + [[start, user, 198]]
    counts = {start: 862, assistant: 385, user: 477, 198: 2121, 199: 58, 200: 26}
    assert choose_anchors(patterns, counts) == (1,) * 35 + (1,)
    assert choose_anchors([[1, 2, 3], [4, 3]], {1: 9, 2: 9, 3: 5, 4: 1}) == (2, 1)  # 3 anchors both
    assert choose_anchors([[1, 2], [3]], {}) == (0, 0)  # nothing seen: the first tokens
