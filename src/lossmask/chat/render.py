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

**Bounds.** A chat template is code from the Hub, and one row must not hang a job or fill memory (a
nested loop of 10^10 turns, ``'x' * 10**9``). The template is read once (``template_bounds``): one whose
work the chat's size bounds, as every real template is, is compiled in a copy of transformers' sandbox
as it is, its rendered text held to ``MAX_RENDER_CHARS``, at the speed of transformers' own render. Any
other is compiled in a copy of that sandbox (same filters, globals and extensions) that also keeps
count: every loop turn and every call is a step (``MAX_RENDER_STEPS`` per row) and ticks a clock
(``MAX_RENDER_SECONDS``), also in loops that write nothing; every string or list that a ``*``, ``+``, ``%``,
``~``, call or filter builds, and the rendered text itself, is held to ``MAX_RENDER_CHARS``; an integer
argument above that size is refused before the call allocates (``'x'.ljust(10**9)``), and so is a power
whose result would be that large. A row over a bound raises ``RenderLimitError`` naming the limit, and
the job counts it ``invalid`` with that reason. All of it runs in this process, in the rendering thread:
no thread or process is killed.

The bounds hold on every path, not only the direct one: ``bounded_rendering()`` makes transformers compile
chat templates into this sandbox for the calls made inside it (a context variable, so other threads and
callers outside lossmask keep transformers' own), and ``ChatTokenizer.render`` and the batch render of
``encode_batch`` call ``apply_chat_template`` inside it. So rows with tools, chats given as Python objects
(``encode_chats``), and the probes of ``detect`` and ``verify`` are held to the same limits, through
``apply_chat_template``'s own preparation of the chat.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import time
import warnings
from typing import Any, Sequence

import pyarrow as pa

PROOF_ROWS = 64
MAX_RENDER_SECONDS = 10.0  # wall time to render one row (checked at every loop turn and call)
MAX_RENDER_CHARS = 64 * 2**20  # characters of one rendered row, and items of any string or list built on the way
MAX_RENDER_STEPS = 2**20  # loop turns and calls of one row in the bounded sandbox (a fraction of a second)


class ChatTemplateError(ValueError):
    """The chat template could not render a conversation (it raised, or there is no template)."""


class RenderLimitError(ChatTemplateError):
    """Rendering one row went over ``MAX_RENDER_SECONDS`` or ``MAX_RENDER_CHARS``."""


_DEADLINE: contextvars.ContextVar[float] = contextvars.ContextVar("lossmask_render_deadline", default=float("inf"))
_STEPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("lossmask_render_steps", default=None)


def _over_time(steps: int = 1) -> None:
    """Count ``steps`` loop turns or calls of the row being rendered; raise past the bounds on steps and time."""
    count = _STEPS.get()  # [steps so far] of the row that render_bounded renders
    if count is not None:
        count[0] += steps
    if count is not None and count[0] > MAX_RENDER_STEPS:
        raise RenderLimitError(f"render over {MAX_RENDER_STEPS:,} loop turns and calls (MAX_RENDER_STEPS): the chat "
                               "template loops too long for one row")
    if time.monotonic() > _DEADLINE.get():
        raise RenderLimitError(f"render time over {MAX_RENDER_SECONDS:g} seconds (MAX_RENDER_SECONDS): the chat "
                               "template loops too long for one row")


def _sized(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)) and len(value) > MAX_RENDER_CHARS:
        raise RenderLimitError(f"a value the chat template built holds {len(value)} items, over "
                               f"{MAX_RENDER_CHARS // 2**20} MiB of characters (MAX_RENDER_CHARS)")
    return value


def _refuse_huge(args: Sequence[Any]) -> None:
    for arg in args:
        if type(arg) is int and arg > MAX_RENDER_CHARS:
            raise RenderLimitError(f"the chat template passes {arg} to a call, over {MAX_RENDER_CHARS // 2**20} MiB "
                                   "of characters (MAX_RENDER_CHARS)")


def _bounded_filter(function):
    @functools.wraps(function)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args, **kwargs):
        _refuse_huge(args[1:])
        _refuse_huge(list(kwargs.values()))
        return _sized(function(*args, **kwargs))
    return bounded


def _ticks(iterable: Any):
    """A loop's items, counted as steps and with the clock checked every 256 turns (also when the loop writes
    nothing)."""
    for k, item in enumerate(iterable):
        if not k & 255:
            _over_time(256)
        yield item


