"""Dropped-row benchmark: how many rows and tokens each way of finding markers loses, per chat template.

For every tokenizer folder under ``--tokenizers`` (any folder of Hugging Face tokenizer folders, also
ones never seen before) it renders a seeded synthetic chat dataset with the tokenizer's own template
(varied turn counts and lengths, system prompts, tool calls where the template renders them, reasoning,
whitespace and Unicode edge cases), tokenises it with ``ChatTokenizer.encode_chats`` and labels it,
untruncated and truncated at each ``--max-lengths``, with three marker sources:

* ``detected``: ``lossmask.detect_markers`` (markers read off the template, verified);
* ``standalone``: what today's tools do. Role strings from a hand-kept table (``STANDALONE_TABLE``,
  written here), or else a guess from the template's special tokens, are tokenised on their own and
  applied with the rule of the pre-2025 TRL completion-only collator, per row in Python: mask from the
  start of the row (then from every instruction match) to the end of the next response match, train
  the rest; a row where either pattern is missing trains nothing. A family with neither an entry nor a
  guess gets no masking: the full sequence trains;
* ``table``: lossmask's template table for the folder's name (``match_template`` + ``table_markers``,
  i.e. ``markers_from_strings``), used as the policy uses it: only when ``verify`` finds it exact,
  otherwise the full sequence trains.

Every row is checked token by token against the ground truth of ``lossmask.verify`` (which never looks
at markers); truncated, the truth is the untruncated truth cut at ``max_length``. Written to ``--out``:
``dropped_rows.json`` (one record per family x source x max length), ``dropped_rows.md`` and
``dropped_rows.png``.

    python benchmarks/dropped_rows.py                                   # shared tokenizers -> docs/dropped_rows/
    python benchmarks/dropped_rows.py --tokenizers DIR --out DIR --rows 200 --max-lengths 512,1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

REPO_ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("detected", "standalone", "table")
REASONS = ("no_response", "empty_response", "empty")  # lossmask's (SPEC.md); outcome codes 1, 2, 3
NO_INSTRUCTION = "no_instruction"  # the standalone collator's own: the instruction pattern never occurs (code 4)
DEFAULT_ROWS = 200
DEFAULT_MAX_LENGTHS = (512, 1024, 4096)
REPEAT = 3  # timings: the best of this many runs

# -- the standalone marker table: how hand-kept tables write role strings -------------------------------

# name (a substring of the tokenizer folder's name, the longest match wins) -> (response, instruction);
# the strings are the obvious ones a person copies from a model card, tokenised on their own.
STANDALONE_TABLE: dict[str, tuple[str, str]] = {
    "chatml": ("<|im_start|>assistant\n", "<|im_start|>user\n"),
    "qwen": ("<|im_start|>assistant\n", "<|im_start|>user\n"),
    "smollm": ("<|im_start|>assistant\n", "<|im_start|>user\n"),
    "phi-4": ("<|im_start|>assistant<|im_sep|>", "<|im_start|>user<|im_sep|>"),
    "llama-3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|start_header_id|>user<|end_header_id|>\n\n"),
    "llama-2": ("[/INST]", "[INST]"),
    "mistral": ("[/INST]", "[INST]"),
    "mixtral": ("[/INST]", "[INST]"),
    "gemma": ("<start_of_turn>model\n", "<start_of_turn>user\n"),
    "phi-3": ("<|assistant|>\n", "<|user|>\n"),
    "zephyr": ("<|assistant|>\n", "<|user|>\n"),
    "olmo": ("<|assistant|>\n", "<|user|>\n"),
    "vicuna": ("ASSISTANT:", "USER:"),
    "alpaca": ("### Response:\n", "### Instruction:\n"),
    "deepseek": ("<｜Assistant｜>", "<｜User｜>"),
    "gpt-oss": ("<|start|>assistant<|channel|>final<|message|>", "<|start|>user<|message|>"),
    "openchat": ("GPT4 Correct Assistant:", "GPT4 Correct User:"),
}

# no entry: guess from the special tokens the tokenizer declares (first hit wins)
STANDALONE_GUESSES: tuple[tuple[tuple[str, ...], tuple[str, str]], ...] = (
    (("<|im_start|>", "<|im_end|>"), ("<|im_start|>assistant\n", "<|im_start|>user\n")),
    (("<|start_header_id|>", "<|eot_id|>"), ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|start_header_id|>user<|end_header_id|>\n\n")),
    (("<start_of_turn>",), ("<start_of_turn>model\n", "<start_of_turn>user\n")),
    (("[INST]", "[/INST]"), ("[/INST]", "[INST]")),
    (("<|assistant|>", "<|user|>"), ("<|assistant|>\n", "<|user|>\n")),
)


@dataclass(frozen=True)
class Standalone:
    """Marker ids as today's tools get them: each string tokenised on its own."""

    response: tuple[int, ...]
    instruction: tuple[int, ...]
    how: str  # where the strings came from, for the report


