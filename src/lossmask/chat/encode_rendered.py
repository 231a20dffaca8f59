"""Rendered chat rows to token ids, with message text kept as data: the step every messages path shares.

``encode_rendered`` takes rows that the chat template has rendered, with their messages, and:

1. locates every message's text in its rendering (``locate.py``); a row where the template dropped
   or rewrote a message is dropped as ``content_dropped``, never labelled;
2. finds special-token strings in message text (``specials.py``) and applies
   ``special_tokens_in_content``: ``"text"`` (default: encoded as ordinary text), ``"keep"`` (as the
   tokenizer splits them: control tokens), ``"drop"`` (the row, as ``special_tokens_in_content``) or
   ``"error"`` (raise, naming the row, message, role and token);
3. tokenises the rows in one batch call with offsets (only rows whose text holds a special-token
   string take the row-by-row text path);
4. marks, per token, whether it lies wholly inside message text (``in_content``). Labelling treats
   those tokens as inert: no marker can match them (``labels.label_batch(data_mask=...)``), so
   nothing a message says can open, close or extend a trained span. A token that straddles the
   edge between template and text stays active, so header variants that merge with a content's
   leading whitespace still match;
5. for the rows asked (``check``), marks per token which message's text it lies wholly inside, and that
   message's role (``RoleTokens``): the batch step checks the role invariant on them after labelling.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from ..engine.outcomes import CONTENT_DROPPED, INVALID, SPECIAL_TOKENS
from ..engine.weights import ExactPlans
from ..options import SPECIAL_TOKENS_IN_CONTENT
from .gc_pause import paused_collection
from .locate import locate_messages, message_pieces, stray_think
from .weights import WeightReader, plan_row


@dataclass
class EncodedRows:
    """Token ids of the rows kept (``keep`` marks them among the input rows) and what happened to the rest.

    ``in_content``: a bool per token of ``input_ids`` (its values back to back), True where the token
    lies wholly inside message text. ``dropped``: ``(row, reason, message)``. ``special_rows``: rows
    whose message text held a special-token string (whatever the policy), with one example.
    """

    input_ids: pa.LargeListArray
    in_content: np.ndarray | None
    keep: np.ndarray
    dropped: list[tuple[int, str, str]] = field(default_factory=list)
    special_rows: int = 0
    special_example: str | None = None
    roles: "RoleTokens | None" = None
    weights: "PlannedWeights | None" = None


@dataclass
class PlannedWeights:
    """Each kept row's ``chat.weights.RowPlan`` (None: defaults), and for the ``exact`` rows (``rows``, in order) the
    character span of each of their tokens (back to back, in the row's own text): ``starts``/``ends``."""

    plans: list
    rows: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    exact_plans: Any = None  # the exact rows' plans, flat (engine.weights.ExactPlans), where locating made them so


@dataclass
class RoleTokens:
    """Per token of ``input_ids`` (back to back), whose text it lies wholly inside, for the role invariant.

    ``role``: 0 outside any checked text, else 1 + an index into ``names`` (the roles seen); ``message``: the
    message's index in its conversation (-1 outside). Assistant text counts only where its trained part is
    required (content, tool-call arguments); reasoning and tool names are left out, as templates keep or
    drop them by their own policy. Rows not checked are all 0."""

    role: np.ndarray
    message: np.ndarray
    names: tuple[str, ...]


def check_policy(special_tokens_in_content: str) -> str:
    if special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
        raise ValueError(
            f"special_tokens_in_content={special_tokens_in_content!r}; pass one of {SPECIAL_TOKENS_IN_CONTENT} "
            "('text' encodes special-token strings in message text as ordinary text)"
        )
    return special_tokens_in_content


@dataclass
class LocatedRows:
    """Steps 1 and 2 of ``encode_rendered``, done: what a worker process sends back instead of the messages.

    ``texts``: the rows kept; ``spans``: each kept row's message-text character ranges; ``as_text``: kept
    rows (indices into ``texts``) whose message text holds special-token strings to encode as text."""

    texts: list[str]
    spans: list[tuple[tuple[int, int], ...]]
    as_text: list[int]
    keep: np.ndarray
    dropped: list[tuple[int, str, str]] = field(default_factory=list)
    special_rows: int = 0
    special_example: str | None = None
    # per kept row: None (not checked), or ``(start, end, message index, role)`` of each text to check
    roles: list[tuple[tuple[int, int, int, str], ...] | None] = field(default_factory=list)
    plans: list | None = None  # per kept row: its chat.weights.RowPlan (None: defaults); None when not weighing
    exact_plans: Any = None  # the exact ones among them, flat (engine.weights.ExactPlans)
    exact: list[int] = field(default_factory=list)  # which kept rows those are, ascending


def encode_rendered(
    ct: Any,
    texts: Sequence[str],
    conversations: Sequence[Sequence[Any]],
    *,
    special_tokens_in_content: str = "text",
    max_length: int | None = None,
    row_numbers: Sequence[int] | None = None,
    positions: "bool | re.Pattern" = True,
    check: Sequence[bool] | None = None,
    weigh: Any = None,
    trained_from: Sequence[int | None] | None = None,
) -> EncodedRows:
    """Locate, check and tokenise rendered rows; ``row_numbers`` name the rows in messages (default: 0, 1, ...).

    ``positions``: which rows need ``in_content`` (and so offsets): True (all), False (none:
    ``in_content`` is None) or a regular expression that finds, in message text, the words of a
    marker it could match (``text_can_match``); the other rows' tokens are never inside a match.
    """
    located = locate_rendered(ct, texts, conversations, special_tokens_in_content=special_tokens_in_content,
                              row_numbers=row_numbers, check=check, weigh=weigh, trained_from=trained_from)
    return encode_located(ct, located, max_length=max_length, positions=positions)


def locate_rendered(
    ct: Any,
    texts: Sequence[str],
    conversations: Sequence[Sequence[Any]],
    *,
    special_tokens_in_content: str = "text",
    row_numbers: Sequence[int] | None = None,
    check: Sequence[bool] | None = None,
    weigh: Any = None,
    trained_from: Sequence[int | None] | None = None,
) -> LocatedRows:
    """Steps 1 and 2: where each row's message text lies, rows dropped, the special-token policy applied.

    ``check``: a bool per row, the rows whose message text is kept by role for the invariant (step 5).
    ``weigh``: the job's ``MaskOptions``, to read each row's weights (``chat.weights.plan_row``); None: no weights.
    ``trained_from``: per row, the message index before which assistant turns weigh 0 (None: none; ``plan_row``)."""
    check_policy(special_tokens_in_content)
    tokens = ct.content_tokens
    n = len(texts)
    names = list(range(n)) if row_numbers is None else list(row_numbers)
    keep = np.ones(n, dtype=bool)
    dropped: list[tuple[int, str, str]] = []
    spans: list[tuple[tuple[int, int], ...]] = []
    as_text: list[int] = []  # kept rows (local index among kept) to encode on the text path
    roles: list[tuple[tuple[int, int, int, str], ...] | None] = []
    plans: list | None = [] if weigh is not None else None
    exact_plans = ExactPlans() if weigh is not None else None
    exact: list[int] = []
    reader = WeightReader.of(weigh) if weigh is not None else None
    special_rows, special_example = 0, None
    with paused_collection():  # per-row Python over every message: see gc_pause
        for r, (text, messages) in enumerate(zip(texts, conversations)):
            try:
                located = locate_messages(text, messages, system_optional=tokens.drops_system)
            except ValueError as exc:  # a tool call's arguments: JSON text nested too deep (json_text)
                keep[r] = False
                dropped.append((names[r], INVALID, f"a tool call's arguments: {exc}"))
                continue
            if located.missing is not None:
                index, role, what = located.missing
                keep[r] = False
                dropped.append((names[r], CONTENT_DROPPED,
                                f"message {index} ({role}): its {what} is not in the rendered row (the chat template "
                                f"dropped or rewrote it{stray_think(messages[index], what)})"))
                continue
            hit = _first_special(tokens, text, located)
            if hit is not None:
                index, role, token = _owner(messages, located, text, hit)
                where = f"row {names[r]}, message {index} ({role}) holds the special-token string {token!r}"
                if special_tokens_in_content == "error":
                    raise ValueError(
                        f"{where}; pass special_tokens_in_content='text' to encode it as ordinary text (the default), "
                        "'keep' to keep it a control token, or 'drop' to drop such rows"
                    )
                special_rows += 1
                special_example = special_example or where
                if special_tokens_in_content == "drop":
                    keep[r] = False
                    dropped.append((names[r], SPECIAL_TOKENS, f"message {index} ({role}) holds {token!r}"))
                    continue
                if special_tokens_in_content == "text":
                    as_text.append(len(spans))
            spans.append(located.spans)
            roles.append(_role_spans(messages, located, _textless_turns(ct, text, messages, located))
                         if check is not None and check[r] else None)
            if plans is not None:
                plan = plan_row(text, messages, located, reader, names[r],
                                trained_from[r] if trained_from is not None else None)
                if plan is not None and plan.exact:
                    exact_plans.add(plan)
                    exact.append(len(plans))
                plans.append(plan)
    return LocatedRows([t for t, k in zip(texts, keep) if k], spans, as_text, keep, dropped, special_rows,
                       special_example, roles, plans, exact_plans, exact)


def _role_spans(messages, located, textless=()) -> tuple[tuple[int, int, int, str], ...]:
    """The located text to check, by message: every piece of a non-assistant message, the required pieces of an
    assistant's, and the whole turn of a non-assistant message with no text (``textless``)."""
    out = list(textless)
    for start, end, index, required in located.pieces:
        message = messages[index]
        role = str(message.get("role")) if isinstance(message, dict) else "?"
        if role != "assistant" or required:
            out.append((start, end, index, role))
    return tuple(sorted(out))


def _textless_turns(ct: Any, text: str, messages: Sequence[Any], located: Any) -> list[tuple[int, int, int, str]]:
    """``(start, end, index, role)`` of the turn of each user, system or tool message that has no text to find (an
    empty message kept under ``empty_messages="keep"``): its characters are where the rendering of the chat up to it
    and the rendering through it part from ``text``. Its structure tokens never train (Phi-3 writes ``<|user|><|end|>``
    after the ``<|assistant|>`` it writes for the message before). Found only for such messages (two renders each);
    a message whose renders fail is left out."""
    found = {index for _, _, index, _ in located.pieces}
    out = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if index in found or role in (None, "assistant") or message_pieces(message):
            continue
        try:
            before = ct.render(list(messages[:index])) if index else ""
            through = ct.render(list(messages[:index + 1]))
        except Exception:  # noqa: BLE001 - a template that refuses a partial chat: nothing more can be said
            continue
        start, end = len(os.path.commonprefix([before, text])), len(os.path.commonprefix([through, text]))
        if end > start and not any(s < end and start < e for s, e, _, _ in located.pieces):
            out.append((start, end, index, str(role)))
    return out


def encode_located(ct: Any, located: LocatedRows, *, max_length: int | None = None,
                   positions: "bool | re.Pattern" = True) -> EncodedRows:
    """Steps 3 and 4: one batch call into the tokeniser, and ``in_content`` where ``positions`` asks for it."""
    kept_texts, spans, as_text, keep = located.texts, located.spans, located.as_text, located.keep
    dropped, special_rows, special_example = located.dropped, located.special_rows, located.special_example
    checked = [r for r, row_roles in enumerate(located.roles) if row_roles is not None]
    plans, exact_plans, exact = located.plans, located.exact_plans, located.exact
    if positions is True:
        need = list(range(len(kept_texts)))
    elif not positions:
        need = []
    else:  # only rows whose text holds a word of a plain-text marker
        need = [r for r, row_spans in enumerate(spans)
                if any(positions.search(kept_texts[r], s, e) for s, e in row_spans)]
    if len(need) == len(kept_texts):
        ids, offsets = ct.encode_texts_with_offsets(kept_texts)
        _as_text(ct, kept_texts, ids, offsets, spans, as_text)
        if max_length is not None:
            ids = [row[:max_length] for row in ids]
            offsets = [row[:max_length] for row in offsets]
        in_content = content_mask(ids, offsets, [len(t) for t in kept_texts], spans)
        lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
        roles = _role_tokens(lengths, {r: (ids[r], offsets[r]) for r in checked}, kept_texts, located.roles)
        weights = planned_weights(plans, exact, [offsets[r] for r in exact], exact_plans)
        return EncodedRows(_large_list(ids), in_content, keep, dropped, special_rows, special_example, roles, weights)
    # the batch call without offsets; the rows that need them are encoded again, in one more call
    flat = ct.encode_flat(kept_texts)
    batch = flat.to_arrow(max_length=max_length)
    in_content = None
    if not need and not as_text and not checked and not exact:
        return EncodedRows(batch, in_content, keep, dropped, special_rows, special_example,
                           weights=planned_weights(plans, exact, [], exact_plans))
    # The weighed rows' spans, read off their ids' bytes where those are the text's (``token_text``): no second call.
    by_bytes = sorted(set(exact) - set(need) - set(as_text) - set(checked))
    some, token_spans, ok = None, None, np.zeros(0, dtype=bool)
    if 2 * len(by_bytes) >= len(kept_texts):  # most rows: read them all rather than gather some
        wanted = np.zeros(len(kept_texts), dtype=bool)
        wanted[by_bytes] = True
        some, by_bytes = flat, list(range(len(kept_texts)))
        token_spans, ok = ct.spans_of(kept_texts, some)
        ok &= wanted
    elif by_bytes:
        some = flat.take(by_bytes)
        token_spans, ok = ct.spans_of([kept_texts[r] for r in by_bytes], some)
    read = np.zeros(len(kept_texts), dtype=bool)
    read[by_bytes] = ok
    asked = np.zeros(len(kept_texts), dtype=bool)
    for rows in (need, as_text, checked, exact):
        asked[rows] = True
    again = np.flatnonzero(asked & ~read).tolist()
    if not again:
        return EncodedRows(batch, in_content, keep, dropped, special_rows, special_example,
                           weights=_planned(plans, exact, by_bytes, some, token_spans, ok, {}, max_length,
                                            exact_plans))
    rows = np.split(batch.values.to_numpy(), batch.offsets.to_numpy()[1:-1]) if kept_texts else []
    sub_ids, sub_offsets = ct.encode_texts_with_offsets([kept_texts[r] for r in again])
    local = {r: k for k, r in enumerate(again)}
    _as_text(ct, [kept_texts[r] for r in again], sub_ids, sub_offsets, [spans[r] for r in again],
             [local[r] for r in as_text])
    for k, r in enumerate(again):
        rows[r] = sub_ids[k][:max_length]
        sub_offsets[k] = sub_offsets[k][:max_length]
    if need:
        lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        mask = content_mask([sub_ids[local[r]][:max_length] for r in need], [sub_offsets[local[r]] for r in need],
                            [len(kept_texts[r]) for r in need], [spans[r] for r in need])
        in_content = np.zeros(int(lengths.sum()), dtype=bool)
        position = np.concatenate([np.arange(starts[r], starts[r] + lengths[r]) for r in need])
        in_content[position] = mask
    lengths = np.fromiter((len(row) for row in rows), dtype=np.int64, count=len(rows))
    roles = _role_tokens(lengths, {r: (rows[r], sub_offsets[local[r]]) for r in checked}, kept_texts, located.roles)
    weights = _planned(plans, exact, by_bytes, some, token_spans, ok,
                       {r: sub_offsets[local[r]] for r in exact if not read[r]}, max_length, exact_plans)
    return EncodedRows(_large_list(rows), in_content, keep, dropped, special_rows, special_example, roles, weights)


def _planned(plans: list | None, exact: list[int], by_bytes: list[int], flat: Any, spans: np.ndarray | None,
             placed: np.ndarray, others: dict, max_length: int | None, exact_plans: Any = None) -> PlannedWeights | None:
    """``planned_weights`` where most exact rows' spans were read off their bytes (``ChatTokenizer.spans_of``: ``flat``
    holds the ids of the ``by_bytes`` rows, ``placed`` says which of them it placed, each token already starting where
    the one before it ends) and the rest (``others``: row -> its ``(n, 2)`` offsets) come from ``tokenizers``. Where
    every exact row was read off the bytes (nearly always), their spans are gathered in one go, with no loop over
    rows."""
    if plans is None:
        return None
    if not by_bytes or (max_length is not None and int(np.diff(flat.offsets).max()) > max_length):
        read = {}
        for k, r in enumerate(by_bytes):
            if placed[k]:
                read[r] = spans[flat.offsets[k]:flat.offsets[k + 1]][:max_length]
        return planned_weights(plans, exact, [read[r] if r in read else others[r] for r in exact], exact_plans)
    rows = np.asarray(exact, dtype=np.int64)
    if not others:
        k = np.searchsorted(np.asarray(by_bytes, dtype=np.int64), rows)  # each exact row among those read
        starts, ends = spans[:, 0], spans[:, 1]
        if k.shape[0] != len(by_bytes):  # some rows read are not exact: their tokens are left out
            offsets = np.asarray(flat.offsets, dtype=np.int64)
            lengths = offsets[k + 1] - offsets[k]
            at = np.repeat(offsets[k] - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
            starts, ends = starts[at], ends[at]
        return PlannedWeights(plans, rows, np.ascontiguousarray(starts, dtype=np.int32),
                              np.ascontiguousarray(ends, dtype=np.int32), exact_plans)
    position = {r: k for k, r in enumerate(by_bytes)}
    pieces, run = [], None  # run: (first, last + 1) of consecutive rows read off the bytes
    for r in exact:
        k = position.get(r, -1)
        if k >= 0 and placed[k]:
            if run is not None and run[1] != k:  # rows between that are not weighed end the run
                pieces.append(spans[flat.offsets[run[0]]:flat.offsets[run[1]]])
                run = None
            run = (run[0], k + 1) if run is not None else (k, k + 1)
            continue
        if run is not None:
            pieces.append(spans[flat.offsets[run[0]]:flat.offsets[run[1]]])
            run = None
        off = np.asarray(others[r], dtype=np.int64).reshape(-1, 2)
        previous = np.concatenate([[0], off[:-1, 1]])
        pieces.append(np.stack([np.minimum(off[:, 0], previous), off[:, 1]], axis=1).astype(np.int32))
    if run is not None:
        pieces.append(spans[flat.offsets[run[0]]:flat.offsets[run[1]]])
    # starts and ends each contiguous (int32: a row's characters fit), as the weights' kernel takes them
    starts = np.concatenate([p[:, 0] for p in pieces]) if len(pieces) > 1 else np.ascontiguousarray(pieces[0][:, 0])
    ends = np.concatenate([p[:, 1] for p in pieces]) if len(pieces) > 1 else np.ascontiguousarray(pieces[0][:, 1])
    return PlannedWeights(plans, rows, starts.astype(np.int32, copy=False), ends.astype(np.int32, copy=False),
                          exact_plans)


def planned_weights(plans: list | None, exact: list[int], offsets: list[np.ndarray],
                    exact_plans: Any = None) -> PlannedWeights | None:
    """The plans, with the character span of each token of the exact rows (placed as ``span_index`` places them:
    from the end of the previous token, since byte-level offsets may leave a merged leading space out)."""
    if plans is None:
        return None
    if not exact:
        return PlannedWeights(plans, np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int32), exact_plans)
    starts, ends = [], []
    for off in offsets:
        off = np.asarray(off, dtype=np.int64).reshape(-1, 2)
        end = off[:, 1]
        previous = np.concatenate([[0], end[:-1]])
        starts.append(np.minimum(off[:, 0], previous))
        ends.append(end)
    return PlannedWeights(plans, np.asarray(exact, dtype=np.int64), np.concatenate(starts).astype(np.int32),
                          np.concatenate(ends).astype(np.int32), exact_plans)


def _role_tokens(lengths: np.ndarray, encoded: dict, texts: Sequence[str], roles: Sequence[Any]) -> RoleTokens | None:
    """Step 5: ``RoleTokens`` for the rows in ``encoded`` (row -> its ids and offsets), or None when there are none."""
    if not encoded:
        return None
    total = int(lengths.sum())
    role = np.zeros(total, dtype=np.int16)
    message = np.full(total, -1, dtype=np.int32)
    starts = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:]) if len(lengths) > 1 else None
    names: list[str] = []
    order = sorted(encoded)
    row_spans = [[(s, e) for s, e, _, _ in roles[r]] for r in order]
    inside = span_index([encoded[r][0] for r in order], [encoded[r][1] for r in order],
                        [len(texts[r]) for r in order], row_spans)
    at = 0
    for r in order:
        n = int(lengths[r])
        which = inside[at:at + n]
        at += n
        hit = which >= 0
        if not hit.any():
            continue
        codes = []
        for _, _, index, name in roles[r]:
            if name not in names:
                names.append(name)
            codes.append((names.index(name) + 1, index))
        table = np.asarray(codes, dtype=np.int64).reshape(-1, 2)
        position = starts[r] + np.flatnonzero(hit)
        role[position] = table[which[hit], 0]
        message[position] = table[which[hit], 1]
    return RoleTokens(role, message, tuple(names))


