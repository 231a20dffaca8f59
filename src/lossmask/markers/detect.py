"""`detect_markers`: response, instruction and end patterns read off the tokenizer's own chat template.

Detection renders the built-in probe conversations (``chat.probes.probe_conversations``), builds their
ground truth (``verify.ground_truth``: where each assistant turn starts and stops training), and
reads the token ids around every turn boundary as they occur in context:

* ``response``: the tokens of the assistant header, the text the generation prompt adds (e.g.
  ``<|im_start|>assistant\\n``, Llama-2's `` [/INST]``), ending where training starts;
* ``end``: the stop token of each turn (``<|im_end|>``, ``</s>``, gpt-oss ``<|end|>`` and
  ``<|return|>`` and ``<|call|>``, GLM's next role token);
* ``instruction``: for turns with no stop token (Falcon's plain-text roles), the header of the
  message that follows, which closes the span; and where a header also precedes a message that is
  not an assistant turn (DeepSeek-V3.1's ``<｜tool▁output▁end｜>`` before the next tool output with
  parallel calls, Mistral's ``[/TOOL_RESULTS][TOOL_RESULTS]``), that message's opener.

The probes cover six kinds of conversation (plain, system, multi-turn, tools and parallel tools
with arguments as objects and as JSON strings, reasoning). A kind the template renders must verify
exactly; one it raises on, ignores or drops message text of is reported as not rendered
(``report.kinds``).

Every variant that occurs is kept. The result is then checked with ``verify`` on the same probes,
and ``MarkerDetectionError`` is raised instead of returning markers that do not reproduce the
ground truth exactly.

``markers_from_strings`` turns marker *text* (from a table, or a user) into token patterns the same
way: by finding the text inside rendered probes and reading the ids there, never by tokenising the
string on its own.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Iterable, Sequence

import numpy as np

from ..chat.probes import KINDS, probe_kind, renderable_probes, sort_probes, vocabulary_probes
from ..chat.tokenizer import ChatTemplateError, ChatTokenizer, load_tokenizer
from ..engine.patterns import Markers
from .verify import GroundTruth, Unchecked, VerifyReport, build_truths, check

_HOW_TO_FIX = (
    "pass markers yourself (lossmask.Markers(response=[[...]], end=[[...]]), or "
    "lossmask.markers_from_strings(tokenizer, response='...', end='...')) and check them with "
    "lossmask.verify(tokenizer, markers)"
)


class MarkerDetectionError(ValueError):
    """The chat template could not be analysed, or the markers read off it do not verify."""


def detect_markers(tokenizer: Any) -> Markers:
    """Derive ``Markers`` from the tokenizer's chat template, verified on the built-in probes.

    ``tokenizer``: a Hugging Face fast tokenizer, a processor, an mlx-lm ``TokenizerWrapper``, a
    folder path, or a ``ChatTokenizer``. Raises ``MarkerDetectionError`` naming the template and
    what failed when the template cannot be analysed or no markers reproduce its ground truth.
    """
    markers, _ = detect_markers_with_report(tokenizer)
    return markers


def detect_markers_with_report(tokenizer: Any) -> tuple[Markers, VerifyReport]:
    """``detect_markers``, also returning the verification report of the probes.

    ``report.kinds`` says, per kind of conversation (plain, system, multi-turn, tools, parallel
    tools, reasoning), whether it was verified exact or why the template cannot render it.
    """
    ct = _load(tokenizer)
    probes, skipped = sort_probes(ct)
    if not probes:
        raise MarkerDetectionError(
            f"the chat template of {ct.name!r} renders none of the probe conversations (it raised on every one"
            f"{': ' + next(iter(skipped.values())) if skipped else ''}); {_HOW_TO_FIX}"
        )
    truths = build_truths(ct, probes)
    # a probe whose text the template drops (Phi-3 drops tool messages, Gemma-2 system prompts...)
    # is a kind of conversation the template does not render: not a failure, and not labelled
    dropped = {t.name: t for t in truths if isinstance(t, Unchecked) and t.dropped}
    truths = [t for t in truths if t.name not in dropped]
    headers = sorted({turn.header for t in truths if isinstance(t, GroundTruth) for turn in t.turns})
    truths += build_truths(ct, vocabulary_probes(ct, headers))
    failed = [t for t in truths if not isinstance(t, GroundTruth)]
    if failed:
        name, error = failed[0][:2]
        more = f" (and {len(failed) - 1} more probes)" if len(failed) > 1 else ""
        raise MarkerDetectionError(
            f"cannot analyse the chat template of {ct.name!r} on probe {name!r}{more}: {error}; {_HOW_TO_FIX}"
        )
    markers = markers_from_truths(ct, truths)
    report = check(ct, markers, truths)
    prefills = _prefills(markers)
    if not report.ok and prefills:
        # a header variant that extends another one (the prompt's prefill, present in some turns
        # only): what it adds is masked wherever it occurs
        with_prefills = replace(markers, mask_out=tuple(prefills))
        retry = check(ct, with_prefills, truths)
        if retry.ok:
            markers, report = with_prefills, retry
            for pattern in sorted(prefills, key=len, reverse=True):  # keep only the ones needed
                fewer = replace(markers, mask_out=tuple(p for p in markers.mask_out if p != pattern))
                again = check(ct, fewer, truths)
                if again.ok:
                    markers, report = fewer, again
    if not report.ok and report.extra and not report.missing:
        markers, report = _close_openers(ct, markers, report, truths)
    if not report.ok:
        raise MarkerDetectionError(
            f"the markers read off the chat template of {ct.name!r} do not reproduce its ground truth, so lossmask "
            f"will not use them: {markers}\n{report}\n{_HOW_TO_FIX}"
        )
    kinds = _kinds(report, skipped, dropped)
    for kind, status, detail in kinds:
        if kind in ("plain", "multi-turn") and status != "exact":
            raise MarkerDetectionError(
                f"the chat template of {ct.name!r} does not render {kind} conversations as given ({detail}); {_HOW_TO_FIX}"
            )
    notes = _notes(ct, markers, truths)
    if not markers.end:
        warnings.warn(f"{ct.name!r}: {notes[0]}", UserWarning, stacklevel=3)
    return markers, replace(report, notes=notes, kinds=kinds)


def _close_openers(ct: ChatTokenizer, markers: Markers, report: VerifyReport, truths) -> tuple[Markers, VerifyReport]:
    """Markers for a response pattern that also precedes a non-assistant message.

    DeepSeek-V3.1 opens the answer after tool results with ``<｜tool▁output▁end｜>``, and with parallel
    calls that token also precedes the next ``<｜tool▁output▁begin｜>``. Each run of extra tokens
    starts with the opener of the message that wrongly trains; that opener, as an instruction
    pattern, closes the span before it. Kept only when the result verifies exactly.
    """
    openers: list[tuple[int, ...]] = []
    for c in report.conversations:
        extra = set(c.extra)
        for k in c.extra:
            if k - 1 not in extra and c.truth is not None and int(c.truth.ids[k]) in ct.added_ids:
                _add(openers, c.truth.ids[k : k + 1])
    if not openers:
        return markers, report
    widened = replace(markers, instruction=tuple(markers.instruction) + tuple(openers))
    retry = check(ct, widened, truths)
    return (widened, retry) if retry.ok else (markers, report)


def _form(probe: str) -> str:
    """How a tool probe passes arguments, or the probe's name."""
    if probe.startswith(("tool", "parallel-tools")):
        return "arguments as JSON strings" if probe.endswith("-json") else "arguments as objects"
    return probe


