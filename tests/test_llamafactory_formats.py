"""The formats LLaMA-Factory users hold, read as LLaMA-Factory reads them: Alpaca rows, a dataset registered in
``dataset_info.json``, and the rows of its ``data/`` samples.

The rows are written here from LLaMA-Factory's documented behaviour (its data/README.md and converter): no
LLaMA-Factory is installed. Each Alpaca row is checked against the same chat given as ``messages``: the tokens and
the labels must be the same, so that Alpaca is exactly a way of writing a chat.
"""

from __future__ import annotations

import json
import warnings

import pyarrow.parquet as pq
import pytest

from conftest import chat_tokenizer
from lossmask import MaskOptions, mask_files

U = lambda text: {"role": "user", "content": text}  # noqa: E731
A = lambda text: {"role": "assistant", "content": text}  # noqa: E731
S = lambda text: {"role": "system", "content": text}  # noqa: E731

ALPACA = [
    {"instruction": "Name a prime.", "input": "", "output": "Seven."},
    {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
    {"instruction": "", "input": "Only an input here.", "output": "Noted."},
    {"instruction": "And an even one?", "input": "", "output": "Two.", "system": "You are terse.",
     "history": [["Name a prime.", "Seven."], ["Another?", "Eleven."]]},
]
# the same rows as LLaMA-Factory's converter makes them: instruction and input joined with "\n" (the empty ones left
# out), the system message first, each history pair an earlier exchange
AS_MESSAGES = [
    [U("Name a prime."), A("Seven.")],
    [U("Translate to French.\nGood morning"), A("Bonjour")],
    [U("Only an input here."), A("Noted.")],
    [S("You are terse."), U("Name a prime."), A("Seven."), U("Another?"), A("Eleven."), U("And an even one?"),
     A("Two.")],
]


def _write(path, rows, *, lines=True):
    with open(path, "w", encoding="utf-8") as fh:
        if lines:
            fh.writelines(json.dumps(row) + "\n" for row in rows)
        else:
            json.dump(rows, fh, indent=2)
    return path


def _mask(tmp_path, family, rows, name="in.jsonl", **options):
    path = _write(tmp_path / name, rows, lines=not name.endswith(".json"))
    out = tmp_path / (name + ".parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(path, out, tokenizer=chat_tokenizer(family), max_drop_fraction=1.0, **options)
    return report, pq.read_table(out)


def _trained(family, table, row):
    ids, labels = table.column("input_ids")[row].as_py(), table.column("labels")[row].as_py()
    return chat_tokenizer(family).decode([t for t, label in zip(ids, labels) if label != -100])


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1", "mistral-v3"])
def test_alpaca_rows_label_as_the_chat_llamafactory_makes_of_them(tmp_path, family):
    report, table = _mask(tmp_path, family, ALPACA, name="alpaca.json")
    assert report.rows_in == report.rows_out == 4
    _, chats = _mask(tmp_path, family, [{"messages": m} for m in AS_MESSAGES], name="chats.jsonl")
    assert table.column("input_ids").to_pylist() == chats.column("input_ids").to_pylist()
    assert table.column("labels").to_pylist() == chats.column("labels").to_pylist()
    assert table.column_names[:3] == ["instruction", "input", "output"]  # the input's columns are kept as they are
    trained = _trained(family, table, 3)
    assert "Seven." in trained and "Eleven." in trained and "Two." in trained  # earlier outputs train by default
    assert "terse" not in trained and "Another?" not in trained and "Good morning" not in _trained(family, table, 1)


def test_alpaca_with_last_turn_only_trains_the_output_alone(tmp_path):
    _, table = _mask(tmp_path, "qwen2.5", ALPACA[3:], last_turn_only=True)
    trained = _trained("qwen2.5", table, 0)
    assert "Two." in trained and "Seven." not in trained and "Eleven." not in trained


def test_alpaca_columns_of_other_names_are_read_through_alpaca_columns(tmp_path):
    rows = [{"question": "Name a prime.", "answer": "Seven."}]
    report, table = _mask(tmp_path, "qwen2.5", rows, alpaca_columns="instruction=question,output=answer")
    assert report.rows_out == 1 and _trained("qwen2.5", table, 0).startswith("Seven.")
    assert MaskOptions(alpaca_columns={"output": "answer"}) == MaskOptions(alpaca_columns="output=answer")
    with pytest.raises(ValueError, match="the parts of an Alpaca row are instruction, input, output, system, history"):
        MaskOptions(alpaca_columns={"response": "answer"})


def test_alpaca_rows_without_a_string_output_or_with_a_broken_history_are_invalid_and_named(tmp_path):
    rows = [{"instruction": "Hi.", "input": "", "output": None},
            {"instruction": "Hi.", "input": "", "output": "Hello.", "history": [["only one"]]},
            {"instruction": "Hi.", "input": "", "output": "Hello.", "history": []}]
    report, _ = _mask(tmp_path, "qwen2.5", rows)
    assert report.rows_out == 1 and report.dropped["invalid"] == 2
    null_output, broken_history = report.invalid_examples
    assert "line 1" in null_output and "column 'output' (the Alpaca output) is null, not a string" in null_output
    assert "line 2" in broken_history and "column 'history' (the Alpaca history) is not a list of [instruction, " \
                                         "output] pairs of strings" in broken_history


def test_alpaca_parts_that_are_neither_text_nor_null_make_the_row_invalid_and_named(tmp_path):
    rows = [{"instruction": "Double it.", "input": 42, "output": "84", "system": ""},
            {"instruction": "Hi.", "input": "", "output": "Hello.", "system": 7},
            {"instruction": "Hi.", "input": True, "output": "Hello.", "system": ""},
            {"instruction": {"text": "Hi."}, "input": "", "output": "Hello.", "system": ""},
            {"instruction": "Hi.", "input": None, "output": "Hello.", "system": None},  # null: left out, as empty
            {"instruction": "Hi.", "input": "", "output": "Hello.", "system": ""}]
    report, table = _mask(tmp_path, "qwen2.5", rows)
    assert report.rows_in == 6 and report.rows_out == 2 and report.dropped["invalid"] == 4
    number, system, boolean, mapping = report.invalid_examples
    assert "line 1" in number and "column 'input' (the Alpaca input) is a number (42), not a string" in number
    assert "line 2" in system and "column 'system' (the Alpaca system) is a number (7), not a string" in system
    assert "line 3" in boolean and "column 'input' (the Alpaca input) is true, not a string" in boolean
    assert "line 4" in mapping and "column 'instruction' (the Alpaca instruction) is an object" in mapping
    assert all(_trained("qwen2.5", table, r).startswith("Hello.") for r in (0, 1))


def test_alpaca_named_as_prompt_and_completion_keeps_the_text_pairs_reading(tmp_path):
    report, table = _mask(tmp_path, "qwen2.5", ALPACA[:1], prompt_column="instruction", completion_column="output")
    tok = chat_tokenizer("qwen2.5")
    assert report.rows_out == 1 and "<|im_start|>" not in tok.decode(table.column("input_ids")[0].as_py())
    assert _trained("qwen2.5", table, 0).startswith("Seven.")


# -- dataset_info.json ------------------------------------------------------------------------------------------

def _registered(tmp_path, entries: dict, files: dict) -> str:
    for name, rows in files.items():
        _write(tmp_path / name, rows, lines=name.endswith(".jsonl"))
    info = tmp_path / "dataset_info.json"
    info.write_text(json.dumps(entries), encoding="utf-8")
    return str(info)


def _mask_registered(tmp_path, info, name, family="qwen2.5", **options):
    out = tmp_path / f"{name}.parquet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(None, out, tokenizer=chat_tokenizer(family), dataset_info=info, dataset=name,
                            max_drop_fraction=1.0, **options)
    return report, pq.read_table(out)


def test_a_registered_alpaca_dataset_reads_only_the_columns_its_entry_names(tmp_path):
    info = _registered(tmp_path, {
        "plain": {"file_name": "rows.json"},  # no columns: instruction, input, output (LLaMA-Factory reads no history)
        "full": {"file_name": "rows.json", "columns": {"prompt": "instruction", "query": "input", "response": "output",
                                                       "system": "system", "history": "history"}},
        "renamed": {"file_name": "qa.jsonl", "columns": {"prompt": "question", "response": "answer"}},
    }, {"rows.json": ALPACA[3:], "qa.jsonl": [{"question": "Name a prime.", "answer": "Seven."}]})
    report, table = _mask_registered(tmp_path, info, "plain")
    assert report.rows_out == 1
    plain = chat_tokenizer("qwen2.5").decode(table.column("input_ids")[0].as_py())
    assert "And an even one?" in plain and "Eleven." not in plain and "You are terse." not in plain
    _, table = _mask_registered(tmp_path, info, "full")
    _, chats = _mask(tmp_path, "qwen2.5", [{"messages": AS_MESSAGES[3]}])
    assert table.column("labels").to_pylist() == chats.column("labels").to_pylist()
    report, table = _mask_registered(tmp_path, info, "renamed")
    assert report.rows_out == 1 and _trained("qwen2.5", table, 0).startswith("Seven.")


def test_a_registered_sharegpt_dataset_reads_its_tags_as_the_role_map(tmp_path):
    conversation = [{"speaker": "asker", "text": "Name a prime."}, {"speaker": "bot", "text": "Seven."}]
    info = _registered(tmp_path, {
        "tagged": {"file_name": "tagged.jsonl", "formatting": "sharegpt",
                   "columns": {"messages": "dialogue"}, "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "asker",
                                                      "assistant_tag": "bot"}},
        "openai": {"file_name": "openai.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"}},
        "keys": {"file_name": "tagged.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialogue"},
                 "tags": {"role_tag": "speaker", "content_tag": "text"}},
    }, {"tagged.jsonl": [{"dialogue": [{"from": m["speaker"], "value": m["text"]} for m in conversation]}],
        "openai.jsonl": [{"messages": [U("Name a prime."), A("Seven.")]}]})
    for name in ("tagged", "openai"):
        report, table = _mask_registered(tmp_path, info, name)
        assert report.rows_out == 1 and _trained("qwen2.5", table, 0).startswith("Seven."), name
    with pytest.raises(ValueError, match="messages keyed 'speaker' and 'text'.*reads ShareGPT's 'from' and 'value'"):
        _mask_registered(tmp_path, info, "keys")


