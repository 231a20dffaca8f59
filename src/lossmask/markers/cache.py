"""Resolved markers kept on disk, so that a job on a tokenizer seen before skips detection (~0.8 s).

The key is a SHA-256 of everything the resolution depends on: the tokenizer as it is serialised
(``tokenizer.json``, added tokens included), what resolution reads off the tokenizer object instead
(``object_facts``: Unsloth Studio's marker strings, the special tokens, the table family of its name), the
chat template(s), template name and kwargs, the
arguments of ``resolve_markers`` (model name, strict, user strings), the versions of ``transformers``
and ``tokenizers`` (they render and tokenise the probes) and the bytes of lossmask's own detection
code and template table, so a change to any of them is a miss, never a stale answer. What is stored is
the outcome (markers, source, messages, reason, table entry) and the warnings resolution emitted, which
a hit emits again. Only successful resolutions are stored; errors are recomputed each time.

Where: ``$LOSSMASK_CACHE_DIR``, else ``$XDG_CACHE_HOME/lossmask``, else ``~/.cache/lossmask``
(``markers/<key>.json``). ``LOSSMASK_CACHE=0`` turns the cache off; an unreadable or unwritable cache is
ignored (the markers are resolved as without it).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

from ..chat.turn_spans import FromRendering
from ..engine.patterns import Markers

# The code a resolution depends on, relative to the package: a change to any of them is a new key.
CODE_FILES = ("markers/detect.py", "markers/verify.py", "markers/content.py", "markers/policy.py", "markers/templates.py",
              "engine/patterns.py", "chat/tokenizer.py", "chat/probes.py", "chat/locate.py", "data/templates.json")
FORMAT = 2  # 2: the tokenizer's name stored as a placeholder


def cache_dir() -> Path | None:
    """The folder of the marker cache, or None when ``LOSSMASK_CACHE=0``."""
    if os.environ.get("LOSSMASK_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    root = os.environ.get("LOSSMASK_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "lossmask")
    return Path(root) / "markers"


def resolve_cached(ct: Any, resolve: Callable[[], Any], **arguments: Any):
    """``resolve()`` (a ``policy.Resolution``), or the stored outcome of the same resolution.

    ``ct`` is the job's ``ChatTokenizer``; ``arguments`` are the other inputs of the resolution
    (model name, strict, user strings), part of the key.
    """
    from .policy import Resolution

    folder = cache_dir()
    if folder is None:
        return resolve()
    try:
        path = folder / f"{cache_key(ct, arguments)}.json"
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be serialised: no cache
        return resolve()
    # the same tokenizer may sit in another folder: its name in the messages is the current job's
    name = str(getattr(ct, "name", "") or "")

    def own(text):
        return text.replace(_NAME, name) if name and text else text

    def general(text):
        return text.replace(name, _NAME) if name and text else text

    stored = _read(path)
    if stored is not None:
        for category, message in stored["warnings"]:
            warnings.warn(own(message), _category(category), stacklevel=3)
        markers = None if stored["markers"] is None else FromRendering() if stored["markers"] == FromRendering().to_dict() \
            else Markers.from_dict(stored["markers"])
        messages = tuple(own(m) for m in stored["messages"])
        return Resolution(markers, stored["source"], messages, own(stored["reason"]), stored["template"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolution = resolve()
    for w in caught:  # emitted again, as they were
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _write(path, {
        "format": FORMAT,
        "markers": resolution.markers.to_dict() if resolution.markers is not None else None,
        "source": resolution.source, "messages": [general(m) for m in resolution.messages],
        "reason": general(resolution.reason),
        "template": resolution.template,
        "warnings": [[f"{w.category.__module__}.{w.category.__qualname__}", general(str(w.message))] for w in caught],
    })
    return resolution


_NAME = "\u0000tokenizer\u0000"  # stands for the tokenizer's name (its folder) in stored messages


def cache_key(ct: Any, arguments: dict) -> str:
    import importlib.metadata as metadata

    digest = hashlib.sha256()
    digest.update(ct.tokenizer_digest)
    versions = {}
    for package in ("transformers", "tokenizers", "jinja2"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    facts = {
        "format": FORMAT, "templates": ct.templates, "template_name": ct.template_name,
        "template_kwargs": ct.template_kwargs, "arguments": arguments, "versions": versions,
        "object": object_facts(ct),
    }
    digest.update(json.dumps(facts, sort_keys=True, default=repr).encode("utf-8"))
    digest.update(code_digest())
    return digest.hexdigest()


def object_facts(ct: Any) -> dict:
    """What a resolution reads off the tokenizer object rather than its serialised vocabulary (``tokenizer_json``):
    Unsloth Studio's marker strings set on it (``_unsloth_output_part`` / ``_unsloth_input_part``, read as the
    policy reads them), its special tokens (the template renders ``bos_token`` / ``eos_token``, the stop token
    trains), the decoding and splitting switches, and the template-table family its name picks (the table is
    tried by that name when detection fails; the name itself is left out, so that the same files in another
    folder hit)."""
    from .policy import unsloth_parts
    from .templates import match_template

    tokenizer = ct.tokenizer
    match = match_template(ct.name) if isinstance(ct.name, str) and ct.name else None
    return {
        "unsloth_parts": unsloth_parts(ct),
        "special_tokens": getattr(tokenizer, "special_tokens_map", None),
        "clean_up_tokenization_spaces": getattr(tokenizer, "clean_up_tokenization_spaces", None),
        "split_special_tokens": getattr(tokenizer, "split_special_tokens", None),
        "table_family": None if match is None else [match.pattern, match.template],
    }


_CODE: list[bytes] = []


def code_digest() -> bytes:
    """A digest of the code a marker resolution depends on (``CODE_FILES``), computed once."""
    if not _CODE:
        here = Path(__file__).resolve().parent.parent  # the lossmask package
        digest = hashlib.sha256()
        for name in CODE_FILES:
            try:
                digest.update(name.encode() + b"\0" + (here / name).read_bytes())
            except OSError:
                digest.update(name.encode() + b"\0missing")
        _CODE.append(digest.digest())
    return _CODE[0]


def _read(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as fh:
            stored = json.load(fh)
        if stored.get("format") != FORMAT:
            return None
        return stored
    except (OSError, ValueError, AttributeError):
        return None


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".partial")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(temporary, path)
    except OSError:
        pass


def _category(name: str) -> type[Warning]:
    module, _, qualname = name.rpartition(".")
    try:
        import importlib

        category = getattr(importlib.import_module(module), qualname)
        if isinstance(category, type) and issubclass(category, Warning):
            return category
    except (ImportError, AttributeError, ValueError):
        pass
    return UserWarning