def standalone_markers(ct: Any, family: str) -> Standalone | None:
    """The standalone markers for a tokenizer folder named ``family``; None means no masking (full sequence)."""
    name = family.lower()
    keys = [key for key in STANDALONE_TABLE if key in name]
    if keys:
        key = max(keys, key=len)
        strings, how = STANDALONE_TABLE[key], f"table entry {key!r}"
    else:
        declared = {str(t) for t in ct.convert_ids_to_tokens(sorted(ct.special_ids))}
        guess = next((s for tokens, s in STANDALONE_GUESSES if all(t in declared for t in tokens)), None)
        if guess is None:
            return None
        strings, how = guess, "guessed from special tokens"
    response, instruction = (tuple(ct.tokenizer.encode(s, add_special_tokens=False)) for s in strings)
    return Standalone(response, instruction, f"{how}: response {strings[0]!r}, instruction {strings[1]!r}")


def _matches(row: np.ndarray, pattern: tuple[int, ...]) -> list[int]:
    """Start positions of ``pattern`` in ``row``: candidates on the first id, then a slice compare (per row)."""
    n = len(pattern)
    return [int(i) for i in np.flatnonzero(row == pattern[0]) if tuple(row[i : i + n].tolist()) == pattern]


def label_standalone(rows: Sequence[np.ndarray], markers: Standalone | None) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-row Python labelling in the style of the pre-2025 TRL completion-only collator.

    Returns a boolean "trained" array per row and an outcome code per row (0 trained, then
    ``REASONS`` in order, 4 when only the instruction pattern is missing). ``markers`` None trains
    every token.
    """
    trained, outcomes = [], np.zeros(len(rows), dtype=np.int8)
    for r, row in enumerate(rows):
        mask = np.ones(len(row), dtype=bool)
        if markers is not None:
            responses = _matches(row, markers.response)
            instructions = _matches(row, markers.instruction)
            if not responses or not instructions:
                mask[:] = False  # the collator warns and ignores the whole row
            else:
                if instructions[0] > responses[0]:
                    instructions.insert(0, 0)
                for k, (start, response) in enumerate(zip(instructions, responses)):
                    mask[(0 if k == 0 else start) : response + len(markers.response)] = False
                if len(responses) < len(instructions):
                    mask[instructions[-1] :] = False
        trained.append(mask)
        if len(row) == 0:
            outcomes[r] = 3
        elif not mask.any():
            if markers is None or _matches(row, markers.response):
                outcomes[r] = 4 if markers is not None and not _matches(row, markers.instruction) else 2
            else:
                outcomes[r] = 1
    return trained, outcomes


# -- the synthetic dataset ---------------------------------------------------------------------------------

_WORDS = (
    "the a model river answer light table window garden number minute reason question system button picture "
    "kitchen country library paper engine signal pattern method simple quiet careful bright heavy rapid "
    "probably usually often rarely maybe exactly because although while after before during between under "
    "compute measure explain compare describe improve remember organise travel cook write read build test "
    "value result error memory token layer function variable server client request cache budget schedule "
    "weather mountain station ticket recipe flour butter sugar oven degree market price contract invoice"
).split()
_UNICODE = (
    "Ünïcödé naïve café façade", "日本語で答えてください。", "Привет, как дела?", "مرحبا بالعالم",
    "emoji 🙂🚀✓ and 👨‍👩‍👧 family", "Ελληνικά γράμματα", "한국어 문장입니다", "e\u0301 combining accent",
    "中文：你好，世界！", "Ça coûte 12 € — ou £10?", "math: ∑ x² ≤ ∞ ≠ π", "Tiếng Việt có dấu",
)
_CODE = (
    "```python\ndef area(r):\n    return 3.14159 * r ** 2\n```",
    "```js\nconst xs = [1, 2, 3].map((x) => x * 2);\nconsole.log(xs);\n```",
    "```sql\nSELECT name, COUNT(*) FROM orders GROUP BY name;\n```",
    "```bash\nfor f in *.txt; do wc -l \"$f\"; done\n```",
    "<div class=\"note\">[1] {braces} <b>bold</b></div>",
)
_LEAD = ("", "", "", "", " ", "\n", "\n\n", "  ", "\t", " \n")
_TRAIL = ("", "", "", "", "\n", " ", "\n\n", "\r\n", "  ")
_SYSTEMS = (
    "You are a helpful assistant.", "You are terse and exact. Answer in one paragraph.",
    "You are a senior chef who explains recipes step by step.", "Réponds en français, s'il te plaît.",
    "You are a coding assistant. Prefer Python.\nAlways show code in fenced blocks.",
)
_TOOLS = (
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "convert_currency", "description": "Convert an amount between currencies.",
     "parameters": {"type": "object", "properties": {"amount": {"type": "number"}, "to": {"type": "string"}},
                    "required": ["amount", "to"]}}},
)
_CITIES = ("Oslo", "Lima", "Kyoto", "Nairobi", "Porto", "Hanoi", "Québec", "Zürich")


def _sentence(rng: np.random.Generator, lo: int = 4, hi: int = 16) -> str:
    words = [str(w) for w in rng.choice(_WORDS, size=int(rng.integers(lo, hi)))]
    return " ".join(words).capitalize() + str(rng.choice([".", ".", "?", "!", ";", ":"]))


def _text(rng: np.random.Generator, words: int, *, edge: float = 0.2) -> str:
    """About ``words`` words of prose, sometimes with code, lists, Unicode and whitespace at the edges."""
    parts: list[str] = []
    count = 0
    while count < words:
        kind = rng.random()
        if kind < 0.08:
            parts.append(str(rng.choice(_UNICODE)))
        elif kind < 0.12 and words > 30:
            parts.append("\n" + str(rng.choice(_CODE)) + "\n")
        elif kind < 0.16 and words > 30:
            parts.append("\n" + "\n".join(f"{k + 1}. {_sentence(rng, 2, 7)}" for k in range(int(rng.integers(2, 5)))) + "\n")
        elif kind < 0.22:
            parts.append("\n\n" + _sentence(rng))
        else:
            parts.append(_sentence(rng))
        count += len(parts[-1].split())
    text = " ".join(parts).strip()
    if rng.random() < edge:
        text = str(rng.choice(_LEAD)) + text + str(rng.choice(_TRAIL))
    return text


def _length(rng: np.random.Generator, median: float, spread: float = 0.8) -> int:
    return max(1, int(rng.lognormal(np.log(median), spread)))


def synthetic_chats(n: int, *, seed: int = 0, system: bool = True, tools: bool = True) -> list[dict]:
    """``n`` seeded chat rows (``{"messages": [...], "tools": [...] | None}``); every content non-blank."""
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(n):
        long_row = rng.random() < 0.08  # a few rows long enough to be cut at 4096 tokens
        messages: list[dict] = []
        if system and rng.random() < 0.45:
            messages.append({"role": "system", "content": str(rng.choice(_SYSTEMS)) if rng.random() < 0.7 else _text(rng, _length(rng, 60))})
        turns = int(rng.choice([1, 1, 1, 2, 2, 3, 3, 4, 5, 6, 8]))
        with_tools = tools and rng.random() < 0.3
        tool_turn = int(rng.integers(0, turns)) if with_tools else -1
        for t in range(turns):
            messages.append({"role": "user", "content": _text(rng, _length(rng, 25 if not long_row else 300))})
            if t == tool_turn:
                call_id = "".join(rng.choice(list("abcdefghijkmnpqrstuvwxyz0123456789"), size=9))
                if rng.random() < 0.5:
                    function = {"name": "get_weather", "arguments": {"city": str(rng.choice(_CITIES))}}
                    result = json.dumps({"temperature": int(rng.integers(-20, 35)), "sky": str(rng.choice(["clear", "rain", "snow"]))})
                else:
                    function = {"name": "convert_currency", "arguments": {"amount": int(rng.integers(1, 900)), "to": "EUR"}}
                    result = json.dumps({"amount": round(float(rng.random()) * 900, 2), "currency": "EUR"})
                messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "type": "function", "function": function}]})
                messages.append({"role": "tool", "tool_call_id": call_id, "name": function["name"], "content": result})
            answer: dict[str, Any] = {"role": "assistant", "content": _text(rng, _length(rng, 70 if not long_row else 900))}
            if rng.random() < 0.2:
                reasoning = _text(rng, _length(rng, 30), edge=0.0)
                answer["reasoning_content"] = reasoning  # Qwen3 / GLM read this key
                answer["thinking"] = reasoning  # gpt-oss / SmolLM3 read this one
            messages.append(answer)
        rows.append({"name": f"row {index}", "messages": messages, "tools": list(_TOOLS) if with_tools else None})
    return rows


# -- measuring ----------------------------------------------------------------------------------------------


@dataclass
class Labelled:
    """What one source gives for the rows: trained mask per row, outcome per row, labelling seconds."""

    trained: list[np.ndarray]
    outcomes: np.ndarray
    seconds: float


def _best(fn: Callable[[], Any]) -> tuple[Any, float]:
    best, result = float("inf"), None
    for _ in range(REPEAT):
        started = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - started)
    return result, best


def _arrow_rows(rows: Sequence[np.ndarray]) -> pa.LargeListArray:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    values = np.concatenate(rows).astype(np.int32) if rows else np.zeros(0, np.int32)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))


def label_with_engine(rows: Sequence[np.ndarray], markers: Any) -> Labelled:
    """lossmask's engine (``label_batch`` on one Arrow batch); ``markers`` None trains every token."""
    from lossmask import label_batch

    if markers is None:
        trained = [np.ones(len(r), dtype=bool) for r in rows]
        outcomes = np.array([0 if len(r) else 3 for r in rows], dtype=np.int8)
        return Labelled(trained, outcomes, 0.0)
    array = _arrow_rows(rows)
    batch, seconds = _best(lambda: label_batch(array, markers))
    offsets = np.asarray(array.offsets)
    values = np.asarray(batch.labels.values) != -100
    trained = [values[offsets[r] : offsets[r + 1]] for r in range(len(rows))]
    return Labelled(trained, np.asarray(batch.outcomes, dtype=np.int8), seconds)