@pytest.mark.parametrize("entry, said", [
    ({"hf_hub_url": "org/data"}, "is loaded from hf_hub_url 'org/data'; lossmask reads local files only"),
    ({"file_name": "x.json", "ranking": True, "formatting": "sharegpt"}, "holds preference pairs (ranking: true)"),
    ({"file_name": "x.json", "columns": {"prompt": "text"}}, "has no response column"),
    ({"file_name": "x.json", "formatting": "sharegpt", "columns": {"messages": "m", "audios": "audios"}},
     "holds audio (columns.audios)"),
    ({"file_name": "x.json", "subset": "en"}, "has 'subset', which lossmask does not read"),
    # an entry of another shape than LLaMA-Factory's: the key named, and what it holds instead
    ({"file_name": "x.json", "formatting": "sharegpt", "tags": ["from"]}, "tags is a list (['from']), where "
     "LLaMA-Factory's dataset_info.json gives an object of role_tag, content_tag, user_tag"),
    ({"file_name": "x.json", "formatting": "sharegpt", "tags": "from"}, "tags is a string ('from')"),
    ({"file_name": "x.json", "formatting": "sharegpt", "columns": {"messages": ["conversations"]}},
     "columns.messages is a list (['conversations']), where LLaMA-Factory's dataset_info.json gives a string"),
    ({"file_name": "x.json", "columns": {"prompt": 5, "response": "output"}}, "columns.prompt is a number (5)"),
    ({"file_name": "x.json", "columns": {"prompt": "q", "response": ["a", "b"]}}, "columns.response is a list"),
    ({"file_name": "x.json", "columns": {"prompt": "q", "respones": "a"}},
     "columns has 'respones', which LLaMA-Factory does not read; its columns are prompt, query, response"),
    ({"file_name": "x.json", "formatting": "sharegpt", "tags": {"user_tag": {"a": 1}}}, "tags.user_tag is an object"),
    ({"file_name": "x.json", "ranking": "no"}, "ranking is a string ('no'), where LLaMA-Factory's dataset_info.json "
     "gives true or false"),
    ({"file_name": 3}, "file_name is a number (3)"),
    ({"file_name": "x.json", "formatting": ["alpaca"]}, "formatting is a list (['alpaca'])"),
    # a split other than the one a local file has is refused, never left unread
    ({"file_name": "x.json", "split": "test"}, "split 'test'; lossmask reads the file whole, as its one split 'train'"),
    ({"file_name": "x.json", "split": "train[:10]"}, "split 'train[:10]'"),
])
def test_a_registered_dataset_lossmask_cannot_read_as_llamafactory_does_is_refused_in_one_line(tmp_path, entry, said):
    info = _registered(tmp_path, {"it": entry}, {})
    with pytest.raises(ValueError) as caught:
        mask_files(None, tmp_path / "out.parquet", tokenizer=chat_tokenizer("qwen2.5"), dataset_info=info, dataset="it")
    assert said in str(caught.value) and f"{info}, dataset 'it'" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_registered_dataset_with_split_train_is_read_whole(tmp_path):
    info = _registered(tmp_path, {"it": {"file_name": "rows.json", "split": "train"}}, {"rows.json": ALPACA[:2]})
    report, _ = _mask_registered(tmp_path, info, "it")
    assert report.rows_in == report.rows_out == 2


