"""Aho-Corasick automata over token classes: what the numba engine runs instead of pattern loops.

The engine must find every occurrence of every pattern (overlapping ones included) in one forward
scan, at a cost per token that does not grow with the number of patterns. An Aho-Corasick automaton
does that: one table lookup per token gives the next state, and the state says which patterns end at
that token.

**Token classes.** A vocabulary has 10^5 ids, of which a marker set uses a few dozen. Every id that
occurs in no pattern is class 0, so the transition table has one column per *used* id plus one.

**Anchors.** Each pattern has one *anchor*: the token at some offset ``k`` of it (its first by default).
Classes are numbered so that anchor classes come last: ``cls < n_quiet`` means "no match can have its
anchor here", the one test the engine's tight loop makes on every token. The loop stops only at
anchors. When it stops at ``u``, every match not yet found has its anchor at ``u`` or later, so it
starts at or after ``u - max_anchor`` (the largest anchor offset): the engine steps the automaton over
those few tokens from the start state, and goes on from ``u`` as usual. The anchors change only speed,
never labels: the tokens the data holds least make the fewest stops (Falcon's ``\n\nUser:``
anchored on ``User``, not on the ``\n`` that fills content), and ``CompiledMarkers.automaton_for``
picks them from a sample of the tokens (``choose_anchors``).

Ids under ``DENSE_IDS`` are looked up in a dense table sized by the largest of them; larger ids
(legal, if unusual) go to a short sorted list, so a marker id of 2^40 costs a binary search on the
rare token beyond the table, never a 2^40-entry table.

**Events.** A match of pattern ``P`` (length ``L``) that ends at token ``e`` fires, per SPEC.md:
response: open at ``e+1`` and close at ``e+1-L``; instruction: close at ``e+1-L``; end: close at
``e+1``; mask_out: covers ``[e+1-L, e]``. Per state, all matches that end there are summarised: the
``OPEN_NEXT`` / ``CLOSE_NEXT`` bits, the lengths ``L`` of the closes at a start (``close_lengths``),
and the longest mask_out match (``mask_length``: the covers all end at ``e``, so the longest holds
the others). ``pending[state]`` is the length of the longest suffix of the text read so far that a
pattern may still grow from (a proper prefix of some pattern): no match can still start at or before
``e - pending``, so the labels up to there are final; where it is 0 the scan restarts from the start
state (no suffix matters any more: its transitions are the start state's).

**Backwards.** ``last_turn_only`` needs ``max(OPEN)`` before the forward scan; a second automaton
over the reversed response patterns finds it scanning back from the row's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

# Ids below this are classified by a dense table (at most 2 MiB of uint8, 4 MiB of uint16); ids at or
# above it by a binary search in a sorted list.
DENSE_IDS = 1 << 21
# Transition tables above this many entries are refused (only marker sets of thousands of distinct
# tokens reach it; real templates use a few dozen).
MAX_TABLE_ENTRIES = 1 << 25

# Bits of Automaton.outputs: what a state fires for the token that reached it.
OPEN_NEXT = 1  # a response pattern ends here: open at the next position
CLOSE_NEXT = 2  # an end pattern ends here: close at the next position
CLOSE_AT_START = 4  # a response or instruction pattern ends here: close at its start
MASK = 8  # a mask_out pattern ends here: positions [e+1-mask_length, e] are masked

# Kinds of Automaton.group_kinds.
DIRECT_RESPONSE, DIRECT_INSTRUCTION, DIRECT_END, DIRECT_MASK = range(4)


@dataclass(frozen=True, eq=False)
class Automaton:
    """The forward and backward automata of one marker set, as flat arrays (see the module doc)."""

    classes: np.ndarray  # uint8 or uint16, class of id v for v < len(classes)
    big_ids: np.ndarray  # uint64, sorted: pattern ids >= DENSE_IDS
    big_classes: np.ndarray  # same dtype as classes, their classes
    n_quiet: int  # classes below this are no pattern's anchor (the tight loop never stops there)
    n_classes: int
    goto: np.ndarray  # int32 [n_states * n_classes]: next state = goto[state * n_classes + cls]
    pending: np.ndarray  # int32 [n_states]: longest suffix of the state that a pattern may still extend
    outputs: np.ndarray  # uint8 [n_states]: OPEN_NEXT | CLOSE_NEXT | CLOSE_AT_START | MASK
    close_offsets: np.ndarray  # int32 [n_states + 1]: close_lengths[close_offsets[s]:close_offsets[s+1]]
    close_lengths: np.ndarray  # int32
    mask_length: np.ndarray  # int32 [n_states]
    pair: np.ndarray  # uint8 [(n_classes + 1) ** 2]: may a match have its anchor at class a followed by b?
    back_goto: np.ndarray  # int32 [n_back_states * n_classes], reversed response patterns
    back_quiet: np.ndarray  # uint8 [n_classes]: 1 where the backward start state stays put
    back_open_length: np.ndarray  # int32 [n_back_states]: longest response pattern starting here, or 0
    anchor_ids: np.ndarray  # int64, sorted: the ids of the anchor classes (class >= n_quiet)
    # The patterns grouped by the class of their anchor token, for the kernel that checks each pattern
    # at its anchor directly (``kernels/numba_kernel.py``): group ``c - n_quiet`` is
    # ``[group_offsets[g], group_offsets[g+1])`` of the arrays below, each pattern's kind (one of the
    # ``DIRECT_*`` codes), anchor offset, length and ids (``group_ids[group_starts[k]:][:group_lengths[k]]``).
    group_offsets: np.ndarray  # int64 [n_classes - n_quiet + 1]
    group_kinds: np.ndarray  # int8
    group_anchors: np.ndarray  # int64
    group_lengths: np.ndarray  # int64
    group_starts: np.ndarray  # int64
    group_ids: np.ndarray  # int64
    max_length: int  # longest pattern
    max_anchor: int  # largest anchor offset: a match starts at most this many tokens before its anchor
    max_response_length: int

    def kernel_args(self) -> tuple:
        """The arrays in the order ``kernels/numba_kernel.py`` unpacks them."""
        return (
            self.classes, self.big_ids, self.big_classes, self.goto, self.pending, self.outputs,
            self.close_offsets, self.close_lengths, self.mask_length, self.pair,
            self.back_goto, self.back_quiet, self.back_open_length,
        )

    def class_of(self, ids: np.ndarray) -> np.ndarray:
        """Classes of an array of ids (vectorised; the kernels do the same per token)."""
        ids = np.asarray(ids, dtype=np.int64)
        last = self.classes.shape[0] - 1
        out = self.classes[np.where(ids < 0, last, np.minimum(ids, last))].astype(np.int64)
        out[out == self.n_classes] = 0
        big = ids >= DENSE_IDS
        if big.any() and self.big_ids.size:
            at = np.searchsorted(self.big_ids, ids[big].astype(np.uint64))
            at = np.minimum(at, self.big_ids.size - 1)
            found = self.big_ids[at] == ids[big].astype(np.uint64)
            out[np.flatnonzero(big)[found]] = self.big_classes[at[found]]
        return out

    @classmethod
    def build(cls, patterns: Sequence[tuple[int, Sequence[int]]], *, response: int, instruction: int,
              end: int, mask_out: int, anchors: Sequence[int] | None = None) -> "Automaton":
        """``patterns``: (kind code, token ids) pairs; the four kind codes name which is which.

        ``anchors``: the offset of each pattern's anchor (see the module doc); by default each
        pattern's first token.
        """
        anchors = [0] * len(patterns) if anchors is None else [int(k) for k in anchors]
        if len(anchors) != len(patterns) or any(not 0 <= k < len(p) for k, (_, p) in zip(anchors, patterns)):
            raise ValueError(f"anchors {anchors} must give one offset inside each of the {len(patterns)} patterns")
        ids = np.unique(np.fromiter((t for _, p in patterns for t in p), dtype=np.int64))
        anchor_ids = np.unique(np.fromiter((p[k] for k, (_, p) in zip(anchors, patterns)), dtype=np.int64,
                                           count=len(patterns)))
        # Quiet ids (in patterns, no pattern's anchor) take classes 1..; anchors come last.
        quiet_ids = np.setdiff1d(ids, anchor_ids, assume_unique=True)
        ordered = np.concatenate([quiet_ids, anchor_ids])
        n_classes = 1 + ordered.size
        n_quiet = 1 + quiet_ids.size
        # One spare class value: BIG marks "look in big_ids" in the table's last slot.
        class_dtype = np.uint8 if n_classes < 1 << 8 else np.uint16 if n_classes < 1 << 16 else np.uint32
        small = ordered < DENSE_IDS
        # The table ends one past the largest small pattern id: kernels clamp every id to that last slot
        # (branch-free), which holds 0, or the BIG class when some pattern id is beyond the table.
        table = np.zeros(int(ordered[small].max()) + 2 if small.any() else 1, dtype=class_dtype)
        table[ordered[small]] = np.arange(1, n_classes, dtype=np.int64)[small]
        big_order = np.argsort(ordered[~small])
        big_ids = ordered[~small][big_order].astype(np.uint64)
        big_classes = np.arange(1, n_classes, dtype=np.int64)[~small][big_order].astype(class_dtype)
        if big_ids.size:
            table[-1] = n_classes  # the BIG class: not a column of goto; kernels resolve it first

        class_index = {int(t): k + 1 for k, t in enumerate(ordered)}
        coded = [(kind, [class_index[int(t)] for t in p]) for kind, p in patterns]
        goto, depth, order, fail, terminal = _trie_automaton([p for _, p in coded], n_classes)
        n_states = depth.shape[0]
        # pending: the depth of the longest suffix state (itself included) that is a proper prefix of some
        # pattern, i.e. that a match may still grow from; 0 where none (the scan may restart from the root).
        inner = np.zeros(n_states, dtype=bool)
        inner[_parents(goto, depth, n_classes)] = True
        pending = np.where(inner, depth, 0).astype(np.int32)
        for state in order[1:]:
            if not inner[state]:
                pending[state] = pending[fail[state]]
        outputs = np.zeros(n_states, dtype=np.uint8)
        mask_length = np.zeros(n_states, dtype=np.int32)
        closes: list[set[int]] = [set() for _ in range(n_states)]
        for (kind, p), state in zip(coded, terminal):
            if kind == response:
                outputs[state] |= OPEN_NEXT | CLOSE_AT_START
                closes[state].add(len(p))
            elif kind == instruction:
                outputs[state] |= CLOSE_AT_START
                closes[state].add(len(p))
            elif kind == end:
                outputs[state] |= CLOSE_NEXT
            elif kind == mask_out:
                outputs[state] |= MASK
                mask_length[state] = max(mask_length[state], len(p))
        for state in order[1:]:  # breadth first: a state's suffix (fail) state is already complete
            f = fail[state]
            outputs[state] |= outputs[f]
            mask_length[state] = max(mask_length[state], mask_length[f])
            closes[state] |= closes[f]
        close_offsets = np.zeros(n_states + 1, dtype=np.int32)
        np.cumsum([len(c) for c in closes], out=close_offsets[1:])
        close_lengths = np.array([length for c in closes for length in sorted(c)], dtype=np.int32)

        pair = _pair_table([p for _, p in coded], anchors, n_classes)

        responses = [p[::-1] for kind, p in coded if kind == response]
        back_goto, _, back_order, back_fail, back_terminal = _trie_automaton(responses, n_classes)
        back_open_length = np.zeros(back_goto.shape[0] // n_classes, dtype=np.int32)
        for p, state in zip(responses, back_terminal):
            back_open_length[state] = max(back_open_length[state], len(p))
        for state in back_order[1:]:
            back_open_length[state] = max(back_open_length[state], back_open_length[back_fail[state]])
        back_quiet = (back_goto[:n_classes] == 0).astype(np.uint8)

        return cls(
            classes=table, big_ids=big_ids, big_classes=big_classes, n_quiet=n_quiet, n_classes=n_classes,
            goto=goto, pending=pending, outputs=outputs, close_offsets=close_offsets, close_lengths=close_lengths,
            mask_length=mask_length, pair=pair, back_goto=back_goto, back_quiet=back_quiet,
            back_open_length=back_open_length, anchor_ids=np.sort(anchor_ids),
            **_anchor_groups(patterns, anchors, class_index, n_quiet, n_classes,
                             {response: DIRECT_RESPONSE, instruction: DIRECT_INSTRUCTION, end: DIRECT_END,
                              mask_out: DIRECT_MASK}),
            max_length=max(len(p) for _, p in coded),
            max_anchor=max(anchors),
            max_response_length=max(len(p) for p in responses),
        )


def _anchor_groups(patterns, anchors, class_index, n_quiet: int, n_classes: int, codes: dict) -> dict:
    """The ``group_*`` fields of ``Automaton``: the patterns ordered by the class of their anchor token."""
    order = sorted(range(len(patterns)), key=lambda k: class_index[int(patterns[k][1][anchors[k]])])
    group_of = np.array([class_index[int(patterns[k][1][anchors[k]])] - n_quiet for k in order], dtype=np.int64)
    lengths = np.array([len(patterns[k][1]) for k in order], dtype=np.int64)
    starts = np.zeros(len(order), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return dict(
        group_offsets=np.searchsorted(group_of, np.arange(n_classes - n_quiet + 1)).astype(np.int64),
        group_kinds=np.array([codes[patterns[k][0]] for k in order], dtype=np.int8),
        group_anchors=np.array([anchors[k] for k in order], dtype=np.int64),
        group_lengths=lengths,
        group_starts=starts,
        group_ids=np.array([int(t) for k in order for t in patterns[k][1]], dtype=np.int64),
    )


def choose_anchors(patterns: Sequence[Sequence[int]], counts: dict[int, int]) -> tuple[int, ...]:
    """The anchor offset of each pattern that makes the engine stop least often.

    The stops are the occurrences of every token some pattern is anchored on, so the sum of ``counts``
    (how often the data holds each token) over the chosen tokens is what to keep small: a weighted
    hitting set. Chosen greedily (the token with the fewest occurrences per pattern it would anchor
    first, the earliest in its patterns among equals), then pruned: a chosen token is dropped, the
    dearest first, where each of its patterns holds another chosen token. So Qwen's 35 whitespace
    variants all end up on the ``assistant`` they share, not each on its own rarely seen whitespace.
    """
    first: dict[int, dict[int, int]] = {}  # token -> {pattern: the token's first offset in it}
    for i, p in enumerate(patterns):
        for k, token in enumerate(p):
            first.setdefault(int(token), {}).setdefault(i, k)
    chosen: list[int] = []
    open_ = set(range(len(patterns)))
    while open_:
        def score(token: int) -> tuple:
            hits = [i for i in first[token] if i in open_]
            if not hits:
                return (float("inf"),)
            return counts.get(token, 0) / len(hits), max(first[token][i] for i in hits), token
        token = min(first, key=score)
        chosen.append(token)
        open_.difference_update(first[token])
    for token in sorted(chosen, key=lambda t: (-counts.get(t, 0), t)):
        rest = [t for t in chosen if t != token]
        if all(any(i in first[t] for t in rest) for i in first[token]):
            chosen = rest
    # Each pattern on the chosen token that comes first in it.
    return tuple(min(first[t][i] for t in chosen if i in first[t]) for i in range(len(patterns)))


def _pair_table(coded: list[list[int]], anchors: list[int], n_classes: int) -> np.ndarray:
    """``pair[a * (n_classes + 1) + b]``: may a match have its anchor at a token of class ``a`` followed by ``b``?

    True when some pattern has ``a`` at its anchor followed by ``b``, or ends at its anchor (then for
    any ``b``); ``b = 0`` (an id in no pattern, or no next token) is true only in that last case. The
    extra class ``n_classes`` (an id beyond the dense table, resolved later) is true both ways. Rows
    of quiet classes are never read. So the engine's tight loop steps over an anchor that is no
    match's anchor here (``<|im_start|>`` before ``system``, ``\n`` before a word), and the automaton
    sees it only when it matters.
    """
    width = n_classes + 1
    pair = np.zeros((width, width), dtype=np.uint8)
    for p, k in zip(coded, anchors):
        if k == len(p) - 1:
            pair[p[k]] = 1
        else:
            pair[p[k], p[k + 1]] = 1
            pair[p[k], n_classes] = 1
    pair[n_classes] = 1
    return pair.reshape(-1)


def _parents(goto: np.ndarray, depth: np.ndarray, n_classes: int) -> np.ndarray:
    """States that have a child in the trie: the targets one deeper than their source."""
    n_states = depth.shape[0]
    table = goto.reshape(n_states, n_classes)
    source, _ = np.nonzero(depth[table] == depth[:, None] + 1)
    return np.unique(source)


def _trie_automaton(patterns: list[list[int]], n_classes: int):
    """The Aho-Corasick automaton of class sequences, with a complete transition table.

    Returns ``(goto, depth, order, fail, terminal)``: ``goto`` flat int32 [n_states * n_classes],
    ``depth`` int32 [n_states], ``order`` the states breadth first (root 0 first), ``fail`` each
    state's longest proper suffix state, ``terminal[k]`` the state where pattern ``k`` ends.
    """
    children: list[dict[int, int]] = [{}]
    depth = [0]
    terminal = []
    for p in patterns:
        state = 0
        for c in p:
            nxt = children[state].get(c)
            if nxt is None:
                nxt = len(children)
                children[state][c] = nxt
                children.append({})
                depth.append(depth[state] + 1)
            state = nxt
        terminal.append(state)
    n_states = len(children)
    if n_states * n_classes > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"these markers ({len(patterns)} patterns over {n_classes - 1} distinct token ids) make an automaton of "
            f"{n_states} x {n_classes} transitions, above the engine's limit of {MAX_TABLE_ENTRIES}; "
            "real chat templates need a few dozen patterns: pass only the variants the data holds"
        )
    goto = np.zeros((n_states, n_classes), dtype=np.int32)
    fail = np.zeros(n_states, dtype=np.int32)
    for c, child in children[0].items():
        goto[0, c] = child  # root's children keep fail 0
    queue = list(children[0].values())
    head = 0
    while head < len(queue):  # breadth first: a state's fail state is always complete before it
        state = queue[head]
        head += 1
        goto[state] = goto[fail[state]]  # what the longest suffix would do, for every class ...
        for c, child in children[state].items():  # ... except where the trie goes on
            fail[child] = goto[fail[state], c]
            goto[state, c] = child
            queue.append(child)
    return goto.reshape(-1), np.array(depth, dtype=np.int32), [0] + queue, fail, terminal
