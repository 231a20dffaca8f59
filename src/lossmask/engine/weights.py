"""A float weight per token, from the marker labels and what the messages ask (docs/weights.md).

The markers decide where assistant turns train (a *run*: consecutive trained tokens). Weights refine that, in
this order, each source over the ones before it:

1. every run takes its message's weight: the role's, or the message's own field (``chat/weights.py``); rows
   whose turns all weigh the same take it without looking at characters (``RowPlan.uniform``);
2. on ``exact`` rows, runs are tied to their message by the located text: two runs of one assistant message with
   no message text between them are one turn, and the template's text between them trains (gpt-oss writes
   ``<|start|>assistant`` between the analysis and the final channel, and the model generates it);
3. character segments (spans, content parts, the text of other roles that ``roles_to_train`` trains) and the
   reasoning policy's lead (a turn's trained tokens before its answer); a token that straddles a segment's edge
   takes the lower of the two weights;
4. the stop-token policy (``train_on_eos``, axolotl's meaning): ``turn`` keeps each run's stop token, ``last`` only
   the row's last run's, ``none`` none, ``all`` every stop token, outside the runs too; the stop token that ``last``
   or ``all`` trains weighs 1 where its turn weighs 0;
5. ``prompt_weight`` for every token nothing above claimed, in the rows where something trains.

Labels are the ids where the weight is > 0. The passes over the batch's tokens are numba kernels
(``kernels/weight_rows.py``): the run weights, then the exact rows (steps 2 and 3), then the prompt weight, the labels
and the totals. Python loops over rows and messages only to gather the plans; the stop-token policy is NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from .buffers import rows_from_arrow

ROLE_NAMES = ("", "assistant", "prompt", "stop token")  # role codes 0..3; other roles follow (Weighed.names)
_ASSISTANT, _PROMPT, _STOP = 1, 2, 3
_STRIDE = np.int64(1) << np.int64(36)  # rows' characters placed apart on one axis (no text is this long)


@dataclass
class Weighed:
    """A batch's weights and what follows from them, rows back to back.

    ``weights``: float32 per token; ``role``: a code per token into ``names`` (0: none); ``labels``: the id where the
    weight is > 0, else ``ignore_index``; ``changed``: do they differ from the marker labels; ``row_tokens`` and
    ``row_mass``: trained tokens and weight mass per row; ``by_role``: ``{role: [trained tokens, weight mass]}``;
    ``odd``: does a weight other than 0 or 1 occur?"""

    weights: np.ndarray
    role: np.ndarray
    names: tuple[str, ...]
    labels: np.ndarray
    changed: bool
    row_tokens: np.ndarray
    row_mass: np.ndarray
    by_role: dict
    odd: bool


class ExactPlans:
    """The exact rows' plans of one batch (``chat.weights.RowPlan``), gathered in the order they were made: what
    ``_exact_arrays`` turns into the kernel's arrays. Filled as the rows are planned (``add``), so that no second
    pass over per-row objects is needed: on 8,000 chats under ``roles_to_train`` that pass took as long as planning
    them. Per row it keeps a few counts and references; per message, its weight and its role's code (``names``: the
    roles in the order they first come, the assistant's code 0), worked out once per role sequence."""

    __slots__ = ("n_messages", "weights", "codes", "names", "pieces", "n_segments", "segments", "n_leads", "leads",
                 "_codes")

    def __init__(self) -> None:
        self.n_messages: list[int] = []
        self.weights: list[float] = []
        self.codes: list[int] = []  # per message: its role's index in ``names``
        self.names: dict[str, int] = {"assistant": 0}
        self.pieces: list[Sequence[tuple]] = []  # per row: its plan's (start, end, message, required) pieces
        self.n_segments: list[int] = []
        self.segments: list[float] = []  # (start, end, weight, message, assistant) a segment, back to back
        self.n_leads: list[int] = []
        self.leads: list[float] = []  # (message, answer_start, weight)
        self._codes: dict[tuple, tuple[int, ...]] = {}  # a role sequence -> its codes

    @classmethod
    def of(cls, plans: Sequence[Any]) -> "ExactPlans":
        out = cls()
        for plan in plans:
            out.add(plan)
        return out

    def add(self, plan: Any) -> None:
        """One exact row's ``chat.weights.RowPlan``, appended."""
        roles = plan.roles if type(plan.roles) is tuple else tuple(plan.roles)
        codes = self._codes.get(roles)
        if codes is None:
            names = self.names
            codes = self._codes[roles] = tuple(names.setdefault(role, len(names)) for role in roles)
        self.n_messages.append(len(roles))
        self.weights += plan.weights
        self.codes += codes
        self.pieces.append(plan.pieces)
        segments, leads = plan.segments, plan.leads
        self.n_segments.append(len(segments))
        if segments:  # most rows have neither
            self.segments += chain.from_iterable(segments)
        self.n_leads.append(len(leads))
        if leads:
            self.leads += chain.from_iterable(leads)

    def piece_array(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's pieces as one ``(n, 4)`` int64 array (read straight off the tuples), and where each row's
        begin."""
        counts = np.fromiter(map(len, self.pieces), dtype=np.int64, count=len(self.pieces))
        offsets = np.zeros(counts.shape[0] + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(self.pieces)), dtype=np.int64,
                           count=4 * int(offsets[-1]))
        return flat.reshape(-1, 4), offsets

    def __len__(self) -> int:
        return len(self.n_messages)


def weigh_tokens(ids: np.ndarray, lengths: np.ndarray, labels: np.ndarray, ignore_index: int, planned: Any,
                 end_patterns: Sequence[Sequence[int]], options: Any, never: np.ndarray | None = None) -> Weighed:
    """The weight of every token of a batch (flat ``ids`` and marker ``labels``, ``lengths`` per row).

    ``planned``: the messages' ``encode_rendered.PlannedWeights`` (None for pre-tokenised ids: only the stop-token
    policy and the prompt weight apply). ``end_patterns``: the markers' stop-token patterns. ``never``: a bool per
    token that weighs 0 whatever the options (inside an image). One kernel call a batch (``kernels/weight_rows.py``:
    ``weigh_batch``); a stop-token policy other than ``turn`` puts its NumPy passes between the kernel's steps.
    ``_weigh_tokens_numpy`` is the reference."""
    from .kernels.weight_rows import finish_weights, start_weights, weigh_batch, weigh_exact  # numba loads on first use

    lengths, row_starts, labels, ignore, out, never = _batch(lengths, labels, ignore_index, never)
    prompt = np.float32(options.prompt_weight or 0)
    names = list(ROLE_NAMES)
    exact = _exact_arrays(planned, row_starts, lengths, names)
    uniform = _uniform(planned, lengths.shape[0])
    if options.train_on_eos != "turn" and end_patterns and ids.shape[0]:
        weights, role = start_weights(labels, ignore, uniform, row_starts, lengths)
        in_run = labels != ignore  # the runs, as steps 2-4 leave them
        weigh_exact(*exact, in_run, weights, role)
        row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
        _stop_tokens(ids, row_of, row_starts, in_run, weights, role, end_patterns, options.train_on_eos)
        totals = finish_weights(weights, role, labels, ignore, np.ascontiguousarray(ids), row_starts, lengths, prompt,
                                never, len(names), out)
    else:
        # one call: on a job's labelling thread each release of the GIL costs a wait to take it back from the thread
        # that renders (up to the interpreter's switch interval), so the steps run in one kernel, not three
        rows = planned.rows if exact[0].shape[0] else exact[0]
        weights, role, *totals = weigh_batch(labels, ignore, uniform, row_starts, lengths, rows, *exact[1:],
                                             np.ascontiguousarray(ids), prompt, never, len(names), out)
    return _weighed(weights, role, names, out, *totals)


def _batch(lengths, labels, ignore_index, never):
    """The batch's arrays as the kernels take them, and the labels' output buffer."""
    lengths = np.asarray(lengths, dtype=np.int64)
    labels = np.ascontiguousarray(labels)
    never = np.zeros(0, dtype=bool) if never is None else np.ascontiguousarray(never, dtype=bool)
    return (lengths, _row_starts(lengths), labels, labels.dtype.type(ignore_index),
            np.empty(labels.shape[0], dtype=labels.dtype), never)


def _weighed(weights, role, names, labels, row_tokens, row_mass, role_tokens, role_mass, changed, odd) -> Weighed:
    by_role = {names[c]: [int(role_tokens[c]), float(role_mass[c])] for c in range(1, len(names)) if role_tokens[c]}
    return Weighed(weights, role, tuple(names), labels, bool(changed), row_tokens, row_mass, by_role, bool(odd))


def _weigh_tokens_numpy(ids, lengths, labels, ignore_index, planned, end_patterns, options, never=None) -> Weighed:
    """``weigh_tokens`` in NumPy, step by step: the reference its kernels are tested against (``tests/test_weights``)."""
    from .kernels.weight_rows import reference_finish, reference_start

    lengths, row_starts, labels, ignore, out, never = _batch(lengths, labels, ignore_index, never)
    names = list(ROLE_NAMES)
    weights, role = reference_start(labels, ignore, _uniform(planned, lengths.shape[0]), row_starts, lengths)
    in_run = labels != ignore
    if planned is not None and planned.plans and planned.rows.size:
        _weigh_exact_numpy(planned, lengths, row_starts, in_run, weights, role, names)
    if options.train_on_eos != "turn" and end_patterns and ids.shape[0]:
        row_of = np.repeat(np.arange(lengths.shape[0]), lengths)
        _stop_tokens(ids, row_of, row_starts, in_run, weights, role, end_patterns, options.train_on_eos)
    totals = reference_finish(weights, role, labels, ignore, ids, row_starts, lengths,
                              np.float32(options.prompt_weight or 0), never, len(names), out)
    return _weighed(weights, role, names, out, *totals)


def _uniform(planned, n_rows: int) -> np.ndarray:
    """Each row's weight for every assistant turn (1 where the row has no plan)."""
    if planned is None or not planned.plans:
        return np.ones(n_rows, dtype=np.float32)
    return np.fromiter((1.0 if p is None else p.uniform for p in planned.plans), dtype=np.float32,
                       count=len(planned.plans))


