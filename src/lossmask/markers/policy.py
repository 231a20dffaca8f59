"""The masking policy: one function that every integration calls to decide which markers to use.

``resolve_markers`` decides, in this order:

1. ``dataset_format`` "text" / "raw" / "pretraining" (continued pretraining) and "alpaca"
   (instruction/input/output rows, not chat): no masking, every token trains; said in ``reason``.
2. Marker strings given by the user (``response_part`` / ``instruction_part``, the call shape of
   Unsloth's ``train_on_responses_only``): located in rendered probes (``markers_from_strings``),
   with the tokenizer's EOS added as the ``end`` marker where the template writes it (the stop token
   trains), verified, and used even when verification disagrees (the user asked for them), with an
   ``UnverifiedMarkersWarning`` then (``MarkerResolutionError`` under ``strict=True``).
3. Detection from the chat template (``detect_markers``, which only returns verified markers).
4. When detection raises ``MarkerDetectionError`` (and only then): the template table, for the
   model name, then for the tokenizer's own name; an entry's markers are used only when ``verify``
   finds them exact, and a ``MarkerFallbackWarning`` names the detection error.
5. When both miss and the template renders a chat: every row is labelled from its own rendering
   (``chat.turn_spans.FromRendering`` stands where the markers would; source "rendered"). Each assistant
   turn is found by rendering the conversation up to it and through it; a row where that fails is counted,
   never trained whole. This is checked on a probe chat before it is chosen.
6. When the template renders no chat at all: ``FullSequenceWarning``, loud, and the full sequence trains
   (markers None); under ``strict=True`` a ``MarkerResolutionError`` instead.

Before detection, a tokenizer that Unsloth Studio prepared carries its own marker strings
(``_unsloth_input_part`` / ``_unsloth_output_part``): they are read as ``instruction_part`` /
``response_part`` (step 2) when the caller gives none.

Any other exception (a template that raises on the probes in a way detection does not expect, a
bug while applying markers, a bad argument) propagates: it is never taken for "detection failed".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..engine.patterns import Markers
from .detect import MarkerDetectionError

SOURCES = ("detected", "table", "user", "rendered", "none")

CHAT_FORMATS = ("chat", "conversational", "messages", "sharegpt")
NO_MASKING_FORMATS = {
    "text": "raw text rows (continued pretraining) have no turns: every token trains",
    "raw": "raw text rows (continued pretraining) have no turns: every token trains",
    "pretraining": "continued pretraining trains on every token",
    "alpaca": (
        "alpaca rows (instruction/input/output) are not rendered with a chat template, so there are no chat markers "
        "to find: every token trains; to train on the output only, give the rows to mask_files / lossmask mask, which "
        "render them with the chat template (docs/inputs.md, Alpaca), or resolve with dataset_format='chat'"
    ),
}


class FullSequenceWarning(UserWarning):
    """No markers could be found or verified: the full sequence (prompts included) will be trained."""


class MarkerFallbackWarning(UserWarning):
    """Detection from the chat template failed; markers came from the template table instead."""


class UnverifiedMarkersWarning(UserWarning):
    """Markers built from the user's strings do not reproduce the ground truth on the probes."""


class MarkerResolutionError(MarkerDetectionError):
    """``strict=True`` and no verified markers were found (or the user's strings do not verify)."""


@dataclass(frozen=True)
class Resolution:
    """What ``resolve_markers`` decided.

    ``markers``: the markers to label with, ``FromRendering`` (label each row from its rendering) or None
    (train every token). ``source``: "detected", "table", "user", "rendered" or "none". ``messages``: what the user should read, in order (warnings
    included). ``reason``: one line saying why this source was chosen. ``template``: the table entry
    used (or the one tried). ``report``: the verification report of the markers, when one was made.
    """

    markers: Any
    source: str
    messages: tuple[str, ...]
    reason: str
    template: str | None = None
    report: Any = None

    @property
    def masking(self) -> bool:
        """Whether labels will mask anything (False: the full sequence trains)."""
        return self.markers is not None


