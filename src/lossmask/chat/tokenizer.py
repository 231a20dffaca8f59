"""`ChatTokenizer`: one adapter over the tokenizers people train with, for rendering and encoding chats.

``load_tokenizer(obj)`` accepts a Hugging Face fast tokenizer, a processor (its chat template renders,
its ``.tokenizer`` gives the ids), an mlx-lm ``TokenizerWrapper`` (the real tokenizer is at
``._tokenizer``), a folder path (loaded offline), or a ``ChatTokenizer`` (returned as is).

Encoding follows what training does: TRL, mlx-lm and ``apply_chat_template(tokenize=True)`` all
tokenise the rendered text with ``add_special_tokens=False``, because the chat template writes
whatever BOS the model expects (Llama-2 even writes one per turn). Letting the tokenizer add its own
BOS on top would double it. A template that writes no BOS (Zephyr, OLMo-2, Qwen) trains without
one, here as in TRL. So every encode below uses ``add_special_tokens=False``: the rendered text is
the whole row.

This module renders and encodes; it knows nothing about markers (``lossmask.markers`` does).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from .render import ChatTemplateError, bounded_rendering, text_parts  # ChatTemplateError raised here too; importers name it from either

Messages = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class EncodedChats:
    """Token ids of many conversations, and the rows the template rejected.

    ``input_ids`` is a ``LargeList<int32>`` array with one row per conversation; a rejected row is
    null there and listed in ``errors`` as ``(row, message)``. A row where the template dropped or
    rewrote a message (``content_dropped``), or dropped under ``special_tokens_in_content="drop"``, is
    null too and listed in ``dropped`` as ``(row, reason, message)``, and so is a row the shape policy left with
    no exchange (``no_exchange``). Label them with ``label(markers)`` (or ``lossmask.label_batch(encoded, markers)``
    / ``make_labels(encoded, markers)``): message text cannot act as a marker, and each row is held to the role
    invariant as ``mask_files`` holds it (a row the markers cannot read is labelled from its rendering, or its
    labels are null and the result's ``rejected`` names it). Labelling ``input_ids`` alone gives neither.
    """

    input_ids: pa.LargeListArray
    errors: tuple[tuple[int, str], ...]
    in_content: np.ndarray | None = None  # bool per token (rows back to back): inside message text
    dropped: tuple[tuple[int, str, str], ...] = ()  # (row, reason, message): rendered, never to be labelled
    special_rows: int = 0  # rows whose message text held a special-token string
    shapes: dict = field(default_factory=dict)  # rows the conversation-shape policy changed, per shape (shapes.py)
    # per token, whose text it lies in (encode_rendered.RoleTokens), for the role invariant (rows of unusual shape)
    roles: Any = field(default=None, repr=False, compare=False)
    # per row: (messages, tools) as rendered (after the shape policy), None for a null row; and what rendered them
    chats: tuple = field(default=(), repr=False, compare=False)
    tokenizer: Any = field(default=None, repr=False, compare=False)
    special_tokens_in_content: str = "text"

    def label(self, markers: Any, *, backend: str | None = None, last_turn_only: bool = False,
              ignore_index: int = -100, dtype: Any = "int64"):
        """``engine.LabelledBatch`` of these rows: message text inert, each row held to the role invariant
        (``turn_spans.label_encoded``)."""
        from .turn_spans import label_encoded

        return label_encoded(self, markers, backend=backend, last_turn_only=last_turn_only,
                             ignore_index=ignore_index, dtype=dtype)

    @property
    def ok(self) -> np.ndarray:
        """A boolean per row: did the template render it?"""
        return ~np.asarray(self.input_ids.is_null().to_numpy(zero_copy_only=False), dtype=bool)


@dataclass(frozen=True)
class FlatIds:
    """Token ids of many texts, flat: text ``i`` is ``ids[offsets[i]:offsets[i + 1]]``.

    ``ids`` is int32, ``offsets`` int64 (``len(texts) + 1`` of them). ``spans`` (only when asked for) is an
    ``(len(ids), 2)`` int64 array: each token's ``[start, end)`` character span in its own text.
    """

    ids: np.ndarray
    offsets: np.ndarray
    spans: np.ndarray | None = None

    def take(self, rows: Sequence[int]) -> "FlatIds":
        """The ids of ``rows`` only, flat in that order (without ``spans``)."""
        rows = np.asarray(rows, dtype=np.int64)
        lengths = np.diff(self.offsets)[rows]
        offsets = np.zeros(rows.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        where = np.repeat(self.offsets[:-1][rows] - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
        return FlatIds(self.ids[where], offsets)

    def to_arrow(self, *, max_length: int | None = None) -> pa.LargeListArray:
        """A ``LargeList<int32>`` array over the same buffers; ``max_length`` keeps each row's first tokens."""
        arr = pa.LargeListArray.from_arrays(pa.array(self.offsets), pa.array(self.ids))
        if max_length is not None and len(self.offsets) > 1 and int(np.diff(self.offsets).max()) > max_length:
            import pyarrow.compute as pc

            arr = pc.list_slice(arr, 0, max_length)
        return arr


_SETUP_PROBE = ({"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."})


class ChatTokenizer:
    """Renders conversations with a tokenizer's own chat template and encodes them as training does.

    Build one with ``lossmask.load_tokenizer``. ``tokenizer`` is the Hugging Face fast tokenizer that
    gives ids and offsets; ``template_owner`` is the object whose chat template renders (the tokenizer
    itself, or a processor). ``processor``: the processor it was built over (None for a tokenizer): its image
    expansion is used for chats with images (``chat/media.py``).
    """

    processor: Any = None

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: Any = None,
        name: str | None = None,
        template_name: str | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"{type(tokenizer).__name__} is not a fast (Rust) tokenizer, and lossmask needs its offset "
                "mapping; load it with AutoTokenizer.from_pretrained(path, use_fast=True)"
            )
        self.tokenizer = tokenizer
        self.name = name or str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)
        templates = _normalise_templates(chat_template if chat_template is not None else tokenizer.chat_template)
        if templates is None:
            raise ChatTemplateError(
                f"tokenizer {self.name!r} has no chat template; pass a tokenizer whose tokenizer_config.json has "
                "'chat_template', or set tokenizer.chat_template to a Jinja template string"
            )
        if template_name is not None and isinstance(templates, dict) and template_name not in templates:
            raise ValueError(
                f"tokenizer {self.name!r} has no chat template named {template_name!r}; it has {sorted(templates)}"
            )
        self.templates = templates
        self.template_name = template_name
        # extra variables every render passes to the template (e.g. {"enable_thinking": False} for Qwen3),
        # so that detection, verification and encoding all see the chat as training renders it
        self.template_kwargs = dict(template_kwargs or {})

    def __repr__(self) -> str:
        return f"ChatTokenizer({self.name!r})"

    def __getstate__(self) -> dict:
        """What a worker process gets: no serialised copy of the vocabulary, no fast tokeniser (it loads its own)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("tokenizer_json", "tokenizer_digest", "fast_tokens", "direct_render",
                                                                "token_text")}

    # -- facts about the vocabulary --------------------------------------------------------

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the tokens the tokenizer declares special (added tokens flagged special, BOS/EOS...)."""
        ids = {int(i) for i, tok in self.tokenizer.added_tokens_decoder.items() if getattr(tok, "special", False)}
        ids.update(int(i) for i in self.tokenizer.all_special_ids)
        return frozenset(ids)

    @cached_property
    def added_ids(self) -> frozenset[int]:
        """Ids of every added token (special or not): atomic in any text, never merged with neighbours."""
        return frozenset(int(i) for i in self.tokenizer.added_tokens_decoder) | self.special_ids

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    @cached_property
    def text_affixes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the tokenizer's own ``__call__`` puts before and after a plain text (its post-processor, as
        ``add_bos_token`` set it: Gemma's ``<bos>``, Llama-3's and SmolLM3's ``<|begin_of_text|>``), found once by
        encoding a probe with and without special tokens. Chat rows never take them (the template writes its own);
        plain-text prompt/completion rows do, as TRL tokenises them."""
        probe = "a"
        bare = list(self.tokenizer(probe, add_special_tokens=False)["input_ids"])
        full = list(self.tokenizer(probe, add_special_tokens=True)["input_ids"])
        for at in range(len(full) - len(bare) + 1):
            if full[at:at + len(bare)] == bare:
                return tuple(full[:at]), tuple(full[at + len(bare):])
        return (), ()  # a post-processor that rewrites the text's own ids: nothing to add around it

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens([int(i) for i in ids])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    # -- rendering -------------------------------------------------------------------------

    def template_for(self, *, tools: Any = None) -> str:
        """The template string that renders a chat with (or without) tools."""
        if isinstance(self.templates, str):
            return self.templates
        if self.template_name is not None:
            return self.templates[self.template_name]
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(
            f"tokenizer {self.name!r} has named chat templates {sorted(self.templates)} and none is 'default'; "
            "pass load_tokenizer(..., template_name=NAME)"
        )

    def render(
        self,
        messages: Messages,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The text the chat template writes for ``messages`` (raises ``ChatTemplateError``).

        Held to ``render.MAX_RENDER_SECONDS`` and ``MAX_RENDER_CHARS`` (``RenderLimitError``). On a template that
        renders text parts only (``renders_parts_only``), string contents are given to it as one text part."""
        if self.renders_parts_only:
            messages = text_parts(messages)
        return self._render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)

    @cached_property
    def renders_parts_only(self) -> bool:
        """Does the template drop string contents but write text parts (LLaVA's and Idefics3's VL templates)?"""
        def probe(wrap):
            chat = [{"role": "user", "content": wrap("Qz7p1")}, {"role": "assistant", "content": wrap("Qz7p2")}]
            try:
                text = self._render(chat)
            except ChatTemplateError:
                return False
            return "Qz7p1" in text and "Qz7p2" in text

        return not probe(lambda t: t) and probe(lambda t: [{"type": "text", "text": t}])

    def _render(self, messages: Messages, *, tools: Sequence[Mapping[str, Any]] | None = None,
                add_generation_prompt: bool = False, **template_kwargs: Any) -> str:
        try:
            with bounded_rendering():
                text = self.tokenizer.apply_chat_template(
                    list(messages),
                    tools=list(tools) if tools else None,
                    chat_template=self.template_for(tools=tools),
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **{**self.template_kwargs, **template_kwargs},
                )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja2 TemplateError, raise_exception(), KeyError in templates...
            raise ChatTemplateError(f"the chat template of {self.name!r} rejected the conversation: {exc}") from exc
        if not isinstance(text, str):  # batched input, or a transformers version returning a dict
            raise ChatTemplateError(f"apply_chat_template returned {type(text).__name__}, expected one string")
        return text

    # -- encoding --------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, as training tokenises it (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode_with_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, offsets)``: int64 ids and an ``(n, 2)`` array of character spans into ``text``."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        return ids, offsets

    def encode_flat(self, texts: Sequence[str], *, char_offsets: bool = False) -> FlatIds:
        """Token ids of many rendered texts in one batch call, flat (``FlatIds``); no special tokens added.

        The one place a tokeniser library is chosen: ``fastokens`` where it is installed and supports this
        tokenizer (proven against ``tokenizers`` on the first texts of each job, see ``fast_tokens``), else
        Hugging Face ``tokenizers``. ``char_offsets=True`` also returns each token's character span, which
        only ``tokenizers`` gives (so it encodes those calls).
        """
        texts = texts if isinstance(texts, list) else list(texts)
        if not char_offsets and texts:
            flat = self.fast_tokens.encode(texts, self._encode_reference)
            if flat is not None:
                return FlatIds(*flat)
        return FlatIds(*self._encode_reference(texts, char_offsets=char_offsets))

    def _encode_reference(self, texts: Sequence[str], *, char_offsets: bool = False):
        """``(ids, offsets[, spans])`` with Hugging Face ``tokenizers``: flattened without a NumPy array per row."""
        backend = self.tokenizer.backend_tokenizer
        texts = list(texts)
        encodings = (backend.encode_batch if char_offsets else backend.encode_batch_fast)(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e) for e in encodings), dtype=np.int64, count=len(encodings))
        offsets = np.zeros(len(encodings) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        total = int(offsets[-1])
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int32, count=total)
        if not char_offsets:
            return ids, offsets
        spans = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(e.offsets for e in encodings)),
                            dtype=np.int64, count=2 * total).reshape(total, 2)
        return ids, offsets, spans

    @cached_property
    def tokenizer_json(self) -> str:
        """The tokenizer serialised as ``tokenizer.json`` (its live state: added tokens included)."""
        return self.tokenizer.backend_tokenizer.to_str()

    @cached_property
    def tokenizer_digest(self) -> bytes:
        """SHA-256 of ``tokenizer_json``, once per adapter (the marker cache's key takes it at every job: 60 ms for
        Llama 3.1's 9 MB)."""
        import hashlib

        return hashlib.sha256(self.tokenizer_json.encode("utf-8")).digest()

    @cached_property
    def token_text(self):
        """The bytes each id stands for (``token_text.TokenText``), or None where they cannot be read off the vocabulary:
        tokens' character spans without tokenising again with offsets."""
        from .token_text import TokenText

        return TokenText.of(self.tokenizer_json, sorted(self.added_ids))

    def spans_of(self, texts: Sequence[str], flat: "FlatIds") -> tuple[np.ndarray, np.ndarray]:
        """``(spans, exact)`` of texts already encoded (``flat``): each token's character span, read off the bytes its
        id stands for, and a bool per text (False: its spans mean nothing; ask ``encode_texts_with_offsets``)."""
        table = self.token_text
        if table is None:
            return np.zeros((flat.ids.shape[0], 2), np.int32), np.zeros(len(texts), dtype=bool)
        return table.spans(texts, flat.ids, flat.offsets)

    @cached_property
    def fast_tokens(self):
        """This tokenizer's ``fast_tokens.FastTokens`` (``fastokens``, loaded on a thread on first use)."""
        from .fast_tokens import FastTokens

        return FastTokens(self, self.name)

    @cached_property
    def direct_render(self):
        """This tokenizer's ``render.DirectRenderer``: the compiled template, for rows read from Arrow."""
        from .render import DirectRenderer

        return DirectRenderer(self)

    def begin_job(self) -> None:
        """A job starts: begin loading the fast tokeniser now; prove it and the direct renderer again on its first rows."""
        self.fast_tokens.begin_job()
        self.fast_tokens.start()
        self.direct_render.begin_job()

    def check_templates(self) -> None:
        """Raise ``render.RenderLimitError`` when one of this tokenizer's templates loops past the render bounds
        whatever the chat (``render.bounded_template``), or goes over the render budget on a two-message chat (the
        set-up probe): a job stops with that one line before it looks for markers."""
        from jinja2.sandbox import SecurityError

        from .render import RenderLimitError, bounded_template

        instead = "fix the template, or pass another (--chat-template FILE.jinja, chat_template=)"
        templates = [self.templates] if isinstance(self.templates, str) else list((self.templates or {}).values())
        for template in templates:
            if isinstance(template, str):
                try:
                    bounded_template(template)
                except RenderLimitError as exc:
                    raise RenderLimitError(f"tokenizer {self.name!r}: {exc}") from None
        try:
            self.render(_SETUP_PROBE)
        except RenderLimitError as exc:
            raise RenderLimitError(f"the chat template of {self.name!r} goes over the render budget on a two-message "
                                   f"chat ({exc}); {instead}") from None
        except ChatTemplateError as exc:  # a template that needs another shape of chat: the markers' probes say so
            if isinstance(exc.__cause__, SecurityError):
                raise ChatTemplateError(f"the chat template of {self.name!r} does what the sandbox refuses on a "
                                        f"two-message chat ({exc.__cause__}); {instead}") from None

    def encode_texts(self, texts: Sequence[str], *, max_length: int | None = None) -> pa.LargeListArray:
        """Token ids of many rendered texts in one batch call: a ``LargeList<int32>`` array."""
        return self.encode_flat(texts).to_arrow(max_length=max_length)

    def encode_texts_with_offsets(self, texts: Sequence[str]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Token ids and ``(n, 2)`` character offsets of many rendered texts, in one batch call.

        The one call the messages path tokenises through (``encode_rendered``): a faster exact
        tokeniser can take its place here.
        """
        encodings = self.tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False)
        ids = [np.array(e.ids, dtype=np.int64) for e in encodings]
        offsets = [np.array(e.offsets, dtype=np.int64).reshape(-1, 2) for e in encodings]
        return ids, offsets

    @cached_property
    def content_tokens(self):
        """Which special-token strings in message text are text and which stay tokens (``specials.ContentTokens``)."""
        from .specials import ContentTokens

        return ContentTokens.of(self)

    @cached_property
    def text_encoder(self):
        """Encodes rows with message text's special-token strings as text (``specials.TextEncoder``)."""
        from .specials import TextEncoder

        return TextEncoder(self, self.content_tokens)

    def encode_chats(
        self,
        conversations: Sequence[Messages | Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        max_length: int | None = None,
        special_tokens_in_content: str = "text",
        options: Any = None,
    ) -> EncodedChats:
        """Render and tokenise many conversations: one batch tokenisation, per-row template errors.

        Each conversation is a list of messages, or a mapping with ``"messages"`` and optionally
        ``"tools"`` (per-row tools override ``tools=``). A conversation the template rejects becomes
        a null row and an entry in ``errors``; the batch goes on. ``max_length`` keeps the first
        ``max_length`` tokens of each row (right truncation, as TRL does).
        ``special_tokens_in_content``: what special-token strings in message text become (``"text"``,
        the default: ordinary text; ``"keep"``: control tokens; ``"drop"``: the row; ``"error"``: raise).

        Rows to train on (``add_generation_prompt=False``) first go through the conversation-shape policy of
        ``options`` (a ``MaskOptions``; default: ``lossmask mask``'s), as in ``mask_files`` (docs/inputs.md):
        repeated roles merged, a leading assistant message and empty messages dropped, a row left with no exchange
        null and in ``dropped`` as ``no_exchange``. Prompts to generate from are rendered as they are.
        """
        from ..options import MaskOptions
        from .encode_rendered import encode_rendered
        from .shapes import needs_call_ids, normalise_shapes, takes_content_parts, without_nulls

        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length={max_length!r} must be a positive integer or None")
        options = options if options is not None else MaskOptions(special_tokens_in_content=special_tokens_in_content)
        texts: list[str] = []
        chats: list[Any] = []
        row_tools_kept: list[Any] = []
        check: list[bool] = []
        rendered_rows: list[int] = []
        errors: list[tuple[int, str]] = []
        read: list[tuple[Any, Any]] = []
        for row, conversation in enumerate(conversations):
            messages, row_tools = conversation, tools
            if isinstance(conversation, Mapping):
                if "messages" not in conversation:
                    errors.append((row, f"row {row} is a mapping without 'messages' (keys: {sorted(conversation)})"))
                    read.append((None, None))
                    continue
                messages, row_tools = conversation["messages"], conversation.get("tools") or tools
            # (the null keys Arrow adds to tools: a datasets column read as Python keeps them)
            read.append((list(messages) if messages is not None else None, without_nulls(row_tools)))
        shaped_dropped: list[tuple[int, str, str]] = []
        unusual = [False] * len(read)
        shapes: dict = {}
        if not add_generation_prompt:  # the shape policy, as mask_files applies it (shapes.py)
            shaped = normalise_shapes([m for m, _ in read], options, takes_parts=takes_content_parts(self),
                                      call_ids=needs_call_ids(self))
            errors += [(r, f"row {r}: {message}") for r, message in shaped.invalid]
            shaped_dropped = [(r, reason, message) for r, reason, message in shaped.dropped]
            refused = {r for r, _ in shaped.invalid} | {r for r, _, _ in shaped.dropped}
            read = [(None, None) if r in refused else (m, t) for r, ((_, t), m) in
                    enumerate(zip(read, shaped.conversations))]
            unusual = shaped.unusual
            shapes = {shape: n for shape, n in shaped.shapes.items() if n}
        errored = {r for r, _ in errors}
        for row, (messages, row_tools) in enumerate(read):
            if messages is None or row in errored:
                continue
            try:
                texts.append(self.render(messages, tools=row_tools, add_generation_prompt=add_generation_prompt))
            except ChatTemplateError as exc:
                errors.append((row, f"row {row}: {exc}"))
                continue
            chats.append(messages)
            row_tools_kept.append(row_tools)
            check.append(bool(unusual[row]))
            rendered_rows.append(row)
        errors.sort()
        n = len(read)
        rendered = encode_rendered(self, texts, chats, special_tokens_in_content=special_tokens_in_content,
                                   max_length=max_length, row_numbers=rendered_rows,
                                   check=check if any(check) else None)
        encoded = rendered.input_ids
        kept = np.flatnonzero(rendered.keep)
        kept_rows = np.asarray(rendered_rows, dtype=np.int64)[kept] if kept.size else np.zeros(0, np.int64)
        per_row: list[Any] = [None] * n
        for local, row in zip(kept.tolist(), kept_rows.tolist()):
            per_row[row] = (chats[local], row_tools_kept[local])
        extra = dict(shapes=shapes, roles=rendered.roles, chats=tuple(per_row), tokenizer=self,
                     special_tokens_in_content=special_tokens_in_content)
        if kept_rows.size == n:
            return EncodedChats(encoded, (), rendered.in_content, (), rendered.special_rows, **extra)
        # scatter the kept rows back among the rejected and dropped ones (nulls)
        take = np.full(n, -1, dtype=np.int64)
        take[kept_rows] = np.arange(kept_rows.size)
        indices = pa.array(take, mask=take < 0)
        return EncodedChats(encoded.take(indices), tuple(errors), rendered.in_content,
                            tuple(sorted(shaped_dropped + list(rendered.dropped))), rendered.special_rows, **extra)


def _normalise_templates(template: Any) -> str | dict[str, str] | None:
    """A template string, or ``{name: template}`` from a dict or a list of ``{"name", "template"}``."""
    if template is None or isinstance(template, str):
        return template or None
    if isinstance(template, Mapping):
        return {str(k): str(v) for k, v in template.items()} or None
    if isinstance(template, (list, tuple)):
        named = {}
        for entry in template:
            if not isinstance(entry, Mapping) or "name" not in entry or "template" not in entry:
                raise TypeError(f"a list of chat templates must hold {{'name': ..., 'template': ...}} entries, got {entry!r}")
            named[str(entry["name"])] = str(entry["template"])
        return named or None
    raise TypeError(f"chat_template must be a string, a dict or a list of named templates, got {type(template).__name__}")


class _ClassNoteFilter:
    """Drops transformers' note that a folder names ``LlamaTokenizerFast`` over a byte-level ``tokenizer.json``.

    transformers then loads ``TokenizersBackend``, which is right for such a folder (DeepSeek's among them), and asks
    the reader to edit the folder's ``tokenizer_config.json``: advice for the folder's publisher, not for a user of
    lossmask, whose labels do not depend on the class."""

    def filter(self, record) -> bool:
        return not str(record.msg).startswith("`tokenizer_class` is ")


def auto_tokenizer(path: str):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``, without transformers' note on the class name.

    A tokenizer-only folder (no model ``config.json``) whose ``tokenizer_config.json`` names the generic
    ``PreTrainedTokenizerFast``, with no custom code, is loaded by that class directly: with no model type to
    overrule the name, it is the class ``AutoTokenizer`` resolves it to, and importing ``AutoTokenizer`` imports
    torch where it is installed (transformers' model configurations), 270 MiB and 1.3 CPU-s that no tokenizer
    needs. Next to a ``config.json``, ``AutoTokenizer`` decides: transformers swaps the declared class for the
    model type's own on some models (Qwen2, Phi-3...)."""
    import logging

    if _names_the_generic_class(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer

    logger, note = logging.getLogger("transformers.models.auto.tokenization_auto"), _ClassNoteFilter()
    logger.addFilter(note)
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    finally:
        logger.removeFilter(note)


def _names_the_generic_class(path: str) -> bool:
    """True for a folder with ``tokenizer.json`` and no ``config.json`` whose ``tokenizer_config.json`` names
    ``PreTrainedTokenizerFast`` and no ``auto_map`` (custom code, which only ``AutoTokenizer`` runs)."""
    import json

    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.exists(os.path.join(path, "config.json")):
        return False
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as file:
            config = json.load(file)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") == "PreTrainedTokenizerFast" \
        and "auto_map" not in config


def load_tokenizer(
    obj: Any, *, template_name: str | None = None, template_kwargs: Mapping[str, Any] | None = None
) -> ChatTokenizer:
    """A ``ChatTokenizer`` over a tokenizer, processor, mlx-lm ``TokenizerWrapper`` or folder path.

    A path is loaded offline with ``AutoTokenizer.from_pretrained(path, local_files_only=True)``.
    ``template_kwargs`` are passed to every render (``{"enable_thinking": False}``: render as
    training does). ``template_name`` picks one of several named chat templates (default: ``"default"``, or
    ``"tool_use"`` when rendering with tools).
    """
    if isinstance(obj, ChatTokenizer):
        if template_name is None and template_kwargs is None:
            return obj
        again = ChatTokenizer(
            obj.tokenizer, chat_template=obj.templates, name=obj.name,
            template_name=template_name if template_name is not None else obj.template_name,
            template_kwargs={**obj.template_kwargs, **(template_kwargs or {})},
        )
        again.processor = obj.processor
        return again
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        from .media import holds_processor, load_processor

        if holds_processor(path):  # a processor's folder: its template and its image expansion
            try:
                processor = load_processor(path)
            except Exception as exc:
                raise ValueError(f"could not load the processor in {path!r} offline ({type(exc).__name__}: {exc}); pass "
                                 "a folder holding its tokenizer and preprocessor_config.json, or a loaded processor") from exc
            return _over_processor(processor, path, template_name, template_kwargs)
        try:
            import transformers  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError("loading a tokenizer from a path needs transformers: pip install 'lossmask[hf]'") from None
        try:
            tokenizer = auto_tokenizer(path)
        except Exception as exc:
            raise ValueError(
                f"could not load a tokenizer from {path!r} offline ({type(exc).__name__}: {exc}); pass a folder "
                "holding tokenizer.json and tokenizer_config.json, or a loaded tokenizer"
            ) from exc
        return ChatTokenizer(tokenizer, name=path, template_name=template_name, template_kwargs=template_kwargs)
    # mlx-lm TokenizerWrapper: the Hugging Face tokenizer is at ._tokenizer (a HF fast tokenizer also
    # has ._tokenizer, but that one is the Rust object, which has no apply_chat_template)
    inner = getattr(obj, "_tokenizer", None)
    if inner is not None and hasattr(inner, "apply_chat_template"):
        return ChatTokenizer(inner, template_name=template_name, template_kwargs=template_kwargs)
    # processor: template on the processor, ids from .tokenizer
    inner = getattr(obj, "tokenizer", None)
    if inner is not None and hasattr(inner, "apply_chat_template") and not hasattr(obj, "convert_tokens_to_ids"):
        return _over_processor(obj, None, template_name, template_kwargs)
    if hasattr(obj, "apply_chat_template") and hasattr(obj, "convert_tokens_to_ids"):
        return ChatTokenizer(obj, template_name=template_name, template_kwargs=template_kwargs)
    raise TypeError(
        f"cannot use a {type(obj).__name__} as a tokenizer; pass a Hugging Face fast tokenizer, a processor, "
        "an mlx-lm TokenizerWrapper, or the path of a tokenizer folder"
    )


def _over_processor(processor: Any, name: str | None, template_name, template_kwargs) -> ChatTokenizer:
    """A ``ChatTokenizer`` over a processor: its template renders, its ``.tokenizer`` gives the ids, and (when it
    has an image processor) it expands images."""
    from .media import is_processor

    inner = processor.tokenizer
    template = getattr(processor, "chat_template", None) or inner.chat_template
    ct = ChatTokenizer(inner, chat_template=template, name=name, template_name=template_name,
                       template_kwargs=template_kwargs)
    if is_processor(processor):
        ct.processor = processor
    return ct