def _row_starts(lengths: np.ndarray) -> np.ndarray:
    """Where each row begins in the flat tokens (rows back to back)."""
    starts = np.zeros(lengths.shape[0], dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def _exact_arrays(planned, row_starts, lengths, names) -> tuple:
    """What ``weigh_exact`` takes about the exact rows (steps 2 and 3), but the per-token arrays: the plans gathered
    into flat arrays (Python over rows, NumPy over their messages, pieces and segments). ``names`` gains the roles
    other than the assistant whose text trains. Empty arrays of the same types where no row is exact (one compiled
    signature)."""
    if planned is None or not planned.plans or not planned.rows.size:
        i, c, f, one = np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32), np.zeros(1, np.int64)
        return (i, i, c, c, one, f, np.zeros(0, bool), np.zeros(0, np.int16), np.zeros(0, np.float64), f, one, i, i, i,
                one, i, i, f, i, np.zeros(0, bool))
    rows = planned.rows
    flat = planned.exact_plans
    if flat is None or len(flat) != rows.shape[0]:  # planned by hand (verify, tests): gathered here
        flat = ExactPlans.of([planned.plans[r] for r in rows])
    msg_off = _offsets(flat.n_messages)
    msg_weight = np.array(flat.weights, dtype=np.float32)
    local = np.array(flat.codes, dtype=np.int16)  # per message, its role's index in flat.names (assistant: 0)
    msg_assistant = local == 0
    pieces, piece_off = flat.piece_array()
    segments, seg_off = np.array(flat.segments, dtype=np.float64).reshape(-1, 5), _offsets(flat.n_segments)
    leads, lead_off = np.array(flat.leads, dtype=np.float64).reshape(-1, 3), _offsets(flat.n_leads)
    lead_at = np.full(msg_weight.shape[0], -np.inf)  # no lead: nothing lies before it
    lead_w = np.zeros(msg_weight.shape[0], dtype=np.float32)
    if leads.shape[0]:
        at = msg_off[:-1][np.repeat(np.arange(rows.shape[0]), np.diff(lead_off))] + leads[:, 0].astype(np.int64)
        lead_at[at], lead_w[at] = leads[:, 1], leads[:, 2]
    seg_m = segments[:, 3].astype(np.int64)
    seg_a = segments[:, 4].astype(bool)
    msg_code = np.zeros(msg_weight.shape[0], dtype=np.int16)  # the role code other roles' text takes where it trains
    if (~seg_a).any() or (~msg_assistant & (msg_weight > 0)).any():
        for name in flat.names:  # in the order they first come
            if name != "assistant" and name not in names:
                names.append(name)
        table = np.array([0 if name == "assistant" else names.index(name) for name in flat.names], dtype=np.int16)
        msg_code = table[local]
    # the tokens' characters: int32 in one layout (a row's characters fit; no copy where they come so)
    return (row_starts[rows], lengths[rows], np.ascontiguousarray(planned.starts, dtype=np.int32),
            np.ascontiguousarray(planned.ends, dtype=np.int32), msg_off, msg_weight, msg_assistant, msg_code, lead_at,
            lead_w, piece_off, pieces[:, 0].copy(), pieces[:, 1].copy(), pieces[:, 2].copy(), seg_off,
            segments[:, 0].astype(np.int64), segments[:, 1].astype(np.int64), segments[:, 2].astype(np.float32), seg_m,
            seg_a)