def resolve_markers(
    tokenizer: Any,
    model_name: str | None = None,
    dataset_format: str = "chat",
    strict: bool = False,
    *,
    response_part: str | Sequence[str] | None = None,
    instruction_part: str | Sequence[str] | None = None,
) -> Resolution:
    """Choose the markers for ``tokenizer`` (see the module notes for the order of decisions).

    ``tokenizer``: a Hugging Face tokenizer, processor, mlx-lm ``TokenizerWrapper``, folder path or
    ``ChatTokenizer``. ``model_name``: the checkpoint name for the table (tried before the
    tokenizer's own name or path). ``dataset_format``: "chat" (or "conversational", "messages", "sharegpt"),
    "text" / "raw" / "pretraining", or "alpaca". ``strict``: raise ``MarkerResolutionError``
    instead of training the full sequence. ``response_part`` / ``instruction_part``: marker text
    as it appears in the rendered chat (e.g. ``"<|im_start|>assistant\\n"``), instead of detection.
    """
    fmt = _check_format(dataset_format)
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be True or False, got {strict!r}")
    if model_name is not None and not isinstance(model_name, str):
        raise TypeError(f"model_name must be a string such as 'Qwen/Qwen2.5-7B-Instruct', got {type(model_name).__name__}")
    if fmt in NO_MASKING_FORMATS:
        if response_part is not None or instruction_part is not None:
            raise ValueError(
                f"response_part/instruction_part mark chat turns, but dataset_format={dataset_format!r} has none; "
                "pass dataset_format='chat' to mask with them, or leave them out"
            )
        reason = f"dataset_format={dataset_format!r}: {NO_MASKING_FORMATS[fmt]}"
        return Resolution(None, "none", (reason,), reason)

    from ..chat.tokenizer import ChatTemplateError, load_tokenizer

    if response_part is None and instruction_part is None:
        response_part, instruction_part = unsloth_parts(tokenizer)
    user_strings = response_part is not None or instruction_part is not None
    try:
        ct = load_tokenizer(tokenizer)
    except ChatTemplateError as exc:  # no chat template: nothing to detect, no rendered text to find table strings in
        if user_strings:
            raise
        name = getattr(tokenizer, "name_or_path", None) or (tokenizer if isinstance(tokenizer, str) else type(tokenizer).__name__)
        messages = [f"marker detection failed: {_first_line(exc)}",
                    "the template table is not tried: its strings become ids only where they are found in a rendered "
                    "chat, and this tokenizer renders none (a base model's tokenizer). Give it the chat template you "
                    "train with (--chat-template FILE.jinja, chat_template=), or markers (--markers FILE.json)"]
        return _full_sequence(str(name), messages, strict, None, None, stacklevel=3)
    steps = Steps.default()
    if user_strings:
        return _from_user(ct, response_part, instruction_part, strict, steps)
    return _resolve_chat(ct, model_name, strict, steps)


@dataclass(frozen=True)
class Steps:
    """The operations the policy chains, as functions (the defaults are lossmask's own).

    ``detect(ct) -> (markers, report)`` raises ``MarkerDetectionError`` when it fails;
    ``match(name) -> TemplateMatch | None``; ``entry_markers(ct, entry) -> Markers``;
    ``strings_markers(ct, **strings) -> Markers``; ``verify(ct, markers) -> report`` with ``.ok``
    and ``.summary()``; ``rendered(ct, messages, tried) -> Resolution | None``: labels from each row's rendering
    when the template renders a chat (None: no such step). Tests pass their own to reach every decision.
    """

    detect: Callable[[Any], tuple[Markers, Any]]
    match: Callable[[str], Any]
    entry_markers: Callable[[Any, Any], Markers]
    strings_markers: Callable[..., Markers]
    verify: Callable[[Any, Markers], Any]
    rendered: Callable[[Any, list, Any], Any] | None = None

    @classmethod
    def default(cls) -> "Steps":
        from .detect import detect_markers_with_report, markers_from_strings
        from .templates import match_template, table_markers
        from .verify import verify

        return cls(detect_markers_with_report, match_template, table_markers, markers_from_strings, verify,
                   _from_rendering)


def _resolve_chat(ct: Any, model_name: str | None, strict: bool, steps: Steps) -> Resolution:
    """Detection, then the table, then the loud full-sequence fallback (chat data, no user strings)."""
    try:
        markers, report = steps.detect(ct)
    except MarkerDetectionError as exc:  # only this one means "detection failed"; anything else propagates
        names = list(dict.fromkeys(n for n in (model_name, ct.name) if n))  # the model name first, then the tokenizer's
        return _from_table(ct, names, exc, strict, steps)
    reason = f"markers detected from the chat template of {ct.name!r} and verified: {report.summary()}"
    return Resolution(markers, "detected", (reason,), reason, report=report)


