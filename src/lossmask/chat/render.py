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
nested loop of 10^10 turns, ``'x' * 10**9``, a join of a join). Every template is compiled in a copy of
transformers' sandbox (same filters, globals and extensions) that renders each row under one budget
(``_Budget``): every loop turn and call is a step (``MAX_RENDER_STEPS``), the clock is read every 256 steps
(``MAX_RENDER_SECONDS``), also in loops that write nothing; whatever ``+``, ``~``, ``*``, ``%``, a call, a
filter, a macro or a block would build is charged before it builds (``join``, ``replace``, widths, ``lipsum``
by what they would make), no value over ``MAX_RENDER_CHARS`` and no more than ``MAX_RENDER_BUILT`` for the
row in all; the rendered text is measured before it is joined. A row over a bound raises
``RenderLimitError`` naming the limit, and the job counts it ``invalid`` with that reason. All of it runs in
this process, in the rendering thread: no thread or process is killed. ``template_bounds`` reads the template
once to pick the cheaper of two budgeted sandboxes (``checked``: every filter wrapped, ``//`` checked too); it
is a choice of speed, not the bound.

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
import re
import time
import warnings
from typing import Any, Sequence

import pyarrow as pa

PROOF_ROWS = 64
MAX_RENDER_SECONDS = 5.0  # wall time to render one row (checked every 256 loop turns and calls)
MAX_RENDER_CHARS = 64 * 2**20  # characters of one rendered row, and items of any string or list built on the way
MAX_RENDER_BUILT = 4 * MAX_RENDER_CHARS  # characters (or items) that growing operations build in one row, all told
MAX_RENDER_STEPS = 2**20  # loop turns and calls of one row (a fraction of a second)
_LIMIT = f"{MAX_RENDER_CHARS // 2**20} MiB of characters (MAX_RENDER_CHARS)"


class ChatTemplateError(ValueError):
    """The chat template could not render a conversation (it raised, or there is no template)."""


class RenderLimitError(ChatTemplateError):
    """Rendering one row went over ``MAX_RENDER_SECONDS``, ``MAX_RENDER_STEPS``, ``MAX_RENDER_CHARS`` or
    ``MAX_RENDER_BUILT``."""


class _Budget:
    """What one row's render has spent: steps (loop turns and calls), characters built, and when its time ends."""

    __slots__ = ("steps", "built", "deadline", "clock_at")

    def __init__(self) -> None:
        self.steps, self.built, self.clock_at = 0, 0, 256
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("lossmask_render_budget", default=None)


def _over_time(steps: int = 1) -> None:
    """Count ``steps`` loop turns or calls of the row being rendered; raise past the bounds on steps and time (the
    clock is read every 256 steps)."""
    budget = _BUDGET.get()
    if budget is None:
        return
    budget.steps += steps
    if budget.steps < budget.clock_at:
        return
    budget.clock_at = budget.steps + 256
    if budget.steps > MAX_RENDER_STEPS:
        raise RenderLimitError(f"render over {MAX_RENDER_STEPS:,} loop turns and calls (MAX_RENDER_STEPS): the chat "
                               "template loops too long for one row")
    if time.monotonic() > budget.deadline:
        raise RenderLimitError(f"render time over {MAX_RENDER_SECONDS:g} seconds (MAX_RENDER_SECONDS): the chat "
                               "template loops too long for one row")


def _charge(size: int, what: str = "a value the chat template builds") -> None:
    """Charge ``size`` characters (or items) that an operation is about to build, before it builds them: refused over
    ``MAX_RENDER_CHARS`` for the value, or when the row's values built so far pass ``MAX_RENDER_BUILT``."""
    if size > MAX_RENDER_CHARS:
        raise RenderLimitError(f"{what} holds {size:,} items, over {_LIMIT}")
    budget = _BUDGET.get()
    if budget is not None:
        budget.built += size
        if budget.built > MAX_RENDER_BUILT:
            raise RenderLimitError(f"the values the chat template builds for one row hold over {MAX_RENDER_BUILT:,} "
                                   "characters in all (MAX_RENDER_BUILT)")


def _sized(value: Any) -> Any:
    """``value``, its size charged (a string, list or dict an operation has built)."""
    if isinstance(value, (str, list, tuple, dict)):
        _charge(_weight(value))
    return value


def _weight(value: Any) -> int:
    """What a string or a collection costs against the bounds: a character each, 8 for an item (a pointer)."""
    return len(value) if isinstance(value, str) else 8 * len(value)


def _refuse_huge(args: Sequence[Any]) -> None:
    for arg in args:
        if type(arg) is int and arg > MAX_RENDER_CHARS:
            raise RenderLimitError(f"the chat template passes {arg} to a call, over {_LIMIT}")


def _text_size(items: Any) -> int:
    return sum(len(item) for item in items if isinstance(item, str))


def _joined_size(separator: str, items: Sequence[Any]) -> int:
    return len(separator) * max(len(items) - 1, 0) + _text_size(items)


def _replaced_size(text: str, old: Any, new: Any, count: Any) -> int:
    if not (isinstance(old, str) and isinstance(new, str)):
        return len(text)
    found = len(text) + 1 if not old else text.count(old)
    if type(count) is int and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _listed(items: Any) -> Any:
    """``items`` as a sequence whose size is known before a join (a generator is drawn out, a step per item)."""
    if isinstance(items, (str, list, tuple, dict)):
        return items
    drawn = []
    for item in _ticked(items):
        drawn.append(item)
    return drawn


def _call_size(function: Any, args: tuple, kwargs: dict) -> tuple[tuple, int | None]:
    """The size of what calling ``function`` would build, when a builtin that grows its output is called (``join``,
    ``replace``, ``ljust``..., ``format``, ``lipsum``), and the arguments to call it with (a generator drawn out)."""
    owner = getattr(getattr(function, "__wrapped__", function), "__self__", None)  # the sandbox wraps str.format
    if isinstance(owner, str):
        name = getattr(function, "__name__", "")
        if name == "join" and args:
            items = _listed(args[0])
            return (items, *args[1:]), _joined_size(owner, items)
        if name == "replace" and len(args) >= 2:
            return args, _replaced_size(owner, args[0], args[1], args[2] if len(args) > 2 else kwargs.get("count"))
        if name in ("ljust", "rjust", "center", "zfill") and args and type(args[0]) is int:
            return args, max(len(owner), args[0])
        if name == "expandtabs":
            size = args[0] if args else kwargs.get("tabsize", 8)
            return args, len(owner) + owner.count("\t") * (size if type(size) is int else 8)
        if name in ("format", "format_map"):
            if _FORMAT_WIDE.search(owner):
                raise RenderLimitError(f"the chat template formats with a width of 10,000 or more or one taken from "
                                       f"its arguments, toward {_LIMIT}")
            values = [*args, *kwargs.values()] + (list(args[0].values()) if name == "format_map" and args
                                                  and isinstance(args[0], dict) else [])
            widest = max((len(v) for v in values if isinstance(v, str)), default=64)
            return args, len(owner) + owner.count("{") * widest
        return args, None
    if getattr(function, "__name__", None) == "generate_lorem_ipsum":  # jinja's lipsum()
        n = args[0] if args else kwargs.get("n", 5)
        most = args[3] if len(args) > 3 else kwargs.get("max", 100)
        if type(n) is int and type(most) is int:
            return args, max(n, 0) * max(most, 1) * 16  # a word and its space are at most 16 characters
    return args, None


# a width or precision of 10,000 or more, or one taken from the arguments, in a str.format or a % format string
_FORMAT_WIDE = re.compile(r"\{[^{}]*:[^{}]*?(?:\d{5,}|\{)")
_PERCENT_WIDE = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\d{5,}|\*|\d*\.(?:\d{5,}|\*))")