def _offsets(counts: list[int]) -> np.ndarray:
    """Where each of consecutive groups of ``counts`` items begins, and the end."""
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _weigh_exact(planned, lengths, row_starts, in_run, weights, role, names) -> None:
    """Steps 2 and 3 on the exact rows, in place, in their kernel alone (``weigh_exact``; ``_weigh_exact_numpy`` is
    its reference)."""
    from .kernels.weight_rows import weigh_exact

    weigh_exact(*_exact_arrays(planned, row_starts, lengths, names), in_run, weights, role)


def _flat(plans, name: str, width: int, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """The ``name`` tuples of every plan as one ``(n, width)`` array, and where each plan's begin."""
    counts = np.fromiter((len(getattr(p, name)) for p in plans), dtype=np.int64, count=len(plans))
    offsets = np.zeros(len(plans) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    items = [item for p in plans for item in getattr(p, name)]
    return np.asarray(items, dtype=dtype).reshape(-1, width), offsets


def _weigh_exact_numpy(planned, lengths, row_starts, in_run, weights, role, names) -> None:
    """``_weigh_exact`` in NumPy over the exact rows' tokens, the reference its kernel is tested against."""
    rows = planned.rows
    plans = [planned.plans[r] for r in rows]
    lens = lengths[rows]
    total = int(lens.sum())
    k_of = np.repeat(np.arange(rows.shape[0]), lens)
    pos = row_starts[rows][k_of] + (np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens))
    base = k_of.astype(np.int64) * _STRIDE
    cs, ce = planned.starts + base, planned.ends + base
    # the plans' messages, pieces, segments and leads on one axis: each row's characters placed _STRIDE apart and its
    # messages numbered after the rows' before it (flattened in Python, placed with NumPy)
    n_messages = np.fromiter((len(p.weights) for p in plans), dtype=np.int64, count=len(plans))
    first = np.cumsum(n_messages) - n_messages
    msg_weight = np.fromiter((w for p in plans for w in p.weights), dtype=np.float32, count=int(n_messages.sum()))
    msg_role = [name for p in plans for name in p.roles]
    is_assistant = np.fromiter((name == "assistant" for name in msg_role), dtype=bool, count=len(msg_role))
    piece_arr = _on_one_axis(plans, "pieces", 4, first, chars=(0, 1), message=2)
    segment_arr = _on_one_axis(plans, "segments", 5, first, chars=(0, 1), message=3)
    lead_arr = _on_one_axis(plans, "leads", 3, first, chars=(1,), message=0)
    tr = in_run[pos]
    # step 2: tie runs to messages, join the runs of one message, tie again
    starts_at, ends_at, message = _runs(tr, k_of, cs, ce, piece_arr, is_assistant)
    same = (message[:-1] >= 0) & (message[:-1] == message[1:]) & (k_of[starts_at[1:]] == k_of[ends_at[:-1]]) \
        if message.size > 1 else np.zeros(0, dtype=bool)
    if same.any() and piece_arr.size:
        between = np.searchsorted(piece_arr[:, 0], ce[ends_at[:-1]], "left") == \
            np.searchsorted(piece_arr[:, 0], cs[starts_at[1:]], "left")
        join = np.flatnonzero(same & between)
        if join.size:
            delta = np.zeros(total + 1, dtype=np.int64)
            np.add.at(delta, ends_at[:-1][join] + 1, 1)
            np.add.at(delta, starts_at[1:][join], -1)
            tr = tr | (np.cumsum(delta)[:-1] > 0)
            starts_at, ends_at, message = _runs(tr, k_of, cs, ce, piece_arr, is_assistant)
    begins = np.zeros(total, dtype=bool)
    begins[starts_at] = True
    run_id = np.cumsum(begins) - 1
    tok_msg = np.where(tr, message[np.maximum(run_id, 0)] if message.size else -1, -1)
    w = weights[pos]  # a fancy index: a copy already
    w = np.where(tr, np.where(tok_msg >= 0, msg_weight[np.maximum(tok_msg, 0)] if msg_weight.size else 0, w), 0)
    w = w.astype(np.float32)
    r = np.where(tr, _ASSISTANT, role[pos])
    # step 3: the reasoning policy's leads
    if lead_arr.shape[0]:
        lead = lead_arr
        lead_at = np.full(msg_weight.shape[0], -np.inf)
        lead_w = np.zeros(msg_weight.shape[0], dtype=np.float32)
        lead_at[lead[:, 0].astype(np.int64)] = lead[:, 1]
        lead_w[lead[:, 0].astype(np.int64)] = lead[:, 2]
        m = np.maximum(tok_msg, 0)
        before = tr & (tok_msg >= 0) & (cs < lead_at[m])
        whole = before & (ce <= lead_at[m])
        w = np.where(whole, lead_w[m], np.where(before, np.minimum(w, lead_w[m]), w)).astype(np.float32)
    # step 3: character segments, after the pieces of other roles' messages that weigh > 0 (roles_to_train)
    if piece_arr.shape[0]:
        role_pieces = piece_arr[~is_assistant[piece_arr[:, 2]] & (msg_weight[piece_arr[:, 2]] > 0)]
        as_segments = np.column_stack([role_pieces[:, 0], role_pieces[:, 1], msg_weight[role_pieces[:, 2]],
                                       role_pieces[:, 2], np.zeros(role_pieces.shape[0])]).astype(np.float64)
        segment_arr = np.concatenate([as_segments, segment_arr])
    if segment_arr.shape[0]:
        seg_s = segment_arr[:, 0].astype(np.int64)
        seg_e = segment_arr[:, 1].astype(np.int64)
        seg_w = segment_arr[:, 2].astype(np.float32)
        seg_m = segment_arr[:, 3].astype(np.int64)
        seg_a = segment_arr[:, 4].astype(bool)
        first = np.searchsorted(ce, seg_s, "right")
        last = np.searchsorted(cs, seg_e, "left")
        counts = np.maximum(last - first, 0)
        seg_of = np.repeat(np.arange(seg_s.shape[0]), counts)
        idx = first[seg_of] + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        eligible = np.where(seg_a[seg_of], tr[idx] & (tok_msg[idx] == seg_m[seg_of]), ~tr[idx])
        whole = eligible & (cs[idx] >= seg_s[seg_of]) & (ce[idx] <= seg_e[seg_of]) & (ce[idx] > cs[idx])
        w[idx[whole]] = seg_w[seg_of[whole]]
        other = whole & ~seg_a[seg_of]
        if other.any():
            role_names = [msg_role[int(m)] for m in seg_m]
            codes = np.empty(seg_s.shape[0], dtype=np.int16)
            for j, name in enumerate(role_names):
                if name not in names:
                    names.append(name)
                codes[j] = names.index(name)
            r[idx[other]] = codes[seg_of[other]]
        straddle = eligible & ~whole & seg_a[seg_of]
        np.minimum.at(w, idx[straddle], seg_w[seg_of[straddle]])
    in_run[pos] = tr
    weights[pos] = w
    role[pos] = r


def _on_one_axis(plans, name: str, width: int, first: np.ndarray, *, chars: tuple, message: int) -> np.ndarray:
    """``_flat``, with the columns in ``chars`` moved to their row's place on the one axis (``k * _STRIDE``) and the
    ``message`` column numbered after the rows' before it. Float64 when a column holds a weight (exact for the
    characters: they stay below 2**53)."""
    out, offsets = _flat(plans, name, width, np.int64 if name == "pieces" else np.float64)
    if out.shape[0]:
        counts = np.diff(offsets)
        k = np.repeat(np.arange(len(plans), dtype=np.int64), counts)
        for column in chars:
            out[:, column] += k * _STRIDE
        out[:, message] += np.repeat(first, counts)
    return out


def _runs(tr, k_of, cs, ce, pieces, is_assistant):
    """First and last token of each run (in order), and the message each is tied to: the first located piece that
    ends after the run starts, when it also starts before the run ends and belongs to an assistant (else -1)."""
    total = tr.shape[0]
    prev = np.zeros(total, dtype=bool)
    prev[1:] = tr[:-1] & (k_of[1:] == k_of[:-1])
    nxt = np.zeros(total, dtype=bool)
    nxt[:-1] = tr[1:] & (k_of[1:] == k_of[:-1])
    starts_at = np.flatnonzero(tr & ~prev)
    ends_at = np.flatnonzero(tr & ~nxt)
    if not pieces.size or not starts_at.size:
        return starts_at, ends_at, np.full(starts_at.shape[0], -1, dtype=np.int64)
    # pieces are sorted by start and disjoint, so their ends are sorted too
    k = np.searchsorted(pieces[:, 1], cs[starts_at], "right")
    ok = k < pieces.shape[0]
    kk = np.minimum(k, pieces.shape[0] - 1)
    ok &= pieces[kk, 0] < ce[ends_at]
    message = np.where(ok, pieces[kk, 2], -1)
    message = np.where((message >= 0) & is_assistant[np.maximum(message, 0)], message, -1)
    return starts_at, ends_at, message


def _stop_tokens(ids, row_of, row_starts, in_run, weights, role, end_patterns, policy) -> None:
    """Step 4, in place: the stop-token policy over every row."""
    total = ids.shape[0]
    nxt = np.zeros(total, dtype=bool)
    nxt[:-1] = in_run[1:] & (row_of[1:] == row_of[:-1])
    run_end = in_run & ~nxt
    stop = np.zeros(total, dtype=bool)  # every token of a stop-token match that closes a run
    outside = np.zeros(total, dtype=bool)  # every token of a match outside the runs
    for pattern in end_patterns:
        pattern = np.asarray(pattern, dtype=ids.dtype)
        n = pattern.shape[0]
        if n > total:
            continue
        hit = np.ones(total - n + 1, dtype=bool)
        for j in range(n):
            hit &= ids[j:total - n + 1 + j] == pattern[j]
        begin = np.flatnonzero(hit)
        begin = begin[row_of[begin] == row_of[begin + n - 1]]
        end = begin + n - 1
        closes = run_end[end]
        for j in range(n):
            stop[begin[closes] + j] = True
            outside[begin[~closes & ~in_run[end]] + j] = True
    if policy == "none":
        weights[stop] = 0.0
    elif policy == "last":  # the stop tokens of every run but the row's last; that one trains, whatever its turn weighs
        prev = np.zeros(total, dtype=bool)
        prev[1:] = in_run[:-1] & (row_of[1:] == row_of[:-1])
        starts = np.flatnonzero(in_run & ~prev)
        last_start = np.full(row_starts.shape[0], -1, dtype=np.int64)
        np.maximum.at(last_start, row_of[starts], starts)
        stops = np.flatnonzero(stop)
        earlier = stops < last_start[row_of[stops]]
        weights[stops[earlier]] = 0.0
        _train_stop(stops[~earlier], weights, role)
    elif policy == "all":  # every stop token trains: after other roles' turns, and after turns that weigh 0
        weights[outside] = 1.0
        role[outside] = _STOP
        in_run |= outside
        _train_stop(np.flatnonzero(stop), weights, role)


def _train_stop(at: np.ndarray, weights: np.ndarray, role: np.ndarray) -> None:
    """The stop tokens ``at`` train: those of a turn that weighs 0 (``training: false``) take weight 1, as axolotl's
    ``train_on_eos`` trains them; the others keep their turn's weight."""
    zero = at[weights[at] <= 0]
    weights[zero] = 1.0
    role[zero] = _STOP


def weights_to_arrow(like: pa.Array, values: np.ndarray) -> pa.Array:
    """A ``list<float32>`` array shaped like ``like`` (a list array of token ids, the same rows, no nulls) holding
    ``values`` (``large_list`` past 2**31 values). Made from buffers: no compute call, which would release the GIL."""
    rows = rows_from_arrow(like)  # views of its offsets, re-based to its first value
    offsets = np.append(rows.starts, rows.ends[-1:] if len(rows) else 0).astype(np.int64)
    large = int(offsets[-1]) >= 2 ** 31
    kind = pa.large_list(pa.float32()) if large else pa.list_(pa.float32())
    return pa.Array.from_buffers(kind, len(rows), [None, pa.py_buffer(offsets if large else offsets.astype(np.int32))],
                                 children=[pa.array(np.ascontiguousarray(values, dtype=np.float32))])


def weight_field_types(schema: pa.Schema, options: Any) -> list[pa.DataType]:
    """The Arrow types of the weight fields a chat column's messages (their content parts, their spans) carry."""
    names = set(options.weight_fields())
    found: list[pa.DataType] = []

    def walk(arrow_type: pa.DataType, depth: int, keys: set) -> None:
        if depth > 4:
            return
        if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
            walk(arrow_type.value_type, depth + 1, keys)
        elif pa.types.is_struct(arrow_type):
            for i in range(arrow_type.num_fields):
                child = arrow_type.field(i)
                if child.name in keys and not (pa.types.is_struct(child.type) or pa.types.is_list(child.type)):
                    found.append(child.type)
                # a span's own weight (detail_field) counts whatever the message fields are
                walk(child.type, depth + 1, keys | {"weight"} if child.name == options.detail_field else keys)

    for name in {options.chat_column(schema.names), options.prompt_column, options.completion_column}:
        if name in schema.names:
            walk(schema.field(name).type, 0, names)
            # JSON text (JSON Lines input): the keys that held numbers in the rows read for the schema
            keys = (schema.field(name).metadata or {}).get(b"lossmask.numeric_keys", b"").decode().split(",")
            found += [pa.float64() for key in keys if key in names]
    return found