def unsloth_parts(tokenizer: Any) -> tuple[str | None, str | None]:
    """The marker strings Unsloth Studio sets on a tokenizer it prepared (``_unsloth_output_part`` opens a reply,
    ``_unsloth_input_part`` a user turn), on the tokenizer or the processor's tokenizer; ``(None, None)`` without."""
    for obj in (tokenizer, getattr(tokenizer, "tokenizer", None), getattr(tokenizer, "_tokenizer", None)):
        if obj is None or isinstance(obj, str):
            continue
        output, given = getattr(obj, "_unsloth_output_part", None), getattr(obj, "_unsloth_input_part", None)
        if isinstance(output, str) and output:
            return output, given if isinstance(given, str) and given else None
    return None, None


def _check_format(dataset_format: str) -> str:
    if isinstance(dataset_format, str):
        fmt = dataset_format.strip().lower()
        if fmt in CHAT_FORMATS or fmt in NO_MASKING_FORMATS:
            return fmt
    raise ValueError(
        f"dataset_format={dataset_format!r} is not known; pass one of {list(CHAT_FORMATS)} (mask to assistant turns), "
        f"{[f for f in NO_MASKING_FORMATS if f != 'alpaca']} (no masking) or 'alpaca'"
    )


def _as_strings(value: str | Sequence[str] | None, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    strings = (value,) if isinstance(value, str) else tuple(value)
    if not strings or not all(isinstance(s, str) and s for s in strings):
        raise TypeError(f"{what} must be a non-empty string or a list of them, such as '<|im_start|>assistant\\n'; got {value!r}")
    return strings


def _from_user(ct, response_part, instruction_part, strict: bool, steps: Steps) -> Resolution:
    if response_part is None:
        raise ValueError(
            "instruction_part was given without response_part; pass response_part too (the text that opens an "
            "assistant turn, e.g. '<|im_start|>assistant\\n'), or neither to detect the markers"
        )
    response, instruction = _as_strings(response_part, "response_part"), _as_strings(instruction_part, "instruction_part")
    # a string that never occurs in the rendered chat raises MarkerDetectionError: the user's own input, so it propagates
    markers = steps.strings_markers(ct, response=response, instruction=instruction)
    eos = _eos_string(ct)
    if eos is not None:  # the stop token trains (SPEC.md); Unsloth's call shape has no place to say so
        try:
            markers = steps.strings_markers(ct, response=response, instruction=instruction, end=(eos,))
        except MarkerDetectionError:
            pass  # the template never writes EOS (Falcon): nothing after the content trains
    report = steps.verify(ct, markers)
    messages = [f"markers from response_part={list(response)!r}, instruction_part={list(instruction)!r}: {markers}"]
    if report.ok:
        reason = f"user-given marker strings, verified: {report.summary()}"
        messages.append(reason)
        return Resolution(markers, "user", tuple(messages), reason, report=report)
    problem = (
        f"the markers from your response_part/instruction_part do not match what {ct.name!r} must train: "
        f"{report.summary()}. Check them with `lossmask show`; leave them out to let lossmask detect the markers."
    )
    if strict:
        raise MarkerResolutionError(f"{problem}\n{report}")
    warnings.warn(problem, UnverifiedMarkersWarning, stacklevel=3)
    messages.append(f"WARNING: {problem}")
    return Resolution(markers, "user", tuple(messages), "user-given marker strings (NOT verified exact)", report=report)


def _eos_string(ct) -> str | None:
    eos = getattr(ct.tokenizer, "eos_token", None)
    return eos if isinstance(eos, str) and eos else None


def _from_table(ct, names: list[str], detection_error: MarkerDetectionError, strict: bool, steps: Steps) -> Resolution:
    """The table entry for the first of ``names`` (model name, then the tokenizer's own) that verifies."""
    detection = f"marker detection failed for {ct.name!r}: {_first_line(detection_error)}"
    messages = [detection]
    tried, report, seen = None, None, set()
    for name in names:
        match = steps.match(name)
        if match is None:
            messages.append(f"the template table has no entry for the name {name!r}; pass model_name= to name the checkpoint")
            continue
        if match.entry is None:
            messages.append(f"the name {name!r} matches {match.pattern!r}, a family the template table does not serve")
            continue
        if match.template in seen:
            continue
        seen.add(match.template)
        tried = match.template
        try:
            markers = steps.entry_markers(ct, match.entry)
        except MarkerDetectionError as exc:
            messages.append(
                f"the template table entry {tried!r} (matched by {match.pattern!r}) is not used: {_first_line(exc)}"
            )
            continue
        report = steps.verify(ct, markers)
        if report.ok:
            reason = f"detection failed; markers from the template table entry {tried!r} (name {name!r}), verified: {report.summary()}"
            warning = f"{detection}; using the template table entry {tried!r} instead, verified exact on the probes"
            warnings.warn(warning, MarkerFallbackWarning, stacklevel=4)
            messages.append(f"WARNING: {warning}")
            return Resolution(markers, "table", tuple(messages), reason, template=tried, report=report)
        messages.append(f"the template table entry {tried!r} is not used: it fails verification: {report.summary()}")
    rendered = steps.rendered(ct, messages, tried) if steps.rendered is not None else None
    if rendered is not None:
        return rendered
    return _full_sequence(ct.name, messages, strict, tried, report, stacklevel=5)


PROBE = (
    {"role": "system", "content": "You answer in one short line."},
    {"role": "user", "content": "What colour is the sky on a clear day?"},
    {"role": "assistant", "content": "It is blue."},
    {"role": "user", "content": "And at night?"},
    {"role": "assistant", "content": "It is dark, with stars."},
)


PROBE_TOOL = {"type": "function", "function": {  # (described, as real schemas are: Command-R+ raises without)
    "name": "get_time", "description": "The time now in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name."}},
                   "required": ["city"]}}}