@functools.lru_cache(maxsize=1)
def _bounded_environment_class():
    from jinja2 import Template, nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedTemplate(Template):
        def render(self, *args, **kwargs):  # what transformers calls: held to the bounds like ours
            return render_bounded(self, **dict(*args, **kwargs))

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # '~' joins strings without a binop: held to the size too
            self.write("environment.sized(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        template_class = BoundedTemplate
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})
        sized = staticmethod(_sized)

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):  # every loop turn ticks the clock
                loop.iter = nodes.Call(nodes.Name("__lossmask_ticks", "load"), [loop.iter], [], None, None)
            return tree

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            _over_time()
            _refuse_huge(args)
            _refuse_huge(list(kwargs.values()))
            return _sized(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int and len(seq) * n > MAX_RENDER_CHARS:
                        raise RenderLimitError(f"the chat template repeats a value to {len(seq) * n} items, over "
                                               f"{MAX_RENDER_CHARS // 2**20} MiB of characters (MAX_RENDER_CHARS)")
            if operator == "**" and type(left) is int and type(right) is int and abs(left) > 1 \
                    and right * abs(left).bit_length() > 8 * MAX_RENDER_CHARS:
                raise RenderLimitError(f"the chat template computes {left} ** {right}, a number over "
                                       f"{MAX_RENDER_CHARS // 2**20} MiB (MAX_RENDER_CHARS)")
            return _sized(super().call_binop(context, operator, left, right))

    return BoundedSandbox


@functools.lru_cache(maxsize=1)
def _fast_environment_class():
    from jinja2 import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class SizedTemplate(Template):
        unchecked = True  # render_bounded renders it with jinja's own render

        def render(self, *args, **kwargs):  # what transformers calls: the rendered text held to MAX_RENDER_CHARS
            return render_bounded(self, **dict(*args, **kwargs))

    class FastSandbox(ImmutableSandboxedEnvironment):  # transformers' sandbox, as it is
        template_class = SizedTemplate

    return FastSandbox


def _jinja_render(template: Any, variables: dict) -> str:
    from jinja2 import Template

    return Template.render(template, variables)


@functools.lru_cache(maxsize=16)
def bounded_template(template: str) -> Any:
    """``template`` compiled as transformers compiles it, in a sandbox that keeps the bounds above.

    A template that ``template_bounds.runaway_reason`` finds bounded by its input's size (every real template
    lossmask is tested on) is compiled in transformers' own sandbox instead, without the per-operation checks:
    the same text at the unbounded renderer's speed, its size still held to ``MAX_RENDER_CHARS``. A template whose
    loops over constant ranges alone make more than ``MAX_RENDER_STEPS`` turns is refused here, once, rather than
    run to the bound on every row."""
    from .template_bounds import constant_turns, runaway_reason

    reference = _reference_environment()
    turns, where = constant_turns(template, reference)
    if turns > MAX_RENDER_STEPS:
        raise RenderLimitError(f"the chat template loops {turns:,} times whatever the chat ({where}), over "
                               f"{MAX_RENDER_STEPS:,} loop turns and calls (MAX_RENDER_STEPS); fix the template")
    return compile_template(template, checked=runaway_reason(template, reference) is not None)


def _reference_environment() -> Any:
    # transformers' environment, from an empty template: compiling the row's template there would fold its
    # constants unbounded ('x' | center(10**9) is computed while compiling)
    return _transformers_compile()("").environment


def compile_template(template: str, *, checked: bool) -> Any:
    """``template`` in a copy of transformers' sandbox (its filters, globals and extensions): with every operation
    checked against the bounds (``checked``), or as transformers runs it, with only the rendered text's size held."""
    reference = _reference_environment()
    env_class = _bounded_environment_class() if checked else _fast_environment_class()
    env = env_class(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                    extensions=[type(e) for e in reference.extensions.values()])
    env.filters.update({name: _bounded_filter(f) for name, f in reference.filters.items()} if checked
                       else reference.filters)
    env.globals.update(reference.globals)
    if checked:
        env.globals["__lossmask_ticks"] = _ticks
    return env.from_string(template)


_BOUNDED: contextvars.ContextVar[bool] = contextvars.ContextVar("lossmask_bounded_rendering", default=False)


@functools.lru_cache(maxsize=1)
def _transformers_compile():
    """transformers' own template compiler; the first call puts ``_compile_or_bound`` in its place."""
    from transformers.utils import chat_template_utils

    original = chat_template_utils._compile_jinja_template
    chat_template_utils._compile_jinja_template = functools.wraps(original)(
        lambda chat_template: bounded_template(chat_template) if _BOUNDED.get() else original(chat_template))
    return original


@contextlib.contextmanager
def bounded_rendering():
    """Within this block (this thread or task only), ``apply_chat_template`` renders in the bounded sandbox.

    Without transformers' private compiler (another version) the block changes nothing: the direct
    renderer is off too then, so that a job says why in its warning.
    """
    try:
        _transformers_compile()
    except (ImportError, AttributeError):
        yield
        return
    token = _BOUNDED.set(True)
    try:
        yield
    finally:
        _BOUNDED.reset(token)


def render_bounded(template: Any, **variables: Any) -> str:
    """Render a ``bounded_template`` within ``MAX_RENDER_SECONDS``, ``MAX_RENDER_STEPS`` and ``MAX_RENDER_CHARS``.

    A template of the unchecked path (its work bounded by the chat's size) is rendered by jinja's own
    ``Template.render``, its text's size checked once at the end; a checked one part by part as it is written."""
    if getattr(template, "unchecked", False):
        text = _jinja_render(template, variables)
        if len(text) > MAX_RENDER_CHARS:
            raise RenderLimitError(f"rendered text over {MAX_RENDER_CHARS // 2**20} MiB of characters "
                                   "(MAX_RENDER_CHARS)")
        return text
    token, steps = _DEADLINE.set(time.monotonic() + MAX_RENDER_SECONDS), _STEPS.set([0])
    try:
        size, parts = 0, []
        for part in template.generate(**variables):
            size += len(part)
            if size > MAX_RENDER_CHARS:
                raise RenderLimitError(f"rendered text over {MAX_RENDER_CHARS // 2**20} MiB of characters "
                                       "(MAX_RENDER_CHARS)")
            parts.append(part)
        return "".join(parts)
    finally:
        _DEADLINE.reset(token)
        _STEPS.reset(steps)


def text_parts(messages: Sequence[Any]) -> list:
    """``messages`` with each string content given as one text part, for a template that renders parts only."""
    return [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]


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
                _alias_reasoning_fields, _plain_template_data,
            )
        except ImportError as exc:
            self.reason = f"this transformers renders otherwise ({exc})"
            return
        self._compile, self._alias = bounded_template, _alias_reasoning_fields
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
                except RenderLimitError as exc:  # rendering it again would not end
                    errors.append((i, f"the chat template of {self.ct.name!r} rejected the conversation: {exc}"))
                    continue
                except Exception:  # noqa: BLE001 - rendered again below, for the error users see elsewhere
                    pass
            try:
                texts[i] = self.ct.render(messages, tools=tools)
            except Exception as exc:  # ChatTemplateError
                errors.append((i, str(exc)))
        return texts, errors

    def render_one(self, messages: list, *, add_generation_prompt: bool = False, tools: Any = None) -> str:
        """One conversation (a prefix of a row, for labels from the rendering): through the compiled template where
        this job proved it equal to ``apply_chat_template``, else through ``ChatTokenizer.render``. Raises
        ``ChatTemplateError`` as ``render`` does."""
        if self.reason is None and not tools and all(type(m) is dict for m in messages):
            compiled = self._compile(self.ct.template_for())
            if compiled in self._proved:
                try:
                    if self.ct.renders_parts_only:
                        messages = text_parts(messages)
                    return render_bounded(compiled, messages=self._alias(messages), tools=None, documents=None,
                                          add_generation_prompt=add_generation_prompt, **self._variables)
                except Exception:  # noqa: BLE001 - rendered again below, for the error users see elsewhere
                    pass
        return self.ct.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def _render(self, compiled: Any, messages: list) -> str:
        if self.ct.renders_parts_only:
            messages = text_parts(messages)
        return render_bounded(compiled, messages=self._alias(messages), tools=None, documents=None,
                              add_generation_prompt=False, **self._variables)

    def _prove(self, compiled: Any, chats: Sequence[Any]) -> None:
        if compiled in self._proved:
            return
        tried = 0
        for k, messages in enumerate(chats[:PROOF_ROWS]):
            if not (isinstance(messages, list) and all(type(m) is dict for m in messages)):
                continue
            try:  # ours first: a row over the bounds is never rendered unbounded
                ours = self._render(compiled, messages)
            except RenderLimitError:
                continue
            except Exception as exc:  # noqa: BLE001
                ours = f"<raised {exc}>"
            try:
                reference = self.ct.render(messages)
            except Exception:  # noqa: BLE001 - a rejected row proves nothing
                continue
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

