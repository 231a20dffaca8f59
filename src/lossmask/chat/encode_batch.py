"""Token ids for a batch of chat or prompt/completion rows, through ``lossmask.load_tokenizer``'s adapter.

This is the only per-row Python of a masking job, and it is the chat template's: Jinja renders one
conversation at a time. Tokenisation is one batch call into the Rust tokenizer; everything after
works on Arrow buffers.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from ..engine.outcomes import SPECIAL_TOKENS
from .encode_rendered import LocatedRows, encode_located, encode_rendered, locate_rendered, text_can_match
from .quoting import described
from .render import plain_arrow_type
from .shapes import (PLACEHOLDERS, needs_call_ids, normalise_shapes, read_placeholders, read_tools, speaker_role,
                     takes_content_parts)
from .turn_spans import FromRendering


@dataclass(frozen=True)
class EncodedBatch:
    """``input_ids`` (list<int32>) for the rows that rendered; ``valid`` marks them among the batch's rows.

    ``errors``: ``(row in the whole input, message)`` for each rejected row. ``prompt_lengths``: for
    plain-text prompt/completion rows, how many leading tokens of each valid row are prompt.
    ``in_content``: a bool per token of ``input_ids`` (back to back), True inside message text, which
    labelling keeps inert. ``dropped``: ``(row, reason, message)`` for rows rendered but not labelled
    (``content_dropped``, ``special_tokens_in_content``). ``special_rows``: rows whose message text held
    a special-token string, with one example.
    """

    input_ids: pa.Array
    valid: np.ndarray
    errors: list[tuple[int, str]]
    prompt_lengths: np.ndarray | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    in_content: np.ndarray | None = None
    dropped: list[tuple[int, str, str]] = field(default_factory=list)
    special_rows: int = 0
    special_example: str | None = None
    shapes: dict[str, int] = field(default_factory=dict)  # rows the shape policy changed, per shape (shapes.py)
    roles: Any = None  # encode_rendered.RoleTokens of the rows whose role invariant is to be checked
    media: Any = None  # rows rendered through a processor: its outputs for their images (chat/media.py)
    media_ids: tuple[int, ...] = ()  # ... and the ids of the media tokens (never trained)
    media_span: Any = None  # ... and a bool per token: inside an image's tokens, first to last (never trained)
    weights: Any = None  # encode_rendered.PlannedWeights: what each row's messages ask to weigh (chat/weights.py)
    texts: list | None = None  # each valid row's rendering, kept when the rows are labelled from it (FromRendering)
    chats: list | None = None  # ... and its (messages, tools) as rendered, when the batch kept them (RenderedBatch)


def chat_tokenizer(tokenizer: Any):
    """The ``ChatTokenizer`` adapter for anything ``lossmask.load_tokenizer`` accepts (built once per job)."""
    from .tokenizer import ChatTokenizer, load_tokenizer

    return tokenizer if isinstance(tokenizer, ChatTokenizer) else load_tokenizer(tokenizer)


@dataclass(frozen=True)
class RenderedBatch:
    """The texts the template wrote for the rows of a batch (``valid`` marks them), before tokenisation.

    ``chats``: the messages of each text (their text is located in it when tokenising: message text is
    data), or ``located`` instead; ``rows``: each text's row in the whole input."""

    texts: list[str]
    chats: list[Any]
    rows: list[int]
    valid: np.ndarray
    errors: list[tuple[int, str]]
    seconds: dict[str, float] = field(default_factory=dict)
    located: LocatedRows | None = None  # message text already located (a worker's batch: no chats to send back)
    dropped: list[tuple[int, str, str]] = field(default_factory=list)  # (row, reason, message): no_exchange
    shapes: dict[str, int] = field(default_factory=dict)  # rows the shape policy changed, per shape
    check: list[bool] | None = None  # per text: check the role invariant on it (shapes.normalise_shapes)
    # per text: the message index before which assistant turns weigh 0 (a conversational prompt's own turns), or None
    trained_from: list[int | None] | None = None
    # with ``located``: each text's chat as rendered (messages, or {messages, tools}), for labels from the rendering
    conversations: list | None = None