def measure(
    family: str, source: str, max_length: int | None, truths: Sequence[Any], labelled: Labelled, note: str
) -> dict:
    """One record: drops per reason, wrong rows and tokens, stop tokens trained, against the cut truths."""
    reasons = (*REASONS, NO_INSTRUCTION)
    dropped = dict.fromkeys(reasons if source == "standalone" else REASONS, 0)
    rows_wrong = wrongly_trained = wrongly_masked = tokens = expected = 0
    stops = stops_trained = 0
    for truth, trained, outcome in zip(truths, labelled.trained, labelled.outcomes):
        should = truth.should_train[:max_length]
        tokens += len(should)
        expected += int(should.sum())
        extra, missing = int((trained & ~should).sum()), int((should & ~trained).sum())
        wrongly_trained += extra
        wrongly_masked += missing
        rows_wrong += bool(extra or missing)
        if not trained.any():
            # every assistant token cut away by truncation: a drop by truncation, whatever the labeller saw
            dropped["empty_response" if not should.any() else reasons[int(outcome) - 1]] += 1
        for turn in truth.turns:
            if turn.stop is not None and turn.stop < len(should):
                stops += 1
                stops_trained += bool(trained[turn.stop])
    return {
        "family": family,
        "source": source,
        "max_length": max_length,
        "rows": len(truths),
        "dropped": dropped,
        "rows_wrong": rows_wrong,
        "tokens_wrongly_trained": wrongly_trained,
        "tokens_wrongly_masked": wrongly_masked,
        "stop_token_trained": round(stops_trained / stops, 4) if stops else None,
        "seconds": round(labelled.seconds, 6),
        "tokens": tokens,
        "tokens_to_train": expected,
        "markers": note,
    }


