"""Weights per token (docs/weights.md), against hand-labelled rows on six template families.

Each expectation is written from the rule, not read off the code: the trained text of a row as maximal runs of one
weight, ``[(text, weight), ...]`` in order (tokens of weight 0 left out). A family's stop token and what it trains
before the content come from docs/masking-rule.md's table.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import chat_tokenizer, detected_markers
from lossmask.engine.tally import Tally
from lossmask.jobs.batch_step import mask_batch
from lossmask.options import MaskOptions

FAMILIES = ("chatml", "llama-3.1", "gemma-3", "mistral-v3", "gpt-oss", "qwen3")
# what each family trains around a last assistant turn's content (docs/masking-rule.md)
BEFORE = {"chatml": "", "llama-3.1": "", "gemma-3": "", "mistral-v3": "", "qwen3": "<think>\n\n</think>\n\n",
          "gpt-oss": "<|channel|>final<|message|>"}
STOP = {"chatml": "<|im_end|>", "llama-3.1": "<|eot_id|>", "gemma-3": "<end_of_turn>", "mistral-v3": "</s>",
        "qwen3": "<|im_end|>", "gpt-oss": "<|return|>"}
# the user's text "Hi there" as it trains when its role does: Mistral's template writes "[INST] " before it, and
# "▁Hi" merges that space with "Hi": the token straddles template and text, so it takes the lower weight (0)
USER_TEXT = {"mistral-v3": "there"}
# the stop token after an earlier turn (gpt-oss ends an earlier final answer with <|end|>)
STOP_EARLIER = {**STOP, "gpt-oss": "<|end|>"}


@pytest.fixture(autouse=True)
def weights_checked_against_numpy(monkeypatch):
    """Every batch a test here weighs is also weighed by the NumPy reference (``engine/weights._weigh_tokens_numpy``,
    step by step), and the two must agree: weights, roles, labels and totals."""
    from lossmask.engine import weights as engine_weights
    from lossmask.jobs import batch_step

    kernel = engine_weights.weigh_tokens

    def both(ids, lengths, labels, ignore_index, planned, end_patterns, options, never=None):
        got = kernel(ids, lengths, labels, ignore_index, planned, end_patterns, options, never)
        want = engine_weights._weigh_tokens_numpy(ids, lengths, labels, ignore_index, planned, end_patterns, options,
                                                  never)
        np.testing.assert_array_equal(got.weights, want.weights)
        assert [got.names[c] for c in got.role] == [want.names[c] for c in want.role]
        np.testing.assert_array_equal(got.labels, want.labels)
        np.testing.assert_array_equal(got.row_tokens, want.row_tokens)
        np.testing.assert_allclose(got.row_mass, want.row_mass, rtol=1e-6)
        assert got.by_role.keys() == want.by_role.keys() and (got.changed, got.odd) == (want.changed, want.odd)
        return got

    monkeypatch.setattr(batch_step, "weigh_tokens", both)


def label(family, rows, **fields):
    """Mask ``rows`` (lists of messages) with ``family``; return the output table and its tally."""
    tally = Tally()
    markers, _ = detected_markers(family)
    out = mask_batch(pa.table({"messages": rows}), markers, MaskOptions(**fields), tally,
                     tokenizer=chat_tokenizer(family))
    return out, tally


def weighted_text(family, out, row=0):
    """``[(text, weight)]``: the trained tokens of one output row, as runs of one weight, decoded."""
    tok = chat_tokenizer(family)
    ids = out["input_ids"][row].as_py()
    labels = out["labels"][row].as_py()
    if "loss_weights" in out.column_names:
        weights = out["loss_weights"][row].as_py()
        assert all((w > 0) == (l != -100) for w, l in zip(weights, labels)), "labels and weights disagree"
        assert all(l in (-100, i) for l, i in zip(labels, ids))
    else:
        weights = [float(l != -100) for l in labels]
    runs: list[tuple[list[int], float]] = []
    for i, (t, w) in enumerate(zip(ids, weights)):
        if w <= 0:
            continue
        if runs and runs[-1][1] == pytest.approx(w) and i > 0 and weights[i - 1] > 0:
            runs[-1][0].append(t)
        else:
            runs.append(([t], round(float(w), 6)))
    return [(tok.decode(r).strip(" "), w) for r, w in runs]


def chat(*turns, **first_assistant):
    """user/assistant messages from texts; ``first_assistant`` adds fields to the first assistant message."""
    messages = []
    for k, text in enumerate(turns):
        message = {"role": "user" if k % 2 == 0 else "assistant", "content": text}
        if k == 1:
            message.update(first_assistant)
        messages.append(message)
    return messages


def last_turn(family, content, weight=1.0):
    return (f"{BEFORE[family]}{content}{STOP[family]}", weight)


# -- defaults are today's outputs ----------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_no_weight_option_no_column(family):
    out, tally = label(family, [chat("Hi there", "Hello back")])
    assert "loss_weights" not in out.column_names
    assert weighted_text(family, out) == [last_turn(family, "Hello back")]
    assert tally.weights_by_role == {}


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_weights_asked_for_is_the_label_mask(family):
    out, _ = label(family, [chat("Hi there", "Hello back")], loss_weights=True)
    labels = out["labels"][0].as_py()
    assert out["loss_weights"][0].as_py() == [float(l != -100) for l in labels]
    assert weighted_text(family, out) == [last_turn(family, "Hello back")]


# -- the message's own field ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_openai_weight_zero_masks_that_turn(family):
    out, _ = label(family, [chat("Hi there", "First answer", "And then?", "Second answer", weight=0)])
    assert weighted_text(family, out) == [last_turn(family, "Second answer")]


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_scale_weighs_a_turn(family):
    out, _ = label(family, [chat("Hi there", "First answer", "And then?", "Second answer", loss_scale=0.25)])
    first = "First answer" + STOP_EARLIER[family]
    if family == "gpt-oss":
        first = "<|channel|>final<|message|>" + first
    assert "loss_weights" in out.column_names
    assert weighted_text(family, out) == [(first, 0.25), last_turn(family, "Second answer")]


@pytest.mark.parametrize("field,value,weight", [
    ("train", False, 0.0), ("training", False, 0.0), ("loss", False, 0.0), ("loss_weight", 2.0, 2.0),
    ("weight", 0.5, 0.5), ("loss_scale", 3, 3.0),
])
def test_each_recognised_field(field, value, weight):
    out, _ = label("chatml", [chat("Hi there", "First answer", "And then?", "Second answer", **{field: value})])
    expected = ([("First answer<|im_end|>", weight)] if weight else []) + [("Second answer<|im_end|>", 1.0)]
    assert weighted_text("chatml", out) == expected


def test_named_field_and_no_field():
    rows = [chat("Hi there", "First answer", "And then?", "Second answer", keep=False, weight=0)]
    out, _ = label("chatml", rows, weight_field="keep")
    assert weighted_text("chatml", out) == [("Second answer<|im_end|>", 1.0)]
    out, _ = label("chatml", rows, weight_field=None)
    assert weighted_text("chatml", out) == [("First answer<|im_end|>", 1.0), ("Second answer<|im_end|>", 1.0)]


def test_a_bad_field_value_names_row_and_message():
    with pytest.raises(ValueError, match="message 1: weight='x' is not a weight"):
        label("chatml", [chat("Hi there", "Answer", weight="x")])


def test_all_turns_weighed_zero_drop_the_row_with_its_cause():
    out, tally = label("chatml", [chat("Hi there", "Answer", weight=0), chat("Hi there", "Answer")])
    assert out.num_rows == 1
    assert tally.drop_causes == {"weights_zero": 1}


# -- roles ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_roles_to_train_trains_user_text(family):
    out, tally = label(family, [chat("Hi there", "Hello back")], roles_to_train=["user", "assistant"])
    # the user's text trains; the template around it (header, stop token) does not
    assert weighted_text(family, out) == [(USER_TEXT.get(family, "Hi there"), 1.0), last_turn(family, "Hello back")]
    assert tally.weights_by_role["user"][0] >= 1 and tally.weights_by_role["user"][1] == tally.weights_by_role["user"][0]


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_by_role_and_prompt_weight(family):
    out, tally = label(family, [chat("Hi there", "Hello back")], weights_by_role={"user": 0.5, "assistant": 2})
    assert weighted_text(family, out) == [(USER_TEXT.get(family, "Hi there"), 0.5), last_turn(family, "Hello back", 2.0)]
    out, tally = label(family, [chat("Hi there", "Hello back")], prompt_weight=0.1)
    weights = np.asarray(out["loss_weights"][0].as_py())
    labels = np.asarray(out["labels"][0].as_py())
    assert set(np.unique(weights).round(6)) == {0.1, 1.0}  # every token trains: the prompt lightly
    assert (labels != -100).all()
    assert last_turn(family, "Hello back") in weighted_text(family, out)
    assert tally.weights_by_role["prompt"][0] == int((weights == np.float32(0.1)).sum())


def test_plans_by_role_alone_are_shared_per_role_sequence_and_read_odd_roles():
    """Rows weighed by role alone take their plan from one worked out per role sequence (``WeightReader.by_roles``):
    each row still gets its own pieces, and odd roles (missing, not a string, not hashable) read as the rule reads
    them: by their string."""
    from lossmask.chat.locate import locate_messages
    from lossmask.chat.weights import WeightReader, plan_row

    with pytest.warns(UserWarning, match="which no chat template writes as a role"):  # odd roles, on purpose
        reader = WeightReader.of(MaskOptions(weights_by_role={"user": 0.5, "None": 0.25, "7": 0.75}))
    text = "Hi there Hello back Next"
    rows = [chat("Hi there", "Hello back"), chat("Hi there", "Hello back"),
            [{"content": "Hi there"}, {"role": "assistant", "content": "Hello back"}],
            [{"role": ["odd"], "content": "Hi there"}, {"role": 7, "content": "Hello back"},
             {"role": "assistant", "content": "Next"}],
            [{"role": "tool", "content": "Hi there"}, {"role": "assistant", "content": "Hello back"}]]
    plans = [plan_row(text, messages, locate_messages(text, messages), reader) for messages in rows]
    assert plans[0].exact and plans[0].weights == (0.5, 1.0) and plans[0].roles == ("user", "assistant")
    assert plans[0] is not plans[1] and plans[0].pieces == [(0, 8, 0, True), (9, 19, 1, True)]
    assert plans[2].roles == ("None", "assistant") and plans[2].weights == (0.25, 1.0)  # a missing role reads "None"
    assert plans[3].roles == ("['odd']", "7", "assistant") and plans[3].weights == (0.0, 0.75, 1.0)
    assert plans[4].exact is False and plans[4].uniform == 1.0  # nothing but the assistant trains: no characters
    assert plan_row(text, rows[4], locate_messages(text, rows[4]), reader) is plans[4]  # shared, never changed


def test_roles_to_train_without_assistant_masks_assistant():
    out, _ = label("chatml", [chat("Hi there", "Hello back")], roles_to_train="user", keep_dropped=True)
    assert weighted_text("chatml", out) == [("Hi there", 1.0)]


# -- character spans and content parts ------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_axolotl_spans(family):
    # "Keep this. Drop this." : characters 0..9 ("Keep this.") train, 11..20 ("Drop this.") do not (end inclusive)
    detail = [{"begin_offset": 0, "end_offset": 9, "train": True}, {"begin_offset": 11, "end_offset": 20, "train": False}]
    out, _ = label(family, [chat("Hi there", "Keep this. Drop this.", train_detail=detail)])
    text = weighted_text(family, out)
    assert text[0][0].startswith(BEFORE[family] + "Keep this.") and "Drop" not in text[0][0]
    assert text[-1] == (STOP[family], 1.0)  # the stop token keeps the message's weight


def test_span_weight_and_straddling_token_takes_the_lower():
    # a span that ends inside the token "answer" (characters 4..6 of "the answer"): that token takes 0.2 (the spans
    # around it train the rest: characters no span covers would not)
    detail = [{"begin_offset": 0, "end_offset": 3, "train": True}, {"begin_offset": 4, "end_offset": 6, "weight": 0.2},
              {"begin_offset": 7, "end_offset": 9, "train": True}]
    out, _ = label("chatml", [chat("Hi there", "the answer", train_detail=detail)])
    assert weighted_text("chatml", out) == [("the", 1.0), ("answer", 0.2), ("<|im_end|>", 1.0)]


@pytest.mark.parametrize("family", FAMILIES)  # gemma-3 and mistral-v3 take parts; the others' are joined first
def test_content_parts_with_train(family):
    parts = [{"type": "text", "text": "Step one.", "train": False}, {"type": "text", "text": "Step two.", "weight": 0.5}]
    out, _ = label(family, [[{"role": "user", "content": [{"type": "text", "text": "Go"}]},
                             {"role": "assistant", "content": parts}]])
    text = weighted_text(family, out)
    assert ("Step two.", 0.5) in text and all("one" not in t for t, _ in text)
    assert text[-1] == (STOP[family], 1.0)


# -- stop tokens -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_train_on_eos(family):
    rows = [chat("Hi there", "First answer", "And then?", "Second answer")]
    first = ("<|channel|>final<|message|>" if family == "gpt-oss" else "") + "First answer"
    out, _ = label(family, rows, train_on_eos="none")
    assert weighted_text(family, out) == [(first, 1.0), (BEFORE[family] + "Second answer", 1.0)]
    out, _ = label(family, rows, train_on_eos="last")
    assert weighted_text(family, out) == [(first, 1.0), last_turn(family, "Second answer")]


def test_train_on_eos_all_trains_stop_tokens_after_user_turns():
    out, _ = label("chatml", [chat("Hi there", "Answer")], train_on_eos="all")
    assert weighted_text("chatml", out) == [("<|im_end|>", 1.0), ("Answer<|im_end|>", 1.0)]


# -- reasoning ---------------------------------------------------------------------------------------------------

def reasoning_chat(key="reasoning_content"):
    return [{"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": "Hello back", key: "They greet me."}]


def test_gpt_oss_trains_the_header_between_analysis_and_final():
    out, _ = label("gpt-oss", [reasoning_chat("thinking")])
    assert weighted_text("gpt-oss", out) == [(
        "<|channel|>analysis<|message|>They greet me.<|end|><|start|>assistant<|channel|>final<|message|>Hello back"
        "<|return|>", 1.0)]


@pytest.mark.parametrize("family,think", [
    ("qwen3", "<think>\nThey greet me.\n</think>\n\n"),
    ("gpt-oss", "<|channel|>analysis<|message|>They greet me.<|end|><|start|>assistant<|channel|>final<|message|>"),
])
def test_reasoning_policy(family, think):
    out, _ = label(family, [reasoning_chat()], reasoning="mask")
    assert weighted_text(family, out) == [(f"Hello back{STOP[family]}", 1.0)]
    out, _ = label(family, [reasoning_chat()], reasoning=0.3)
    assert weighted_text(family, out) == [(think, 0.3), (f"Hello back{STOP[family]}", 1.0)]
    out, _ = label(family, [reasoning_chat()])
    assert weighted_text(family, out) == [(think + f"Hello back{STOP[family]}", 1.0)]


def test_mask_empty_think():
    out, _ = label("qwen3", [chat("Hi there", "Hello back")], mask_empty_think=True)
    assert weighted_text("qwen3", out) == [("Hello back<|im_end|>", 1.0)]
    out, _ = label("qwen3", [reasoning_chat()], mask_empty_think=True)  # a block with reasoning stays
    assert weighted_text("qwen3", out)[0][0].startswith("<think>\nThey greet me.")


# -- pre-tokenised ids -------------------------------------------------------------------------------------------

def test_input_ids_take_marker_level_choices_only():
    markers, _ = detected_markers("chatml")
    tok = chat_tokenizer("chatml")
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n")
    table = pa.table({"input_ids": pa.array([ids], pa.list_(pa.int32()))})
    out = mask_batch(table, markers, MaskOptions(prompt_weight=0.1, train_on_eos="none"), Tally())
    weights = out["loss_weights"][0].as_py()
    trained = [i for i, w in zip(ids, weights) if w == 1.0]
    assert tok.decode(trained) == "Yo"
    # every token but "Yo" (1.0) and its <|im_end|> (0: train_on_eos="none" claims it) takes the prompt weight
    assert sum(w == np.float32(0.1) for w in weights) == len(ids) - len(trained) - 1
    with pytest.raises(ValueError, match="carry none"):
        mask_batch(table, markers, MaskOptions(roles_to_train=["user"]), Tally())


# -- options -----------------------------------------------------------------------------------------------------

def test_options_checked():
    with pytest.raises(ValueError, match="train_on_eos"):
        MaskOptions(train_on_eos="sometimes")
    with pytest.raises(ValueError, match="prompt_weight"):
        MaskOptions(prompt_weight=-1)
    with pytest.raises(ValueError, match="reasoning"):
        MaskOptions(reasoning="skip")
    assert MaskOptions(weights_by_role="assistant=1,user=0.1").role_weights() == {"assistant": 1.0, "user": 0.1}
    assert MaskOptions(roles_to_train="user").role_weights() == {"user": 1.0, "assistant": 0.0}


def test_cli_documents_every_weight_flag():
    from lossmask.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["mask"].format_help()
    for flag in ("--roles-to-train", "--weights-by-role", "--weight-field", "--detail-field", "--prompt-weight",
                 "--train-on-eos", "--reasoning", "--mask-empty-think", "--loss-weights", "--source-column"):
        assert flag in text


# -- every path: files, Hugging Face datasets, Ray ------------------------------------------------------------------

ROWS = [
    {"messages": chat("Hi there", "First answer", "And then?", "Second answer", loss_scale=0.5), "dataset": "a"},
    {"messages": chat("Hello", "Answer"), "dataset": "b"},
]


def test_parquet_round_trip_and_report(tmp_path):
    from lossmask import mask_files
    from conftest import tokenizer_path

    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    report = mask_files(str(src), str(tmp_path / "out.parquet"), tokenizer=str(tokenizer_path("chatml")),
                        source_column="dataset", progress=False)
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.schema.field("loss_weights").type == pa.list_(pa.float32())
    out, _ = label("chatml", [r["messages"] for r in ROWS])
    assert table["loss_weights"].to_pylist() == out["loss_weights"].to_pylist()
    assert table["labels"].to_pylist() == out["labels"].to_pylist()
    assert set(report.weights_by_source) == {"a", "b"}
    assert report.weights_by_source["a"]["rows"] == 1
    assert report.weights_by_role["assistant"]["tokens"] == report.tokens_trained
    assert "weights_by_source" in report.to_dict()


def test_hf_round_trip():
    datasets = pytest.importorskip("datasets")
    from lossmask import hf
    from conftest import tokenizer_path

    ds = datasets.Dataset.from_list(ROWS)
    masked = hf.mask_dataset(ds, str(tokenizer_path("chatml")), loss_weights=True)
    out, _ = label("chatml", [r["messages"] for r in ROWS])
    assert masked["loss_weights"] == [[pytest.approx(w) for w in row] for row in out["loss_weights"].to_pylist()]
    assert masked["labels"] == out["labels"].to_pylist()


def test_ray_round_trip(local_ray):
    ray = local_ray
    from lossmask import ray as lossmask_ray
    from conftest import tokenizer_path

    ds = ray.data.from_items(ROWS)
    masked, report = lossmask_ray.mask_dataset(ds, tokenizer=str(tokenizer_path("chatml")), source_column="dataset")
    assert set(report.weights_by_source) == {"a", "b"}
    rows = sorted(masked.take_all(), key=lambda r: r["dataset"])
    out, _ = label("chatml", [r["messages"] for r in ROWS])
    expected = out["loss_weights"].to_pylist()
    assert [list(np.asarray(r["loss_weights"], dtype=np.float32)) for r in rows] == \
        [list(np.asarray(w, dtype=np.float32)) for w in expected]


def test_jsonl_in_many_batches_writes_one_schema(tmp_path):
    from lossmask import mask_files
    from conftest import tokenizer_path

    rows = [{"messages": chat("Hi there", f"Answer {k}")} for k in range(5)]
    rows.append({"messages": chat("Hi there", "Last answer", loss_scale=0.5)})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    mask_files(str(src), str(tmp_path / "out.parquet"), tokenizer=str(tokenizer_path("chatml")), batch_size=2,
               progress=False)
    weights = pq.read_table(tmp_path / "out.parquet")["loss_weights"].to_pylist()
    assert {w for row in weights[:5] for w in row} == {0.0, 1.0} and 0.5 in weights[5]


def test_a_fraction_where_no_column_was_promised_is_an_error():
    markers, _ = detected_markers("chatml")
    table = pa.table({"messages": [chat("Hi there", "Answer", loss_scale=0.5)]})
    with pytest.raises(ValueError, match="loss_weights=True"):
        mask_batch(table, markers, MaskOptions(), Tally(), tokenizer=chat_tokenizer("chatml"), write_weights=False)


# -- the per-token kernels against their NumPy references ----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), max_size=7), seed=st.integers(0, 2**32 - 1),
       prompt=st.sampled_from([0.0, 0.05, 1.0]), with_never=st.booleans())
def test_weight_row_kernels_equal_their_references(lengths, seed, prompt, with_never):
    from lossmask.engine.kernels import weight_rows as k

    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if lengths.size else lengths
    n = int(lengths.sum())
    ids = rng.integers(0, 50, n).astype(np.int32)
    labels = np.where(rng.random(n) < 0.5, ids, -100).astype(np.int64)
    uniform = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], dtype=np.float32), lengths.shape[0])
    got = k.start_weights(labels, np.int64(-100), uniform, starts, lengths)
    want = k.reference_start(labels, np.int64(-100), uniform, starts, lengths)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    weights, role = got
    extra = rng.random(n) < 0.2  # what exact rows and the stop policy leave: other roles, other weights
    role[extra] = rng.integers(0, 5, int(extra.sum()))
    weights[extra] = rng.choice(np.array([0.0, 0.3, 1.0], dtype=np.float32), int(extra.sum()))
    never = rng.random(n) < 0.1 if with_never else np.zeros(0, dtype=bool)
    w1, r1, o1 = weights.copy(), role.copy(), np.empty(n, np.int64)
    w2, r2, o2 = weights.copy(), role.copy(), np.empty(n, np.int64)
    got = k.finish_weights(w1, r1, labels, np.int64(-100), ids, starts, lengths, np.float32(prompt), never, 6, o1)
    want = k.reference_finish(w2, r2, labels, np.int64(-100), ids, starts, lengths, np.float32(prompt), never, 6, o2)
    np.testing.assert_array_equal(w1, w2)
    np.testing.assert_array_equal(r1, r2)
    np.testing.assert_array_equal(o1, o2)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), rtol=1e-6)


@st.composite
def exact_batches(draw):
    """A batch of exact rows as ``engine/weights`` hands them to ``weigh_exact``: tokens with character spans (some
    empty), marker runs, and plans with messages of three roles, sorted disjoint pieces, segments and leads."""
    from lossmask.chat.encode_rendered import PlannedWeights
    from lossmask.chat.weights import RowPlan

    n_rows = draw(st.integers(1, 4))
    plans, lengths, starts, ends, runs = [], [], [], [], []
    for _ in range(n_rows):
        sizes = draw(st.lists(st.integers(0, 4), max_size=14))
        cs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64) if sizes else np.zeros(0, np.int64)
        ce = cs + np.asarray(sizes, dtype=np.int64)
        chars = int(ce[-1]) if sizes else 0
        roles = draw(st.lists(st.sampled_from(["assistant", "assistant", "user", "system"]), min_size=1, max_size=4))
        weights = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=len(roles), max_size=len(roles)))
        cuts = sorted(draw(st.lists(st.integers(0, chars + 1), max_size=8)))
        pieces = [(a, b, draw(st.integers(0, len(roles) - 1)), draw(st.booleans()))
                  for a, b in zip(cuts[::2], cuts[1::2]) if b > a]
        segments = []
        for _ in range(draw(st.integers(0, 3))):
            m = draw(st.integers(0, len(roles) - 1))
            a = draw(st.integers(0, chars + 1))
            segments.append((a, a + draw(st.integers(0, 4)), draw(st.sampled_from([0.0, 0.3, 1.0])), m,
                             roles[m] == "assistant"))
        leads = [(m, draw(st.integers(0, chars + 1)), draw(st.sampled_from([0.0, 0.25, 3.0])))
                 for m in range(len(roles)) if roles[m] == "assistant" and draw(st.booleans())]
        plans.append(RowPlan(uniform=1.0, exact=True, weights=weights, roles=roles, pieces=pieces,
                             segments=segments, leads=leads))
        lengths.append(len(sizes))
        starts.append(cs)
        ends.append(ce)
        runs.append(draw(st.lists(st.sampled_from([True, True, False]), min_size=len(sizes), max_size=len(sizes))))
    planned = PlannedWeights(plans, np.arange(n_rows, dtype=np.int64), np.concatenate(starts), np.concatenate(ends))
    return planned, np.asarray(lengths, dtype=np.int64), np.asarray([t for row in runs for t in row], dtype=bool)


@settings(max_examples=500, deadline=None)
@given(batch=exact_batches(), uniform=st.sampled_from([0.5, 1.0]))
def test_exact_rows_kernel_equals_its_numpy_reference(batch, uniform):
    """``weigh_exact`` (through ``_weigh_exact``) against ``_weigh_exact_numpy``, on batches no template wrote:
    runs that straddle pieces, pieces of no assistant, segments across token edges, leads inside tokens. Then the
    whole of ``weigh_tokens`` (the one kernel call a job makes, ``weigh_batch``) against its NumPy reference on them."""
    from lossmask.engine import weights as engine_weights

    planned, lengths, in_run = batch
    row_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    weights = np.where(in_run, np.float32(uniform), np.float32(0)).astype(np.float32)
    role = in_run.astype(np.int16)
    names_got, names_want = list(engine_weights.ROLE_NAMES), list(engine_weights.ROLE_NAMES)
    got = [in_run.copy(), weights.copy(), role.copy()]
    want = [in_run.copy(), weights.copy(), role.copy()]
    engine_weights._weigh_exact(planned, lengths, row_starts, *got, names_got)
    engine_weights._weigh_exact_numpy(planned, lengths, row_starts, *want, names_want)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert [names_got[c] for c in got[2]] == [names_want[c] for c in want[2]]
    for plan in planned.plans:
        plan.uniform = uniform
    ids = np.arange(in_run.shape[0], dtype=np.int32)
    labels = np.where(in_run, ids, -100).astype(np.int64)
    options = MaskOptions()
    fused = engine_weights.weigh_tokens(ids, lengths, labels, -100, planned, [], options)
    stepwise = engine_weights._weigh_tokens_numpy(ids, lengths, labels, -100, planned, [], options)
    np.testing.assert_array_equal(fused.weights, stepwise.weights)
    np.testing.assert_array_equal(fused.labels, stepwise.labels)
    assert [fused.names[c] for c in fused.role] == [stepwise.names[c] for c in stepwise.role]
    np.testing.assert_array_equal(fused.row_tokens, stepwise.row_tokens)


def test_collection_paused_while_locating_and_restored():
    """gc_pause: nested and concurrent pauses give collection back once, and only if it was on before."""
    import gc
    import threading

    from lossmask.chat.gc_pause import paused_collection

    assert gc.isenabled()
    with paused_collection():
        assert not gc.isenabled()
        seen = []

        def other_thread():
            with paused_collection():
                seen.append(gc.isenabled())

        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert seen == [False] and not gc.isenabled()  # the other thread's pause ended; this one's has not
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_collection():
            pass
        assert not gc.isenabled()  # it was off: it stays off
    finally:
        gc.enable()


def test_reasoning_policy_leaves_a_turn_without_reasoning_alone():
    """reasoning='mask' masks the reasoning of the turns that have it; another turn of the row (here one whose
    reasoning the template dropped) and another exact row of the batch train as they would without the policy."""
    first = [{"role": "user", "content": "Is 7 prime?"},
             {"role": "assistant", "content": "Yes.", "reasoning_content": "It has no divisors."},
             {"role": "user", "content": "And 9?"},
             {"role": "assistant", "content": "No, 3 x 3.", "reasoning_content": "Three times three."}]
    second = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Draft", "weight": 0},
              {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Final"}]
    out, _ = label("qwen3", [first, second], reasoning="mask")
    assert weighted_text("qwen3", out, 0) == [("Yes.<|im_end|>", 1.0), ("No, 3 x 3.<|im_end|>", 1.0)]
    assert weighted_text("qwen3", out, 1) == [(BEFORE["qwen3"] + "Final<|im_end|>", 1.0)]