def _budgeted_arguments(function: Any, args: tuple, kwargs: dict) -> tuple:
    """A call of the template: a step, an integer argument over ``MAX_RENDER_CHARS`` refused, what a builtin that
    grows its output would build charged; the arguments to call it with."""
    _over_time()
    _refuse_huge(args)
    if kwargs:
        _refuse_huge(list(kwargs.values()))
    args, size = _call_size(function, args, kwargs)
    if size is not None:
        _charge(size, f"the text {getattr(function, '__name__', 'a call')}() would build")
    return args


def _bounded_filter(function, name: str):
    """A filter of the template, held to the budget: ``join`` and ``replace`` charged before they build, a width or
    count over ``MAX_RENDER_CHARS`` refused, what it returns charged."""
    @functools.wraps(function)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args, **kwargs):
        _refuse_huge(args[1:])
        _refuse_huge(list(kwargs.values()))
        value = args[1] if name in _CONTEXT_FILTERS and len(args) > 1 else args[0]
        if name == "join":
            items = _listed(value)
            args = (args[0], items, *args[2:])
            separator = args[2] if len(args) > 2 else kwargs.get("d", "")
            if isinstance(separator, str) and len(args) < 4 and "attribute" not in kwargs:
                _charge(_joined_size(separator, items), "the text join would build")
        elif name == "replace" and isinstance(value, str) and len(args) >= 4:
            _charge(_replaced_size(value, args[2], args[3], args[4] if len(args) > 4 else kwargs.get("count")),
                    "the text replace would build")
        return _sized(function(*args, **kwargs))
    return bounded


