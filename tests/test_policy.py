"""The masking policy: every decision of ``resolve_markers``, with stand-in steps, then on real tokenizers."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from conftest import chat_tokenizer, tokenizer_path
from lossmask import Markers
from lossmask.markers.detect import MarkerDetectionError
from lossmask.markers.policy import (
    FullSequenceWarning,
    MarkerFallbackWarning,
    MarkerResolutionError,
    Resolution,
    Steps,
    UnverifiedMarkersWarning,
    _from_user,
    _resolve_chat,
    resolve_markers,
)
from lossmask.markers.templates import TemplateEntry, TemplateMatch

DETECTED = Markers(response=[[1, 2]], end=[[9]])
FROM_TABLE = Markers(response=[[1, 3]], end=[[9]])
FROM_USER = Markers(response=[[1, 4]], end=[[9]])
ENTRY = TemplateEntry("chatml", ("<|im_start|>assistant\n",), ("<|im_start|>",), ("<|im_end|>",))


@dataclass
class FakeReport:
    ok: bool

    def summary(self) -> str:
        return "exact" if self.ok else "MISMATCH: 3 missing"

    def __str__(self) -> str:
        return self.summary()


@dataclass
class Fakes:
    """Stand-in steps that record what the policy asked them."""

    detect_error: BaseException | None = None
    match_result: TemplateMatch | None = None
    entry_error: BaseException | None = None
    verify_ok: bool = True
    verify_error: BaseException | None = None
    calls: list = field(default_factory=list)

    def steps(self) -> Steps:
        def detect(ct):
            self.calls.append(("detect", ct.name))
            if self.detect_error is not None:
                raise self.detect_error
            return DETECTED, FakeReport(True)

        def match(name):
            self.calls.append(("match", name))
            return self.match_result

        def entry_markers(ct, entry):
            self.calls.append(("entry_markers", entry.name))
            if self.entry_error is not None:
                raise self.entry_error
            return FROM_TABLE

        def strings_markers(ct, **strings):
            self.calls.append(("strings_markers", strings))
            return FROM_USER

        def verify(ct, markers):
            self.calls.append(("verify", markers))
            if self.verify_error is not None:
                raise self.verify_error
            return FakeReport(self.verify_ok)

        return Steps(detect, match, entry_markers, strings_markers, verify)


CT = SimpleNamespace(name="org/qwen2.5-7b-sft", tokenizer=SimpleNamespace(eos_token="<|im_end|>"))
TABLE_HIT = TemplateMatch("org/qwen2.5-7b-sft", "qwen2.5", "chatml", ENTRY)
NOT_FOUND = MarkerDetectionError("the assistant header holds no whole token")


# -- formats without masking ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "raw", "pretraining", "alpaca", "TEXT"])
def test_non_chat_formats_train_everything_quietly(fmt):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolution = resolve_markers(None, dataset_format=fmt)  # no tokenizer needed: nothing is looked at
    assert resolution.markers is None and resolution.source == "none" and not resolution.masking
    assert fmt.lower() in resolution.reason and resolution.messages == (resolution.reason,)


def test_alpaca_reason_says_how_to_mask():
    assert "dataset_format='chat'" in resolve_markers(None, dataset_format="alpaca").reason


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"dataset_format='sft' is not known.*'chat'.*'text'.*'alpaca'"):
        resolve_markers(None, dataset_format="sft")


def test_marker_strings_with_a_non_chat_format_are_refused():
    with pytest.raises(ValueError, match="dataset_format='chat'"):
        resolve_markers(None, dataset_format="text", response_part="### Response:")


def test_bad_argument_types():
    with pytest.raises(TypeError, match="strict must be"):
        resolve_markers(None, dataset_format="text", strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model_name must be a string"):
        resolve_markers(None, 7)  # type: ignore[arg-type]


# -- detection, then the table, then the loud fallback -------------------------------------------


def test_detection_first():
    fakes = Fakes(match_result=TABLE_HIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolution = _resolve_chat(CT, None, False, fakes.steps())
    assert resolution == Resolution(DETECTED, "detected", resolution.messages, resolution.reason, report=resolution.report)
    assert "detected" in resolution.reason and [c[0] for c in fakes.calls] == ["detect"]  # the table is not consulted


def test_detection_failure_falls_back_to_a_verified_table_entry_with_a_warning_naming_the_error():
    fakes = Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT)
    with pytest.warns(MarkerFallbackWarning, match="holds no whole token.*'chatml'"):
        resolution = _resolve_chat(CT, None, False, fakes.steps())
    assert resolution.markers == FROM_TABLE and resolution.source == "table" and resolution.template == "chatml"
    assert any("holds no whole token" in m for m in resolution.messages)
    assert ("match", CT.name) in fakes.calls  # no model_name: the tokenizer's own name
    assert ("verify", FROM_TABLE) in fakes.calls  # table markers are verified like detected ones


def test_model_name_is_what_the_table_matches_first():
    fakes = Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT)
    with pytest.warns(MarkerFallbackWarning):
        _resolve_chat(CT, "my-chatml-model", False, fakes.steps())
    assert [c for c in fakes.calls if c[0] == "match"] == [("match", "my-chatml-model")]


def test_the_tokenizer_name_is_tried_when_the_model_name_matches_nothing():
    fakes = Fakes(detect_error=NOT_FOUND)
    steps = fakes.steps()
    steps = Steps(steps.detect, lambda name: TABLE_HIT if name == CT.name else None, steps.entry_markers,
                  steps.strings_markers, steps.verify)
    with pytest.warns(MarkerFallbackWarning):
        resolution = _resolve_chat(CT, "my-private-model", False, steps)
    assert resolution.source == "table" and any("'my-private-model'" in m for m in resolution.messages)


@pytest.mark.parametrize(
    "fakes, said",
    [
        (Fakes(detect_error=NOT_FOUND, match_result=None), "no entry for the name 'org/qwen2.5-7b-sft'"),
        (Fakes(detect_error=NOT_FOUND, match_result=TemplateMatch("x", "falcon-3", None, None)), "does not serve"),
        (Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT, entry_error=MarkerDetectionError("'<|x|>' does not occur")),
         "'chatml' .*is not used: '<|x|>' does not occur"),
        (Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT, verify_ok=False), "'chatml' is not used: it fails verification"),
    ],
)
def test_both_miss_trains_the_full_sequence_loudly_or_raises_under_strict(fakes, said):
    with pytest.warns(FullSequenceWarning, match="FULL SEQUENCE") as record:
        resolution = _resolve_chat(CT, None, False, fakes.steps())
    assert resolution.markers is None and resolution.source == "none" and not resolution.masking
    assert "holds no whole token" in str(record[0].message)  # the warning carries the detection error
    messages = "\n".join(resolution.messages)
    assert "holds no whole token" in messages and "FULL SEQUENCE" in messages
    assert __import__("re").search(said, messages), messages

    with pytest.raises(MarkerResolutionError, match="holds no whole token") as raised:
        _resolve_chat(CT, None, True, fakes.steps())
    assert isinstance(raised.value, MarkerDetectionError)


def test_strict_with_a_verified_table_entry_does_not_raise():
    fakes = Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT)
    with pytest.warns(MarkerFallbackWarning):
        assert _resolve_chat(CT, None, True, fakes.steps()).source == "table"


@pytest.mark.parametrize("error", [RuntimeError("bug in the engine"), ValueError("bad ids"), TypeError("oops"), KeyError("k")])
def test_errors_other_than_detection_failure_propagate_from_detection(error):
    fakes = Fakes(detect_error=error, match_result=TABLE_HIT)
    with pytest.raises(type(error)):
        _resolve_chat(CT, None, False, fakes.steps())
    assert [c[0] for c in fakes.calls] == ["detect"]  # never taken for "detection failed"


def test_errors_while_applying_table_markers_propagate():
    fakes = Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT, entry_error=ValueError("negative token id"))
    with pytest.raises(ValueError, match="negative token id"):
        _resolve_chat(CT, None, False, fakes.steps())
    fakes = Fakes(detect_error=NOT_FOUND, match_result=TABLE_HIT, verify_error=RuntimeError("kernel failed"))
    with pytest.raises(RuntimeError, match="kernel failed"):
        _resolve_chat(CT, None, False, fakes.steps())


# -- the user's strings ---------------------------------------------------------------------------


def test_user_strings_are_located_with_the_eos_as_end_and_verified():
    fakes = Fakes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolution = _from_user(CT, "<|im_start|>assistant\n", ["<|im_start|>user\n"], False, fakes.steps())
    assert resolution.markers == FROM_USER and resolution.source == "user"
    strings = [c[1] for c in fakes.calls if c[0] == "strings_markers"]
    assert strings[-1] == {"response": ("<|im_start|>assistant\n",), "instruction": ("<|im_start|>user\n",), "end": ("<|im_end|>",)}
    assert ("verify", FROM_USER) in fakes.calls and "detect" not in [c[0] for c in fakes.calls]


def test_user_strings_that_do_not_verify_are_used_with_a_warning_or_refused_under_strict():
    fakes = Fakes(verify_ok=False)
    with pytest.warns(UnverifiedMarkersWarning, match="do not match"):
        resolution = _from_user(CT, "<|im_start|>assistant", None, False, fakes.steps())
    assert resolution.source == "user" and resolution.markers == FROM_USER and "NOT verified" in resolution.reason
    with pytest.raises(MarkerResolutionError, match="do not match"):
        _from_user(CT, "<|im_start|>assistant", None, True, fakes.steps())


def test_instruction_part_alone_is_refused():
    with pytest.raises(ValueError, match="without response_part"):
        _from_user(CT, None, "<|im_start|>user\n", False, Fakes().steps())


@pytest.mark.parametrize("bad", ["", [""], [3], []])
def test_bad_user_strings(bad):
    with pytest.raises(TypeError, match="response_part must be"):
        _from_user(CT, bad, None, False, Fakes().steps())


# -- real tokenizers ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3", "gpt-oss", "glm-4"])
def test_real_tokenizers_resolve_to_detected_markers_that_verify(family):
    from lossmask.markers.verify import verify

    path = chat_tokenizer(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FullSequenceWarning)
        resolution = resolve_markers(path)
    assert resolution.source == "detected" and resolution.markers is not None
    assert verify(path, resolution.markers).ok


@pytest.mark.parametrize("family, model_name", [("qwen3", None), ("gpt-oss", "openai/gpt-oss-20b-sft"), ("glm-4", "zai-org/GLM-4.5")])
def test_real_table_fallback_when_detection_fails(family, model_name):
    """Detection made to fail (and only that); the real table, markers_from_strings and verify do the rest."""
    ct = chat_tokenizer(family)

    def fail(ct):
        raise MarkerDetectionError("probe could not be analysed")

    default = Steps.default()
    steps = Steps(fail, default.match, default.entry_markers, default.strings_markers, default.verify)
    with pytest.warns(MarkerFallbackWarning, match="probe could not be analysed"):
        resolution = _resolve_chat(ct, model_name, False, steps)
    assert resolution.source == "table" and resolution.report.ok
    assert resolution.template == family


def test_real_template_that_renders_is_labelled_from_its_rendering_when_detection_and_table_miss():
    from lossmask import ChatTokenizer
    from lossmask.chat.turn_spans import FromRendering

    ct = ChatTokenizer(chat_tokenizer("qwen2.5").tokenizer, name="private-checkpoint")  # a name the table does not know

    def fail(ct):
        raise MarkerDetectionError("probe could not be analysed")

    default = Steps.default()
    steps = Steps(fail, default.match, default.entry_markers, default.strings_markers, default.verify, default.rendered)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FullSequenceWarning)  # the template renders: the full sequence never trains
        resolution = _resolve_chat(ct, "some-private-model", False, steps)
        assert _resolve_chat(ct, "some-private-model", True, steps).source == "rendered"  # strict: labelled, not raised
        other = _resolve_chat(ct, "llama-3", False, steps)
    assert resolution.source == "rendered" and isinstance(resolution.markers, FromRendering) and resolution.masking
    assert "some-private-model" in "\n".join(resolution.messages) and "keeps every rule" in resolution.reason
    # the table entry of another family does not verify on this template, and is said so
    assert other.source == "rendered" and any("'llama-3'" in m and "not used" in m for m in other.messages)
    # without the rendering step (a template that renders nothing), the full sequence trains, loudly
    bare = Steps(fail, default.match, default.entry_markers, default.strings_markers, default.verify)
    with pytest.warns(FullSequenceWarning):
        assert _resolve_chat(ct, "some-private-model", False, bare).source == "none"


def test_unsloth_studio_marker_strings_on_the_tokenizer_are_read_as_user_markers():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path("llama-3")), local_files_only=True)
    tokenizer._unsloth_input_part = "<|start_header_id|>user<|end_header_id|>\n\n"
    tokenizer._unsloth_output_part = "<|start_header_id|>assistant<|end_header_id|>\n\n"
    resolution = resolve_markers(tokenizer)
    assert resolution.source == "user" and resolution.report.ok
    assert "_unsloth" not in resolution.reason and "response_part=['<|start_header_id|>assistant" in resolution.messages[0]


def test_real_user_strings_unsloth_shape():
    path = chat_tokenizer("llama-3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolution = resolve_markers(
            path,
            instruction_part="<|start_header_id|>user<|end_header_id|>\n\n",
            response_part="<|start_header_id|>assistant<|end_header_id|>\n\n",
        )
    assert resolution.source == "user" and resolution.report.ok
    assert resolution.markers.end == ((128009,),)  # <|eot_id|>, the EOS, trains


def test_real_user_string_that_never_occurs_is_an_error_not_a_fallback():
    with pytest.raises(MarkerDetectionError, match="does not occur"):
        resolve_markers(chat_tokenizer("qwen2.5"), response_part="<|assistant|>")


def test_tokenizer_without_a_chat_template_trains_the_full_sequence_loudly():
    from transformers import AutoTokenizer

    from lossmask.chat.tokenizer import ChatTemplateError

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path("qwen2.5")), local_files_only=True)
    tokenizer.chat_template = None
    with pytest.warns(FullSequenceWarning, match="FULL SEQUENCE") as record:
        resolution = resolve_markers(tokenizer)
    assert record[0].filename == __file__  # the warning points at the caller's line
    assert resolution.markers is None and resolution.source == "none"
    assert any("has no chat template" in m for m in resolution.messages)
    with pytest.raises(MarkerResolutionError, match="has no chat template"):
        resolve_markers(tokenizer, strict=True)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        resolve_markers(tokenizer, response_part="<|im_start|>assistant\n")
