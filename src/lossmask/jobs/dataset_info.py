"""A dataset registered in LLaMA-Factory's ``dataset_info.json``, read as LLaMA-Factory reads it.

``dataset_entry(path, name)`` gives the file (or folder) the entry names and the ``MaskOptions`` fields that read
its rows as LLaMA-Factory's converters do: ``formatting`` (``alpaca``, the default, or ``sharegpt`` / ``openai``),
``columns`` (which column holds each part) and ``tags`` (ShareGPT's role and content keys and speaker names).
LLaMA-Factory's own rule is kept: an entry with ``columns`` reads only the columns it names (so Alpaca's ``system``
and ``history`` are read only when named), and an entry with ``tags`` only the speakers it names.

What lossmask cannot read as LLaMA-Factory does is refused with one line naming the file, the dataset and the key:
a dataset on a hub (lossmask reads local files), preference pairs (``ranking``) and KTO rows (``kto_tag``), which are
not supervised fine-tuning rows, text with no response (pretraining, every token trains), and audio. So is an entry
of another shape than LLaMA-Factory's (``tags`` or ``columns`` not an object of names, a key it does not know), a
``split`` other than ``train`` (the only split of a local file), and a file that is not a regular file of at most
``MAX_DATASET_INFO_BYTES``. Values from the file are quoted shortened (``display.quoted``).
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from .display import described, escaped, json_kind, quoted, shortened

MAX_DATASET_INFO_BYTES = 4 << 20  # LLaMA-Factory's own dataset_info.json is about 15 kB

# keys of an entry that say where it lives when it is not a local file
_REMOTE = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
# keys read here; any other key of an entry is refused, named, rather than left unread
_READ = frozenset(("file_name", "formatting", "columns", "tags", "file_sha1", "ranking", "split"))
# the keys of ``columns`` and ``tags`` LLaMA-Factory reads (its DatasetAttr), each naming a column / a key or speaker
_COLUMN_KEYS = ("prompt", "query", "response", "history", "messages", "system", "tools", "images", "videos", "audios",
                "chosen", "rejected", "kto_tag")
_TAG_KEYS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "observation_tag", "function_tag", "system_tag")
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
    info = _read_info(path)
    shown = escaped(path)
    if not isinstance(info, dict):
        raise ValueError(f"{shown}: not a dataset_info.json ({json_kind(info)}, not an object of datasets)")
    for key, value in info.items():
        if not isinstance(value, dict):
            raise ValueError(f"{shown}: dataset {quoted(key)} is {json_kind(value)}, not an object; each dataset "
                             "of a dataset_info.json is an object (file_name, formatting, columns, tags)")
    if name not in info:
        known = sorted(info)
        listed = ", ".join(shortened(k, 40) for k in known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
        raise ValueError(f"{shown}: no dataset {quoted(name)}; it registers {listed or 'none'}")
    entry = info[name]
    where = f"{shown}, dataset {quoted(name)}"
    remote = [key for key in _REMOTE if key in entry]
    if remote:
        raise ValueError(f"{where} is loaded from {remote[0]} {quoted(entry[remote[0]])}; lossmask reads local files "
                         "only: download it and register it with file_name (or pass the file as INPUT)")
    unread = sorted(set(entry) - _READ)
    if unread:
        raise ValueError(f"{where} has {', '.join(quoted(key, 40) for key in unread[:10])}, which lossmask does not "
                         "read; remove it, or pass the file as INPUT with the columns named (docs/inputs.md)")
    _check_shape(where, entry)
    if entry.get("ranking"):
        raise ValueError(f"{where} holds preference pairs (ranking: true), which are not supervised fine-tuning rows: "
                         "lossmask masks SFT rows; mask the chosen responses as a chat instead")
    split = entry.get("split", "train")
    if split != "train":
        raise ValueError(f"{where}: split {quoted(split)}; lossmask reads the file whole, as its one split 'train' "
                         "(datasets.load_dataset gives a local file that split alone): remove split, or put the rows "
                         "to mask in a file of their own")
    # LLaMA-Factory reads a column named "" (or null) as no column
    columns = {part: column or None for part, column in (entry.get("columns") or {}).items()}
    if columns.get("kto_tag"):
        raise ValueError(f"{where} holds KTO rows (kto_tag), which are not supervised fine-tuning rows; lossmask masks "
                         "SFT rows")
    if columns.get("audios"):
        raise ValueError(f"{where} holds audio (columns.audios); lossmask reads text, images and videos only, and an "
                         "audio row is never kept as text")
    for part, column in _MEDIA_COLUMNS.items():
        if columns.get(part) not in (None, column):
            raise ValueError(f"{where}: columns.{part} is {quoted(columns[part])}; lossmask reads {part} from the "
                             f"column {column!r}: rename it")
    if columns.get("tools") not in (None, "tools"):
        raise ValueError(f"{where}: columns.tools is {quoted(columns['tools'])}; lossmask reads tools from the column "
                         "'tools': rename it")
    formatting = entry.get("formatting", "alpaca")
    if formatting == "alpaca":
        fields = _alpaca_fields(where, columns if "columns" in entry else None)
    elif formatting in ("sharegpt", "openai"):
        fields = _sharegpt_fields(where, columns if "columns" in entry else None,
                                  entry.get("tags") if "tags" in entry else None)
    else:
        raise ValueError(f"{where}: formatting {quoted(formatting)}; LLaMA-Factory's are 'alpaca', 'sharegpt' and "
                         "'openai'")
    folder = os.path.dirname(os.path.abspath(path))
    return DatasetEntry(os.path.join(folder, entry["file_name"]), fields)


def _read_info(path: str) -> Any:
    """The JSON of the ``dataset_info.json`` at ``path``: a regular file of at most ``MAX_DATASET_INFO_BYTES``, read
    no further than that (a pipe or a device such as ``/dev/zero`` is refused before a byte is read)."""
    shown = escaped(path)
    try:  # O_NONBLOCK: opening a FIFO with no writer returns at once, to be refused below
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise OSError(f"{shown}: {exc.strerror or exc}; pass the dataset_info.json of your data folder") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a pipe" if stat.S_ISFIFO(mode) else \
                "a socket" if stat.S_ISSOCK(mode) else "a device"
            raise ValueError(f"{shown} is {kind}, not a file; pass the dataset_info.json file of your data folder")
        with os.fdopen(fd, "rb", closefd=False) as fh:
            data = fh.read(MAX_DATASET_INFO_BYTES + 1)
    except OSError as exc:
        raise OSError(f"{shown}: {exc.strerror or exc}; pass the dataset_info.json of your data folder") from None
    finally:
        os.close(fd)
    if len(data) > MAX_DATASET_INFO_BYTES:
        raise ValueError(f"{shown} is larger than {MAX_DATASET_INFO_BYTES >> 20} MiB, far past any dataset_info.json "
                         "(LLaMA-Factory's registers hundreds of datasets in about 15 kB); pass the dataset_info.json "
                         "of your data folder")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError(f"{shown}: JSON nested deeper than Python's JSON reader goes; a dataset_info.json is an "
                         "object of datasets, each an object of a few levels") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise ValueError(f"{shown}: not JSON ({exc}); pass LLaMA-Factory's dataset_info.json") from None


def _check_shape(where: str, entry: dict) -> None:
    """``entry``'s keys hold what LLaMA-Factory's dataset_info.json gives them: strings, ``ranking`` a boolean,
    ``columns`` and ``tags`` objects of the keys it knows, each naming a column / a key or speaker (or null)."""
    def wrong(key: str, value: Any, expected: str) -> ValueError:
        return ValueError(f"{where}: {key} is {described(value)}, where LLaMA-Factory's dataset_info.json gives "
                          f"{expected}")

    if not isinstance(entry.get("file_name"), str) or not entry["file_name"]:
        if "file_name" not in entry:
            raise ValueError(f"{where} has no file_name; register the dataset's local file under file_name")
        raise wrong("file_name", entry["file_name"], "the name of the dataset's file or folder")
    for key in ("formatting", "split", "file_sha1"):
        if key in entry and not isinstance(entry[key], str):
            raise wrong(key, entry[key], "a string")
    if "ranking" in entry and not isinstance(entry["ranking"], bool):
        raise wrong("ranking", entry["ranking"], "true or false")
    for key, known, what in (("columns", _COLUMN_KEYS, "a column name"), ("tags", _TAG_KEYS, "a message key or a speaker")):
        if key not in entry:
            continue
        given = entry[key]
        if not isinstance(given, dict):
            raise wrong(key, given, f"an object of {', '.join(known[:3])}, ... each {what}")
        other = [k for k in given if k not in known]
        if other:
            raise ValueError(f"{where}: {key} has {', '.join(quoted(k, 40) for k in other[:10])}, which LLaMA-Factory "
                             f"does not read; its {key} are {', '.join(known)}")
        for part, value in given.items():
            if value is not None and not isinstance(value, str):
                raise wrong(f"{key}.{part}", value, f"a string, {what} (or null)")


def _alpaca_fields(where: str, columns: dict | None) -> dict:
    """Alpaca's parts; with ``columns`` given, a part it does not name is not read (as LLaMA-Factory does)."""
    named = dict(_ALPACA_DEFAULT) if columns is None else {part: columns.get(part) for part in _ALPACA_DEFAULT}
    if not named["response"]:
        raise ValueError(f"{where} has no response column ({'columns: ' + quoted(columns) if columns else ''}): "
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
            raise ValueError(f"{where}: tags.function_tag is {quoted(named['function_tag'])}; lossmask reads tool calls "
                             "from speaker 'function_call': rename it")
        fields["role_map"] = {named[tag]: role for tag, role in _ROLE_OF_TAG.items() if named[tag]}
    elif keys == ("role", "content"):
        wrong = {tag: named[tag] for tag, role in _ROLE_OF_TAG.items()
                 if named[tag] and named[tag] != role and tag != "function_tag"}
        if wrong:
            raise ValueError(f"{where}: {{role, content}} messages are read with the roles the chat template writes, "
                             f"and tags rename them ({quoted(wrong)}); write the roles as user, assistant, system "
                             "and tool in the data")
    else:
        raise ValueError(f"{where}: messages keyed {quoted(keys[0])} and {quoted(keys[1])} (tags.role_tag, tags.content_tag); "
                         "lossmask reads ShareGPT's 'from' and 'value', or 'role' and 'content'")
    return fields