def _as_text(ct, texts, ids, offsets, spans, rows) -> None:
    """Encode ``rows`` (indices into the lists) again with message text's special-token strings as text."""
    if not rows:
        return
    encoder = ct.text_encoder
    for r in rows:
        ids[r], offsets[r] = encoder.encode(texts[r], ids[r], offsets[r], spans[r])


def text_can_match(ct: Any, markers: Any, special_tokens_in_content: str) -> bool | re.Pattern:
    """Can message text make a marker match, so that labelling must know where it lies?

    Markers hold template tokens only (a header ends where training starts; stop tokens follow the
    text). With special-token strings encoded as text, message text cannot produce a structural
    token, so a pattern holding one cannot match there; only patterns made of other tokens
    (plain-text markers such as ``[/INST]`` on Llama-2 or ``### Response:``) can, and only in a row
    whose text holds the pattern's words. Returns False (no row), True (every row) or a regular
    expression of those words (the rows whose message text it finds).
    """
    if markers is None or not hasattr(markers, "response"):  # no markers, or labels from the rendering (no patterns)
        return False
    if special_tokens_in_content != "text":
        return True
    structural = ct.content_tokens.structural
    plain = [p for patterns in markers.to_dict().values() for p in patterns if not any(int(t) in structural for t in p)]
    if not plain:
        return False
    words = set()
    for pattern in plain:
        pieces = [ct.decode([t]) for t in pattern]
        if any("\ufffd" in piece for piece in pieces):
            return True
        found = [w for piece in pieces for w in re.findall(r"[^\W_]{2,}", piece)]
        if not found:
            return True  # a pattern of punctuation and spaces: every row
        words.update(found)
    return re.compile("|".join(sorted(map(re.escape, words), key=len, reverse=True)))


