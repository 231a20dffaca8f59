"""The template table: marker strings per chat-template family, and model names that pick a family.

The table is data (``data/templates.json``), read once. It is the fallback of the policy
(``policy.resolve_markers``) when detection from the chat template fails:

* ``match_template(name)`` finds the family of a model name. Names are normalised first
  (``normalise_model_name``): lowercase, the organisation or folder prefix dropped, and the rest split
  into words at every separator and at every change between letters and digits (for a path, the
  component that names the model: commit hashes, ``snapshots`` and ``checkpoint-N`` are skipped, and
  a Hugging Face cache folder ``models--org--name`` gives ``name``), so that
  ``Qwen/Qwen2.5-7B-Instruct``, ``my-qwen2.5-7b-instruct-lora`` and ``qwen2_5`` all read
  ``qwen 2 5 ...``. A pattern matches when its words occur in the name in order (each ``*``-separated
  group contiguous), so suffixes such as ``-sft``, ``-lora``, ``-instruct``, ``-it``, ``-gguf``, sizes
  and dates are tolerated. The pattern with the most words wins (``qwen3`` over ``qwen``,
  ``llama-3.1`` over ``llama-3``); on a tie, the one that starts earlier in the name.
* ``table_markers(tokenizer, template)`` turns an entry's strings into token patterns with
  ``markers_from_strings``, which finds the text inside rendered probe conversations; the strings are
  never tokenised on their own. The policy then verifies them like detected markers.

This module imports no heavy library: the tokenizer work happens in ``detect.py`` when it is called.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from ..engine.patterns import KINDS, Markers

_WORD = re.compile(r"[a-z]+|[0-9]+")


@dataclass(frozen=True)
class TemplateEntry:
    """Marker strings of one chat-template family, as they appear in its rendered text."""

    name: str
    response: tuple[str, ...]
    instruction: tuple[str, ...] = ()
    end: tuple[str, ...] = ()
    mask_out: tuple[str, ...] = ()
    note: str = ""

    def strings(self) -> dict[str, tuple[str, ...]]:
        """``{kind: strings}`` for the four marker kinds, as ``markers_from_strings`` takes them."""
        return {kind: getattr(self, kind) for kind in KINDS}


@dataclass(frozen=True)
class ModelPattern:
    """A model-name pattern: ``groups`` of words that must occur in order; ``template`` None means 'known, unsupported'."""

    pattern: str
    groups: tuple[tuple[str, ...], ...]
    template: str | None

    @property
    def words(self) -> int:
        return sum(len(g) for g in self.groups)


@dataclass(frozen=True)
class TemplateMatch:
    """Which pattern a model name matched, and the family it picks (None: the table cannot serve it)."""

    model_name: str
    pattern: str
    template: str | None
    entry: TemplateEntry | None


@dataclass(frozen=True)
class TemplateTable:
    """The loaded table: ``templates`` by name, and the model-name ``patterns``."""

    templates: dict[str, TemplateEntry]
    patterns: tuple[ModelPattern, ...]

    def match(self, model_name: str) -> TemplateMatch | None:
        """The most specific pattern that ``model_name`` matches, or None when none does."""
        if not isinstance(model_name, str):
            raise TypeError(f"model_name must be a string such as 'Qwen/Qwen2.5-7B-Instruct', got {type(model_name).__name__}")
        words = normalise_model_name(model_name)
        best: tuple[int, int, int] | None = None
        chosen: ModelPattern | None = None
        for order, pattern in enumerate(self.patterns):
            at = _find_groups(words, pattern.groups)
            if at is None:
                continue
            rank = (-pattern.words, at, order)
            if best is None or rank < best:
                best, chosen = rank, pattern
        if chosen is None:
            return None
        entry = self.templates[chosen.template] if chosen.template is not None else None
        return TemplateMatch(model_name, chosen.pattern, chosen.template, entry)

    def entry(self, template: str) -> TemplateEntry:
        """The entry named ``template``; a ``KeyError`` that lists the known names otherwise."""
        try:
            return self.templates[template]
        except KeyError:
            raise KeyError(f"no template {template!r} in the table; known templates: {sorted(self.templates)}") from None


def normalise_model_name(name: str) -> tuple[str, ...]:
    """The words of a model name: lowercase, prefix dropped, split at separators and letter/digit changes.

    >>> normalise_model_name("Qwen/Qwen2.5-7B-Instruct")
    ('qwen', '2', '5', '7', 'b', 'instruct')
    >>> normalise_model_name("/models/org--gpt_oss-20b-SFT")
    ('org', 'gpt', 'oss', '20', 'b', 'sft')
    >>> normalise_model_name("~/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/9c925d6")
    ('qwen', '3', '8', 'b')
    >>> normalise_model_name("runs/llama-3.1-8b-sft/checkpoint-500")
    ('llama', '3', '1', '8', 'b', 'sft')
    """
    return tuple(_WORD.findall(_model_component(name).lower()))


_SKIPPED_COMPONENT = re.compile(r"[0-9a-f]{7,64}|snapshots|checkpoint[-_]?\d+|step[-_]?\d+", re.IGNORECASE)


def _model_component(name: str) -> str:
    """The path component that names the model: the last one, skipping commit hashes, ``snapshots`` and
    ``checkpoint-N`` folders; a Hugging Face cache folder ``models--org--name`` gives ``name``."""
    components = [c for c in re.split(r"[\\/]", name.strip()) if c]
    for component in reversed(components):
        if component.startswith("models--"):
            return component.rsplit("--", 1)[-1]
        if not _SKIPPED_COMPONENT.fullmatch(component):
            return component
    return components[-1] if components else ""


def _find_groups(words: tuple[str, ...], groups: tuple[tuple[str, ...], ...]) -> int | None:
    """Where the first group starts when every group occurs contiguously, in order; None otherwise."""
    position, first = 0, None
    for group in groups:
        n = len(group)
        at = next((i for i in range(position, len(words) - n + 1) if words[i : i + n] == group), None)
        if at is None:
            return None
        if first is None:
            first = at
        position = at + n
    return first


def _strings(entry: dict, kind: str, template: str) -> tuple[str, ...]:
    value = entry.get(kind, [])
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"template table: {template}.{kind} must be a list of non-empty strings, got {value!r}")
    return tuple(value)


def parse_table(data: dict) -> TemplateTable:
    """Check and load the table's JSON object (``{"templates": {...}, "models": [...]}``)."""
    templates: dict[str, TemplateEntry] = {}
    for name, entry in data.get("templates", {}).items():
        unknown = set(entry) - set(KINDS) - {"note"}
        if unknown:
            raise ValueError(f"template table: {name} has unknown keys {sorted(unknown)}; expected {list(KINDS)} and 'note'")
        response = _strings(entry, "response", name)
        if not response:
            raise ValueError(f"template table: {name} needs at least one response string")
        templates[name] = TemplateEntry(
            name, response, _strings(entry, "instruction", name), _strings(entry, "end", name),
            _strings(entry, "mask_out", name), str(entry.get("note", "")),
        )
    patterns = []
    for row in data.get("models", []):
        pattern, template = row.get("pattern"), row.get("template")
        if template is not None and template not in templates:
            raise ValueError(f"template table: pattern {pattern!r} names the unknown template {template!r}")
        groups = tuple(g for g in (tuple(_WORD.findall(part.lower())) for part in str(pattern).split("*")) if g)
        if not groups:
            raise ValueError(f"template table: pattern {pattern!r} holds no words")
        patterns.append(ModelPattern(str(pattern), groups, template))
    return TemplateTable(templates, tuple(patterns))