def encode_table(tokenizer: Any, table: pa.Table, kind: str, options: Any, *, first_row: int = 0,
                 markers: Any = "unknown") -> EncodedBatch:
    """Render and tokenise the chat (``kind="messages"``) or prompt/completion rows of ``table``.

    ``markers``: what will label the rows; ``in_content`` is only computed where message text could
    match one of them (``encode_rendered.text_can_match``; always when they are not given).
    """
    tok = chat_tokenizer(tokenizer)
    if kind == "prompt_completion" and is_text_pairs(table, options):
        return _encode_text_pairs(tok, table.column(options.prompt_column), table.column(options.completion_column),
                                  options, first_row=first_row)
    # message text located right after rendering, then one call into the tokeniser: as mask_files encodes a batch
    return tokenize_rendered(tok, render_table(tok, table, kind, options, first_row=first_row, locate=True), options,
                             markers=markers)


def is_text_pairs(table: pa.Table, options: Any) -> bool:
    prompts = table.schema.field(options.prompt_column).type
    return pa.types.is_string(prompts) or pa.types.is_large_string(prompts)


def render_table(tokenizer: Any, table: pa.Table, kind: str, options: Any, *, first_row: int = 0,
                 locate: bool = False) -> RenderedBatch:
    """Render the chat (``kind="messages"``) or conversational prompt/completion rows of ``table``; with ``locate``,
    also locate their message text (``encode_rendered.locate_rendered``) and keep that instead of the messages."""
    tok = chat_tokenizer(tokenizer)
    started = time.perf_counter()
    conversations, where, columns, unread = conversations_of(table, kind, options, processor=tok.processor is not None)
    # conversational prompt/completion: each row's completion, to tell its assistant turns from the prompt's own
    completions = messages_from_arrow(table.column(options.completion_column)) if kind == "prompt_completion" else None
    # rows of plain JSON values render through the compiled template directly (render.py)
    plain = all(plain_arrow_type(table.schema.field(name).type) for name in columns)
    tools = json_values(table.column("tools")) if "tools" in table.column_names else None
    errors: list[tuple[int, str]] = [(first_row + r, message) for r, message in unread]
    # the conversation-shape policy (shapes.py), before the template sees a row
    shaped = normalise_shapes(conversations, options, takes_parts=takes_content_parts(tok), call_ids=needs_call_ids(tok))
    # conversational prompt/completion: how many of each row's last assistant turns are its completion's (the rest,
    # the prompt's own, weigh 0), unless the prompt's turns are asked to train too
    turns = completion_turns(completions, options, takes_content_parts(tok)) \
        if completions is not None and not options.train_prompt_turns else None
    errors += [(first_row + r, f"column {where!r}: {message}") for r, message in shaped.invalid]
    dropped = [(first_row + r, reason, message) for r, reason, message in shaped.dropped]
    refused = {r for r, _ in shaped.invalid} | {r for r, _, _ in shaped.dropped} | {r for r, _ in unread}
    chats, rows, check, completion = [], [], [], []
    for r, messages in enumerate(shaped.conversations):
        if r in refused:
            continue
        if not messages:
            errors.append((first_row + r, f"column {where!r} is {'null' if messages is None else 'empty'}"))
            continue
        try:
            row_tools = read_tools(tools[r]) if tools is not None else None
        except ValueError as exc:
            errors.append((first_row + r, f"column 'tools': {exc}"))
            continue
        chats.append(messages if not row_tools else {"messages": messages, "tools": row_tools})
        rows.append(r)
        check.append(shaped.unusual[r])
        completion.append(turns[r] if turns is not None else None)
    convert = time.perf_counter()
    texts, failures = tok.direct_render.render(chats) if plain else render_chats(tok, chats)
    texts = list(texts)
    shortened = keep_last_turns(tok, texts, chats, options.max_length) if options.truncation == "history" else 0
    rendered = time.perf_counter()
    ok = np.array([text is not None for text in texts], dtype=bool)
    rows = np.asarray(rows, dtype=np.int64)
    ok_rows = rows[ok] if rows.size else rows
    valid = np.zeros(table.num_rows, dtype=bool)
    valid[ok_rows] = True
    errors += [(first_row + int(rows[local]), message) for local, message in failures]
    errors.sort()
    texts = [text for text in texts if text is not None]
    conversations = [chat for chat, good in zip(chats, ok) if good]
    chats = [_messages_of(chat) for chat in conversations]
    check = [c for c, good in zip(check, ok) if good]
    trained_from = [first_trained(chat, n) for chat, n in zip(chats, (n for n, good in zip(completion, ok) if good))] \
        if turns is not None else None
    if trained_from is not None and all(k is None for k in trained_from):
        trained_from = None
    row_numbers = (first_row + ok_rows).tolist()
    seconds = {"read_messages": convert - started, "render": rendered - convert}
    shapes = {shape: n for shape, n in shaped.shapes.items() if n}
    if shortened:
        shapes[EARLIEST_TURNS_DROPPED] = shortened
    if not locate:
        return RenderedBatch(texts, chats, row_numbers, valid, errors, seconds=seconds, dropped=dropped, shapes=shapes,
                             check=check, trained_from=trained_from)
    located = locate_rendered(tok, texts, chats, special_tokens_in_content=options.special_tokens_in_content,
                              row_numbers=row_numbers, check=check, weigh=options, trained_from=trained_from)
    seconds["locate"] = time.perf_counter() - rendered
    return RenderedBatch(texts, [], row_numbers, valid, errors, seconds=seconds, located=located, dropped=dropped,
                         shapes=shapes, conversations=conversations)


