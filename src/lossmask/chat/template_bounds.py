"""Whether a chat template's work is bounded by the size of the chat it renders: checked once per template.

Every render runs under ``render``'s budget (steps, characters built, time), which is the bound. This module
only picks the cheaper of its two sandboxes: it reads the template's parsed nodes (jinja2's AST) once and
says whether the template is of the kind real templates are (they walk ``messages``, ``tools`` and the parts
of those, test and print). When ``runaway_reason`` returns None, the filters that build nothing larger than
they are given stay unwrapped; otherwise every filter is held to the budget. A template that can run away
may pass this reading (a self-call on a part of an argument twice, a value doubled through a temporary): the
budget stops it all the same.

A template passes when nothing in it makes much from little:

- ``range`` gets small constants (at most ``SMALL``) or a length (``x | length``, ``loop.length``) plus or
  minus a constant; loops over small constant ranges nested in each other make at most ``SMALL`` turns;
- ``*`` has a small constant on one side (``'-' * 80``), ``**`` only constants; a ``%`` or ``format``
  string is a constant with no large width; filters and methods that take a width or a count (``center``,
  ``indent``, ``truncate``, ``wordwrap``, ``batch``, ``slice``, ``ljust``, ``zfill``...) get small constants;
- no value is built from itself twice in one step (``{% set ns.s = ns.s ~ ns.s %}`` doubles it per turn);
- loops nest at most ``MAX_NESTED_WALKS`` deep over collections that are not a part of an enclosing loop's
  item (a loop over a message's tool calls inside the loop over messages walks the input once; a loop over
  ``messages`` inside it walks it again for each message);
- a macro calls itself (directly or through others) only on a part of one of its arguments (structural
  recursion over a JSON tree, as gpt-oss's rendering of a tool's parameter schema does); no ``recursive``
  loop, include, import, ``extends`` or call block other than transformers' ``generation`` tag;
- every call is a macro of the template, one of transformers' globals (``namespace``, ``raise_exception``,
  ``strftime_now``, ``dict``), ``range`` as above, or a method from ``SAFE_METHODS``; every filter is one
  of ``SAFE_FILTERS`` (or takes small constants, above).

Such a template does work polynomial in the chat's size, of a degree set by its loop nesting, unless it
uses one of the ways round this reading named above; any other template gets the sandbox with every filter
wrapped.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Iterable

SMALL = 10_000  # the largest constant a range, a repeat or a width may take on the fast path
MAX_NESTED_WALKS = 2  # loops over collections of their own, one inside another

SAFE_FILTERS = frozenset({
    "abs", "attr", "capitalize", "count", "d", "default", "dictsort", "e", "escape", "first", "float",
    "forceescape", "groupby", "int", "items", "join", "last", "length", "list", "lower", "map", "max", "min",
    "reject", "rejectattr", "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string",
    "striptags", "sum", "title", "tojson", "trim", "unique", "upper", "wordcount", "xmlattr",
})
SIZED_FILTERS = frozenset({"center", "indent", "truncate", "wordwrap", "batch", "slice", "format"})
SAFE_METHODS = frozenset({
    "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "startswith", "endswith", "lower", "upper",
    "title", "capitalize", "replace", "find", "rfind", "index", "rindex", "count", "items", "keys", "values", "get",
    "isdigit", "isalpha", "isspace", "isnumeric", "isalnum", "islower", "isupper", "partition", "rpartition",
    "removeprefix", "removesuffix", "casefold", "swapcase", "copy",
})
SIZED_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs", "format", "join"})
SAFE_GLOBALS = frozenset({"namespace", "raise_exception", "strftime_now", "dict", "joiner", "cycler"})
_WIDE = re.compile(r"\d{5,}")  # a width of 10,000 or more in a format string


class _Unbounded(Exception):
    """Why the template is not of the bounded kind (the first reason found)."""


@functools.lru_cache(maxsize=8)
def _parsed(template: str, environment: Any) -> Any:
    """``environment.parse(template)``, once for both checks below (they only read the tree): lexing a large
    template (DeepSeek-V3's) is most of what they cost."""
    return environment.parse(template)


@functools.lru_cache(maxsize=64)
def runaway_reason(template: str, environment: Any) -> str | None:
    """None when ``template`` (parsed by ``environment``, with its extensions) cannot run away; else why it might."""
    try:
        tree = _parsed(template, environment)
    except Exception:  # noqa: BLE001 - a template that does not parse is left to the renderer to refuse
        return "it does not parse"
    try:
        _Walk(tree).check()
    except _Unbounded as why:
        return str(why)
    return None


@functools.lru_cache(maxsize=64)
def constant_turns(template: str, environment: Any) -> tuple[int, str]:
    """The most loop turns that nested loops over constant ranges make, whatever the chat, and where (0 when none)."""
    from jinja2 import nodes

    try:
        tree = _parsed(template, environment)
    except Exception:  # noqa: BLE001
        return 0, ""
    best = (0, "")

    def walk(node: Any, turns: int, where: str) -> None:
        nonlocal best
        for child in node.iter_child_nodes():
            inner, at = turns, where
            if isinstance(child, nodes.For) and isinstance(child.iter, nodes.Call) \
                    and isinstance(child.iter.node, nodes.Name) and child.iter.node.name == "range":
                constants = [_const_int(arg) for arg in child.iter.args]
                if constants and all(c is not None for c in constants):
                    start, stop = (0, constants[0]) if len(constants) == 1 else (constants[0], constants[1])
                    step = constants[2] if len(constants) > 2 and constants[2] else 1
                    inner = turns * max(1, len(range(start, stop, step)))
                    at = f"range({', '.join(map(str, constants))}) (line {child.lineno})" + (f" in {where}" if where else "")
                    if inner > best[0]:
                        best = (inner, at)
            walk(child, inner, at)

    walk(tree, 1, "")
    return best


def _const_int(node: Any) -> int | None:
    from jinja2 import nodes

    if isinstance(node, nodes.Const) and type(node.value) is int:
        return node.value
    if isinstance(node, nodes.Neg) and isinstance(node.node, nodes.Const) and type(node.node.value) is int:
        return -node.node.value
    return None


def _small(node: Any) -> bool:
    value = _const_int(node)
    if value is not None:
        return abs(value) <= SMALL
    from jinja2 import nodes

    return isinstance(node, nodes.Const) and isinstance(node.value, (float, bool, type(None))) \
        and (not isinstance(node.value, float) or abs(node.value) <= SMALL)


def _a_length(node: Any) -> bool:
    """``x | length`` (or ``count``), ``loop.length`` / ``loop.index``..., that plus or minus a small constant."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter) and node.name in ("length", "count") and not node.args:
        return True
    if isinstance(node, nodes.Getattr) and isinstance(node.node, nodes.Name) and node.node.name == "loop":
        return node.attr in ("length", "index", "index0", "revindex", "revindex0")
    if isinstance(node, (nodes.Add, nodes.Sub)):
        return (_a_length(node.left) and (_small(node.right) or _a_length(node.right))) or \
            (_a_length(node.right) and _small(node.left))
    return False


def _names(node: Any) -> Iterable[str]:
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        yield node.name
    for name in node.find_all(nodes.Name):
        yield name.name


def _target_key(node: Any) -> str | None:
    from jinja2 import nodes

    if isinstance(node, nodes.Name):
        return node.name
    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    return None


def _mentions(node: Any, key: str) -> int:
    from jinja2 import nodes

    if "." in key:
        name, attr = key.split(".", 1)
        return sum(1 for g in node.find_all(nodes.Getattr)
                   if g.attr == attr and isinstance(g.node, nodes.Name) and g.node.name == name)
    return sum(1 for name in _names(node) if name == key)


class _Walk:
    def __init__(self, tree: Any):
        from jinja2 import nodes

        self.nodes = nodes
        self.tree = tree
        self.macros = {m.name: m for m in tree.find_all(nodes.Macro)}

    def check(self) -> None:
        self._body(self.tree.body, walks=0, ranges=1, parts=frozenset())
        self._recursion()

    # -- statements ---------------------------------------------------------------------------------

    def _body(self, body: list, *, walks: int, ranges: int, parts: frozenset) -> None:
        for node in body:
            self._statement(node, walks=walks, ranges=ranges, parts=parts)
            if isinstance(node, self.nodes.Assign) and isinstance(node.target, self.nodes.Name) \
                    and set(_names(node.node)) & parts:  # {% set args = call.arguments %}: a part too
                parts = parts | {node.target.name}

    def _statement(self, node: Any, *, walks: int, ranges: int, parts: frozenset) -> None:
        n = self.nodes
        if isinstance(node, n.For):
            self._for(node, walks=walks, ranges=ranges, parts=parts)
        elif isinstance(node, n.Macro):
            params = frozenset(arg.name for arg in node.args)
            for default in node.defaults:
                self._expr(default)
            self._body(node.body, walks=1, ranges=1, parts=params)  # as if called inside a loop
        elif isinstance(node, n.CallBlock):
            if not isinstance(node.call.node, n.ExtensionAttribute):  # transformers' {% generation %} tag
                raise _Unbounded("it uses a call block")
            self._body(node.body, walks=walks, ranges=ranges, parts=parts)
        elif isinstance(node, (n.Include, n.Import, n.FromImport, n.Extends)):
            raise _Unbounded(f"it uses {type(node).__name__.lower()}")
        elif isinstance(node, (n.Assign, n.AssignBlock)):
            key = _target_key(node.target)
            value = node.node if isinstance(node, n.Assign) else None
            if value is not None:
                if key is not None and _mentions(value, key) > 1:
                    raise _Unbounded(f"it builds {key} from itself twice in one step (line {node.lineno})")
                self._expr(value)
            else:
                for f in [node.filter] if node.filter is not None else []:
                    self._expr(f)
                self._body(node.body, walks=walks, ranges=ranges, parts=parts)
        else:
            for field in node.fields:
                value = getattr(node, field)
                children = value if isinstance(value, list) else [value]
                if children and all(isinstance(child, n.Stmt) for child in children):  # a body: in order
                    self._body(children, walks=walks, ranges=ranges, parts=parts)
                    continue
                for child in children:
                    if isinstance(child, n.Expr):
                        self._expr(child)
                    elif isinstance(child, n.Node):  # a statement, Keyword, Pair, Operand...
                        self._statement(child, walks=walks, ranges=ranges, parts=parts)

    def _for(self, node: Any, *, walks: int, ranges: int, parts: frozenset) -> None:
        n = self.nodes
        if node.recursive:
            raise _Unbounded(f"it has a recursive loop (line {node.lineno})")
        self._expr(node.iter)
        if node.test is not None:
            self._expr(node.test)
        it = node.iter
        if isinstance(it, n.Call) and isinstance(it.node, n.Name) and it.node.name == "range":
            constants = [_const_int(arg) for arg in it.args]
            if all(c is not None for c in constants):
                start, stop = (0, constants[0]) if len(constants) == 1 else (constants[0], constants[1])
                ranges *= max(1, stop - start)
                if ranges > SMALL:
                    raise _Unbounded(f"its loops over constant ranges make {ranges:,} turns (line {node.lineno})")
            else:
                walks += 1
        elif not (set(_names(it)) & parts):  # a collection of its own, not a part of an enclosing item
            walks += 1
        if walks > MAX_NESTED_WALKS:
            raise _Unbounded(f"it nests {walks} loops over collections of their own (line {node.lineno})")
        inner = parts | frozenset(_names(node.target))
        self._body(node.body, walks=walks, ranges=ranges, parts=inner)
        self._body(node.else_, walks=walks, ranges=ranges, parts=parts)

    # -- expressions --------------------------------------------------------------------------------

    def _expr(self, node: Any) -> None:
        n = self.nodes
        if isinstance(node, n.Call):
            self._call(node)
        elif isinstance(node, n.Filter):
            self._filter(node)
        elif isinstance(node, n.Mul):
            if not (_small(node.left) or _small(node.right)) or isinstance(node.left, (n.Mul, n.Pow)) \
                    or isinstance(node.right, (n.Mul, n.Pow)):
                raise _Unbounded(f"it repeats a value by a number that is not a small constant (line {node.lineno})")
        elif isinstance(node, n.Pow):
            if not (_small(node.left) and _small(node.right)):
                raise _Unbounded(f"it raises to a power that is not constant (line {node.lineno})")
        elif isinstance(node, n.Mod):
            self._format_string(node.left, node.lineno)
        for child in node.iter_child_nodes():
            if isinstance(child, n.Expr):
                self._expr(child)
            else:
                for grandchild in child.iter_child_nodes():
                    self._expr(grandchild)

    def _format_string(self, node: Any, lineno: int) -> None:
        n = self.nodes
        if isinstance(node, n.Const) and isinstance(node.value, str):
            if _WIDE.search(node.value):
                raise _Unbounded(f"a format string has a large width (line {lineno})")
            return
        if isinstance(node, n.Const):  # a number: % is arithmetic
            return
        if isinstance(node, (n.Name, n.Getattr, n.Getitem, n.Filter, n.Call)):  # a number at run time, or data
            return  # a format made of data has its widths in data: the sandbox's % is data-sized, like the text
        raise _Unbounded(f"it formats with a string built at render time (line {lineno})")

    def _call(self, node: Any) -> None:
        n = self.nodes
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise _Unbounded(f"it calls with *args or **kwargs (line {node.lineno})")
        callee = node.node
        arguments = list(node.args) + [k.value for k in node.kwargs]
        if isinstance(callee, n.Name):
            if callee.name == "range":
                if not all(_small(a) or _a_length(a) for a in arguments):
                    raise _Unbounded(f"it calls range with a bound that is not small or a length (line {node.lineno})")
                return
            if callee.name in self.macros or callee.name in SAFE_GLOBALS or callee.name == "loop":
                if callee.name == "loop":
                    raise _Unbounded(f"it calls loop() (line {node.lineno})")
                return
            raise _Unbounded(f"it calls {callee.name} (line {node.lineno})")
        if isinstance(callee, n.Getattr):
            if callee.attr in SAFE_METHODS:
                return
            if callee.attr in SIZED_METHODS:
                if callee.attr == "format":
                    self._format_string(callee.node, node.lineno)
                    return
                if callee.attr == "join" or all(_small(a) for a in arguments):
                    return
            raise _Unbounded(f"it calls the method {callee.attr} (line {node.lineno})")
        if isinstance(callee, n.ExtensionAttribute):
            return
        raise _Unbounded(f"it calls a computed value (line {node.lineno})")

    def _filter(self, node: Any) -> None:
        if node.dyn_args is not None or node.dyn_kwargs is not None:
            raise _Unbounded(f"it passes *args or **kwargs to a filter (line {node.lineno})")
        arguments = list(node.args) + [k.value for k in node.kwargs]
        if node.name in SAFE_FILTERS:
            if node.name == "tojson" and not all(_small(a) or isinstance(a, self.nodes.Const) for a in arguments):
                raise _Unbounded(f"tojson takes an indent that is not a constant (line {node.lineno})")
            return
        if node.name in SIZED_FILTERS:
            if node.name == "format" and node.node is not None:
                self._format_string(node.node, node.lineno)
                return
            if all(_small(a) or (isinstance(a, self.nodes.Const) and isinstance(a.value, str)) for a in arguments):
                return
            raise _Unbounded(f"the filter {node.name} takes a size that is not a small constant (line {node.lineno})")
        raise _Unbounded(f"it uses the filter {node.name} (line {node.lineno})")

    # -- recursion ----------------------------------------------------------------------------------

    def _recursion(self) -> None:
        n = self.nodes
        calls = {name: {c.node.name for c in m.find_all(n.Call)
                        if isinstance(c.node, n.Name) and c.node.name in self.macros}
                 for name, m in self.macros.items()}
        for name, macro in self.macros.items():
            reach, todo = set(), list(calls[name])
            while todo:
                other = todo.pop()
                if other not in reach:
                    reach.add(other)
                    todo.extend(calls[other])
            if name not in reach:
                continue
            params = [arg.name for arg in macro.args]
            for call in macro.find_all(n.Call):
                if isinstance(call.node, n.Name) and call.node.name in reach and call.node.name in self.macros:
                    if not any(self._part_of(arg, params, macro) for arg in list(call.args)
                               + [k.value for k in call.kwargs]):
                        raise _Unbounded(f"the macro {name} calls {call.node.name} again on no part of its "
                                         f"arguments (line {call.lineno})")

    def _part_of(self, node: Any, params: list[str], macro: Any) -> bool:
        """A proper part of a parameter: an item, attribute or loop item taken from it (never the parameter itself)."""
        n = self.nodes
        items = set()  # loop targets over a parameter (or over a part of one)
        for loop in macro.find_all(n.For):
            if set(_names(loop.iter)) & (set(params) | items):
                items |= set(_names(loop.target))
        if isinstance(node, n.Name):
            return node.name in items
        if isinstance(node, (n.Getattr, n.Getitem)):
            inner = node.node
            while isinstance(inner, (n.Getattr, n.Getitem, n.Filter)):
                inner = inner.node
            return isinstance(inner, n.Name) and (inner.name in params or inner.name in items)
        return False