_CONTEXT_FILTERS = frozenset({"join", "replace", "map", "select", "reject", "selectattr", "rejectattr", "sum",
                              "unique", "min", "max", "sort", "groupby", "attr", "xmlattr", "urlize", "indent",
                              "wordwrap", "truncate", "dictsort", "random", "tojson", "format"})
# filters that build nothing larger than what they are given, and that real templates use on every message: left as
# they are on the fast path (every other filter is held to the budget there too)
_PLAIN_FILTERS = frozenset({"trim", "length", "count", "first", "last", "default", "d", "safe", "lower", "int",
                            "float", "abs", "round", "items", "wordcount", "string", "reverse", "capitalize"})


def _ticks(iterable: Any) -> Any:
    """A loop's items, counted as steps (also when the loop writes nothing): a sized collection all at once, before
    the loop starts (then looped over as it is, at no cost per turn); anything else turn by turn, the clock checked
    every 256 turns."""
    try:
        turns = len(iterable)
    except TypeError:
        return _ticked(iterable)
    _over_time(turns)
    return iterable


def _ticked(iterable: Any):
    for k, item in enumerate(iterable):
        if not k & 255:
            _over_time(256)
        yield item


_SMALL_BUILD = 4096  # a string or list of at most this size, built by + or ~, is not charged (a cheap path)


def _charged_join(join: Any, parts: tuple) -> Any:
    """``~``: the parts' size charged before they are joined (when it is not small)."""
    size = _text_size(parts)
    if size > _SMALL_BUILD:
        _charge(size, "the text ~ would build")
    return join(parts)


def _plus(operands: tuple) -> Any:
    """A chain ``a + b + c ...``: strings joined at once, their size charged before (when it is not small); other
    values added one by one, each string or list charged before it is built."""
    if len(set(map(type, operands))) == 1 and type(operands[0]) is str:
        size = sum(map(len, operands))
        if size > _SMALL_BUILD:
            _charge(size, "the text + would build")
        return "".join(operands)
    total = operands[0]
    for operand in operands[1:]:
        if isinstance(total, (str, list, tuple)) and isinstance(operand, (str, list, tuple)):
            _charge(_weight(total) + _weight(operand), "the value + would build")
        total = total + operand
    return total


def _charged_concat(parts: Any) -> str:
    """The text a macro, a block ``{% set %}``, a filter block or a call block wrote, charged before it is joined
    (jinja joins every such buffer with ``environment.concat``)."""
    parts = list(parts)
    _charge(sum(map(len, parts)), "the text a block of the chat template writes")
    return "".join(parts)


@functools.lru_cache(maxsize=2)
def _environment_class(checked: bool):
    from jinja2 import Template, nodes
    from jinja2.compiler import CodeGenerator, optimizeconst
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedTemplate(Template):
        def render(self, *args, **kwargs):  # what transformers calls: held to the bounds like ours
            return render_bounded(self, **dict(*args, **kwargs))

    class Generator(CodeGenerator):
        @optimizeconst
        def visit_Add(self, node, frame):  # a chain of '+' through one call: charged when it builds much
            operands = [node.right]
            while isinstance(node.left, nodes.Add):
                node = node.left
                operands.append(node.right)
            operands.append(node.left)
            self.write("environment.plus((")
            for operand in reversed(operands):
                self.visit(operand, frame)
                self.write(", ")
            self.write("))")

        def visit_Concat(self, node, frame):  # '~' joins strings without a binop: charged before it joins
            self.write("environment.charged_join(str_join if not context.eval_ctx.autoescape else markup_join, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetedSandbox(ImmutableSandboxedEnvironment):
        """transformers' sandbox, held to the row's budget: every loop turn and call is a step, and whatever a call,
        filter or operator would build is charged before it builds."""
        code_generator_class = Generator
        template_class = BoundedTemplate
        intercepted_binops = frozenset({"*", "**", "%", "//"} if checked else {"*", "**", "%"})
        charged_join = staticmethod(_charged_join)
        plus = staticmethod(_plus)
        concat = staticmethod(_charged_concat)

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):  # every loop turn ticks the clock
                loop.iter = nodes.Filter(loop.iter, "lossmask_ticks", [], [], None, None)  # a plain call
            return tree

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            args = _budgeted_arguments(__obj, args, kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs))  # the sandbox's checks, its safe format

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and type(n) is int:
                        _charge(_weight(seq) * n, "the value * would build")
            if operator == "**" and type(left) is int and type(right) is int and abs(left) > 1 \
                    and right * abs(left).bit_length() > 8 * MAX_RENDER_CHARS:
                raise RenderLimitError(f"the chat template computes {left} ** {right}, a number over {_LIMIT}")
            if operator == "%" and isinstance(left, str) and _PERCENT_WIDE.search(left):
                raise RenderLimitError(f"the chat template formats with a width of 10,000 or more or one taken from "
                                       f"its arguments, toward {_LIMIT}")
            return _sized(super().call_binop(context, operator, left, right))

    BudgetedSandbox.__name__ = "BoundedSandbox" if checked else "FastSandbox"
    if not checked:
        BoundedTemplate.__name__ = "SizedTemplate"
    return BudgetedSandbox


