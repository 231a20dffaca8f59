"""The conversation shapes real dumps hold, and the role invariant.

The shapes are those of a public ShareGPT dump (a chat that opens with
an assistant message, a role repeated, an empty message, ShareGPT's ``{from, value}``, OpenAI text parts),
run through ``mask_files`` (and the CLI) on real tokenizers with their real chat templates. Kept rows are
checked with an oracle that reads the trained tokens back as text: no user text in them, every assistant
reply in them.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import warnings

import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FIXTURES, chat_tokenizer
from lossmask import MaskOptions, mask_files
from lossmask.chat.encode_batch import messages_from_arrow
from lossmask.cli import main

sys.path.insert(0, str(FIXTURES))
from loaded_once import folders_loaded_once  # noqa: E402

sys.path.pop(0)

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731

PHI3_REPEATED_USER = [U("666"), U("what does this number mean?"), A("666 is called the number of the beast.")]
LEADING_ASSISTANT = [A("Sure, here is the rest."), U("Thanks."), A("It reads the file.")]
ASSISTANT_TWICE = [U("Read the file."), A("It opens the file."), A("Then it reads every line.")]
EMPTY_ASSISTANT = [U("Hello there."), A(""), U("Are you still there?"), A("Yes, I am here.")]


def _mask(tmp_path, family, chats, name="in.jsonl", column="messages", **options):
    path = tmp_path / name
    with open(path, "w", encoding="utf-8") as fh:
        for chat in chats:
            fh.write(json.dumps({column: chat}) + "\n")
    out = tmp_path / (name + ".parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Falcon's no-stop-token warning
        report = mask_files(path, out, tokenizer=chat_tokenizer(family), max_drop_fraction=1.0, **options)
    assert report.rows_in == report.rows_out + sum(report.dropped.values())
    return report, pq.read_table(out)


def _trained_text(family, table, row=0) -> str:
    ids, labels = table.column("input_ids")[row].as_py(), table.column("labels")[row].as_py()
    return chat_tokenizer(family).decode([t for t, label in zip(ids, labels) if label != -100])


def _assert_roles_kept(family, table, chats_out) -> None:
    """The oracle: in every kept row no user or system text trains, and every assistant reply does (compared with
    whitespace runs made one space: Falcon rewrites blank lines)."""
    for row, chat in enumerate(chats_out):
        trained = _flat(_trained_text(family, table, row))
        for message in chat:
            if message["role"] in ("user", "system"):
                assert _flat(message["content"]) not in trained, (family, row, message, trained)
            elif message["role"] == "assistant" and message["content"]:
                assert _flat(message["content"]) in trained, (family, row, message, trained)


def _flat(text: str) -> str:
    return " ".join(text.split())


# -- shapes as a policy, counted by shape ---------------------------------------------------------------------

MESSY = [PHI3_REPEATED_USER, LEADING_ASSISTANT, ASSISTANT_TWICE, EMPTY_ASSISTANT, [A("Only a greeting.")],
         [S("Be brief."), A("Hi."), U("What is 2 + 2?"), A("4.")]]
NORMALISED = [
    [U("666\n\nwhat does this number mean?"), A("666 is called the number of the beast.")],
    [U("Thanks."), A("It reads the file.")],
    [U("Read the file."), A("It opens the file.\n\nThen it reads every line.")],
    [U("Hello there.\n\nAre you still there?"), A("Yes, I am here.")],
    [S("Be brief."), U("What is 2 + 2?"), A("4.")],
]


@pytest.mark.parametrize("family", ["falcon", "gemma-3", "mistral-v3", "llama-2", "phi-3", "chatml"])
def test_messy_shapes_are_normalised_kept_and_counted(tmp_path, family):
    report, table = _mask(tmp_path, family, MESSY)
    # every conversation holding a user and an assistant message is kept; the one without is no_exchange
    assert report.rows_out == 5 and report.dropped["invalid"] == 0, report.summary()
    assert report.dropped["no_exchange"] == 1 and "no_exchange: row 4: " in "\n".join(report.dropped_examples)
    assert report.shapes == {"leading_assistant_dropped": 3, "roles_merged": 3, "empty_messages_dropped": 1}
    assert report.to_dict()["shapes"] == report.shapes
    assert "conversation shapes changed before rendering (rows): leading_assistant_dropped 3" in report.summary()
    assert messages_from_arrow(table.column("messages"))[0][1]["content"] == "what does this number mean?"  # as it was
    _assert_roles_kept(family, table, NORMALISED)


def test_the_policy_can_be_turned_off_and_the_template_decides(tmp_path):
    report, table = _mask(tmp_path, "falcon", MESSY[:4], consecutive_roles="keep", leading_assistant="keep",
                          empty_messages="keep")
    assert report.shapes == {}
    # Falcon refuses the repeated roles; the empty assistant message it renders, and then the markers would train
    # the user text after it: that row is labelled from its rendering instead
    assert report.dropped["invalid"] == 3 and "template_breaks_roles" not in report.dropped
    assert report.rows_out == 1 and report.labelled_from_rendering == 1
    _assert_roles_kept("falcon", table, [EMPTY_ASSISTANT])
    with pytest.raises(ValueError, match="consecutive_roles='join'; pass one of"):
        MaskOptions(consecutive_roles="join")


def test_cli_flags_are_documented_and_reach_the_job(tmp_path):
    help_text = io.StringIO()
    with contextlib.redirect_stdout(help_text), pytest.raises(SystemExit):
        main(["mask", "--help"])
    for flag in ("--consecutive-roles", "--leading-assistant", "--empty-messages", "--role-map", "--check-roles"):
        assert flag in help_text.getvalue()
    with open(tmp_path / "in.jsonl", "w") as fh:
        for chat in MESSY:
            fh.write(json.dumps({"messages": chat}) + "\n")
    from conftest import tokenizer_path

    for extra in ([], ["--consecutive-roles", "keep", "--leading-assistant", "keep"]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(["mask", str(tmp_path / "in.jsonl"), str(tmp_path / "out.parquet"), "--tokenizer",
                         str(tokenizer_path("mistral-v1")), "--max-drop-fraction", "1", "--no-progress",
                         "--report", str(tmp_path / "r.json"), *extra])
        assert code == 0, err.getvalue()
        report = json.loads((tmp_path / "r.json").read_text())
        assert (report["dropped"]["invalid"] > 0) == bool(extra)  # Mistral refuses repeated roles
        assert "conversation shapes changed before rendering (rows): " in out.getvalue()
        assert ("roles_merged" in report["shapes"]) == (not extra)


# -- the role invariant ---------------------------------------------------------------------------------------

def test_phi3_two_user_messages_are_merged_or_labelled_from_the_rendering(tmp_path):
    report, table = _mask(tmp_path, "phi-3", [PHI3_REPEATED_USER])
    assert report.rows_out == 1 and report.shapes == {"roles_merged": 1}
    trained = _trained_text("phi-3", table)
    assert "what does this number mean?" not in trained and "666 is called the number of the beast." in trained
    # with merging off, the template writes <|assistant|> after the first user message: the markers break the roles,
    # so the row is labelled from its rendering (the turn starts after the last generation prompt), counted apart
    report, table = _mask(tmp_path, "phi-3", [PHI3_REPEATED_USER], name="keep.jsonl", consecutive_roles="keep")
    assert report.rows_out == 1 and "template_breaks_roles" not in report.dropped
    assert report.labelled_from_rendering == 1 and "labelled_from_rendering: 1 rows" in report.summary()
    assert report.to_dict()["labelled_from_rendering"] == 1
    assert _trained_text("phi-3", table) == "666 is called the number of the beast.<|end|>"


@pytest.mark.parametrize("family", ["deepseek-v3.1", "phi-3"])
def test_an_assistant_message_without_a_header_is_counted_not_silent(tmp_path, family):
    kept = dict(consecutive_roles="keep", leading_assistant="keep")
    report, table = _mask(tmp_path, family, [ASSISTANT_TWICE, LEADING_ASSISTANT], **kept)
    # the second reply has no header: found from the rendering, the row trains both; an opening assistant message
    # has no generation prompt before it (the template renders none for an empty chat): dropped, and counted
    assert report.rows_out == 1 and report.labelled_from_rendering == 1, report.summary()
    assert report.dropped["template_breaks_roles"] == 1, report.summary()
    assert "message 0 (assistant) and does not train" in report.dropped_examples[0]
    _assert_roles_kept(family, table, [ASSISTANT_TWICE])
    # under the default policy both rows train every reply
    report, table = _mask(tmp_path, family, [ASSISTANT_TWICE, LEADING_ASSISTANT], name="default.jsonl")
    assert report.rows_out == 2 and "template_breaks_roles" not in report.dropped
    _assert_roles_kept(family, table, [NORMALISED[2], NORMALISED[1]])


def test_falcon_empty_assistant_message_never_trains_the_user_text_after_it(tmp_path):
    report, table = _mask(tmp_path, "falcon", [EMPTY_ASSISTANT])
    assert report.rows_out == 1 and report.shapes == {"empty_messages_dropped": 1, "roles_merged": 1}
    _assert_roles_kept("falcon", table, [NORMALISED[3]])
    # kept empty, the markers would train the user text after it: the row is labelled from its rendering instead
    report, table = _mask(tmp_path, "falcon", [EMPTY_ASSISTANT], name="keep.jsonl", empty_messages="keep")
    assert report.rows_out == 1 and "template_breaks_roles" not in report.dropped
    assert report.labelled_from_rendering == 1
    _assert_roles_kept("falcon", table, [EMPTY_ASSISTANT])


def _call(i: int, city: str) -> dict:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}


TOOL_AFTER_TOOL = [
    U("Weather in Paris, then Rome?"),
    {"role": "assistant", "content": "", "tool_calls": [_call(1, "Paris")]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    {"role": "assistant", "content": "", "tool_calls": [_call(2, "Rome")]},
    {"role": "tool", "tool_call_id": "call_2", "content": "Cloudy, 18 C"},
    A("Paris is sunny and Rome is cloudy."),
]


@pytest.mark.parametrize("family", ["deepseek-v3", "deepseek-v3.1", "qwen2.5", "llama-3.1"])
def test_a_tool_call_right_after_a_tool_result_trains(tmp_path, family):
    report, table = _mask(tmp_path, family, [TOOL_AFTER_TOOL])
    assert report.rows_out == 1 and "template_breaks_roles" not in report.dropped, report.summary()
    trained = _trained_text(family, table)
    assert "Rome" in trained and "Paris is sunny and Rome is cloudy." in trained
    assert "Sunny, 21 C" not in trained and "Weather in Paris" not in trained


def test_deepseek_v3_is_the_template_the_markers_cannot_read_and_its_rendering_labels_it(tmp_path):
    report, table = _mask(tmp_path, "deepseek-v3", [TOOL_AFTER_TOOL])
    assert report.labelled_from_rendering == 1 and report.rows_out == 1
    trained = _trained_text("deepseek-v3", table)
    # both calls train, each through its stop token, as TRL trains them; no tool result, no user text
    assert trained.count('"city": "Paris"') == 1 and trained.count('"city": "Rome"') == 1
    assert trained.count("<｜end▁of▁sentence｜>") == 3
    assert "Sunny" not in trained and "Cloudy" not in trained and "Weather" not in trained


def test_the_invariant_on_every_row_finds_nothing_on_plain_rows(tmp_path):
    rows = [[U("What is 2 + 2?"), A("4.")], [S("Be brief."), U("Hi"), A("Hello."), U("Bye"), A("Goodbye.")]]
    for family in ("qwen2.5", "llama-3.1", "gemma-3"):
        report, table = _mask(tmp_path, family, rows, name=f"{family}.jsonl", check_roles="all")
        assert report.rows_out == 2 and report.shapes == {}
        _assert_roles_kept(family, table, rows)


# -- ShareGPT -------------------------------------------------------------------------------------------------

SHAREGPT = [
    [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Name a prime."},
     {"from": "gpt", "value": "Seven."}],
    [{"from": "bing", "value": "Welcome back."}, {"from": "human", "value": "And an even one?"},
     {"from": "chatgpt", "value": "Two."}],
    [{"from": "human", "value": "Hi"}, {"from": "narrator", "value": "(a pause)"}, {"from": "bard", "value": "Hello."}],
]


def test_sharegpt_conversations_are_read_with_a_role_map(tmp_path):
    report, table = _mask(tmp_path, "qwen2.5", SHAREGPT, column="conversations")
    assert report.rows_out == 2 and report.dropped["invalid"] == 1
    error = report.invalid_examples[0]
    assert "column 'conversations': message 1 has 'from': 'narrator'" in error
    assert "human=user" in error and "--role-map narrator=ROLE" in error
    assert report.shapes["sharegpt_messages_read"] == 2 and report.shapes["leading_assistant_dropped"] == 1
    _assert_roles_kept("qwen2.5", table, [[S("You are terse."), U("Name a prime."), A("Seven.")],
                                          [U("And an even one?"), A("Two.")]])
    # the user's map goes over the default: the narrator speaks as the user (and is merged with the user before)
    report, table = _mask(tmp_path, "qwen2.5", SHAREGPT[2:], name="mapped.jsonl", column="conversations",
                          role_map="narrator=user")
    assert report.rows_out == 1
    _assert_roles_kept("qwen2.5", table, [[U("Hi\n\n(a pause)"), A("Hello.")]])
    assert MaskOptions(role_map={"narrator": "user"}) == MaskOptions(role_map="narrator=user")
    with pytest.raises(ValueError, match="'narrator' is not SPEAKER=ROLE"):
        MaskOptions(role_map="narrator")


# -- text parts on a template that takes strings --------------------------------------------------------------

def test_text_parts_are_joined_never_rendered_as_a_python_repr(tmp_path):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this file."}]},
             {"role": "assistant", "content": [{"type": "text", "text": "It is a CSV file."}]}]
    image = [{"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "What is it?"}]},
             A("A cat.")]
    report, table = _mask(tmp_path, "llama-3.1", [parts, image])
    assert report.rows_out == 1 and report.shapes["content_parts_joined"] == 1
    rendered = chat_tokenizer("llama-3.1").decode(table.column("input_ids")[0].as_py())
    assert "'type'" not in rendered and "Describe\nthis file." in rendered
    assert _trained_text("llama-3.1", table).startswith("It is a CSV file.")
    assert report.dropped["invalid"] == 1 and "holds a content part of type 'image'" in report.invalid_examples[0]


def test_a_text_part_without_a_string_is_invalid_with_one_line_that_names_its_text(tmp_path):
    null_text = [U("Describe it."), {"role": "assistant", "content": [{"type": "text", "text": None}]}]
    no_text = [{"role": "user", "content": [{"type": "text"}]}, A("Fine.")]
    number = [{"role": "user", "content": [{"type": "text", "text": 7}]}, A("Seven.")]
    report, _ = _mask(tmp_path, "llama-3.1", [null_text, no_text, number, [U("Hi."), A("Hello.")]])
    assert report.rows_out == 1 and report.dropped["invalid"] == 3
    said = [example.split(": ", 1)[1] for example in report.invalid_examples]
    assert [line.split("'messages': ", 1)[1].removesuffix(" (rows counted from 0)") for line in said] == [
        'message 1 (assistant) holds a text part whose \'text\' is null, not a string; give it a string ("" for no '
        "text) or remove the part (LLaMA-Factory's v1 parts hold it under 'value')",
        'message 0 (user) holds a text part whose \'text\' is missing, not a string; give it a string ("" for no '
        "text) or remove the part (LLaMA-Factory's v1 parts hold it under 'value')",
        'message 0 (user) holds a text part whose \'text\' is a int, not a string; give it a string ("" for no '
        "text) or remove the part (LLaMA-Factory's v1 parts hold it under 'value')",
    ]
    assert all("type 'text'" not in line and "\n" not in line for line in report.invalid_examples)


# -- the CLI property: messy shapes either train with the roles kept, or are counted --------------------------

MESSAGES = st.sampled_from([U("Hi there."), U("Tell me more."), A("Sure thing."), A("Here it is."), A(""), U(""),
                            S("Be kind.")])


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(chats=st.lists(st.lists(MESSAGES, min_size=1, max_size=6), min_size=1, max_size=6),
       merge=st.sampled_from(["merge", "keep"]), leading=st.sampled_from(["drop", "keep"]),
       empty=st.sampled_from(["drop", "keep"]), family=st.sampled_from(["phi-3", "falcon", "deepseek-v3.1"]))
def test_cli_property_every_messy_run_adds_up_and_keeps_the_roles(chats, merge, leading, empty, family):
    from conftest import tokenizer_path

    # the CLI is given the family's folder, answered by the tokenizer loaded once per test run
    with tempfile.TemporaryDirectory() as base, folders_loaded_once(family):
        source, output, report_path = (os.path.join(base, n) for n in ("in.jsonl", "out.parquet", "r.json"))
        with open(source, "w") as fh:
            for chat in chats:
                fh.write(json.dumps({"messages": chat}) + "\n")
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = main(["mask", source, output, "--tokenizer", str(tokenizer_path(family)), "--no-progress",
                         "--max-drop-fraction", "1", "--report", report_path, "--consecutive-roles", merge,
                         "--leading-assistant", leading, "--empty-messages", empty])
        assert code == 0 and "Traceback" not in err.getvalue(), err.getvalue()
        report = json.loads(open(report_path).read())
        assert report["rows_in"] == report["rows_out"] + sum(report["dropped"].values()) == len(chats)
        table = pq.read_table(output)
        assert table.num_rows == report["rows_out"]
        tok = chat_tokenizer(family)
        for row in range(table.num_rows):
            ids, labels = table.column("input_ids")[row].as_py(), table.column("labels")[row].as_py()
            trained = tok.decode([t for t, label in zip(ids, labels) if label != -100])
            for message in messages_from_arrow(table.column("messages"))[row]:
                if message["role"] != "assistant" and message["content"].strip():
                    assert message["content"] not in trained, (family, message, trained)


def test_a_weight_on_a_message_keeps_the_shape_plain():
    """OpenAI's ``weight`` (or any weight field holding a number or boolean) changes no rendering: such rows are not
    singled out for the role check; a weight field holding anything else, or another key, still is."""
    from lossmask.chat.shapes import normalise_shapes
    from lossmask.options import MaskOptions

    def shaped(assistant):
        return normalise_shapes([[{"role": "user", "content": "hi"}, assistant]], MaskOptions()).unusual[0]

    assert not shaped({"role": "assistant", "content": "ok", "weight": 0})
    assert not shaped({"role": "assistant", "content": "ok", "loss": True, "loss_scale": 2.5})
    assert shaped({"role": "assistant", "content": "ok", "weight": "0"})
    assert shaped({"role": "assistant", "content": "ok", "name": "bot"})


# -- LLaMA-Factory v1 content parts ({"type", "value"}) ----------------------------------------------------------

def _v1(role, *parts, **rest):
    return {"role": role, "content": [{"type": kind, "value": value} for kind, value in parts], **rest}


def test_v1_value_parts_are_read_as_text_reasoning_and_tool_calls(tmp_path):
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    chats = [
        [_v1("user", ("text", "hi"), loss_weight=0.0), _v1("assistant", ("text", "Hello there."), loss_weight=1.0)],
        [_v1("system", ("text", "Use tools.")), _v1("user", ("text", "Weather in Oslo?")),
         _v1("assistant", ("reasoning", "The user wants the weather."), ("tool_call", call)),
         _v1("tool", ("text", '{"temp": 3}')), _v1("assistant", ("text", "It is 3 degrees."))],
    ]
    report, table = _mask(tmp_path, "qwen3", chats)
    assert report.rows_out == 2 and report.shapes["v1_content_parts_read"] == 2
    assert _trained_text("qwen3", table, 0).endswith("Hello there.<|im_end|>")
    trained = _trained_text("qwen3", table, 1)
    assert "get_weather" in trained and "It is 3 degrees." in trained
    assert "Weather in Oslo?" not in trained and "Use tools." not in trained and '"temp"' not in trained
    rendered = chat_tokenizer("qwen3").decode(table.column("input_ids")[1].as_py())
    assert "'value'" not in rendered and "'type'" not in rendered


def test_a_v1_part_without_a_string_value_is_invalid_with_one_line_naming_value(tmp_path):
    missing = [{"role": "user", "content": [{"type": "text", "value": None}]}, A("Fine.")]
    image = [_v1("user", ("image_url", "a.png"), ("text", "What is it?")), A("A cat.")]
    report, _ = _mask(tmp_path, "llama-3.1", [missing, image, [U("Hi."), A("Hello.")]])
    assert report.rows_out == 1 and report.dropped["invalid"] == 2
    first, second = report.invalid_examples
    assert "'text' part whose 'value' is null, not a string" in first and "\n" not in first
    assert "v1 content part of type 'image_url'" in second and "\n" not in second