def _cli_error(*args) -> str:
    """What ``lossmask mask ARGS`` prints on stderr, checked to be one line of an error (no traceback)."""
    import contextlib
    import io

    from lossmask.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["mask", *map(str, args), "--no-progress"]) == 1
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lossmask mask: error: "), lines
    return lines[0]


def test_a_dataset_info_that_is_no_regular_file_or_too_large_or_too_deep_is_refused_in_one_line(tmp_path):
    import os

    from lossmask.jobs.dataset_info import MAX_DATASET_INFO_BYTES

    out = tmp_path / "out.parquet"
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: opening it to read would wait for one
    large = tmp_path / "large.json"
    large.write_text(json.dumps({"it": {"file_name": "x.json", "pad": "x" * MAX_DATASET_INFO_BYTES}}))
    deep = tmp_path / "deep.json"
    deep.write_text('{"a":' * 200_000 + "1" + "}" * 200_000)
    for info, said in (("/dev/zero", "/dev/zero is a device, not a file"), (fifo, f"{fifo} is a pipe, not a file"),
                       (tmp_path, f"{tmp_path} is a folder, not a file"),
                       (large, f"{large} is larger than {MAX_DATASET_INFO_BYTES >> 20} MiB"),
                       (deep, f"{deep}: JSON nested deeper than Python's JSON reader goes")):
        assert said in _cli_error("--dataset-info", info, "--dataset", "it", out)
    assert not out.exists() and sorted(os.listdir(tmp_path)) == ["deep.json", "fifo.json", "large.json"]