def _first_special(tokens, text: str, located) -> tuple[int, int, str] | None:
    for start, end in located.spans:
        match = tokens.find(text, start, end)
        if match is not None:
            return match.start(), match.end(), match.group(0)
    return None


def _owner(messages, located, text, hit) -> tuple[int, str, str]:
    """Which message holds the special-token string found at ``hit`` (the first whose text holds it)."""
    start, _, token = hit
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        for key in ("content", "reasoning_content", "reasoning", "thinking"):
            value = message.get(key)
            if isinstance(value, str) and token in value:
                return index, str(message.get("role")), token
        if token in repr(message.get("tool_calls", "")) or token in repr(message.get("content", "")):
            return index, str(message.get("role")), token
    return -1, "?", token


def content_mask(ids: Sequence[np.ndarray], offsets: Sequence[np.ndarray], lengths: Sequence[int],
                 spans: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """A bool per token (rows back to back): does the token lie wholly inside one of its row's ``spans``?

    A token covers the characters from the end of the previous token (byte-level offsets may leave a
    merged leading space out) to its own end; zero-width tokens (a normaliser's prefix) are never inside.
    """
    return span_index(ids, offsets, lengths, spans) >= 0


def span_index(ids: Sequence[np.ndarray], offsets: Sequence[np.ndarray], lengths: Sequence[int],
               spans: Sequence[Sequence[tuple[int, int]]]) -> np.ndarray:
    """Per token (rows back to back), the index within its row's ``spans`` (sorted by start) of the span it lies
    wholly inside, or -1; a token is placed as in ``content_mask``."""
    counts = np.fromiter((len(r) for r in ids), dtype=np.int64, count=len(ids))
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    off = np.concatenate([np.asarray(o, dtype=np.int64).reshape(-1, 2) for o in offsets])
    base = np.zeros(len(ids), dtype=np.int64)
    np.cumsum(np.asarray(lengths[:-1], dtype=np.int64), out=base[1:]) if len(ids) > 1 else None
    row_of = np.repeat(np.arange(len(ids)), counts)
    first = np.zeros(total, dtype=bool)
    starts_at = np.cumsum(counts) - counts
    first[starts_at[counts > 0]] = True
    prev_end = np.empty(total, dtype=np.int64)
    prev_end[0] = 0
    prev_end[1:] = off[:-1, 1]
    prev_end[first] = 0
    start = np.minimum(off[:, 0], np.maximum(prev_end, 0)) + base[row_of]
    end = off[:, 1] + base[row_of]
    flat = [(s + base[r], e + base[r]) for r, row_spans in enumerate(spans) for s, e in row_spans]
    if not flat:
        return np.full(total, -1, dtype=np.int64)
    span_arr = np.asarray(flat, dtype=np.int64)
    first_span = np.zeros(len(spans), dtype=np.int64)  # each row's first index in span_arr
    np.cumsum([len(row_spans) for row_spans in spans[:-1]], out=first_span[1:]) if len(spans) > 1 else None
    k = np.searchsorted(span_arr[:, 0], start, side="right") - 1
    valid = k >= 0
    kk = np.maximum(k, 0)
    inside = valid & (start >= span_arr[kk, 0]) & (end <= span_arr[kk, 1]) & (off[:, 1] > off[:, 0])
    return np.where(inside, kk - first_span[row_of], -1)


def _large_list(rows: Sequence[np.ndarray]) -> pa.LargeListArray:
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate([np.asarray(r, dtype=np.int32) for r in rows]) if rows else np.zeros(0, np.int32)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32, copy=False)))