def _from_rendering(ct: Any, messages: list[str], tried: str | None) -> Resolution | None:
    """Labels from each row's rendering, when the template renders a chat: with its system message, else without
    (templates that refuse one). None when it renders neither (the full sequence then trains, loudly)."""
    from ..chat.render import ChatTemplateError
    from ..chat.turn_spans import FromRendering, _encode, label_row_from_rendering

    problem = None
    # with a system message; without (templates that refuse one); with tools (templates made for tool use only)
    for probe, tools in ((list(PROBE), None), (list(PROBE[1:]), None), (list(PROBE[1:]), [PROBE_TOOL])):
        try:
            text = ct.render(probe, tools=tools)
        except ChatTemplateError as exc:
            problem = problem or _first_line(exc)
            continue
        ids, _ = _encode(ct, text, probe, "text")
        trained, why = label_row_from_rendering(ct, probe, ids, tools=tools, text=text)
        checked = ("a probe chat labelled from its rendering keeps every rule (replies and their stop tokens train, "
                   "no user or system text and no assistant header does)") if trained is not None and trained.any() \
            else f"the probe chat cannot be labelled from its rendering ({why or 'nothing trains'}): rows that cannot " \
                 "are counted as template_breaks_roles, never trained whole"
        reason = (f"no token markers could be read or verified for {ct.name!r}; each row is labelled from its own "
                  f"rendering (its assistant turns found by rendering the conversation up to and through each): {checked}")
        messages.append(reason)
        return Resolution(FromRendering(), "rendered", tuple(messages), reason, template=tried)
    messages.append(f"the chat template renders no chat ({problem}), so no row can be labelled from its rendering")
    return None


def _full_sequence(name: str, messages: list[str], strict: bool, tried: str | None, report: Any, *, stacklevel: int = 4) -> Resolution:
    """Nothing verified: the loud warning and the full sequence (or ``MarkerResolutionError`` under strict)."""
    loud = (
        f"NO LOSS MASKING for {name!r}: no markers could be detected or taken from the template table, so the FULL "
        "SEQUENCE (system, user and tool turns included) will be trained. Pass response_part=/instruction_part= "
        "(see `lossmask show`), or markers yourself, or strict=True to stop here."
    )
    if strict:
        raise MarkerResolutionError("\n".join(messages + [loud.replace(" will be trained", " would be trained")]))
    warnings.warn(loud + "\n" + "\n".join(messages), FullSequenceWarning, stacklevel=stacklevel)
    messages.append(f"WARNING: {loud}")
    return Resolution(None, "none", tuple(messages), "detection failed and the template table had no verified entry",
                      template=tried, report=report)


def _first_line(exc: BaseException) -> str:
    return str(exc).split("\n", 1)[0]