def completion_turns(completions: list, options: Any, takes_parts: bool) -> list[int]:
    """How many assistant messages each conversational completion holds once the shape policy has read it (behind a
    user message, as it stands in its row). A completion is its row's tail, so these are the row's last ones."""
    opener = {"role": "user", "content": "?"}
    shaped = normalise_shapes([None if c is None else [opener, *c] for c in completions], options,
                              takes_parts=takes_parts)
    return [0 if messages is None else sum(1 for m in messages[1:] if isinstance(m, dict) and m.get("role") == "assistant")
            for messages in shaped.conversations]


def first_trained(messages: Any, completion: int) -> int | None:
    """The index of the first of a row's last ``completion`` assistant messages (the completion's), before which the
    prompt's assistant turns weigh 0; None when the prompt holds none (nothing to leave out)."""
    if not isinstance(messages, list):
        return None
    assistants = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if len(assistants) <= completion:
        return None
    return assistants[-completion] if completion else len(messages)


EARLIEST_TURNS_DROPPED = "earliest_turns_dropped"  # truncation="history": rows that lost their first exchanges


def keep_last_turns(tok: Any, texts: list[str | None], chats: list, max_length: int | None) -> int:
    """``truncation="history"``: each rendered chat longer than ``max_length`` tokens loses its earliest exchanges
    (a user message and what follows it up to the next one; messages before the first user message, a system
    prompt, stay), whole, until it fits or one exchange is left; ``texts`` and ``chats`` are changed in place.
    Returns how many rows lost some. One more batch call into the tokeniser counts the rows' tokens; only the
    rows over the limit are rendered again."""
    from .tokenizer import ChatTemplateError

    rows = [i for i, text in enumerate(texts) if text is not None]
    if not max_length or not rows:
        return 0
    offsets = np.asarray(tok.encode_flat([texts[i] for i in rows]).offsets, dtype=np.int64)
    over = [i for i, n in zip(rows, np.diff(offsets).tolist()) if n > max_length]
    shortened = 0
    for i in over:
        messages, tools = (chats[i]["messages"], chats[i].get("tools")) if isinstance(chats[i], dict) else (chats[i], None)
        users = [j for j, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
        head = messages[:users[0]] if users else []
        for cut in users[1:]:
            kept = head + messages[cut:]
            try:
                text = tok.render(kept, tools=tools)
            except ChatTemplateError:  # a shorter chat the template refuses: keep what rendered
                break
            texts[i] = text
            chats[i] = kept if tools is None else {**chats[i], "messages": kept}
            if cut == users[1]:
                shortened += 1
            if int(np.diff(np.asarray(tok.encode_flat([text]).offsets))[0]) <= max_length:
                break
    return shortened


def tokenize_rendered(tokenizer: Any, rendered: RenderedBatch, options: Any, *, markers: Any = "unknown") -> EncodedBatch:
    """Token ids of a rendered batch (one batch call into the tokeniser), as ``list<int32>``, with message text
    kept as data (``encode_rendered``): rows whose message the template dropped are taken out here."""
    started = time.perf_counter()
    tok = chat_tokenizer(tokenizer)
    positions = markers == "unknown" or text_can_match(tok, markers, options.special_tokens_in_content)
    if rendered.located is not None:
        encoded = encode_located(tok, rendered.located, max_length=options.max_length, positions=positions)
    else:
        encoded = encode_rendered(
            tok, rendered.texts, rendered.chats,
            special_tokens_in_content=options.special_tokens_in_content, max_length=options.max_length,
            row_numbers=rendered.rows, positions=positions, check=rendered.check, weigh=options,
            trained_from=rendered.trained_from,
        )
    valid = rendered.valid
    if not encoded.keep.all():
        valid = valid.copy()
        valid[np.flatnonzero(valid)[~encoded.keep]] = False
    texts = chats = None
    if isinstance(markers, FromRendering):  # the rows are labelled from their rendering: keep it, not to render again
        texts = rendered.located.texts if rendered.located is not None else \
            [text for text, kept in zip(rendered.texts, encoded.keep) if kept]
        if rendered.conversations is not None:  # ... and their messages, not to read them from the table again
            chats = [(chat["messages"], chat["tools"]) if isinstance(chat, dict) else (chat, None)
                     for chat, kept in zip(rendered.conversations, encoded.keep) if kept]
    seconds = {**rendered.seconds, "tokenize_text": time.perf_counter() - started}
    return EncodedBatch(
        _as_list32(encoded.input_ids), valid, rendered.errors, seconds=seconds,
        in_content=encoded.in_content, dropped=sorted(rendered.dropped + encoded.dropped),
        special_rows=encoded.special_rows, special_example=encoded.special_example,
        shapes=rendered.shapes, roles=encoded.roles, weights=encoded.weights, texts=texts, chats=chats,
    )


def _messages_of(chat: Any) -> Any:
    return chat["messages"] if isinstance(chat, dict) else chat


def render_chats(tok, chats: list) -> tuple[list[str | None], list[tuple[int, str]]]:
    """Render many chats with the template: one ``apply_chat_template`` call for the rows without tools.

    One call for the batch spares the per-call set-up of rendering row by row (~1.3x on the render
    step); the output is the same function applied to each chat. When the batch call raises, the rows
    are rendered one by one so that only the rows the template rejects are lost, each with its message.
    Returns the text per chat (None where rejected) and ``(index, message)`` per rejected chat.
    """
    from .render import bounded_rendering, text_parts
    from .tokenizer import ChatTemplateError

    texts: list[str | None] = [None] * len(chats)
    errors: list[tuple[int, str]] = []
    plain = [i for i, chat in enumerate(chats) if not isinstance(chat, dict)]
    if plain:
        try:
            with bounded_rendering():
                batch = tok.tokenizer.apply_chat_template(
                    [text_parts(chats[i]) if tok.renders_parts_only else chats[i] for i in plain],
                    chat_template=tok.template_for(), tokenize=False,
                    add_generation_prompt=False, **tok.template_kwargs,
                )
        except Exception:  # some row is rejected or over a render bound: find which, row by row (bounded) below
            batch = None
        if isinstance(batch, list) and len(batch) == len(plain) and all(isinstance(t, str) for t in batch):
            for i, text in zip(plain, batch):
                texts[i] = text
    for i, chat in enumerate(chats):
        if texts[i] is not None:
            continue
        messages, tools = (chat["messages"], chat.get("tools")) if isinstance(chat, dict) else (chat, None)
        try:
            texts[i] = tok.render(messages, tools=tools)
        except ChatTemplateError as exc:
            errors.append((i, str(exc)))
    return texts, errors


def _encode_text_pairs(tok, prompts, completions, options, *, first_row: int) -> EncodedBatch:
    """Plain-text prompt/completion, as TRL and the tokenizer's own ``__call__`` tokenise it: what the tokenizer's
    post-processor puts before a text (its BOS; ``ChatTokenizer.text_affixes``), unless the prompt's ids already
    begin with it, then the prompt ids, the completion ids, the EOS unless the completion ends with it, and what the
    post-processor puts after a text, unless the row already ends with it. Nothing is ever doubled."""
    p_text, c_text = prompts.to_pylist(), completions.to_pylist()
    valid = np.array([p is not None and c is not None for p, c in zip(p_text, c_text)], dtype=bool)
    errors = [
        (first_row + r, f"column {options.prompt_column if p_text[r] is None else options.completion_column!r} is null")
        for r in np.flatnonzero(~valid)
    ]
    dropped, special_rows, special_example, as_text = _special_text_pairs(tok, p_text, c_text, valid, options, first_row)
    for row, _, _ in dropped:
        valid[row - first_row] = False
    keep = np.flatnonzero(valid)
    p_ids = _encode_plain(tok, [p_text[r] for r in keep], as_text[keep])
    c_ids = _encode_plain(tok, [c_text[r] for r in keep], as_text[keep])
    before, after = tok.text_affixes
    p_offsets, c_offsets = p_ids.offsets.to_numpy(), c_ids.offsets.to_numpy()
    p_vals, c_vals = p_ids.values.to_numpy(), c_ids.values.to_numpy()
    add_before = ~_ends_with(p_vals, p_offsets, before, at_start=True)
    eos = tok.eos_token_id
    needs_eos = ~_ends_with(c_vals, c_offsets, (eos,)) if eos is not None else np.zeros(len(keep), dtype=bool)
    # the row's last ids so far are the EOS where one is appended, else the completion's own
    tail = (after == (eos,)) & needs_eos if after else np.zeros(len(keep), dtype=bool)
    add_after = ~_ends_with(c_vals, c_offsets, after) & ~tail
    offsets, values = _join_rows([
        _repeated(before, add_before), (np.diff(p_offsets), p_vals), (np.diff(c_offsets), c_vals),
        _repeated((eos,) if eos is not None else (), needs_eos), _repeated(after, add_after),
    ])
    arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))
    prompt_lengths = np.diff(p_offsets).astype(np.int64) + add_before * len(before)
    if options.max_length is not None:
        arr = _truncate(arr, options.max_length)
    return EncodedBatch(_as_list32(arr), valid, errors, prompt_lengths=prompt_lengths, dropped=dropped,
                        special_rows=special_rows, special_example=special_example)


