"""See what will be trained: one conversation rendered, tokenised and labelled, as text or as an HTML page.

``label_conversation`` renders a conversation (a built-in sample by default: a system prompt,
several turns, a tool call and its result where the template supports tools) with the tokenizer's
own chat template, chooses markers with the policy (``resolve_markers``), labels the tokens with
``make_labels`` and returns a ``Shown``. ``format_text`` prints it (trained text between ``[`` and
``]``, or coloured on a terminal), ``to_html`` makes a self-contained page (inline CSS, one box per
token, trained tokens highlighted, each space marked, a legend with the markers and where they came from).
``describe_markers`` lists markers as ids and decoded text. ``read_row`` reads one chat, or a row of any
file ``lossmask mask`` reads; ``read_chat`` makes a chat row what the job renders, and ``label_row`` labels a
row of token ids or prompt/completion text by the job itself. ``run_show`` and ``run_detect`` are the
``lossmask show`` and ``lossmask detect`` commands.

Nothing here runs on a hot path: it is per-token Python over one conversation, for people to read.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
import warnings
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence, TextIO

import numpy as np

from .chat.probes import WEATHER_TOOL
from .engine.labels import make_labels
from .engine.patterns import KINDS, Markers
from .chat.turn_spans import FromRendering
from .jobs.display import escaped, quoted
from .markers.policy import Resolution, resolve_markers

_CALL = {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}

SAMPLE_CONVERSATION: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "What is the weather there? Use the tool."},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "minus three, snowing"},
        {"role": "assistant", "content": "It is -3 °C and snowing. Wrap up warm!"},
    ],
    "tools": [WEATHER_TOOL],
}


@dataclass(frozen=True)
class Shown:
    """One labelled conversation: the rendered ``text``, per token its ``ids``, the ``pieces`` of text
    it shows (together they are ``text``), whether it is ``trained``, and the policy's ``resolution``.
    ``notes`` say how the conversation was adapted to the template (tool turns dropped...)."""

    tokenizer: str
    text: str
    ids: np.ndarray
    pieces: tuple[str, ...]
    trained: np.ndarray
    resolution: Resolution
    markers_text: dict[str, list[tuple[list[int], str]]]
    notes: tuple[str, ...] = ()

    @property
    def n_trained(self) -> int:
        return int(self.trained.sum())


def describe_markers(tokenizer: Any, markers: Markers | None) -> dict[str, list[tuple[list[int], str]]]:
    """``{kind: [(ids, decoded text), ...]}`` for each marker kind that has patterns."""
    if markers is None or not hasattr(markers, "response"):  # none, or labels from the rendering: no patterns
        return {}
    from .chat.tokenizer import load_tokenizer

    ct = load_tokenizer(tokenizer)
    return {kind: [(list(p), ct.decode(p)) for p in getattr(markers, kind)] for kind in KINDS if getattr(markers, kind)}


def _coerce_conversation(conversation: Any) -> tuple[list[Mapping[str, Any]], list | None]:
    if isinstance(conversation, Mapping):
        if "messages" not in conversation:
            raise ValueError(f"a conversation mapping needs 'messages' (and optionally 'tools'); it has {sorted(conversation)}")
        return list(conversation["messages"]), list(conversation.get("tools") or []) or None
    if isinstance(conversation, Sequence) and not isinstance(conversation, (str, bytes)):
        return list(conversation), None
    raise TypeError(
        f"a conversation is a list of messages or a mapping with 'messages' (and 'tools'), got {type(conversation).__name__}"
    )


def _sample_chat(ct: Any, text: str) -> tuple[list, Any]:
    """The messages and tools of the sample as ``_render_sample`` rendered them into ``text``."""
    from .chat.tokenizer import ChatTemplateError

    messages, tools = SAMPLE_CONVERSATION["messages"], SAMPLE_CONVERSATION["tools"]
    merged = _merge_assistant_runs([m for m in messages if m["role"] != "tool" and not m.get("tool_calls")])
    for msgs, tls in ((messages, tools), ([_arguments_as_json(m) for m in messages], tools), (merged, None),
                      ([m for m in merged if m["role"] != "system"], None)):
        try:
            if ct.render(msgs, tools=tls) == text:
                return msgs, tls
        except ChatTemplateError:
            continue
    return list(messages), tools


def _render_sample(ct: Any) -> tuple[str, tuple[str, ...]]:
    """The sample, adapted step by step to what the template accepts; notes say what was left out."""
    from .chat.tokenizer import ChatTemplateError

    messages, tools = SAMPLE_CONVERSATION["messages"], SAMPLE_CONVERSATION["tools"]
    without_tools = [m for m in messages if m["role"] != "tool" and not m.get("tool_calls")]
    merged = _merge_assistant_runs(without_tools)
    without_system = [m for m in merged if m["role"] != "system"]
    as_strings = [_arguments_as_json(m) for m in messages]
    attempts = [
        (messages, tools, ()),
        (as_strings, tools, ("the template takes tool-call arguments only as JSON strings (DeepSeek-V3); the sample "
                             "passes them so",)),
        (merged, None, ("the template does not render tool calls, so the sample's tool turns are left out",)),
        (without_system, None, ("the template accepts neither tools nor a system message; both are left out of the sample",)),
    ]
    errors = []
    for msgs, tls, notes in attempts:
        try:
            text = ct.render(msgs, tools=tls)
        except ChatTemplateError as exc:
            errors.append(str(exc))
            continue
        if tls and "get_weather" not in text.split("Use the tool.", 1)[-1]:
            errors.append("tool calls ignored")
            continue  # the template silently drops tool calls: show the chat without them
        return text, notes
    raise ChatTemplateError(f"the chat template of {ct.name!r} renders none of the sample conversations: {errors[-1]}")


def _arguments_as_json(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """The message with its tool-call arguments serialised to JSON strings."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        if not isinstance(function.get("arguments"), str):
            function["arguments"] = json.dumps(function.get("arguments", {}), ensure_ascii=False)
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def _merge_assistant_runs(messages: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Without tool turns, two user turns in a row remain; keep roles alternating by dropping the first."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        if out and out[-1]["role"] == message["role"] == "user":
            out[-1] = message
        else:
            out.append(message)
    return out


def token_pieces(text: str, offsets: np.ndarray) -> tuple[str, ...]:
    """The text each token shows: from the end of the previous piece to the end of its own span.

    The pieces join to ``text`` exactly: characters no token covers go with the next token, a
    token whose span an earlier one already covered (a multi-byte character split over several
    byte tokens) shows an empty piece, and text after the last token goes with the last one.
    """
    pieces, cursor = [], 0
    for _, end in offsets.tolist():
        end = max(int(end), cursor)
        pieces.append(text[cursor:end])
        cursor = end
    if pieces and cursor < len(text):
        pieces[-1] += text[cursor:]
    return tuple(pieces)


def label_conversation(
    tokenizer: Any,
    conversation: Any = None,
    *,
    model_name: str | None = None,
    resolution: Resolution | None = None,
) -> Shown:
    """Render ``conversation`` (default: the built-in sample) and label it as training would.

    ``tokenizer``: anything ``lossmask.load_tokenizer`` accepts. ``conversation``: a list of
    messages or ``{"messages": [...], "tools": [...]}``. ``resolution``: the policy's decision, when
    already made (default: ``resolve_markers(tokenizer, model_name)``). Without markers (the policy
    found none) every token trains, as it would in training, and the resolution's messages say so.
    """
    from .chat.tokenizer import load_tokenizer

    ct = load_tokenizer(tokenizer)
    if resolution is None:
        resolution = resolve_markers(ct, model_name)
    if conversation is None:
        text, notes = _render_sample(ct)
    else:
        messages, tools = _coerce_conversation(conversation)
        text, notes = ct.render(messages, tools=tools), ()
    ids, offsets = ct.encode_with_offsets(text)
    if resolution.markers is None:
        trained = np.ones(len(ids), dtype=bool)
    elif isinstance(resolution.markers, FromRendering):  # no token markers: the turns found from the rendering
        from .chat.turn_spans import label_row_from_rendering

        messages, tools = _coerce_conversation(conversation) if conversation is not None else _sample_chat(ct, text)
        found, why = label_row_from_rendering(ct, messages, np.asarray(ids), tools=tools, text=text,
                                              offsets=np.asarray(offsets))
        trained = found if found is not None else np.zeros(len(ids), dtype=bool)
        if why:
            notes = tuple(notes) + (f"this conversation cannot be labelled from its rendering: {why}",)
    else:
        trained = np.asarray(make_labels([ids.tolist()], resolution.markers)[0], dtype=np.int64) != -100
    return Shown(ct.name, text, ids, token_pieces(text, offsets), trained, resolution,
                 describe_markers(ct, resolution.markers), notes)


# -- text -------------------------------------------------------------------------------------------


def _header_lines(shown: Shown) -> list[str]:
    r = shown.resolution
    lines = [
        f"lossmask show {shown.tokenizer}",
        f"markers: {r.source}" + (f" (template table entry {r.template!r})" if r.source == "table" else ""),
    ]
    for kind, patterns in shown.markers_text.items():
        lines.append(f"  {kind}: " + ", ".join(f"{text!r} {ids}" for ids, text in patterns))
    lines += [f"  {m}" for m in r.messages]
    lines += [f"note: {n}" for n in shown.notes]
    lines.append(f"{shown.n_trained} of {len(shown.ids)} tokens trained")
    return [escaped(line, keep=_KEPT) for line in lines]


_KEPT = "\n\t"  # a chat's line breaks and tabs print as they are; every other control character escaped, as `repr`


def _printed(piece: str) -> str:
    """A piece of the chat as ``show`` prints it: an escape sequence, a bell or a carriage return from the data is
    written as ``repr`` writes it (``\\x1b[2J``), as ``lossmask mask --show`` does, so that printing a chat can
    neither clear the terminal nor set its title, on a terminal or through a pipe."""
    return escaped(piece, keep=_KEPT)


def format_text(shown: Shown) -> str:
    """The conversation as plain text, each run of trained tokens between ``[`` and ``]``."""
    out, inside = [], False
    for piece, trained in zip(shown.pieces, shown.trained.tolist()):
        if trained != inside:
            out.append("[" if trained else "]")
            inside = trained
        out.append(_printed(piece))
    if inside:
        out.append("]")
    legend = "trained text is between [ and ]"
    return "\n".join(_header_lines(shown) + [legend, "", "".join(out)])


def print_shown(shown: Shown, *, out: TextIO | None = None, colour: bool | None = None) -> None:
    """Print ``shown``: coloured with rich on a terminal (token boundaries by alternating shades),
    else ``format_text``."""
    out = out or sys.stdout
    colour = out.isatty() if colour is None else colour
    if colour:
        try:
            from rich.console import Console
            from rich.text import Text
        except ImportError:  # pragma: no cover - rich comes with the hf extra
            colour = False
    if not colour:
        print(format_text(shown), file=out)
        return
    console = Console(file=out, highlight=False, soft_wrap=True, force_terminal=True)
    for line in _header_lines(shown):
        console.print(line, markup=False, style="bold" if line.startswith("lossmask") else None)
    console.print(Text("trained", style="bold black on green") + Text(" tokens highlighted; ") +
                  Text("masked", style="grey50") + Text(" tokens dim; shades alternate at token boundaries\n"))
    body = Text()
    for k, (piece, trained) in enumerate(zip(shown.pieces, shown.trained.tolist())):
        shown_piece = _printed(piece).replace("\n", "↵\n") if trained else _printed(piece)
        if trained:
            style = "black on green" if k % 2 == 0 else "black on bright_green"
        else:
            style = "grey50" if k % 2 == 0 else "grey70"
        body.append(shown_piece, style=style)
    console.print(body)


# -- HTML -------------------------------------------------------------------------------------------

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2em; color: #1d1d1f; max-width: 70em; }
h1 { font-size: 1.3em; margin-bottom: .2em; } h2 { font-size: 1.05em; margin-top: 1.6em; }
.meta { color: #555; } .warn { color: #a11; font-weight: 600; }
table.markers { border-collapse: collapse; font-size: .9em; }
table.markers td, table.markers th { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.chat { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: .9em; line-height: 1.9;
        white-space: pre-wrap; overflow-wrap: anywhere; border: 1px solid #ccc; border-radius: 6px; padding: 1em; background: #fafafa; }
.t { border: 1px solid #d0d0d0; border-radius: 3px; margin-right: 1px; padding: 0 1px; color: #777; }
.t.tr { background: #b7f0c1; border-color: #2e9b47; color: #0b3d17; }
.t.sp { font-weight: 600; }
.nl { color: #aaa; } .t.tr .nl { color: #2e9b47; }
.empty::after { content: "\\200b"; }
.legend span.t { display: inline-block; }
code.mk, .t { white-space: pre; }
.ws { position: relative; }
.ws::before { position: absolute; left: 0; right: 0; text-align: center; color: #9a9a9a; pointer-events: none; }
.ws.s::before { content: "\\00b7"; } .ws.tab::before { content: "\\2192"; }
.t.tr .ws::before { color: #2e9b47; }
"""


def visible_spaces(text: str) -> str:
    """``text`` as HTML in which each space and tab is kept (``white-space: pre``) and marked, a dot or an arrow drawn
    over it: markers or tokens that differ only in their whitespace look different, and copied text is unchanged."""
    return (html.escape(text).replace(" ", '<span class="ws s"> </span>')
            .replace("\t", '<span class="ws tab">\t</span>'))


def _token_html(piece: str, token_id: int, trained: bool, decoded: str, special: bool) -> str:
    classes = "t" + (" tr" if trained else "") + (" sp" if special else "")
    title = f"#{token_id} {decoded!r}" + (" trained" if trained else " masked")
    if not piece:
        return f'<span class="{classes} empty" title="{html.escape(title)}"></span>'
    body = visible_spaces(piece).replace("\n", '<span class="nl">↵</span>\n')
    return f'<span class="{classes}" title="{html.escape(title)}">{body}</span>'


def to_html(shown: Shown, *, decode: Any = None, special_ids: frozenset[int] = frozenset(), title: str | None = None) -> str:
    """A self-contained HTML page: legend (markers, source, messages) and the chat, one box per token.

    ``decode(ids) -> str`` shows each token's own text in its tooltip (default: its piece);
    tokens in ``special_ids`` are drawn bold.
    """
    r = shown.resolution
    title = title or f"lossmask show: {os.path.basename(shown.tokenizer.rstrip('/')) or shown.tokenizer}"
    rows = []
    for kind, patterns in shown.markers_text.items():
        cells = "<br>".join(f'<code class="mk">{visible_spaces(repr(text))}</code> <span class=meta>{ids}</span>'
                            for ids, text in patterns)
        rows.append(f"<tr><th>{kind}</th><td>{cells}</td></tr>")
    markers_table = (f'<table class="markers">{"".join(rows)}</table>' if rows
                     else '<p class="warn">No markers: every token trains.</p>')
    source = html.escape(r.source) + (f" (template table entry <code>{html.escape(r.template)}</code>)" if r.source == "table" else "")
    messages = "".join(
        f'<li class="{"warn" if m.startswith("WARNING") else ""}">{html.escape(m)}</li>' for m in r.messages
    )
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in shown.notes)
    tokens = []
    for k, (piece, token, trained) in enumerate(zip(shown.pieces, shown.ids.tolist(), shown.trained.tolist())):
        decoded = decode([token]) if decode is not None else piece
        tokens.append(_token_html(piece, token, trained, decoded, token in special_ids))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_CSS}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<p class="meta">tokenizer <code>{html.escape(shown.tokenizer)}</code> · {len(shown.ids)} tokens, {shown.n_trained} trained
 · generated by <code>lossmask show</code></p>
<h2>Legend</h2>
<p class="legend"><span class="t tr">trained</span> counts in the loss · <span class="t">masked</span> labelled -100 ·
each box is one token (hover for its id and text) · <span class="nl">↵</span> is a newline ·
<code class="mk"><span class="ws s"> </span></code> a space, <code class="mk"><span class="ws tab">\t</span></code> a tab ·
<b>bold</b> tokens are special tokens</p>
<h2>Markers: {source}</h2>
{markers_table}
<ul class="meta">{messages}{notes}</ul>
<h2>The conversation as the model is trained on it</h2>
<div class="chat">{"<wbr>".join(tokens)}</div>
</body></html>
"""


def write_html(shown: Shown, path: str | os.PathLike, tokenizer: Any = None) -> None:
    """Write ``to_html(shown)`` to ``path``; with ``tokenizer``, tooltips and special tokens come from it."""
    decode, special = None, frozenset()
    if tokenizer is not None:
        from .chat.tokenizer import load_tokenizer

        ct = load_tokenizer(tokenizer)
        decode, special = ct.decode, ct.special_ids
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(to_html(shown, decode=decode, special_ids=special))


# -- reading a chat as lossmask mask reads it ------------------------------------------------------------


def read_row(path: str | os.PathLike, *, row: int = 0, options: Any = None) -> tuple[dict, str]:
    """Row ``row`` of ``path`` as Python values, and where it is (``file, line N``), as ``lossmask mask`` reads it.

    ``path`` holds one chat (a JSON object with ``messages``, ShareGPT's ``conversations`` or ``prompt`` +
    ``completion``, and perhaps ``tools``; or a JSON list of ``{role, content}`` or ``{from, value}`` messages), or
    rows in any file ``mask`` reads (JSON Lines, a JSON array of rows, Parquet, Arrow IPC, compressed JSON).
    """
    from .options import MaskOptions

    options = options or MaskOptions()
    name = escaped(os.fspath(path))
    if row < 0:
        raise ValueError(f"{name}: row {row}: rows are counted from 0 (--row 0 is the first)")
    value = _one_json_value(path)
    if isinstance(value, list) and value and all(isinstance(m, Mapping) and ("role" in m or "from" in m) for m in value):
        value = {("conversations" if "from" in value[0] else options.messages_column): value}
    if isinstance(value, Mapping):
        if row:
            raise ValueError(f"{name} holds one chat; it has no row {row}")
        return dict(value), name
    return _row_in_file(path, row, options)


def row_kind(values: Mapping[str, Any], options: Any, where: str) -> str:
    """``"chat"`` (messages, ShareGPT conversations, prompt + completion messages), ``"text"`` (prompt + completion
    as text) or ``"ids"`` (token ids), in the order ``lossmask mask`` looks for them; else ValueError."""
    if options.input_ids_column in values:
        return "ids"
    if options.chat_column(list(values)) in values:
        return "chat"
    prompt, completion = values.get(options.prompt_column), values.get(options.completion_column)
    if isinstance(prompt, list) and isinstance(completion, list):
        return "chat"
    if isinstance(prompt, str) and isinstance(completion, str):
        return "text"
    raise ValueError(f"{where} has {quoted(sorted(values))}: a row is {options.messages_column!r} (messages), 'conversations' "
                     f"(ShareGPT's {{from, value}}), prompt + completion (messages or text), or "
                     f"{options.input_ids_column!r} (token ids)")


def read_chat(tokenizer: Any, values: Mapping[str, Any], where: str, *, options: Any = None) -> tuple[dict, tuple[str, ...]]:
    """A chat row (``row_kind`` ``"chat"``) as ``lossmask mask`` would render it: ``({"messages", "tools"}, notes)``.

    The chat goes through the shape policy of ``options`` (a ``MaskOptions``; default its defaults), and ``notes``
    say what the policy changed. A row ``mask`` would refuse raises ValueError naming the file and row.
    """
    from .chat.shapes import normalise_shapes, read_tools, takes_content_parts
    from .chat.tokenizer import load_tokenizer
    from .options import MaskOptions

    options = options or MaskOptions()
    column = options.chat_column(list(values))
    if column in values:
        conversation = values[column]
        if not conversation:
            raise ValueError(f"{where}: column {column!r} is {'null' if conversation is None else 'empty'}")
    else:
        conversation = values[options.prompt_column] + values[options.completion_column]
    try:
        tools = read_tools(values["tools"]) if values.get("tools") is not None else None
    except ValueError as exc:
        raise ValueError(f"{where}: column 'tools' {exc}") from None
    ct = load_tokenizer(tokenizer)
    shaped = normalise_shapes([conversation], options, takes_parts=takes_content_parts(ct))
    if shaped.invalid:
        raise ValueError(f"{where}: {shaped.invalid[0][1]}")
    if shaped.dropped:
        _, reason, message = shaped.dropped[0]
        raise ValueError(f"{where}: lossmask mask drops this row as {reason}: {message}")
    notes = tuple(f"{shape}: {SHAPE_NOTES.get(shape, 'changed as lossmask mask changes it (docs/inputs.md)')}"
                  for shape, n in shaped.shapes.items() if n)
    return {"messages": shaped.conversations[0], "tools": tools}, notes


def label_row(tokenizer: Any, values: Mapping[str, Any], *, resolution: Resolution, options: Any = None,
              model_name: str | None = None) -> Shown:
    """A row of token ids or of prompt + completion text, labelled by the job itself (``mask_files`` on this one
    row, rows that train nothing kept), each token shown as its own decoded text."""
    from .chat.tokenizer import load_tokenizer
    from .options import MaskOptions

    ct = load_tokenizer(tokenizer)
    options = options or MaskOptions()
    ids, trained, _ = _labelled_by_the_job(ct, values, resolution, options, model_name)
    pieces = tuple(ct.decode([int(t)]) for t in ids)
    kind = "token ids" if options.input_ids_column in values else "prompt and completion text (no chat template)"
    return Shown(ct.name, "".join(pieces), ids, pieces, trained, resolution, describe_markers(ct, resolution.markers),
                 (f"a row of {kind}, labelled by lossmask mask itself; each token is shown as its own text",))


def _labelled_by_the_job(ct: Any, values: Mapping[str, Any], resolution: Resolution, options: Any,
                         model_name: str | None, *, as_json: bool = False) -> tuple[np.ndarray, np.ndarray, str | None]:
    """``(ids, trained, dropped)`` of one row as ``mask_files`` labels it (rows that train nothing kept): ``dropped`` is
    the job's line for a row it drops (``"content_dropped: ..."``), and then nothing trains. ``as_json``: the row is
    given to the job as a JSON Lines row (a chat, read as ``mask`` reads JSON), else as a Parquet row."""
    import tempfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from .jobs.stream import mask_files

    # the row is shown from its labels and ids: written whatever output the caller's options choose
    options = replace(options, keep_dropped=True, max_drop_fraction=1.0, labels_column=options.labels_column or "labels",
                      keep_columns=())
    with tempfile.TemporaryDirectory(prefix="lossmask-show-") as folder:
        source = os.path.join(folder, "row.jsonl" if as_json else "row.parquet")
        labelled = os.path.join(folder, "labelled.parquet")
        if as_json:
            with open(source, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(dict(values), ensure_ascii=False) + "\n")
        else:
            pq.write_table(pa.Table.from_pylist([dict(values)]), source)
        with warnings.catch_warnings():  # the policy's messages are printed with the page or text, once
            warnings.simplefilter("ignore")
            report = mask_files(source, labelled, tokenizer=ct, markers=resolution.markers, model_name=model_name,
                                options=options, progress=False)
        rows = pq.read_table(labelled, columns=[options.input_ids_column, options.labels_column]).to_pylist()
    # the job's line names the row of its one-row file ("content_dropped: row 0: ..."): the reason and what it says
    dropped = next((re.sub(r"^(\w+): row \d+: ", r"\1: ", line) for line in report.dropped_examples), None)
    out = rows[0] if rows else {}
    ids = np.asarray(out.get(options.input_ids_column) or [], dtype=np.int64)
    labels = out.get(options.labels_column)
    trained = np.zeros(len(ids), dtype=bool) if labels is None or dropped is not None \
        else np.asarray(labels, dtype=np.int64) != options.ignore_index
    return ids, trained, dropped


def _as_the_job_decides(ct: Any, shown: Shown, values: Mapping[str, Any], resolution: Resolution, options: Any,
                        model_name: str | None) -> Shown:
    """``shown`` (a chat row labelled for display) with the labels ``lossmask mask`` gives the same row, so that the
    two tell one story: a row the job drops is shown with its reason and nothing trained."""
    from .options import MaskOptions

    options = options or MaskOptions()
    try:
        ids, trained, dropped = _labelled_by_the_job(ct, values, resolution, options, model_name, as_json=True)
    except (TypeError, ValueError):  # a row JSON cannot carry (bytes of an image): the display's own labels
        return shown
    if dropped is not None:
        return replace(shown, trained=np.zeros(len(shown.ids), dtype=bool),
                       notes=tuple(shown.notes) + (f"lossmask mask drops this row, so nothing of it trains: {dropped}",))
    if len(ids) == len(shown.ids) and np.array_equal(ids, shown.ids):
        return replace(shown, trained=trained)
    pieces = tuple(ct.decode([int(t)]) for t in ids)  # the job encodes message text apart (special-token strings)
    return replace(shown, text="".join(pieces), ids=ids, pieces=pieces, trained=trained,
                   notes=tuple(shown.notes) + ("the job's token ids differ from the rendering's (message text encoded "
                                               "as text); each token is shown as its own text",))


SHAPE_NOTES = {
    "sharegpt_messages_read": "ShareGPT's {from, value} messages read through the role map, as lossmask mask reads them",
    "leading_assistant_dropped": "the chat opened with an assistant message before any user message; it was removed, "
                                 "so it does not train (--leading-assistant keep keeps it)",
    "roles_merged": "consecutive messages of one role were joined with a blank line (--consecutive-roles keep)",
    "empty_messages_dropped": "messages with no text were removed (--empty-messages keep)",
    "content_parts_joined": "content given as text parts was joined into one string",
}


def _one_json_value(path: str | os.PathLike) -> Any:
    """The file's content when it is one JSON document (a chat, or a JSON array); None for anything else (JSON
    Lines, Parquet, compressed files), which the job's own reader reads."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (UnicodeDecodeError, ValueError):
        return None


def _row_in_file(path: str | os.PathLike, row: int, options: Any) -> tuple[dict, str]:
    """``(values, where)`` of row ``row`` of a data file, read by the job's own reader."""
    from .chat.encode_batch import json_values, messages_from_arrow
    from .jobs.inputs import open_inputs

    files = open_inputs(os.fspath(path))
    try:
        seen = 0
        for batch in files.batches(max(1, min(row + 1, 1024))):
            if row < seen + batch.num_rows:
                local, names = row - seen, batch.schema.names
                chat_columns = (options.chat_column(names), options.prompt_column, options.completion_column)
                values = {}
                for name in names:
                    column = batch.column(name).slice(local, 1)
                    chat = name in chat_columns and not _is_text(column.type)
                    values[name] = (messages_from_arrow if chat else json_values)(column)[0]
                where = files.where(row)
                return values, f"row {row} ({where})" if where else f"row {row} of {escaped(os.fspath(path))}"
            seen += batch.num_rows
    finally:
        files.close()
    raise ValueError(f"{escaped(os.fspath(path))} has {seen} rows (counted from 0); it has no row {row}")


def _is_text(arrow_type: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


# -- the commands -----------------------------------------------------------------------------------


def _resolve_quietly(ct: Any, model_name: str | None) -> Resolution:
    """The policy's decision; its warnings are in ``messages``, which the commands print, so not twice."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_markers(ct, model_name)


def _resolve_as_the_job(ct: Any, model_name: str | None) -> Resolution:
    """``_resolve_quietly`` through the job's on-disk marker cache (``markers.cache``), under the job's key: a
    tokenizer that ``lossmask mask`` or ``show`` resolved before skips detection. No verification report comes back
    from the cache, so ``detect`` (which prints it) resolves afresh."""
    from .jobs.stream import resolve_markers_cached

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a hit emits the stored warnings again: the commands print ``messages``
        return resolve_markers_cached(ct, lambda: _resolve_quietly(ct, model_name), model_name=model_name, strict=False)


def run_show(tokenizer: Any, conversation_path: str | os.PathLike | None = None, *, html_path: str | os.PathLike | None = None,
             model_name: str | None = None, out: TextIO | None = None, colour: bool | None = None, row: int = 0,
             options: Any = None) -> int:
    """``lossmask show``: print the labelled conversation (row ``row`` of ``conversation_path``, read as
    ``lossmask mask`` reads it: ``read_row``; default: the built-in sample), or write it as an HTML page."""
    from .chat.tokenizer import load_tokenizer
    from .options import MaskOptions

    out = out or sys.stdout
    ct = load_tokenizer(tokenizer)
    resolution = _resolve_as_the_job(ct, model_name)
    if conversation_path is None:
        shown = label_conversation(ct, resolution=resolution)
    else:
        values, where = read_row(conversation_path, row=row, options=options)
        if row_kind(values, options or MaskOptions(), where) == "chat":
            conversation, notes = read_chat(ct, values, where, options=options)
            shown = replace(label_conversation(ct, conversation, resolution=resolution), notes=notes)
            shown = _as_the_job_decides(ct, shown, values, resolution, options, model_name)
        else:
            shown = label_row(ct, values, resolution=resolution, options=options, model_name=model_name)
    if html_path is not None:
        write_html(shown, html_path, ct)
        print(f"wrote {os.fspath(html_path)}: {len(shown.ids)} tokens, {shown.n_trained} trained, markers {shown.resolution.source}",
              file=out)
    else:
        print_shown(shown, out=out, colour=colour)
    return 0


def detect_report(tokenizer: Any, *, model_name: str | None = None) -> dict[str, Any]:
    """What ``lossmask detect --json`` prints: markers (ids and text), source, reason, messages, verification."""
    from .chat.tokenizer import ChatTemplateError, load_tokenizer

    try:
        ct = load_tokenizer(tokenizer)
    except ChatTemplateError:  # a base model's tokenizer: the policy says what it does without a template
        r = _resolve_quietly(tokenizer, model_name)
        return {"tokenizer": str(tokenizer), "source": r.source, "template": r.template, "reason": r.reason,
                "messages": list(r.messages), "markers": None, "decoded": {}, "verification": None}
    r = _resolve_quietly(ct, model_name)
    report = r.report
    verification = None
    if report is not None:
        verification = {
            "ok": bool(report.ok),
            "summary": report.summary(),
            "tokens": int(report.tokens),
            "missing": int(report.missing),
            "extra": int(report.extra),
            "conversations": [
                {"name": c.name, "tokens": c.tokens, "missing": len(c.missing), "extra": len(c.extra), "error": c.error}
                for c in report.conversations
            ],
            "kinds": [{"kind": k, "status": st, "detail": d} for k, st, d in getattr(report, "kinds", ())],
        }
    return {
        "tokenizer": ct.name,
        "source": r.source,
        "template": r.template,
        "reason": r.reason,
        "messages": list(r.messages),
        "markers": r.markers.to_dict() if r.markers is not None else None,
        "decoded": {kind: [text for _, text in patterns] for kind, patterns in describe_markers(ct, r.markers).items()},
        "verification": verification,
    }


def run_detect(tokenizer: Any, *, model_name: str | None = None, as_json: bool = False, out: TextIO | None = None) -> int:
    """``lossmask detect``: print the markers, their source and the verification; 1 when there is no verified masking."""
    out = out or sys.stdout
    info = detect_report(tokenizer, model_name=model_name)
    verified = info["markers"] is not None and info["verification"] is not None and info["verification"]["ok"]
    verified = verified or info["source"] == "rendered"  # labels from each row's rendering, checked on a probe chat
    if as_json:
        print(json.dumps(info, indent=2, ensure_ascii=False), file=out)
        return 0 if verified else 1
    print(f"tokenizer: {info['tokenizer']}", file=out)
    print(f"source: {info['source']}" + (f" (template table entry {info['template']!r})" if info["source"] == "table" else ""), file=out)
    if info["markers"] is None:
        print("markers: none: the full sequence trains", file=out)
    elif info["source"] == "rendered":
        print("markers: none can be read; each row is labelled from its own rendering (its assistant turns found by "
              "rendering the conversation up to and through each)", file=out)
    else:
        from .jobs.report import marker_lines

        print("markers (text = ids; whitespace variants are the header merged with the reply's leading whitespace):",
              file=out)
        markers = {kind: info["markers"][kind] for kind in KINDS if info["markers"].get(kind)}
        for line in marker_lines(markers, info["decoded"]):
            print(f"  {line}", file=out)
    summary = info["verification"]["summary"] if info["verification"] is not None else None
    for message in info["messages"]:
        print(message, file=out)
    if summary is not None and not any(summary in message for message in info["messages"]):
        print(f"verification: {summary}", file=out)
    if info["verification"] is not None:
        kinds = info["verification"]["kinds"]
        if kinds:
            print("conversation kinds:", file=out)
        for k in kinds:
            print(f"  {k['kind']:<15} {k['status']}" + (f": {k['detail']}" if k["detail"] else ""), file=out)
    return 0 if verified else 1