def source_markers(ct: Any, family: str) -> dict[str, tuple[Any, str, float]]:
    """``{source: (markers, note, seconds to get them)}``; markers None means the full sequence trains."""
    from lossmask import MarkerDetectionError, detect_markers

    out: dict[str, tuple[Any, str, float]] = {}
    started = time.perf_counter()
    try:
        markers, note = detect_markers(ct), "detected from the chat template, verified"
    except MarkerDetectionError as exc:
        markers, note = None, f"detection failed ({str(exc).splitlines()[0][:160]}): full sequence"
    out["detected"] = (markers, note, time.perf_counter() - started)
    started = time.perf_counter()
    standalone = standalone_markers(ct, family)
    note = standalone.how if standalone else "no table entry and no guess from the special tokens: full sequence"
    out["standalone"] = (standalone, note, time.perf_counter() - started)
    started = time.perf_counter()
    markers, note = _table_markers(ct, family)
    out["table"] = (markers, note, time.perf_counter() - started)
    return out


def _table_markers(ct: Any, family: str) -> tuple[Any, str]:
    """The template table's markers for the folder's name, as the policy takes them (verified, else None)."""
    from lossmask import MarkerDetectionError, match_template, verify
    from lossmask.markers.templates import table_markers

    match = match_template(family)
    if match is None or match.entry is None:
        return None, f"the template table has no entry for {family!r}: full sequence"
    try:
        markers = table_markers(ct, match.entry)
    except MarkerDetectionError as exc:
        return None, f"table entry {match.template!r} not found in the template ({str(exc)[:120]}): full sequence"
    report = verify(ct, markers)
    if not report.ok:
        return None, f"table entry {match.template!r} fails verify ({report.summary()}): full sequence"
    return markers, f"table entry {match.template!r}, verified"