@lru_cache(maxsize=1)
def load_table() -> TemplateTable:
    """The table shipped with lossmask (``lossmask/data/templates.json``), read once."""
    text = resources.files("lossmask").joinpath("data/templates.json").read_text(encoding="utf-8")
    return parse_table(json.loads(text))


def match_template(model_name: str) -> TemplateMatch | None:
    """The table's family for ``model_name`` (see the module notes), or None when no pattern matches."""
    return load_table().match(model_name)


def table_markers(tokenizer: Any, template: str | TemplateEntry) -> Markers:
    """Token patterns for a table entry, located in probes rendered with ``tokenizer``'s own template.

    Raises ``MarkerDetectionError`` when a string never occurs in the rendered probes. The markers
    are not verified here; ``resolve_markers`` verifies them before use.
    """
    from .detect import markers_from_strings

    entry = template if isinstance(template, TemplateEntry) else load_table().entry(template)
    return markers_from_strings(tokenizer, **entry.strings())


def table_markdown(table: TemplateTable | None = None) -> str:
    """The table as Markdown (docs/template-table.md is this, kept current by a test)."""
    table = table or load_table()

    def cell(strings: tuple[str, ...]) -> str:
        return "<br>".join("`" + json.dumps(s, ensure_ascii=False)[1:-1].replace("|", "\\|") + "`" for s in strings) or "–"

    by_template: dict[str | None, list[str]] = {}
    for pattern in table.patterns:
        by_template.setdefault(pattern.template, []).append(f"`{pattern.pattern}`")
    lines = [
        "# The template table",
        "",
        "Generated from `src/lossmask/data/templates.json` by `lossmask.markers.templates.table_markdown()`; do not edit by hand.",
        "",
        "The table is the fallback of `lossmask.resolve_markers` when detection from the chat template fails.",
        "Marker strings become token ids only by being found inside a conversation rendered with the",
        "tokenizer's own chat template (`markers_from_strings`), and an entry is used only when `lossmask.verify`",
        "finds it exact. Every entry below verifies exactly on the shared tokenizer of its family",
        "(`tests/test_templates.py`).",
        "",
        "Model names are matched after normalisation: lowercase, organisation or folder prefix dropped, words",
        "split at separators and at letter/digit changes. A pattern matches when its words occur in order",
        "(`*` allows words between groups); the pattern with the most words wins, then the one that starts first.",
        "",
        "| template | response | instruction | end | model-name patterns | note |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in table.templates.items():
        patterns = ", ".join(by_template.get(name, [])) or "–"
        note = entry.note.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        lines.append(f"| `{name}` | {cell(entry.response)} | {cell(entry.instruction)} | {cell(entry.end)} | {patterns} | {note} |")
    unserved = by_template.get(None, [])
    if unserved:
        lines += ["", "Known families the table does not serve (so that a looser pattern does not claim them): "
                  + ", ".join(unserved) + "."]
    return "\n".join(lines) + "\n"
