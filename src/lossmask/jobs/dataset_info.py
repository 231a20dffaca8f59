"""A dataset registered in LLaMA-Factory's ``dataset_info.json``, read as LLaMA-Factory reads it.

``dataset_entry(path, name)`` gives the file (or folder) the entry names and the ``MaskOptions`` fields that read
its rows as LLaMA-Factory's converters do: ``formatting`` (``alpaca``, the default, or ``sharegpt`` / ``openai``),
``columns`` (which column holds each part) and ``tags`` (ShareGPT's role and content keys and speaker names).
LLaMA-Factory's own rule is kept: an entry with ``columns`` reads only the columns it names (so Alpaca's ``system``
and ``history`` are read only when named), and an entry with ``tags`` only the speakers it names.

What lossmask cannot read as LLaMA-Factory does is refused with one line naming the file, the dataset and the key:
a dataset on a hub (lossmask reads local files), preference pairs (``ranking``) and KTO rows (``kto_tag``), which are
not supervised fine-tuning rows, text with no response (pretraining, every token trains), and audio.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

# keys of an entry that say where it lives when it is not a local file
_REMOTE = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
# keys read here; any other key of an entry is refused, named, rather than left unread
_READ = frozenset(("file_name", "formatting", "columns", "tags", "file_sha1", "ranking", "split"))
# LLaMA-Factory's defaults for an entry that gives no ``columns`` / no ``tags`` (its DatasetAttr)
_ALPACA_DEFAULT = {"prompt": "instruction", "query": "input", "response": "output", "history": None, "system": None}
_TAGS_DEFAULT = {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt",
                 "observation_tag": "observation", "function_tag": "function_call", "system_tag": "system"}
_ROLE_OF_TAG = {"user_tag": "user", "assistant_tag": "assistant", "observation_tag": "tool",
                "function_tag": "assistant", "system_tag": "system"}
# the media columns lossmask reads for chats through a processor (chat/encode_media.py)
_MEDIA_COLUMNS = {"images": "images", "videos": "videos"}


@dataclass(frozen=True)
class DatasetEntry:
    """The input of one registered dataset, and the ``MaskOptions`` fields that read it."""

    input: str
    fields: dict


def dataset_entry(path: str | os.PathLike, name: str) -> DatasetEntry:
    """The file and the reading options of dataset ``name`` in ``dataset_info.json`` at ``path``."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            info = json.load(fh)
    except OSError as exc:
        raise OSError(f"{path}: {exc.strerror or exc}; pass the dataset_info.json of your data folder") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc}); pass LLaMA-Factory's dataset_info.json") from None
    if not isinstance(info, dict) or not all(isinstance(v, dict) for v in info.values()):
        raise ValueError(f"{path}: not a dataset_info.json (an object of datasets, each an object)")
    if name not in info:
        known = sorted(info)
        shown = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
        raise ValueError(f"{path}: no dataset {name!r}; it registers {shown}")
    entry = info[name]
    where = f"{path}, dataset {name!r}"
    remote = [key for key in _REMOTE if key in entry]
    if remote:
        raise ValueError(f"{where} is loaded from {remote[0]} {entry[remote[0]]!r}; lossmask reads local files only: "
                         "download it and register it with file_name (or pass the file as INPUT)")
    unread = sorted(set(entry) - _READ)
    if unread:
        raise ValueError(f"{where} has {', '.join(map(repr, unread))}, which lossmask does not read; remove it, or "
                         "pass the file as INPUT with the columns named (docs/inputs.md)")
    if "file_name" not in entry or not isinstance(entry["file_name"], str):
        raise ValueError(f"{where} has no file_name; register the dataset's local file under file_name")
    if entry.get("ranking"):
        raise ValueError(f"{where} holds preference pairs (ranking: true), which are not supervised fine-tuning rows: "
                         "lossmask masks SFT rows; mask the chosen responses as a chat instead")
    columns = entry.get("columns")
    if columns is not None and not isinstance(columns, dict):
        raise ValueError(f"{where}: columns is a {type(columns).__name__}, not an object of part -> column")
    columns = columns or {}
    if columns.get("kto_tag"):
        raise ValueError(f"{where} holds KTO rows (kto_tag), which are not supervised fine-tuning rows; lossmask masks "
                         "SFT rows")
    if columns.get("audios"):
        raise ValueError(f"{where} holds audio (columns.audios); lossmask reads text, images and videos only, and an "
                         "audio row is never kept as text")
    for part, column in _MEDIA_COLUMNS.items():
        if columns.get(part) not in (None, column):
            raise ValueError(f"{where}: columns.{part} is {columns[part]!r}; lossmask reads {part} from the column "
                             f"{column!r}: rename it")
    if columns.get("tools") not in (None, "tools"):
        raise ValueError(f"{where}: columns.tools is {columns['tools']!r}; lossmask reads tools from the column "
                         "'tools': rename it")
    formatting = entry.get("formatting", "alpaca")
    if formatting == "alpaca":
        fields = _alpaca_fields(where, columns if "columns" in entry else None)
    elif formatting in ("sharegpt", "openai"):
        fields = _sharegpt_fields(where, columns if "columns" in entry else None,
                                  entry.get("tags") if "tags" in entry else None)
    else:
        raise ValueError(f"{where}: formatting {formatting!r}; LLaMA-Factory's are 'alpaca', 'sharegpt' and 'openai'")
    folder = os.path.dirname(os.path.abspath(path))
    return DatasetEntry(os.path.join(folder, entry["file_name"]), fields)