def run_family(path: Path, *, rows: int, max_lengths: Sequence[int], seed: int = 0) -> list[dict]:
    """Every record of one tokenizer folder (sources x [untruncated] + max lengths)."""
    from lossmask import load_tokenizer
    from lossmask.chat.probes import renderable_probes
    from lossmask.markers.verify import GroundTruth, build_truths

    family = path.name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # detection's notes (no stop token...) and transformers' length warnings
        ct = load_tokenizer(path)
        probes = {p.name for p in renderable_probes(ct)}
        chats = synthetic_chats(rows, seed=seed, system="system" in probes, tools="tool" in probes)
        encoded = ct.encode_chats(chats)
        ok = encoded.ok
        truths = build_truths(ct, [c for c, keep in zip(chats, ok) if keep])
        ids = [np.asarray(r, dtype=np.int64) for r, keep in zip(encoded.input_ids.to_pylist(), ok) if keep]
        kept = [(t, i) for t, i in zip(truths, ids) if _checkable(t, i)]
        unchecked = len(chats) - len(kept)
        why = ""
        if unchecked:
            no_truth = sum(not isinstance(t, GroundTruth) for t in truths)
            dropped = sum(bool(getattr(t, "dropped", ())) for t in truths if not isinstance(t, GroundTruth))
            why = (f"{len(encoded.errors)} rejected by the template, {no_truth} without a ground truth "
                   f"({dropped} of them because the template dropped message text, e.g. the system prompt), "
                   f"{unchecked - len(encoded.errors) - no_truth} with an assistant text the ground truth cannot locate")
            print(f"{family}: {unchecked} of {len(chats)} rows not checked ({why})", file=sys.stderr)
        truths, ids = [t for t, _ in kept], [i for _, i in kept]
        sources = source_markers(ct, family)
    records = []
    for max_length in (None, *max_lengths):
        cut = ids if max_length is None else [r[:max_length] for r in ids]
        for source in SOURCES:
            markers, note, setup = sources[source]
            if source == "standalone":
                (trained, outcomes), seconds = _best(lambda: label_standalone(cut, markers))
                labelled = Labelled(trained, outcomes, seconds)
            else:
                labelled = label_with_engine(cut, markers)
            record = measure(family, source, max_length, truths, labelled, note)
            record["setup_seconds"] = round(setup, 3)
            record["unchecked"] = unchecked
            record["unchecked_why"] = why
            records.append(record)
    return records


def _checkable(truth: Any, ids: np.ndarray) -> bool:
    """A row is checked when verify built its truth, on the same ids, and located every assistant turn.

    A turn with nothing to train means the ground truth could not find the assistant's text in the
    rendered chat (Falcon's template rewrites '\\n\\n' inside contents); such a row is left out.
    """
    from lossmask.markers.verify import GroundTruth

    return (isinstance(truth, GroundTruth) and np.array_equal(truth.ids, ids)
            and all(turn.end > turn.start for turn in truth.turns))


def tokenizer_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and (p / "tokenizer_config.json").is_file())


# -- outputs ----------------------------------------------------------------------------------------------------