def test_errors_about_a_dataset_info_quote_long_values_shortened(tmp_path):
    info = _registered(tmp_path, {"it": {"file_name": "x.json", "formatting": "x" * 200_000},
                                  **{f"{k}{'y' * 2_000_000}": {"file_name": "x.json"} for k in range(1)}}, {})
    out = tmp_path / "out.parquet"
    line = _cli_error("--dataset-info", info, "--dataset", "it", out)
    assert "formatting 'xxxxxxxx" in line and "(200,000 characters)" in line and len(line) < 400
    line = _cli_error("--dataset-info", info, "--dataset", "z" * 200_000, out)
    assert "no dataset 'zzzz" in line and "(200,000 characters)" in line and "(2,000,001 characters)" in line
    assert len(line) < 500


def test_the_cli_reads_a_registered_dataset_and_names_the_ones_it_has(tmp_path, capsys):
    from lossmask.cli import main
    from conftest import tokenizer_path

    info = _registered(tmp_path, {"alpaca_demo": {"file_name": "rows.json"}}, {"rows.json": ALPACA[:2]})
    out = tmp_path / "out.parquet"
    assert main(["mask", "--dataset-info", info, "--dataset", "alpaca_demo", str(out),
                 "--tokenizer", str(tokenizer_path("qwen2.5")), "--no-progress"]) == 0
    assert pq.read_table(out).num_rows == 2
    assert main(["mask", "--dataset-info", info, "--dataset", "other", str(out),
                 "--tokenizer", str(tokenizer_path("qwen2.5")), "--no-progress"]) == 1
    assert "no dataset 'other'; it registers alpaca_demo" in capsys.readouterr().err
    assert main(["mask", str(tmp_path / "rows.json"), str(out), "--dataset-info", info, "--dataset", "alpaca_demo",
                 "--tokenizer", str(tokenizer_path("qwen2.5")), "--no-progress"]) == 1
    assert "both name the input; pass one" in capsys.readouterr().err