def _alpaca_fields(where: str, columns: dict | None) -> dict:
    """Alpaca's parts; with ``columns`` given, a part it does not name is not read (as LLaMA-Factory does)."""
    named = dict(_ALPACA_DEFAULT) if columns is None else {part: columns.get(part) for part in _ALPACA_DEFAULT}
    if not named["response"]:
        raise ValueError(f"{where} has no response column ({'columns: ' + json.dumps(columns) if columns else ''}): "
                         "text with no response is pretraining, where every token trains and there is nothing to mask")
    if not named["prompt"] and not named["query"]:
        raise ValueError(f"{where} names neither a prompt nor a query column; name the instruction with "
                         "columns.prompt")
    return {"alpaca_columns": {"instruction": named["prompt"], "input": named["query"], "output": named["response"],
                               "system": named["system"], "history": named["history"]}}


def _sharegpt_fields(where: str, columns: dict | None, tags: dict | None) -> dict:
    """ShareGPT's (or OpenAI's) chat column, and its speakers as the role map."""
    messages = "conversations" if columns is None else columns.get("messages")
    if not messages:
        raise ValueError(f"{where} names no messages column; name it with columns.messages")
    named = dict(_TAGS_DEFAULT) if tags is None else {tag: tags.get(tag) for tag in _TAGS_DEFAULT}
    keys = (named["role_tag"], named["content_tag"])
    fields: dict[str, Any] = {"messages_column": messages}
    if columns and columns.get("system"):  # the system prompt kept apart from the chat, first unless the chat has one
        fields["system_column"] = columns["system"]
    if keys == ("from", "value"):
        if named["function_tag"] not in (None, "function_call"):
            raise ValueError(f"{where}: tags.function_tag is {named['function_tag']!r}; lossmask reads tool calls "
                             "from speaker 'function_call': rename it")
        fields["role_map"] = {named[tag]: role for tag, role in _ROLE_OF_TAG.items() if named[tag]}
    elif keys == ("role", "content"):
        wrong = {tag: named[tag] for tag, role in _ROLE_OF_TAG.items()
                 if named[tag] and named[tag] != role and tag != "function_tag"}
        if wrong:
            raise ValueError(f"{where}: {{role, content}} messages are read with the roles the chat template writes, "
                             f"and tags rename them ({json.dumps(wrong)}); write the roles as user, assistant, system "
                             "and tool in the data")
    else:
        raise ValueError(f"{where}: messages keyed {keys[0]!r} and {keys[1]!r} (tags.role_tag, tags.content_tag); "
                         "lossmask reads ShareGPT's 'from' and 'value', or 'role' and 'content'")
    return fields