def _ends_with(values: np.ndarray, offsets: np.ndarray, ids: tuple[int, ...], *, at_start: bool = False) -> np.ndarray:
    """Per row of ``(offsets, values)``: do its ids end with ``ids`` (begin with them, ``at_start``)? False for
    every row when ``ids`` is empty."""
    lengths = np.diff(offsets)
    found = (lengths >= len(ids)) & bool(ids)
    for k, token in enumerate(ids):
        where = offsets[:-1] + k if at_start else offsets[1:] - len(ids) + k
        found &= values[np.clip(where, 0, max(values.size - 1, 0))] == token if values.size else False
    return found


def _repeated(ids: tuple[int, ...], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` in each row where ``rows`` is True, nothing in the others: a ragged part for ``_join_rows``."""
    lengths = rows.astype(np.int64) * len(ids)
    return lengths, np.tile(np.asarray(ids, dtype=np.int64), int(rows.sum()))


def _join_rows(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged parts ``(lengths, values)`` of the same rows, joined row by row in order: ``(offsets, values)`` of
    int32 ids, placed by position with no loop over rows."""
    lengths = np.stack([np.asarray(n, dtype=np.int64) for n, _ in parts])
    offsets = np.zeros(lengths.shape[1] + 1, dtype=np.int64)
    np.cumsum(lengths.sum(axis=0), out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.int32)
    start = offsets[:-1].copy()
    for n, (_, values) in zip(lengths, parts):
        if values.size:
            within = np.arange(values.size, dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)
            out[np.repeat(start, n) + within] = values
        start += n
    return offsets, out


def _special_text_pairs(tok, p_text, c_text, valid, options, first_row):
    """Plain-text prompt/completion rows are all message text: apply ``special_tokens_in_content`` to them."""
    as_text = np.zeros(len(p_text), dtype=bool)
    dropped: list[tuple[int, str, str]] = []
    special_rows, example = 0, None
    tokens = tok.content_tokens
    if tokens.pattern is None:
        return dropped, special_rows, example, as_text
    for r in np.flatnonzero(valid):
        for column, text in ((options.prompt_column, p_text[r]), (options.completion_column, c_text[r])):
            match = tokens.find(text)
            if match is None:
                continue
            where = f"row {first_row + r}, column {column!r} holds the special-token string {match.group(0)!r}"
            if options.special_tokens_in_content == "error":
                raise ValueError(
                    f"{where}; pass special_tokens_in_content='text' to encode it as ordinary text (the default), "
                    "'keep' to keep it a control token, or 'drop' to drop such rows"
                )
            special_rows += 1
            example = example or where
            if options.special_tokens_in_content == "drop":
                dropped.append((first_row + int(r), SPECIAL_TOKENS, f"column {column!r} holds {match.group(0)!r}"))
            as_text[r] = options.special_tokens_in_content == "text"
            break
    return dropped, special_rows, example, as_text


def _encode_plain(tok, texts: list[str], as_text: np.ndarray) -> pa.Array:
    """``encode_texts``, with the rows marked ``as_text`` encoded with special-token strings as text."""
    ids = tok.encode_texts(texts)
    if not as_text.any():
        return ids
    rows = ids.to_pylist()
    encoder = tok.text_encoder.first
    for r in np.flatnonzero(as_text):
        rows[r] = encoder.encode(texts[r], add_special_tokens=False).ids
    return pa.array(rows, type=pa.large_list(pa.int32()))


def _truncate(arr: pa.Array, max_length: int) -> pa.Array:
    import pyarrow.compute as pc

    return pc.list_slice(arr, 0, max_length)


def _as_list32(arr: pa.Array) -> pa.Array:
    """list<int32> (the Hugging Face ``Sequence(int32)`` layout); only the offsets are rewritten."""
    target = pa.list_(pa.int32())
    return arr if arr.type == target else arr.cast(target)


def conversations_of(table: pa.Table, kind: str, options: Any, *,
                     processor: bool = False) -> tuple[list, str, list[str], list[tuple[int, str]]]:
    """The chats of a batch's rows (``kind``: messages, conversational prompt/completion, or Alpaca), before the shape
    policy: ``(conversations, what names their column in messages, the columns read, [(row, message)] unreadable)``.
    Chats beside media columns have their placeholders read (``shapes.read_placeholders``; ``processor``: rendered
    through one)."""
    if kind == "messages":
        column = options.chat_column(table.column_names)
        conversations = messages_from_arrow(table.column(column))
        if options.system_column is not None:
            system_first(conversations, table, options)
        media = {name: _item_counts(table.column(name)) for name in PLACEHOLDERS if name in table.column_names}
        unread = read_placeholders(conversations, media, processor=processor) if media else []
        return conversations, column, [column], [(r, f"column {column!r}: {message}") for r, message in unread]
    if kind == "alpaca":
        return alpaca_conversations(table, options)
    prompts = messages_from_arrow(table.column(options.prompt_column))
    completions = messages_from_arrow(table.column(options.completion_column))
    conversations = [None if p is None or c is None else p + c for p, c in zip(prompts, completions)]
    return (conversations, f"{options.prompt_column}+{options.completion_column}",
            [options.prompt_column, options.completion_column], [])


def system_first(conversations: list, table: pa.Table, options: Any) -> None:
    """Each row's system prompt from ``options.system_column`` put first, as LLaMA-Factory reads ``columns.system``:
    a chat that opens with a system message keeps its own; an empty or null value adds nothing. In place."""
    name = options.system_column
    if name not in table.column_names:
        raise ValueError(f"system_column={name!r} is not a column of the rows (they have {table.column_names}); name "
                         "the column that holds the system prompt")
    roles = options.roles()
    for r, (messages, system) in enumerate(zip(conversations, json_values(table.column(name)))):
        if system is None or (isinstance(system, str) and not system.strip()) or not isinstance(messages, list):
            continue
        if not isinstance(system, str):
            raise ValueError(f"column {name!r} (the system prompt) holds a {type(system).__name__} in row {r}; "
                             "it must hold text")
        first = messages[0] if messages else None
        if isinstance(first, dict) and ("system" == first.get("role") or
                                        ("role" not in first and speaker_role(first.get("from"), roles) == "system")):
            continue
        conversations[r] = [{"role": "system", "content": system}, *messages]


def _item_counts(column: pa.ChunkedArray) -> list[int]:
    """Per row, how many items a media column holds (0 for null), read from the list offsets where it is a list (its
    images' bytes are never copied out); a lone value counts 1."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        import pyarrow.compute as pc

        return pc.fill_null(pc.list_value_length(column), 0).to_pylist()
    return [0 if value is None else len(value) if isinstance(value, list) else 1 for value in json_values(column)]


def alpaca_conversations(table: pa.Table, options: Any) -> tuple[list, str, list[str], list[tuple[int, str]]]:
    """Alpaca rows as chats, as LLaMA-Factory reads them: ``system`` (when not empty) the system message, each
    ``[instruction, output]`` pair of ``history`` an earlier user and assistant message, the non-empty ones of
    ``instruction`` and ``input`` joined with ``"\n"`` the user message, ``output`` the assistant message.

    A row whose output is not a string, whose instruction, input or system is neither a string nor null (LLaMA-Factory's
    converter fails on a number there), or whose history is not a list of pairs of strings, is unreadable (named)."""
    names = options.alpaca()
    present = [part for part in ("instruction", "input", "output", "system", "history") if names[part] in table.column_names]
    values = {part: json_values(table.column(names[part])) for part in present}
    empty = [None] * table.num_rows
    conversations: list = []
    unread: list[tuple[int, str]] = []
    rows = zip(*(values.get(part, empty) for part in ("instruction", "input", "output", "system", "history")))
    for r, (instruction, given, output, system, history) in enumerate(rows):
        parts = {"output": output, "instruction": instruction, "input": given, "system": system}
        wrong = next((part for part, value in parts.items()
                      if not isinstance(value, str) and (value is not None or part == "output")), None)
        if wrong is not None:  # a null output trains nothing; null or absent other parts are left out, as empty
            unread.append((r, f"column {names[wrong]!r} (the Alpaca {wrong}) is {described(parts[wrong])}, not a "
                              "string"))
            conversations.append(None)
            continue
        messages = [{"role": "system", "content": system}] if isinstance(system, str) and system else []
        if history is not None:
            if not isinstance(history, list) or not all(
                    isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) for t in pair) for pair in history):
                unread.append((r, f"column {names['history']!r} (the Alpaca history) is not a list of [instruction, "
                                  "output] pairs of strings"))
                conversations.append(None)
                continue
            for earlier, answer in history:
                messages += [{"role": "user", "content": earlier}, {"role": "assistant", "content": answer}]
        query = "\n".join(text for text in (instruction, given) if isinstance(text, str) and text)
        messages += [{"role": "user", "content": query}, {"role": "assistant", "content": output}]
        conversations.append(messages)
    return conversations, "+".join(names[part] for part in present), [names[part] for part in present], unread


def messages_from_arrow(column: pa.Array | pa.ChunkedArray) -> list[list[dict] | None]:
    """Arrow chat rows as Python messages; keys that are null in a message are left out.

    JSON readers give every message every key seen anywhere in the file (``tool_calls: null`` on a
    plain user turn); templates test ``'tool_calls' in message`` or ``is defined``, so the null keys go.
    """
    if isinstance(column, pa.ChunkedArray):
        return [row for chunk in column.chunks for row in messages_from_arrow(chunk)]
    if (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)) and pa.types.is_struct(column.type.value_type):
        return _struct_messages(column)
    rows = column.to_pylist()
    return [None if row is None else [_message(m) for m in row] for row in rows]


def _struct_messages(column: pa.Array) -> list[list[dict] | None]:
    """``messages_from_arrow`` for ``list<struct>``: the struct's fields converted column by column (one
    ``to_pylist`` per field, not one per message), then each message built from its non-null fields."""
    offsets = column.offsets.to_numpy()
    structs = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    offsets = (offsets - offsets[0]).tolist()
    names = [structs.type.field(i).name for i in range(structs.type.num_fields)]
    fields = [json_values(field) for field in structs.flatten()]  # (``arrow.json`` fields decoded)
    if names:
        messages = [{name: value for name, value in zip(names, values) if value is not None} for values in zip(*fields)]
    else:
        messages = [{} for _ in range(len(structs))]
    for message in messages:  # content parts too: a text part must not carry an ``image: null`` key
        content = message.get("content")
        if type(content) is list and content and type(content[0]) is dict:
            message["content"] = [{k: v for k, v in part.items() if v is not None} if type(part) is dict else part
                                  for part in content]
    if structs.null_count:  # a null message stays None (the template rejects the row)
        for i in np.flatnonzero(structs.is_null().to_numpy(zero_copy_only=False)):
            messages[i] = None
    valid = column.is_valid().to_numpy(zero_copy_only=False) if column.null_count else None
    return [messages[offsets[r]:offsets[r + 1]] if valid is None or valid[r] else None for r in range(len(column))]


def json_values(column: pa.Array | pa.ChunkedArray) -> list:
    """A column as Python values, with JSON text (``arrow.json``) decoded at any depth: ``datasets`` stores a field
    whose keys differ from row to row as JSON text (a tool's ``properties``, a call's ``arguments``)."""
    values = column.to_pylist()
    if not _holds_json(column.type):
        return values
    return [_decoded(v, column.type) for v in values]


def _holds_json(arrow_type: pa.DataType) -> bool:
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return True
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return _holds_json(arrow_type.value_type)
    if pa.types.is_struct(arrow_type):
        return any(_holds_json(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    return False


def _decoded(value: Any, arrow_type: pa.DataType) -> Any:
    """A Python value of ``arrow_type`` with its ``arrow.json`` parts decoded."""
    if value is None:
        return None
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return json.loads(value) if isinstance(value, str) else value
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type):
        return [_decoded(v, arrow_type.value_type) for v in value]
    if pa.types.is_struct(arrow_type) and isinstance(value, dict):
        return {k: _decoded(v, arrow_type.field(k).type) if arrow_type.get_field_index(k) >= 0 else v
                for k, v in value.items()}
    return value


def _message(message: Any) -> Any:
    if isinstance(message, str):  # a JSON object (arrow.json)
        try:
            message = json.loads(message)
        except ValueError:
            return message
    if isinstance(message, dict):
        return {k: v for k, v in message.items() if v is not None}
    return message


def chats_of_rows(ct: Any, table: Any, kind: str, options: Any, rows: Sequence[int]) -> list[tuple[list | None, Any]]:
    """``(messages, tools)`` of some rows of an Arrow batch, as the messages path rendered them: read from the chat
    column (or prompt + completion) and put through the shape policy (``shapes.normalise_shapes``)."""
    take = pa.array(list(rows), type=pa.int64())
    conversations = conversations_of(table.take(take), kind, options, processor=ct.processor is not None)[0]
    tools = json_values(table.column("tools").take(take)) if "tools" in table.column_names else [None] * len(take)
    shaped = normalise_shapes(conversations, options, takes_parts=takes_content_parts(ct), call_ids=needs_call_ids(ct))
    return [(messages, read_tools(tool) if tool is not None else None)
            for messages, tool in zip(shaped.conversations, tools)]