@functools.lru_cache(maxsize=16)
def bounded_template(template: str) -> Any:
    """``template`` compiled as transformers compiles it, in a sandbox that keeps the budget above.

    A template that ``template_bounds.runaway_reason`` finds bounded by its input's size (every real template
    lossmask is tested on) leaves the filters that build nothing larger than they are given unwrapped
    (``_PLAIN_FILTERS``); any other has every filter wrapped. Both are held to the budget. A template whose loops
    over constant ranges alone make more than ``MAX_RENDER_STEPS`` turns is refused here, once, rather than run to
    the bound on every row."""
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
    """``template`` in a copy of transformers' sandbox (its filters, globals and extensions), held to the row's
    budget: with every filter held to it and ``//`` checked too (``checked``), or all but the filters that build
    nothing larger than they are given (``_PLAIN_FILTERS``)."""
    reference = _reference_environment()
    env = _environment_class(checked)(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                                      extensions=[type(e) for e in reference.extensions.values()])
    env.filters.update({name: f if name in _PLAIN_FILTERS and not checked else _bounded_filter(f, name)
                        for name, f in reference.filters.items()})
    env.globals.update(reference.globals)
    env.filters["lossmask_ticks"] = _ticks
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
    """Render a ``bounded_template`` within the row's budget: ``MAX_RENDER_SECONDS``, ``MAX_RENDER_STEPS``,
    ``MAX_RENDER_BUILT``, and ``MAX_RENDER_CHARS`` for the text, measured before it is joined (the parts are the
    template's text and values already charged, held by reference)."""
    token = _BUDGET.set(_Budget())
    try:
        context = template.new_context(variables)
        try:
            parts = list(template.root_render_func(context))
        except Exception:  # noqa: BLE001 - jinja's own handling: the error's traceback points into the template
            template.environment.handle_exception()
        size = sum(map(len, parts))
        if size > MAX_RENDER_CHARS:
            raise RenderLimitError(f"rendered text of {size:,} characters, over {_LIMIT}")
        return "".join(parts)
    finally:
        _BUDGET.reset(token)


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
    """The compiled template of one ``ChatTokenizer``, with the variables ``apply_chat_template`` passes it.

    Rows with tools render through it too, with the tools as ``apply_chat_template`` gives them to the template
    (transformers' ``_plain_template_data`` of the list, each tool a dict), once chats with tools are proved equal
    to ``apply_chat_template`` in the job, as chats without are (each kind proved on its own first rows)."""

    def __init__(self, ct: Any):
        self.ct = ct
        self.reason: str | None = None  # why the job renders through apply_chat_template instead
        self._proved: set[Any] = set()  # (compiled template, with tools) proved in this job
        self._tools: tuple[Any, Any] = (None, None)  # the last tools given, and their plain copy
        try:
            from transformers.utils.chat_template_utils import (
                _alias_reasoning_fields, _plain_template_data,
            )
        except ImportError as exc:
            self.reason = f"this transformers renders otherwise ({exc})"
            return
        self._compile, self._alias, self._plain = bounded_template, _alias_reasoning_fields, _plain_template_data
        special = _plain_template_data(dict(getattr(ct.tokenizer, "special_tokens_map", {}) or {}))
        self._variables = {**special, **_plain_template_data(dict(ct.template_kwargs))}

    def begin_job(self) -> None:
        self._proved.clear()

    def render(self, chats: Sequence[Any]) -> tuple[list[str | None], list[tuple[int, str]]]:
        """Like ``encode_batch.render_chats`` for chats of plain JSON values (a list of messages, or ``{messages, tools}``)."""
        texts: list[str | None] = [None] * len(chats)
        errors: list[tuple[int, str]] = []
        proved: dict[int, str] = {}  # the chats the proofs rendered, by their index: not rendered again
        if self.reason is None:
            proved = self._prove(self._compile(self.ct.template_for()), False, chats)
            if any(isinstance(chat, dict) and chat.get("tools") for chat in chats):
                try:
                    proved.update(self._prove(self._compile(self.ct.template_for(tools=True)), True, chats))
                except ChatTemplateError:  # no template for chats with tools: each row says so below
                    pass
        for i, chat in enumerate(chats):
            if i in proved and self.reason is None:
                texts[i] = proved[i]
                continue
            messages, tools = (chat["messages"], chat.get("tools")) if isinstance(chat, dict) else (chat, None)
            compiled = self._proved_for(messages, tools)
            if compiled is not None:
                try:
                    texts[i] = self._render(compiled, messages, tools)
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
        this job proved it equal to ``apply_chat_template`` (for chats with tools, or without, as this one is), else
        through ``ChatTokenizer.render``. Raises ``ChatTemplateError`` as ``render`` does (an empty conversation
        included: the compiled template would render one where ``render`` refuses it)."""
        compiled = self._proved_for(messages, tools) if messages else None
        if compiled is not None:
            try:
                return self._render(compiled, messages, tools, add_generation_prompt)
            except Exception:  # noqa: BLE001 - rendered again below, for the error users see elsewhere
                pass
        return self.ct.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def _proved_for(self, messages: Any, tools: Any) -> Any:
        """The compiled template that renders this chat as ``apply_chat_template`` would, where this job proved it for
        chats of its kind (with tools or without) and the chat is plain: each message a dict, each tool a dict (not a
        function to describe); else None."""
        if self.reason is not None or not all(type(m) is dict for m in messages):
            return None
        if tools and not (type(tools) in (list, tuple) and all(type(t) is dict for t in tools)):
            return None
        try:
            compiled = self._compile(self.ct.template_for(tools=tools))
        except ChatTemplateError:
            return None
        return compiled if (compiled, bool(tools)) in self._proved else None

    def _render(self, compiled: Any, messages: list, tools: Any = None, add_generation_prompt: bool = False) -> str:
        if self.ct.renders_parts_only:
            messages = text_parts(messages)
        return render_bounded(compiled, messages=self._alias(messages), tools=self._plain_tools(tools), documents=None,
                              add_generation_prompt=add_generation_prompt, **self._variables)

    def _plain_tools(self, tools: Any) -> Any:
        """The tools as ``apply_chat_template`` gives them to the template (None for none); the copy of the last tools
        given is kept, for a row's many renders with the same list."""
        if not tools:
            return None
        given, plain = self._tools  # (read once: the labelling thread renders beside the rendering one)
        if given is not tools:
            plain = self._plain(list(tools))
            self._tools = (tools, plain)
        return plain

    def _prove(self, compiled: Any, with_tools: bool, chats: Sequence[Any]) -> dict[int, str]:
        """Prove ``compiled`` on the first ``PROOF_ROWS`` chats of its kind (with tools or without), unless this job
        has: each rendered by it and by ``apply_chat_template``. Returns the texts of the chats it rendered, where both
        agree on every one (by the chat's index), else nothing (and ``reason`` says why)."""
        if (compiled, with_tools) in self._proved:
            return {}
        tried, texts = 0, {}
        for k, chat in enumerate(chats[:PROOF_ROWS]):
            messages, tools = (chat.get("messages"), chat.get("tools")) if isinstance(chat, dict) else (chat, None)
            if bool(tools) != with_tools or not isinstance(messages, list) or not messages:
                continue
            if with_tools and not (isinstance(tools, list) and all(type(t) is dict for t in tools)):
                continue
            if not all(type(m) is dict for m in messages):
                continue
            try:  # ours first: a row over the bounds is never rendered unbounded
                ours = self._render(compiled, messages, tools)
            except RenderLimitError:
                continue
            except Exception as exc:  # noqa: BLE001
                ours = f"<raised {exc}>"
            try:
                reference = self.ct.render(messages, tools=tools)
            except Exception:  # noqa: BLE001 - a rejected row proves nothing
                continue
            tried += 1
            texts[k] = ours
            if ours != reference:
                at = next((j for j, (a, b) in enumerate(zip(ours, reference)) if a != b), min(len(ours), len(reference)))
                self.reason = (f"rendering the template directly differs from apply_chat_template on chat {k} of the "
                               f"job's first batch{' (with tools)' if with_tools else ''}, at character {at} "
                               f"({reference[at:at + 40]!r}); this job renders through apply_chat_template")
                warnings.warn(self.reason, stacklevel=3)
                return {}
        if tried:
            self._proved.add((compiled, with_tools))
        return texts
