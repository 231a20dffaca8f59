"""Chat rows read from Arrow rendered by the compiled template itself, without transformers' per-call set-up.

``apply_chat_template`` spends about as long preparing each chat as Jinja spends rendering it: it walks
every message to turn objects into dicts, copies it again into plain JSON types, drops null keys and
aliases the reasoning fields. Rows read from Arrow need none of that but the last two: every value is
already a plain ``str``/``int``/``float``/``bool``/``None``/``list``/``dict`` (``plain_arrow_type`` checks
the column's type once), and ``encode_batch.messages_from_arrow`` has dropped the null keys. So such rows go
straight to the template transformers compiles (``_compile_jinja_template``, cached by it), with the same
variables (the tokenizer's special tokens, then the tokenizer's ``template_kwargs``), after the same
reasoning aliasing (transformers' own ``_alias_reasoning_fields``): 1.35-1.74x faster on the render step.

That leans on a private function of transformers and on its current normalisation, so it is proved per
job, like the fast tokeniser: the first ``PROOF_ROWS`` chats of a job are also rendered by
``apply_chat_template``, and any difference (or a transformers without the function) switches the job
back to it, with a warning naming the first differing row. Rows the template rejects are rendered again
by ``ChatTokenizer.render``, so their error message is the one users see anywhere else.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import pyarrow as pa

PROOF_ROWS = 64


class ChatTemplateError(ValueError):
    """The chat template could not render a conversation (it raised, or there is no template)."""


def plain_arrow_type(arrow_type: pa.DataType) -> bool:
    """Does ``to_pylist`` of this type give only JSON types (no bytes, dates, decimals, tuples of a map)?"""
    if getattr(arrow_type, "extension_name", None) == "arrow.json":
        return True
    if (pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type) or pa.types.is_integer(arrow_type)
            or pa.types.is_floating(arrow_type) or pa.types.is_boolean(arrow_type) or pa.types.is_null(arrow_type)):
        return True
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return plain_arrow_type(arrow_type.value_type)
    if pa.types.is_struct(arrow_type):
        return all(plain_arrow_type(arrow_type.field(i).type) for i in range(arrow_type.num_fields))
    return False


class DirectRenderer:
    """The compiled template of one ``ChatTokenizer``, with the variables ``apply_chat_template`` passes it."""

    def __init__(self, ct: Any):
        self.ct = ct
        self.reason: str | None = None  # why the job renders through apply_chat_template instead
        self._proved: set[Any] = set()  # the compiled templates proved in this job
        try:
            from transformers.utils.chat_template_utils import (
                _alias_reasoning_fields, _compile_jinja_template, _plain_template_data,
            )
        except ImportError as exc:
            self.reason = f"this transformers renders otherwise ({exc})"
            return
        self._compile, self._alias = _compile_jinja_template, _alias_reasoning_fields
        special = _plain_template_data(dict(getattr(ct.tokenizer, "special_tokens_map", {}) or {}))
        self._variables = {**special, **_plain_template_data(dict(ct.template_kwargs))}

    def begin_job(self) -> None:
        self._proved.clear()

    def render(self, chats: Sequence[Any]) -> tuple[list[str | None], list[tuple[int, str]]]:
        """Like ``encode_batch.render_chats`` for chats of plain JSON values (a list of messages, or ``{messages, tools}``)."""
        texts: list[str | None] = [None] * len(chats)
        errors: list[tuple[int, str]] = []
        if self.reason is None:
            compiled = self._compile(self.ct.template_for())
            self._prove(compiled, chats)
        for i, chat in enumerate(chats):
            messages, tools = (chat["messages"], chat.get("tools")) if isinstance(chat, dict) else (chat, None)
            if self.reason is None and not tools and all(type(m) is dict for m in messages):
                try:
                    texts[i] = self._render(compiled, messages)
                    continue
                except Exception:  # noqa: BLE001 - rendered again below, for the error users see elsewhere
                    pass
            try:
                texts[i] = self.ct.render(messages, tools=tools)
            except Exception as exc:  # ChatTemplateError
                errors.append((i, str(exc)))
        return texts, errors

    def _render(self, compiled: Any, messages: list) -> str:
        return compiled.render(messages=self._alias(messages), tools=None, documents=None, add_generation_prompt=False,
                               **self._variables)

    def _prove(self, compiled: Any, chats: Sequence[Any]) -> None:
        if compiled in self._proved:
            return
        tried = 0
        for k, messages in enumerate(chats[:PROOF_ROWS]):
            if not (isinstance(messages, list) and all(type(m) is dict for m in messages)):
                continue
            try:
                reference = self.ct.render(messages)
            except Exception:  # noqa: BLE001 - a rejected row proves nothing
                continue
            try:
                ours = self._render(compiled, messages)
            except Exception as exc:  # noqa: BLE001
                ours = f"<raised {exc}>"
            tried += 1
            if ours != reference:
                at = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
                self.reason = (f"rendering the template directly differs from apply_chat_template on chat {k} of the "
                               f"job's first batch, at character {at} ({reference[at:at + 40]!r}); this job renders "
                               "through apply_chat_template")
                warnings.warn(self.reason, stacklevel=3)
                return
        if tried:
            self._proved.add(compiled)