# -- multimodal rows as LLaMA-Factory writes them: <image> placeholders beside an images column --------------------

def _mllm_rows(tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 56), (200, 30, 30)).save(tmp_path / "a.png")
    Image.new("RGB", (84, 56), (30, 30, 200)).save(tmp_path / "b.png")
    return [
        {"messages": [U("<image>Who is this?"), A("A red square."), U("And this one?<image>"), A("A blue one.")],
         "images": ["a.png", "b.png"], "audios": []},
        {"messages": [U("<audio>What's that sound?"), A("Glass shattering.")], "images": [], "audios": ["x.mp3"]},
        {"messages": [U("<image><image>Two?"), A("One.")], "images": ["a.png"], "audios": []},
    ]


def test_image_placeholders_without_a_processor_make_the_row_invalid_never_text(tmp_path):
    report, _ = _mask(tmp_path, "qwen2.5", _mllm_rows(tmp_path)[:2] + [{"messages": [U("Hi."), A("Hello.")],
                                                                       "images": [], "audios": []}])
    assert report.rows_out == 1 and report.dropped["invalid"] == 2
    images, audio = report.invalid_examples
    assert "holds 2 <image> placeholders with media in column(s) 'images'" in images and "processor" in images
    assert "holds audio (column 'audios')" in audio and "never keeps an audio row as text" in audio


