"""Hostile weight values and span offsets: each ends in one line naming what is wrong, or in a counted outcome;
nothing that float32 cannot hold is written, and no span offset is cast past its type (docs/weights.md, "Values")."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import tempfile
import warnings

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tokenizer_path
from lossmask.cli import main
from lossmask.options import MAX_WEIGHT, MaskOptions

from test_weights import label, weighted_text

SPAN_KEYS = ("begin_offset", "end_offset")


def chat(weight=None, detail=None, answer="Alpha beta gamma."):
    assistant = {"role": "assistant", "content": answer}
    if weight is not None:
        assistant["weight"] = weight
    if detail is not None:
        assistant["train_detail"] = detail
    return [{"role": "user", "content": "Hi there"}, assistant]


def run_cli(folder, rows, *flags):
    """``lossmask mask`` on ``rows`` (chats, one JSON line each) with chatml: exit code, stderr, report or None."""
    source, output, report = (os.path.join(folder, name) for name in ("in.jsonl", "out.parquet", "report.json"))
    with open(source, "w") as fh:
        fh.writelines(json.dumps({"messages": messages}) + "\n" for messages in rows)
    err = io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):  # Python's own, on stderr as the CLI would
        if issubclass(category, UserWarning) and "fastokens" not in str(message):
            err.write(warnings.formatwarning(message, category, filename, lineno, line))

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show
        code = main(["mask", source, output, "--tokenizer", str(tokenizer_path("chatml")), "--report", report,
                     "--no-progress", "--max-drop-fraction", "1", *flags])
    on_disk = json.loads(open(report).read()) if code == 0 else None
    return code, err.getvalue(), on_disk, output


# -- weights float32 cannot hold -------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e39, 1e308, 3.5e38, 3.4028235677973366e38])
def test_a_message_weight_beyond_float32_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"message 1: weight=.* is beyond float32's range"):
        label("chatml", [chat(weight=value)])


def test_a_span_weight_beyond_float32_is_refused_naming_the_span():
    detail = [{"begin_offset": 0, "end_offset": 4, "weight": 1e39}]
    with pytest.raises(ValueError, match=r"message 1, train_detail span 0: weight=1e\+39 is beyond float32's range"):
        label("chatml", [chat(detail=detail)])


@pytest.mark.parametrize("field", ["prompt_weight", "reasoning"])
def test_an_option_weight_beyond_float32_is_refused_naming_the_option(field):
    with pytest.raises(ValueError, match=rf"{field}=1e\+39 must be a finite weight.*float32 holds none above"):
        MaskOptions(**{field: 1e39})
    with pytest.raises(ValueError, match=r"weights_by_role\['user'\]=1e\+39"):
        MaskOptions(weights_by_role="user=1e39")


def test_float32s_largest_weight_is_written_as_it_is():
    out, _ = label("chatml", [chat(weight=MAX_WEIGHT)])
    weights = [w for w in out["loss_weights"][0].as_py() if w]
    assert weights and all(math.isfinite(w) and w == pytest.approx(MAX_WEIGHT) for w in weights)


def test_the_command_line_refuses_a_weight_beyond_float32_in_one_line(tmp_path):
    code, err, _, output = run_cli(tmp_path, [chat(weight=1e39)])
    assert code == 1 and len(err.strip().splitlines()) == 1 and not os.path.exists(output)
    assert re.search(r"error: row 0 \(.*in\.jsonl, line 1\), message 1: weight=1e\+39 is beyond float32's range", err)
    code, err, _, output = run_cli(tmp_path, [chat()], "--prompt-weight", "1e39")
    assert code == 1 and "prompt_weight=1e+39" in err and len(err.strip().splitlines()) == 1


# -- span offsets ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value", [("end_offset", 2 ** 63), ("end_offset", 2 ** 64 + 1), ("begin_offset", -1),
                                        ("begin_offset", -(2 ** 63)), ("end_offset", "4"), ("end_offset", 2.5),
                                        ("end_offset", True), ("end_offset", 17), ("end_offset", float("nan"))])
def test_a_span_offset_that_is_not_within_the_message_is_refused(key, value):
    # planned straight from the messages (Python callers' rows; Arrow cannot hold the offsets past int64 itself)
    from lossmask.chat.locate import locate_messages
    from lossmask.chat.weights import plan_row

    messages = chat(detail=[{"begin_offset": 0, "end_offset": 4, "train": False, key: value}])
    text = "Hi there Alpha beta gamma."
    with pytest.raises(ValueError, match=rf"row 0, message 1, train_detail span 0: {key}=.* is not a character offset "
                                         r"within the message's content \(integers, 0\.\.16"):
        plan_row(text, messages, locate_messages(text, messages), MaskOptions())


def test_a_span_that_ends_before_it_begins_is_refused():
    with pytest.raises(ValueError, match=r"span 1: end_offset=2 is before begin_offset=3"):
        label("chatml", [chat(detail=[{"begin_offset": 0, "end_offset": 1}, {"begin_offset": 3, "end_offset": 2}])])


def test_a_span_train_that_is_not_a_boolean_is_refused():
    with pytest.raises(ValueError, match=r"span 0: train='false'; pass true or false"):
        label("chatml", [chat(detail=[{"begin_offset": 0, "end_offset": 4, "train": "false"}])])


def test_the_last_character_is_a_valid_end_offset():
    detail = [{"begin_offset": 0, "end_offset": 16, "train": True}, {"begin_offset": 6, "end_offset": 9, "train": False}]
    out, _ = label("chatml", [chat(detail=detail)])
    assert weighted_text("chatml", out) == [("Alpha", 1.0), ("gamma.<|im_end|>", 1.0)]


def test_the_command_line_refuses_an_int64_overflowing_offset_in_one_line(tmp_path):
    detail = [{"begin_offset": 0, "end_offset": 2 ** 63, "train": False}]
    code, err, _, output = run_cli(tmp_path, [chat(detail=detail)])
    assert code == 1 and len(err.strip().splitlines()) == 1 and not os.path.exists(output), err
    assert re.search(r"error: row 0 \(.*in\.jsonl, line 1\), message 1, train_detail span 0: end_offset=", err), err


# -- weights that are zero ---------------------------------------------------------------------------------------

def test_rows_weighted_zero_in_any_spelling_are_counted_as_weights_zero(tmp_path):
    rows = [chat(weight=w) for w in (False, -0.0, 1e-50, 0)] + [chat()]
    code, err, report, output = run_cli(tmp_path, rows)
    assert code == 0, err
    assert report["dropped"]["weights_zero"] == 4 and report["dropped"]["empty_response"] == 0
    assert report["rows_in"] == report["rows_out"] + sum(report["dropped"].values()) == 5


def test_minus_zero_is_written_as_zero():
    out, _ = label("chatml", [chat(weight=-0.0), chat(weight=0.5)], keep_dropped=True)
    assert out.num_rows == 2 and all(math.copysign(1.0, w) == 1.0 for w in out["loss_weights"][0].as_py())


# -- options that are accepted but probably not meant -----------------------------------------------------------

def test_a_role_weight_for_a_role_no_template_writes_warns():
    with pytest.warns(UserWarning, match=r"'wizard', which no chat template writes as a role.*role_map"):
        MaskOptions(weights_by_role="wizard=1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskOptions(weights_by_role="user=0.1,tool=0.2", roles_to_train=["assistant", "system"])
        MaskOptions(weights_by_role={"wizard": 1}, role_map={"merlin": "wizard"})  # mapped to: a role of the data


def test_a_weight_field_that_holds_no_weight_warns():
    with pytest.warns(UserWarning, match=r"weight_field='content' names a message field that holds no weight.*"
                                         r"weight_field='auto'"):
        MaskOptions(weight_field="content")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MaskOptions(weight_field="score")


def test_the_command_line_warns_in_one_line(tmp_path):
    code, err, _, _ = run_cli(tmp_path, [chat()], "--weights-by-role", "wizard=1", "--weight-field", "content")
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("lossmask mask: warning: ") for line in lines), err
    assert "'wizard'" in lines[0] and "weight_field='content'" in lines[1]


# -- the property: hostile weights and offsets through the command line ----------------------------------------

EDGE_WEIGHTS = st.sampled_from([0, -0.0, 1e-50, 1e-45, 0.5, 1, MAX_WEIGHT, 3.4028235677973366e38, 3.5e38, 1e39, 1e308,
                                2 ** 128, -1e-30, -1])
EDGE_OFFSETS = st.one_of(st.integers(0, 20), st.sampled_from([-1, 2 ** 31, 2 ** 32, 2 ** 63 - 1, 2 ** 63, -(2 ** 63),
                                                             -(2 ** 63) - 1, 2 ** 64]))


@st.composite
def weighted_rows(draw):
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        weight = draw(st.one_of(st.none(), EDGE_WEIGHTS))
        spans = draw(st.lists(st.fixed_dictionaries({"begin_offset": EDGE_OFFSETS, "end_offset": EDGE_OFFSETS,
                                                     "train": st.booleans()}), max_size=2))
        rows.append(chat(weight=weight, detail=spans or None))
    return rows, draw(st.sampled_from([[], ["--prompt-weight", "1e39"], ["--prompt-weight", "3.4e38"],
                                       ["--weights-by-role", "user=1e308"], ["--loss-weights"]]))


def _acceptable(rows, flags) -> bool:
    """Would every value of the job be accepted: weights 0..MAX_WEIGHT, offsets within the 17 characters?"""
    for messages in rows:
        assistant = messages[1]
        if not 0 <= assistant.get("weight", 0) <= MAX_WEIGHT:
            return False
        for span in assistant.get("train_detail") or ():
            if not 0 <= span["begin_offset"] <= span["end_offset"] < 17:
                return False
    return not any(value in flags for value in ("1e39", "user=1e308"))


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(job=weighted_rows())
def test_hostile_weights_and_offsets_end_in_finite_weights_or_one_line(job):
    rows, flags = job
    with tempfile.TemporaryDirectory() as folder:
        code, err, report, output = run_cli(folder, rows, *flags)
        assert "Traceback" not in err
        if not _acceptable(rows, flags):
            assert code == 1 and not os.path.exists(output), err
            line, = err.strip().splitlines()
            assert line.startswith("lossmask mask: error: ") and ("row " in line or "=" in line), err
            return
        assert code == 0, err
        assert report["rows_in"] == report["rows_out"] + sum(report["dropped"].values())
        table = pq.read_table(output)
        if "loss_weights" in table.column_names:
            values = [w for row in table["loss_weights"].to_pylist() for w in row]
            assert all(math.isfinite(w) and 0 <= w <= MAX_WEIGHT for w in values)