def _kinds(report: VerifyReport, skipped: dict[str, str], dropped: dict) -> tuple[tuple[str, str, str], ...]:
    """``(kind, status, detail)`` per kind of probe: "exact", or "not rendered" with the reason."""
    by_kind: dict[str, dict] = {kind: {"exact": [], "skipped": [], "dropped": []} for kind in KINDS}
    for c in report.conversations:  # all exact here: detection refuses otherwise
        if not c.name.startswith("vocabulary-"):
            by_kind[probe_kind(c.name)]["exact"].append(c)
    for name, why in skipped.items():
        by_kind[probe_kind(name)]["skipped"].append((name, why))
    for name, unchecked in dropped.items():
        d = unchecked.dropped[0]
        by_kind[probe_kind(name)]["dropped"].append(
            (name, f"the template drops message {d.message} ({d.role}): its {d.part} {d.text!r}"))
    out = []
    for kind in KINDS:
        entry = by_kind[kind]
        exact, others = entry["exact"], entry["skipped"] + entry["dropped"]
        if not exact:
            whys = list(dict.fromkeys(why for _, why in others))
            detail = whys[0] if len(whys) == 1 else "; ".join(f"{_form(name)}: {why}" for name, why in others) or "no probe"
            out.append((kind, "not rendered", detail))
            continue
        notes = []
        if kind == "reasoning":
            # reasoning given as a field (reasoning_content / thinking): does the template write it?
            fields = [c for c in exact if c.name == "reasoning" and c.truth is not None]
            turns = sum(len(c.truth.turns) for c in fields)
            lost = sum(len({d.message for d in c.dropped if d.part == "reasoning"}) for c in fields)
            if not fields or lost >= turns:
                inline = [c for c in exact if c.name == "reasoning-in-content"]
                stripped = any(d.part == "reasoning" for c in inline for d in c.dropped)
                how = ("strips reasoning written into the content too" if stripped else
                       "keeps reasoning written into the content as <think>...</think>, trained as content")
                out.append((kind, "not rendered", f"the template ignores reasoning fields and {how}"))
                continue
            if lost:
                notes.append(f"the template drops the reasoning of {lost} of {turns} turns (before the last user message)")
        if kind in ("tools", "parallel tools"):
            forms = ["objects" if not c.name.endswith("-json") else "JSON strings" for c in exact]
            notes.append("arguments as " + " and ".join(sorted(set(forms))))
            notes += [f"{_form(name)}: {why}" for name, why in others]
        beyond = sum(len(c.beyond_markers) for c in exact)
        if beyond:
            notes.append(f"{beyond} generated header tokens beyond any marker, not trained")
        out.append((kind, "exact", "; ".join(notes)))
    return tuple(out)


