"""Labels from each row's rendering (``FromRendering``), for templates whose token markers cannot be read.

Where markers verify, labels from the rendering must be the markers' labels, token for token: that is what
proves the turn-finding rule on real templates. Then each door takes the mode on a template whose markers
cannot be read (from llama.cpp's collection, skipped when it cannot be had), and what cannot work (token ids
alone) is refused in one line.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")

from conftest import FIXTURES, chat_tokenizer, tokenizer_path  # noqa: E402

import lossmask  # noqa: E402
from lossmask.chat.turn_spans import FromRendering  # noqa: E402

sys.path.insert(0, str(FIXTURES))
from loaded_once import folders_loaded_once  # noqa: E402

sys.path.pop(0)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "chats.jsonl"

CHATS = [
    [{"role": "user", "content": "Hi there, can you help?"}, {"role": "assistant", "content": "Hello friend, gladly."},
     {"role": "user", "content": "How are you today?"}, {"role": "assistant", "content": "Fine thanks, and you?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say <|im_start|>assistant now"},
     {"role": "assistant", "content": "Done: <|im_end|> is just text here."}],
    [{"role": "user", "content": "Only a question, no answer."}],
]


def _mask(tmp_path: Path, source: Path, tokenizer, **kwargs):
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.parquet"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = lossmask.mask_files(source, out, tokenizer=tokenizer, max_drop_fraction=1.0, keep_dropped=True, **kwargs)
    return report, pq.read_table(out)


@pytest.mark.parametrize("family", ["qwen2.5", "llama-3.1", "gemma-3", "deepseek-v3", "glm-4", "mistral-v3", "phi-3.5"])
def test_labels_from_the_rendering_equal_the_verified_markers_labels(family, tmp_path):
    """The bundled example chats (tool calls, a row cut after the header, rows the template rejects) on templates
    whose markers verify: the same rows, ids and labels from the rendering as from the markers."""
    tokenizer = chat_tokenizer(family)  # loaded once per test run, for both jobs
    by_markers, with_markers = _mask(tmp_path, EXAMPLES, tokenizer, max_length=256)
    by_rendering, with_rendering = _mask(tmp_path, EXAMPLES, tokenizer, max_length=256, markers=FromRendering())
    assert with_rendering["input_ids"].to_pylist() == with_markers["input_ids"].to_pylist()
    assert with_rendering["labels"].to_pylist() == with_markers["labels"].to_pylist()
    assert by_rendering.markers_source == "rendered" and by_rendering.rows_out == by_markers.rows_out


def test_pre_tokenised_ids_cannot_be_labelled_from_a_rendering_and_say_so_in_one_line(tmp_path):
    source = tmp_path / "ids.jsonl"
    source.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(ValueError) as raised:
        lossmask.mask_files(source, tmp_path / "out.parquet", markers=FromRendering())
    assert "\n" not in str(raised.value) and "carry no rendering" in str(raised.value)


def test_a_resolution_from_the_rendering_survives_the_marker_cache(tmp_path, monkeypatch):
    from lossmask.markers.cache import resolve_cached
    from lossmask.markers.policy import Resolution

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ct = chat_tokenizer("qwen2.5")
    made = Resolution(FromRendering(), "rendered", ("why",), "why")
    first = resolve_cached(ct, lambda: made, model_name=None, strict=False)
    again = resolve_cached(ct, lambda: pytest.fail("resolved again instead of read from the cache"),
                           model_name=None, strict=False)
    assert first.source == again.source == "rendered" and isinstance(again.markers, FromRendering)


# -- a template whose markers cannot be read, through every door ---------------------------------------


@pytest.fixture(scope="module")
def unreadable():
    """DeepSeek-V3.2's real template: its generation prompt writes ``<think></think>``, its history ``</think>``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
    try:
        import template_collection as collection
    finally:
        sys.path.pop(0)
    folder, why = collection.collection_dir()
    if folder is None:
        pytest.skip(why)
    return collection.tokenizer_for((folder / "deepseek-ai-DeepSeek-V3.2.jsonl".replace(".jsonl", ".jinja")).read_text())


def _trained_text(tok, ids, labels) -> str:
    return "".join(tok.decode([i]) if label != -100 else "|" for i, label in zip(ids, labels))


def test_resolution_of_a_template_whose_markers_cannot_be_read_is_rendered_not_the_full_sequence(unreadable):
    with warnings.catch_warnings():
        warnings.simplefilter("error", lossmask.FullSequenceWarning)
        resolution = lossmask.resolve_markers(unreadable, strict=True)
    assert resolution.source == "rendered" and isinstance(resolution.markers, FromRendering)


def test_every_door_labels_such_a_template_alike(unreadable, tmp_path):
    datasets = pytest.importorskip("datasets")
    from lossmask.hf import mask_dataset

    source = tmp_path / "chats.jsonl"
    source.write_text("\n".join(json.dumps({"messages": c}) for c in CHATS) + "\n")
    report, table = _mask(tmp_path, source, unreadable)
    assert report.markers_source == "rendered"
    files = table["labels"].to_pylist()
    texts = [_trained_text(unreadable, i, l) for i, l in zip(table["input_ids"].to_pylist(), files)]
    assert texts[0].endswith("</think>Hello friend, gladly.<｜end▁of▁sentence｜>"
                             "|||||||||</think>Fine thanks, and you?<｜end▁of▁sentence｜>".replace("|||||||||", texts[0][
                                 texts[0].index("<｜end▁of▁sentence｜>") + len("<｜end▁of▁sentence｜>"):
                                 texts[0].rindex("</think>")]))
    assert "Hi there" not in texts[0] and "is just text here.<｜end▁of▁sentence｜>" in texts[1]
    assert "Say" not in texts[1] and set(texts[2]) == {"|"}  # no reply: nothing trains (no_response)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dataset = mask_dataset(datasets.Dataset.from_dict({"messages": CHATS[:2]}), unreadable)
    assert [row["labels"] for row in dataset] == files[:2]

    ct = lossmask.load_tokenizer(unreadable)
    encoded = ct.encode_chats(CHATS[:2])
    assert lossmask.make_labels(encoded, FromRendering()).to_pylist() == files[:2]