def test_image_placeholders_through_a_processor_are_the_rows_images_in_order(tmp_path):
    pytest.importorskip("PIL")
    from conftest import vision_processor_dir
    from lossmask.chat.media import load_processor

    proc = load_processor(vision_processor_dir("qwen2-vl", tmp_path / "proc"))
    path = _write(tmp_path / "mllm.json", _mllm_rows(tmp_path), lines=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = mask_files(path, tmp_path / "out.parquet", tokenizer=proc, max_drop_fraction=1.0)
    assert report.rows_out == 1 and report.dropped["invalid"] == 2
    audio, mismatch = report.invalid_examples
    assert "holds audio" in audio and "holds 2 <image> placeholder(s) but 1 item(s) in column 'images'" in mismatch
    table = pq.read_table(tmp_path / "out.parquet")
    tok = chat_tokenizer("qwen2.5")
    ids, labels = table.column("input_ids")[0].as_py(), table.column("labels")[0].as_py()
    rendered = tok.decode(ids)
    assert rendered.count("<|vision_start|>") == 2 and "<image>" not in rendered
    assert rendered.index("<|vision_start|>") < rendered.index("Who is this?")  # the placeholder's place is kept
    assert rendered.rindex("<|vision_start|>") > rendered.index("And this one?")
    trained = tok.decode([t for t, label in zip(ids, labels) if label != -100])
    assert "A red square." in trained and "A blue one." in trained and "<|image_pad|>" not in trained


# -- tool-call ids, where the template requires them ------------------------------------------------------------

def _call(name, call_id=None):
    call = {"type": "function", "function": {"name": name, "arguments": {"city": "Oslo"}}}
    return call if call_id is None else {**call, "id": call_id}


def test_tool_calls_without_ids_get_deterministic_ids_where_the_template_requires_them(tmp_path):
    no_ids = [U("Weather in Oslo and time there?"),
              {"role": "assistant", "content": "", "tool_calls": [_call("get_weather"), _call("get_time")]},
              {"role": "tool", "content": "3 degrees"}, {"role": "tool", "content": "noon"}, A("3 degrees at noon.")]
    given = [U("Weather?"), {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", "abcdefghi")]},
             {"role": "tool", "content": "3 degrees", "tool_call_id": "abcdefghi"}, A("3 degrees.")]
    report, table = _mask(tmp_path, "mistral-v3", [{"messages": no_ids}, {"messages": given}])
    assert report.rows_out == 2 and report.shapes["tool_call_ids_written"] == 1
    tok = chat_tokenizer("mistral-v3")
    first, second = (tok.decode(table.column("input_ids")[r].as_py()) for r in (0, 1))
    assert '"id": "000000001"' in first and '"id": "000000002"' in first
    assert '"call_id": "000000001"' in first and '"call_id": "000000002"' in first
    assert '"id": "abcdefghi"' in second and "000000001" not in second
    assert "get_weather" in _trained("mistral-v3", table, 0)
    # a template that takes calls without ids is given none
    report, table = _mask(tmp_path, "qwen2.5", [{"messages": no_ids}], name="qwen.jsonl")
    assert report.rows_out == 1 and "tool_call_ids_written" not in report.shapes
    assert "000000001" not in chat_tokenizer("qwen2.5").decode(table.column("input_ids")[0].as_py())


@pytest.mark.parametrize("family", ["mistral-v3", "qwen2.5", "llama-3.1"])
def test_a_chat_with_no_assistant_message_counts_as_no_response_on_every_family(tmp_path, family):
    report, _ = _mask(tmp_path, family, [{"messages": [U("Is anyone there?")]}, {"messages": [U("Hi."), A("Hello.")]}])
    assert report.rows_out == 1 and report.dropped["no_response"] == 1 and report.dropped["empty_response"] == 0


def test_a_registered_sharegpt_dataset_takes_its_system_prompt_from_columns_system(tmp_path):
    """LLaMA-Factory's converter: the system column is the system prompt, unless the chat opens with a system message
    (which then wins); an empty value adds none."""
    rows = [
        {"conversations": [{"from": "human", "value": "Name a prime."}, {"from": "gpt", "value": "Seven."}],
         "sys": "You are terse."},
        {"conversations": [{"from": "system", "value": "Answer in French."}, {"from": "human", "value": "Hello?"},
                           {"from": "gpt", "value": "Bonjour."}], "sys": "You are terse."},
        {"conversations": [{"from": "human", "value": "And an even one?"}, {"from": "gpt", "value": "Two."}], "sys": ""},
    ]
    info = _registered(tmp_path, {
        "with_system": {"file_name": "chats.jsonl", "formatting": "sharegpt",
                        "columns": {"messages": "conversations", "system": "sys"}},
        "openai": {"file_name": "openai.jsonl", "formatting": "openai",
                   "columns": {"messages": "messages", "system": "system"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"}},
    }, {"chats.jsonl": rows, "openai.jsonl": [{"messages": [U("Name a prime."), A("Seven.")], "system": "Be brief."}]})
    report, table = _mask_registered(tmp_path, info, "with_system")
    assert report.rows_out == 3
    expected = [[S("You are terse."), U("Name a prime."), A("Seven.")],
                [S("Answer in French."), U("Hello?"), A("Bonjour.")],
                [U("And an even one?"), A("Two.")]]
    _, chats = _mask(tmp_path, "qwen2.5", [{"messages": chat} for chat in expected], name="expected.jsonl")
    assert table.column("input_ids").to_pylist() == chats.column("input_ids").to_pylist()
    assert table.column("labels").to_pylist() == chats.column("labels").to_pylist()
    report, table = _mask_registered(tmp_path, info, "openai")
    text = chat_tokenizer("qwen2.5").decode(table.column("input_ids")[0].as_py())
    assert report.rows_out == 1 and text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    with pytest.raises(ValueError, match="system_column='nope' is not a column of the rows"):
        _mask(tmp_path, "qwen2.5", rows, name="missing.jsonl", system_column="nope")


def test_hf_mask_dataset_reads_a_registered_dataset_as_mask_files_does(tmp_path):
    datasets = pytest.importorskip("datasets")
    from lossmask.hf import mask_dataset

    info = _registered(tmp_path, {"alpaca_demo": {"file_name": "rows.json"},
                                  "chats": {"file_name": "chats.jsonl", "formatting": "sharegpt",
                                            "columns": {"messages": "dialogue"}}},
                       {"rows.json": ALPACA[:3],
                        "chats.jsonl": [{"dialogue": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}]})
    for name in ("alpaca_demo", "chats"):
        report, files = _mask_registered(tmp_path, info, name)
        loaded = mask_dataset(None, chat_tokenizer("qwen2.5"), dataset_info=info, dataset_name=name)
        assert list(loaded["labels"]) == files.column("labels").to_pylist(), name
        given = datasets.load_dataset("json", data_files=str(tmp_path / ("rows.json" if name == "alpaca_demo"
                                                                         else "chats.jsonl")), split="train")
        assert list(mask_dataset(given, chat_tokenizer("qwen2.5"), dataset_info=info, dataset_name=name)["labels"]) == \
            files.column("labels").to_pylist(), name
    with pytest.raises(ValueError, match="dataset_info= and dataset_name= go together"):
        mask_dataset(None, chat_tokenizer("qwen2.5"), dataset_info=info)


def test_a_placeholder_for_a_medium_the_row_has_no_item_of_makes_the_row_invalid_for_audio_as_for_images(tmp_path):
    rows = [
        {"messages": [U("<audio>What's that sound?"), A("Glass shattering.")], "images": []},  # no audios column
        {"messages": [U("<image>Who is this?"), A("A red square.")], "images": [], "videos": []},  # no image in the row
        {"messages": [U("<video>What happens?"), A("It rains.")], "images": []},  # no videos column
        {"messages": [U("Hi."), A("Hello.")], "images": []},
    ]
    report, _ = _mask(tmp_path, "qwen2.5", rows)
    assert report.rows_out == 1 and report.dropped["invalid"] == 3, report.summary()
    audio, image, video = report.invalid_examples
    assert "holds 1 <audio> placeholder but no item in column 'audios'" in audio
    assert "holds 1 <image> placeholder but no item in column 'images'" in image
    assert "holds 1 <video> placeholder but no item in column 'videos'" in video
    # rows with no media column at all are plain chats: the same text is text there, for every medium alike
    report, _ = _mask(tmp_path, "qwen2.5", [{"messages": row["messages"]} for row in rows], name="plain.jsonl")
    assert report.rows_out == 4