def _prefills(markers: Markers) -> list[tuple[int, ...]]:
    """What a longer response pattern adds to a shorter one that is its prefix."""
    out: list[tuple[int, ...]] = []
    for short in markers.response:
        for long in markers.response:
            if len(long) > len(short) and long[: len(short)] == short and long[len(short) :] not in out:
                out.append(long[len(short) :])
    return out


def _notes(ct: ChatTokenizer, markers: Markers, truths: Sequence[GroundTruth]) -> tuple[str, ...]:
    """What a user should know about markers that verified: turns without a stop token, plain text."""
    notes = []
    turns = [turn for truth in truths for turn in truth.turns]
    unstopped = [turn for turn in turns if turn.stop is None]
    if not markers.end:
        notes.append(
            "the chat template writes no stop token after assistant turns, so only their content is trained and "
            "the model does not learn to stop; consider a template that ends turns with the EOS token"
        )
    elif unstopped:
        notes.append(
            f"{len(unstopped)} of {len(turns)} probed assistant turns have no stop token (the template writes "
            "none after them, e.g. after the last turn of a chat), so nothing after their content is trained"
        )
    if markers.mask_out:
        texts = ", ".join(repr(ct.decode(p)) for p in markers.mask_out)
        notes.append(
            f"the generation prompt writes text that only some turns contain; it is never trained (mask_out: {texts})"
        )
    added = ct.added_ids
    if not any(any(t in added for t in pattern) for pattern in markers.response):
        texts = sorted({ct.decode(p).strip() for p in markers.response})
        notes.append(
            f"the response markers are plain text ({', '.join(map(repr, texts))}): a message containing that text "
            "opens a trained span"
        )
    return tuple(notes)


def _load(tokenizer: Any) -> ChatTokenizer:
    try:
        return load_tokenizer(tokenizer)
    except ChatTemplateError as exc:
        raise MarkerDetectionError(f"{exc}; {_HOW_TO_FIX}") from exc