def test_the_mlx_feed_and_show_take_such_a_template(unreadable, tmp_path):
    pytest.importorskip("mlx.core")
    from lossmask.mlx import load_dataset
    from lossmask.show import label_conversation

    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "valid"):
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in CHATS[:2]) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train, _, _ = load_dataset(data, unreadable)
    assert len(train) == 2 and train.counts.by_outcome["trained"] == 2
    shown = label_conversation(unreadable, CHATS[0])
    assert shown.resolution.source == "rendered" and 0 < int(shown.trained.sum()) < len(shown.ids)


def test_detect_says_rows_are_labelled_from_their_rendering_and_exits_0(unreadable, tmp_path, capsys):
    from lossmask.cli import main

    unreadable.save_pretrained(tmp_path / "tok")
    assert main(["detect", str(tmp_path / "tok")]) == 0
    out = capsys.readouterr().out
    assert "source: rendered" in out and "labelled from its own rendering" in out


# -- a row's time is bounded ------------------------------------------------------------------------------


def _long_chat(turns: int) -> list[dict]:
    chat = []
    for t in range(turns):
        chat += [{"role": "user", "content": f"Question number {t}?"}, {"role": "assistant", "content": f"Answer {t}."}]
    return chat


def test_a_row_past_its_rendering_budget_is_dropped_counted_and_named(tmp_path):
    """A budget too small for any row: the long row is dropped under its own reason, named with its row number, and the
    report still adds up; the same row within the default budget is kept."""
    source = tmp_path / "long.jsonl"
    source.write_text(json.dumps({"messages": _long_chat(200)}) + "\n")
    tokenizer = chat_tokenizer("qwen2.5")
    report, table = _mask(tmp_path, source, tokenizer, markers=FromRendering(), max_row_rendering_seconds=1e-9)
    assert report.dropped["rendering_over_budget"] == 1 and report.rows_out == 0
    assert any(e.startswith("rendering_over_budget: row 0: ") and "max_row_rendering_seconds" in e
               for e in report.dropped_examples), report.dropped_examples
    kept, _ = _mask(tmp_path, source, tokenizer, markers=FromRendering())
    assert kept.rows_out == 1 and "rendering_over_budget" not in kept.dropped


def test_a_row_whose_markers_break_the_roles_is_not_waited_on_either(tmp_path):
    """DeepSeek-V3's call after a tool result breaks the role invariant under its markers; the rendering that would
    label it is bounded by the same budget, and the row is counted as over it rather than as breaking the roles."""
    from test_conversation_shapes import TOOL_AFTER_TOOL

    source = tmp_path / "calls.jsonl"
    source.write_text(json.dumps({"messages": TOOL_AFTER_TOOL}) + "\n")
    report, _ = _mask(tmp_path, source, chat_tokenizer("deepseek-v3"), max_row_rendering_seconds=1e-9)
    assert report.dropped.get("rendering_over_budget") == 1 and "template_breaks_roles" not in report.dropped
    assert report.labelled_from_rendering == 0


def test_the_command_line_takes_the_rows_rendering_budget(tmp_path, capsys):
    """``lossmask mask --max-row-rendering-seconds S``: the row the markers break is counted as over the budget."""
    from test_conversation_shapes import TOOL_AFTER_TOOL

    from lossmask.cli import main

    source = tmp_path / "calls.jsonl"
    source.write_text(json.dumps({"messages": TOOL_AFTER_TOOL}) + "\n")
    # the folder answered by the tokenizer loaded once per test run
    with warnings.catch_warnings(), folders_loaded_once("deepseek-v3"):
        warnings.simplefilter("ignore")
        status = main(["mask", str(source), str(tmp_path / "out.parquet"), "--tokenizer",
                       str(tokenizer_path("deepseek-v3")), "--max-row-rendering-seconds", "1e-9", "--keep-dropped",
                       "--max-drop-fraction", "1", "--report", str(tmp_path / "report.json"), "--no-progress"])
    assert status == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert "rendering_over_budget" in json.dumps(report), report


def test_a_rendering_budget_must_be_a_positive_number_of_seconds():
    for bad in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="max_row_rendering_seconds"):
            lossmask.MaskOptions(max_row_rendering_seconds=bad)


def test_label_from_rendering_names_a_row_past_its_budget():
    """The batch call that the other doors share: the row keeps null labels and is listed with its reason."""
    import pyarrow as pa

    from lossmask.chat.turn_spans import label_from_rendering

    ct = chat_tokenizer("qwen2.5")
    chat = _long_chat(50)
    ids = pa.array([ct.encode_chats([chat]).input_ids[0].as_py()], type=pa.list_(pa.int64()))
    result = label_from_rendering(ct, [chat], ids, seconds_per_row=1e-9)
    assert [(r, reason) for r, reason, _ in result.rejected] == [(0, "rendering_over_budget")]
    assert result.labels.null_count == 1