def _rate(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def totals(records: Sequence[dict], source: str, max_length: int | None) -> dict:
    """One source at one max length, added up over families."""
    chosen = [r for r in records if r["source"] == source and r["max_length"] == max_length]
    stops = [r["stop_token_trained"] for r in chosen if r["stop_token_trained"] is not None]
    return {
        "families": len(chosen),
        "rows": sum(r["rows"] for r in chosen),
        "dropped": {k: sum(r["dropped"].get(k, 0) for r in chosen) for k in (*REASONS, NO_INSTRUCTION)},
        "rows_wrong": sum(r["rows_wrong"] for r in chosen),
        "tokens": sum(r["tokens"] for r in chosen),
        "tokens_wrongly_trained": sum(r["tokens_wrongly_trained"] for r in chosen),
        "tokens_wrongly_masked": sum(r["tokens_wrongly_masked"] for r in chosen),
        "stop_token_trained": sum(stops) / len(stops) if stops else None,
        "families_all_stops_trained": sum(1 for s in stops if s == 1.0),
        "families_with_drops": sum(1 for r in chosen if sum(r["dropped"].values())),
        "families_wrong": sum(1 for r in chosen if r["rows_wrong"]),
        "seconds": sum(r["seconds"] for r in chosen),
    }


def _pct(x: float) -> str:
    if x == 0:
        return "0"
    return f"{100 * x:.1f}%" if x >= 0.001 else "<0.1%"


def _drops(dropped: dict) -> str:
    parts = [f"{n} {k}" for k, n in dropped.items() if n]
    return ", ".join(parts) or "0"


def render_markdown(records: Sequence[dict], *, rows: int, max_lengths: Sequence[int], seed: int) -> str:
    families = list(dict.fromkeys(r["family"] for r in records))
    lines = [
        "# Dropped rows and mislabelled tokens, per chat template and marker source",
        "",
        "Generated by `python benchmarks/dropped_rows.py` (do not edit by hand); the records are in",
        "[`dropped_rows.json`](dropped_rows.json), the chart in [`dropped_rows.png`](dropped_rows.png).",
        "",
        f"{len(families)} tokenizer folders; per family {rows} synthetic chats (seed {seed}: 1-8 turns, system prompts and",
        "tool calls where the template renders them, reasoning, code, lists, Unicode, whitespace at content edges,",
        "8% long rows), rendered with the family's own template, tokenised with `encode_chats`, and labelled with:",
        "",
        "- **detected**: `lossmask.detect_markers` (read off the template, verified), lossmask's engine;",
        "- **standalone**: role strings tokenised on their own (a hand-kept table, else a guess from the special",
        "  tokens, else no masking) and applied per row with the rule of the pre-2025 TRL completion-only",
        "  collator; a row without the response pattern (`no_response`) or without the instruction pattern",
        "  (`no_instruction`, this collator's own reason) is ignored, i.e. dropped;",
        "- **table**: lossmask's template table for the folder's name (`markers_from_strings`), used only when",
        "  `verify` finds it exact (as `resolve_markers` does), else the full sequence trains.",
        "",
        "Every token is compared with the ground truth of `lossmask.verify` (untruncated; truncated, the truth cut",
        "at `max_length`). *Dropped*: rows with nothing trained, by reason; a row whose every assistant token was",
        "cut away by truncation counts as `empty_response`. *Rows wrong*: rows with at least one token labelled",
        "differently from the truth. *Stop trained*: the fraction of assistant turns (stop token inside the row)",
        "whose stop token trains. *Seconds*: labelling time of the rows (best of 3; lossmask's numba engine on one",
        "Arrow batch, the standalone collator per row in Python).",
        "",
        "## All families",
        "",
        "| source | max length | rows | dropped | rows wrong | tokens wrongly trained | tokens wrongly masked | stop trained (mean) | families with drops | families wrong | seconds |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for max_length in (None, *max_lengths):
        for source in SOURCES:
            t = totals(records, source, max_length)
            dropped = sum(t["dropped"].values())
            stop = "–" if t["stop_token_trained"] is None else _pct(t["stop_token_trained"])
            lines.append(
                f"| {source} | {max_length or 'none'} | {t['rows']} | {dropped} ({_pct(_rate(dropped, t['rows']))}) | "
                f"{t['rows_wrong']} ({_pct(_rate(t['rows_wrong'], t['rows']))}) | "
                f"{t['tokens_wrongly_trained']} ({_pct(_rate(t['tokens_wrongly_trained'], t['tokens']))}) | "
                f"{t['tokens_wrongly_masked']} ({_pct(_rate(t['tokens_wrongly_masked'], t['tokens']))}) | {stop} | "
                f"{t['families_with_drops']} of {t['families']} | {t['families_wrong']} of {t['families']} | {t['seconds']:.3f} |"
            )
    detected, standalone = totals(records, "detected", None), totals(records, "standalone", None)
    if detected["seconds"]:
        lines += ["", f"Labelling speed, untruncated, all families: lossmask's engine {detected['seconds']:.3f} s, the per-row "
                  f"standalone collator {standalone['seconds']:.3f} s: the engine is **{standalone['seconds'] / detected['seconds']:.1f}x** as fast "
                  "on the same rows (one thread each; markers derived once per tokenizer, not counted: `setup_seconds`)."]
    lines += [
        "",
        "## Per family, untruncated",
        "",
        "| family | source | rows | dropped | rows wrong | wrongly trained | wrongly masked | stop trained | seconds | markers |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for family in families:
        for r in records:
            if r["family"] == family and r["max_length"] is None:
                stop = "–" if r["stop_token_trained"] is None else _pct(r["stop_token_trained"])
                note = r["markers"].replace("|", "\\|").replace("\n", "\\n")
                lines.append(
                    f"| {family} | {r['source']} | {r['rows']} | {_drops(r['dropped'])} | {r['rows_wrong']} | "
                    f"{r['tokens_wrongly_trained']} | {r['tokens_wrongly_masked']} | {stop} | {r['seconds']:.4f} | {note} |"
                )
    unchecked = {r["family"]: r for r in records if r["unchecked"] and r["max_length"] is None and r["source"] == "detected"}
    if unchecked:
        lines += ["", "Rows not checked (left out of every count above and below, for every source alike):", ""]
        lines += [f"- **{f}**: {r['unchecked']} of {r['rows'] + r['unchecked']} rows: {r['unchecked_why']}" for f, r in unchecked.items()]
        if "falcon" in unchecked:
            lines.append("  (Falcon's template rewrites `\\n\\n` as `\\n` inside every content, so `verify` does not find the text.)")
        if any(f in unchecked for f in ("mistral-v3", "mistral-nemo", "phi-3")):
            lines.append("  (Mistral v3/Nemo write the system prompt only before the last user message, and Phi-3 drops it: "
                         "a row that lost a message is not the conversation it was given, so it has no ground truth.)")
    masked = [r for r in records if r["max_length"] is None and r["source"] == "detected" and r["tokens_wrongly_masked"]]
    if any(r["family"] == "gpt-oss" for r in masked):
        lines += ["", "gpt-oss, detected: the wrongly masked tokens are the `<|start|>assistant` the model writes between "
                  "its analysis and its final channel (2 per turn with reasoning). The rule trains them; no marker set can, "
                  "because they are token for token the header that opens a turn (docs/masking-rule.md, step 4)."]
    for max_length in max_lengths:
        lines += [
            "",
            f"## Per family, truncated at {max_length} tokens",
            "",
            "| family | " + " | ".join(f"{s}: dropped / rows wrong / stop trained" for s in SOURCES) + " |",
            "| --- | " + " | ".join("---" for _ in SOURCES) + " |",
        ]
        for family in families:
            cells = []
            for source in SOURCES:
                r = next(x for x in records if x["family"] == family and x["source"] == source and x["max_length"] == max_length)
                stop = "–" if r["stop_token_trained"] is None else _pct(r["stop_token_trained"])
                cells.append(f"{_drops(r['dropped'])} / {r['rows_wrong']} / {stop}")
            lines.append(f"| {family} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


COLOURS = {"detected": "#1b7837", "standalone": "#d6604d", "table": "#4393c3"}


def render_chart(records: Sequence[dict], path: Path, *, rows: int) -> None:
    """Drop rate and wrong-token rate per family and source (untruncated), horizontal bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(dict.fromkeys(r["family"] for r in records))
    base = {(r["family"], r["source"]): r for r in records if r["max_length"] is None}
    panels = [
        ("rows dropped (nothing trained)", lambda r: _rate(sum(r["dropped"].values()), r["rows"])),
        ("rows with a wrong token", lambda r: _rate(r["rows_wrong"], r["rows"])),
        ("tokens labelled wrong", lambda r: _rate(r["tokens_wrongly_trained"] + r["tokens_wrongly_masked"], r["tokens"])),
    ]
    height = 0.27
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 0.36 * len(families) + 2.2), sharey=True)
    y = np.arange(len(families))
    for ax, (title, value) in zip(np.atleast_1d(axes), panels):
        for k, source in enumerate(SOURCES):
            values = [100 * value(base[(f, source)]) if (f, source) in base else 0 for f in families]
            bars = ax.barh(y + (k - 1) * height, values, height, color=COLOURS[source], label=source)
            for bar, v in zip(bars, values):
                if v == 0:  # a visible zero: a dot on the axis
                    ax.plot([0], [bar.get_y() + height / 2], marker="o", color=COLOURS[source], markersize=4, clip_on=False)
        ax.set_title(title + " (%)", fontsize=11)
        ax.set_xlim(0, 100)
        ax.grid(axis="x", alpha=0.3)
        ax.invert_yaxis() if ax is np.atleast_1d(axes)[0] else None
    first = np.atleast_1d(axes)[0]
    first.set_yticks(y)
    first.set_yticklabels(families)
    t = {s: totals(records, s, None) for s in SOURCES}
    summary = "   ".join(
        f"{s}: {_pct(_rate(sum(t[s]['dropped'].values()), t[s]['rows']))} rows dropped, "
        f"{_pct(_rate(t[s]['rows_wrong'], t[s]['rows']))} rows wrong" for s in SOURCES
    )
    fig.suptitle(f"Untruncated: {len(families)} chat templates x {rows} synthetic chats\n{summary}",
                 fontsize=10.5)
    handles, labels = first.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(SOURCES), frameon=False, fontsize=10)
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(records: Sequence[dict], out: Path, *, rows: int, max_lengths: Sequence[int], seed: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "dropped_rows.json").write_text(json.dumps(list(records), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "dropped_rows.md").write_text(render_markdown(records, rows=rows, max_lengths=max_lengths, seed=seed), encoding="utf-8")
    render_chart(records, out / "dropped_rows.png", rows=rows)


def _max_lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in re.split(r"[,\s]+", text.strip()) if v)
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--max-lengths {text!r}: expected positive integers separated by commas, e.g. 512,1024,4096")
    return values


def _set_threads(threads: int) -> None:
    """One numba thread by default: a tiny batch on a busy machine otherwise pays for waking the pool."""
    try:
        import numba
    except ImportError:  # another backend labels: nothing to set
        return
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_root = Path(os.environ.get("LOSSMASK_TOKENIZERS", REPO_ROOT.parent / "shared" / "tokenizers"))
    parser.add_argument("--tokenizers", type=Path, default=default_root, help="a folder of tokenizer folders")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "dropped_rows", help="output folder")
    parser.add_argument("--rows", type=int, default=DEFAULT_ROWS, help="synthetic chats per family")
    parser.add_argument("--max-lengths", type=_max_lengths, default=DEFAULT_MAX_LENGTHS, help="truncation lengths, e.g. 512,1024,4096")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", nargs="*", default=None, help="only these folder names")
    parser.add_argument("--threads", type=int, default=1,
                        help="numba threads for lossmask's engine (default 1: both sides timed on one core)")
    args = parser.parse_args(argv)
    if not args.tokenizers.is_dir():
        print(f"no tokenizers at {args.tokenizers}; pass --tokenizers DIR (a folder of tokenizer folders)", file=sys.stderr)
        return 2
    if args.rows < 1:
        parser.error(f"--rows {args.rows}: expected a positive number of chats per family")
    folders = [p for p in tokenizer_folders(args.tokenizers) if not args.families or p.name in args.families]
    if not folders:
        print(f"no tokenizer folders (with tokenizer_config.json) under {args.tokenizers}", file=sys.stderr)
        return 2
    from lossmask import Markers, label_batch

    _set_threads(args.threads)
    label_batch([[1, 2, 3]], Markers(response=[[1]], end=[[3]]))  # compile the kernel before timing anything
    records: list[dict] = []
    started = time.perf_counter()
    for path in folders:
        family_started = time.perf_counter()
        try:
            family_records = run_family(path, rows=args.rows, max_lengths=args.max_lengths, seed=args.seed)
        except Exception as exc:  # an unseen folder that cannot be loaded or rendered: say so, go on
            print(f"{path.name}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})", file=sys.stderr)
            continue
        records += family_records
        line = ", ".join(
            f"{r['source']} {sum(r['dropped'].values())} dropped / {r['rows_wrong']} wrong"
            for r in family_records if r["max_length"] is None
        )
        print(f"{path.name}: {line} ({time.perf_counter() - family_started:.1f} s)", file=sys.stderr)
    if not records:
        print("no family could be measured", file=sys.stderr)
        return 1
    write_outputs(records, args.out, rows=args.rows, max_lengths=args.max_lengths, seed=args.seed)
    print(f"wrote {args.out}/dropped_rows.{{json,md,png}} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