def markers_from_truths(tokenizer: Any, truths: Iterable[GroundTruth]) -> Markers:
    """The patterns around every assistant turn of the given ground truths, every variant kept."""
    ct = load_tokenizer(tokenizer)
    response: list[tuple[int, ...]] = []
    instruction: list[tuple[int, ...]] = []
    end: list[tuple[int, ...]] = []
    turns = 0
    for truth in truths:
        starts, ends, ids = truth.offsets[:, 0], truth.offsets[:, 1], truth.ids
        for turn in truth.turns:
            turns += 1
            header_at = turn.start - len(turn.header)
            header = ids[(starts >= header_at) & (starts < turn.start)]
            if header.size == 0:
                raise MarkerDetectionError(
                    f"{ct.name!r}, probe {truth.name!r}: the assistant header {turn.header!r} holds no whole token "
                    f"(it merges into its neighbours), so no response pattern can mark where training starts; {_HOW_TO_FIX}"
                )
            _add(response, header)
            if turn.stop is not None:
                _add(end, ids[turn.stop : turn.stop + 1])
            elif turn.next_start < len(truth.text):
                following = ids[(starts >= turn.end) & (ends <= turn.next_start)]
                if following.size == 0:
                    raise MarkerDetectionError(
                        f"{ct.name!r}, probe {truth.name!r}: an assistant turn has no stop token and the next message "
                        f"starts right after it, so no pattern can close it; {_HOW_TO_FIX}"
                    )
                _add(instruction, following)
    if not turns:
        raise MarkerDetectionError(f"the probes rendered with {ct.name!r} hold no assistant turn; {_HOW_TO_FIX}")
    return Markers(response=response, instruction=instruction, end=end)


def _add(patterns: list[tuple[int, ...]], ids: np.ndarray) -> None:
    pattern = tuple(int(t) for t in ids)
    if pattern not in patterns:
        patterns.append(pattern)


def markers_from_strings(
    tokenizer: Any,
    *,
    response: str | Sequence[str],
    instruction: str | Sequence[str] = (),
    end: str | Sequence[str] = (),
    mask_out: str | Sequence[str] = (),
) -> Markers:
    """Token patterns for marker *strings*, read where the strings occur in rendered probes.

    Each string is found in the probe conversations rendered with the tokenizer's chat template
    (and their generation prompts); the ids of the tokens that cover each occurrence, in context,
    are one variant. Every variant is kept. A string that never occurs raises
    ``MarkerDetectionError``. The markers are not verified here: call ``lossmask.verify``.
    """
    ct = _load(tokenizer)
    texts = _probe_texts(ct)
    if not texts:
        raise MarkerDetectionError(f"the chat template of {ct.name!r} renders none of the probe conversations; {_HOW_TO_FIX}")
    encoded = [(text, *ct.encode_with_offsets(text)) for text in texts]
    kinds = {}
    for kind, strings in (("response", response), ("instruction", instruction), ("end", end), ("mask_out", mask_out)):
        strings = [strings] if isinstance(strings, str) else list(strings)
        patterns: list[tuple[int, ...]] = []
        for string in strings:
            if not isinstance(string, str) or not string:
                raise TypeError(f"{kind} marker strings must be non-empty strings, got {string!r}")
            found = False
            for text, ids, offsets in encoded:
                at = text.find(string)
                while at >= 0:
                    cover = (offsets[:, 0] < at + len(string)) & (offsets[:, 1] > at)
                    if cover.any():
                        _add(patterns, ids[cover])
                        found = True
                    at = text.find(string, at + 1)
            if not found:
                raise MarkerDetectionError(
                    f"the {kind} marker {string!r} does not occur in any conversation rendered with the chat template "
                    f"of {ct.name!r}; check the string against `lossmask show`, or let lossmask.detect_markers find the markers"
                )
        kinds[kind] = patterns
    return Markers(**kinds)


def _probe_texts(ct: ChatTokenizer) -> list[str]:
    texts = []
    for probe in renderable_probes(ct):
        texts.append(ct.render(probe.messages, tools=probe.tools))
        for i, message in enumerate(probe.messages):
            if message.get("role") == "assistant" and i:
                try:
                    texts.append(ct.render(probe.messages[:i], tools=probe.tools, add_generation_prompt=True))
                except ChatTemplateError:
                    pass
    return texts
